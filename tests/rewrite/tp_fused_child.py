"""Launched by test_tp_fused.py as `torchrun --nproc-per-node P tp_fused_child.py OUT CASES_JSON`.

Each case (model, pp, sp): a model with a fused q/k/v projection (the zoo's gpt2, small config:
``c_attn(x).split(n_embd, dim=2)``; or ``chunk``, a GPT whose ``qkv(x).chunk(3, dim=-1)`` parts
are ``view``ed into heads), traced; its column/row blocks from the op graph (the fused column
included); with pp=1 sharded over all ranks (TP=P, sequence parallelism with sp) on the fx
GraphModule, with pp=2 a 2-stage 1F1B pipeline whose stages are TP groups of P/2; 5 SGD steps
(lr 0.1) beside the unsplit model on the same batches. Saved to OUT/<id>-rank<r>.pt: losses, the
largest loss and parameter differences (parameters gathered with ``full_tensor()``, in the
original layout), with pp=1 the collectives of the first step (CommDebugMode), whether the rank's
local fused weight is exactly rows q_r, k_r, v_r of the original, and the largest difference of
``checkpoint.full_state_dict`` from the unsplit model's state dict."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402

import autoplace  # noqa: E402
from autoplace import zoo  # noqa: E402
from autoplace.rewrite.checkpoint import full_state_dict  # noqa: E402
from autoplace.rewrite.schedules import build_schedule_runner  # noqa: E402
from autoplace.rewrite.tensor_parallel import apply_tensor_parallel, tp_layout  # noqa: E402
from autoplace.tp_rules import linear_pairs  # noqa: E402

STEPS = 5
VOCAB, SEQ, BATCH = 256, 32, 4


class ChunkAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        parts = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (parts[i].view(b, t, self.heads, self.hd).transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class ChunkGPT(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.ln = nn.ModuleList([nn.LayerNorm(d) for _ in range(layers)])
        self.attn = nn.ModuleList([ChunkAttention(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for ln, attn in zip(self.ln, self.attn):
            x = x + attn(ln(x))
        return self.head(x)


def build(name: str) -> tuple[nn.Module, str]:
    """The model and its fused projection's path in the first block."""
    if name == "gpt2":
        return zoo.build("gpt2", small=True, seed=0, vocab_size=VOCAB, seq_len=SEQ).model, "h.0.attn.c_attn"
    torch.manual_seed(0)
    return ChunkGPT(), "attn.0.qkv"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def reference(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _checkpoint_errors(gm: nn.Module, want: dict[str, torch.Tensor], path: Path, world: int) -> dict[str, float]:
    """Save ``gm`` (trained, TP) with ``checkpoint.save``; load it into a TP model of other weights
    and, with DCP, into the plain model: the largest differences from the unsplit ``want``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from autoplace.rewrite import checkpoint

    checkpoint.save(gm, path)
    fresh, _ = build(BUILD)
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(0.5)
    x0, _ = batch(0)
    layout = tp_layout(linear_pairs(autoplace.trace(fresh, (x0,))))
    other = torch.fx.symbolic_trace(fresh)
    apply_tensor_parallel(other, layout, init_device_mesh("cpu", (world,)))
    checkpoint.load(other, path)
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in other.named_parameters()}
    plain, _ = build(BUILD)
    sd = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=str(path))
    return {"ckpt_tp_err": max((got[n] - want[n]).abs().max().item() for n in got),
            "ckpt_plain_err": max((sd[k] - want[k]).abs().max().item() for k in want)}


BUILD = "gpt2"


def run(case: dict[str, Any], rank: int, world: int, out: Path) -> None:
    model, fused_path = build(case["model"])
    want_losses, want = reference(model)
    x0, _ = batch(0)
    pairs = linear_pairs(autoplace.trace(model, (x0,)))
    layout = tp_layout(pairs)
    w0 = dict(model.named_parameters())[f"{fused_path}.weight"].detach().clone()
    gm = torch.fx.symbolic_trace(model)
    losses: list[float] = []
    rec: dict[str, Any] = {"layout": layout, "parts": {p.column_path: p.parts for p in pairs}}
    if case["pp"] == 1 and not case.get("wrap"):
        from torch.distributed.device_mesh import init_device_mesh
        apply_tensor_parallel(gm, layout, init_device_mesh("cpu", (world,)), sequence_parallel=case.get("sp", False))
        local = dict(gm.named_parameters())[f"{fused_path}.weight"].to_local()
        n = w0.size(0) // 3
        rows = torch.cat([w0[j * n + rank * n // world: j * n + (rank + 1) * n // world] for j in range(3)])
        rec["local_is_qkv_rows"] = bool(torch.equal(local, rows))
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = batch(step)
            loss, counted = pw.counted_step(lambda: gm(x), lambda o: loss_fn(o, y))
            if step == 0:
                rec["comms"] = counted
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        modules: list[nn.Module] = [gm]
        state = full_state_dict(gm, model=model)  # the checkpoint path: gathered, original names and layout
        rec["state_err"] = max((state[k] - want[k]).abs().max().item() for k in want)
        rec["state_keys"] = sorted(state) == sorted(want)
        if case.get("ckpt"):  # DCP: written sharded, read into a fresh TP model and into the plain model
            rec |= _checkpoint_errors(gm, want, out / f"ckpt-{case['id']}", world)
    elif case.get("wrap"):  # the user's path: a plan by hand (pp ranks of dp x tp devices) through autoplace.wrap
        graph = autoplace.trace(model, (x0,))
        pp, n = case["pp"], graph.num_nodes
        per = world // pp
        plan = autoplace.Placement.pipeline(graph, autoplace.Cluster.from_devices(["cpu"] * world),
                                            [i * pp // n for i in range(n)],
                                            [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                            microbatches=2, schedule="1f1b", tp=case["tp"],
                                            **{k: case[k] for k in ("shard",) if k in case})
        runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan, example_inputs=(x0,),
                                loss_fn=loss_fn, timeout_s=120, progress=False)
        modules = list(getattr(runner, "stage_modules", [runner.stage_module]))
        losses = tm.train_runner(runner, STEPS, batch)
    else:
        runner = build_schedule_runner(gm, pw.contiguous_stages(gm, case["pp"]), example_inputs=(x0,), microbatches=2,
                                       loss_fn=loss_fn, schedule="1f1b", virtual_stages=1, tp=world // case["pp"],
                                       tp_pairs=[(p.column_path, p.row_path) for p in pairs])
        modules = list(runner.stage_modules)
        losses = tm.train_runner(runner, STEPS, batch)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for mod in modules for n, p in mod.named_parameters()}
    rec |= {"losses": losses, "sharded": sorted({n for mod in modules for n, p in mod.named_parameters()
                                                 if hasattr(p, "full_tensor")}),
            "loss_err": max([abs(a - b) for a, b in zip(losses, want_losses)] or [0.0]),
            "param_err": max((params[n] - want[n]).abs().max().item() for n in params), "checked": sorted(params),
            "worst": max(params, key=lambda n: (params[n] - want[n]).abs().max().item())}
    torch.save(rec, out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
