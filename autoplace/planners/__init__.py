"""Planners: heuristics and learned policies behind one protocol and one registry.

    autoplace.planners()                      # names of every registered planner
    autoplace.plan(graph, cluster)            # the best of them by simulated step time
    register(planner)                         # add one (see base.Planner)
"""

from __future__ import annotations

from .base import FunctionPlanner, NoFitError, Planner, get_planner, plan, planners, register

__all__ = ["Planner", "FunctionPlanner", "NoFitError", "register", "get_planner", "planners", "plan"]
