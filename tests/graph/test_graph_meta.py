"""OpGraph.meta is typed (graph.ir.GraphMeta): every key a layer writes for another to read is
declared there, and a graph with an undeclared key is refused where it is built, so a misspelt
key fails loudly instead of being read as absent."""

from __future__ import annotations

import json

import pytest
import torch.nn as nn

import autoplace
from autoplace.graph.ir import GraphError, GraphMeta, OpGraph


def _graph() -> OpGraph:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    import torch

    return autoplace.trace(model, (torch.randn(4, 8),))


def test_an_undeclared_key_is_refused_with_the_declared_ones_named() -> None:
    g = _graph()
    with pytest.raises(GraphError, match=r"\['memroy'\].*GraphMeta's.*memory"):
        g.replace(meta={**g.meta, "memroy": {}})


def test_every_key_a_trace_writes_is_declared_and_survives_json() -> None:
    g = _graph()
    assert set(g.meta) <= GraphMeta.__optional_keys__
    assert {"traced_with", "fx_nodes", "memory"} <= set(g.meta)  # what the tracer is documented to write
    back = OpGraph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert back.meta.keys() == g.meta.keys()
