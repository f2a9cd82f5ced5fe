"""Launched by test_tp_vocab.py as `torchrun --nproc-per-node 2 vocab_child.py OUT CASES_JSON`.

Each case: a zoo model (GPT-2 with its tied LM head, or Llama with an untied one) traced with
torch.fx and sharded over both ranks by ``apply_tensor_parallel`` (the blocks from the op graph;
the embedding and head split by vocabulary by the rewrite itself; with the case's ``sp``, sequence
parallelism too); 4 SGD steps beside the unsplit
model on the same batches; saves the losses, the largest loss and (gathered) parameter
differences, the vocabulary split it made, whether a tied weight is still one parameter, the heads
left split for loss parallelism, the error a loss that cannot run on split logits raised, and the
collectives of the first step by phase and kind (CommDebugMode; the loss's with the forward), to
OUT/<id>-rank<r>.pt."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.fx
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402

import autoplace  # noqa: E402
from autoplace.rewrite.tensor_parallel import (TensorParallelError, apply_tensor_parallel, loss_parallel_context,  # noqa: E402
                                               loss_parallel_heads, tp_layout, vocab_modules, vocab_parallel_loss)
from autoplace.tp_rules import linear_pairs  # noqa: E402

STEPS = 4
VOCAB, SEQ = 64, 8


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g), torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def _bad_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss torch's loss_parallel cannot run on vocabulary-split logits (a softmax read by index)."""
    return (out.softmax(-1)[..., 0] - y.float()).square().mean()


def _model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        return autoplace.zoo.build("gpt2", small=True, seed=0, vocab_size=VOCAB, seq_len=SEQ, n_positions=SEQ).model
    return autoplace.zoo.build("llama", small=True, seed=0, vocab_size=VOCAB, seq_len=SEQ, n_heads=4, n_kv_heads=2,
                               dim=32).model


def run(case: dict, rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    model = _model(case["model"])
    ref = copy.deepcopy(model)
    x0, _ = _batch(0)
    pairs = linear_pairs(autoplace.trace(model, (x0,)))
    layout = tp_layout(pairs)
    gm = torch.fx.symbolic_trace(model)
    vocab = vocab_modules(gm, world)
    apply_tensor_parallel(gm, layout, init_device_mesh("cpu", (world,)), sequence_parallel=bool(case.get("sp")))
    tied = [getattr(gm.get_submodule(e), "weight") is getattr(gm.get_submodule(h), "weight") for e, h in vocab]
    opt, ref_opt = torch.optim.SGD(gm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses, comms = [], [], {}
    heads = loss_parallel_heads(gm)
    with loss_parallel_context(bool(heads)):  # a loss that does not run on them says how to fix it
        try:
            vocab_parallel_loss(_bad_loss)(gm(_batch(0)[0]), _batch(0)[1])
            refused = ""
        except TensorParallelError as e:
            refused = str(e)
    for step in range(STEPS):
        x, y = _batch(step)
        # the loss on the split logits under loss_parallel, its collectives with the forward (counted_step)
        loss, counted = pw.counted_step(lambda: gm(x), lambda o: _loss(o, y))
        if step == 0:
            comms = counted
        opt.step()
        opt.zero_grad()
        r = _loss(ref(x), y)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(r.item())
    runner_refused = ""
    if case.get("runner"):  # the runners' path: a loss that cannot run on the split logits fails with the fix
        from autoplace.rewrite.schedules import build_schedule_runner

        fresh = torch.fx.symbolic_trace(_model(case["model"]))
        runner = build_schedule_runner(fresh, {n.name: 0 for n in fresh.graph.nodes}, example_inputs=(x0,),
                                       microbatches=1, loss_fn=_bad_loss, schedule="gpipe", virtual_stages=1,
                                       tp=world, tp_pairs=[(q.column_path, q.row_path) for q in pairs])
        try:
            runner.step(x0, target=_batch(0)[1])
        except Exception as e:  # PipelineError: the step's first line, the rewrite's message
            runner_refused = str(e)
    want = dict(ref.named_parameters())
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in gm.named_parameters()}
    torch.save({"losses": losses, "vocab": vocab, "tied": tied, "comms": comms, "heads": heads, "refused": refused,
                "runner_refused": runner_refused,
                "sharded": sorted(n for n, p in gm.named_parameters() if hasattr(p, "full_tensor")),
                "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "param_err": max((got[n] - want[n].detach()).abs().max().item() for n in got)},
               out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
