"""Launched by test_checkpoint.py: `torchrun --nproc-per-node N test_checkpoint_child.py OUT CASES_JSON`
(no tests here: pytest collects nothing from it).

A case ``{"id", "save": kind, "loads": [kind, ...]}``: every rank builds the same small Llama
(seed 0) and the plan ``kind`` names (:func:`plan_for`), wraps it with ``autoplace.wrap``, trains
2 Adam steps, saves model and optimizer (``runner.save``), trains 2 more (the uninterrupted run),
and gathers the whole model (``full_state_dict``) into a plain model; then for every load kind it
builds a model from another seed under that plan, loads the checkpoint and trains the same 2 steps.
With ``"ckpt": path`` it loads a checkpoint an earlier launch (or process) wrote instead of saving
one. Beside it, the unwrapped model trains on the full batch (the reference). Each rank writes
``OUT/<id>-rank<r>.json``; the test asserts on them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))

import autoplace  # noqa: E402
import autoplace.zoo as zoo  # noqa: E402
from autoplace import Cluster, Placement  # noqa: E402

LR = 1e-2
SAVE_AT, STEPS = 2, 4


def cluster(world: int) -> Cluster:
    """``world`` CPUs; four of them on two simulated hosts (what HSDP shards within)."""
    hosts = 2 if world == 4 else 1
    base = Cluster.from_devices(["cpu"] * world)
    devs = tuple(dataclasses.replace(d, host=i * hosts // world, peak_flops_tensor=1e12)
                 for i, d in enumerate(base.devices))
    return Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name=f"{hosts}x{world // hosts}xcpu")


def plan_for(kind: str, graph: Any, c: Cluster, world: int) -> Placement:
    """The plans of the matrix, by name, on ``world`` ranks (contiguous cuts by op index)."""
    n = graph.num_nodes

    def cut(k: int) -> list[int]:
        return [i * k // n for i in range(n)]

    every = list(range(world))
    if kind in ("pp", "gpipe"):  # one stage per rank (torch's 1F1B wants a micro-batch per stage at least)
        return Placement.pipeline(graph, c, cut(world), every, microbatches=world,
                                  schedule="1f1b" if kind == "pp" else "gpipe")
    if kind == "ddp":  # data parallel: one stage replicated on every rank
        return Placement.pipeline(graph, c, cut(1), [every], microbatches=2)
    if kind in ("fsdp", "hsdp"):
        return Placement.pipeline(graph, c, cut(1), [every], microbatches=2, shard=kind)
    if kind == "ppdp":  # two stages of world / 2 replicas
        h = world // 2
        return Placement.pipeline(graph, c, cut(2), [every[:h], every[h:]], microbatches=2)
    if kind in ("zbv", "i1f1b"):
        return Placement.pipeline(graph, c, cut(2 * world), every, microbatches=4, virtual_stages=2,
                                  schedule="zbv" if kind == "zbv" else "interleaved-1f1b")
    if kind == "tp":  # world / 2 stages of a TP pair
        return Placement.pipeline(graph, c, cut(world // 2), [every[i:i + 2] for i in range(0, world, 2)],
                                  microbatches=2, tp=2)
    raise ValueError(kind)


def wrap(wl: Any, kind: str, graph: Any, c: Cluster, world: int) -> tuple[Any, torch.optim.Optimizer]:
    """``autoplace.wrap`` under the plan ``kind`` names, and Adam on what it returns; ``online``: the
    1F1B plan as an OnlinePipeline (its optimizer holds the whole model, as it requires)."""
    if kind == "online":
        opt = torch.optim.Adam(wl.model.parameters(), lr=LR)
        runner = autoplace.wrap(wl.model, ["cpu"] * world, mode="pipeline", plan=plan_for("pp", graph, c, world),
                                cluster=c, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn, finetune="online",
                                optimizer=opt, progress=False)
        return runner, opt
    runner = autoplace.wrap(wl.model, ["cpu"] * world, plan=plan_for(kind, graph, c, world), cluster=c,
                            example_inputs=wl.example_inputs, loss_fn=wl.loss_fn, timeout_s=120, progress=False)
    return runner, torch.optim.Adam(runner.parameters(), lr=LR)


def fresh(seed: int) -> Any:
    torch.manual_seed(seed)
    return zoo.build("llama", small=True, batch_size=8, n_layers=4)


def batch(wl: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, 256, tuple(wl.example_inputs[0].shape), generator=g),
            torch.randint(0, 256, tuple(wl.target.shape), generator=g))


def train(runner: Any, opt: torch.optim.Optimizer, wl: Any, steps: range) -> list[float | None]:
    out: list[float | None] = []
    for s in steps:
        x, y = batch(wl, s)
        loss = runner.step(x, target=y)
        opt.step()
        opt.zero_grad()
        out.append(None if loss is None else float(loss))
    return out


def reference(wl: Any) -> tuple[list[float], torch.nn.Module, torch.nn.Module]:
    """The unwrapped model's losses over STEPS Adam steps, and copies of it at SAVE_AT and at the end."""
    ref = copy.deepcopy(wl.model)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    losses, at_save = [], ref
    for s in range(STEPS):
        x, y = batch(wl, s)
        loss = wl.loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if s + 1 == SAVE_AT:
            at_save = copy.deepcopy(ref)
    return losses, at_save, ref


def plain_loss(model: torch.nn.Module, wl: Any, step: int) -> float:
    x, y = batch(wl, step)
    with torch.no_grad():
        return float(wl.loss_fn(model(x), y))


def next_loss(runner: Any, wl: Any) -> float | None:
    """The runner's loss on the batch after the last (a forward and backward; no update)."""
    x, y = batch(wl, STEPS)
    loss = runner.step(x, target=y)
    for p in runner.parameters():
        p.grad = None
    return None if loss is None else float(loss)


def param_err(state: dict[str, torch.Tensor], ref: torch.nn.Module) -> float:
    return max((state[k].float() - p.detach()).abs().max().item() for k, p in ref.named_parameters())


def chunk_counts(path: Path) -> dict[str, Any]:
    """Per saved model key: chunks written and their elements over the tensor's (1.0: each element once)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    out: dict[str, Any] = {}
    for key, m in md.state_dict_metadata.items():
        chunks = getattr(m, "chunks", None)
        if chunks is None or not key.startswith("model."):
            continue
        numel = torch.Size(m.size).numel()
        covered = sum(torch.Size(ch.sizes).numel() for ch in chunks)
        out[key[len("model."):]] = [len(chunks), covered / max(numel, 1)]
    return {"chunks": out, "keys": sorted(md.state_dict_metadata)}


def constants(case: dict[str, Any], rank: int, world: int, out: Path) -> None:
    """A model whose forward makes a tensor constant (fx's ``_tensor_constant0``, a buffer of its
    stage): the runner's raw keys, and those of its checkpoint and of the gathered state."""
    import rewrite_models as rm
    import pipeline_workers as pw
    from autoplace.rewrite.checkpoint import full_state_dict, model_state_dict
    from autoplace.rewrite.runtime import build_pipeline_runner
    from torch.distributed.checkpoint import FileSystemReader

    model, (x,), _ = rm.build("factories", 0)
    gm = torch.fx.symbolic_trace(model)
    runner = build_pipeline_runner(gm, pw.contiguous_stages(gm, world), example_inputs=(x,), microbatches=2,
                                   loss_fn=rm.loss_fn("factories"), schedule="1f1b")
    path = out / f"{case['id']}-ckpt"
    runner.save(path)
    saved = sorted(k[len("model."):] for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    (out / f"{case['id']}-rank{rank}.json").write_text(json.dumps(dict(
        raw_keys=sorted(runner.state_dict()), names=sorted(model_state_dict(runner)), saved=saved,
        full=sorted(full_state_dict(runner)), model_keys=sorted(model.state_dict()),
        rank0_only=sorted(full_state_dict(runner, rank0_only=True)))))


def run(case: dict[str, Any], rank: int, world: int, out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    if case.get("model") == "factories":
        return constants(case, rank, world, out)

    c = cluster(world)
    wl = fresh(0)
    ref_losses, _, ref_end = reference(wl)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    rec: dict[str, Any] = {"rank": rank, "ref_losses": ref_losses}
    path = Path(case.get("ckpt") or out / f"{case['id']}-ckpt")
    if "ckpt" not in case:
        model = wl.model
        runner, opt = wrap(wl, case["save"], graph, c, world)
        losses = train(runner, opt, wl, range(SAVE_AT))
        runner.save(path, optimizer=opt, step=SAVE_AT)
        losses += train(runner, opt, wl, range(SAVE_AT, STEPS))
        full = runner.full_state_dict(model=model)
        plain = fresh(7).model
        plain.load_state_dict(full)  # strict: exactly the model's keys
        on_disk = fresh(8).model
        dcp.load({"model": on_disk.state_dict()}, checkpoint_id=str(path))  # the checkpoint, unwrapped
        from autoplace.rewrite.checkpoint import model_state_dict

        mine = model_state_dict(runner)
        against = runner.report(c, against="ddp") if case["id"] == "pp" else ""
        rec.update(kind=type(runner).__name__, losses=losses, report=runner.report(c), against=against, raw_keys=sorted(runner.state_dict()),
                   names=sorted(mine), dtensors=sorted(k for k, v in mine.items() if isinstance(v, DTensor)),
                   full_keys=list(full) == list(model.state_dict()), full_param_err=param_err(full, ref_end),
                   # the plain model's loss on the next batch, and the runner's (its forward, before an update)
                   plain_next=plain_loss(plain, wl, STEPS), next=next_loss(runner, wl),
                   # the checkpoint (step 2) in the plain model: its loss on batch 2 is the run's third
                   dcp_plain_loss=plain_loss(on_disk, wl, SAVE_AT),
                   model_keys=sorted(model.state_dict()), **chunk_counts(path))
        dist.barrier()
    rec["loads"] = []
    for i, kind in enumerate(case["loads"]):
        wl_b = fresh(1 + i)
        runner_b, opt_b = wrap(wl_b, kind, graph, c, world)
        step = runner_b.load(path, optimizer=opt_b)
        losses_b = train(runner_b, opt_b, wl_b, range(SAVE_AT, STEPS))
        full_b = runner_b.full_state_dict(model=wl_b.model)
        plain_b = fresh(9).model
        plain_b.load_state_dict(full_b)
        rec["loads"].append(dict(kind=kind, runner=type(runner_b).__name__, step=step, losses=losses_b,
                                 full_param_err=param_err(full_b, ref_end), plain_next=plain_loss(plain_b, wl, STEPS),
                                 next=next_loss(runner_b, wl), report=runner_b.report()))
    (out / f"{case['id']}-rank{rank}.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    import pipeline_workers as pw

    pw.run_cases(run)
