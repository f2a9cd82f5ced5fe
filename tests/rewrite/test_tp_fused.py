"""Tensor parallelism of a fused q/k/v projection (GPT-2's ``c_attn``) under torchrun, gloo on
CPU, fp32: the zoo's gpt2 (small config) and a GPT whose fused projection is ``chunk``ed and
``view``ed, TP=2 on 2 ranks, train like the unsplit model to 1e-5 (losses, parameters gathered in
the original layout, ``checkpoint.full_state_dict``, and a ``checkpoint.save``/``load``
round trip into a TP and into the plain model); each rank holds exactly rows q_i, k_i,
v_i of the fused weight; the collectives torch runs are those the simulator charges (one input-
gradient all-reduce per fused column). Slow: sequence parallelism, 2 pipeline stages x TP=2, and
TP=2 x DDP=2 through ``autoplace.wrap``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.fx

import autoplace
import pipeline_workers as pw
from autoplace import zoo
from autoplace.rewrite.tensor_parallel import TensorParallelError, fused_columns, localize_heads, tp_layout
from autoplace.sim.tensor_parallel import tp_collectives
from autoplace.tp_rules import linear_pairs

CHILD = Path(__file__).with_name("tp_fused_child.py")


def _launch(tmp_path: Path, ranks: int, cases: list[dict]) -> dict[str, list[dict]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    pw.launch_cases(CHILD, tmp_path, ranks, cases, 300)
    return {c["id"]: [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)] for c in cases}


_NAMES = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
          "all_gather_into_tensor": "all_gather"}  # DTensor's collectives as the simulator names them


def _ran(comms: dict[str, int]) -> dict[str, int]:
    """CommDebugMode's counts (``"forward all_gather_into_tensor"``: 1) under the simulator's names;
    the rewrite's own collectives (``allgather_``, ...) are not charged and are left out."""
    return {f"{k.split()[0]} {_NAMES[k.split()[1]]}": v for k, v in comms.items() if k.split()[1] in _NAMES}


def _gpt2() -> tuple[torch.nn.Module, torch.Tensor]:
    wl = zoo.build("gpt2", small=True, seed=0)
    return wl.model, wl.example_inputs[0]


def test_tp2_fused_qkv_equals_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, [{"id": "gpt2", "model": "gpt2", "pp": 1, "ckpt": True},
                                {"id": "chunk", "model": "chunk", "pp": 1}])
    import tp_fused_child as child

    for name in ("gpt2", "chunk"):  # the models the child trains (GPT-2 at its vocabulary of 256)
        model, _ = child.build(name)
        graph = autoplace.trace(model, (child.batch(0)[0],))
        charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, np.arange(graph.num_nodes), 1, tp=2))
        assert len(_ran(got[name][0]["comms"])) == len(got[name][0]["comms"])  # only DTensor's ran, none dropped
        assert _ran(got[name][0]["comms"]) == dict(charged), (name, got[name][0]["comms"], charged)
    # gpt2 (2 blocks of attention + MLP): per block one forward all-reduce of each row output, per
    # column (c_attn is one, fused) one input-gradient all-reduce: 4 + 4; and the vocabulary split
    # (wte and the tied lm_head in one module): wte's forward all-reduce, the loss's three (loss
    # parallelism, counted with the forward), lm_head's input-gradient all-reduce. chunk (2 attention
    # blocks, a fused qkv each; its head has a bias, so no vocabulary split): 2 + 2.
    assert _ran(got["gpt2"][0]["comms"]) == {"forward all_reduce": 4 + 1 + 3, "backward all_reduce": 4 + 1}
    assert _ran(got["chunk"][0]["comms"]) == {"forward all_reduce": 2, "backward all_reduce": 2}
    for name, fused in (("gpt2", "h.0.attn.c_attn"), ("chunk", "attn.0.qkv")):
        for r in got[name]:
            assert r["layout"][fused] == "colwise" and r["parts"][fused] == 3
            assert f"{fused}.weight" in r["sharded"] and r["local_is_qkv_rows"], (name, r)
            assert len(r["losses"]) == 5 and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, (name, r)
            assert r["state_keys"] and r["state_err"] <= 1e-5, (name, r)
    for r in got["gpt2"]:  # checkpoint.save of the strided shards, loaded into TP and into the plain model
        assert r["ckpt_tp_err"] <= 1e-5 and r["ckpt_plain_err"] <= 1e-5, r


@pytest.mark.slow
def test_fused_qkv_with_sequence_parallelism_in_a_pipeline_and_with_ddp(tmp_path: Path) -> None:
    sp = _launch(tmp_path / "sp", 2, [{"id": "sp", "model": "gpt2", "pp": 1, "sp": True}])["sp"]
    for r in sp:
        assert r["local_is_qkv_rows"] and r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
        assert r["state_err"] <= 1e-5
    model, x = _gpt2()
    graph = autoplace.trace(model, (x,))
    charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, np.arange(graph.num_nodes), 1, tp=2,
                                                                    sequence_parallel=True))  # the vocab split's too
    ran = _ran(sp[0]["comms"])
    assert ran == dict(charged), (ran, charged)  # the fused column gathers its input once, as one column
    four = _launch(tmp_path / "four", 4, [{"id": "pp", "model": "gpt2", "pp": 2},
                                          {"id": "dp", "model": "gpt2", "pp": 1, "tp": 2, "wrap": True}])
    for r in four["dp"]:  # TP2 x DDP2 through autoplace.wrap (a plan of one rank of 4 devices, tp=2)
        assert "h.0.attn.c_attn.weight" in r["sharded"] and len(r["losses"]) == 5
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
    pp = four["pp"]
    assert sum(len(r["losses"]) for r in pp) == 2 * 5  # the last stage's two TP ranks
    assert {"h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"} <= {n for r in pp for n in r["sharded"]}
    want = {n for n, _ in _gpt2()[0].named_parameters(remove_duplicate=False)}  # lm_head's tied weight too
    assert set().union(*(r["checked"] for r in pp)) == want
    for r in pp:
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r


def test_the_fused_split_and_heads_follow_the_local_sizes() -> None:
    model, x = _gpt2()  # n_embd 32, 4 heads: split(32, dim=2), unflatten(2, (4, -1)) per part
    gm = torch.fx.symbolic_trace(model)
    layout = tp_layout(linear_pairs(autoplace.trace(model, (x,))))
    assert fused_columns(gm, layout) == {"h.0.attn.c_attn": 3, "h.1.attn.c_attn": 3}
    assert localize_heads(gm, layout, 2) == 2 * (1 + 3)  # per block the split and q, k, v's unflatten
    assert "split(16, dim = 2)" in gm.code and "unflatten(2, (2, -1))" in gm.code, gm.code


class _Unequal(torch.nn.Module):
    """A projection split into unequal parts (q 16 wide, k and v 8 each: not a fused column)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(16, 32), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split([16, 8, 8], dim=-1)
        return self.proj(q * torch.cat([k, v], dim=-1))


def test_a_column_split_otherwise_is_refused_by_the_runtime() -> None:
    gm = torch.fx.symbolic_trace(_Unequal())
    with pytest.raises(TensorParallelError, match=r"qkv \(colwise\) is read by .*not into equal parts of its last "
                                                  r"dimension each reshaped into heads"):
        fused_columns(gm, {"qkv": "colwise", "proj": "rowwise"})


def test_a_fused_part_tp_does_not_divide_is_refused_with_the_fix() -> None:
    model, x = _gpt2()
    gm = torch.fx.symbolic_trace(model)
    layout = tp_layout(linear_pairs(autoplace.trace(model, (x,))))
    with pytest.raises(TensorParallelError, match=r"splits 96 features into parts of \[32, 32, 32\]; tp=3 does not "
                                                  r"divide them: use a tensor-parallel degree that divides 32"):
        localize_heads(gm, layout, 3)


@pytest.mark.slow
@pytest.mark.skip(reason="FSDP2 over a fused column's strided TP shard: training matches the unsplit model, but "
                  "FSDP's 2-D placement (dp chunks of the TP-local q_i|k_i|v_i rows) is not the DTensor its spec says, "
                  "so full_tensor() of c_attn.weight is wrong (max 0.12). capability.runtime_problems refuses the "
                  "combination (test_capability); this is the test for the fix (shard fused weights on dim 1 with "
                  "shard_placement_fn, or keep them whole): lift the refusal and this skip together")
def test_fsdp2_x_tp2_with_a_fused_column(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, [{"id": "fsdp", "model": "gpt2", "pp": 1, "tp": 2, "wrap": True, "shard": "fsdp"}])
    for r in got["fsdp"]:
        assert r["loss_err"] <= 1e-5, r  # the training itself is right
        assert r["param_err"] <= 1e-5, r["worst"]
