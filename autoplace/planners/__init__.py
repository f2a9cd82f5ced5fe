"""Planners: heuristics and learned policies behind one protocol and one registry.

    autoplace.planners()                      # names of every registered planner
    autoplace.planners("pipeline")            # ... of one mode
    autoplace.plan(graph, cluster)            # the best of them by simulated step time
    register(planner)                         # add one (see registry.Planner)

Layout: ``registry`` (the protocol and the registry), ``planning`` (``plan()``, "best"), ``judge``
(a planner's own simulator-backed comparison of its candidates), ``budget`` (planning time),
``memory`` (the planners' quick memory estimate); ``heuristic/`` (the algorithms people run
today), ``learned/`` (the reinforcement-learning machinery and the EAGLE, Mars and pipeline
policies).

``autoplace.planners`` is both this package and the listing function: once the package is
imported Python binds the name to the module, so the module itself is callable and lists.
"""

from __future__ import annotations

import sys
import types

from ..errors import NoFitError
from .planning import plan
from .registry import FunctionPlanner, Planner, get_planner, planners, register

__all__ = ["Planner", "FunctionPlanner", "NoFitError", "register", "get_planner", "planners", "plan"]


class _CallablePackage(types.ModuleType):
    def __call__(self, mode: str | None = None) -> list[str]:
        return planners(mode)


sys.modules[__name__].__class__ = _CallablePackage
