"""The schedule table (autoplace.pipeline_rules.SPECS) is the one list of schedules: every other
list is read from it, every entry names a torch class that exists, a torchtitan name torch's
get_schedule_class resolves, and an order of actions in the simulator (the one executor runs them all)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import get_schedule_class

from autoplace import pipeline_rules
from autoplace.pipeline_rules import SPECS
from autoplace.planners.heuristic import schedules as offers
from autoplace.rewrite import runtime
from autoplace.sim import schedules as sim_schedules


def test_every_list_of_schedules_is_read_from_the_table() -> None:
    assert pipeline_rules.ALL_SCHEDULES == tuple(SPECS)
    assert set(pipeline_rules.SCHEDULES) | set(pipeline_rules.MULTI_SCHEDULES) == set(SPECS)
    assert runtime.SCHEDULES is pipeline_rules.SCHEDULES
    assert set(offers.LOOPED) | set(offers.V_SHAPED) == set(pipeline_rules.MULTI_SCHEDULES)
    assert set(sim_schedules.ORDERS) == set(SPECS)  # every schedule, one-stage ones included, is an order


@pytest.mark.parametrize("name", list(SPECS))
def test_each_entry_runs_on_torch_and_in_the_simulator(name: str) -> None:
    spec = SPECS[name]
    assert get_schedule_class(spec.torchtitan_name).__name__ == spec.torch_class
    v = spec.virtual[0] if spec.multi_stage else 1
    v = max(v, 2) if spec.multi_stage and spec.virtual[1] is None else v
    order = sim_schedules.actions(name, 2, v, 4)
    assert len(order) == 2 and all(order)  # every rank has actions
    stages = {a.stage for row in order for a in row}
    assert stages == set(range(2 * v))
