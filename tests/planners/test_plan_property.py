"""plan() answers on every cluster shape: a Placement that is valid (and, for pipeline plans,
one the runtime runs), or an AutoplaceError with its reason; never another exception.

The default run covers a representative subset (every profile and zoo model at least once, every
cluster shape and mode at least once) at short budgets; ``-m slow`` runs the whole cross product
(``benchmarks/plan_property.py`` runs it too and writes the counts to benchmarks/results/).
Regression tests of the crashes it found sit at the end.
"""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace.cluster import Cluster
from autoplace.placement import Placement
from autoplace.planners.heuristic.schedules import best_schedule

from conftest import PIPEDREAM_DIR, pipedream_path


# ---- regressions of crashes the property test found ------------------------------------------


def test_best_schedule_without_a_microbatch_option_for_the_plans_replicas_skips_that_sweep() -> None:
    """3 stages x 4 replicas at M=3 on a batch of 32: no M with 4 x M dividing 32 among the
    plan's M and 3, 6, 12, so the pp x dp sweep over the plan's own replicas has no micro-batch
    option; it used to index ms[0] of an empty list (IndexError in sweep). It is skipped, and
    said in the notes."""
    g = autoplace.load_pipedream(pipedream_path("gnmt"))
    c = Cluster.homogeneous("V100-PCIe-16GB", 4, "pcie3", hosts=3)
    n = g.num_nodes
    st = np.minimum(np.arange(n) * 3 // n, 2)
    p = Placement.pipeline(g, c, st, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], microbatches=3)
    assert g.batch_size == 32
    choice = best_schedule(g, c, p)
    assert not choice.placement.problems(g, c)
    assert any("dp=4" in note and "no micro-batch count" in note for note in choice.notes), choice.notes
