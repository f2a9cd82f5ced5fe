"""Reduce fidelity_llm's results to what autoplace.claims checks a claimed gain against.

    python benchmarks/published_checks.py   # reads benchmarks/results/fidelity_llm.json and the
                                            # published configurations; writes
                                            # autoplace/data/published_checks.json (shipped) and
                                            # benchmarks/results/published_checks.{json,md}

For every published configuration simulated by ``benchmarks/fidelity_llm.py``, each plan
dimension of :mod:`autoplace.claims` is reduced to its class (:func:`autoplace.evidence.value_class`)
and the row is listed under that class, in band (predicted / measured within
:data:`autoplace.evidence.BAND`) or not; rows not expressible count as simulated with no ratio
(never in band). Published values map to autoplace's as fidelity_llm builds them: shard
``fsdp-grad-op`` is FSDP without resharding after forward; recompute ``full`` every unit,
``every-2nd-block`` some units, ``none`` none (``selective-op`` has no class: op-level); the
pipeline degree is ``pp``; micro-batches per step are global batch / (dp x micro-batch) (the
pipeline's micro-batch count with pp > 1, gradient accumulation otherwise); the schedule only
where pp > 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoplace.evidence import BAND, CHECKS_PATH, value_class  # noqa: E402
from autoplace.report import format_table  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "published" / "llm"
RESULTS = ROOT / "benchmarks" / "results"
RECOMPUTE = {"full": "every unit", "every-2nd-block": "some units", "none": "none"}


def classes(c: dict[str, Any]) -> dict[str, str | None]:
    """The class of every claims dimension for one published configuration."""
    pp, tp, dp = int(c["pp"]), int(c["tp"]), int(c["dp"])
    m = max(int(c["global_batch"]) // max(dp * int(c["micro_batch"]), 1), 1)
    sharded = c["shard"] in ("fsdp", "fsdp-grad-op", "hsdp")
    return {
        "ranks": value_class("ranks", pp),
        "virtual_stages": value_class("virtual_stages", int(c.get("virtual_stages") or 1)),
        "schedule": value_class("schedule", c["schedule"]) if pp > 1 else None,
        "microbatches": value_class("microbatches", m),
        "tp": value_class("tp", tp),
        "sequence_parallel": value_class("sequence_parallel", bool(c.get("sequence_parallel")) and tp > 1),
        "shard": "fsdp" if c["shard"] == "fsdp-grad-op" else value_class("shard", c["shard"]),
        "recompute": RECOMPUTE.get(c["recompute"]),
        "precision": value_class("precision", c["precision"]),
        "reshard_after_forward": value_class("reshard_after_forward", c["shard"] != "fsdp-grad-op") if sharded else None,
    }


def main() -> int:
    fid = json.loads((RESULTS / "fidelity_llm.json").read_text())
    ratio = {r["id"]: r.get("ratio") for r in fid["rows"]}
    configs = {c["id"]: c for p in sorted(DATA.glob("*.json")) for c in json.loads(p.read_text())["configurations"]}
    dims: dict[str, dict[str, dict[str, list[str]]]] = {}
    for rid, c in configs.items():
        if rid not in ratio:
            continue  # not simulated by the results at hand
        r = ratio[rid]
        ok = r is not None and BAND[0] <= r <= BAND[1]
        for dim, cls in classes(c).items():
            if cls is None:
                continue
            slot = dims.setdefault(dim, {}).setdefault(cls, {"rows": [], "in_band": []})
            slot["rows"].append(rid)
            if ok:
                slot["in_band"].append(rid)
    commit = fid.get("meta", {}).get("commit") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                                 capture_output=True, text=True).stdout.strip()
    out = {"source": "benchmarks/results/fidelity_llm.json", "fidelity_llm_commit": commit, "band": list(BAND),
           "dimensions": dims}
    CHECKS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CHECKS_PATH.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    (RESULTS / "published_checks.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    rows = [(d, cls, len(v["rows"]), len(v["in_band"])) for d, per in sorted(dims.items()) for cls, v in sorted(per.items())]
    md = ["# Published checks: which plan differences a published measurement backs", "",
          f"Written by `python benchmarks/published_checks.py` from `benchmarks/results/fidelity_llm.json` "
          f"(fidelity_llm at {commit}). A difference (dimension, chosen class, recipe class) in a claim is checked "
          f"when both classes have a published row the simulator predicts within {BAND[0]:.2f}-{BAND[1]:.2f} "
          "(autoplace/evidence.py); the claims table says which terms are.", "",
          format_table(["dimension", "class", "published rows", "in band"], rows, markdown=True)]
    (RESULTS / "published_checks.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
