"""The planner protocol and the registry.

A planner is any object with

- ``name``: the registry key (``"m-etf"``, ``"eagle"``);
- ``modes``: the placement modes it returns, a tuple of ``"model"`` and/or ``"pipeline"``;
- ``kind``: ``"heuristic"`` or ``"learned"``;
- ``place(graph, cluster, *, cost=None, budget_s=None, seed=0) -> Placement`` (a plan depends
  on the op graph only, never on the module, so ``plan()`` and ``wrap()`` agree). A planner with
  more than one mode also takes ``mode=``.
- optionally ``config_type``: the class of its settings; then ``place`` also takes
  ``config=`` (an instance, or None for its own), which ``plan(..., config=...)`` passes on.

``register(planner)`` adds one. The built-in planners live in two subpackages,
:mod:`autoplace.planners.heuristic` and :mod:`autoplace.planners.learned`; every module under
them is imported on first use of the registry, so a planner module that calls ``register`` at
import time is found without editing anything else. :func:`autoplace.planners.planning.plan` runs
them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from ..cluster import Cluster
from ..errors import NoFitError, UnknownPlannerError
from ..placement import Placement

if TYPE_CHECKING:
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph

__all__ = ["Planner", "FunctionPlanner", "NoFitError", "register", "get_planner", "planners", "MODES", "KINDS",
           "as_cluster", "call_planner", "config_for"]

MODES = ("model", "pipeline")
KINDS = ("heuristic", "learned")
# The subpackage of the built-in heuristics: imported strictly (an error there is a bug); the
# learned planners' import errors are warnings, so one being written cannot break the heuristics.
_STRICT = "heuristic"
_LENIENT = "learned"


@runtime_checkable
class Planner(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def modes(self) -> tuple[str, ...]: ...

    @property
    def kind(self) -> str: ...

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0) -> Placement: ...


@dataclasses.dataclass(frozen=True)
class FunctionPlanner:
    """A planner made of a function ``fn(graph, cluster, *, cost, seed) -> Placement``
    (how the heuristics are written: the algorithm is the function, this is its registry entry)."""

    name: str
    modes: tuple[str, ...]
    fn: Callable[..., Placement]
    kind: str = "heuristic"
    summary: str = ""

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0) -> Placement:
        return self.fn(graph, as_cluster(cluster), cost=cost, seed=seed)


_REGISTRY: dict[str, Planner] = {}
_loaded = False


def register(planner: Planner, *, replace: bool = False) -> Planner:
    """Add ``planner`` to the registry (``replace=True`` to swap one of the same name)."""
    missing = [a for a in ("name", "modes", "kind", "place") if not hasattr(planner, a)]
    if missing:
        raise TypeError(f"{planner!r} is not a planner: it lacks {', '.join(missing)} "
                        "(see autoplace.planners.Planner)")
    bad_modes = [m for m in planner.modes if m not in MODES]
    if not planner.modes or bad_modes:
        raise ValueError(f"planner {planner.name!r} has modes {planner.modes!r}; each must be one of {MODES}")
    if planner.kind not in KINDS:
        raise ValueError(f"planner {planner.name!r} has kind {planner.kind!r}; it must be one of {KINDS}")
    if planner.name == "best":
        raise ValueError("'best' is reserved: plan(planner='best') runs every planner")
    if planner.name in _REGISTRY and not replace and _REGISTRY[planner.name] is not planner:
        raise ValueError(f"a planner named {planner.name!r} is already registered; "
                         "pass replace=True to swap it")
    _REGISTRY[planner.name] = planner
    return planner


def _load() -> None:
    """Import the planner modules under this package once, so their ``register`` calls run:
    each subpackage's ``PLANNER_MODULES`` first, in order, then any other module found there."""
    global _loaded
    if _loaded:
        return
    package = __name__.rsplit(".", 1)[0]
    strict = importlib.import_module(f"{package}.{_STRICT}")
    for name in _modules(strict):
        importlib.import_module(name)
    _loaded = True  # set after the built-ins, so a failure there shows again on the next call
    for name in _modules(importlib.import_module(f"{package}.{_LENIENT}")):
        try:
            importlib.import_module(name)
        except Exception as e:  # a learned planner still being written must not break the heuristics
            warnings.warn(f"planner module {name} failed to import ({type(e).__name__}: {e}); "
                          "its planners are not registered", RuntimeWarning, stacklevel=3)


def _modules(pkg: Any) -> list[str]:
    """The modules of subpackage ``pkg`` that register planners: its ``PLANNER_MODULES``, in order,
    when it names them (so planning imports no training code: pretraining, the corpus, imitation);
    else every module found on disk (private ones, starting with ``_``, excepted)."""
    named = getattr(pkg, "PLANNER_MODULES", None)
    if named is not None:
        return [f"{pkg.__name__}.{m}" for m in named]
    return [info.name for info in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}.", onerror=lambda n: None)
            if not info.ispkg and not info.name.rsplit(".", 1)[-1].startswith("_")]


def get_planner(name: str) -> Planner:
    """The registered planner called ``name``."""
    _load()
    if name not in _REGISTRY:
        raise UnknownPlannerError(f"no planner named {name!r}; registered planners: "
                                  f"{', '.join(sorted(_REGISTRY))} (or 'best' in plan())")
    return _REGISTRY[name]


def planners(mode: str | None = None) -> list[str]:
    """Names of the registered planners, heuristics first, optionally only those of ``mode``."""
    _load()
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode is {mode!r}; it must be one of {MODES} or None")
    chosen = [p for p in _REGISTRY.values() if mode is None or mode in p.modes]
    return [p.name for p in sorted(chosen, key=lambda p: (KINDS.index(p.kind), list(_REGISTRY).index(p.name)))]


def as_cluster(cluster: Cluster | str) -> Cluster:
    return Cluster.preset(cluster) if isinstance(cluster, str) else cluster


def config_for(p: Planner, config: object) -> object | None:
    """The config ``plan(..., config=config)`` gives planner ``p``: ``config`` itself, or its
    entry for ``p.name`` when it is a mapping of planner names; None when it names none. A
    config of another class than ``p.config_type`` (or for a planner without one) is an error."""
    if isinstance(config, Mapping):
        config = config.get(p.name)
    if config is None:
        return None
    expected = getattr(p, "config_type", None)
    if expected is None:
        raise TypeError(f"planner {p.name!r} takes no config; got a {type(config).__name__}. Planners with a "
                        f"config: {', '.join(n for n in planners() if hasattr(get_planner(n), 'config_type'))}")
    if not isinstance(config, expected):
        raise TypeError(f"planner {p.name!r} takes a {expected.__name__} config, not a {type(config).__name__}; "
                        f"pass config={expected.__name__}(...) (or a mapping of planner names to configs)")
    return config


def check_configs(config: object, names: list[str]) -> None:
    """Check ``plan(planner="best", config=...)``'s mapping before any planner runs: each key
    a planner that runs (one of ``names``), each value of that planner's config class."""
    if config is None:
        return
    if not isinstance(config, Mapping):
        raise TypeError(f"plan(planner='best') runs several planners; config must map planner names to configs "
                        f"(e.g. {{'eagle': EagleConfig(...)}}), not a {type(config).__name__}")
    unknown = [k for k in config if k not in names]
    if unknown:
        raise ValueError(f"config names {', '.join(map(repr, unknown))}, which this plan does not run; "
                         f"it runs {', '.join(names)}")
    for k in config:
        config_for(get_planner(k), config)


def call_planner(p: Planner, graph: "OpGraph", cluster: Cluster, mode: str, *, config: object = None,
                 **kw: Any) -> Placement:
    if len(p.modes) > 1 and "mode" in inspect.signature(p.place).parameters:
        kw["mode"] = mode
    chosen = config_for(p, config)
    if chosen is not None:
        kw["config"] = chosen
    out = p.place(graph, cluster, **kw)
    if not isinstance(out, Placement):
        raise TypeError(f"planner {p.name!r} returned {type(out).__name__}, not a Placement")
    return out
