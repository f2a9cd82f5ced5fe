"""Where trained networks of the learned planners are kept, so that online fine-tuning starts
from the network a plan was made with (``placement.meta["tuned_weights"]``; written by
:func:`autoplace.planners.learned.mars.planner.keep_tuned` for Mars,
:func:`autoplace.planners.learned.eagle.weights.keep_trained` for EAGLE and
:func:`autoplace.planners.learned.pipeline.tuned.keep_tuned` for pipeline-rl)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

from torch import nn

__all__ = ["tuned_dir", "tuned_path", "keep_network"]


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


def keep_network(net: nn.Module, planner: str, save: Callable[[Path], None], keep: int) -> Path:
    """Save ``net`` (by ``save(path)``) under ``tuned_dir(planner)`` once (the same network is one
    file, touched when saved again), drop all but the newest ``keep`` files there, and return its
    path (``placement.meta["tuned_weights"]``)."""
    path = tuned_path(net, planner)
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save(tmp)
        tmp.replace(path)
    else:
        path.touch()
    files = sorted(tuned_dir(planner).glob("tuned-*.pt"), key=_mtime, reverse=True)
    for old in files[keep:]:
        if old != path:
            old.unlink(missing_ok=True)
    return path


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except FileNotFoundError:  # another process pruned it meanwhile
        return 0.0
