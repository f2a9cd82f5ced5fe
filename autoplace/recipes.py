"""The parallelism recipes practitioners publish for Llama-class training, as plan values: what a
planner's plan is compared with (``benchmarks/llama_recipes.py``) and what a claim of gain is
decomposed against (:mod:`autoplace.claims`).

Each builder returns :class:`Recipe` values for a graph and cluster: the recipe's name, where it
is published, its :class:`~autoplace.placement.Placement` (None when it cannot be expressed here)
and, when the plan rules or the runtime refuse it, their message. Layout, as both torchtitan's
device mesh ``["pp", "dp", "tp"]`` and Megatron-LM's rank order (tensor fastest, then data, then
pipeline) lay ranks out: a TP group is ``tp`` consecutive devices (inside one host), a pipeline
rank is ``dp x tp`` consecutive devices, the ranks in device order. The global batch is the
graph's; micro-batches of one sample per replica, as both publish them (torchtitan's
``pipeline_parallel_microbatch_size = 1``; Megatron's micro-batch 1).

- :func:`torchtitan_recipes` (Liang et al., "TorchTitan: One-stop PyTorch native solution for
  production ready LLM pre-training", ICLR 2025; its ``llama3_8b.toml`` and ``llama3_70b.toml``):
  1D FSDP over every device with full AC, and with selective AC of every second block (its 8B
  default is op-level selective AC, which a plan cannot say: per block only); 2D FSDP x TP with
  TP = the devices of a host and sequence parallelism, full AC; 3D PP x FSDP x TP with 1F1B and
  with interleaved 1F1B (2 stages per rank) for PP = 2 and PP = hosts. bf16 mixed precision
  (``mixed_precision_param = "bfloat16"``) where the cost model trains in 16 bits.
- :func:`megatron_recipes` (Narayanan et al., "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", SC'21): TP = the devices of a host, PP across hosts, DP over
  the rest, interleaved 1F1B with 2 chunks per rank (1F1B without pipeline: gradient
  accumulation), micro-batch 1, full recompute of every transformer layer, no sequence
  parallelism (it came later). One row per PP degree dividing the hosts: the paper's rule is the
  fewest stages that fit, which the simulator decides. Megatron keeps bf16 weights with fp32
  master copies on every DP replica (no sharding in SC'21; the distributed optimizer came
  later): the DP dimension is ``shard="ddp"`` with ``precision="bf16"`` (fp32 masters, gradients
  and Adam state whole on every replica; autoplace's runtime casts the parameters to bf16 per
  call and all-reduces bf16 gradients, where Megatron-LM keeps one bf16 copy and reduces in fp32).
- :func:`ddp_recipe`: PyTorch DDP over every device, fp32, no recompute.

Recompute is the list of transformer blocks, with several stages per rank too (a rank's list
holds the blocks of all its stages), so the embedding and the head are not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .capability import runtime_problems
from .errors import AutoplaceError
from .graph.units import block_units, is_block
from .placement import Placement
from .planners.heuristic.fsdp import block_stages
from .planners.heuristic.stage_options import precision_for

if TYPE_CHECKING:
    from .cluster import Cluster
    from .cost.analytic import CostModel
    from .graph.ir import OpGraph

__all__ = ["Recipe", "RecipeError", "FAMILIES", "recipes", "torchtitan_recipes", "megatron_recipes", "ddp_recipe"]

TORCHTITAN = "Liang et al. 2024 (TorchTitan, ICLR 2025); torchtitan llama3_8b.toml / llama3_70b.toml"
MEGATRON = "Narayanan et al. SC'21 (Megatron-LM: TP in a host, PP across hosts, DP, interleaved 1F1B)"
DDP = "PyTorch DistributedDataParallel over every device"


class RecipeError(AutoplaceError, ValueError):
    """A recipe family that does not exist (the message lists those that do)."""


@dataclass(frozen=True)
class Recipe:
    """One published recipe on one graph and cluster."""

    name: str
    """the recipe in words: ``"torchtitan 2D: FSDP 2 x TP 8 (SP), full AC"``."""
    family: str
    """"torchtitan", "megatron" or "ddp"."""
    source: str
    """where it is published."""
    placement: Placement | None
    """the recipe as a plan; None when it cannot be expressed (``problem`` says why)."""
    problem: str = ""
    """why the plan rules refuse it ("refused: ..."), why the runtime would not run it
    ("runtime: ..."), or why it cannot be expressed; "" when none."""

    @property
    def valid(self) -> bool:
        """Whether the plan passes the plan rules (it can be simulated)."""
        return self.placement is not None and not self.problem.startswith(("refused", "not expressible"))


def _blocks(graph: "OpGraph") -> list[str]:
    return [u for u in block_units(graph).names if is_block(u)]


def _host_size(cluster: "Cluster") -> int:
    hosts = cluster.hosts
    return min(hosts.count(h) for h in set(hosts))


def _recipe(name: str, family: str, source: str, graph: "OpGraph", cluster: "Cluster",
            stage_of_node: np.ndarray | None, ranks: int, **kw: Any) -> Recipe:
    """The recipe on ``ranks`` pipeline ranks of consecutive devices, checked by the plan rules
    and the runtime's."""
    if stage_of_node is None:
        return Recipe(name, family, source, None, "not expressible: the model has fewer blocks than stages")
    n = cluster.num_devices
    width = n // ranks
    devs = [list(range(r * width, (r + 1) * width)) for r in range(ranks)]
    p = Placement.pipeline(graph, cluster, stage_of_node, devs, planner=f"recipe:{family}", validate=False,
                           meta={"recipe": name}, **kw)
    why = p.problems(graph, cluster)
    if why:
        return Recipe(name, family, source, p, "refused: " + "; ".join(why))
    rt = runtime_problems(p, graph)
    return Recipe(name, family, source, p, ("runtime: " + "; ".join(rt)) if rt else "")


def torchtitan_recipes(graph: "OpGraph", cluster: "Cluster", *, cost: "CostModel | None" = None) -> list[Recipe]:
    """torchtitan's 1D, 2D and 3D recipes (module docstring)."""
    from .cost.analytic import CostModel

    prec = precision_for(cluster, cost if cost is not None else CostModel())
    n, b, tp = cluster.num_devices, graph.batch_size, _host_size(cluster)
    hosts = n // tp
    blocks = _blocks(graph)
    one = np.zeros(graph.num_nodes, dtype=np.int64)
    out = [
        _recipe(f"torchtitan 1D: FSDP {n}, full AC", "torchtitan", TORCHTITAN, graph, cluster, one, 1,
                microbatches=1, shard="fsdp", recompute=blocks, precision=prec),
        _recipe(f"torchtitan 1D: FSDP {n}, AC every 2nd block", "torchtitan", TORCHTITAN, graph, cluster, one, 1,
                microbatches=1, shard="fsdp", recompute=blocks[1::2], precision=prec),
        _recipe(f"torchtitan 2D: FSDP {hosts} x TP {tp} (SP), full AC", "torchtitan", TORCHTITAN, graph, cluster,
                one, 1, microbatches=1, shard="fsdp", recompute=blocks, precision=prec, tp=tp, sequence_parallel=True),
    ]
    for pp in sorted({2, hosts}):
        if pp < 2 or hosts % pp:
            continue
        dp = hosts // pp
        m = max(b // dp, 1)  # micro-batch 1 per replica
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
            out.append(_recipe(f"torchtitan 3D: PP {pp} x FSDP {dp} x TP {tp} (SP), {schedule}"
                               + (f" v={v}" if v > 1 else "") + ", full AC", "torchtitan", TORCHTITAN, graph, cluster,
                               block_stages(graph, pp * v), pp, microbatches=m, schedule=schedule, virtual_stages=v,
                               shard="fsdp", recompute=blocks, precision=prec, tp=tp,
                               sequence_parallel=True))
    return out


def megatron_recipes(graph: "OpGraph", cluster: "Cluster", *, cost: "CostModel | None" = None) -> list[Recipe]:
    """Megatron-LM's 3-D recipe, one row per pipeline degree dividing the hosts (module docstring)."""
    from .cost.analytic import CostModel

    prec = precision_for(cluster, cost if cost is not None else CostModel())
    n, b, tp = cluster.num_devices, graph.batch_size, _host_size(cluster)
    hosts = n // tp
    blocks = _blocks(graph)
    out = []
    for pp in [p for p in (1, 2, 4, 8, 16) if p <= hosts and hosts % p == 0]:
        dp = hosts // pp
        m = max(b // dp, 1)
        schedule, v = ("interleaved-1f1b", 2) if pp > 1 else ("1f1b", 1)
        st = np.zeros(graph.num_nodes, dtype=np.int64) if pp == 1 else block_stages(graph, pp * v)
        out.append(_recipe(f"Megatron: TP {tp} x PP {pp} x DP {dp}, {schedule}" + (f" v={v}" if v > 1 else "")
                           + ", mb 1, full recompute", "megatron", MEGATRON, graph, cluster, st, pp,
                           microbatches=m, schedule=schedule, virtual_stages=v, shard="ddp",
                           recompute=blocks, precision=prec, tp=tp))
    return out


def ddp_recipe(graph: "OpGraph", cluster: "Cluster", *, cost: "CostModel | None" = None) -> list[Recipe]:
    """DDP over every device, fp32, one micro-batch."""
    one = np.zeros(graph.num_nodes, dtype=np.int64)
    return [_recipe(f"DDP {cluster.num_devices}, fp32", "ddp", DDP, graph, cluster, one, 1, microbatches=1)]


FAMILIES: dict[str, Callable[..., list[Recipe]]] = {
    "torchtitan": torchtitan_recipes, "megatron": megatron_recipes, "ddp": ddp_recipe}
"""The recipe families by name (the CLI's ``--against``)."""


def recipes(graph: "OpGraph", cluster: "Cluster", family: str, *, cost: "CostModel | None" = None) -> list[Recipe]:
    """Every recipe of ``family`` ("torchtitan", "megatron", "ddp") on ``graph`` and ``cluster``."""
    if family not in FAMILIES:
        raise RecipeError(f"unknown recipe family {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family](graph, cluster, cost=cost)
