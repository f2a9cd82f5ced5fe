"""tp_rules on fused q/k/v projections: GPT-2's ``c_attn`` (one Linear split into q, k, v, each
reshaped into heads) is one fused column of its attention block, with its part count, and the
width and heads rules apply per part; what is not that pattern (unequal parts, a fused GLU without
heads, a graph whose trace did not record ``meta["fused"]``, Transformer-XL's relative shift)
stays refused with the reason."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplace
from autoplace import zoo
from autoplace.tp_rules import linear_pairs, tp_problems, tp_refusals

sys.path.insert(0, str(Path(__file__).parent / "sim"))
from sim_helpers import cluster  # noqa: E402


def _gpt2() -> autoplace.OpGraph:
    wl = zoo.build("gpt2", small=True)  # n_embd 32, 4 heads, 2 layers
    return autoplace.trace(wl.model, wl.example_inputs)


def test_gpt2_c_attn_is_one_fused_column() -> None:
    g = _gpt2()
    assert g.meta["fused"] == {"h.0.attn.c_attn": 3, "h.1.attn.c_attn": 3}
    pairs = {p.column_path: p for p in linear_pairs(g)}
    attn = pairs["h.0.attn.c_attn"]
    assert (attn.row_path, attn.parts, attn.heads, attn.hidden) == ("h.0.attn.c_proj", 3, 4, 96)
    assert pairs["h.0.c_fc"].parts == 1 and not tp_refusals(g)
    # the sdpa between is the block's, so a stage boundary through it leaves the block whole
    assert any(g.kinds[i] == "scaled_dot_product_attention" for i in attn.between)


def test_the_width_and_heads_rules_apply_per_part() -> None:
    pairs = linear_pairs(_gpt2())
    c = cluster(8)
    assert tp_problems(c, list(range(4)), 4, pairs) == []  # 4 heads per part, 32 features per part
    three = tp_problems(c, list(range(3)), 3, [p for p in pairs if p.parts == 3])
    assert any("does not divide the hidden width of h.0.attn.c_attn per part (96 in 3 fused parts)" in m
               for m in three), three  # 96 alone is divisible by 3: the rule must be per part
    eight = tp_problems(c, list(range(8)), 8, pairs)
    assert any("does not divide the 4 heads per part of h.0.attn.c_attn" in m for m in eight), eight


def test_without_the_traced_part_counts_the_fused_column_is_refused() -> None:
    g = _gpt2()
    bare = dataclasses.replace(g, meta={k: v for k, v in g.meta.items() if k != "fused"})
    why = tp_refusals(bare)
    assert {p.row_path for p in linear_pairs(bare)} == {"h.0.c_proj", "h.1.c_proj"}
    assert len(why) == 2 and "h.0.attn.c_attn is split or sliced other than into equal parts" in why[0]


class _Unequal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 32), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # q wider than k and v: not equal parts
        q, k, v = self.qkv(x).split([16, 8, 8], dim=-1)
        a = F.scaled_dot_product_attention(q.unflatten(-1, (2, -1)).transpose(1, 2),
                                           torch.cat([k, v], -1).unflatten(-1, (2, -1)).transpose(1, 2),
                                           torch.cat([k, v], -1).unflatten(-1, (2, -1)).transpose(1, 2))
        return self.proj(a.transpose(1, 2).flatten(2))


class _FusedGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13, self.w2 = nn.Linear(16, 64), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # equal parts, but no heads: not a fused q/k/v
        a, b = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(a) * b)


def test_other_splits_stay_refused() -> None:
    x = torch.randn(2, 4, 16)
    for block in (_Unequal(), _FusedGLU()):
        model = nn.Sequential(nn.LayerNorm(16), block)  # a block is a module's linears: here "1"
        name = "1.qkv" if isinstance(block, _Unequal) else "1.w13"
        g = autoplace.trace(model, (x,))
        assert "fused" not in g.meta and not linear_pairs(g)
        assert f"the output of {name} is split or sliced other than into equal parts" in tp_refusals(g)[0]


def test_transformer_xl_stays_refused() -> None:
    wl = zoo.build("transformer-xl", small=True)
    g = autoplace.trace(wl.model, wl.example_inputs)
    assert "fused" not in g.meta
    assert {p.row_path for p in linear_pairs(g)} == {"layers.0.ff_out", "layers.1.ff_out"}
    assert "op pad" in tp_refusals(g)[0]
