"""Which differences between two plans a published measurement checks.

A claimed gain over an expert recipe (:mod:`autoplace.claims`) is the simulator's, term by term.
A term is *checked* when the simulator predicts published, measured training runs within
:data:`BAND` both for plans with the chosen value of that dimension and for plans with the
recipe's value (both sides of the difference have been measured somewhere and the simulator got
them right); otherwise the term rests on the simulator alone. :data:`CLAIM_LIMIT`: a gain above
it that any unchecked term carries is reported as the simulator's estimate, not as a claim
(issue 28: no claimed gain over 1.15x on a term without a published measurement behind it).

The published rows are ``benchmarks/data/published/llm/`` (Megatron-LM SC'21, MosaicML
llm-foundry, torchtitan), simulated as published by ``benchmarks/fidelity_llm.py``;
``benchmarks/published_checks.py`` reduces those results to ``autoplace/data/published_checks.json``
(shipped: per dimension, the value classes of :func:`value_class` with the rows that have them,
in band or not, and the commit the results came from). Rerun it when fidelity_llm's results
change.

Values are compared by class, not exactly (a published table never has this cluster's exact
micro-batch count or stage cuts): see :func:`value_class`. ``stage_cuts`` has no class: where
exactly a pipeline is cut is never published, so a term carried by the cuts is always unchecked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["BAND", "CLAIM_LIMIT", "CHECKS_PATH", "Check", "value_class", "check", "load_checks"]

BAND = (0.80, 1.25)
"""predicted / measured step time within this range: the simulator got a published row right."""

CLAIM_LIMIT = 1.15
"""a gain above this must rest on checked terms only to be called a claim."""

CHECKS_PATH = Path(__file__).resolve().parent / "data" / "published_checks.json"


def value_class(dim: str, value: Any) -> str | None:
    """The class of one plan dimension's value, as :mod:`autoplace.claims` spells the
    dimensions (its ``_spec`` values) and as published rows are reduced to it; None: no class
    (never published, e.g. the stage cuts). Recompute: ``"none"``, ``"every unit"``, ``"some
    units"`` (``value``: claims' words for it); ranks: one
    rank or several (the pipeline degree, from the rank list or an int); micro-batches: 1 or
    more; virtual stages: 1 or more; the others their value."""
    if dim == "stage_cuts":
        return None
    if dim == "ranks":
        n = value if isinstance(value, int) else len(value)
        return "one rank" if n == 1 else "several ranks"
    if dim == "microbatches":
        return "M=1" if int(value) == 1 else "M>1"
    if dim == "virtual_stages":
        return "v=1" if int(value) == 1 else "v>1"
    if dim == "recompute":  # claims' words: "none", "every unit", "N units"
        if not isinstance(value, str):
            raise TypeError(f"recompute's class needs the unit count: pass 'none', 'every unit' or 'N units', not {value!r}")
        return value if value in ("none", "every unit") else "some units"
    if isinstance(value, tuple):
        return None if len(set(value)) != 1 else str(value[0])
    return str(value)


@dataclass(frozen=True)
class Check:
    """What the published rows say about one difference (dimension, chosen class, recipe class)."""

    dimension: str
    chosen: str | None
    recipe: str | None
    in_band: tuple[int, int]
    """published rows in :data:`BAND` with the chosen class and with the recipe's."""
    rows: tuple[int, int]
    """published rows simulated with each class (in band or not)."""

    @property
    def checked(self) -> bool:
        return self.in_band[0] > 0 and self.in_band[1] > 0

    def words(self) -> str:
        if self.chosen is None or self.recipe is None:
            return "no: never published"
        if self.checked:
            return f"yes: {self.in_band[0]} / {self.in_band[1]} rows in band"
        miss = [f"{c!r} ({n} of {t} rows in band)" for c, n, t in
                ((self.chosen, self.in_band[0], self.rows[0]), (self.recipe, self.in_band[1], self.rows[1])) if n == 0]
        return "no: " + ", ".join(miss)


@lru_cache(maxsize=4)
def load_checks(path: str | None = None) -> dict[str, Any]:
    """The shipped reduction of the published rows (empty dimensions when the file is absent)."""
    p = Path(path) if path is not None else CHECKS_PATH
    if not p.exists():
        return {"dimensions": {}, "source": f"absent: {p}"}
    return dict(json.loads(p.read_text()))


def check(dim: str, chosen: Any, recipe: Any, *, checks: dict[str, Any] | None = None) -> Check:
    """The published check of switching ``dim`` from the recipe's value to the chosen one
    (values as :func:`value_class` takes them)."""
    data = checks if checks is not None else load_checks()
    per = data.get("dimensions", {}).get(dim, {})
    a, b = value_class(dim, chosen), value_class(dim, recipe)

    def count(c: str | None) -> tuple[int, int]:
        got = per.get(c, {}) if c is not None else {}
        return len(got.get("in_band", [])), len(got.get("rows", []))

    (ia, ta), (ib, tb) = count(a), count(b)
    return Check(dim, a, b, (ia, ib), (ta, tb))
