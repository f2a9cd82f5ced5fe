"""Hugging Face KV caches as pytree nodes, so a traced model returns its cache like the model.

Hugging Face decoders return their keys and values in a cache object, ``DynamicCache`` for
causal models and ``EncoderDecoderCache`` (a self-attention and a cross-attention
``DynamicCache``) for seq2seq ones. torch.export flattens a model's output with
``torch.utils._pytree`` and fails on a type it does not know, so a traced model could only be
exported with ``use_cache=False``, and the wrapped model lost the cache field its user sees in
eager mode.

:func:`register_hf_caches` registers both types: ``DynamicCache`` through transformers' own
``register_dynamic_cache_export_support`` (what its export path calls), ``EncoderDecoderCache``
here, as the pair of its two caches. The registry is process-wide, so registering is done once,
only when transformers is already imported (the model is one of its), and never replaces a
registration made by someone else.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils._pytree import SUPPORTED_NODES, GetAttrKey, register_pytree_node

__all__ = ["register_hf_caches"]


def _flatten_encoder_decoder(cache: Any) -> tuple[list[Any], None]:
    return [cache.self_attention_cache, cache.cross_attention_cache], None


def _flatten_encoder_decoder_with_keys(cache: Any) -> tuple[list[tuple[Any, Any]], None]:
    return [(GetAttrKey("self_attention_cache"), cache.self_attention_cache),
            (GetAttrKey("cross_attention_cache"), cache.cross_attention_cache)], None


def _unflatten_encoder_decoder(children: Any, context: None) -> Any:
    from transformers.cache_utils import EncoderDecoderCache

    self_attention, cross_attention = children
    return EncoderDecoderCache(self_attention, cross_attention)


def register_hf_caches() -> bool:
    """Register transformers' DynamicCache and EncoderDecoderCache as pytree nodes (once).

    Returns whether DynamicCache is registered afterwards (False when transformers is not
    imported or this version offers no way to flatten it).
    """
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    except ImportError:
        return False
    if DynamicCache not in SUPPORTED_NODES:
        try:
            from transformers.integrations.executorch import register_dynamic_cache_export_support
        except ImportError:
            return False
        register_dynamic_cache_export_support()
    if DynamicCache not in SUPPORTED_NODES:
        return False
    if EncoderDecoderCache not in SUPPORTED_NODES:
        try:
            register_pytree_node(
                EncoderDecoderCache, _flatten_encoder_decoder, _unflatten_encoder_decoder,
                serialized_type_name=f"{EncoderDecoderCache.__module__}.{EncoderDecoderCache.__name__}",
                flatten_with_keys_fn=_flatten_encoder_decoder_with_keys)
        except ValueError as e:  # registered meanwhile by another caller
            if "already registered" not in str(e):
                raise
    return True
