"""coarsen(): folding free nodes into ops, on hand-made fine graphs with hand-worked answers."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.graph.coarsen import coarsen


def test_chain_with_input_views_and_output() -> None:
    # 0 x (source) -> 1 view(x) -> 2 conv -> 3 getitem -> 4 relu -> 5 output
    roles = ["source", "view", "op", "view", "op", "sink"]
    inputs = [[], [0], [1], [2], [3], [4]]
    c = coarsen(roles, inputs, [10, 10, 20, 5, 5, 0])
    assert c.heads == (2, 4)
    # the input and its view fold forward into the conv; getitem back into the conv; output into relu
    assert c.op_of == (0, 0, 0, 0, 1, 1)
    assert c.members == ((0, 1, 2, 3), (4, 5))
    assert c.edges.tolist() == [[0, 1]]
    assert c.edge_bytes.tolist() == [5.0]  # relu reads the getitem's value


def test_view_of_two_ops_goes_to_the_later_one() -> None:
    # 0 x; 1 a = op(x); 2 b = op(x); 3 v = expand_as(a, b) (view of both); 4 c = op(v)
    roles = ["source", "op", "op", "view", "op"]
    inputs = [[], [0], [0], [1, 2], [3]]
    c = coarsen(roles, inputs, [4, 8, 8, 8, 8])
    assert c.op_of[3] == 1  # op index of b (the later of a = 0 and b = 1)
    assert c.edges.tolist() == [[0, 1], [1, 2]]
    # x sits with a (its first consumer); b reads x from a: 4 bytes; a is read by the view in op 1
    assert dict(zip(map(tuple, c.edges.tolist()), c.edge_bytes.tolist())) == {(0, 1): 4.0 + 8.0, (1, 2): 8.0}


def test_value_read_twice_by_one_op_crosses_once() -> None:
    # 0 x; 1 a = op(x); 2 b = op(a, a-view); 3 view(a)
    roles = ["source", "op", "view", "op"]
    inputs = [[], [0], [1], [1, 2]]
    c = coarsen(roles, inputs, [1, 100, 100, 0])
    # op 1 reads a (100 bytes) and the view of a (which lives in op 0: another 100)
    assert c.edges.tolist() == [[0, 1]]
    assert c.edge_bytes.tolist() == [200.0]
    roles2 = ["source", "op", "op", "op"]
    inputs2 = [[], [0], [1, 1], [1]]
    c2 = coarsen(roles2, inputs2, [1, 100, 7, 0])
    assert dict(zip(map(tuple, c2.edges.tolist()), c2.edge_bytes.tolist())) == {(0, 1): 100.0, (0, 2): 100.0}


def test_shared_parameter_reads_are_edgeless() -> None:
    # 0 w (get_attr); 1 a = op(w); 2 b = op(a, w)
    roles = ["source", "op", "op"]
    inputs = [[], [0], [1, 0]]
    with_edge = coarsen(roles, inputs, [64, 8, 8])
    assert with_edge.edge_bytes.tolist() == [72.0]
    without = coarsen(roles, inputs, [64, 8, 8], edgeless=[0])
    assert without.edge_bytes.tolist() == [8.0]


def test_unused_and_all_free() -> None:
    # an unused input goes to the next op after it
    c = coarsen(["op", "source", "op", "sink"], [[], [], [0], [2]], [1, 1, 1, 0])
    assert c.op_of == (0, 1, 1, 1)
    # nothing but an input and the output: the output becomes the one op
    c = coarsen(["source", "sink"], [[], [0]], [4, 0])
    assert c.heads == (1,) and c.op_of == (0, 0) and c.edges.shape == (0, 2)


def test_random_graphs_stay_topological() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 40))
        roles = list(rng.choice(["op", "view", "source"], size=n - 1, p=[0.5, 0.3, 0.2])) + ["sink"]
        inputs = [sorted(set(rng.integers(0, i, size=int(rng.integers(0, 3))).tolist())) if i else []
                  for i in range(n)]
        inputs = [[] if r == "source" else ins for r, ins in zip(roles, inputs)]
        c = coarsen(roles, inputs, rng.integers(1, 100, size=n).tolist())
        assert np.all(c.edges[:, 0] < c.edges[:, 1])
        for i, ins in enumerate(inputs):
            for j in ins:
                assert c.op_of[j] <= c.op_of[i]
        assert sorted(m for ms in c.members for m in ms) == list(range(n))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown roles"):
        coarsen(["op", "free"], [[], [0]], [1, 1])
    with pytest.raises(ValueError, match="topological"):
        coarsen(["op", "op"], [[1], []], [1, 1])
