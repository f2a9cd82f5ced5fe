"""Head counts of a traced model's attention projections, for tensor parallelism's rules.

The op graph folds reshapes into their producers, so the number of heads a query, key or value
projection's output is split into is not in it; tensor parallelism must divide it (each device
holds whole heads; under grouped-query attention the key/value heads too). :func:`head_counts`
reads it from the fx graph: for each ``Linear`` module called in ``gm``, the first reshape of its
output that splits its width into ``(heads, head_dim)`` (``view``/``reshape``/``unflatten`` with
sizes ending in ``(h, d)`` where ``h x d`` is the width, or ``(h, -1)``). :func:`split_index` is
the rule, shared with the runtime that rewrites the same reshapes to the local head count
(:mod:`autoplace.rewrite.tensor_parallel`). The result is meant for ``OpGraph.meta["heads"]``
(``{module path: heads}``), which :func:`autoplace.tp_rules.tp_problems` checks.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

__all__ = ["RESHAPES", "split_index", "reshape_sizes", "head_counts"]

RESHAPES = frozenset({"view", "reshape", "unflatten"})


def split_index(sizes: Sequence[Any], widths: set[int]) -> int | None:
    """The index in ``sizes`` (a reshape's target sizes; ints, -1 or values read at run time) of
    the entry that holds a sharded width: the last, when it equals a width (a merge of heads); the
    second to last, when the last two split a width into ``(heads, head_dim)`` or ``(heads, -1)``;
    None otherwise (a reshape that splits no sharded width, such as RoPE's ``(-1, 2)``)."""
    ints = [s if isinstance(s, int) and not isinstance(s, bool) else None for s in sizes]
    if len(ints) >= 1 and ints[-1] in widths:
        return len(ints) - 1
    if len(ints) >= 2 and ints[-2] is not None and ints[-2] > 0 and (
            ints[-1] == -1 or (ints[-1] is not None and ints[-2] * ints[-1] in widths)):
        return len(ints) - 2
    return None


def reshape_sizes(n: torch.fx.Node) -> tuple[str, list[Any]] | None:
    """(kind, target sizes) of a reshape node (``view``, ``reshape``, ``unflatten``), else None."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    name = name.split(".")[0]
    if n.op not in ("call_method", "call_function") or name not in RESHAPES:
        return None
    if name == "unflatten":
        sizes = n.args[2] if len(n.args) > 2 else n.kwargs.get("sizes")
    elif len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        sizes = n.args[1]
    else:
        sizes = n.args[1:]
    return (name, list(sizes)) if isinstance(sizes, (tuple, list)) else None


def head_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """``{Linear module path: heads}`` for every Linear whose output a reshape splits into heads."""
    mods = dict(gm.named_modules())
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        mod = mods.get(str(n.target)) if n.op == "call_module" else None
        if not isinstance(mod, torch.nn.Linear) or str(n.target) in out:
            continue
        for u in n.users:
            got = reshape_sizes(u)
            if got is None:
                continue
            k = split_index(got[1], {int(mod.out_features)})
            if k is not None and k == len(got[1]) - 2:
                out[str(n.target)] = int(got[1][k])
                break
    return out
