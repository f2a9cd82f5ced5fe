"""The time budget of one :func:`autoplace.plan` call, as a deadline planners can read.

``plan()`` opens a deadline for the whole call and a nested, earlier one for each planner it
runs (a learned planner gets its share of what is left). Code that loops (PPO, REINFORCE,
local search, the simulator judge of the heuristics) asks :func:`expired` between steps and
stops there: a learned planner returns the best placement it has seen so far, and
:meth:`Judge <autoplace.planners.judge.Judge>` raises :class:`OutOfTime` so a heuristic is
cut between two variants. Outside ``plan()`` there is no deadline and nothing changes.

    with within(2.0):              # at most 2 s from now (and never past an outer deadline)
        ...
        if expired(): break        # True once the innermost deadline has passed

A planner's own ``budget_s`` argument (what it is given when called alone, or its share inside
``plan()``) is read through one :class:`Clock` made when the planner starts: ``clock.left_s()``
for what remains (``None``: no budget), ``clock.spent()`` to stop, ``clock.elapsed_s()`` for
its report. No planner computes ``budget_s - (perf_counter() - t0)`` by hand.

A deadline is *hard* when ``plan()`` already holds a placement that fits (a heuristic gave
one): only then may :func:`check` cut a heuristic short, so a too-small budget never leaves
``plan()`` with nothing to return.

numba's compilation is not planning: the first call of a simulator kernel in a process whose
on-disk cache is cold (the first run after installing or editing autoplace) compiles it, for
seconds, once; every later process loads it from the cache. Deadlines move back by the time
spent compiling (:func:`compile_s`, measured through numba's ``"numba:compile"`` events), so
a first run plans as well as the next ones rather than spending its budget on the compiler.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import AutoplaceError

__all__ = ["Clock", "Deadline", "OutOfTime", "within", "current", "expired", "left_s", "check", "compile_s",
           "compiling"]


class OutOfTime(AutoplaceError, RuntimeError):
    """A planner was stopped because :func:`autoplace.plan`'s time budget ran out."""


class _Compiles:
    """Seconds numba spent compiling in this process (outermost compilations only)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.local = threading.local()
        self.installed = False
        self.running_since: float | None = None

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        from numba.core import event

        compiles = self

        class _Listener(event.Listener):
            def on_start(self, ev: object) -> None:
                depth = getattr(compiles.local, "depth", 0)
                compiles.local.depth = depth + 1
                if depth == 0:
                    compiles.local.t0 = time.perf_counter()
                    compiles.running_since = compiles.local.t0

            def on_end(self, ev: object) -> None:
                compiles.local.depth = getattr(compiles.local, "depth", 1) - 1
                if compiles.local.depth == 0:
                    compiles.total += time.perf_counter() - compiles.local.t0
                    compiles.running_since = None

        event.register("numba:compile", _Listener())

    def now(self) -> float:
        """Seconds compiled so far, the compilation under way included."""
        since = self.running_since
        return self.total + (time.perf_counter() - since if since is not None else 0.0)


_COMPILES = _Compiles()


def compile_s() -> float:
    """Seconds numba has spent compiling in this process since deadlines were first used."""
    return _COMPILES.now()


def compiling() -> bool:
    """Whether numba is compiling right now (for a progress display)."""
    return _COMPILES.running_since is not None


@dataclass
class Deadline:
    """A point in ``time.perf_counter()`` time, moved back by numba's compile time since it was
    set; ``hit`` records that something stopped for it."""

    at: float
    hard: bool = False
    hit: bool = False
    compiled0: float = 0.0

    def when(self) -> float:
        """The deadline now (later by what numba compiled since it was set)."""
        return self.at + (_COMPILES.now() - self.compiled0)

    def left_s(self) -> float:
        return max(self.when() - time.perf_counter(), 0.0)

    def expired(self) -> bool:
        if time.perf_counter() >= self.when():
            self.hit = True
            return True
        return False


@dataclass
class Clock:
    """A planner's own ``budget_s``, counted from when the clock was made (``None``: no budget)."""

    budget_s: float | None
    t0: float = field(default_factory=time.perf_counter)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def left_s(self, floor: float = 0.0) -> float | None:
        """Seconds of the budget left, at least ``floor`` (a sub-search handed this always gets a
        positive budget); ``None`` when there is no budget."""
        return None if self.budget_s is None else max(self.budget_s - self.elapsed_s(), floor)

    def spent(self) -> bool:
        """Whether the whole budget is used (never, without one)."""
        return self.budget_s is not None and self.elapsed_s() >= self.budget_s


_CURRENT: ContextVar[Deadline | None] = ContextVar("autoplace_deadline", default=None)


def current() -> Deadline | None:
    """The innermost deadline in force (None outside ``plan()``)."""
    return _CURRENT.get()


@contextmanager
def within(seconds: float | None, *, hard: bool = False) -> Iterator[Deadline | None]:
    """A deadline ``seconds`` from now, never later than the one in force (None: only the one
    in force, if any)."""
    outer = _CURRENT.get()
    if seconds is None and outer is None:
        yield None
        return
    _COMPILES.install()
    at = time.perf_counter() + seconds if seconds is not None else float("inf")
    if outer is not None:
        at = min(at, outer.when())
    d = Deadline(at, hard=hard, compiled0=_COMPILES.now())
    token = _CURRENT.set(d)
    try:
        yield d
    finally:
        _CURRENT.reset(token)
        if d.hit and outer is not None and outer.when() <= d.when():
            outer.hit = True


def expired() -> bool:
    """Whether the deadline in force has passed (False when there is none)."""
    d = _CURRENT.get()
    return d is not None and d.expired()


def left_s() -> float | None:
    """Seconds until the deadline in force (None when there is none)."""
    d = _CURRENT.get()
    return None if d is None else d.left_s()


def check() -> None:
    """Raise :class:`OutOfTime` if a hard deadline has passed."""
    d = _CURRENT.get()
    if d is not None and d.hard and d.expired():
        raise OutOfTime(f"the time budget ran out {time.perf_counter() - d.when():.2f} s ago")
