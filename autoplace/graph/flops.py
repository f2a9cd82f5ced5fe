"""FLOP counting for the tracer: torch.utils.flop_counter plus the CPU kernels it misses.

``torch.utils.flop_counter.FlopCounterMode`` counts matrix products, convolutions and the
CUDA attention kernels at the ATen dispatch level. On a CPU (and under a fake CPU tensor,
which is how :mod:`autoplace.graph.trace` propagates shapes) two important ops dispatch to
kernels it has no formula for, so they would count 0:

- ``scaled_dot_product_attention`` runs ``aten._scaled_dot_product_flash_attention_for_cpu``
  (and its ``_backward``). We reuse the library's own SDPA formulas: forward
  ``4 * b * h * s_q * s_k * d`` (two batched matmuls, ``Q K^T`` and ``P V``), backward
  ``2.5x`` that (five matmuls of the same size when the library recomputes the scores; the
  formula is the library's, not ours). A causal mask does not halve the count, as in the
  library's CUDA formulas.
- ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` run ``aten.mkldnn_rnn_layer`` (one call per layer and
  direction) and ``aten.mkldnn_rnn_layer_backward``. Forward: the input and recurrent
  matmuls, ``2 * T * B * G * (I + H)`` with ``G`` the gate rows of the weights (4H for an
  LSTM, 3H for a GRU, H for a plain RNN); the gate nonlinearities are elementwise and
  uncounted, as everywhere in FlopCounterMode. Backward: twice the forward (gradients of the
  inputs and of the weights), the same convention as the library's ``mm`` backward.

One library formula is replaced: ``aten.convolution_backward``'s weight gradient is counted by
the library as a dense convolution whatever ``groups`` is, so a depthwise convolution's backward
came out ``groups`` times too large (NASNet's backward at 10x its forward). Each gradient the
op computes (input, weight: ``output_mask``) costs what the forward costs,
``2 * N * prod(out spatial) * C_out * (C_in / groups) * prod(kernel)``, the convention of the
library's dense formula.

:func:`flop_counter` returns a ``FlopCounterMode`` with these formulas added. Use it for any
count that should agree with :attr:`OpGraph.fwd_flops` (for example a whole-model reference).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["CUSTOM_FLOP_FORMULAS", "flop_counter", "rnn_layer_flops"]

_Shape = tuple[int, ...]
aten = torch.ops.aten


def rnn_layer_flops(input_shape: _Shape, w_ih_shape: _Shape, w_hh_shape: _Shape) -> int:
    """Matmul FLOPs of one RNN layer in one direction: ``2 * T * B * (G*I + G*H)``.

    ``input_shape`` is ``(T, B, I)``, ``(B, T, I)``, ``(T, I)`` unbatched or ``(sum T, I)``
    packed: every dimension but the last counts time steps times batch.
    ``w_ih_shape = (G, I)`` and ``w_hh_shape = (G, H)``.
    """
    steps_and_batch = 1
    for s in input_shape[:-1]:
        steps_and_batch *= int(s)
    g_i = int(w_ih_shape[0]) * int(w_ih_shape[1])
    g_h = int(w_hh_shape[0]) * int(w_hh_shape[1])
    return 2 * steps_and_batch * (g_i + g_h)


def _sdpa_cpu_flop(query: _Shape, key: _Shape, value: _Shape, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, key, value))


def _sdpa_cpu_backward_flop(grad_out: _Shape, query: _Shape, key: _Shape, value: _Shape, *args: Any,
                            out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


def _mkldnn_rnn_flop(input: _Shape, weight0: _Shape, weight1: _Shape, *args: Any, out_shape: Any = None,
                     **kwargs: Any) -> int:
    # schema: (input, weight0 = w_ih, weight1 = w_hh, weight2, weight3, hx_, cx_, reverse, ...)
    return rnn_layer_flops(input, weight0, weight1)


def _mkldnn_rnn_backward_flop(input: _Shape, weight1: _Shape, weight2: _Shape, *args: Any, out_shape: Any = None,
                              **kwargs: Any) -> int:
    # schema: (input, weight1 = w_ih, weight2 = w_hh, ...): input and weight gradients, 2x forward.
    return 2 * rnn_layer_flops(input, weight1, weight2)


def _conv_backward_flop(grad_out: _Shape, x: _Shape, w: _Shape, _bias: Any, _stride: Any, _padding: Any,
                        _dilation: Any, transposed: bool, _output_padding: Any, _groups: Any,
                        output_mask: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # The forward count of this convolution (w carries C_in / groups, so grouped and depthwise
    # convolutions come out right), once per gradient asked for (input and weight).
    fwd = conv_flop_count(list(x), list(w), list(grad_out), transposed=bool(transposed))
    return int(fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1]))))


CUSTOM_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten.convolution_backward: _conv_backward_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    aten.mkldnn_rnn_layer: _mkldnn_rnn_flop,
    aten.mkldnn_rnn_layer_backward: _mkldnn_rnn_backward_flop,
}
"""ATen ops (overload packets) -> FLOP formula over argument shapes, added to the library's."""


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: every count goes to "Global" only.

    The tracker's backward hooks break ``torch.autograd.grad`` on leaf tensors (which is how
    the tracer counts one node's backward), and per-module tables are not needed here.
    """

    parents = frozenset({"Global"})

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts CPU attention and CPU RNN kernels and
    keeps only the global total (``get_total_flops()``; no per-module table)."""
    counter = FlopCounterMode(display=False, custom_mapping=dict(CUSTOM_FLOP_FORMULAS))
    counter.mod_tracker = _GlobalOnly()  # type: ignore[assignment]
    return counter
