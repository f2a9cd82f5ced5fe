"""The pipeline policy of a graph and cluster, and the shipped weights it loads: what the
``pipeline-rl`` planner needs at plan time, without the pretraining (:mod:`.pretrain` makes the
weights; importing it would load the training corpus and the zoo)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from autoplace.cluster import Cluster
from autoplace.planners.learned.features import node_features
from autoplace.sim import simulator_for
from .policy import PipelinePolicy, device_features, summary_features
from .space import PipelineSpace

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["make_policy", "load_weights", "weights_hidden", "WEIGHTS_PATH", "MAX_STAGES"]

WEIGHTS_PATH = Path(__file__).resolve().parents[3] / "weights" / "pipeline_rl.pt"
"""The shipped weights (their split and command in the ``.json`` beside them)."""
MAX_STAGES = 16
"""Most stages the pretrained policy plans (the device head's cost grows as stages^2 x devices)."""

def make_policy(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None" = None, *, hidden: int = 32,
                max_stages: int | None = MAX_STAGES, explore: float = 0.1, seed: int = 0,
                weights: Path | str | None = None) -> PipelinePolicy:
    """The pipeline policy of ``graph`` on ``cluster`` (``weights``: a pretrained network to load)."""
    sim = simulator_for(graph, cluster, cost)
    space = PipelineSpace.of(graph, cluster, sim, max_stages=max_stages)
    x = np.asarray(node_features(graph, cluster, cost=sim.cost), dtype=np.float32)
    pol = PipelinePolicy(space, x, device_features(space, cluster), summary_features(space, sim, sim.cost),
                         hidden=hidden, explore=explore, seed=seed)
    if weights is not None:
        pol.load_shared(load_weights(weights))
    return pol


def load_weights(path: Path | str) -> dict[str, torch.Tensor]:
    """The shared network saved by :func:`pretrain`."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no pipeline policy weights at {p}; run python -m "
                                "autoplace.planners.learned.pipeline.pretrain, or plan without weights")
    state = torch.load(p, map_location="cpu", weights_only=True)
    return {str(k): v for k, v in state.items()}


def weights_hidden(path: Path | str) -> int:
    """The hidden size the weights at ``path`` were made with (from the .json beside them)."""
    meta = Path(path).with_suffix(".json")
    if not meta.exists():
        raise FileNotFoundError(f"{meta} is missing: the pipeline weights' record (hidden size, split, command) "
                                "is written beside them by python -m autoplace.planners.learned.pipeline.pretrain")
    return int(json.loads(meta.read_text())["config"]["hidden"])
