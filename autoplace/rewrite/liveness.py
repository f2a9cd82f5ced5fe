"""How long a pipeline rank waits for its peers, and which peer stopped answering.

A pipeline rank spends most of a step waiting: for the activations of the stage before it,
the gradients of the stage after it, its replicas' all-reduce. A peer that stops (SIGSTOP, a
debugger, a hang in native code) leaves it waiting for the process group's timeout, and gloo's
timeout names no peer. Three things bound that wait and name the peer:

- :class:`Timeouts`: the bound of every wait inside a step is ``max(floor_s, multiple x
  predicted step)``, the first ``first_steps`` steps (lazy initialisation, cuDNN autotuning,
  compilation) ``max(first_floor_s, first_multiple x predicted step)``; the multiple rounded up
  to 1, 2 or 5 x 10^k seconds (so re-planned pipelines reuse their process groups). The predicted
  step is the simulator's for the plan (:func:`autoplace.wrap` passes it); without one the
  floors hold. Point-to-point waits are bounded by the timeout their process group was made
  with, so the runtime keeps one group per bound (:func:`group`).
- :class:`Heartbeat`: a daemon thread per process that bumps this rank's counter in the
  process group's store every ``heartbeat_s`` (with what the rank is doing: building, in step
  n, done with step n) and reads its peers'. A peer whose counter has not moved for a while is
  stopped or hung without releasing the GIL; one whose counter moves is alive, and its state
  says whether it is in the same step.
- :class:`Gate`: every step starts with a barrier (one asynchronous all-reduce of one element
  on a gloo group, ~0.3 ms on one host). Waiting there is not bounded by the step's bound, since a peer
  may be checkpointing or evaluating between steps, but by ``between_steps_s``; a peer whose
  heartbeat stops for ``stall_s`` is reported at once.

When a wait inside a step times out, :func:`who_stopped` reads the heartbeat table (already in
memory: no store access, which would hang if the store's host is the stopped process) and
names the rank(s) whose heartbeat stopped, or the ones not in this step.
"""

from __future__ import annotations

import math
import sys
import atexit
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import PipelineError

__all__ = ["Timeouts", "Heartbeat", "Gate", "heartbeat", "group", "pipeline_name", "who_stopped", "state",
           "SETUP_TIMEOUT_S"]

SETUP_TIMEOUT_S = 600.0
"""The process group's timeout while ranks trace, plan and build (before a plan predicts a step)."""


def _nice_ceiling(x: float) -> float:
    """The least of 1, 2, 5 x 10^k that is >= x (x > 0)."""
    e = 10.0 ** math.floor(math.log10(x))
    for m in (1.0, 2.0, 5.0, 10.0):
        if m * e >= x * (1 - 1e-9):
            return float(f"{m * e:.6g}")
    return 10 * e


@dataclass(frozen=True)
class Timeouts:
    """How long a pipeline rank waits for its peers before it raises ``PipelineTimeoutError``."""

    floor_s: float = 30.0
    """Least bound of a wait inside a step (after the first steps), whatever the prediction."""
    multiple: float = 10.0
    """Bound of a wait inside a step: ``max(floor_s, multiple x predicted step)``."""
    first_floor_s: float = 300.0
    """Least bound of a wait inside the first steps (setup, lazy initialisation, compilation)."""
    first_multiple: float = 100.0
    """Bound inside the first steps: ``max(first_floor_s, first_multiple x predicted step)``."""
    first_steps: int = 1
    """How many steps get the first steps' bound."""
    between_steps_s: float = 600.0
    """How long a rank waits at the start of a step for peers that are alive but elsewhere."""
    stall_s: float = 10.0
    """A peer whose heartbeat has not moved for this long is reported as not answering."""
    heartbeat_s: float = 0.5
    """Seconds between two heartbeats of a rank (and between two looks at the peers')."""

    def __post_init__(self) -> None:
        for name in ("floor_s", "first_floor_s", "between_steps_s", "stall_s", "heartbeat_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise PipelineError(f"Timeouts.{name} is {v!r}; it must be a positive number of seconds")
        for name in ("multiple", "first_multiple"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise PipelineError(f"Timeouts.{name} is {v!r}; it must be a number >= 0")
        if not isinstance(self.first_steps, int) or self.first_steps < 0:
            raise PipelineError(f"Timeouts.first_steps is {self.first_steps!r}; it must be an integer >= 0")

    @classmethod
    def fixed(cls, seconds: float) -> Timeouts:
        """The same bound for every wait, in every step and between steps."""
        return cls(floor_s=seconds, multiple=0.0, first_floor_s=seconds, first_multiple=0.0,
                   between_steps_s=seconds, stall_s=min(10.0, float(seconds)))

    def bound_s(self, step: int, predicted_s: float | None) -> float:
        """The bound of one wait in step ``step`` (1 is the first); the multiple rounded up to 1, 2 or 5 x 10^k s."""
        first = step <= self.first_steps
        floor, k = (self.first_floor_s, self.first_multiple) if first else (self.floor_s, self.multiple)
        if k == 0 or predicted_s is None or not math.isfinite(predicted_s) or predicted_s <= 0:
            return float(floor)
        return max(float(floor), _nice_ceiling(k * predicted_s))

    def explain(self, step: int, predicted_s: float | None) -> str:
        """How ``bound_s(step, predicted_s)`` came about, for error messages."""
        first = step <= self.first_steps
        floor, k = (self.first_floor_s, self.first_multiple) if first else (self.floor_s, self.multiple)
        which = f"the first {self.first_steps} step(s)' bound" if first else "the bound"
        if k == 0:
            return f"{which} {floor:g} s"
        pred = f"{predicted_s * 1e3:.3g} ms" if predicted_s is not None else "unknown (no plan)"
        return f"{which} {self.bound_s(step, predicted_s):g} s = max({floor:g} s, {k:g} x predicted step {pred})"


# ---- process groups, one per (ranks, bound) --------------------------------------------------------

_GROUPS: dict[tuple[Any, ...], Any] = {}
_PIPELINES: dict[tuple[int, ...], int] = {}
_WORLD: list[Any] = [None]  # the default process group the two caches above belong to


def _this_world() -> None:
    """Empty the caches when the default process group is not the one they were made in."""
    world = dist.distributed_c10d._get_default_group()
    if _WORLD[0] is not world:
        _GROUPS.clear()
        _PIPELINES.clear()
        _WORLD[0] = world


def group(ranks: Sequence[int], timeout_s: float, *, backend: str | None = None) -> Any:
    """A process group over ``ranks`` whose waits time out after ``timeout_s``; made once.

    Every rank of the world calls it, members or not, in the same order with the same
    arguments (``dist.new_group``'s rule; then the ranks also agree on every cache hit). Not
    ``use_local_synchronization``: its group names count the groups each member holds, which
    differ where some ranks share a tied parameter.
    """
    _this_world()
    key = (tuple(ranks), float(timeout_s), backend)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s), backend=backend)
    return _GROUPS[key]


def gate_timeout_s(timeouts: Timeouts) -> float:
    """The gate group's own timeout: a backstop past the gate's own decisions."""
    return timeouts.between_steps_s + 2 * timeouts.stall_s + 60


def pipeline_name(members: Sequence[int]) -> str:
    """A name for the next pipeline over ``members``, the same on each (they build pipelines in
    the same order): its heartbeat states tell it from earlier ones."""
    _this_world()
    key = tuple(members)
    _PIPELINES[key] = _PIPELINES.get(key, 0) + 1
    return f"{_PIPELINES[key]}@{min(key)}-{max(key)}"


# ---- heartbeat -------------------------------------------------------------------------------------

class Heartbeat:
    """This process's heartbeat in the store, and what it last saw of its peers' (see the module doc).

    ``state`` is what this rank is doing, set by the main thread and published with each beat.
    """

    def __init__(self, store: Any, rank: int, interval_s: float) -> None:
        self.rank = rank
        self.interval_s = interval_s
        self.state = "building"
        self._store = store
        self._pg = dist.distributed_c10d._get_default_group()
        self._watched: set[int] = set()
        self._present: set[int] = set()
        self._lock = threading.Lock()
        self._beats: dict[int, tuple[int, float, str]] = {}  # rank -> (count, when it last moved, state)
        self._started = time.monotonic()
        self._count = 0
        self.store_error: str | None = None
        self.alarm: tuple[float, Callable[[], str | None]] | None = None
        """(when, say): from ``when`` on, each beat calls ``say()``; the first text it returns is
        printed to stderr and the alarm cleared (for backends whose timeout ends the process
        without a Python error, NCCL's watchdog: the peer is named before that)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"autoplace-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"autoplace/heartbeat/{rank}"

    def watch(self, ranks: Iterable[int]) -> None:
        """Follow the heartbeats of ``ranks`` from now on."""
        now = time.monotonic()
        with self._lock:
            for r in ranks:
                if r != self.rank and r not in self._watched:
                    self._watched.add(r)
                    self._beats.setdefault(r, (-1, now, "no heartbeat yet"))

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread and wait for it (at most ``timeout_s``): run at interpreter exit, so
        the thread is never inside a store call while the process tears down (a C++ store
        call cut off by finalisation aborts the process: "terminate called without an
        active exception", seen at exit of torchrun workers on a loaded machine)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = self.interval_s
        while not self._stop.is_set():
            if not dist.is_initialized() or dist.distributed_c10d._get_default_group() is not self._pg:
                return  # the process group this heartbeat belongs to is gone
            try:
                self._beat()
                self.store_error = None
                backoff = self.interval_s
            except Exception as e:  # the store's host stopped or went away: note it, try again later
                text = str(e).strip().splitlines()
                self.store_error = f"{type(e).__name__}: {text[0][:200] if text else ''}"
                backoff = min(30.0, backoff * 2)
            self._sound_alarm()
            self._stop.wait(backoff)

    def _sound_alarm(self) -> None:
        alarm = self.alarm
        if alarm is None or time.monotonic() < alarm[0]:
            return
        try:
            text = alarm[1]()
        except Exception:
            return
        if text and self.alarm is alarm:
            self.alarm = None
            print(f"autoplace: {text}", file=sys.stderr, flush=True)

    def _beat(self) -> None:
        self._count += 1
        self._store.set(self._key(self.rank), f"{self._count} {self.state}")
        with self._lock:
            peers = sorted(self._watched)
        for r in peers:
            if r not in self._present and self._store.check([self._key(r)]):
                self._present.add(r)
        present = [r for r in peers if r in self._present]
        values = self._store.multi_get([self._key(r) for r in present]) if present else []
        now = time.monotonic()
        with self._lock:
            for r, raw in zip(present, values):
                count_text, _, state = bytes(raw).decode(errors="replace").partition(" ")
                count = int(count_text)
                old = self._beats.get(r)
                moved = old is None or count != old[0]
                self._beats[r] = (count, now if moved else old[1], state)  # type: ignore[index]

    def silence_s(self, rank: int) -> float:
        """Seconds since ``rank``'s heartbeat last moved (since it was watched if it never beat)."""
        with self._lock:
            beat = self._beats.get(rank)
        return time.monotonic() - (beat[1] if beat is not None else self._started)

    def state_of(self, rank: int) -> str:
        with self._lock:
            beat = self._beats.get(rank)
        return beat[2] if beat is not None else "not watched"

    def stopped(self, ranks: Iterable[int], stall_s: float) -> list[int]:
        """The ranks among ``ranks`` whose heartbeat has not moved for ``stall_s``."""
        if self.store_error is not None:
            return []  # our own view is stale: say nothing rather than something wrong
        return [r for r in ranks if r != self.rank and self.silence_s(r) > stall_s]


_HEARTBEAT: list[Heartbeat | None] = [None]


def heartbeat(interval_s: float = 0.5) -> Heartbeat | None:
    """This process's heartbeat, started on first use; None where the store cannot be cloned."""
    hb = _HEARTBEAT[0]
    if hb is not None and hb.alive() and hb._pg is dist.distributed_c10d._get_default_group():
        return hb
    try:
        store = dist.distributed_c10d._get_default_store().clone()  # type: ignore[attr-defined]
        store.set_timeout(timedelta(seconds=max(2.0, 4 * interval_s)))
    except Exception:  # a store without clone(): no heartbeat; messages fall back to the stage adjacency
        return None
    old = _HEARTBEAT[0]
    if old is not None:
        old.stop()
    hb = Heartbeat(store, dist.get_rank(), interval_s)
    _HEARTBEAT[0] = hb
    if not _AT_EXIT[0]:
        atexit.register(_stop_heartbeat)
        _AT_EXIT[0] = True
    return hb


_AT_EXIT = [False]


def _stop_heartbeat() -> None:
    hb = _HEARTBEAT[0]
    if hb is not None:
        hb.stop()


# ---- the barrier that starts a step ------------------------------------------------------------

class Gate:
    """The barrier at the start of every step over a pipeline's ranks (see the module doc)."""

    def __init__(self, ranks: Sequence[int], gate_group: Any, hb: Heartbeat | None) -> None:
        self.ranks = tuple(ranks)
        self.hb = hb
        self.group = gate_group  # gloo, made with gate_timeout_s()

    def wait(self, timeouts: Timeouts, describe: Callable[[float], str]) -> str | None:
        """Wait for every rank; None when all came, else why not (``describe(waited_s)`` words it)."""
        done = threading.Event()
        work = dist.all_reduce(torch.zeros(1), group=self.group, async_op=True)
        work.get_future().add_done_callback(lambda _: done.set())
        start = time.monotonic()
        while not done.wait(timeouts.heartbeat_s):
            waited = time.monotonic() - start
            if self.hb is not None and self.hb.stopped(self.ranks, timeouts.stall_s):
                return describe(waited)
            if waited >= timeouts.between_steps_s:
                return describe(waited)
        work.wait()  # a peer that crashed: its error surfaces here
        return None


def state(pipeline: str, step: int, phase: str) -> str:
    """A heartbeat state: ``pipeline`` (no spaces), the step (1 is the first) and ``gate|in|done``."""
    return f"{pipeline} {step} {phase}"


def who_stopped(hb: Heartbeat | None, ranks: Sequence[int], name: Callable[[int], str], pipeline: str, step: int,
                waited_s: float, timeouts: Timeouts, *, at_gate: bool = False, adjacent: Sequence[int] = ()) -> str:
    """Which of ``ranks`` stopped answering in step ``step``, in words, from the heartbeats seen.

    A peer whose heartbeat has not moved is named first; else the peers that are alive but have
    not reached this step (its gate with ``at_gate``, else its schedule); ``adjacent`` (the ranks
    this one exchanges tensors with) are named when the heartbeats cannot tell.
    """
    peers = [r for r in ranks if hb is None or r != hb.rank]
    if hb is None or hb.store_error is not None:
        why = "no heartbeat runs in this process" if hb is None else f"the store did not answer ({hb.store_error})"
        near = ", ".join(name(r) for r in adjacent) or "none"
        return (f"cannot tell which peer stopped ({why}); this rank exchanges tensors with {near}: one of them, "
                "or a rank it waits on, stopped answering")
    # Relative to how long we waited: a peer stopped 3 s ago stands out after a 3 s wait.
    threshold = max(4 * timeouts.heartbeat_s, min(timeouts.stall_s, 0.5 * waited_s))
    silent = sorted(((hb.silence_s(r), r) for r in peers if hb.silence_s(r) > threshold), reverse=True)
    if silent:
        return "; ".join(
            f"{name(r)} stopped answering: its heartbeat has not moved for {s:.1f} s (a stopped process, e.g. "
            f"SIGSTOP or a debugger, or one hung in native code; its last heartbeat said: "
            f"{_words(hb.state_of(r), pipeline)})"
            for s, r in silent)
    behind = [(r, hb.state_of(r)) for r in peers if not _reached(hb.state_of(r), pipeline, step, at_gate)]
    if behind:
        return "; ".join(f"{name(r)} is alive but has not reached step {step} (it is {_words(s, pipeline)})"
                         for r, s in behind)
    return (f"every peer is alive and in step {step}: one of them is slower than the bound allows "
            "(raise it, e.g. timeout_s=Timeouts(floor_s=...))")


def _parse(raw: str) -> tuple[str, int, str] | None:
    parts = raw.split(" ")
    if len(parts) == 3 and parts[2] in ("gate", "in", "done") and parts[1].isdigit():
        return parts[0], int(parts[1]), parts[2]
    return None


def _reached(raw: str, pipeline: str, step: int, at_gate: bool) -> bool:
    got = _parse(raw)
    if got is None or got[0] != pipeline:
        return False
    return got[1] > step or (got[1] == step and (at_gate or got[2] != "gate"))


def _words(raw: str, pipeline: str) -> str:
    """A heartbeat state in words."""
    got = _parse(raw)
    if got is None:
        return raw
    what = {"gate": "waiting to start step", "in": "in step", "done": "done with step"}[got[2]]
    return f"{what} {got[1]}{'' if got[0] == pipeline else ' of another pipeline'}"
