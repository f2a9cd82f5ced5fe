"""The published large-scale LLM data (benchmarks/data/published/llm) and the harness that
simulates it (benchmarks/fidelity_llm.py): every row cites where its number was read and carries
the inputs of its conversion to a step time, the conversions agree with the tables' other
columns, and one tiny row goes through the harness's plan builder and the simulator."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fidelity_llm.py"


@pytest.fixture(scope="module")
def F() -> Any:
    spec = importlib.util.spec_from_file_location("fidelity_llm", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fidelity_llm"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pubs(F: Any) -> list[dict[str, Any]]:
    return F.load()


def test_files_parse_and_cite_every_number(pubs: list[dict[str, Any]]) -> None:
    assert len(pubs) >= 3
    assert len({p["publication"]["group"] for p in pubs}) >= 3, "independent sources: distinct groups"
    ids: set[str] = set()
    for p in pubs:
        pub = p["publication"]
        for key in ("key", "citation", "where", "numbers_read_in", "precision", "flop_formula", "assumptions"):
            assert pub.get(key), f"{pub.get('key')}: publication.{key} is missing"
        for c in p["configurations"]:
            assert c["id"] not in ids, f"duplicate id {c['id']}"
            ids.add(c["id"])
            assert c["cluster"] in p["clusters"], c["id"]
            assert c["gpus"] == c["tp"] * c["pp"] * c["dp"], c["id"]
            assert c["measured"]["value"] > 0 and c["measured"]["where"], c["id"]
            conv = c["conversion"]
            if c["measured"]["metric"] == "model_tflops_per_gpu":
                for k in ("flop_formula", "seq_len", "vocab", "layers", "hidden", "global_batch", "gpus"):
                    assert k in conv, f"{c['id']}: conversion.{k} is missing"
            else:
                assert conv["tokens_per_step"] == c["global_batch"] * c["seq_len"], c["id"]
                assert conv["gpus"] == c["gpus"], c["id"]
            if c["pp"] > 1:
                assert c["global_batch"] % (c["micro_batch"] * c["dp"]) == 0, f"{c['id']}: micro-batches not whole"
        for s in p.get("sweeps", []):
            assert set(s["rows"]) <= ids and len(s["rows"]) >= 2, s["id"]


def test_the_set_spans_the_scales_and_parallelisms_issue_28_names(pubs: list[dict[str, Any]]) -> None:
    rows = [c for p in pubs for c in p["configurations"]]
    assert len(rows) >= 20
    assert min(c["gpus"] for c in rows) <= 8 and max(c["gpus"] for c in rows) >= 1000
    assert any(c["tp"] > 1 for c in rows) and any(c["pp"] > 1 for c in rows)
    assert any(c["shard"].startswith("fsdp") for c in rows) and any(c["shard"] == "ddp" for c in rows)
    assert any(c["recompute"] != "none" for c in rows) and any(c["recompute"] == "none" for c in rows)
    assert any(c["schedule"] == "interleaved-1f1b" and c["virtual_stages"] > 1 for c in rows)


def test_step_time_conversions_agree_with_the_tables_other_columns(F: Any, pubs: list[dict[str, Any]]) -> None:
    """Megatron: F / (GPUs x per-GPU TFLOP/s) against F / aggregate petaFLOP/s (both columns of
    Table 1, rounded to 3 digits); MosaicML: tokens/s over all GPUs against tokens/s per GPU."""
    checked = 0
    for c in (c for p in pubs for c in p["configurations"]):
        m = c["measured"]
        if "aggregate_pflops" in m:
            via_total = F.megatron_flops(c["conversion"]) / (m["aggregate_pflops"] * 1e15)
            assert F.measured_step_s(c) == pytest.approx(via_total, rel=0.02), c["id"]
            # the paper's formula counts the recomputed forward: 4 x 24 B s l h^2 at least
            cv = c["conversion"]
            dense = 96 * cv["global_batch"] * cv["seq_len"] * cv["layers"] * cv["hidden"] ** 2
            assert F.megatron_flops(cv) > dense
            checked += 1
        if "tokens_per_s" in m:
            assert m["tokens_per_s"] / c["gpus"] == pytest.approx(m["value"], rel=0.01), c["id"]
            assert F.measured_step_s(c) == pytest.approx(c["conversion"]["tokens_per_step"] / m["tokens_per_s"],
                                                         rel=0.01)
            checked += 1
    assert checked >= 20


def _tiny_row(**kw: Any) -> dict[str, Any]:
    row = {"id": "tiny", "model": {"zoo": "gpt2", "config": {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                                                            "n_positions": 32, "seq_len": 32}},
           "cluster": "c", "gpus": 8, "tp": 1, "pp": 2, "dp": 4, "shard": "ddp", "precision": "fp32",
           "recompute": "none", "schedule": "1f1b", "virtual_stages": 1, "micro_batch": 2, "global_batch": 16,
           "seq_len": 32, "extras": [],
           "measured": {"metric": "tokens_per_s_per_gpu", "value": 1000.0, "where": "test"},
           "conversion": {"tokens_per_step": 16 * 32, "gpus": 8}}
    row.update(kw)
    return row


SPEC = {"gpu": "A100-80GB", "gpus_per_host": 4, "intra_host": "nvlink3-switch", "network_gbps": 200,
        "nics_per_host": 4, "network_transport": "rdma"}


def test_one_small_row_is_placed_as_published_and_simulates(F: Any) -> None:
    pytest.importorskip("torch")
    row = _tiny_row()
    graphs = F.Graphs()
    g = graphs.get(row["model"], row["global_batch"])
    cluster = F.build_cluster(SPEC, 8, "c")
    assert cluster.bandwidth(0, 3) > cluster.bandwidth(0, 4)  # NVSwitch inside a host, a NIC between hosts
    if "host_nics" in F.Device.__dataclass_fields__:  # the simulator's multi-rail rings read it
        assert {d.host_nics for d in cluster.devices} == {SPEC["nics_per_host"]}
    pl = F.plan_values(row, g, cluster)
    # Megatron's rank order: stage k holds GPUs k*dp*tp .. (k+1)*dp*tp - 1; layers split evenly
    assert pl.stage_devices == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pl.microbatches == row["global_batch"] // (row["micro_batch"] * row["dp"])
    block = F.block_of_node(g)
    st = np.asarray(pl.stage_of_node)
    assert set(block[st == 0].tolist()) == {0, 1} and set(block[st == 1].tolist()) == {2, 3}
    out = F.run_row(row, SPEC, graphs, F.CostModel())
    assert "ratio" in out, out.get("not_expressible")
    assert math.isfinite(out["step_s"]) and out["step_s"] > 0
    assert out["ratio"] == pytest.approx(out["step_s"] / F.measured_step_s(row))


def test_a_setting_outside_the_plan_space_is_recorded_not_dropped(F: Any) -> None:
    pytest.importorskip("torch")
    out = F.run_row(_tiny_row(extras=["float8"]), SPEC, F.Graphs(), F.CostModel())
    assert "ratio" not in out and "float8" in out["not_expressible"]
    assert out.get("nearest_changes") and "nearest_ratio" in out  # the bf16-free nearest plan still simulates
    s = F.summarize([out], [{"publication": {"key": "t"}, "configurations": [_tiny_row()], "sweeps": []}])
    assert s["not_expressible"] == 1 and s["share_within_all_rows"] == 0.0 and not s["met"]["share_within"]


def test_memory_compares_reserved_with_a_ratio_fitted_on_the_fit_part_only(F: Any) -> None:
    from fidelity_llm_report import memory_check, reserved_ratio
    rows = [{"id": "fit", "measured_memory_gib": 80.0, "peak_gib": 64.0, "memory_fit_part": True},
            {"id": "held", "measured_memory_gib": 60.0, "peak_gib": 50.0, "memory_fit_part": False},
            {"id": "refused", "measured_memory_gib": 70.0, "nearest_peak_gib": 56.0, "memory_fit_part": False},
            {"id": "no-memory", "peak_gib": 10.0}]
    assert reserved_ratio(rows) == pytest.approx(1.25)
    m = memory_check(rows)
    assert m["rows"] == 3 and m["per_row"]["held"]["reserved_gib"] == pytest.approx(62.5)
    assert m["per_row"]["held"]["within"] and m["per_row"]["fit"]["within"]
    # a refused row is not met, even where its nearest plan's figure is close (it is a diagnostic)
    assert m["per_row"]["refused"]["nearest_reserved_over_measured"] == pytest.approx(1.0)
    assert not m["per_row"]["refused"]["within"]
    assert (m["within"], m["held_out"], m["held_out_expressible"], m["held_out_within"]) == (2, 2, 1, 1)
    assert m["within_allocated_only"] == 0
    # the held-out figures do not move the ratio; the fit part does
    moved = [dict(r, measured_memory_gib=30.0) if r["id"] == "held" else r for r in rows]
    assert reserved_ratio(moved) == pytest.approx(1.25) and not memory_check(moved)["per_row"]["held"]["within"]
    assert reserved_ratio([dict(r, memory_fit_part=False) for r in rows]) is None
    # the published memory rows name their fit part
    assert F.in_memory_fit_part("tt-h100-llama31-8b-fsdp-8") and not F.in_memory_fit_part("tt-h100-llama31-8b-fsdp-128")


def test_a_one_stage_fsdp_row_lists_the_terms_of_its_memory(F: Any) -> None:
    pytest.importorskip("torch")
    row = _tiny_row(pp=1, dp=8, shard="fsdp", precision="bf16", recompute="selective-op",
                    measured={"metric": "tokens_per_s_per_gpu", "value": 1000.0, "where": "test", "memory_gib": 1.0})
    out = F.run_row(row, SPEC, F.Graphs(), F.CostModel())
    terms = out["memory_terms"]
    assert isinstance(terms, dict) and terms["gradient shards at the peak"] >= 0.0
    assert terms["saved activations"] > 0 and terms["parameter shards and optimizer state"] > 0
    # the terms are the simulator's loop peak (at most the shards it still counts beside the peak)
    assert sum(terms.values()) <= out["peak_gib"] * (1 + 1e-9)
    assert out["peak_gib"] - sum(terms.values()) <= terms["parameter shards and optimizer state"]
    pipeline = F.run_row(_tiny_row(measured=row["measured"]), SPEC, F.Graphs(), F.CostModel())
    assert pipeline["memory_terms"] is None  # per virtual stage (stage_cost), not listed
