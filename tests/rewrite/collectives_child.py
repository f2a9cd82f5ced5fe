"""Launched by test_collectives_torchrun.py as `torchrun --nproc-per-node P collectives_child.py OUT CASES`.

A user's script for a composed plan (the plans of compose_child.py, with reshard_after_forward
and sequence_parallel too, and for the BatchNorm CNN of bn_plans_child.py one FSDP or HSDP stage
over every rank), run through ``autoplace.wrap``: two warm-up steps (lazy initialisation, shape
inference; DDP rebuilds its buckets in the forward after its first synchronised backward,
broadcasting their indices, which in a pipeline is the second step), then one training step (the
runner's step and the optimizer's) counted under :class:`Counted`, a ``CommDebugMode`` that also
keeps, per collective, its kind, the ranks of its process group, the bytes of its whole tensor
and the functions of autoplace and torch that issued it, and records point-to-point sends and
receives (which CommDebugMode does not count). Saves the events of every step, CommDebugMode's
own counts, the simulator's list (:func:`autoplace.sim.collectives.step_collectives`) for this
rank and the plan to OUT/<id>-rank<r>.pt."""

from __future__ import annotations

import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).parent))
import bn_plans_child as bn  # noqa: E402
import compose_child as cc  # noqa: E402
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402

import autoplace  # noqa: E402
from autoplace.graph.trace import trace_module  # noqa: E402
from autoplace.sim.collectives import step_collectives  # noqa: E402

_C10D = torch.ops.c10d
_FUNCOL = (torch.ops._c10d_functional, torch.ops.c10d_functional)
KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
        "all_reduce_coalesced": "all_reduce",
        "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
        "all_gather_into_tensor_coalesced": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "reduce_scatter_tensor_coalesced": "reduce_scatter",
        "broadcast_": "broadcast", "broadcast": "broadcast", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
        "all_to_all_single": "all_to_all", "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
        "send": "send", "recv_": "recv", "recv_any_source_": "recv"}
P2P = {_C10D.send, _C10D.recv_, _C10D.recv_any_source_}
HERE = str(Path(__file__).parent)


def _ranks(args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The global ranks of the collective's process group (a c10d op's ProcessGroup argument, a
    functional collective's group name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for a in [*args, *kwargs.values()]:
        pg = None
        if isinstance(a, dist.ProcessGroup):
            pg = a
        elif isinstance(a, torch.ScriptObject):
            pg = dist.ProcessGroup.unbox(a)
        elif isinstance(a, str):
            try:
                pg = _resolve_process_group(a)
            except Exception:  # not a group name
                continue
        if pg is not None:
            return tuple(dist.get_process_group_ranks(pg))
    return ()


def _bytes(kind: str, args: tuple) -> int:
    """Bytes of the whole tensor: an all-gather's output, a reduce-scatter's input, else the tensors'."""
    size = [t.numel() * t.element_size() for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)]
    if not size:
        return 0
    if kind == "all_gather" and isinstance(args[0], torch.Tensor) and len(args) > 1 and isinstance(args[1], int):
        return size[0] * args[1]  # functional: (input, group size, group name)
    return max(size) if kind in ("all_gather", "reduce_scatter") else sum(size)


_SKIP = ("_comm_mode", "distributed_c10d.py", "_functional_collectives.py", "c10d_logger.py")


def _origin() -> tuple[str, str]:
    """Who issued it, as ``path:function``: the innermost caller in autoplace, and the innermost
    in torch.distributed past its collective wrappers (FSDP, DTensor, DDP, pipelining)."""
    frames = traceback.extract_stack()[:-3]
    ours = theirs = "-"
    for f in reversed(frames):
        if ours == "-" and "/autoplace/" in f.filename:
            ours = f"{f.filename.split('/autoplace/')[-1]}:{f.name}"
        if theirs == "-" and "/torch/" in f.filename and "/distributed/" in f.filename and not any(
                s in f.filename for s in _SKIP):
            theirs = f"{f.filename.split('/distributed/')[-1]}:{f.name}"
    return ours, theirs


class Counted(CommDebugMode):
    """CommDebugMode that also records every collective and point-to-point op it passes through.
    Its module tracker is off: its hooks fail inside torch's PipelineStage (an fx stage module's
    forward hook finds no parent, IndexError in ``_fw_set_module_hook``), and the counts do not
    need it (every op is counted under "Global")."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []
        tracker = self.advanced_module_tracker
        tracker.__enter__ = lambda: None  # type: ignore[method-assign]
        tracker.__exit__ = lambda *a: None  # type: ignore[method-assign]
        tracker.name = "Global"
        tracker.module_parents_dict["Global"] = {"Global"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = func._overloadpacket
        name = packet.__name__
        if packet in P2P or packet in self.comm_registry or any(packet is getattr(_C10D, n, None) for n in KIND):
            kind = KIND.get(name, name)
            ranks = _ranks(args, kwargs or {})
            if kind in ("send", "recv"):  # (from, to) in global ranks: the peer is a rank of the group
                peer = ranks[int(next(a for a in args[2:] if isinstance(a, int)))]
                me = dist.get_rank()
                ranks = (me, peer) if kind == "send" else (peer, me)
            self.events.append({"kind": kind, "ranks": ranks, "bytes": _bytes(kind, args),
                                "origin": _origin(),
                                "backward": torch._C._current_graph_task_id() != -1})
        return out


def plan_for(case: dict, graph: autoplace.OpGraph, world: int) -> autoplace.Placement:
    """compose_child.py's plan by hand (``pp`` ranks of ``dp x tp`` devices, contiguous stages, on
    ``hosts`` hosts), with ``reshard_after_forward``, ``sequence_parallel`` and ``vocab_parallel`` too when the
    case sets them."""
    pp, tp, v = case["pp"], case.get("tp", 1), case.get("v", 1)
    per, k, n = world // pp, pp * v, graph.num_nodes
    opts = {f: case[f] for f in ("shard", "recompute", "precision", "reshard_after_forward", "sequence_parallel",
                                 "vocab_parallel") if f in case}
    return autoplace.Placement.pipeline(graph, cc.cluster_for(case, world), [i * k // n for i in range(n)],
                                        [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                        microbatches=case.get("microbatches", 2), schedule=case["schedule"],
                                        virtual_stages=v, tp=tp, **opts)


def _gpt(case: dict, world: int) -> tuple[Any, ...]:
    model = tm.build(case["model"], 0)
    x0, _ = tm.batch(8, 0)
    graph = autoplace.trace(model, (x0,))
    plan = plan_for(case, graph, world)
    cluster = cc.cluster_for(case, world)
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan, example_inputs=(x0,),
                            loss_fn=tm.loss, timeout_s=120, progress=False, cluster=cluster)
    return runner, plan, graph, cluster, lambda k: tm.batch(8, k)


def _bn(case: dict, world: int) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = bn.SmallResNet()
    x0 = torch.randn(bn.BATCH, 3, 12, 12)
    shard = case["shard"]
    c = bn.cluster(world, 2 if shard == "hsdp" else 1)
    g = trace_module(model, (x0,)).graph
    plan = autoplace.Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [list(range(world))],
                                        microbatches=case.get("microbatches", 1), shard=shard)
    runner = autoplace.wrap(model, ["cpu"] * world, plan=plan, cluster=c, example_inputs=(x0,),
                            loss_fn=torch.nn.CrossEntropyLoss(), progress=False, timeout_s=120)
    gen = torch.Generator().manual_seed(1)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(bn.BATCH, 3, 12, 12, generator=gen), torch.randint(0, 10, (bn.BATCH,), generator=gen)
    return runner, plan, g, c, batch


def run(case: dict, rank: int, world: int, out: Path) -> None:
    runner, plan, graph, cluster, batch = (_bn if case["model"] == "bn" else _gpt)(case, world)
    sim = [dataclasses.asdict(e) for e in step_collectives(graph, cluster, plan)[rank]]
    opt = torch.optim.SGD(list(runner.parameters()), lr=0.1)
    steps: list[dict[str, Any]] = []
    for k in range(case.get("steps", 3)):
        x, y = batch(k)
        mode = Counted()
        with mode:
            runner.step(x, target=y)
            opt.step()
        opt.zero_grad()
        steps.append({"events": mode.events,
                      "comm_counts": {str(a).split(".")[-1]: b for a, b in mode.get_comm_counts().items()}})
    torch.save({"plan": plan.to_dict(), "steps": steps, "sim": sim, "kind": type(runner).__name__,
                "stages": list(getattr(runner, "stage_indices", [getattr(runner, "stage_index", 0)])),
                "units": list(getattr(runner, "units", ())),
                "buffers": {n: (tuple(b.shape), str(b.dtype)) for mod in getattr(runner, "stage_modules", [])
                            for n, b in mod.named_buffers()}},
               out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
