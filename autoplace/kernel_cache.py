"""Keep numba's on-disk kernel cache in step with the kernels' sources.

numba keys a cached kernel by its own file's path and time stamp only. A kernel that calls a
kernel of another file (the stage costs' compiled pass calls :func:`autoplace.sim.ddp.ddp_bucket_plan`)
keeps the old callee's machine code after only the callee's file changed: in a working tree
updated in place (a pull, an edit) the simulator then silently runs old code. So once per
process, on import, this hashes the source of every autoplace module that defines a numba kernel
and, when the hash differs from the one stamped beside the cache, deletes autoplace's cached
kernels (``*.nbi``/``*.nbc`` in its ``__pycache__`` folders) so each compiles once again
(:mod:`autoplace.planners.warmup` does that ahead). A fresh install has no stale cache; numba's
per-user or ``$NUMBA_CACHE_DIR`` caches, used when the package folder is not writable, are not
touched.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

__all__ = ["kernel_sources_hash", "refresh"]

STAMP = "autoplace-kernels.stamp"
"""the file in ``autoplace/__pycache__`` holding the hash the cached kernels were built from."""


_KERNEL = re.compile(r"^\s*@(?:numba\.)?n?jit\b", re.MULTILINE)
"""a line decorating a numba kernel (``@njit(...)``, ``@numba.jit``)."""


def _kernel_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts
                  and _KERNEL.search(p.read_text(encoding="utf-8", errors="replace")))


def kernel_sources_hash(root: Path) -> str:
    """A hash of the paths and contents of the modules under ``root`` that define numba kernels."""
    h = hashlib.sha256()
    for p in _kernel_files(root):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _stat_key(root: Path) -> str:
    """A cheap key of every module's path, size and time stamp: when it is the stamped one, no
    source changed and nothing is read."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        if "__pycache__" not in p.parts:
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def refresh(root: Path | None = None) -> bool:
    """Delete the cached kernels under ``root`` (default: this package) when the kernel sources
    changed since they were stamped; True when it deleted. Quiet and harmless where the folder
    is read-only (numba then caches elsewhere). The stamp holds the kernel sources' hash and the
    modules' :func:`_stat_key`, so an unchanged tree costs one ``stat`` per module."""
    root = Path(__file__).resolve().parent if root is None else root
    stamp = root / "__pycache__" / STAMP
    try:
        old = stamp.read_text().split() if stamp.exists() else []
        key = _stat_key(root)
        if old[1:2] == [key]:
            return False
        now = kernel_sources_hash(root)
        stale = [] if old[:1] == [now] else [p for p in root.rglob("__pycache__/*") if p.suffix in (".nbi", ".nbc")]
        for p in stale:
            p.unlink(missing_ok=True)
        stamp.parent.mkdir(exist_ok=True)
        stamp.write_text(f"{now}\n{key}\n")
        return bool(stale)
    except OSError:
        return False
