"""autoplace.evidence: a claimed gain over CLAIM_LIMIT must rest on differences that published
measurements check; the shipped checks file is fidelity_llm's results reduced (never stale)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from autoplace.claims import Claim, Term
from autoplace.evidence import CHECKS_PATH, CLAIM_LIMIT, check, load_checks, value_class

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {"dimensions": {
    "shard": {"fsdp": {"rows": ["a", "b"], "in_band": ["a"]}, "ddp": {"rows": ["c"], "in_band": []}},
    "recompute": {"every unit": {"rows": ["a"], "in_band": ["a"]}, "none": {"rows": ["b"], "in_band": ["b"]}},
    "schedule": {"1f1b": {"rows": ["d"], "in_band": ["d"]}},
}}


def test_a_difference_is_checked_only_when_both_sides_are_predicted_right_somewhere() -> None:
    assert check("recompute", "none", "every unit", checks=CHECKS).checked
    ddp = check("shard", "fsdp", "ddp", checks=CHECKS)
    assert not ddp.checked and ddp.in_band == (1, 0) and ddp.rows == (2, 1) and "'ddp' (0 of 1 rows in band)" in ddp.words()
    zb = check("schedule", "zb-h1", "1f1b", checks=CHECKS)
    assert not zb.checked and zb.in_band == (0, 1)  # never published: unchecked
    cuts = check("stage_cuts", [0, 1], [0, 0], checks=CHECKS)
    assert not cuts.checked and cuts.words() == "no: never published"  # where a pipeline is cut is never published


def test_value_classes() -> None:
    assert value_class("ranks", ((0, 1), (2, 3))) == value_class("ranks", 4) == "several ranks"
    assert value_class("ranks", 1) == "one rank" and value_class("microbatches", 1) == "M=1"
    assert value_class("microbatches", 8) == value_class("microbatches", 2) == "M>1"
    assert value_class("recompute", "12 units") == "some units" and value_class("recompute", "every unit") == "every unit"
    assert value_class("shard", ("fsdp", "fsdp")) == "fsdp" and value_class("shard", ("fsdp", "ddp")) is None
    with pytest.raises(TypeError, match="unit count"):
        value_class("recompute", frozenset({"blocks.0"}))


def _claim(gain: float, terms: list[tuple[str, float | None, bool]]) -> Claim:
    ts = []
    for dim, ratio, checked in terms:
        c = check(dim, "none", "every unit", checks=CHECKS) if checked else check(dim, "fsdp", "ddp", checks=CHECKS)
        ts.append(Term(dim, "x", "y", None if ratio is None else ratio, ratio, check=c))
    return Claim("recipe", 1.0, gain, False, False, tuple(ts))


def test_a_gain_over_the_limit_on_an_unchecked_term_is_not_a_claim() -> None:
    big = _claim(1.30, [("recompute", 1.10, True), ("shard", 1.18, False)])
    assert not big.is_claim and [t.dimension for t in big.unchecked] == ["shard"]
    assert "NOT A CLAIM" in big.table() and "shard" in big.table().split("NOT A CLAIM")[1]
    assert _claim(1.30, [("recompute", 1.30, True)]).is_claim  # carried by checked terms
    assert _claim(CLAIM_LIMIT - 0.01, [("shard", 1.14, False)]).is_claim  # small gains are claims as before
    assert not _claim(1.30, [("recompute", 1.1, True), ("shard", None, False)]).is_claim  # unpriced: carries
    assert _claim(1.30, [("recompute", 1.3, True), ("shard", 0.98, False)]).is_claim  # an unchecked term that costs


def _reduce() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("published_checks", ROOT / "benchmarks" / "published_checks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_checks"] = mod
    spec.loader.exec_module(mod)
    return mod  # type: ignore[no-any-return]


def test_published_values_map_as_fidelity_llm_builds_them() -> None:
    mod: Any = _reduce()
    row = dict(pp=4, tp=8, dp=32, global_batch=1536, micro_batch=1, shard="fsdp-grad-op", recompute="every-2nd-block",
               schedule="interleaved-1f1b", virtual_stages=3, precision="bf16", sequence_parallel=True)
    got = mod.classes(row)
    assert got["reshard_after_forward"] == "False" and got["shard"] == "fsdp" and got["recompute"] == "some units"
    assert got["ranks"] == "several ranks" and got["microbatches"] == "M>1" and got["virtual_stages"] == "v>1"
    assert got["schedule"] == "interleaved-1f1b" and got["tp"] == "8" and got["sequence_parallel"] == "True"
    one = mod.classes(dict(row, pp=1, tp=1, shard="ddp", recompute="selective-op", global_batch=32))
    assert one["schedule"] is None and one["recompute"] is None and one["reshard_after_forward"] is None


def test_the_shipped_checks_are_fidelity_llms_results_reduced() -> None:
    fid = ROOT / "benchmarks" / "results" / "fidelity_llm.json"
    if not fid.exists():
        pytest.skip("no benchmarks/results/fidelity_llm.json")
    shipped = json.loads(CHECKS_PATH.read_text())
    ratio = {r["id"]: r.get("ratio") for r in json.loads(fid.read_text())["rows"]}
    in_band = {rid for rid, r in ratio.items() if r is not None and 0.8 <= r <= 1.25}
    for dim, per in shipped["dimensions"].items():
        for cls, v in per.items():
            assert set(v["in_band"]) == set(v["rows"]) & in_band, (dim, cls, "rerun benchmarks/published_checks.py")
    assert set().union(*(set(v["rows"]) for v in shipped["dimensions"]["precision"].values())) == set(ratio)
    assert load_checks()["dimensions"] == shipped["dimensions"]
