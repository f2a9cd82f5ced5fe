"""Model-parallel rewrite: one GraphModule whose operations run on their planned devices.

``place_module(gm, target_of_fx, devices)`` turns a traced model and a per-node placement into
a new ``torch.fx.GraphModule`` that trains like the original, with

- every parameter and buffer on the device of the first node (in topological order) that uses
  it, moved in place (``tensor.data = tensor.data.to(device)``, as ``nn.Module.to`` does), so
  the user's ``Parameter`` objects, and an optimizer built on them, stay valid;
- one transfer node per (producer, destination target) on every edge between two targets:
  ``.to(device, non_blocking=True)`` tree-mapped over tuples, lists and dicts of tensors
  (blocking when the copy goes from an accelerator to the CPU, where a non-blocking copy may be
  read before it lands);
- graph inputs moved to the targets of their consumers, and the output moved back to the
  device of the first tensor input (or to ``output_device``);
- factory calls (``torch.zeros``, ``torch.arange``, ``torch.tensor``, any call with a
  ``device=`` keyword, ``x.to(<device>)``, ``x.cuda()``, ``x.cpu()``) creating their tensor on
  their node's device; ``x.new_*`` and ``torch.*_like`` follow their (moved) template;
- a module whose state lives on another target than the node calling it (a tied weight, a
  shared submodule called twice) run through ``torch.func.functional_call`` with
  differentiable ``.to()`` copies of its parameters, so their gradients accumulate into the
  one shared parameter; its buffers are moved too and written back after the call, so
  BatchNorm running statistics stay exact;
- an operation that writes an input in place (``x.add_(y)``, ``x += y``, ``relu(inplace=True)``,
  a buffer update such as ``aten.copy_`` in an exported graph) running where that input lives,
  whatever the placement says, so the write lands on the tensor its other readers see;
- ``state_dict()`` keys equal to ``gm``'s (fx tensor constants are non-persistent buffers),
  and train()/eval() reaching the user's submodules, which the new module shares.

A *target* is an index into ``devices``; two targets may name the same device (``["cpu",
"cpu"]``): each still gets its own transfers, which is how the transparency tests exercise a
plan on one CPU. ``always_copy=True`` makes every transfer a real copy even then.

Known limits: an in-place write to a graph input runs on a copy when the input moves (the
caller's tensor is not written); random ops draw from each device's own generator, so they match
the unplaced model only on one device type.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.node import Argument, Node, map_arg
from torch.utils._pytree import tree_leaves, tree_map_only

from ..errors import AutoplaceError

__all__ = ["place_module", "settle", "OneDevice", "transfer", "check_devices", "PlacementRewriteError"]

DeviceLike = torch.device | str

# Calls that create a tensor from nothing but sizes and values: they get device=<node's device>.
FACTORY_FUNCTIONS: frozenset[Any] = frozenset({
    torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace,
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.empty_strided, torch.tril_indices,
    torch.triu_indices,
})
# Tensor methods that move their receiver to a fixed device.
_MOVE_METHODS = frozenset({"to", "cuda", "cpu"})


class PlacementRewriteError(AutoplaceError, ValueError):
    """A placement cannot be applied to this module; the message names the rule and the fix."""


# ---- runtime helpers the rewritten graph calls ---------------------------------------------------

def transfer(value: Any, device: torch.device, copy: bool = False) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) moved to ``device``.

    Non-blocking, except from an accelerator to the CPU, where the CPU could read the result
    before the copy lands. ``copy=True`` copies even when the tensor is already there.
    """

    def move(t: torch.Tensor) -> torch.Tensor:
        non_blocking = not (device.type == "cpu" and t.device.type != "cpu")
        return t.to(device, non_blocking=non_blocking, copy=copy)

    return tree_map_only(torch.Tensor, move, value)


def _to_first_input_device(value: Any, inputs: tuple[Any, ...]) -> Any:
    """Move the output to the device of the first tensor among the graph inputs (if any)."""
    for leaf in tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor):
            return transfer(value, leaf.device)
    return value


def _call_moved(module: torch.nn.Module, device: torch.device, copy: bool, *args: Any,
                **kwargs: Any) -> Any:
    """Call ``module`` on ``device`` with its state copied there (parameters differentiably).

    Used when a module's state lives on another target than this call, e.g. a tied weight or a
    submodule called twice. Gradients of the copies flow back into the shared parameters;
    buffers updated by the call (BatchNorm statistics) are written back to the originals.
    """
    moved_by_id: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    buffers = dict(module.named_buffers(remove_duplicate=False))
    for name, t in [*module.named_parameters(remove_duplicate=False), *buffers.items()]:
        if id(t) not in moved_by_id:
            moved_by_id[id(t)] = transfer(t, device, copy)
        state[name] = moved_by_id[id(t)]
    out = torch.func.functional_call(module, state, args, kwargs)
    for name, buf in buffers.items():
        new = state[name]
        if new is not buf:
            # Through .data, like the in-kernel update of a BatchNorm call on the original:
            # an earlier call may have saved this buffer for its backward.
            buf.data.copy_(transfer(new.detach(), buf.device))
    return out


# ---- input checks --------------------------------------------------------------------------------

def check_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """Parse ``devices`` and check that this machine has each one; raise a clear error if not.

    A device is usable when torch can allocate an empty tensor on it (under FakeTensorMode this
    accepts fake ``cuda`` devices, which is how the device-correctness tests run on a CPU).
    """
    if isinstance(devices, (str, torch.device)) or len(devices) == 0:
        raise PlacementRewriteError(
            f"devices must be a non-empty list of devices, got {devices!r}; "
            "e.g. ['cuda:0', 'cuda:1'], or ['cpu', 'cpu'] to try a two-device plan on the CPU")
    parsed: list[torch.device] = []
    for i, d in enumerate(devices):
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise PlacementRewriteError(
                f"devices[{i}] = {d!r} is not a device torch understands ({e}); "
                "use names like 'cpu', 'cuda:0', 'mps'") from e
        if dev.type not in ("cpu", "meta"):
            try:
                torch.empty(0, device=dev)
            except (RuntimeError, AssertionError, AttributeError) as e:
                count = torch.cuda.device_count() if dev.type == "cuda" else 0
                raise PlacementRewriteError(
                    f"devices[{i}] = {d!r} is not available on this machine ({e}); "
                    f"it has {count} CUDA device(s): pick from those, or repeat 'cpu' "
                    "(e.g. ['cpu', 'cpu']) to run the plan on the CPU") from e
        parsed.append(dev)
    return parsed


def _check_single_device(gm: torch.nn.Module) -> None:
    counts: dict[str, int] = {}
    for t in [*gm.parameters(), *gm.buffers()]:
        counts[str(t.device)] = counts.get(str(t.device), 0) + 1
    if len(counts) > 1:
        spread = ", ".join(f"{n} tensors on {d}" for d, n in sorted(counts.items()))
        raise PlacementRewriteError(
            f"the model is already spread over several devices ({spread}); a placement starts "
            "from a model on one device: call model.to('cpu') (or one GPU) first")


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _node_targets(gm: torch.fx.GraphModule, target_of_fx: Mapping[str, int],
                  n_targets: int) -> dict[Node, int]:
    """Target of every call node (required) and get_attr node (optional: else first user's)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    unknown = sorted(set(target_of_fx) - set(nodes))
    if unknown:
        raise PlacementRewriteError(
            f"the placement names {len(unknown)} node(s) this graph does not have "
            f"({', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}); "
            "it was made for another trace of the model: re-plan on this graph")
    out: dict[Node, int] = {}
    missing: list[str] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        t = target_of_fx.get(n.name)
        if t is None:
            if n.op != "get_attr":
                missing.append(n.name)
            continue
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_targets:
            raise PlacementRewriteError(
                f"node {n.name!r} is placed on target {t!r}; targets are the indices 0..{n_targets - 1} "
                "of the devices list: give an index in that range")
        out[n] = t
    if missing:
        raise PlacementRewriteError(
            f"{len(missing)} operation(s) have no target ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}); every call node needs one: complete the mapping")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n not in out:
            users = sorted((u for u in n.users if u.op != "output"), key=order.__getitem__)
            if users:
                out[n] = out[users[0]]
    return out


# ---- where state lives ---------------------------------------------------------------------------

def _module_state(module: torch.nn.Module) -> list[torch.Tensor]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [t for _, t in named]


def _state_homes(gm: torch.fx.GraphModule, node_target: Mapping[Node, int]) -> dict[int, tuple[torch.Tensor, int]]:
    """id(tensor) -> (tensor, target of the first node in topological order that uses it)."""
    homes: dict[int, tuple[torch.Tensor, int]] = {}
    for n in gm.graph.nodes:
        if n not in node_target:
            continue
        if n.op == "call_module":
            tensors = _module_state(_fetch_attr(gm, n.target))
        elif n.op == "get_attr":
            obj = _fetch_attr(gm, n.target)
            tensors = [obj] if isinstance(obj, torch.Tensor) else _module_state(obj) if isinstance(obj, torch.nn.Module) else []
        else:
            continue
        for t in tensors:
            homes.setdefault(id(t), (t, node_target[n]))
    return homes


_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul,
})


def _written_args(n: Node, gm: torch.nn.Module) -> list[Node]:
    """The input nodes an operation writes in place (empty for a pure operation).

    ATen overloads (torch.export graphs) say so in their schema (``Tensor(a!)``); at the torch
    level an op writes its first argument when it is a method or function named with a trailing
    underscore (``x.add_(y)``, ``torch.relu_``), an augmented assignment (``x += y``), a call with
    ``inplace=True`` or a module built with ``inplace=True`` (``nn.ReLU(inplace=True)``).
    """
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        written = []
        for i, a in enumerate(n.target._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                if isinstance(v, Node):
                    written.append(v)
        return written
    first = n.args[0] if n.args else None
    if not isinstance(first, Node):
        return []
    if n.op == "call_method":
        name = str(n.target)
        inplace = name.endswith("_") and not name.startswith("_")
    elif n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        inplace = (n.target in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
                   or n.kwargs.get("inplace") is True)
    elif n.op == "call_module":
        inplace = getattr(_fetch_attr(gm, str(n.target)), "inplace", False) is True
    else:
        inplace = False
    return [first] if inplace else []


def _effective_targets(gm: torch.fx.GraphModule, node_target: dict[Node, int],
                       homes: Mapping[int, tuple[torch.Tensor, int]]) -> dict[Node, int]:
    """Where each node really runs.

    A get_attr of a tensor produces it where the tensor lives, whatever its own entry says. An
    operation that writes one of its inputs in place runs where that input lives: run anywhere
    else, it would write a transferred copy, and the producer's tensor (a buffer, or an activation
    other ops still read) would never see the write.
    """
    out = dict(node_target)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n in out:
            obj = _fetch_attr(gm, n.target)
            if isinstance(obj, torch.Tensor):
                out[n] = homes[id(obj)][1]
        elif n in out:
            written = [w for w in _written_args(n, gm) if w in out]
            if written:
                out[n] = out[written[0]]
    return out


# ---- the rewrite ---------------------------------------------------------------------------------

def _is_device_arg(a: Argument) -> bool:
    if isinstance(a, (str, torch.device)):
        return True
    return (isinstance(a, Node) and a.op == "call_function" and a.target is getattr
            and len(a.args) == 2 and a.args[1] == "device")


def _rewrite_graph(gm: torch.fx.GraphModule, target: Mapping[Node, int],
                   homes: Mapping[int, tuple[torch.Tensor, int]], devices: Sequence[torch.device],
                   output_device: torch.device | None, copy: bool) -> torch.fx.Graph:
    g = torch.fx.Graph()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    env: dict[Node, Node] = {}
    moved: dict[tuple[Node, int], Node] = {}

    def emit_transfers(n: Node) -> None:
        """One transfer per destination target, right after the producer."""
        dests: list[int] = []
        for u in sorted(n.users, key=order.__getitem__):
            if u.op != "output" and target[u] != target.get(n) and target[u] not in dests:
                dests.append(target[u])
        for t in dests:
            moved[(n, t)] = g.create_node("call_function", transfer, (env[n], devices[t], copy),
                                          name=f"{n.name}__to{t}")

    def value_on(t: int) -> Any:
        return lambda n: env[n] if target.get(n) == t else moved[(n, t)]

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = g.node_copy(n)
    for n in placeholders:
        emit_transfers(n)

    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        t = target[n]
        dev = devices[t]
        if n.op == "call_module" and any(
                homes[id(s)][1] != t for s in _module_state(_fetch_attr(gm, n.target))):
            args = map_arg(n.args, value_on(t))
            kwargs = map_arg(n.kwargs, value_on(t))
            mod = g.create_node("get_attr", n.target, name=f"{n.name}__module")
            new = g.create_node("call_function", _call_moved, (mod, dev, copy, *args), kwargs, name=n.name)
        elif n.op == "call_method" and n.target in _MOVE_METHODS:
            recv = value_on(t)(n.args[0])
            rest = [dev if _is_device_arg(a) else map_arg(a, value_on(t)) for a in n.args[1:]]
            kwargs = {k: (dev if k == "device" else map_arg(v, value_on(t)))
                      for k, v in n.kwargs.items() if n.target == "to"}
            new = g.create_node("call_method", "to", (recv, *rest) if n.target == "to" else (recv, dev),
                                kwargs, name=n.name)
        else:
            new = g.node_copy(n, value_on(t))
            if n.op in ("call_function", "call_method") and (
                    "device" in n.kwargs or (n.op == "call_function" and n.target in FACTORY_FUNCTIONS)):
                new.kwargs = {**new.kwargs, "device": dev}
        new.meta = dict(n.meta)
        env[n] = new
        emit_transfers(n)

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    result = map_arg(out_node.args[0], env.__getitem__)
    if output_device is None:
        inputs = tuple(env[p] for p in placeholders)
        final = g.call_function(_to_first_input_device, (result, inputs))
    else:
        final = g.call_function(transfer, (result, output_device, False))
    g.output(final, type_expr=out_node.type)
    # A value read only as a device argument, which the rewrite replaced, needs no transfer.
    for n in list(moved.values()):
        if not n.users:
            g.erase_node(n)
    return g


def _share_state(placed: torch.fx.GraphModule, gm: torch.fx.GraphModule) -> None:
    """Make ``placed`` hold exactly gm's modules, parameters and buffers (same objects)."""
    for name, mod in gm._modules.items():
        placed._modules[name] = mod
    for name, p in gm._parameters.items():
        placed._parameters[name] = p
    for name, b in gm._buffers.items():
        placed._buffers[name] = b
    placed._non_persistent_buffers_set = set(gm._non_persistent_buffers_set)
    # fx stores tensor constants of forward() (torch.tensor([...])) as `_tensor_constant<i>`
    # buffers; they are not model state, so they stay out of state_dict().
    for name in placed._buffers:
        if name.startswith("_tensor_constant"):
            placed._non_persistent_buffers_set.add(name)
    placed.train(gm.training)


def _match_persistence(placed: torch.nn.Module, original: torch.nn.Module) -> None:
    """Keep out of placed.state_dict() the buffers ``original`` keeps out of its own.

    torch.fx's GraphModule registers every buffer it copies as persistent, so a traced model
    may list buffers (position ids, masks) that the user's model does not save.
    """
    saved = set(original.state_dict())
    buffers = dict(original.named_buffers(remove_duplicate=False))
    for name, _ in list(placed.named_buffers(remove_duplicate=False)):
        if name in buffers and name not in saved:
            owner_path, _, leaf = name.rpartition(".")
            owner = placed.get_submodule(owner_path) if owner_path else placed
            owner._non_persistent_buffers_set.add(leaf)


def place_module(gm: torch.fx.GraphModule, target_of_fx: Mapping[str, int],
                 devices: Sequence[DeviceLike], *, output_device: DeviceLike | None = None,
                 always_copy: bool = False, original: torch.nn.Module | None = None) -> torch.fx.GraphModule:
    """A GraphModule running each node of ``gm`` on ``devices[target_of_fx[node.name]]``.

    Args:
        gm: a traced model (``torch.fx.symbolic_trace`` or autoplace's tracer) whose parameters
            are the user's. All its parameters and buffers must be on one device.
        target_of_fx: fx node name -> target index into ``devices``. Every call node needs one;
            get_attr, placeholder and output entries are optional (a get_attr without one takes
            its first user's target; a tensor lives where it is first used).
        devices: the placement targets; a device may repeat (``["cpu", "cpu"]``): each entry is
            a distinct target with its own transfers.
        output_device: where the output goes; by default the device of the first tensor input.
        always_copy: make every transfer a real copy, even between targets on the same device
            (tests use it to exercise the cross-device path on one CPU).
        original: the model ``gm`` was traced from, if at hand: buffers it keeps out of its
            ``state_dict`` (non-persistent) stay out of the placed module's too, which a
            GraphModule otherwise lists. (It marks them on the module owning them, which may
            be one of ``gm``'s own intermediate modules.)

    Returns:
        A new GraphModule sharing ``gm``'s submodules, parameters and buffers. This MOVES the
        user's parameters and buffers to their planned devices in place, as ``model.to()``
        does (the ``Parameter`` objects stay the same, so existing optimizers remain valid;
        optimizer state already created is not moved). Nothing is moved when an error is
        raised: devices, the mapping and the model are all checked first.
    """
    devs = check_devices(devices)
    out_dev = check_devices([output_device])[0] if output_device is not None else None
    _check_single_device(gm)
    node_target = _node_targets(gm, target_of_fx, len(devs))
    homes = _state_homes(gm, node_target)
    target = _effective_targets(gm, node_target, homes)
    graph = _rewrite_graph(gm, target, homes, devs, out_dev, always_copy)
    placed = torch.fx.GraphModule(gm, graph, class_name=f"Placed{type(gm).__name__}")
    _share_state(placed, gm)
    if original is not None:
        _match_persistence(placed, original)
    placed.__dict__["_state_devices"] = [(t, devs[home]) for t, home in homes.values()]
    settle(placed)
    return placed


def settle(placed: torch.fx.GraphModule) -> None:
    """Move every parameter and buffer of a module made by :func:`place_module` (and any
    gradient it has) to the device that module expects it on, in place. Needed only when
    another placed module of the same model (for the other of train and eval mode) ran in
    between and put some of them elsewhere."""
    with torch.no_grad():
        for t, dev in placed.__dict__.get("_state_devices", []):
            if t.device != dev:
                t.data = t.data.to(dev)
                if t.grad is not None:
                    t.grad = t.grad.to(dev)


class OneDevice(torch.nn.Module):
    """A plan that keeps every op on one device needs no graph: the user's module runs as it
    is, with its state moved to ``device`` (in place, as ``model.to()`` does), the inputs moved
    there and the output moved back to the first tensor input's device. This avoids the fx
    graph's per-call cost on the plans where there is nothing to rewrite.
    """

    def __init__(self, module: torch.nn.Module, device: DeviceLike) -> None:
        super().__init__()
        dev = check_devices([device])[0]
        _check_single_device(module)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                if t.device != dev:
                    t.data = t.data.to(dev)
        self.module = module
        self.device = dev

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = (args, kwargs)
        moved_args, moved_kwargs = transfer(inputs, self.device)
        out = self.module(*moved_args, **moved_kwargs)
        return _to_first_input_device(out, inputs)
