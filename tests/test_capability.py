"""What the runtime runs (autoplace.capability.runtime_problems) and the per-rank recompute lists
of plans with virtual stages (autoplace.parallel.split_recompute)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
import autoplace.zoo as zoo
from autoplace.capability import runtime_problems
from autoplace.graph.trace import trace_module
from autoplace.graph.units import block_units


@pytest.fixture(scope="module")
def g():  # type: ignore[no-untyped-def]
    wl = zoo.build("llama", small=True, n_layers=4, batch_size=8)
    return trace_module(wl.model, wl.example_inputs).graph


def _by_block(g) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Stage k holds block layers.k (the embedding with the first, norm and head with the last)."""
    u = block_units(g)
    names = [u.names[x] if x >= 0 else "" for x in np.asarray(u.unit_of_node).tolist()]
    st = [int(n.split(".")[1]) if n.startswith("layers.") else 0 for n in names]
    return np.maximum.accumulate(np.array(st))


def test_a_ranks_recompute_list_keeps_the_units_of_all_its_virtual_stages(g) -> None:  # type: ignore[no-untyped-def]
    # 2 ranks x 2 virtual stages, interleaved: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3;
    # the units of stages 2 and 3 were dropped without a word when lists were split per stage index
    c = autoplace.Cluster.preset("8xA100-nvlink")
    blocks = ["layers.0", "layers.1", "layers.2", "layers.3"]
    p = autoplace.Placement.pipeline(g, c, _by_block(g), [[0, 1], [2, 3]], microbatches=4,
                                     schedule="interleaved-1f1b", virtual_stages=2, recompute=blocks)
    assert p.recompute == (("layers.0", "layers.2"), ("layers.1", "layers.3"))
    v = autoplace.Placement.pipeline(g, c, _by_block(g), [[0, 1], [2, 3]], microbatches=4, schedule="zbv",
                                     virtual_stages=2, recompute=blocks)  # V: rank 0 holds stages 0 and 3
    assert v.recompute == (("layers.0", "layers.3"), ("layers.1", "layers.2"))
    with pytest.raises(autoplace.PlacementError, match="stage 0 recomputes 'layers.1'"):
        autoplace.Placement.pipeline(g, c, _by_block(g), [[0, 1], [2, 3]], microbatches=4,
                                     schedule="interleaved-1f1b", virtual_stages=2,
                                     recompute=[("layers.0", "layers.1"), ("layers.3",)])


def test_a_tensor_parallel_group_is_one_replica_of_the_batch(g) -> None:  # type: ignore[no-untyped-def]
    # tp=2 on 4 devices: 2 replicas, each micro-batch split in 2 (the runtime's dp), not in 4
    c = autoplace.Cluster.preset("8xA100-nvlink")
    p = autoplace.Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=4, tp=2)
    assert runtime_problems(p, g) == []
    over = autoplace.Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=8,
                                        tp=2, validate=False)
    assert any("micro" in m or "sample" in m for m in runtime_problems(over, g))
