"""numba's cache is dropped when any kernel source changes (autoplace.kernel_cache): numba itself
keys a kernel by its own file only, so a changed callee in another file kept old machine code."""

from __future__ import annotations

from pathlib import Path

from autoplace.kernel_cache import STAMP, kernel_sources_hash, refresh


def _tree(root: Path) -> list[Path]:
    (root / "sim" / "__pycache__").mkdir(parents=True)
    (root / "sim" / "ddp.py").write_text("from numba import njit\n@njit(cache=True)\ndef f(x):\n    return x\n")
    (root / "sim" / "pipeline.py").write_text("from numba import njit\nfrom .ddp import f\n")
    (root / "plain.py").write_text('"""Kernels are ``@njit(cache=True)``."""\nx = 1\n')  # names it, has none
    cached = [root / "sim" / "__pycache__" / n for n in ("pipeline._core-85.py311.nbi", "pipeline._core-85.py311.0.nbc")]
    for p in cached:
        p.write_bytes(b"old machine code")
    return cached


def test_a_changed_callee_drops_the_cache_and_nothing_else_does(tmp_path: Path) -> None:
    cached = _tree(tmp_path)
    assert refresh(tmp_path)  # no stamp yet: whatever is cached may be stale
    assert not any(p.exists() for p in cached)
    assert (tmp_path / "__pycache__" / STAMP).read_text().split()[0] == kernel_sources_hash(tmp_path)
    for p in cached:
        p.write_bytes(b"new machine code")
    assert not refresh(tmp_path) and all(p.exists() for p in cached)  # unchanged sources: kept
    (tmp_path / "plain.py").write_text('"""Kernels are ``@njit(cache=True)``."""\nx = 2\n')  # no kernel there
    assert not refresh(tmp_path) and all(p.exists() for p in cached)
    (tmp_path / "sim" / "ddp.py").write_text("from numba import njit\n@njit(cache=True)\ndef f(x):\n    return 2 * x\n")
    assert refresh(tmp_path)  # only the callee's file changed: the caller's cache goes too
    assert not any(p.exists() for p in cached)


def test_the_package_is_stamped_on_import() -> None:
    import autoplace

    root = Path(autoplace.__file__).resolve().parent
    assert (root / "__pycache__" / STAMP).read_text().split()[0] == kernel_sources_hash(root)
