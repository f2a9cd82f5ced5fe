"""autoplace: automatic device placement for PyTorch.

    model = autoplace.wrap(model, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])

traces the model with torch.fx, plans a placement (a learned policy or a classic heuristic,
judged by a training-step simulator) and returns a module that runs it. The pieces are public
too: ``trace`` / ``load_pipedream`` give an :class:`OpGraph`, ``Cluster`` describes devices,
``plan`` returns a :class:`Placement`, ``simulate`` predicts its step time. Every error
autoplace raises derives from :class:`AutoplaceError`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from . import kernel_cache as _kernel_cache

_kernel_cache.refresh()  # before any kernel loads: numba's cache misses a changed callee's file

from .cluster import Cluster, Device, Link  # noqa: E402
from .cost.analytic import CostModel  # noqa: E402
from .errors import AutoplaceError  # noqa: E402
from .graph.ir import OpGraph  # noqa: E402
from .placement import Placement, PlacementError  # noqa: E402

__version__ = "0.1.0"

# Heavier names load on first use, so `import autoplace` stays quick.
_LAZY = {
    "trace": ("autoplace.graph.trace", "trace"),
    "load_pipedream": ("autoplace.graph.pipedream", "load_pipedream"),
    "simulate": ("autoplace.sim", "simulate"),
    "SimResult": ("autoplace.sim", "SimResult"),
    "lower_bound": ("autoplace.sim", "lower_bound"),
    "planners": ("autoplace.planners", "planners"),
    "plan": ("autoplace.planners", "plan"),
    "wrap": ("autoplace.api", "wrap"),
    "PlacedModule": ("autoplace.api", "PlacedModule"),
    "zoo": ("autoplace.zoo", None),
    "OnlineConfig": ("autoplace.online", "OnlineConfig"),
    "save_checkpoint": ("autoplace.rewrite.checkpoint", "save"),
    "load_checkpoint": ("autoplace.rewrite.checkpoint", "load"),
    "full_state_dict": ("autoplace.rewrite.checkpoint", "full_state_dict"),
}

__all__ = [
    "trace", "load_pipedream", "OpGraph", "Cluster", "Device", "Link", "CostModel", "Placement",
    "PlacementError", "simulate", "SimResult", "lower_bound", "planners", "plan", "wrap", "PlacedModule", "zoo",
    "OnlineConfig", "AutoplaceError", "save_checkpoint", "load_checkpoint", "full_state_dict",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = import_module(mod) if attr is None else getattr(import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autoplace' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
