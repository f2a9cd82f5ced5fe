"""Apply a plan to a real model.

- :func:`place_module`: model parallel, one GraphModule whose nodes run on their planned
  devices, with transfers on every cross-device edge (``placed.py``).
- :func:`split_stages`: a chain of stage GraphModules for a pipeline (``pipeline.py``).
- :func:`build_pipeline_runner`: this rank's stage on torch.distributed.pipelining, with GPipe or
  1F1B, optionally each stage replicated data-parallel (``runtime.py``); the runner, a
  :class:`PipelineRunner`, is an ``nn.Module`` (``runner.py``). Sharded stages
  (``fsdp.py``, ``units.py``) go through the same builder; several stages per rank
  (``schedules.py``) and tensor parallelism (``tensor_parallel.py``) run their own schedules.
"""

from __future__ import annotations

from .pipeline import StageSplitError, split_stages
from .placed import OneDevice, PlacementRewriteError, place_module
from .runtime import (PipelineError, PipelineRunner, PipelineTimeoutError, build_pipeline_runner,
                      init_distributed)

__all__ = [
    "place_module", "OneDevice", "PlacementRewriteError", "split_stages", "StageSplitError", "build_pipeline_runner",
    "PipelineRunner", "init_distributed", "PipelineError", "PipelineTimeoutError",
]
