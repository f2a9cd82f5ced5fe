"""Apply a plan to a real model.

- :func:`place_module`: model parallel, one GraphModule whose nodes run on their planned
  devices, with transfers on every cross-device edge (``placed.py``).
- :func:`split_stages`: a chain of stage GraphModules for a pipeline (``pipeline.py``).
- :func:`autoplace.rewrite.compose.build_runner`: a pipeline-mode plan to this rank's runner, one
  composition for every kind (``compose.py``): per stage TP/SP, recompute, FSDP/HSDP/DDP; a
  one-stage plan then runs its data-parallel loop (``loop.py``), every pipeline the one schedule
  builder on torch.distributed.pipelining (``schedules.py``). The runner, a
  :class:`PipelineRunner`, is an ``nn.Module`` (``runner.py``); :func:`build_pipeline_runner`
  (``runtime.py``) is the schedule builder for one GPipe/1F1B stage per rank from a stage assignment.
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
