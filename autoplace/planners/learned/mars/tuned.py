"""Where trained networks of the learned planners are kept, so that online fine-tuning starts
from the network a plan was made with (``placement.meta["tuned_weights"]``; written by
:func:`autoplace.planners.learned.mars.planner.keep_tuned` for Mars,
:func:`autoplace.planners.learned.eagle.weights.keep_trained` for EAGLE and
:func:`autoplace.planners.learned.pipeline.tuned.keep_tuned` for pipeline-rl)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from torch import nn

__all__ = ["tuned_dir", "tuned_path"]


def tuned_dir(planner: str = "mars") -> Path:
    """``$AUTOPLACE_CACHE/<planner>`` (default ``~/.cache/autoplace/mars``): trained networks,
    kept so that online fine-tuning starts from the network a plan was made with."""
    return Path(os.environ.get("AUTOPLACE_CACHE", Path.home() / ".cache" / "autoplace")) / planner


def tuned_path(net: nn.Module, planner: str = "mars") -> Path:
    """The file under :func:`tuned_dir` for ``net``, named by a hash of its parameters (the same
    network is one file); the folder is created."""
    digest = hashlib.sha1()
    for k, v in sorted(net.state_dict().items()):
        digest.update(k.encode())
        digest.update(v.detach().cpu().contiguous().numpy().tobytes())
    folder = tuned_dir(planner)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"tuned-{digest.hexdigest()[:16]}.pt"
