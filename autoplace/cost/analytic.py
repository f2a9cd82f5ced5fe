"""The cost model: seconds per op per device, from measurements where they exist and from a
roofline estimate where they do not.

Roofline (Williams, Waterman and Patterson, CACM 2009), per op and device:

    t = max(flops / (peak_flops * e_compute[class]), bytes / (mem_bandwidth * e_memory)) + overhead

with ``bytes`` the op's parameters plus the activations it reads and writes, and ``class`` the
op's kind class (:mod:`autoplace.graph.kinds`). The graph's bytes are taken as traced in fp32;
a cost model that computes in 16 bits (``dtype_bytes=2``) charges every value an op reads or
writes at 2 bytes (:attr:`CostModel.value_scale`): with mixed precision the op reads 16-bit
copies of its weights and 16-bit activations (Micikevicius et al., "Mixed Precision Training",
ICLR 2018, section 3: fp16 weights, activations and gradients in the forward and backward, an
fp32 master copy for the update), so the update keeps fp32 traffic. Backward uses the graph's backward FLOPs and
twice the forward bytes (it reads the saved activations and the output gradient, writes the
input and weight gradients). A transfer costs ``latency + bytes / bandwidth`` (the cluster's).

Measured times (a PipeDream profile, or :mod:`autoplace.cost.profile`) win over the roofline
on the device kind they were measured on; on another kind they are scaled by the ratio of the
two kinds' fp32 peaks. ``batch_fraction`` < 1 (a pipeline micro-batch) scales the per-sample
work and keeps the per-op overhead and the parameter traffic: small micro-batches pay for it.

In 16 bits on a GPU kind with a measured tensor-core table (A100, H100, H200), GEMMs and fused
attention take a shape-dependent efficiency instead (``shape_efficiency``, on by default;
:mod:`autoplace.cost.efficiency` names its sources): the measured maximum matmul FLOP/s of the
generation times tile and wave quantization at the op's ``M x N`` (``M`` at the micro-batch),
and FlashAttention-2's measured rate at the op's sequence length, both times one fraction
reached in training (``tensor_sustained``) and a GEMM times a saturating size term in the
micro-batch's tokens (``tensor_size_half``), both fitted on a named part of published runs. fp32 times
never change.

:func:`autoplace.cost.calibrate.calibrate` fits ``e_compute`` per class to measured times.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..graph.kinds import CLASSES, kind_class
from .efficiency import SIZE_HALF_TOKENS, SUSTAINED_FRACTION, tensor_core_efficiencies

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["CostModel", "DEFAULT_COMPUTE_EFFICIENCY", "LINK_EFFICIENCY", "MAMF_BF16", "OPTIMIZER_STATE"]

# Fraction of fp32 peak that eager PyTorch reaches per class of op on a GPU at training batch
# sizes (cuDNN convolutions and cuBLAS GEMMs near half of peak; the rest is memory bound, so
# its compute term rarely decides). calibrate() replaces these with fitted values.
DEFAULT_COMPUTE_EFFICIENCY: dict[str, float] = {
    "conv": 0.55,
    "matmul": 0.6,
    "rnn": 0.4,
    "attention": 0.4,
    "embedding": 0.3,
    "norm": 0.2,
    "pool": 0.3,
    "activation": 0.3,
    "elementwise": 0.3,
    "reduce": 0.3,
    "concat": 0.3,
    "dropout": 0.3,
    "input": 1.0,
    "loss": 0.3,
    "other": 0.3,
}

# Fraction of a link's line rate that transfers and collectives reach, by link-name prefix (the
# cluster's ``link_names``; the LINKS presets name Ethernet links "eth*", which carry NCCL and
# Gloo over TCP sockets). Sources, not fitted: NCCL issue #209 (NCCL 2.4, 2019: "not able to
# reliably obtain more than 60% of wire speed over 32Gbps networks" with TCP) and nccl-tests
# issue #83 (Azure, 25 Gb/s TCP: NCCL all-reduce bus bandwidth "maxed out at 1.7GBps", 54% of
# the 3.125 GB/s line rate). RDMA links (InfiniBand, RoCE), NVLink and PCIe keep their rate.
LINK_EFFICIENCY: dict[str, float] = {"eth": 0.55}

# Maximum achievable matmul FLOPS in bf16 (dense) over the tensor-core peak, per device kind:
# the best of a grid of shapes measured with mamf-finder.py, stas00/ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table" (A100 SXM:
# 271.2 of 312 TFLOPS; H100 SXM: 794.5 of 989). Measured there, not fitted here; used only with
# CostModel(tensor_matmul_ceiling=True).
MAMF_BF16: dict[str, float] = {"A100-40GB": 271.2 / 312, "A100-80GB": 271.2 / 312, "H100": 794.5 / 989}

# Optimizer state per parameter byte (Adam keeps two moments; SGD with momentum one).
OPTIMIZER_STATE: dict[str, float] = {"adam": 2.0, "adamw": 2.0, "sgd-momentum": 1.0, "sgd": 0.0}
# Bytes touched by the update per parameter byte (read p, g and state, write p and state).
_UPDATE_TRAFFIC: dict[str, float] = {"adam": 7.0, "adamw": 7.0, "sgd-momentum": 5.0, "sgd": 3.0}


def _family(kind: str) -> str:
    return kind.split("-", 1)[0].upper()


@dataclass(frozen=True)
class CostModel:
    """How long ops, transfers and updates take. A frozen value; ``replace`` to change it."""

    compute_efficiency: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_COMPUTE_EFFICIENCY))
    """fraction of peak FLOP/s reached, per kind class (missing classes use "other")."""
    memory_efficiency: float = 0.7
    """fraction of memory bandwidth reached by memory-bound ops."""
    use_measured: bool = True
    """use a graph's measured times where it has them."""
    optimizer: str = "adam"
    """optimizer whose state and update the simulator charges ("adam", "sgd-momentum", "sgd")."""
    dtype_bytes: int = 4
    """bytes per value an op computes with (4: fp32; 2: fp16/bf16 on tensor cores, mixed
    precision: activations, the weights' compute copies, transfers and TP collectives in 16
    bits; parameters, optimizer state and the update keep fp32 master bytes)."""
    overhead_scale: float = 1.0
    """multiplier on each device's per-op launch overhead."""
    calibration: Mapping[str, Any] = field(default_factory=dict)
    """how this model was fitted (set by calibrate(); empty for the defaults)."""
    link_efficiency: Mapping[str, float] = field(default_factory=lambda: dict(LINK_EFFICIENCY))
    """fraction of line rate reached on links whose name starts with a key (see LINK_EFFICIENCY);
    other links run at the cluster's bandwidth. ``{}`` turns the term off."""
    reduce_dtype_bytes: int | None = None
    """bytes per gradient value in gradient collectives (DDP's all-reduce, FSDP's reduce-scatter,
    HSDP's cross-host all-reduce); None: the compute dtype, as autoplace's runtime reduces a bf16
    stage (``MixedPrecisionPolicy(reduce_dtype=bf16)``) and Megatron-LM fp16 reduces. 4 for runs
    that reduce in fp32: torchtitan (``mixed_precision_reduce`` takes only float32), Megatron-LM
    in bf16 (``accumulate_allreduce_grads_in_fp32`` is forced on: "bfloat16 requires gradient
    accumulation and all-reduce to be done in fp32", megatron/training/arguments.py), and
    ``torch.autocast`` with DDP (the parameters stay fp32, so their gradients are)."""
    tensor_matmul_ceiling: bool = False
    """on tensor cores (16 bits), "matmul"-class ops reach the device kind's measured maximum
    achievable matmul FLOPS (:data:`MAMF_BF16`) instead of ``compute_efficiency["matmul"]`` (an
    fp32 eager value); the roofline's memory term still bounds small GEMMs. Off by default: not
    yet judged on measured runs; fp32 times never change. Superseded by ``shape_efficiency``
    on the kinds that table lists."""
    shape_efficiency: bool = True
    """in 16 bits on a GPU kind of :data:`~autoplace.cost.efficiency.TENSOR_CORE_KINDS`, GEMMs
    and attention take the efficiency of their shape (:mod:`autoplace.cost.efficiency`) instead
    of ``compute_efficiency``; False: the class constants everywhere. fp32 times never change."""
    tensor_sustained: float = SUSTAINED_FRACTION
    """with ``shape_efficiency``: achieved in training over the microbenchmark efficiency
    (:data:`~autoplace.cost.efficiency.SUSTAINED_FRACTION`, fitted on a named part of published runs)."""
    tensor_size_half: float = SIZE_HALF_TOKENS
    """with ``shape_efficiency``: ``M0`` of a GEMM's saturating size term ``M / (M + M0)``, ``M``
    the micro-batch's tokens (:data:`~autoplace.cost.efficiency.SIZE_HALF_TOKENS`, fitted with
    ``tensor_sustained``); 0 turns it off."""
    causal_attention: bool = True
    """attention ops run a causal kernel (half the traced FLOPs, which ignore the mask); used
    only with ``shape_efficiency``. The zoo's GPT-2 and Llama are causal, BERT is not."""
    batch_norm: str = "sync"
    """how the runtime runs BatchNorm on a replicated stage (``wrap(..., batch_norm=)``):
    ``"sync"`` (its default) all-reduces the statistics over the replicas, which the simulator
    charges (:func:`autoplace.sim.ddp.bn_sync_op_seconds`); ``"local"`` (and torch's own DDP with
    ``nn.BatchNorm``) does not."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"optimizer {self.optimizer!r} is unknown; use one of {sorted(OPTIMIZER_STATE)}")
        bad = {k: v for k, v in self.compute_efficiency.items() if not 0 < v <= 1}
        if bad:
            raise ValueError(f"compute efficiencies must be in (0, 1]; got {bad}")
        if not 0 < self.tensor_sustained <= 1:
            raise ValueError(f"tensor_sustained is {self.tensor_sustained}; it must be in (0, 1] (a fraction of the "
                             "microbenchmark efficiency)")
        if not self.tensor_size_half >= 0:
            raise ValueError(f"tensor_size_half is {self.tensor_size_half}; it must be >= 0 tokens (0: no size term)")
        if not 0 < self.memory_efficiency <= 1:
            raise ValueError(f"memory_efficiency is {self.memory_efficiency}; it must be in (0, 1]")
        bad = {k: v for k, v in self.link_efficiency.items() if not 0 < v <= 1}
        if bad:
            raise ValueError(f"link efficiencies must be in (0, 1]; got {bad}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes is {self.dtype_bytes!r}; it must be 4 (fp32) or 2 (fp16/bf16)")
        if self.batch_norm not in ("sync", "local"):
            raise ValueError(f"batch_norm is {self.batch_norm!r}; it must be 'sync' (statistics all-reduced over a "
                             "stage's replicas, the runtime's default) or 'local'")
        if self.reduce_dtype_bytes not in (None, 2, 4):
            raise ValueError(f"reduce_dtype_bytes is {self.reduce_dtype_bytes!r}; it must be None (the compute "
                             "dtype), 4 (fp32) or 2 (fp16/bf16)")

    # ---- bytes ---------------------------------------------------------------------------

    @property
    def value_scale(self) -> float:
        """Bytes of an activation (or a weight's compute copy) per traced fp32 byte: 1 in fp32,
        1/2 in 16 bits. What transfers, TP collectives, op memory traffic and saved activations
        are charged; parameters, gradients and optimizer state in memory keep fp32 bytes."""
        return self.dtype_bytes / 4.0

    def grad_scale(self, compute_scale: float | None = None) -> float:
        """Bytes of a gradient in a gradient collective per fp32 parameter byte:
        ``reduce_dtype_bytes / 4`` when set, else ``compute_scale`` (the stage's compute bytes
        per fp32 byte; default :attr:`value_scale`)."""
        if self.reduce_dtype_bytes is not None:
            return self.reduce_dtype_bytes / 4.0
        return self.value_scale if compute_scale is None else float(compute_scale)

    # ---- per-op ------------------------------------------------------------------------

    def efficiency_vector(self, graph: "OpGraph") -> np.ndarray:
        other = self.compute_efficiency.get("other", DEFAULT_COMPUTE_EFFICIENCY["other"])
        return np.array([self.compute_efficiency.get(kind_class(k), other) for k in graph.kinds])

    def roofline_times(self, graph: "OpGraph", cluster: "Cluster", *,
                       batch_fraction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(N, D) forward and backward seconds from the roofline alone."""
        f = float(batch_fraction)
        eff = self.efficiency_vector(graph)[:, None]
        in_bytes = np.zeros(graph.num_nodes)
        if graph.num_edges:
            np.add.at(in_bytes, graph.edges[:, 1], graph.edge_bytes)
        vs = self.value_scale  # 16-bit activations and weight copies (1.0 in fp32: the bytes as traced)
        act = (in_bytes + graph.out_bytes) * f * vs
        fwd_bytes = (graph.param_bytes * vs + act)[:, None]
        bwd_bytes = (2.0 * graph.param_bytes * vs + 2.0 * act)[:, None]
        tensor = self.dtype_bytes <= 2
        peak = np.array([(d.peak_flops_tensor or d.peak_flops) if tensor else d.peak_flops
                         for d in cluster.devices])[None, :]
        bw = np.array([d.mem_bandwidth for d in cluster.devices])[None, :] * self.memory_efficiency
        ovh = np.array([d.launch_overhead_s for d in cluster.devices])[None, :] * self.overhead_scale
        eff_f = eff_b = eff
        if tensor and self.shape_efficiency:  # (N, D) per op and device, forward and backward apart
            eff_f, eff_b = tensor_core_efficiencies(graph, cluster.devices, eff[:, 0], batch_fraction=f,
                                                    causal=self.causal_attention, sustained=self.tensor_sustained,
                                                    size_half=self.tensor_size_half)
        elif tensor and self.tensor_matmul_ceiling:  # (N, D): the measured bf16 matmul ceiling where known
            mamf = np.array([MAMF_BF16.get(d.kind, np.nan) for d in cluster.devices])[None, :]
            is_mm = np.array([kind_class(k) == "matmul" for k in graph.kinds], dtype=bool)[:, None]
            eff_f = eff_b = np.where(is_mm & ~np.isnan(mamf), mamf, eff)
        fwd = np.maximum(graph.fwd_flops[:, None] * f / (peak * eff_f), fwd_bytes / bw) + ovh
        bwd = np.maximum(graph.bwd_flops[:, None] * f / (peak * eff_b), bwd_bytes / bw) + ovh
        # Ops that move nothing and compute nothing, and graph inputs (a profile's Input nodes:
        # data loading, not device work), cost nothing.
        is_input = np.array([kind_class(k) == "input" for k in graph.kinds], dtype=bool)
        idle = (((graph.fwd_flops == 0) & (graph.out_bytes == 0) & (graph.param_bytes == 0)) | is_input)[:, None]
        fwd = np.where(idle, 0.0, fwd)
        bwd = np.where(idle, 0.0, bwd)
        return fwd, bwd

    def op_times(self, graph: "OpGraph", cluster: "Cluster", *,
                 batch_fraction: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(N, D) forward and backward seconds of every op on every device, at
        ``batch_fraction`` of the graph's batch, times each device's calibrated ``time_factor``."""
        fwd, bwd = self._op_times(graph, cluster, batch_fraction)
        factor = cluster.time_factors
        if np.any(factor != 1.0):
            fwd, bwd = fwd * factor[None, :], bwd * factor[None, :]
        return fwd, bwd

    def _op_times(self, graph: "OpGraph", cluster: "Cluster", batch_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        fwd, bwd = self.roofline_times(graph, cluster, batch_fraction=batch_fraction)
        if not self.use_measured:
            return fwd, bwd
        mf, mb = graph.fwd_time_s, graph.bwd_time_s
        if np.all(np.isnan(mf)) and np.all(np.isnan(mb)):
            return fwd, bwd
        scale = self._measured_scale(graph, cluster)  # (D,) or NaN where not transferable
        if np.all(np.isnan(scale)):
            return fwd, bwd
        if batch_fraction != 1.0:
            # Measured at the full batch: keep the per-op overhead, scale the rest like the roofline does.
            full_f, full_b = self.roofline_times(graph, cluster)
            with np.errstate(divide="ignore", invalid="ignore"):
                rf = np.where(full_f > 0, fwd / full_f, batch_fraction)
                rb = np.where(full_b > 0, bwd / full_b, batch_fraction)
        else:
            rf = rb = np.ones_like(fwd)
        ok = ~np.isnan(scale)[None, :]
        mfw = mf[:, None] * scale[None, :] * rf
        mbw = mb[:, None] * scale[None, :] * rb
        fwd = np.where(ok & ~np.isnan(mf)[:, None], mfw, fwd)
        bwd = np.where(ok & ~np.isnan(mb)[:, None], mbw, bwd)
        return fwd, bwd

    def _measured_scale(self, graph: "OpGraph", cluster: "Cluster") -> np.ndarray:
        from ..cluster import DEVICE_KINDS

        ref = graph.profiled_on
        ref_peak = None
        if ref in DEVICE_KINDS:
            ref_peak = DEVICE_KINDS[ref][0]
        out = np.full(cluster.num_devices, np.nan)
        for i, d in enumerate(cluster.devices):
            if d.kind == ref or (ref and _family(d.kind) == _family(ref) and ref_peak is None):
                out[i] = 1.0
            elif ref_peak is not None:
                out[i] = ref_peak / d.peak_flops
            elif not ref:
                out[i] = 1.0  # measured somewhere unnamed: take the numbers as they are
        return out

    def link_bandwidth(self, cluster: "Cluster") -> np.ndarray:
        """(D, D) bytes/s each transfer and collective reaches: the cluster's bandwidth times the
        ``link_efficiency`` of the link's kind (its ``link_names`` entry)."""
        bw = np.array(cluster.bandwidth_matrix, dtype=np.float64)
        if self.link_efficiency and cluster.link_names:
            names = np.array(cluster.link_names, dtype=str)
            for prefix, eff in self.link_efficiency.items():
                bw = np.where(np.char.startswith(names, prefix), bw * eff, bw)
        return bw

    def update_times(self, graph: "OpGraph", cluster: "Cluster") -> np.ndarray:
        """(N, D) seconds of the optimizer update of each op's parameters on each device."""
        bw = np.array([d.mem_bandwidth for d in cluster.devices])[None, :] * self.memory_efficiency
        return graph.param_bytes[:, None] * _UPDATE_TRAFFIC[self.optimizer] / bw * cluster.time_factors[None, :]

    @property
    def optimizer_state_factor(self) -> float:
        """Optimizer state bytes per parameter byte."""
        return OPTIMIZER_STATE[self.optimizer]

    def with_efficiency(self, **per_class: float) -> "CostModel":
        unknown = set(per_class) - set(CLASSES)
        if unknown:
            raise ValueError(f"unknown kind classes {sorted(unknown)}; known: {', '.join(CLASSES)}")
        return replace(self, compute_efficiency={**self.compute_efficiency, **per_class})

    def to_dict(self) -> dict[str, Any]:
        return {"compute_efficiency": dict(self.compute_efficiency), "memory_efficiency": self.memory_efficiency,
                "use_measured": self.use_measured, "optimizer": self.optimizer, "dtype_bytes": self.dtype_bytes,
                "overhead_scale": self.overhead_scale, "calibration": dict(self.calibration),
                "link_efficiency": dict(self.link_efficiency)} | (
                    {"reduce_dtype_bytes": self.reduce_dtype_bytes} if self.reduce_dtype_bytes is not None else {}) | (
                    {"tensor_matmul_ceiling": True} if self.tensor_matmul_ceiling else {}) | (
                    {"shape_efficiency": False} if not self.shape_efficiency else {}) | (
                    {"causal_attention": False} if not self.causal_attention else {}) | (
                    {"tensor_sustained": self.tensor_sustained} if self.tensor_sustained != SUSTAINED_FRACTION else {}) | (
                    {"tensor_size_half": self.tensor_size_half} if self.tensor_size_half != SIZE_HALF_TOKENS else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        return cls(**dict(d))
