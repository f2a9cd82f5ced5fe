"""Worker processes for the pipeline tests (started with torch.multiprocessing.spawn).

Each worker joins a gloo process group on 127.0.0.1 through torchrun's environment variables
(so ``init_distributed`` is exercised), builds the same model as every other rank, runs the
pipeline, and compares what its stage holds with the unsplit model it also builds. Results go
to ``<out>/rank<r>.json``; the test process asserts on them.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import rewrite_models as rm  # noqa: E402

from autoplace.rewrite.runtime import (  # noqa: E402
    PipelineTimeoutError, build_pipeline_runner, free_port, init_distributed)  # noqa: F401 - free_port: for the mp.spawn tests
from autoplace.rewrite.schedules import build_schedule_runner  # noqa: E402


def contiguous_stages(gm: torch.fx.GraphModule, stages: int) -> dict[str, int]:
    """Equal runs of call nodes in graph order (so Inception's branches straddle a boundary)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return {n.name: min(stages - 1, i * stages // len(nodes)) for i, n in enumerate(nodes)}


def batch(name: str, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if name.startswith("gpt"):
        return torch.randint(0, 32, (size, 8), generator=g), torch.randint(0, 32, (size, 8), generator=g)
    return torch.randn(size, 3, 8, 8, generator=g), torch.randint(0, 5, (size,), generator=g)


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max([(a[k] - b[k]).abs().max().item() for k in a] or [0.0])


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One pipeline configuration: a first step compared with the reference, then optional steps."""
    name, schedule, micro, replicas = case["model"], case["schedule"], case["microbatches"], case["replicas"]
    stages = dist.get_world_size() // replicas
    model, _, _ = rm.build(name, case.get("seed", 0))
    ref = copy.deepcopy(model)
    loss_fn = rm.loss_fn(name)
    size = micro * replicas * 2
    x, y = batch(name, size, 100)
    gm = torch.fx.symbolic_trace(model)
    t0 = time.perf_counter()
    runner = build_pipeline_runner(gm, contiguous_stages(gm, stages), example_inputs=(x,), microbatches=micro,
                                   loss_fn=loss_fn, schedule=schedule, replicas=replicas,
                                   batch_norm=case.get("batch_norm", "sync"))
    t_build = time.perf_counter() - t0
    mine = dict(runner.stage_module.named_parameters())
    opt_name = case.get("optimizer", "sgd")

    def make_opt(params: Any) -> torch.optim.Optimizer:
        if opt_name == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)

    opt, ref_opt = make_opt(runner.parameters()), make_opt(ref.parameters())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    losses, ref_losses, step_s = [], [], []
    grad_err = buf_err = None
    for step in range(case.get("steps", 1)):
        if step:
            x, y = batch(name, size, 100 + step)
        t0 = time.perf_counter()
        loss = runner.step(x, target=y)
        step_s.append(time.perf_counter() - t0)
        if case.get("reference") == "microbatch_accumulation":
            # BatchNorm: pipelining promises the unsplit model run micro-batch by micro-batch.
            ref_loss = torch.zeros(())
            for xm, ym in zip(x.tensor_split(micro), y.tensor_split(micro)):
                lm = loss_fn(ref(xm), ym)
                (lm / micro).backward()
                ref_loss = ref_loss + lm.detach() / micro
        else:
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
        if step == 0:
            grad_err = _max_err({k: p.grad for k, p in mine.items()},
                                {k: ref_params[k].grad for k in mine})
            ref_bufs = dict(ref.named_buffers())
            buf_err = _max_err({k: b for k, b in runner.stage_module.named_buffers() if k in ref_bufs},
                               {k: ref_bufs[k] for k, _ in runner.stage_module.named_buffers() if k in ref_bufs})
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
        ref_losses.append(float(ref_loss.detach()))
    return {
        **case, "rank": dist.get_rank(), "stage": runner.stage_index, "replica": runner.replica,
        "params": sorted(mine), "grad_err": grad_err, "buffer_err": buf_err,
        "param_err": _max_err({k: p.detach() for k, p in mine.items()}, {k: ref_params[k].detach() for k in mine}),
        "param_errs": {k: (p.detach() - ref_params[k].detach()).abs().max().item() for k, p in mine.items()},
        "losses": losses, "ref_losses": ref_losses, "build_s": t_build, "step_s": step_s,
        "tied_groups": len(runner.tied),
        # the runner is an nn.Module whose parameters and state are exactly its stage's
        "is_module": isinstance(runner, torch.nn.Module),
        "same_parameters": [id(p) for p in runner.parameters()] == [id(p) for p in runner.stage_module.parameters()],
        "state_keys": sorted(runner.state_dict()) == sorted(f"stage_module.{k}" for k in runner.stage_module.state_dict()),
    }


def worker(rank: int, world: int, port: int, out: str, cases: list[dict[str, Any]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    try:
        init_distributed(device="cpu", timeout_s=120)
        for case in cases:
            results.append(run_case(case))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results.append({"error": traceback.format_exc()})
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def stuck_worker(rank: int, world: int, port: int, out: str, timeout_s: float, schedule: str = "1f1b") -> None:
    """Rank 1 builds its runner and then never calls step(); rank 0 must time out, not hang.
    A multi-stage ``schedule`` (two stages per rank) is built by build_schedule_runner."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    init_distributed(device="cpu", timeout_s=timeout_s)
    model, _, _ = rm.build("inception_gn", 0)
    x, y = batch("inception_gn", 4, 0)
    gm = torch.fx.symbolic_trace(model)
    runner: Any
    if schedule in ("1f1b", "gpipe"):
        runner = build_pipeline_runner(gm, contiguous_stages(gm, world), example_inputs=(x,), microbatches=2,
                                       loss_fn=rm.loss_fn("inception_gn"), schedule=schedule)
    else:
        runner = build_schedule_runner(gm, contiguous_stages(gm, 2 * world), example_inputs=(x,), microbatches=2,
                                       loss_fn=rm.loss_fn("inception_gn"), schedule=schedule, virtual_stages=2)
    result: dict[str, Any] = {"rank": rank}
    if rank == 0:
        t0 = time.perf_counter()
        try:
            runner.step(x, target=y)
            result["error"] = ""
        except PipelineTimeoutError as e:
            result["error"] = f"PipelineTimeoutError: {e}"
        except Exception as e:  # the wrong kind of error: report it
            result["error"] = f"{type(e).__name__}: {e}"
        result["waited_s"] = time.perf_counter() - t0
    else:
        time.sleep(timeout_s + 4)  # alive but silent, past rank 0's timeout
    Path(out, f"rank{rank}.json").write_text(json.dumps([result]))
    os._exit(0)  # skip the process group's teardown, which would wait on the dead exchange


def run_cases(run: Any) -> None:
    """A torchrun child's main: join the group, run ``run(case, rank, world, out)`` for every case
    of ``argv[2]`` (JSON) writing under ``argv[1]``; a case that raises leaves its traceback in
    ``<id>-rank<r>.err`` and the next one still runs (every rank meets at a barrier per case)."""
    rank, world, _ = init_distributed(timeout_s=60)
    out = Path(sys.argv[1])
    for case in json.loads(sys.argv[2]):
        try:
            run(case, rank, world, out)
        except Exception:
            (out / f"{case['id']}-rank{rank}.err").write_text(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


def train_and_record(runner: Any, name: str, steps: int) -> dict[str, Any]:
    """``steps`` SGD steps (lr 0.1) of a pipeline ``runner`` on ``batch(name, 8, step)``, and what
    the transparency tests compare: the losses this rank saw, its stages' parameters after (whole:
    DTensor shards gathered), its stage indices and which parameters were sharded."""
    params = list(runner.parameters())  # a rank of a small model cut in 8 may hold no parameters
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    losses = []
    for step in range(steps):
        x, y = batch(name, 8, step)
        loss = runner.step(x, target=y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    named = [(n, p) for mod in runner.stage_modules for n, p in mod.named_parameters()]
    return {"losses": losses,
            "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named},
            "stages": list(runner.stage_indices), "sharded": [n for n, p in named if hasattr(p, "full_tensor")]}


def counted_step(forward: Any, loss_of: Any) -> tuple[torch.Tensor, dict[str, int]]:
    """One forward (``forward()``) and backward (of ``loss_of(output)``) under CommDebugMode: the
    loss and the collectives by phase and kind (``{"forward all_reduce": 4, "backward ...": ...}``;
    a backward kind only where the backward ran some). The loss's collectives count with the forward
    (the simulator's phase); logits left split by vocabulary (a DTensor output) run the loss and the
    backward as autoplace's runners do (torch's ``loss_parallel``, rewrite.tensor_parallel)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._pytree import tree_leaves

    from autoplace.rewrite.tensor_parallel import loss_parallel_context, vocab_parallel_loss

    count = CommDebugMode()
    with count:
        out = forward()
        with loss_parallel_context(any(isinstance(x, DTensor) for x in tree_leaves(out))):
            loss = vocab_parallel_loss(lambda o, _: loss_of(o))(out, None)
            fwd = {str(k).split(".")[-1]: v for k, v in count.get_comm_counts().items()}
            loss.backward()
    total = {str(k).split(".")[-1]: v for k, v in count.get_comm_counts().items()}
    comms = {f"forward {k}": v for k, v in fwd.items()}
    comms |= {f"backward {k}": v - fwd.get(k, 0) for k, v in total.items() if v - fwd.get(k, 0)}
    return loss, comms


def launch_cases(child: Path, out: Path, ranks: int, cases: list[dict[str, Any]], timeout: float) -> None:
    """``torchrun --nproc-per-node ranks child OUT CASES_JSON`` (gloo on 127.0.0.1, one thread per
    process); fails with the children's error files and torchrun's stderr when a rank failed."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(ranks), "--standalone",
           str(child), str(out), json.dumps(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = {f.name: f.read_text()[-1500:] for f in out.glob("*.err")}
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
