"""Tiny Hugging Face models built from their config classes (no download, no dropout, so a
pipelined run and the unsplit model draw no random numbers and must agree to float rounding).

GPT-2 (learned positions, output tied to the embedding), Llama (RoPE, grouped-query attention),
Mistral (RoPE and a sliding window shorter than the sequence) and T5 (encoder-decoder, relative
position bias shared across layers, tied output). Each is called positionally with tensors, as
a pipeline's first stage takes them: ``model(*inputs)``; ``loss_fn(output, target)`` reads the
logits of the model's own output.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAMES = ("gpt2", "llama", "mistral", "t5")
VOCAB = 64
SEQ = 8


def build(name: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        cfg: Any = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=4, n_head=2,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                           bos_token_id=0, eos_token_id=0)
        cls: Any = transformers.GPT2LMHeadModel
    elif name in ("llama", "mistral"):
        common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if name == "llama":
            cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
        else:
            cfg, cls = transformers.MistralConfig(**common, sliding_window=4), transformers.MistralForCausalLM
    elif name == "t5":
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                                    num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                                    eos_token_id=1)
        cls = transformers.T5ForConditionalGeneration
    else:
        raise ValueError(f"unknown model {name!r}; one of {NAMES}")
    torch.manual_seed(seed)
    return cls(cfg)


def batch(name: str, size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Positional inputs and the target (next-token ids) of one batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    if name == "t5":
        mask = torch.ones(size, SEQ, dtype=torch.long)
        decoder_ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
        return (ids, mask, decoder_ids), target
    return (ids,), target


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
