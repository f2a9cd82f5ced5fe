"""The errors of the pipeline rewrite and runtime, each an :class:`autoplace.AutoplaceError`.

They live here, below every other module of :mod:`autoplace.rewrite`, so the modules that raise
them (the split, the runtime, its BatchNorm and liveness parts, the sharded runtime) import them
one way.
"""

from __future__ import annotations

from ..errors import AutoplaceError

__all__ = ["StageSplitError", "PipelineError", "PipelineTimeoutError", "ShardedRunError"]


class StageSplitError(AutoplaceError, ValueError):
    """A stage assignment cannot be cut into a pipeline; the message names the rule and the fix."""


class PipelineError(AutoplaceError, RuntimeError):
    """A pipeline step failed on this rank; the message names the rank and stage."""


class PipelineTimeoutError(AutoplaceError, TimeoutError):
    """A peer did not answer within the process group's timeout; names this rank and stage."""


class ShardedRunError(AutoplaceError, RuntimeError):
    """A sharded plan cannot be built or run here; the message names the rule and the fix."""
