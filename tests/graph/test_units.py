"""FSDP units from the module tree: blocks, the root, and the cases that fall back to the root."""

from __future__ import annotations

import numpy as np

from autoplace import OpGraph
from autoplace.graph.trace import trace_module
from autoplace.graph.units import block_units, stage_units
import autoplace.zoo as zoo


def _g(paths: list[str], edges: list[tuple[int, int]], tied: tuple[tuple[int, ...], ...] = ()) -> OpGraph:
    n = len(paths)
    return OpGraph.build([f"n{i}" for i in range(n)], ["linear"] * n, edges, module_paths=tuple(paths), tied=tied)


def test_transformer_blocks_are_units_and_the_rest_is_root() -> None:
    wl = zoo.build("gpt2", small=True)
    g = trace_module(wl.model, wl.example_inputs).graph
    u = block_units(g)
    # blocks, and top-level modules with parameters of their own; the tied embedding and head
    # share one parameter, so both stay in the root
    assert u.names == ("wpe", "h.0", "h.1", "ln_f")
    roots = [g.names[i] for i in u.nodes(-1)]
    assert {"wte", "lm_head"} <= set(roots) and not {"wpe", "ln_f"} & set(roots)
    # every op of h.0 (its residual adds too) is in unit 0
    assert all(u.unit_of_node[i] == u.index("h.0") for i, p in enumerate(g.module_paths) if p.startswith("h.0"))


def test_outermost_indexed_child_with_siblings_is_the_block() -> None:
    # encoder.layer.0.attn / encoder.layer.1.ff; "mlp.0" alone (one indexed child) is no container
    g = _g(["emb", "encoder.layer.0.attn", "encoder.layer.0.ff.0", "encoder.layer.0.ff.1",
            "encoder.layer.1.attn", "head.0"], [(i, i + 1) for i in range(5)])
    u = block_units(g)
    assert u.names == ("encoder.layer.0", "encoder.layer.1")
    assert u.unit_of_node.tolist() == [-1, 0, 0, 0, 1, -1]  # emb and head own no parameters here
    owned = OpGraph.build([f"n{i}" for i in range(3)], ["linear"] * 3, [(0, 1), (1, 2)],
                          module_paths=("emb", "layers.0", "layers.1"), param_bytes=[4.0, 4.0, 4.0])
    assert block_units(owned).names == ("emb", "layers.0", "layers.1")  # a top-level module with parameters


def test_non_convex_blocks_and_tied_parameters_fall_back_to_the_root() -> None:
    # blocks.0 = {1, 3} with 2 (root) between: 1 -> 2 -> 3, so it cannot run as one call
    g = _g(["a", "blocks.0", "mid", "blocks.0", "blocks.1", "blocks.1"], [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])
    assert block_units(g).names == ("blocks.1",)
    # blocks.0 and blocks.1 share a parameter: neither can own it alone
    t = _g(["a", "blocks.0", "blocks.1", "blocks.2"], [(0, 1), (1, 2), (2, 3)], tied=((1, 2),))
    u = block_units(t)
    assert u.names == ("blocks.2",)
    assert u.unit_of_node.tolist() == [-1, -1, -1, 0]


def test_units_split_by_a_stage_boundary_go_to_the_root() -> None:
    g = _g(["a", "blocks.0", "blocks.0", "blocks.1", "blocks.1"], [(i, i + 1) for i in range(4)])
    u = block_units(g)
    assert stage_units(u, np.array([0, 0, 1, 1, 1])).tolist() == [-1, -1, -1, 1, 1]
    assert stage_units(u, np.array([0, 0, 0, 1, 1])).tolist() == [-1, 0, 0, 1, 1]
