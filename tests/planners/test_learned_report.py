"""Every learned planner fills the one LearnedReport, in placement.meta["learned"]."""

from __future__ import annotations

import json

import pytest

import autoplace
from autoplace.placement import Placement
from autoplace.planners.learned.eagle.planner import EagleConfig
from autoplace.planners.learned.mars.planner import MarsConfig
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig
from autoplace.planners.learned.reinforce import ReinforceConfig
from autoplace.planners.learned.run import LearnedReport
from autoplace.planners.registry import get_planner, planners

from planner_graphs import chain

SMALL = {"eagle": EagleConfig(groups=3, hidden=8, quick_samples=8, progress=False),
         "reinforce": ReinforceConfig(max_items=4, hidden=8, quick_samples=8, progress=False),
         "mars": MarsConfig(), "pipeline-rl": PipelineRLConfig(prior_samples=8, imitation_steps=4, quick_samples=8)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Mars without shipped weights
@pytest.mark.parametrize("name", [n for n in planners() if get_planner(n).kind == "learned"])
def test_every_learned_planner_fills_the_report(name: str) -> None:
    p = get_planner(name)
    mode = p.modes[0]
    out = autoplace.plan(chain(6), "4xV100-pcie", planner=name, mode=mode, config=SMALL.get(name))
    report = LearnedReport.of(out)
    assert report is not None and report.planner == name
    assert report.samples >= 1 and report.seeds and report.reference_step_time_s > 0
    assert report.source in ("sample", "refine") + report.seeds
    again = Placement.from_dict(json.loads(json.dumps(out.to_dict())))
    assert LearnedReport.of(again) == report  # a plain dict in meta: JSON round trip


def test_heuristics_have_no_report() -> None:
    assert LearnedReport.of(autoplace.plan(chain(6), "4xV100-pcie", planner="m-etf")) is None
