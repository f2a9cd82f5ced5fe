"""The model's inputs and output as a pipeline sees them.

torch.distributed.pipelining lets a last stage return a tensor or a tuple of tensors only, so
when the output is anything else (a Hugging Face ``ModelOutput`` with its KV cache, an
``OrderedDict``, a tuple), :func:`pipeline_module` makes the graph return the tuple of the
output's computed leaves and records the structure, and :func:`model_output_loss` rebuilds the
model's own output, every field included, before calling ``loss_fn``; :func:`output_tensors`
names the tensors the last stage returns. :func:`pipeline_module` also makes stage 0 take just
the call's tensors, positionally (see :mod:`autoplace.rewrite.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.node import Node
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from .errors import StageSplitError

__all__ = ["ModelOutput", "pipeline_module", "output_tensors", "model_output_loss"]


# ---- the model's inputs and output ----------------------------------------------------------------

@dataclass(frozen=True)
class ModelOutput:
    """How the tuple of tensors a last stage returns nests into the model's own output."""

    spec: TreeSpec
    """the output's structure (pytree), with every leaf."""
    slots: tuple[tuple[bool, Any], ...]
    """per leaf: (True, i) for item i of the stage's tuple, (False, value) for a constant."""

    def rebuild(self, flat: Sequence[Any]) -> Any:
        return tree_unflatten([flat[v] if sent else v for sent, v in self.slots], self.spec)


_OUTPUT_META = "autoplace_model_output"


def _plain(a: Any) -> Any:
    """An fx output argument with fx's immutable containers made plain again (named tuples kept)."""
    if isinstance(a, Node):
        return a
    if isinstance(a, tuple) and hasattr(a, "_fields"):
        return type(a)(*(_plain(x) for x in a))
    if isinstance(a, tuple):
        return tuple(_plain(x) for x in a)
    if isinstance(a, list):
        return [_plain(x) for x in a]
    if isinstance(a, dict):
        return {k: _plain(v) for k, v in a.items()}
    return a


def _literal(v: Any) -> bool:
    """Whether fx can write ``v`` into generated code as a constant."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
                                   torch.layout)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_literal(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _literal(x) for k, x in v.items())
    return False


def pipeline_module(traced: Any, example_inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """``traced.gm`` as a pipeline runs it (see the module docstring).

    Args:
        traced: a :class:`autoplace.graph.trace.Traced`.
        example_inputs: the positional arguments of the call the pipeline will run (tensors;
            only which arguments they are matters, not their values).

    Returns:
        A GraphModule sharing ``traced.gm``'s state and node names, whose inputs are the tensors
        of ``example_inputs`` in their order. It returns the model's output when that is one
        tensor; otherwise the tuple of the output's computed leaves, which
        :func:`model_output_loss` turns back into the model's own output for ``loss_fn``.

    Raises:
        StageSplitError: an argument that holds tensors inside a container (a pipeline's first
            stage takes tensors), or a non-tensor argument fx cannot write as a constant.
    """
    gm = traced.gm
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise StageSplitError(
                f"example input {i} is {x!r:.60}; a pipeline's first stage takes tensors, one per positional "
                "argument of forward: pass a tensor there (an attention mask of ones, say), or end the inputs "
                "before it when it and every later argument may keep their defaults")
    values = traced.bind(tuple(example_inputs))
    g = torch.fx.Graph()
    env: dict[Node, Any] = {}
    fed: list[Any] = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = values[n.name]
        if isinstance(v, torch.Tensor):
            ph = g.placeholder(n.name, type_expr=n.type)
            ph.meta = dict(n.meta)
            env[n] = ph
            fed.append(v)
        elif any(isinstance(x, torch.Tensor) for x in tree_leaves(v)):
            raise StageSplitError(
                f"input {n.name!r} is a {type(v).__name__} holding tensors; a pipeline's first stage takes "
                "tensors, one per argument: pass them as separate arguments of forward")
        elif not _literal(v):
            raise StageSplitError(
                f"input {n.name!r} is fixed at {type(v).__name__} {str(v)[:60]!r}, which a stage module cannot hold "
                "as a constant (fx writes constants into code: numbers, strings, None, dtypes, devices and "
                "tuples of them): make it an attribute of the model instead of an argument")
        else:
            env[n] = v
    mine = list(example_inputs)
    if len(fed) != len(mine) or any(a is not b for a, b in zip(fed, mine)):
        raise StageSplitError(
            f"the traced graph takes {len(fed)} tensor input(s) and the call passes {len(mine)} argument(s), "
            "not the same tensors in the same order; a pipeline's first stage takes the tensors of the call as "
            "positional arguments in the order forward declares them: pass each input as a tensor, positionally")
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output"):
            env[n] = g.node_copy(n, lambda u: env[u])
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    result = out_node.args[0]
    structure: ModelOutput | None = None
    if isinstance(result, Node) and traced.out_spec is None:
        g.output(env[result], type_expr=out_node.type)
    else:
        leaves, spec = tree_flatten(_plain(result))
        if traced.out_spec is not None:
            spec = traced.out_spec
        sent = [x for x in leaves if isinstance(x, Node)]
        index = {x: i for i, x in enumerate(dict.fromkeys(sent))}
        structure = ModelOutput(spec, tuple((True, index[x]) if isinstance(x, Node) else (False, x) for x in leaves))
        g.output(tuple(env[x] for x in index))
    mod = torch.fx.GraphModule(gm, g, class_name=f"Pipelined{type(gm).__name__}")
    if structure is not None:
        mod.meta[_OUTPUT_META] = structure
    return mod


def output_tensors(gm: torch.fx.GraphModule, values: Mapping[str, Any]) -> list[Any]:
    """The tensors the last stage returns (``values`` from :func:`propagate_fake`): the model's
    output when it is one tensor, else the tensors of its leaves.

    Raises:
        StageSplitError: the output holds no tensor, or a leaf computed in the graph that is not
            a tensor (stages return tensors only).
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    got = values.get(out.name)
    leaves = tree_leaves(got)
    found = [v for v in leaves if isinstance(v, torch.Tensor)]
    if not found:
        raise StageSplitError(f"the model returns no tensor ({type(got).__name__}); a pipeline's last stage passes "
                              "the model's output to loss_fn: return the tensors the loss needs")
    if _OUTPUT_META in gm.meta and len(found) != len(leaves):
        bad = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
        raise StageSplitError(f"the model's output holds values computed in forward that are not tensors ({bad}); "
                              "a pipeline's last stage returns tensors only: return them as tensors or leave them out")
    return found


def model_output_loss(gm: torch.fx.GraphModule,
                      loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` for the last stage of ``gm``'s pipeline: it receives the model's own output
    (a ``ModelOutput`` with every field, an ``OrderedDict``), rebuilt from the tuple of tensors
    the stage returns (torch.distributed.pipelining passes tensors and tuples of them only)."""
    structure = gm.meta.get(_OUTPUT_META)
    if structure is None:
        return loss_fn

    def loss(output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        flat = output if isinstance(output, tuple) else (output,)
        return loss_fn(structure.rebuild(flat), target, **kwargs)

    return loss
