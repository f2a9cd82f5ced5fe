"""bf16 mixed precision on DDP stages (:mod:`autoplace.rewrite.mixed_precision`), the Megatron-style
plans: 2 DDP replicas, a 2-stage pipeline of 2 DDP replicas each, interleaved 1F1B (2 ranks x 2
stages) of 2 DDP replicas, TP2 x DDP2 (and TP2 x FSDP2), each with bf16 (and recompute, whose
checkpoints must cast again), under a real `torchrun` launch (gloo, CPU) through
``autoplace.wrap(mode="pipeline", plan=...)``.

The reference is the unsplit model in the same mixed precision on torch's own engine: FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` on a one-rank mesh (the semantics
the DDP stages claim; torch's DDP ``mixed_precision`` cannot run on CPU). What each run must show:

- the same forward: the first step's loss (every parameter still equal) within 1e-6 of the
  reference's, where the fp32 model's is 3e-5 away (checked, so the test can tell the two apart);
  TP excepted: its row-parallel partial sums are rounded to bf16 before they are added, so its
  tokens differ by bf16 roundings there, and it gets the training tolerance; so does interleaved
  1F1B, whose 4 stages cut blocks, so that values the reference keeps in fp32 inside a block cross
  a stage boundary in bf16;
- training: 5 SGD steps, losses within 1e-3 and parameters within 2e-3 of the reference. The
  runs differ from it only in how gradients are rounded (per replica and micro-batch, then once
  more for the bf16 all-reduce, where the reference rounds the whole batch's once); 2e-3 is
  about half a bf16 step (2^-8) at the parameters' scale, checked to be at most 2, the bound
  the bf16 FSDP tests use;
- the same training as autoplace's FSDP bf16 stages: TP2 x DDP2 and TP2 x FSDP2 with bf16 give the
  same losses (to 1e-6; with 2 micro-batches per replica, FSDP2's bf16 accumulation and the DDP
  stage's fp32 accumulation round the same sum once);
- the mechanism: a Linear inside each stage computes in bf16, the optimizer's parameters are
  fp32, and every gradient after a step is a bf16 value (the all-reduce ran in bf16; an fp32
  reduction of two replicas' or micro-batches' gradients leaves values between bf16 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_workers as pw

CHILD = Path(__file__).with_name("bf16_ddp_child.py")

DDP2 = [{"id": "ddp2", "model": "llama", "pp": 1}]
FOUR = [
    {"id": "pp2_ddp2_ac", "model": "llama", "pp": 2, "recompute": True},
    {"id": "tp2_ddp2_ac", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe", "recompute": True,
     "microbatches": 1},
    {"id": "i1f1b_ddp2", "model": "llama", "pp": 2, "v": 2, "schedule": "interleaved-1f1b"},  # one DDP per stage
    # the same plan on FSDP2's MixedPrecisionPolicy: the DDP run must train as it does. One micro-batch:
    # a one-stage plan runs FSDP's own loop, which reduce-scatters (in bf16) after every micro-batch and
    # sums the shards in fp32, where DDP reduces once a step; with 2 micro-batches the gradients are then
    # not bf16 values and the losses part after step 1 (3.43255 vs 3.43249), as FSDP's loop did before
    # the one runtime path too (FSDPRunner at 26e06b1: 22590 of 55440 gradient elements not bf16)
    {"id": "tp2_fsdp2_ac", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe", "recompute": True,
     "shard": "fsdp", "microbatches": 1},
]


def _check(tmp_path: Path, ranks: int, cases: list[dict]) -> None:
    for c in cases:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)]
        last = [p for p in parts if p["losses"]]
        assert last and all(len(p["losses"]) == 5 for p in last), c
        for p in last:
            first16 = abs(p["losses"][0] - p["ref16_losses"][0])
            first32 = abs(p["losses"][0] - p["ref32_losses"][0])
            assert abs(p["ref16_losses"][0] - p["ref32_losses"][0]) > 1e-5, c  # bf16 shows in this model's loss
            if c.get("tp", 1) == 1 and c.get("v", 1) == 1:
                assert first16 <= 1e-6 < first32, (c, first16, first32)
            assert p["loss_err16"] <= 1e-3, (c, p["losses"], p["ref16_losses"])
        for p in parts:
            assert p["param_scale"] <= 2.0, c
            assert p["param_err16"] <= 2e-3, (c, p["param_err16"])
            assert p["compute_dtypes"] == ["torch.bfloat16"], (c, p["compute_dtypes"])
            assert p["param_dtypes"] == ["torch.float32"], (c, p["param_dtypes"])
            assert p["grads"] > 0 and p["not_bf16"] == 0, (c, p["not_bf16"], p["grads"])
        if c.get("recompute"):
            assert any(p["units"] for p in parts), c


@pytest.mark.slow
def test_bf16_ddp_on_2_processes_trains_as_the_unsplit_model_in_bf16(tmp_path: Path) -> None:
    pw.launch_cases(CHILD, tmp_path, 2, DDP2, timeout=400)
    _check(tmp_path, 2, DDP2)
    assert all(torch.load(tmp_path / f"ddp2-rank{r}.pt")["kind"] == "LoopRunner" for r in range(2))


@pytest.mark.slow
def test_bf16_pipeline_and_tp_with_ddp_replicas_on_4_processes(tmp_path: Path) -> None:
    pw.launch_cases(CHILD, tmp_path, 4, FOUR, timeout=600)
    _check(tmp_path, 4, FOUR)
    ddp, fsdp = (torch.load(tmp_path / f"{c}-rank3.pt") for c in ("tp2_ddp2_ac", "tp2_fsdp2_ac"))
    assert max(abs(a - b) for a, b in zip(ddp["losses"], fsdp["losses"])) <= 1e-6, (ddp["losses"], fsdp["losses"])


# ---- in one process -----------------------------------------------------------------------------


def _llama_stage():  # type: ignore[no-untyped-def]
    import tp_models as tm

    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.pipeline import split_with_boundaries
    from autoplace.rewrite.units import outline_units, unit_of_fx

    x, y = tm.batch(8, 0)
    traced = trace_module(tm.build("llama", 0), (x,))
    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    units = outline_units(stage, unit_of_fx(traced), like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes})
    return stage, units, x, y, tm.loss


def test_a_bf16_ddp_stage_computes_in_bf16_on_fp32_parameters_and_recomputes_in_bf16() -> None:
    import copy

    from autoplace.rewrite.units import shard_stage

    stage, units, x, y, loss_fn = _llama_stage()
    names = [n for n, _ in stage.named_parameters()]
    plain, recomputed = stage, copy.deepcopy(stage)
    seen: list[torch.dtype] = []
    for mod, rc in ((plain, False), (recomputed, True)):
        shard_stage(mod, units, None, shard="ddp", recompute=rc, bf16=True, reshard_after_forward=False,
                    output_dtype=torch.float32)
    probe = next(m for m in recomputed.get_submodule(units[1]).modules() if isinstance(m, torch.nn.Linear))
    probe.register_forward_hook(lambda _m, _i, o: seen.append(o.dtype))
    outs = []
    for mod in (plain, recomputed):
        out = mod(x)
        assert out.dtype == torch.float32  # the last stage's outputs leave in fp32, for the loss
        loss_fn(out, y).backward()
        outs.append(out.detach())
    assert seen == [torch.bfloat16, torch.bfloat16]  # forward, then the recompute in backward: both bf16
    assert torch.equal(outs[0], outs[1])
    assert [n for n, _ in recomputed.named_parameters()] == names  # state_dict keys unchanged
    for (n, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert isinstance(b, torch.nn.Parameter) and b.dtype == torch.float32 and b.grad is not None
        assert b.grad.dtype == torch.float32 and torch.equal(a.grad, b.grad), n  # recompute changes nothing
    fp32_out = _llama_stage()[0](x)
    assert (fp32_out - outs[0]).abs().max() > 1e-3  # it did compute in bf16


def test_batch_norm_runs_in_fp32_inside_a_bf16_ddp_stage() -> None:
    # torch's CPU BatchNorm refuses bf16 weights beside fp32 running statistics; it runs in fp32
    # (FSDP1's default for BatchNorm) between bf16 convolutions
    import autoplace.zoo as zoo
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.pipeline import split_with_boundaries
    from autoplace.rewrite.units import outline_units, shard_stage, unit_of_fx

    wl = zoo.build("resnet18", small=True)
    traced = trace_module(wl.model, wl.example_inputs)
    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    units = outline_units(stage, unit_of_fx(traced), like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes})
    shard_stage(stage, units, None, shard="ddp", recompute=False, bf16=True, reshard_after_forward=False,
                output_dtype=torch.float32)
    dtypes: dict[str, set[torch.dtype]] = {"conv": set(), "bn": set()}
    for m in stage.modules():
        kind = "conv" if isinstance(m, torch.nn.Conv2d) else "bn" if isinstance(m, torch.nn.BatchNorm2d) else None
        if kind:
            m.register_forward_hook(lambda _m, _i, o, k=kind: dtypes[k].add(o.dtype))
    out = stage(*wl.example_inputs)
    wl.loss_fn(out, wl.target).backward()
    # BN ran in fp32 (torch refuses its bf16 weights beside fp32 statistics); its output returns in bf16
    assert dtypes == {"conv": {torch.bfloat16}, "bn": {torch.bfloat16}}
    assert all(p.dtype == torch.float32 and p.grad is not None for p in stage.parameters())
