"""Checkpoints in the original model's names (autoplace.rewrite.checkpoint) under real torchrun
launches, gloo on CPU, a small Llama trained with Adam: for every runner kind a checkpoint is
written once per key (replicas deduplicated, shards each once), a resumed run's next losses equal
the uninterrupted run's (to 1e-6 under the same plan), a checkpoint written under one plan loads
under another (stage count, replicas, shards, TP or model-parallel changed: to 1e-5), and the
gathered state loads strictly into the plain model, whose outputs equal the unwrapped reference's.
Each launch has a hard timeout and every rank's process group a 60 s one, so a broken peer fails
the test instead of hanging it (pipeline_workers.launch_cases)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autoplace
import pipeline_workers as pw
import test_checkpoint_child as cc
from autoplace import Cluster, Placement
from autoplace.rewrite import checkpoint

CHILD = Path(__file__).with_name("test_checkpoint_child.py")
NON_PERSISTENT = {"rope_cos", "rope_sin"}  # the Llama's register_buffer(persistent=False)
SAME_PLAN, OTHER_PLAN, REFERENCE = 1e-6, 1e-5, 1e-5
MEASURED: dict[str, float] = {}  # cell -> max difference, printed with -s


def _launch(tmp_path: Path, world: int, cases: list[dict[str, Any]], timeout: int) -> dict[str, list[dict[str, Any]]]:
    pw.launch_cases(CHILD, tmp_path, world, cases, timeout)
    return {c["id"]: [json.loads((tmp_path / f"{c['id']}-rank{r}.json").read_text()) for r in range(world)]
            for c in cases}


def _losses(per_rank: list[list[float | None]]) -> list[float]:
    """Each step's loss from the ranks that report it (the last stage's; every rank under FSDP), all equal."""
    out = []
    for step in zip(*per_rank):
        seen = [x for x in step if x is not None]
        assert seen and max(seen) - min(seen) <= 1e-6, step
        out.append(seen[0])
    return out


def _diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def _check_save(cell: str, recs: list[dict[str, Any]]) -> list[float]:
    """save and unwrapped: original names only, each element written once, the gathered state and
    the DCP checkpoint load into the plain model; returns the uninterrupted run's losses."""
    r0 = recs[0]
    model_keys = set(r0["model_keys"])
    for r in recs:
        assert not any(k.startswith("stage_module") for k in r["names"]), r["names"][:3]
        assert set(r["names"]) <= model_keys | NON_PERSISTENT, sorted(set(r["names"]) - model_keys)[:4]
        assert r["full_keys"], cell  # full_state_dict(model=) gives exactly the model's keys, in order
    assert set().union(*(set(r["names"]) for r in recs)) >= model_keys
    assert {f"model.{k}" for k in model_keys} <= set(r0["keys"])
    assert all(n >= 1 and frac == 1.0 for n, frac in r0["chunks"].values()), r0["chunks"]
    losses = _losses([r["losses"] for r in recs])
    MEASURED[f"{cell} vs reference (losses)"] = _diff(losses, r0["ref_losses"])
    assert MEASURED[f"{cell} vs reference (losses)"] <= REFERENCE
    _check_unwrapped(cell, recs)
    MEASURED[f"{cell} dcp into plain model (loss)"] = max(abs(r["dcp_plain_loss"] - losses[cc.SAVE_AT]) for r in recs)
    assert MEASURED[f"{cell} dcp into plain model (loss)"] <= REFERENCE
    return losses


def _check_unwrapped(cell: str, rows: list[dict[str, Any]]) -> None:
    """The gathered state in the plain model: its loss on the next batch is the runner's, to 1e-5; its
    parameters are the reference's to 1e-3 (Adam divides by the root of tiny second moments, which
    turns the summation order's rounding into more than that on a few elements)."""
    runner_next = _losses([[r["next"]] for r in rows])[0]
    MEASURED[f"{cell} unwrapped (next loss)"] = max(abs(r["plain_next"] - runner_next) for r in rows)
    MEASURED[f"{cell} unwrapped (parameters vs reference)"] = max(r["full_param_err"] for r in rows)
    assert MEASURED[f"{cell} unwrapped (next loss)"] <= REFERENCE
    assert MEASURED[f"{cell} unwrapped (parameters vs reference)"] <= 1e-3


def _check_loads(cell: str, recs: list[dict[str, Any]], uninterrupted: list[float], same: str | None) -> None:
    """resume (the load kind ``same``: to 1e-6) and reshard (any other kind: to 1e-5)."""
    for i, load in enumerate(recs[0]["loads"]):
        rows = [r["loads"][i] for r in recs]
        assert all(row["step"] == cc.SAVE_AT for row in rows)
        got = _diff(_losses([row["losses"] for row in rows]), uninterrupted[cc.SAVE_AT:])
        tol = SAME_PLAN if load["kind"] == same else OTHER_PLAN
        MEASURED[f"{cell} -> {load['kind']} (losses)"] = got
        assert got <= tol, (cell, load["kind"], got)
        _check_unwrapped(f"{cell} -> {load['kind']}", rows)


def _placed(tmp_path: Path) -> tuple[Any, Any, Any]:
    wl = cc.fresh(0)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    c = Cluster.from_devices(["cpu", "cpu"])
    plan = Placement.from_assignment(graph, c, np.arange(graph.num_nodes) * 2 // graph.num_nodes)
    placed = autoplace.wrap(wl.model, ["cpu", "cpu"], example_inputs=wl.example_inputs, plan=plan, mode="model",
                            progress=False)
    return wl, placed, torch.optim.Adam(placed.parameters(), lr=cc.LR)


def _train_placed(wl: Any, placed: Any, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    out = []
    for s in steps:
        x, y = cc.batch(wl, s)
        loss = wl.loss_fn(placed(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _model_parallel_run(tmp_path: Path) -> tuple[Path, list[float]]:
    """A model-parallel PlacedModule in this process: save after 2 steps, resume, the names are the
    model's; returns the checkpoint and the uninterrupted losses."""
    wl, placed, opt = _placed(tmp_path)
    ref_losses, _, ref_end = cc.reference(wl)  # before training: the PlacedModule trains the model's parameters
    path = tmp_path / "placed-ckpt"
    losses = _train_placed(wl, placed, opt, range(cc.SAVE_AT))
    checkpoint.save(placed, path, optimizer=opt, step=cc.SAVE_AT)
    losses += _train_placed(wl, placed, opt, range(cc.SAVE_AT, cc.STEPS))
    MEASURED["placed vs reference (losses)"] = _diff(losses, ref_losses)
    assert MEASURED["placed vs reference (losses)"] <= REFERENCE
    full = checkpoint.full_state_dict(placed, model=wl.model)
    assert list(full) == list(wl.model.state_dict())
    wl_b, placed_b, opt_b = _placed(tmp_path)
    assert checkpoint.load(placed_b, path, optimizer=opt_b) == cc.SAVE_AT
    MEASURED["placed -> placed (losses)"] = _diff(_train_placed(wl_b, placed_b, opt_b, range(cc.SAVE_AT, cc.STEPS)),
                                                  losses[cc.SAVE_AT:])
    assert MEASURED["placed -> placed (losses)"] <= SAME_PLAN
    plain = cc.fresh(5).model
    plain.load_state_dict(full)
    x, y = cc.batch(wl, cc.STEPS)
    with torch.no_grad():
        MEASURED["placed unwrapped (next loss)"] = abs(cc.plain_loss(plain, wl, cc.STEPS) - float(wl.loss_fn(placed(x), y)))
    assert MEASURED["placed unwrapped (next loss)"] <= REFERENCE
    assert cc.param_err(full, ref_end) <= 1e-3
    return path, losses


def _into_placed(tmp_path: Path, path: Path, uninterrupted: list[float], cell: str) -> None:
    """A pipeline's checkpoint resumed by a model-parallel PlacedModule in this process."""
    wl, placed, opt = _placed(tmp_path)
    assert checkpoint.load(placed, path, optimizer=opt) == cc.SAVE_AT
    MEASURED[cell] = _diff(_train_placed(wl, placed, opt, range(cc.SAVE_AT, cc.STEPS)), uninterrupted[cc.SAVE_AT:])
    assert MEASURED[cell] <= OTHER_PLAN


def _check_report(recs: list[dict[str, Any]], runner: str, where: str) -> None:
    for r in recs:
        text = r["report"]
        assert text.startswith(f"{runner}: {where}"), text
        for part in ("plan: ", "parameters: ", "schedule: ", "micro-batches", "predicted step: ", " ms"):
            assert part in text, (part, text)


def test_checkpoint_matrix_on_two_processes(tmp_path: Path) -> None:
    placed_ckpt, placed_losses = _model_parallel_run(tmp_path)
    cases = [
        {"id": "pp", "save": "pp", "loads": ["pp", "fsdp", "gpipe"]},
        {"id": "ddp", "save": "ddp", "loads": ["ddp", "tp"]},
        {"id": "fsdp", "save": "fsdp", "loads": ["fsdp", "zbv"]},
        {"id": "zbv", "save": "zbv", "loads": ["zbv", "i1f1b"]},
        {"id": "tp", "save": "tp", "loads": ["tp", "pp"]},
        {"id": "online", "save": "online", "loads": ["online", "fsdp"]},  # OnlinePipeline (one stage per rank)
        {"id": "placed", "ckpt": str(placed_ckpt), "loads": ["pp"]},
        {"id": "consts", "model": "factories"},
    ]
    got = _launch(tmp_path, 2, cases, timeout=900)
    for c in cases[:-2]:
        _check_loads(c["id"], got[c["id"]], _check_save(c["id"], got[c["id"]]), same=c["save"])
    _check_loads("placed", got["placed"], placed_losses, same=None)  # model parallel -> pipeline
    # FSDP shards (2 chunks of each parameter, no replica written twice); TP shards the MLP and attention
    fsdp, tp, ddp = got["fsdp"][0], got["tp"][0], got["ddp"][0]
    assert fsdp["dtensors"] and all(fsdp["chunks"][k][0] == 2 for k in fsdp["dtensors"] if "weight" in k)
    assert any("feed_forward" in k for k in tp["dtensors"])
    assert all(n == 1 for n, _ in ddp["chunks"].values())  # two replicas, each key once
    assert {r["kind"] for r in got["zbv"]} == {"MultiStageRunner"}
    assert {r["kind"] for r in got["online"]} == {"OnlinePipeline"}
    _check_report(got["pp"], "MultiStageRunner", "pipeline rank")
    for r in got["pp"]:  # report(cluster, against=...): the claim over the recipes, with each term's published check
        assert r["against"].startswith(r["report"]) and "ddp recipes on this cluster (simulated):" in r["against"], r["against"]
    _check_report(got["fsdp"], "LoopRunner", "FSDP rank")
    _check_report(got["zbv"], "MultiStageRunner", "pipeline rank")
    assert "replica 1 of 2" in got["ddp"][1]["report"] and "zbv" in got["zbv"][0]["report"]
    # fx's tensor constant is a stage buffer (raw key), not model state: not in the checkpoint, nor gathered
    consts = got["consts"]
    assert any(k.endswith("_tensor_constant0") for r in consts for k in r["raw_keys"])
    assert all(r["saved"] == r["full"] == r["model_keys"] for r in consts), consts[0]
    assert consts[0]["rank0_only"] == consts[0]["model_keys"] and consts[1]["rank0_only"] == []
    _into_placed(tmp_path, tmp_path / "fsdp-ckpt", _losses([r["losses"] for r in got["fsdp"]]), "fsdp -> placed (losses)")
    print("\n".join(f"{k}: {v:.2e}" for k, v in MEASURED.items()))


@pytest.mark.slow
def test_checkpoint_matrix_on_four_processes(tmp_path: Path) -> None:
    """HSDP (2 hosts x 2), pp x dp, 4 stages, and a checkpoint of 2 processes resumed on 4."""
    (tmp_path / "two").mkdir()
    two = _launch(tmp_path / "two", 2, [{"id": "fsdp2", "save": "fsdp", "loads": []}], timeout=600)
    fsdp2 = _check_save("fsdp2", two["fsdp2"])
    cases = [
        {"id": "hsdp", "save": "hsdp", "loads": ["hsdp", "pp"]},
        {"id": "ppdp", "save": "ppdp", "loads": ["ppdp", "tp"]},
        {"id": "from2", "ckpt": str(tmp_path / "two" / "fsdp2-ckpt"), "loads": ["hsdp", "ppdp"]},
    ]
    got = _launch(tmp_path, 4, cases, timeout=1500)
    for c in cases[:2]:
        _check_loads(c["id"], got[c["id"]], _check_save(c["id"], got[c["id"]]), same=c["save"])
    _check_loads("from2", got["from2"], fsdp2, same=None)
    hsdp = got["hsdp"][0]
    # sharded over the 2 devices of a host, replicated across hosts: 2 chunks per weight, not 4
    assert hsdp["dtensors"] and all(hsdp["chunks"][k][0] == 2 for k in hsdp["dtensors"] if "weight" in k)
    _check_report(got["hsdp"], "LoopRunner", "FSDP rank")
    print("\n".join(f"{k}: {v:.2e}" for k, v in MEASURED.items()))


def test_names_and_errors_in_one_process(tmp_path: Path) -> None:
    assert checkpoint.original_name("stage_module.layers.0.w") == "layers.0.w"
    assert checkpoint.original_name("stage_modules.3.layers.0.w") == "layers.0.w"
    assert checkpoint.original_name("stage_modules.0._tensor_constant0") is None
    assert checkpoint.original_name("stage_module.lifted_tensor_2") is None
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(torch.nn.Linear(2, 2), tmp_path / "missing")
    lin = torch.nn.Linear(2, 2)
    checkpoint.save(lin, tmp_path / "lin")
    with pytest.raises(checkpoint.CheckpointError, match="no optimizer state"):
        checkpoint.load(lin, tmp_path / "lin", optimizer=torch.optim.Adam(lin.parameters()))
    # saved before the first step: the optimizer keeps no state (Adam's step count unchanged), and so does a load
    opt = torch.optim.Adam(lin.parameters(), lr=0.1)
    checkpoint.save(lin, tmp_path / "step0", optimizer=opt, step=0)
    assert not opt.state
    twin = torch.nn.Linear(2, 2)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=0.5)
    assert checkpoint.load(twin, tmp_path / "step0", optimizer=twin_opt) == 0
    assert not twin_opt.state and twin_opt.param_groups[0]["lr"] == 0.1  # the saved hyperparameters
    for m, o in ((lin, opt), (twin, twin_opt)):
        m(torch.ones(3, 2)).sum().backward()
        o.step()
    assert torch.equal(lin.weight, twin.weight)
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks 2 parameter\(s\) of this model \(0.bias, 0.weight"):
        checkpoint.load(torch.nn.Sequential(torch.nn.Linear(2, 2)), tmp_path / "lin")
