"""Pipeline rewrite: cut a traced model into a chain of stage GraphModules.

``split_stages(gm, stage_of_fx)`` returns one GraphModule per stage. Stage ``s`` takes exactly
the values live across the boundary between stages ``s-1`` and ``s`` (stage 0 takes the
graph's inputs) and returns, as a tuple, the values live across ``s`` -> ``s+1`` (made contiguous, as sending
them to another process needs); the last stage returns the model's output. A value is live across boundary ``b`` when it is made at stage
``<= b`` (a graph input counts as made before stage 0) and used at a stage ``> b``, so a value
that skips stages is passed through them; branches need no special case. Stages must not
decrease along an edge (GPipe's chain of partitions, Huang et al. 2019; PipeDream's stages,
Narayanan et al. 2019, with the DAG flattened into a chain by passing values through).

torch.fx's ``split_module`` is not used: it wires a value that skips a stage straight from its
producer to its consumer at the top level, while a pipeline on ``torch.distributed.pipelining``
needs each stage to receive everything from the stage before it.

Values that cross a boundary must be tensors, since stages exchange tensors only:

- values holding no tensor (``x.size(1)``, ``x.shape``, arithmetic on them) are recomputed in
  every stage that uses them, from the tensors they derive from (which are then passed
  through), so a size is always the one of the current micro-batch;
- tuples and lists of tensors (an LSTM's ``(h, c)``) are sent as their tensors and rebuilt.

To tell these apart ``split_stages`` runs the model once on fake tensors when given
``example_inputs`` (no memory, no compute, the user's buffers untouched); without them it uses
``node.meta["val"]`` when the tracer left one, and otherwise recognises size queries by name.

Stage modules share the user's parameters (the same ``Parameter`` objects), under their
original qualified names; a parameter used by two stages (a tied embedding) appears in both.

The model's own output reaches ``loss_fn``. torch.distributed.pipelining lets a last stage
return a tensor or a tuple of tensors only, so when the output is anything else (a Hugging Face
``ModelOutput`` with its KV cache, an ``OrderedDict``, a tuple), :func:`pipeline_module` makes
the graph return the tuple of the output's computed leaves and records the structure, and
:func:`model_output_loss` rebuilds the model's own output, every field included, before calling
``loss_fn``. The tensors of fields the loss does not read (a cache's keys and values) are still
sent to the last stage, as they are part of that output.

:func:`pipeline_module` also makes stage 0 take just the call's tensors, positionally: every
other input of the traced graph (a flag such as ``use_cache``, an argument left at its default)
is fixed at its value in the call.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.node import Node, map_arg
from torch.utils._pytree import tree_leaves

from .errors import StageSplitError
from .model_output import ModelOutput, model_output_loss, output_tensors, pipeline_module

__all__ = ["split_stages", "StageSplitError", "Split", "split_with_boundaries", "propagate_fake",
           "pipeline_module", "output_tensors", "model_output_loss", "ModelOutput"]

# Leaf kinds of a node's value.
TENSOR, STATIC, CONTAINER = "tensor", "static", "container"
_SIZE_METHODS = frozenset({"size", "dim", "numel", "stride", "nelement", "ndimension", "get_device"})
_SIZE_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})


def _make_tuple(*items: Any) -> tuple[Any, ...]:
    return tuple(items)


def _make_list(*items: Any) -> list[Any]:
    return list(items)


# ---- what each value is ---------------------------------------------------------------------------

def propagate_fake(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> dict[str, Any]:
    """Run ``gm`` on fake copies of its state and inputs; fx node name -> fake value.

    Parameters keep ``requires_grad``, so the values say which outputs carry gradients. The
    user's tensors (BatchNorm statistics included) are not touched.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    class Runner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = gm

        def forward(self, *args: Any) -> Any:
            return Recorder(self.m).run(*args)

    named = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    with mode:
        fake_by_id: dict[int, torch.Tensor] = {}
        for _, t in named:
            if id(t) not in fake_by_id:
                fake = mode.from_tensor(t.detach())
                fake_by_id[id(t)] = fake.requires_grad_(t.requires_grad) if t.is_floating_point() else fake
        state = {f"m.{k}": fake_by_id[id(t)] for k, t in named}
        args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs)
        torch.func.functional_call(Runner(), state, args)
    return values


def _kind_of_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return TENSOR
    leaves = tree_leaves(v)
    return CONTAINER if any(isinstance(x, torch.Tensor) for x in leaves) else STATIC


def _kinds(gm: torch.fx.GraphModule, values: Mapping[str, Any] | None) -> dict[Node, str]:
    kinds: dict[Node, str] = {}
    for n in gm.graph.nodes:
        if values is not None and n.name in values:
            kinds[n] = _kind_of_value(values[n.name])
        elif "val" in n.meta:
            kinds[n] = _kind_of_value(n.meta["val"])
        elif (n.op == "call_method" and n.target in _SIZE_METHODS) or (
                n.op == "call_function" and n.target is getattr and n.args[1] in _SIZE_ATTRS):
            kinds[n] = STATIC
        elif n.op == "call_function" and n.all_input_nodes and all(
                kinds.get(u) == STATIC for u in n.all_input_nodes) and getattr(n.target, "__module__", "") in (
                "_operator", "operator", "builtins"):
            kinds[n] = STATIC
        else:
            kinds[n] = TENSOR
    return kinds


# ---- the split --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """The stage modules and, per stage, the fx names of the values entering and leaving it."""

    stages: list[torch.fx.GraphModule]
    inputs: list[list[str]]
    outputs: list[list[str]]
    """Names of the values each non-last stage returns (containers flattened to their tensors:
    ``name.0``, ``name.1.0``, ...); the last stage's entry is empty (it returns the model output)."""


def _stage_of(gm: torch.fx.GraphModule, stage_of_fx: Mapping[str, int], kinds: Mapping[Node, str],
              num_stages: int | None) -> tuple[dict[Node, int], int]:
    nodes = {n.name: n for n in gm.graph.nodes}
    unknown = sorted(set(stage_of_fx) - set(nodes))
    if unknown:
        raise StageSplitError(
            f"the stage assignment names node(s) this graph does not have ({', '.join(unknown[:5])}); "
            "it was made for another trace: re-plan on this graph")
    stage: dict[Node, int] = {}
    missing = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        s = stage_of_fx.get(n.name)
        if s is None:
            missing.append(n.name)
            continue
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise StageSplitError(f"node {n.name!r} has stage {s!r}; stages are integers 0, 1, 2, ...")
        stage[n] = s
    if missing:
        raise StageSplitError(
            f"{len(missing)} operation(s) have no stage ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); every call node needs one: complete the mapping")
    count = max(stage.values(), default=0) + 1
    if num_stages is not None:
        if num_stages < count:
            raise StageSplitError(f"num_stages is {num_stages} but the assignment uses stage {count - 1}")
        count = num_stages
    for v in gm.graph.nodes:
        if v not in stage or kinds[v] == STATIC:
            continue
        for u in v.all_input_nodes:
            if u in stage and kinds[u] != STATIC and stage[u] > stage[v]:
                raise StageSplitError(
                    f"edge {u.name} -> {v.name} goes from stage {stage[u]} back to stage {stage[v]}; "
                    f"stages must not decrease along an edge: put {v.name} in stage >= {stage[u]} "
                    f"or {u.name} in stage <= {stage[v]}")
    return stage, count


def _static_needs(gm: torch.fx.GraphModule, stage: Mapping[Node, int], kinds: Mapping[Node, str],
                  count: int) -> list[set[Node]]:
    """Per stage, the no-tensor nodes it must recompute for its own operations."""
    needs: list[set[Node]] = [set() for _ in range(count)]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")

    def pull(n: Node, s: int) -> None:
        for u in n.all_input_nodes:
            if kinds[u] == STATIC and u.op not in ("placeholder", "get_attr") and u not in needs[s]:
                needs[s].add(u)
                pull(u, s)

    for n in gm.graph.nodes:
        if n in stage and kinds[n] != STATIC:
            pull(n, stage[n])
    pull(out_node, count - 1)
    return needs


def _leaf_paths(value: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    if isinstance(value, (tuple, list)):
        return [p for i, v in enumerate(value) for p in _leaf_paths(v, (*prefix, i))]
    return [prefix]


def split_with_boundaries(gm: torch.fx.GraphModule, stage_of_fx: Mapping[str, int], *,
                          values: Mapping[str, Any] | None = None,
                          num_stages: int | None = None) -> Split:
    """``split_stages`` with the boundary values; ``values`` from :func:`propagate_fake`."""
    kinds = _kinds(gm, values)
    stage, count = _stage_of(gm, stage_of_fx, kinds, num_stages)
    needs = _static_needs(gm, stage, kinds, count)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")

    # Where each value is made and last used (recomputed no-tensor nodes use their inputs there).
    made = {n: (-1 if n.op == "placeholder" else stage[n]) for n in gm.graph.nodes
            if n.op == "placeholder" or (n in stage and kinds[n] != STATIC)}
    last_use: dict[Node, int] = {}

    def use(u: Node, s: int) -> None:
        if u in made:
            last_use[u] = max(last_use.get(u, -1), s)

    for n in gm.graph.nodes:
        if n in stage and kinds[n] != STATIC:
            for u in n.all_input_nodes:
                use(u, stage[n])
    for s in range(count):
        for n in needs[s]:
            for u in n.all_input_nodes:
                use(u, s)
    for u in out_node.all_input_nodes:
        use(u, count - 1)

    def live(b: int) -> list[Node]:
        return sorted((v for v, m in made.items() if m <= b < last_use.get(v, -1)), key=order.__getitem__)

    def flat_names(v: Node) -> list[tuple[str, tuple[int, ...]]]:
        if kinds[v] != CONTAINER:
            return [(v.name, ())]
        val = values[v.name] if values is not None and v.name in values else v.meta.get("val")
        paths = _leaf_paths(val)
        leaves = tree_leaves(val)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise StageSplitError(
                f"value {v.name} crosses a stage boundary but holds non-tensors "
                f"({type(val).__name__} of {[type(x).__name__ for x in leaves]}); stages pass tensors only: "
                f"put its users in stage {made[v]}")
        return [(f"{v.name}.{'.'.join(map(str, p))}", p) for p in paths]

    stages: list[torch.fx.GraphModule] = []
    ins_all: list[list[str]] = []
    outs_all: list[list[str]] = []
    for s in range(count):
        g = torch.fx.Graph()
        env: dict[Node, Node] = {}
        ins: list[str] = []
        entering = placeholders if s == 0 else live(s - 1)
        for v in entering:
            if s == 0:
                env[v] = g.node_copy(v)
                ins.append(v.name)
                continue
            leaves = flat_names(v)
            if kinds[v] != CONTAINER:
                ph = g.placeholder(v.name)
                ph.meta = dict(v.meta)
                env[v] = ph
                ins.append(v.name)
                continue
            holders = {p: g.placeholder(name.replace(".", "_")) for name, p in leaves}
            ins.extend(name for name, _ in leaves)
            val = values[v.name] if values is not None and v.name in values else v.meta["val"]

            def rebuild(x: Any, prefix: tuple[int, ...]) -> Any:
                if isinstance(x, (tuple, list)):
                    parts = [rebuild(y, (*prefix, i)) for i, y in enumerate(x)]
                    return g.call_function(_make_tuple if isinstance(x, tuple) else _make_list, tuple(parts))
                return holders[prefix]

            env[v] = rebuild(val, ())

        def lookup(u: Node) -> Node:
            if u not in env and u.op == "get_attr":
                env[u] = g.get_attr(str(u.target))
            return env[u]

        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output", "get_attr") or n in env:
                continue
            if (n in stage and kinds[n] != STATIC and stage[n] == s) or n in needs[s]:
                env[n] = g.node_copy(n, lookup)
        outs: list[str] = []
        if s == count - 1:
            g.output(map_arg(out_node.args[0], lookup), type_expr=out_node.type)
        else:
            results: list[Node] = []
            for v in live(s):
                for name, path in flat_names(v):
                    node = env[v]
                    for i in path:
                        node = g.call_function(operator.getitem, (node, i))
                    # Sent between processes, which needs contiguous memory (a no-op if it is).
                    results.append(g.call_method("contiguous", (node,)))
                    outs.append(name)
            g.output(tuple(results))
        mod = torch.fx.GraphModule(gm, g, class_name=f"Stage{s}")
        stages.append(mod)
        ins_all.append(ins)
        outs_all.append(outs)
    return Split(stages, ins_all, outs_all)


def split_stages(gm: torch.fx.GraphModule, stage_of_fx: Mapping[str, int], *,
                 example_inputs: Sequence[Any] | None = None,
                 num_stages: int | None = None) -> list[torch.fx.GraphModule]:
    """Cut ``gm`` into a chain of stage modules, ``stages[s+1](*stages[s](...))``.

    Args:
        gm: a traced model; the stages share its parameters.
        stage_of_fx: fx node name -> stage index (0, 1, ...), for every call node; entries for
            placeholders, get_attr and output nodes are ignored (a get_attr is copied into
            each stage that uses it).
        example_inputs: inputs to run the model once on fake tensors, which tells tensors from
            sizes and tuples; recommended (see the module docstring).
        num_stages: the number of stages, when trailing stages are empty (pass-through).

    Raises:
        StageSplitError: a node without a stage, an edge that goes back to an earlier stage
            (naming the edge), or a value that cannot be sent between stages.
    """
    values = propagate_fake(gm, example_inputs) if example_inputs is not None else None
    return split_with_boundaries(gm, stage_of_fx, values=values, num_stages=num_stages).stages
