"""Tensor parallelism under torchrun, gloo on CPU: the attention and MLP blocks the op graph
shows, sharded with ColwiseParallel/RowwiseParallel (attention on local heads), train like the
unsplit model to 1e-5: TP=2 on 2 ranks, and 2 pipeline stages x TP=2 on 4 ranks; the collectives
torch runs are those the simulator charges."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.fx

import autoplace
import pipeline_workers as pw
import tp_models as tm
from autoplace.rewrite.tensor_parallel import TensorParallelError, localize_heads, tp_layout, whole_blocks
from autoplace.sim.tensor_parallel import tp_collectives
from autoplace.tp_rules import linear_pairs

CHILD = Path(__file__).with_name("tp_child.py")


def _launch(tmp_path: Path, ranks: int, cases: list[dict]) -> dict[str, list[dict]]:
    pw.launch_cases(CHILD, tmp_path, ranks, cases, 300)
    return {c["id"]: [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)] for c in cases}


def _attention(prefix: str, cols: tuple[str, ...], row: str) -> dict[str, str]:
    return {**{f"{prefix}.{c}": "colwise" for c in cols}, f"{prefix}.{row}": "rowwise"}


def test_tp2_attention_and_mlp_equal_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, [{"id": "gpt", "model": "gpt-qkv", "pp": 1}, {"id": "llama", "model": "llama", "pp": 1}])
    gpt_layout: dict[str, str] = {}
    llama_layout: dict[str, str] = {}
    for b in (0, 1):
        gpt_layout |= _attention(f"blocks.{b}.attn", ("q", "k", "v"), "proj") | _attention(f"blocks.{b}", ("fc",), "fc2")
        llama_layout |= (_attention(f"layers.{b}.attention", ("wq", "wk", "wv"), "wo")
                         | _attention(f"layers.{b}.feed_forward", ("w1", "w3"), "w2"))
    for name, layout in (("gpt", gpt_layout), ("llama", llama_layout)):
        # the collectives torch ran (CommDebugMode) are the ones the simulator charges
        graph = autoplace.trace(tm.build("gpt-qkv" if name == "gpt" else "llama"), (tm.batch(8, 0)[0],))
        charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, np.arange(graph.num_nodes), 1, tp=2))
        ran = {k.replace("_into_tensor", ""): v for k, v in got[name][0]["comms"].items()}
        # Llama's untied tok_embeddings/output are split by vocabulary too (test_tp_vocab.py): one
        # more forward all-reduce, the loss's three (loss parallelism, counted with the forward), one
        # more backward all-reduce
        vocab = {"tok_embeddings", "output"} if name == "llama" else set()
        assert ran == dict(charged) == {"forward all_reduce": 4 + (1 + 3 if vocab else 0),
                                        "backward all_reduce": 8 if name == "gpt" else 11}
        for r in got[name]:
            assert r["layout"] == layout
            assert {n.rsplit(".", 1)[0] for n in r["sharded"]} == set(layout) | vocab
            assert len(r["losses"]) == 5 and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, (name, r)


def test_pp2_x_tp2_equals_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, [{"id": "gpt", "model": "gpt-qkv", "pp": 2}, {"id": "llama", "model": "llama", "pp": 2}])
    for name, parts in got.items():
        assert sum(len(r["losses"]) for r in parts) == 2 * 5  # the last stage's two TP ranks
        assert any("attn.q.weight" in n or "attention.wq.weight" in n for r in parts for n in r["sharded"])
        want = {n for n, _ in tm.build("gpt-qkv" if name == "gpt" else "llama").named_parameters()}
        assert set().union(*(r["checked"] for r in parts)) == want
        for r in parts:
            assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, (name, r)


def _traced(heads: int) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    model = tm.build("gpt-qkv", 0, heads=heads)
    x, _ = tm.batch(8, 0)
    return torch.fx.symbolic_trace(model), tp_layout(linear_pairs(autoplace.trace(model, (x,))))


def test_reshapes_follow_the_local_head_count() -> None:
    gm, layout = _traced(4)
    # per block: q's view (4 -> 2 heads), k's unflatten, v's reshape, the merge (16 -> 8 features)
    assert localize_heads(gm, layout, 2) == 4 * 2
    code = gm.code
    for line in ("view(size_1, size_2, 2, 4)", "unflatten(-1, (2, -1))", "reshape(size_1, size_2, 2, 4)",
                 "reshape(size_1, size_2, 8)"):
        assert line in code, code

def test_heads_not_divisible_is_refused_with_the_fix() -> None:
    gm, layout = _traced(1)
    with pytest.raises(TensorParallelError, match=r"has 1 heads on the sharded dimension; tp=2 does not divide them: "
                                                  r"use a tensor-parallel degree that divides 1"):
        localize_heads(gm, layout, 2)


class _CutAttention(torch.nn.Module):
    """A stage that a boundary cut after the query projection: q arrives as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.v, self.proj = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qh = q.view(8, 8, 4, 4).transpose(1, 2)
        k, v = (m(x).view(8, 8, 4, 4).transpose(1, 2) for m in (self.k, self.v))
        return self.proj(torch.nn.functional.scaled_dot_product_attention(qh, k, v).transpose(1, 2).reshape(8, 8, 16))


def test_a_block_cut_by_a_stage_boundary_stays_whole() -> None:
    gm = torch.fx.symbolic_trace(_CutAttention())
    layout = {"k": "colwise", "v": "colwise", "proj": "rowwise", "other": "colwise"}
    assert whole_blocks(gm, layout) == {"other": "colwise"}
    uncut, full = _traced(4)
    assert whole_blocks(uncut, full) == full


def test_tp2_with_sequence_parallelism_equals_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, [{"id": "gpt", "model": "gpt-qkv", "pp": 1, "sp": True},
                                {"id": "llama", "model": "llama", "pp": 1, "sp": True}])
    names = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
             "all_gather_into_tensor": "all_gather"}
    for name, parts in got.items():
        graph = autoplace.trace(tm.build("gpt-qkv" if name == "gpt" else "llama"), (tm.batch(8, 0)[0],))
        charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, np.arange(graph.num_nodes), 1, tp=2,
                                                                        sequence_parallel=True))
        # the blocks' collectives (DTensor's) are the simulator's; the rewrite's own (allgather_, allreduce_:
        # the cut before the head, the norms' weight gradients) are not charged
        ran = {f"{k.split()[0]} {names[k.split()[1]]}": v for k, v in parts[0]["comms"].items()
               if k.split()[1] in names}
        assert ran == dict(charged), (name, parts[0]["comms"])
        for r in parts:
            assert len(r["losses"]) == 5 and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, (name, r)
