"""Launched by test_rewrite_batchnorm.py as `torchrun --nproc-per-node 2 batchnorm_child.py OUT MODE`.

(``... OUT MODE resnet50 64 float32`` measures the zoo's full ResNet-50 on 64 x 64 images in float32
instead: the figures of the README.)

A small ResNet (the zoo's resnet18, small config: 20 BatchNorm layers), in float64 so that
differences are the method's and not rounding amplified by BatchNorm over few samples, under
three plans on two gloo processes, one training step and then two more:

- ``pipeline``: 2 stages, 4 micro-batches;
- ``data-parallel``: 1 stage on 2 replicas, 1 micro-batch;
- ``hybrid``: 1 stage on 2 replicas, 2 micro-batches.

MODE is the runner's ``batch_norm`` ("sync" or "local"). Every rank also runs the unsplit model
on the same batch: on the whole batch (``full``); micro-batch by micro-batch with gradient
accumulation (``accum``: what a pipeline's loss and gradients can equal); and, for the running
statistics, ``deferred``: the same micro-batch by micro-batch forward, each BatchNorm's inputs
recorded by a hook, and one running-statistics update from their concatenation (torch.var_mean
over the whole batch, unbiased, with the layer's momentum), which is what deferred batch norm
promises. After the first step (before the optimizer moves anything) each rank records, for its
stage, the largest differences of the loss, gradients and BatchNorm buffers to each; rank 0
gathers every stage's buffers into one model and compares its eval-mode output with the
references'. Results go to OUT/rank<r>.json.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.nn.modules.batchnorm import _BatchNorm

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402

import autoplace  # noqa: E402
from autoplace.rewrite import build_pipeline_runner, init_distributed  # noqa: E402

CASES = [("pipeline", 2, 1, 4), ("data-parallel", 1, 2, 1), ("hybrid", 1, 2, 2)]  # name, stages, replicas, M
BATCH = 8
MODEL, IMAGE, DTYPE = "resnet18", 32, torch.float64  # the test's; argv[3:6] override them


def _err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max([(a[k].double() - b[k].double()).abs().max().item() for k in a] or [0.0])


def _reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, micro: int) -> dict[str, Any]:
    """The unsplit model's step on (x, y): micro=1 on the whole batch, else by gradient accumulation."""
    ref = copy.deepcopy(model).train()
    loss = torch.zeros((), dtype=torch.float64)
    for xm, ym in zip(x.tensor_split(micro), y.tensor_split(micro)):
        lm = loss_fn(ref(xm), ym)
        (lm / micro).backward()
        loss += lm.detach() / micro
    return {"model": ref, "loss": loss.item(),
            "grads": {k: p.grad.detach().clone() for k, p in ref.named_parameters()},
            "buffers": {k: b.detach().clone() for k, b in ref.named_buffers()}}


def _deferred(model: torch.nn.Module, x: torch.Tensor, micro: int) -> dict[str, Any]:
    """BatchNorm buffers after one deferred update from the inputs each layer saw, micro-batch by micro-batch."""
    ref = copy.deepcopy(model).train()
    layers = {name: m for name, m in ref.named_modules() if isinstance(m, _BatchNorm)}
    start = {name: (m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
             for name, m in layers.items()}
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    for name, m in layers.items():
        m.register_forward_pre_hook(lambda _m, args, name=name: seen[name].append(args[0].detach().clone()))
    with torch.no_grad():
        for xm in x.tensor_split(micro):
            ref(xm)
    buffers: dict[str, torch.Tensor] = {}
    for name, m in layers.items():
        inputs = torch.cat(seen[name])
        var, mean = torch.var_mean(inputs, [0, *range(2, inputs.dim())], correction=1)
        mean0, var0, tracked0 = start[name]
        buffers[f"{name}.running_mean"] = (1 - m.momentum) * mean0 + m.momentum * mean
        buffers[f"{name}.running_var"] = (1 - m.momentum) * var0 + m.momentum * var
        buffers[f"{name}.num_batches_tracked"] = tracked0 + 1
    ev = copy.deepcopy(model)
    state = ev.state_dict()
    state.update(buffers)
    ev.load_state_dict(state)
    return {"model": ev, "buffers": buffers}


def run(name: str, stages: int, replicas: int, micro: int, mode: str) -> dict[str, Any]:
    torch.manual_seed(0)
    small = MODEL == "resnet18"
    wl = autoplace.zoo.build(MODEL, small=small, batch_size=BATCH, **({} if small else {"image_size": IMAGE,
                                                                                      "num_classes": 10}))
    model, loss_fn = wl.model.to(DTYPE), wl.loss_fn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g, dtype=DTYPE)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    refs = {"full": _reference(model, x, y, loss_fn, 1), "accum": _reference(model, x, y, loss_fn, micro),
            "deferred": _deferred(model, x, micro)}
    gm = torch.fx.symbolic_trace(model)
    runner = build_pipeline_runner(gm, pw.contiguous_stages(gm, stages), example_inputs=(x,), microbatches=micro,
                                   loss_fn=loss_fn, schedule="1f1b", replicas=replicas, batch_norm=mode)
    loss = runner.step(x, target=y)
    grads = {k: p.grad for k, p in runner.stage_module.named_parameters()}
    bufs = {k: b for k, b in runner.stage_module.named_buffers()}
    out: dict[str, Any] = {"case": name, "stage": runner.stage_index, "replica": runner.replica,
                           "converted": len(runner.batch_norms), "buffers": sorted(bufs)}
    for ref_name, ref in refs.items():
        if "grads" in ref:
            out[f"grad_err_{ref_name}"] = _err(grads, {k: ref["grads"][k] for k in grads})
            if loss is not None:
                out[f"loss_err_{ref_name}"] = abs(loss.item() - ref["loss"])
        for kind in ("running_mean", "running_var", "num_batches_tracked"):
            mine = {k: b for k, b in bufs.items() if k.endswith(kind)}
            out[f"{kind}_err_{ref_name}"] = _err(mine, {k: ref["buffers"][k] for k in mine})
    first = {k: b for k, b in bufs.items() if k.startswith("stem.1.") and not k.endswith("tracked")}
    out["first_layer_err_full"] = _err(first, {k: refs["full"]["buffers"][k] for k in first}) if first else None
    # Eval outputs: every stage's buffers in one copy of the model (parameters not stepped yet).
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: b.detach().cpu() for k, b in bufs.items()})
    if dist.get_rank() == 0:
        assembled = copy.deepcopy(model)
        state = assembled.state_dict()
        for part in everyone:
            state.update(part)
        assembled.load_state_dict(state)
        xe = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
        with torch.no_grad():
            got = assembled.eval()(xe)
            for ref_name, ref in refs.items():
                out[f"eval_err_{ref_name}"] = (got - ref["model"].eval()(xe)).abs().max().item()
    # Two more steps: the running statistics are updated once a step.
    opt = torch.optim.SGD(runner.parameters(), lr=0.05)
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        runner.step(x, target=y)
    out["num_batches_tracked"] = sorted({int(b.item()) for k, b in runner.stage_module.named_buffers()
                                         if k.endswith("num_batches_tracked")})
    return out


def main() -> None:
    global MODEL, IMAGE, DTYPE
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3:
        MODEL, IMAGE, DTYPE = sys.argv[3], int(sys.argv[4]), getattr(torch, sys.argv[5])
    rank, _, _ = init_distributed(device="cpu", timeout_s=120)
    torch.set_num_threads(1)
    results = [run(*case, mode) for case in CASES]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
