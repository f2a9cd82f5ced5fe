"""Placement.meta is typed (placement.PlacementMeta): every key a planner, the report, the exports
or online tuning writes for another layer to read is declared there with its writer and reader. A
Placement with an undeclared key is refused where it is built (a misspelt key fails loudly instead
of being read as absent); a saved plan whose meta has a key no longer declared still loads, without
that key and with a warning."""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.graph.ir import OpGraph
from autoplace.placement import PlacementError, PlacementMeta, meta_problems

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _chain(n: int = 4, batch: int = 8) -> OpGraph:
    f = np.full(n, 2e11)
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, 4e6), param_bytes=np.full(n, 4e7), fwd_flops=f, bwd_flops=2 * f,
                         batch_size=batch)


def test_an_undeclared_key_is_refused_where_the_placement_is_built() -> None:
    g, c = _chain(), Cluster.preset("4xV100-pcie")
    with pytest.raises(PlacementError, match=r"'predicted_step_tme_s'.*PlacementMeta does not declare.*"
                                             r"did you mean 'predicted_step_time_s'\?.*add this one to PlacementMeta"):
        Placement.from_assignment(g, c, [0, 0, 1, 1], meta={"predicted_step_tme_s": 1.0})
    with pytest.raises(PlacementError, match="'stage_modles'"):
        Placement.pipeline(g, c, [0, 0, 1, 1], [0, 1], microbatches=2, meta={"stage_modles": [["a"], ["b"]]})


def test_an_undeclared_key_is_refused_where_meta_is_written() -> None:
    g, c = _chain(), Cluster.preset("4xV100-pcie")
    p = Placement.from_assignment(g, c, [0, 0, 1, 1], meta={"predicted_step_time_s": 1.0})
    assert p.meta == {"predicted_step_time_s": 1.0, "batch_size": 8}
    # the planners write meta by replacing it (dataclasses.replace runs the same check)
    with pytest.raises(PlacementError, match=r"\['tie_rules'\]|'tie_rules'"):
        dataclasses.replace(p, meta={**p.meta, "tie_rules": {}})  # type: ignore[typeddict-unknown-key]
    assert dataclasses.replace(p, meta={**p.meta, "tie_rule": {}}).meta["tie_rule"] == {}
    with pytest.raises(PlacementError, match="'nope'"):
        Placement("model", [0, 0, 1, 1], meta={"nope": 1})  # type: ignore[arg-type,typeddict-unknown-key]
    # and when it is written in place
    with pytest.raises(PlacementError, match=r"'favorite_children'.*did you mean 'favourite_children'\?"):
        p.meta["favorite_children"] = 3  # type: ignore[typeddict-unknown-key]
    with pytest.raises(PlacementError, match="'plan_time'"):
        p.meta.update({"plan_time": 1.0})  # type: ignore[misc]
    with pytest.raises(PlacementError, match="'plan_time'"):
        p.meta.setdefault("plan_time", 1.0)  # type: ignore[typeddict-item]
    p.meta["favourite_children"] = 3
    assert p.meta == {"predicted_step_time_s": 1.0, "batch_size": 8, "favourite_children": 3}
    assert pickle.loads(pickle.dumps(p)).meta == p.meta and copy.deepcopy(p).meta == p.meta
    assert json.loads(json.dumps(p.to_dict()))["meta"] == p.meta
    assert meta_problems({"batch_size": 8, "candidates": []}) == []
    assert len(meta_problems({"a": 1, "b": 2, "batch_size": 1})) == 2


def test_an_old_plan_file_with_an_unknown_key_loads_without_it(tmp_path: Path) -> None:
    g, c = _chain(), Cluster.preset("4xV100-pcie")
    p = Placement.pipeline(g, c, [0, 0, 1, 1], [0, 1], microbatches=2, meta={"predicted_step_time_s": 0.5})
    d = p.to_dict()
    d["meta"] = {**d["meta"], "retired_key": [1, 2]}
    path = tmp_path / "old_plan.json"
    path.write_text(json.dumps(d))
    with pytest.warns(UserWarning, match=r"\['retired_key'\].*PlacementMeta does not declare.*dropped"):
        back = Placement.from_json(path)
    assert back == p and back.meta == p.meta  # the plan itself is unchanged; only the unknown key is gone
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan this autoplace saved loads with no warning
        assert Placement.from_dict(p.to_dict()).meta == p.meta


def test_the_plans_saved_in_benchmark_results_hold_only_declared_keys() -> None:
    """Plans an earlier autoplace wrote (benchmarks/results, their op lists left out): every meta
    key they hold is declared, so they load without a warning."""
    found: list[dict] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if x.get("format") == "autoplace.Placement/1":
                found.append(x)
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for name in ("fsdp.json", "online_kinds.json", "online_kinds_confirm0.json", "online_kinds_subset_70034f9.json"):
        if (RESULTS / name).exists():
            walk(json.loads((RESULTS / name).read_text()))
    if not found:
        pytest.skip("no saved plans under benchmarks/results")
    undeclared = sorted({q for d in found for q in meta_problems(d.get("meta", {}))})
    assert not undeclared, undeclared


def test_a_planners_answer_carries_only_declared_keys() -> None:
    """plan() end to end (heuristics, the schedule pass, the reserve): its meta survives the check
    and a JSON round trip."""
    g, c = _chain(8), Cluster.preset("4xV100-pcie")
    p = autoplace.plan(g, c, planner="best", mode="pipeline")
    assert {"predicted_step_time_s", "candidates", "budget_s", "tie_rule", "memory_reserve_bytes"} <= set(p.meta)
    assert Placement.from_dict(json.loads(json.dumps(p.to_dict()))).meta.keys() == p.meta.keys()


def test_every_declared_key_says_who_writes_and_who_reads_it() -> None:
    """Each key of PlacementMeta is followed by a docstring naming its writer and, after ``->``,
    its readers, or saying "(no reader)"."""
    tree = ast.parse(inspect.getsource(PlacementMeta))
    body = tree.body[0].body  # type: ignore[attr-defined]
    undocumented = []
    for k, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = body[k + 1] if k + 1 < len(body) else None
            text = str(doc.value.value) if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) else ""
            if "->" not in text and "(no reader" not in text:
                undocumented.append(node.target.id)
    assert not undocumented, f"PlacementMeta keys without writer -> reader: {undocumented}"
    assert len(PlacementMeta.__optional_keys__) >= 80
