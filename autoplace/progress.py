"""Progress on slow work, behind one switch.

``wrap(..., progress=False)`` (or ``with autoplace.progress.shown(False):``) silences every
progress display autoplace would show inside it: the status lines of :class:`Step` and the
learned planners' bars (:func:`autoplace.planners.ppo.progress_bar`). The switch is a context
variable, so it holds for the code inside the ``with`` block and for nothing else.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import IO, Any, Iterator

__all__ = ["shown", "enabled", "Step"]

_SHOWN: ContextVar[bool] = ContextVar("autoplace_progress", default=True)


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

    Nothing is printed where progress is switched off.
    """

    def __init__(self, what: str, *, stream: IO[str] | None = None) -> None:
        self.what = what
        self.stream = stream
        self.on = enabled()

    def _print(self, text: str, end: str = "\n") -> None:
        if self.on:
            print(text, end=end, flush=True, file=self.stream if self.stream is not None else sys.stdout)

    def __enter__(self) -> "Step":
        self.t0 = time.perf_counter()
        self._print(f"{self.what} ...", end="")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._print(f" {time.perf_counter() - self.t0:.1f} s" if exc[0] is None else " failed")
