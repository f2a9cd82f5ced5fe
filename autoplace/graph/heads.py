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

A *fused* projection (GPT-2's ``c_attn``: one Linear for q, k and v) is read by one split of its
last dimension into equal parts (``split(s, dim)`` with ``parts x s`` its width, ``split([s, s,
s], dim)``, ``chunk(parts, dim)``), each part then reshaped into heads as above (on the split's
dimension, or -1). :func:`fused_split` recognises that pattern on one Linear call;
:func:`fused_parts` gives ``{module path: parts}`` (``OpGraph.meta["fused"]``), and
:func:`head_counts` gives such a projection's heads per part. Anything else that splits or slices a
Linear's output (unequal parts, a split of the batch, a part read without a per-head reshape) is
not fused: tensor parallelism leaves it whole.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

__all__ = ["RESHAPES", "SPLITS", "split_index", "reshape_sizes", "split_sizes", "fused_split", "fused_parts",
           "head_counts"]

RESHAPES = frozenset({"view", "reshape", "unflatten"})
SPLITS = frozenset({"split", "chunk", "split_with_sizes"})


def _name(n: torch.fx.Node) -> str:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name.split(".")[0]


def _arg(n: torch.fx.Node, i: int, key: str, default: Any = None) -> Any:
    return n.args[i] if len(n.args) > i else n.kwargs.get(key, default)


def split_sizes(n: torch.fx.Node, width: int) -> tuple[list[int], Any] | None:
    """(the part sizes, the dimension) of a split node (``split``, ``split_with_sizes``, ``chunk``;
    method or function) of a tensor whose split dimension is ``width`` wide, else None."""
    if n.op not in ("call_method", "call_function") or _name(n) not in SPLITS:
        return None
    arg = _arg(n, 1, "split_size_or_sections" if n.op == "call_function" else "split_size",
               n.kwargs.get("chunks", n.kwargs.get("split_size", n.kwargs.get("split_sizes"))))
    dim = _arg(n, 2, "dim", 0)
    if _name(n) == "chunk":
        if not isinstance(arg, int) or arg < 1 or width % arg:
            return None
        return [width // arg] * arg, dim
    if isinstance(arg, int) and not isinstance(arg, bool) and arg > 0 and width % arg == 0:
        return [arg] * (width // arg), dim
    if isinstance(arg, (list, tuple)) and all(isinstance(a, int) for a in arg) and sum(arg) == width:
        return [int(a) for a in arg], dim
    return None


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
    name = _name(n)
    if n.op not in ("call_method", "call_function") or name not in RESHAPES:
        return None
    if name == "unflatten":
        sizes = n.args[2] if len(n.args) > 2 else n.kwargs.get("sizes")
    elif len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
        sizes = n.args[1]
    else:
        sizes = n.args[1:]
    return (name, list(sizes)) if isinstance(sizes, (tuple, list)) else None


def _heads_of(part: torch.fx.Node, width: int, dim: Any) -> int | None:
    """The heads a reshape of ``part`` (``width`` wide on dimension ``dim``) splits it into."""
    for u in part.users:
        got = reshape_sizes(u)
        if got is None:
            continue
        if got[0] == "unflatten" and _arg(u, 1, "dim") not in (dim, -1):
            continue
        k = split_index(got[1], {width})
        if k is not None and k == len(got[1]) - 2:
            return int(got[1][k])
    return None


def fused_split(n: torch.fx.Node, width: int) -> tuple[int, int] | None:
    """(parts, heads per part) when the node ``n`` (a Linear's output, ``width`` features) is read
    only by one split of its last dimension into equal parts, each part read only through
    ``getitem`` and reshaped into heads (see the module docstring); else None."""
    users = list(n.users)
    if len(users) != 1:
        return None
    sp = users[0]
    got = split_sizes(sp, width)
    if got is None:
        return None
    sizes, dim = got
    if len(sizes) < 2 or len(set(sizes)) != 1 or not isinstance(dim, int) or dim == 0:
        return None
    items = list(sp.users)
    if not items or any(u.op != "call_function" or _name(u) != "getitem" or not isinstance(u.args[1], int)
                        for u in items):
        return None
    heads = {_heads_of(u, sizes[0], dim) for u in items}
    if len({u.args[1] for u in items}) != len(sizes) or None in heads or len(heads) != 1:
        return None
    h = heads.pop()
    assert h is not None
    return len(sizes), h


def _linear_calls(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.nn.Linear]]:
    mods = dict(gm.named_modules())
    return [(n, m) for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(m := mods.get(str(n.target)), torch.nn.Linear)]


def fused_parts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """``{Linear module path: parts}`` for every fused projection (:func:`fused_split`) in ``gm``."""
    out: dict[str, int] = {}
    for n, mod in _linear_calls(gm):
        got = fused_split(n, int(mod.out_features))
        if got is not None:
            out[str(n.target)] = got[0]
    return out


def head_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """``{Linear module path: heads}`` for every Linear whose output a reshape splits into heads
    (a fused projection: its heads per part)."""
    out: dict[str, int] = {}
    for n, mod in _linear_calls(gm):
        if str(n.target) in out:
            continue
        fused = fused_split(n, int(mod.out_features))
        if fused is not None:
            out[str(n.target)] = fused[1]
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
