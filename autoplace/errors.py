"""The one base of every error autoplace raises, and the errors several modules share.

    try:
        model = autoplace.wrap(model, devices)
    except autoplace.AutoplaceError as e:   # any refusal of autoplace's, with the rule and the fix
        ...

Each error class keeps the builtin base it had before this one existed (``PlacementError`` is
still a ``ValueError``, ``NoFitError`` a ``RuntimeError``), so ``except ValueError`` code keeps
working; ``AutoplaceError`` tells autoplace's refusals from a bug inside torch or the model.
This module imports nothing of autoplace's, so every module can import it.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["AutoplaceError", "ProfileError", "UnknownPlannerError", "NoFitError", "PlacementError"]


class AutoplaceError(Exception):
    """Raised by autoplace for input it refuses or a request it cannot meet; the message names
    the value, the rule and the fix."""


class ProfileError(AutoplaceError, ValueError):
    """A profile (measured op times) cannot be read or made: a malformed or unreadable PipeDream
    ``graph.txt`` (the message names the file and line), or a model that cannot be profiled as
    asked (weights on the meta device, a device that is not here)."""


class UnknownPlannerError(AutoplaceError, KeyError, ValueError):
    """No planner is registered under the name asked for; the message lists the registered ones.
    A ``KeyError`` (a failed look-up) and a ``ValueError`` (a bad argument) both."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows the repr of its argument (quotes, escaped newlines).
        return str(self.args[0]) if self.args else ""


class NoFitError(AutoplaceError, RuntimeError):
    """No placement of this planner fits the devices' memory; the message says what was
    needed and what is available, and ``why`` the planner's own reason ("" when it has none)."""

    def __init__(self, message: str, *, why: str = "") -> None:
        super().__init__(message)
        self.why = why


class PlacementError(AutoplaceError, ValueError):
    """A placement does not fit its graph or cluster; the message lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = "placement is invalid" if len(self.problems) != 1 else "placement is invalid:"
        body = self.problems[0] if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(f"{head} {body}" if len(self.problems) == 1 else f"{head}:{body}")
