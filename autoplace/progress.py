"""Progress on slow work, behind one switch.

``wrap(..., progress=False)`` (or ``with autoplace.progress.shown(False):``) silences every
progress display autoplace would show inside it: the status lines of :class:`Step`, the live
display of :class:`Status` (what ``plan()`` shows while it runs its planners) and the learned
planners' bars (:func:`autoplace.planners.learned.ppo.progress_bar`). The switch is a context
variable, so it holds for the code inside the ``with`` block and for nothing else.

:class:`Status` shows nothing for work that ends within ``delay_s`` (2 s); past that it shows,
on stderr, which part is running and how far it is, refreshed a few times a second: a tqdm
bar on a terminal, and elsewhere (logs, CI, captured output) a plain line each time the part
changes and every few seconds while one runs.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any, Callable, Iterator

__all__ = ["shown", "enabled", "Step", "Status", "status"]

_SHOWN: ContextVar[bool] = ContextVar("autoplace_progress", default=True)
_STEP: ContextVar["Step | None"] = ContextVar("autoplace_open_step", default=None)
_STATUS: ContextVar["Status | None"] = ContextVar("autoplace_status", default=None)


def enabled() -> bool:
    """Whether progress may be shown here (False inside ``shown(False)``)."""
    return _SHOWN.get()


@contextmanager
def shown(on: bool) -> Iterator[None]:
    """Show progress inside the block only if ``on`` (and it is not already switched off)."""
    token = _SHOWN.set(_SHOWN.get() and bool(on))
    try:
        yield
    finally:
        _SHOWN.reset(token)


class Step:
    """Prints ``what ...`` and, when the block ends, how long it took (or ``failed``).

    Nothing is printed where progress is switched off. When a :class:`Status` display shows
    inside the block, the line is ended first and printed again, whole, with the time.
    """

    def __init__(self, what: str, *, stream: IO[str] | None = None) -> None:
        self.what = what
        self.stream = stream
        self.on = enabled()
        self.broken = False

    def _print(self, text: str, end: str = "\n") -> None:
        if self.on:
            print(text, end=end, flush=True, file=self.stream if self.stream is not None else sys.stdout)

    def break_line(self) -> None:
        """End the open ``what ...`` line so another display can use the next one."""
        if not self.broken:
            self.broken = True
            self._print("")

    def __enter__(self) -> "Step":
        self.t0 = time.perf_counter()
        self._print(f"{self.what} ...", end="")
        self._token = _STEP.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _STEP.reset(self._token)
        done = f"{time.perf_counter() - self.t0:.1f} s" if exc[0] is None else "failed"
        self._print(f"{self.what} ... {done}" if self.broken else f" {done}")


def status() -> "Status | None":
    """The :class:`Status` display open here (None when there is none)."""
    return _STATUS.get()


class Status:
    """A live display of work done in ``total`` parts: which part runs, how far it is.

        with Status("autoplace: planning", total=len(planners)) as st:
            for k, name in enumerate(planners):
                st.part(k, name)          # part k (0-based) starts
                ...                       # code inside may call status().detail("ppo 64/256 samples")

    Nothing is shown until ``delay_s`` seconds have passed (so quick work stays quiet), nor
    where progress is switched off. Then, on ``stream`` (default stderr): on a terminal a tqdm
    bar ``what: k/total parts [elapsed] name: detail`` refreshed every ``refresh_s``; elsewhere
    a line ``what: part k/total name (elapsed s) detail`` when the part changes, and every
    ``every_s`` seconds while one runs. ``note()``, when given and not empty, is shown instead
    of the detail (what holds everything up, e.g. a compiler).
    """

    def __init__(self, what: str, total: int, *, unit: str = "planners", delay_s: float = 2.0,
                 stream: IO[str] | None = None, refresh_s: float = 0.25, every_s: float = 5.0,
                 note: Callable[[], str] | None = None) -> None:
        self.what, self.total, self.unit = what, max(int(total), 1), unit
        self.note = note
        self.delay_s, self.refresh_s, self.every_s = float(delay_s), float(refresh_s), float(every_s)
        self.stream: IO[str] = stream if stream is not None else sys.stderr
        self.on = enabled()
        self.index, self.name, self.text = 0, "", ""
        self.lines = 0
        """lines written (plain mode) or refreshes drawn (terminal): 0 while nothing was shown."""
        self._bar: Any = None
        self._last: tuple[int, str, bool] | None = None
        self._last_t = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(callable(isatty) and isatty())

    # ---- what the work reports -------------------------------------------------------------

    def part(self, index: int, name: str) -> None:
        """Part ``index`` (0-based), called ``name``, starts; its detail is cleared."""
        self.index, self.name, self.text = int(index), str(name), ""

    def detail(self, text: str) -> None:
        """How far the running part is (a short phrase: ``ppo 64/256 samples, best 1.92 ms``)."""
        self.text = str(text)

    # ---- display ---------------------------------------------------------------------------

    def __enter__(self) -> "Status":
        self.t0 = time.perf_counter()
        self._token = _STATUS.set(self)
        self._step = _STEP.get()
        if self.on:
            self._thread = threading.Thread(target=self._run, name="autoplace-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        _STATUS.reset(self._token)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
            elif self.lines and exc[0] is None:
                self._write(f"{self.what}: {self.total}/{self.total} {self.unit} done in "
                            f"{time.perf_counter() - self.t0:.1f} s")

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if time.perf_counter() - self.t0 >= self.delay_s:
                with self._lock:
                    if not self._stop.is_set():
                        self._show()

    def _show(self) -> None:
        if self.lines == 0 and self._step is not None:
            self._step.break_line()
        elapsed = time.perf_counter() - self.t0
        text = (self.note() if self.note is not None else "") or self.text
        now = (self.index, self.name, text == self.text)
        label = f"{self.name}: {text}" if text else self.name
        if self.tty:
            if self._bar is None:
                from tqdm.auto import tqdm

                what = f"{self.what}: ".replace("{", "{{").replace("}", "}}")
                fmt = what + "{n_fmt}/{total_fmt} " + self.unit + " |{bar:10}| [{elapsed}] {desc}"
                self._bar = tqdm(total=self.total, desc=label, file=self.stream, leave=False, dynamic_ncols=True,
                                 initial=self.index, bar_format=fmt)
                self._bar.start_t -= elapsed  # the clock counts from the start of the work, not of the bar
            self._bar.n = self.index
            self._bar.set_description_str(label, refresh=False)
            self._bar.refresh()
            self.lines += 1
        elif now != self._last or elapsed - self._last_t >= self.every_s:
            one = self.unit[:-1] if self.unit.endswith("s") else self.unit
            self._write(f"{self.what}: {one} {self.index + 1}/{self.total} {self.name} ({elapsed:.1f} s)"
                        + (f": {text}" if text else ""))
            self._last, self._last_t = now, elapsed

    def _write(self, line: str) -> None:
        try:
            print(line, file=self.stream, flush=True)
        except ValueError:  # the stream was closed under us (a test's capture ended)
            return
        self.lines += 1
