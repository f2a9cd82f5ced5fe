"""The simulator's tensor parallelism of a fused q/k/v projection (the zoo's gpt2, ``c_attn``):
the fused column's ops run at 1/t on each device and its input gradient is all-reduced ONCE in
backward (one column, as Megatron-LM's fused QKV and as the runtime runs it), where separate q,
k and v projections (the TP tests' GPT) are charged three."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import zoo
from autoplace.sim.tensor_parallel import tp_collectives, tp_share, tp_stage_cost

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
from sim_helpers import cluster  # noqa: E402
import tp_models as tm  # noqa: E402


def _gpt2() -> autoplace.OpGraph:
    wl = zoo.build("gpt2", small=True)
    return autoplace.trace(wl.model, wl.example_inputs)


def _backward_all_reduces(g: autoplace.OpGraph, row: str) -> list[int]:
    return [c.op for c in tp_collectives(g, np.arange(g.num_nodes), 1, tp=2)
            if c.block == row and (c.phase, c.kind) == ("backward", "all_reduce")]


def test_one_backward_all_reduce_for_the_fused_column() -> None:
    g = _gpt2()
    c_attn = g.module_paths.index("h.0.attn.c_attn")
    assert _backward_all_reduces(g, "h.0.attn.c_proj") == [c_attn]
    ln_1 = g.module_paths.index("h.0.ln_1")  # its bytes: the column's input (ln_1's output)
    [ar] = [c for c in tp_collectives(g, np.arange(g.num_nodes), 2, tp=2) if c.op == c_attn]
    assert ar.nbytes == pytest.approx(g.out_bytes[ln_1] / 2)
    qkv = autoplace.trace(tm.build("gpt-qkv"), (tm.batch(8, 0)[0],))  # separate q, k, v: three
    assert len(_backward_all_reduces(qkv, "blocks.0.attn.proj")) == 3
    kinds = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(g, np.arange(g.num_nodes), 1, tp=2)
                    if c.block.startswith("h."))
    assert kinds == {"forward all_reduce": 4, "backward all_reduce": 4}  # 2 layers x (attention, MLP)


@pytest.mark.parametrize("t", [2, 4])
def test_the_fused_column_and_its_attention_run_at_one_over_t(t: int) -> None:
    g = _gpt2()
    c = cluster(t)
    n = g.num_nodes
    split = {f"h.{i}.{m}" for i in (0, 1) for m in ("attn.c_attn", "attn", "attn.c_proj", "c_fc", "gelu", "c_proj")}
    block = [i for i, p in enumerate(g.module_paths) if p in split]  # c_attn, sdpa, c_proj; c_fc, gelu, c_proj
    share = tp_share(g, c, np.arange(n), list(range(t)), 1)
    c_attn = g.module_paths.index("h.0.attn.c_attn")
    sdpa = next(i for i in range(n) if g.kinds[i] == "scaled_dot_product_attention")
    assert share.work[c_attn] == share.work[sdpa] == share.params[c_attn] == pytest.approx(1 / t)
    want = np.ones(n)
    want[block] = 1 / t  # every op of the attention and MLP blocks,
    want[[g.module_paths.index("wte"), g.module_paths.index("lm_head")]] = 1 / t  # the vocabulary split, nothing else
    assert np.allclose(share.work, want), (g.names, share.work)
    fwd = np.arange(1.0, n + 1)
    f, b, comm, params = tp_stage_cost(g, c, np.arange(n), list(range(t)), fwd, 2 * fwd, 1)
    assert f == pytest.approx(float((fwd * want).sum())) and b == pytest.approx(2 * f)
    assert params == pytest.approx(float((g.param_bytes * want).sum())) and comm > 0
