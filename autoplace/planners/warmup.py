"""Compile the simulator's numba kernels into numba's on-disk cache now, before the first plan.

    python -m autoplace.planners.warmup        # once after installing (or editing) autoplace

Every kernel is ``@njit(cache=True)``: the first process that calls one compiles it (about 15 s
for all of them on two busy cores) and writes it to the cache, where every later process loads
it in well under a second. The cache lives in the ``__pycache__`` folder beside each source
file when that is writable (a clone, a virtual environment), else in numba's per-user cache
folder, or in ``$NUMBA_CACHE_DIR`` when set. It is keyed by the source file's path and time
stamp, so editing a file (or moving the installation) compiles that file's kernels again, and
:mod:`autoplace.kernel_cache` drops every cached kernel when any kernel source changed (numba
would keep a caller's old copy of a changed callee).

This plans two small traced models on a four-GPU preset in every mode with every planner and
simulates the plans with timelines, which calls each kernel once with the types planning
uses (the types depend neither on the graph's size nor on the cluster: the simulator hands
the kernels arrays of fixed dtypes, all writable). ``plan()`` does not count compilation
against its time budget either way; this only moves the wait to installation time.
"""

from __future__ import annotations

import sys
import time

import autoplace
from autoplace.planners import budget as _budget
from autoplace.progress import shown

__all__ = ["warm_up"]


def warm_up(*, verbose: bool = False) -> float:
    """Call every simulator kernel once; returns the seconds numba spent compiling (0 when the
    cache already held them all)."""
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    with _budget.within(3600.0):  # installs numba's compile listener
        before = _budget.compile_s()
        with shown(verbose):
            # a branchy CNN with BatchNorm, and a transformer without: the multi-stage schedules
            # (interleaved, zero-bubble: autoplace.sim.order_sim) are offered to the second only
            for name in ("inception_v3", "gpt2"):
                wl = autoplace.zoo.build(name, small=True, device="meta")
                graph = autoplace.trace(wl.model, wl.example_inputs)
                for mode in ("model", "pipeline"):
                    plan = autoplace.plan(graph, cluster, mode=mode)
                    autoplace.simulate(graph, plan, cluster).timeline
                autoplace.lower_bound(graph, cluster)
        return _budget.compile_s() - before


def main() -> int:
    t0 = time.perf_counter()
    compiled = warm_up(verbose="-v" in sys.argv[1:])
    print(f"autoplace: simulator kernels ready in numba's cache ({compiled:.1f} s compiling, "
          f"{time.perf_counter() - t0:.1f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
