"""What FSDP costs a step on this host beyond what the simulator charges it: measured, and charged.

The simulator prices a sharded stage (``autoplace.sim.sharding``) as its compute on each rank's
share of the batch plus a ring all-gather and reduce-scatter per FSDP unit over the cluster's link
(on a host cluster, gloo's send/recv link). On 2 CPU processes that left FSDP 8-11x under its
measured step (``benchmarks/results/online_kinds.md`` at 2362 s: ResNet-18 20 ms predicted, 228
ms measured; GNMT-4 unrolled 35 / 276 ms): ``fully_shard``'s hooks, the copies in and out of its
flat buffers, and one gloo collective call per unit and direction, each of which on a 2-core host
wakes gloo's threads and waits for a core (see :mod:`autoplace.online.host_probe`'s
``busy_messages``), are no cost term of the host model.

:func:`fsdp_overhead` measures that residual directly, through the runtime's own FSDP path
(:func:`autoplace.rewrite.compose.build_runner` with a one-stage ``shard="fsdp"`` plan, what the
online switch runs), on stacks of linear layers (the fit's data: a named synthetic part, no model
of the benchmarks): each rank's wall seconds of a forward + backward step under FSDP, minus the
same layers' plain forward + backward on the rank's half of the batch (both ranks at once, so
sharing the cores as under FSDP), minus the ring all-gathers and reduce-scatters the simulator
already charges on the link. The residual is fitted (non-negative least squares) as

    per_step_s + per_unit_s x (units + 1: the root) + per_tensor_s x parameter tensors
               + per_byte_s x parameter bytes

over 4 and 16 small one-layer blocks, 4 small blocks of 4 layers (more tensors per unit: a ResNet
block holds 6-9) and 4 wide one-layer blocks, with and without resharding after forward
(``reshard_per_unit_s``: the extra per unit when the backward gathers again). A first fit without
the tensor term charged ResNet-18's FSDP 60 ms where it measured 262 ms.

:func:`fsdp_step_overhead_s` charges the fit to a candidate's sharded stage, once per
micro-batch (FSDP's loop runs forward and backward per micro-batch): the online tuner's
simulator adds it (:func:`autoplace.online.kinds.kind_evaluate`, from the cost model's
``fsdp_s``, :class:`autoplace.cost.host.HostCostModel`). The simulator's own sharded path does
not read it (``plan("best")`` still picks without it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from ..cost.shared_cores import low

if TYPE_CHECKING:
    from ..graph.ir import OpGraph
    from .kinds import KindPlan

__all__ = ["fsdp_overhead", "fsdp_step_overhead_s", "LAYOUTS"]

LAYOUTS = ((16, 4, 1), (16, 16, 1), (16, 4, 4), (512, 4, 1))
"""(width, blocks, layers per block) of the probed stacks: few and many small units, units of many
tensors, few large units."""


class _Stack(torch.nn.Module):
    """``blocks`` blocks of ``per_block`` Linear(width, width) + ReLU in a ModuleList: one FSDP unit
    each (:func:`autoplace.graph.units.block_units`: ``blocks.0``, ``blocks.1``, ...)."""

    def __init__(self, width: int, blocks: int, per_block: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[m for _ in range(per_block) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
            for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _ring_s(nbytes: float, latency_s: float, bandwidth: float) -> float:
    """A ring all-gather or reduce-scatter of ``nbytes`` over 2 ranks, as the simulator prices it."""
    return 0.5 * nbytes / bandwidth + latency_s


def fsdp_overhead(rank: int, *, latency_s: float, bandwidth: float, repeats: int = 12) -> dict[str, Any]:
    """The residual fit of the module doc, on this rank of an initialised 2-rank gloo group (the
    same call on both ranks); ``latency_s`` and ``bandwidth``: the link the simulator prices the
    collectives on (the host probe's send/recv link)."""
    import copy
    import dataclasses

    import torch.distributed as dist
    from scipy.optimize import nnls

    from ..cost.host import host_cluster
    from ..graph.trace import trace_module
    from ..graph.units import block_units
    from ..placement import Placement
    from ..rewrite.compose import build_runner

    cluster = host_cluster(2, latency_s=latency_s, bandwidth=bandwidth)
    loss = torch.nn.functional.mse_loss

    def wall(fn: Any) -> float:
        ts = []
        for k in range(repeats + 3):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if k >= 3:
                ts.append(time.perf_counter() - t0)
        return low(ts)

    rows = []
    for width, layers, per_block in LAYOUTS:
        torch.manual_seed(0)
        model = _Stack(width, layers, per_block)
        x, y = torch.randn(16, width), torch.randn(16, width)
        half = x[: len(x) // 2], y[: len(y) // 2]

        def plain() -> None:
            loss(model(half[0]), half[1]).backward()
            model.zero_grad(set_to_none=True)

        plain_s = wall(plain)
        traced = trace_module(model, (x,))
        units = block_units(traced.graph).num_units + 1
        nbytes = float(sum(p.numel() * p.element_size() for p in model.parameters()))
        tensors = len(list(model.parameters()))
        for reshard in (False, True):
            plan = Placement.pipeline(traced.graph, cluster, np.zeros(traced.graph.num_nodes, dtype=np.int64),
                                      [[0, 1]], microbatches=1, schedule="1f1b", shard="fsdp",
                                      reshard_after_forward=reshard)
            mine = dataclasses.replace(traced, gm=copy.deepcopy(traced.gm))
            runner = build_runner(mine, plan, cluster, example_inputs=(x,), loss_fn=loss, device="cpu")
            fsdp_s = wall(lambda: runner.step(x, target=y))
            link_s = (2 + int(reshard)) * _ring_s(nbytes, latency_s, bandwidth) + (2 + int(reshard)) * units * latency_s
            rows.append({"width": width, "layers": layers, "per_block": per_block, "units": units, "tensors": tensors,
                         "bytes": nbytes, "reshard": reshard,
                         "fsdp_s": fsdp_s, "plain_s": plain_s, "link_s": link_s,
                         "residual_s": fsdp_s - plain_s - link_s})
    a = np.array([[1.0, r["units"], r["tensors"], r["bytes"], r["units"] * float(r["reshard"])] for r in rows])
    resid = np.array([max(r["residual_s"], 0.0) for r in rows])
    coef, _ = nnls(a, resid)
    return {"per_step_s": float(coef[0]), "per_unit_s": float(coef[1]), "per_tensor_s": float(coef[2]),
            "per_byte_s": float(coef[3]), "reshard_per_unit_s": float(coef[4]), "rows": rows}


def fsdp_step_overhead_s(terms: Mapping[str, Any], graph: "OpGraph", cand: "KindPlan") -> float:
    """Seconds :func:`fsdp_overhead`'s fit (``terms``) adds to a step of ``cand``: for each sharded
    stage, per micro-batch, ``per_step_s + (per_unit_s [+ reshard_per_unit_s]) x (its units + 1) +
    per_tensor_s x its parameter tensors + per_byte_s x its parameter bytes``; the slowest stage's (0
    for a plan with no sharded stage). Parameter tensors per op: the profile's count where it has
    one, else one per op that holds parameter bytes."""
    opts = cand.options
    if not terms or opts is None:
        return 0.0
    from ..cost.host import profile_terms
    from ..graph.units import block_units, stage_units

    st = np.asarray(cand.stage_of_node)
    p = profile_terms(graph)
    tensors = np.asarray(p["update"]["param_tensors"], dtype=float) if p and p.get("update") and \
        "param_tensors" in p["update"] else (np.asarray(graph.param_bytes) > 0).astype(float)
    unit = stage_units(block_units(graph), st)
    worst = 0.0
    for s in range(len(cand.stage_devices)):
        if not opts.sharded(s):
            continue
        units = len({int(u) for u in unit[st == s] if u >= 0}) + 1
        unit_s = float(terms.get("per_unit_s", 0.0)) + (float(terms.get("reshard_per_unit_s", 0.0))
                                                       if opts.reshard_after_forward[s] else 0.0)
        nbytes = float(np.asarray(graph.param_bytes)[st == s].sum())
        worst = max(worst, int(cand.microbatches) * (float(terms.get("per_step_s", 0.0)) + unit_s * units
                                                     + float(terms.get("per_tensor_s", 0.0)) * float(tensors[st == s].sum())
                                                     + float(terms.get("per_byte_s", 0.0)) * nbytes))
    return worst
