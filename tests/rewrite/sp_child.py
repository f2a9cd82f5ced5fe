"""Launched by test_rewrite_sequence_parallel.py as `torchrun --nproc-per-node P sp_child.py OUT CASES_JSON`.

Each case (model, pp, via): trace the model, build its TP plan (pp stages, each a TP group of
P / pp ranks, one host of a DGX-1) and let the planner's rule (sp_choice) pick sequence
parallelism on that cluster with its memory set between what the plan needs with and without SP;
then run the chosen Placement: ``via="apply"`` (pp=1) shards the traced module with
apply_tensor_parallel(sequence_parallel=plan.sequence_parallel); ``via="runner"`` builds the
plan's pipeline with build_schedule_runner(sequence_parallel=plan.sequence_parallel). Train 5 SGD steps and save the plan, the
losses, the largest difference of losses and gathered parameters from the unsplit model, the
sequence-parallel region each module was rewritten with, and with ``via="apply"`` the
collectives torch ran in the first step by phase and kind (CommDebugMode), to OUT/<id>-rank<r>.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "planners"))
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402
from planner_graphs import with_memory  # noqa: E402

import autoplace.rewrite.schedules as schedules  # noqa: E402
from autoplace import Cluster  # noqa: E402
from autoplace.graph.trace import trace_module  # noqa: E402
from autoplace.placement import Placement  # noqa: E402
from autoplace.planners.heuristic.sequence_parallel import sp_choice  # noqa: E402
from autoplace.rewrite.tensor_parallel import (apply_tensor_parallel, loss_parallel_context,  # noqa: E402
                                               loss_parallel_heads, tp_layout, vocab_parallel_loss)
from autoplace.sim import simulator_for  # noqa: E402
from autoplace.tp_rules import linear_pairs  # noqa: E402

STEPS = 5


def _plan(graph, world: int, pp: int, microbatches: int) -> Placement:  # type: ignore[no-untyped-def]
    """The planner's choice for a TP plan whose cluster holds less than it needs without SP."""
    t = world // pp
    c = Cluster.preset("8xV100-nvlink")
    st = np.minimum(np.arange(graph.num_nodes) * pp // graph.num_nodes, pp - 1)
    groups = [list(range(s * t, (s + 1) * t)) for s in range(pp)]
    plain = Placement.pipeline(graph, c, st, groups, microbatches=microbatches, tp=t)
    sim = simulator_for(graph, c)
    need = [float(sim.run(p, timeline=False).peak_memory_bytes.max())
            for p in (plain, Placement.from_dict({**plain.to_dict(), "sequence_parallel": True}))]
    tight = with_memory(c, sum(need) / 2)
    chosen, _ = sp_choice(simulator_for(graph, tight), Placement.pipeline(graph, tight, st, groups,
                                                                          microbatches=microbatches, tp=t))
    return chosen


def _counts(mode):  # type: ignore[no-untyped-def]
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def run(case: dict, rank: int, world: int, out: Path) -> None:
    from torch.distributed.tensor.debug import CommDebugMode

    model = tm.build(case["model"], 0)
    want_losses, want = tm.reference(model, STEPS)
    x0, _ = tm.batch(8, 0)
    traced = trace_module(model, (x0,))
    graph = traced.graph
    pp, via = case["pp"], case["via"]
    plan = _plan(graph, world, pp, 1 if via == "apply" else 2)
    pairs = linear_pairs(graph)
    gm = torch.fx.symbolic_trace(model)
    if via == "apply":
        from torch.distributed.device_mesh import init_device_mesh

        apply_tensor_parallel(gm, tp_layout(pairs), init_device_mesh("cpu", (plan.tp,)),
                              sequence_parallel=plan.sequence_parallel)
        modules: list[torch.nn.Module] = [gm]
        heads = bool(loss_parallel_heads(gm))  # logits split by vocabulary: the loss as the runners run it
        loss_fn = vocab_parallel_loss(tm.loss)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
            with loss_parallel_context(heads):
                loss = loss_fn(gm(x), y)
                loss.backward()
            return loss
    else:
        assert plan.stage_of_node is not None
        stage_of_fx = {n.name: int(plan.stage_of_node[traced.op_of_fx[n.name]]) for n in gm.graph.nodes
                       if n.name in traced.op_of_fx}
        for n in gm.graph.nodes:  # placeholders and the output: with their neighbours
            stage_of_fx.setdefault(n.name, 0 if n.op == "placeholder" else pp - 1)
        runner = schedules.build_schedule_runner(gm, stage_of_fx, example_inputs=(x0,),
                                                 microbatches=plan.microbatches, loss_fn=tm.loss,
                                                 schedule=plan.schedule, virtual_stages=1, tp=plan.tp,
                                                 tp_pairs=[(p.column_path, p.row_path) for p in pairs],
                                                 sequence_parallel=plan.sequence_parallel)
        modules = list(runner.stage_modules)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
            return runner.step(x, target=y)
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    losses: list[float] = []
    comms: dict[str, int] = {}
    for k in range(STEPS):
        x, y = tm.batch(8, k)
        if k == 0 and via == "apply":  # the collectives of the first step; forward counted alone in a second pass
            with CommDebugMode() as count:
                loss = step(x, y)
            with CommDebugMode() as fwd, loss_parallel_context(heads):
                loss_fn(gm(x), y)
            f = _counts(fwd)
            comms = {f"forward {a}": b for a, b in f.items()}
            comms |= {f"backward {a}": b - f.get(a, 0) for a, b in _counts(count).items() if b - f.get(a, 0)}
        else:  # CommDebugMode's module hooks fail inside torch's PipelineStage: the runner is not counted
            loss = step(x, y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for mod in modules for n, p in mod.named_parameters()}
    torch.save({"plan": plan.to_dict(), "losses": losses, "comms": comms,
                "sp_modules": [m.meta.get("sequence_region", []) for m in modules if isinstance(m, torch.fx.GraphModule)],
                "loss_err": max([abs(a - b) for a, b in zip(losses, want_losses)] or [0.0]),
                "param_err": max((params[n] - want[n]).abs().max().item() for n in params),
                "checked": sorted(params)}, out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
