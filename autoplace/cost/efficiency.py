"""Tensor-core efficiency that depends on the op's shape, its precision and the GPU generation.

The roofline (:mod:`autoplace.cost.analytic`) divides an op's FLOPs by ``peak * efficiency``.
In 16 bits on a GPU kind listed in :data:`TENSOR_CORE_KINDS`, the efficiency of a GEMM
("matmul" class) and of fused attention ("attention" class) comes from here instead of one
constant per class. Two constants are fitted (below, with their fit part); the rest comes from
the named public measurements.

GEMM (an ``M x K`` by ``K x N`` product, ``M`` the tokens of the micro-batch)::

    e = MAMF(kind) * useful(M, N) ,  useful = M N / (waves * SMs * tm * tn)

- ``MAMF(kind)``: the maximum achievable bf16 matmul FLOP/s over the tensor-core peak, the
  best of a grid of shapes measured with mamf-finder.py (S. Bekman, ml-engineering,
  compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table": A100 SXM
  271.2 of 312 TFLOPS, H100 SXM 794.5 of 989). The per-generation ceiling.
- ``useful``: tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's
  Guide", DU-09799-001, sections 2.3 and 3): cuBLAS covers the ``M x N`` output with
  ``tm x tn`` tiles, one tile per SM at a time, so ``tiles = ceil(M/tm) ceil(N/tn)`` run in
  ``waves = ceil(tiles / SMs)`` and the last wave and the tiles' edges idle. The guide's
  largest tiles (256 x 128, either way round, and 128 x 128) are tried and the best kept
  (cuBLAS's heuristics choose a tile per shape). SMs: 108 (A100), 132 (H100 SXM5), NVIDIA's
  architecture whitepapers. The roofline's memory term still bounds GEMMs with a small
  dimension, so no extra small-``K`` term is added.
- Backward: the input gradient (``M x N`` by ``N x K``: output ``M x K``) and the weight
  gradient (output ``N x K``, reduced over ``M``) take half the backward FLOPs each; their
  times add (a harmonic mean of their efficiencies). A batched product of two activations
  (``bmm``, ``baddbmm``: unfused attention's scores and context) has one such output per batch,
  so both gradients fill the waves over the batch like the forward.

In training, kernels do not run as in a microbenchmark: clocks drop under sustained load, and
launches, allocator and FSDP hooks sit between kernels. Two constants are fitted to training runs,
on a named part of the published rows (``benchmarks/fidelity_llm.py --fit``: MosaicML
llm-foundry's H100 rows) and reported on the rest (MosaicML's A100 rows, torchtitan, Megatron-LM):

- :data:`SUSTAINED_FRACTION` multiplies both efficiencies above;
- :data:`SIZE_HALF_TOKENS`, ``M0``: a GEMM's efficiency is further multiplied by ``M / (M + M0)``,
  a saturating size term in the micro-batch's tokens. It stands for costs paid per micro-batch
  in proportion to the weights (time of ``M0`` extra rows of every GEMM): per-micro-batch weight
  gathers, casts and gradient accumulation around the kernels, which the simulator does not
  charge separately -- not for cuBLAS's own size curve, which the wave term covers. This term was
  added after a first fit (``SUSTAINED_FRACTION`` alone) had been reported on every row, so the
  held-out rows were seen when its form was chosen; its value is fitted on the fit part only.
  It is FSDP-motivated (every fit row is FSDP). The cost model applies it to every 16-bit GEMM;
  the simulator takes it back out for every pipeline stage that is not sharded, with options or
  without (:func:`autoplace.sim.stage_ops.resident_ratio`: weights resident, nothing gathered or
  cast per micro-batch, as Megatron-LM's DDP/TP/PP runs). That choice was made after the held-out
  Megatron-LM rows had been seen at 1-2 samples a micro-batch (their GEMMs at half efficiency);
  no value was fitted on them. Model-parallel plans (one process) still pay it.

Shapes are read back from the graph's facts (fp32 as traced): a Linear has ``N K`` weights
(``param_bytes / 4``), ``2 M N K`` forward FLOPs and ``M N`` outputs; a matmul without
weights (a tied LM head) has an ``M x K`` activation input (``M = outputs x inputs / (M N K)``,
preferred when both agree within 5%: a bias skews the weight count). Where no consistent
integer shape comes out, ``useful`` is 1 (the MAMF ceiling alone).

Attention (fused, FlashAttention-2: the kernel of PyTorch's SDPA on A100/H100; the Triton kernel
of the same figures is close to it): measured TFLOP/s by sequence
length, head dimension 128, on H100 SXM5 (Shah et al., "FlashAttention-3", 2024, Figures 5
and 6: forward without and with causal mask, backward without). The sequence length is read
back as ``fwd_flops / (4 * outputs)`` (the library's count ``4 b h s^2 d``). The traced count
ignores a causal mask (:mod:`autoplace.graph.flops`); a causal kernel does half that work,
at the causal rates (forward measured; backward: the non-causal backward times the forward's
causal/non-causal ratio at the same length, an assumption). A100: no per-length table was
readable here; the H100 curves are scaled so that the long-sequence forward is 73% of the
A100 peak, the top of FlashAttention-2's "50-73% of the theoretical maximum FLOPs/s on A100"
(Dao, 2023, abstract) -- the curve's shape is the H100's, an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..graph.kinds import kind_class

if TYPE_CHECKING:
    from ..cluster import Device
    from ..graph.ir import OpGraph

__all__ = ["TensorCoreKind", "TENSOR_CORE_KINDS", "BATCHED_GEMMS", "FA2_SEQ", "SUSTAINED_FRACTION", "SIZE_HALF_TOKENS", "gemm_shapes",
           "gemm_efficiency", "attention_seq", "attention_efficiency", "tensor_core_efficiencies"]

FA2_SEQ = np.array([512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0])
"""Sequence lengths of the FlashAttention-3 paper's H100 figures."""
_FA2_H100_FWD = np.array([309.0, 350.0, 362.0, 368.0, 370.0, 370.0])          # TFLOP/s, no mask
_FA2_H100_FWD_CAUSAL = np.array([191.0, 260.0, 298.0, 319.0, 333.0, 335.0])   # TFLOP/s, causal count
_FA2_H100_BWD = np.array([214.0, 260.0, 291.0, 310.0, 318.0, 322.0])          # TFLOP/s, no mask
SUSTAINED_FRACTION = 0.84
"""Achieved in training over the microbenchmark efficiency, for GEMMs and attention alike: fitted
with :data:`SIZE_HALF_TOKENS` (least mean |log(predicted / measured)| over a grid, 0.50-1.00 by
0.02 x 0-4096 tokens) on MosaicML llm-foundry's 21 H100 rows by ``benchmarks/fidelity_llm.py
--fit``; ``CostModel(tensor_sustained=...)`` overrides it."""
SIZE_HALF_TOKENS = 2048.0
"""``M0`` of the saturating size term (tokens of a micro-batch at which a GEMM reaches half its
efficiency): fitted with :data:`SUSTAINED_FRACTION` on the same rows by the same command."""
BATCHED_GEMMS = frozenset({"bmm", "baddbmm"})
"""Op kinds that are batched products of two activations (torch's 3-D ``bmm``/``baddbmm``)."""
_TILES = ((256, 128), (128, 256), (128, 128))
"""cuBLAS tile shapes (output rows x columns) tried per GEMM (NVIDIA's guide, section 2.3)."""


@dataclass(frozen=True)
class TensorCoreKind:
    """What one GPU generation reaches on its 16-bit tensor cores."""

    peak_tflops: float
    """dense bf16 tensor-core peak the figures below are fractions of."""
    sms: int
    """streaming multiprocessors (one GEMM tile each per wave)."""
    mamf: float
    """maximum achievable bf16 matmul FLOP/s over the peak (mamf-finder.py, best shape)."""
    attn_scale: float
    """this kind's FlashAttention-2 TFLOP/s over the H100 SXM5's at the same length and mask."""


TENSOR_CORE_KINDS: dict[str, TensorCoreKind] = {
    "A100-40GB": TensorCoreKind(312.0, 108, 271.2 / 312, 0.73 * 312 / 370),
    "A100-80GB": TensorCoreKind(312.0, 108, 271.2 / 312, 0.73 * 312 / 370),
    "H100": TensorCoreKind(989.0, 132, 794.5 / 989, 1.0),
    # H200 SXM: the H100's SMs, clocks and tensor cores (NVIDIA datasheet); measured as an H100 here.
    "H200": TensorCoreKind(989.0, 132, 794.5 / 989, 1.0),
}
"""GPU kinds (``Device.kind``) with a shape-dependent 16-bit efficiency; others keep the class constants."""


# ---- shapes --------------------------------------------------------------------------------

def gemm_shapes(graph: "OpGraph") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(M, N, K) of every "matmul"-class op at the graph's batch (NaN where not a matmul or
    not consistent): Linear from weights, FLOPs and outputs; weightless from its inputs."""
    n = graph.num_nodes
    is_mm = np.array([kind_class(k) == "matmul" for k in graph.kinds], dtype=bool)
    f = np.asarray(graph.fwd_flops, dtype=np.float64) / 2.0      # M N K
    out = np.asarray(graph.out_bytes, dtype=np.float64) / 4.0    # M N
    w = np.asarray(graph.param_bytes, dtype=np.float64) / 4.0    # N K (+ N of a bias)
    inp = np.zeros(n)
    if graph.num_edges:
        np.add.at(inp, graph.edges[:, 1], graph.edge_bytes)
    inp /= 4.0                                                   # M K when one activation input
    with np.errstate(divide="ignore", invalid="ignore"):
        m_act = out * inp / f  # exact for one M x K activation input
        m_w = f / w            # exact without a bias (a bias of N adds 1/K)
        agree = np.abs(m_act / m_w - 1.0) < 0.05
        m = np.rint(np.where(w > 0, np.where(agree, m_act, m_w), m_act))
        nn = np.rint(out / m)
        k = np.rint(f / (m * nn))
    ok = is_mm & (f > 0) & np.isfinite(m) & np.isfinite(nn) & np.isfinite(k) & (m >= 1) & (nn >= 1) & (k >= 1)
    nan = np.full(n, np.nan)
    return np.where(ok, m, nan), np.where(ok, nn, nan), np.where(ok, k, nan)


def attention_seq(graph: "OpGraph") -> np.ndarray:
    """Sequence length of every "attention"-class op (``fwd_flops / (4 * outputs)``; NaN elsewhere)."""
    is_at = np.array([kind_class(k) == "attention" for k in graph.kinds], dtype=bool)
    out = np.asarray(graph.out_bytes, dtype=np.float64) / 4.0
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.asarray(graph.fwd_flops, dtype=np.float64) / (4.0 * out)
    return np.where(is_at & np.isfinite(s) & (s >= 1), s, np.nan)


# ---- efficiencies --------------------------------------------------------------------------

def _useful(rows: np.ndarray, cols: np.ndarray, sms: int) -> np.ndarray:
    """Fraction of the tiles' SM time doing useful work, best over :data:`_TILES` (1 where NaN)."""
    best = np.zeros_like(rows)
    for tm, tn in _TILES:
        tiles = np.ceil(rows / tm) * np.ceil(cols / tn)
        waves = np.ceil(tiles / sms)
        best = np.maximum(best, rows * cols / (waves * sms * tm * tn))
    return np.where(np.isfinite(best), np.minimum(best, 1.0), 1.0)


def gemm_efficiency(m: np.ndarray, n: np.ndarray, k: np.ndarray, kind: TensorCoreKind,
                    batched: np.ndarray | bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) fraction of the tensor-core peak of GEMMs of shape (M, N, K).
    ``batched``: a batched product of two activations (``bmm``, ``baddbmm``; M counts the rows of
    every batch), whose second operand's gradient is one ``K x N`` output per batch, so its tiles
    fill the waves as the forward's ``M`` rows do (``useful(M, N)``), not one ``N x K`` matrix."""
    m, n, k = (np.asarray(a, dtype=np.float64) for a in (m, n, k))
    fwd = kind.mamf * _useful(m, n, kind.sms)
    dgrad = kind.mamf * _useful(m, k, kind.sms)
    wgrad = kind.mamf * np.where(batched, _useful(m, n, kind.sms), _useful(n, k, kind.sms))
    bwd = 2.0 / (1.0 / dgrad + 1.0 / wgrad)
    return fwd, bwd


def attention_efficiency(seq: np.ndarray, kind: TensorCoreKind, *, causal: bool
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) FLOPs counted as traced (no mask) per second over the peak, for
    FlashAttention-2 at sequence length ``seq`` (log-linear between the measured lengths,
    held constant outside them); with ``causal`` the kernel does half the counted work."""
    x = np.log2(np.clip(np.asarray(seq, dtype=np.float64), FA2_SEQ[0], FA2_SEQ[-1]))
    xp = np.log2(FA2_SEQ)
    fwd = np.interp(x, xp, _FA2_H100_FWD)
    bwd = np.interp(x, xp, _FA2_H100_BWD)
    if causal:
        ratio = np.interp(x, xp, _FA2_H100_FWD_CAUSAL / _FA2_H100_FWD)
        fwd, bwd = 2.0 * fwd * ratio, 2.0 * bwd * ratio  # half the counted FLOPs at the causal rate
    s = kind.attn_scale / kind.peak_tflops
    return fwd * s, bwd * s


def tensor_core_efficiencies(graph: "OpGraph", devices: Sequence["Device"], base: np.ndarray, *,
                             batch_fraction: float = 1.0, causal: bool = True,
                             sustained: float = SUSTAINED_FRACTION, size_half: float = SIZE_HALF_TOKENS
                             ) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) forward and backward efficiencies in 16 bits: ``base`` (N,) where the op is not a
    GEMM or attention or the device kind is not in :data:`TENSOR_CORE_KINDS`; the shape's
    efficiency where it is, with the GEMMs' ``M`` at ``batch_fraction`` of the graph's batch,
    times ``sustained`` (and a GEMM's times ``M / (M + size_half)``)."""
    base = np.asarray(base, dtype=np.float64)
    fwd = np.repeat(base[:, None], len(devices), axis=1)
    bwd = fwd.copy()
    m, n, k = gemm_shapes(graph)
    m = np.maximum(m * float(batch_fraction), 1.0)
    is_mm = ~np.isnan(n)
    is_mm_class = np.array([kind_class(kk) == "matmul" for kk in graph.kinds], dtype=bool)
    is_batched = np.array([kk in BATCHED_GEMMS for kk in graph.kinds], dtype=bool)
    seq = attention_seq(graph)
    is_at = ~np.isnan(seq)
    cache: dict[str, tuple[np.ndarray, ...]] = {}
    for j, d in enumerate(devices):
        spec = TENSOR_CORE_KINDS.get(d.kind)
        if spec is None:
            continue
        if d.kind not in cache:
            gf, gb = gemm_efficiency(np.where(is_mm, m, 1.0), np.where(is_mm, n, 1.0), np.where(is_mm, k, 1.0), spec,
                                     batched=is_batched)
            af, ab = attention_efficiency(np.where(is_at, seq, 2048.0), spec, causal=causal)
            size = m / (m + max(float(size_half), 0.0))
            cache[d.kind] = (gf * sustained * size, gb * sustained * size, af * sustained, ab * sustained)
        gf, gb, af, ab = cache[d.kind]
        # a matmul whose shape is not read back still gets the generation's ceiling
        ceiling = spec.mamf * sustained
        fwd[:, j] = np.where(is_mm, gf, np.where(is_mm_class, ceiling, fwd[:, j]))
        bwd[:, j] = np.where(is_mm, gb, np.where(is_mm_class, ceiling, bwd[:, j]))
        fwd[:, j] = np.where(is_at, af, fwd[:, j])
        bwd[:, j] = np.where(is_at, ab, bwd[:, j])
    return fwd, bwd
