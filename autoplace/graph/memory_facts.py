"""The memory facts of a traced model: what autograd saves per op, measured once on fake tensors.

:func:`measure` runs the traced fx graph once on fake tensors (no memory allocated,
``FakeTensorMode``) under autograd with ``saved_tensors_hooks``, and records per op the storages
its backward saves, its trainable bytes, its largest parameter, the inputs it reads, the bytes of
its outputs that carry a gradient and of the graph outputs it produces, and the calls op-level
selective checkpointing would save (:func:`sac_saves`: every matmul and attention call, with its
output bytes, FLOPs and the bytes of it autograd saves too); :func:`attach` stores them, and
the dtype-dependent ones again from a bf16 forward (``["bf16"]``), in ``OpGraph.meta["memory"]``
(left out of the graph's hash). The terms of a step's peak that read them are
:mod:`autoplace.cost.memory`'s. They live here, beside the trace, because they
are read off the fx graph (only ``graph/`` and ``rewrite/`` touch torch.fx).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from .ir import OpGraph

__all__ = ["measure", "attach", "rnn_workspace_bytes", "sac_saves", "FORMAT", "DTYPE_KEYS", "RNN_WORKSPACE", "SAC_SAVE", "SAC_MM"]

FORMAT = "autoplace.memory/1"
DTYPE_KEYS = ("grad_bytes", "saved_bytes", "saved_ptr", "saved_ops", "saved_producer", "sac_ptr", "sac_mm",
              "sac_bytes", "sac_flops", "sac_autograd")
"""The facts that depend on the compute dtype: ``facts["bf16"]`` holds them from a bf16 forward."""
SAC_MM = "aten::mm"
SAC_SAVE = frozenset({
    SAC_MM,
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional::reduce_scatter_tensor",
    "aten::max",
})
"""ATen ops whose outputs op-level selective activation checkpointing saves (torchtitan's
``_save_list`` of ``selective_ac_option="op"``: ``mm``, the fused attention kernels, the
functional reduce-scatter and ``max`` (a scalar, for float8 scales), as torchtitan ran its
December 2024 benchmarks; the CPU flash kernel added, the CPU form of the same op). A biased
linear runs ``addmm``, which is not in torchtitan's list (its models have no biases): it is
recomputed, as there."""


def sac_saves(op_name: str, mm_count: int) -> bool:
    """Whether op-level selective checkpointing saves the output of one ATen call (``op_name`` as
    ``OpOverload._schema.name``, ``"aten::mm"``) inside a checkpointed unit, ``mm_count`` the
    matmuls of this forward of the unit so far, this one included: the ops of :data:`SAC_SAVE`,
    except every second ``mm`` (torchtitan: "saves output of all compute ops, except every second
    mm"). The rule both the runtime's policy (:mod:`autoplace.rewrite.units`) and the simulator's
    prices (:mod:`autoplace.sim.fsdp_stage`, from the calls :func:`measure` records) read."""
    return op_name in SAC_SAVE and not (op_name == SAC_MM and mm_count % 2 == 0)
RNN_WORKSPACE = (9.375, 6.0, 28672.0)
"""rnn_workspace: ``nn.LSTM`` on a CPU runs oneDNN's LSTM (``mkldnn_rnn_layer``), which saves a
workspace per layer and direction that fake tensors show as empty. Measured bytes:
``max(28672, 4 (T + 1) B (9.375 H + 6 max(I, H)))`` for T steps, batch B, hidden H, input I
(least squares over 108 shapes by ``python benchmarks/fidelity_memory.py --rnn-probe``: median
error 2.5%, up to 36% on the smallest shapes, where oneDNN rounds its buffers to pages). cuDNN's
reserve space on a GPU holds the same kind of per-step gates and states; not measured here."""

# ---- the facts: one pass on fake tensors ---------------------------------------------------

def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


class _Recorder(torch.fx.Interpreter):
    """Runs the graph, noting which op is running when autograd saves a tensor."""

    def __init__(self, gm: torch.fx.GraphModule, op_of_fx: Mapping[str, int]) -> None:
        super().__init__(gm)
        self.op_of_fx = op_of_fx
        self.current = -1
        self.values: dict[str, Any] = {}
        self.keep: list[Any] = []  # storages stay alive, so their keys are never reused

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = self.op_of_fx.get(n.name, -1)
        cpu = torch.device("cpu")
        if n.op in ("call_function", "call_method", "call_module"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = tree_map(lambda v: cpu if isinstance(v, torch.device) else v, (args, kwargs))
            out = getattr(self, n.op)(n.target, args, kwargs)
        else:
            out = super().run_node(n)
        self.values[n.name] = out
        return out


class _SacCalls(TorchDispatchMode):
    """Notes every ATen call of :data:`SAC_SAVE` (its op, whether a matmul, output bytes, FLOPs)."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        from .flops import flop_counter

        self.rec = rec
        self.formulas = flop_counter().flop_registry
        self.calls: list[tuple[int, bool, float, float, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in SAC_SAVE and self.rec.current >= 0:
            stores = {_storage_key(t): t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor)}
            formula = self.formulas.get(func._overloadpacket)
            flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
            self.calls.append((self.rec.current, name == SAC_MM, float(sum(stores.values())), flops, tuple(stores)))
        return out


def rnn_workspace_bytes(steps: int, batch: int, hidden: int, inputs: int) -> float:
    """Bytes of the workspace oneDNN's LSTM saves for one layer and direction (see :data:`RNN_WORKSPACE`)."""
    a, b, floor = RNN_WORKSPACE
    return max(floor, 4.0 * (steps + 1) * batch * (a * hidden + b * max(inputs, hidden)))


def _lstm_workspaces(mod: torch.nn.Module, x: Any) -> list[float]:
    if not isinstance(mod, torch.nn.LSTM) or not isinstance(x, torch.Tensor) or mod.proj_size:
        return []
    if x.dim() == 3:
        steps, batch = (x.shape[1], x.shape[0]) if mod.batch_first else (x.shape[0], x.shape[1])
    else:
        steps, batch = x.shape[0], 1
    dirs = 2 if mod.bidirectional else 1
    return [rnn_workspace_bytes(int(steps), int(batch), mod.hidden_size, mod.input_size if layer == 0 else
                                mod.hidden_size * dirs)
            for layer in range(mod.num_layers) for _ in range(dirs)]


def measure(gm: torch.fx.GraphModule, placeholders: Mapping[str, Any], op_of_fx: Mapping[str, int],
            graph: "OpGraph", *, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The memory facts of ``graph`` (traced from ``gm``; ``op_of_fx`` maps fx nodes to its
    ops), from one forward on fake CPU tensors under autograd: a JSON-able dict for
    ``OpGraph.meta["memory"]`` (see the module docstring). ``dtype``: run with every floating
    parameter, buffer and input in that dtype (bf16: what a bf16 stage saves, its fp32 upcasts
    included); the bytes held (trainable, inputs) stay those of the model as given. Raises
    whatever the forward raises (a module that branches on tensor values cannot run on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n_ops = graph.num_nodes
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, grad: bool) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                as_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
                fakes[id(t)] = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=as_dtype, device=cpu,
                                                   requires_grad=grad and t.is_floating_point())
        return fakes[id(t)]

    trainable = np.zeros(n_ops)
    largest = np.zeros(n_ops)
    buffers = np.zeros(n_ops)  # buffer tensors held (what DDP broadcasts before every forward)
    registered = {id(b) for b in gm.buffers()}
    state: dict[str, torch.Tensor] = {}
    owner: dict[int, int] = {}  # id(user's tensor) -> first op holding it
    for n in gm.graph.nodes:
        op = op_of_fx.get(n.name, -1)
        if n.op == "call_module":
            held = [(f"{n.target}.{k}", v) for k, v in gm.get_submodule(str(n.target)).named_parameters(
                remove_duplicate=False)] + [(f"{n.target}.{k}", v) for k, v in gm.get_submodule(
                    str(n.target)).named_buffers(remove_duplicate=False)]
        elif n.op == "get_attr":
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            held = [(str(n.target), obj)] if isinstance(obj, torch.Tensor) else []
        else:
            continue
        for name, t in held:
            grad = isinstance(t, torch.nn.Parameter) and t.requires_grad and t.is_floating_point()
            state[name] = fake(t, grad)
            if id(t) not in owner and op >= 0:
                owner[id(t)] = op
                if grad:
                    trainable[op] += _nbytes(t)
                    largest[op] = max(largest[op], _nbytes(t))
                elif id(t) in registered:
                    buffers[op] += 1
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        if name not in state:
            state[name] = fake(t, isinstance(t, torch.nn.Parameter) and t.requires_grad)
    weight_keys = {_storage_key(t) for t in fakes.values()}

    rec = _Recorder(gm, op_of_fx)
    inputs = np.zeros(n_ops)
    input_keys: set[int] = set()
    flat = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        value = tree_map(lambda v: fake(v, v.requires_grad) if isinstance(v, torch.Tensor) else v,
                         placeholders[n.name])
        flat.append(value)
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and _storage_key(t) not in input_keys:
                input_keys.add(_storage_key(t))
                inputs[op_of_fx[n.name]] += _nbytes(t)

    saved: dict[int, list[Any]] = {}  # storage key -> [bytes, set of saving ops]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key in weight_keys or key in input_keys or rec.current < 0:
            return t
        st = t.untyped_storage()
        rec.keep.append(st)
        saved.setdefault(key, [int(st.nbytes()), set()])[1].add(rec.current)
        return t

    class _Run(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *args: Any) -> Any:
            return rec.run(*args)

    runner = _Run()
    sac = _SacCalls(rec)
    with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sac:
        out = torch.func.functional_call(runner, {f"gm.{k}": v for k, v in state.items()}, tuple(flat))

    grad_bytes = np.zeros(n_ops)
    producer: dict[int, int] = {}
    for n in gm.graph.nodes:
        op = op_of_fx.get(n.name, -1)
        if op < 0 or n.op in ("placeholder", "output"):
            continue
        for t in tree_flatten(rec.values.get(n.name))[0]:
            if isinstance(t, torch.Tensor):
                producer.setdefault(_storage_key(t), op)
    for i, name in enumerate(graph.names):
        for t in tree_flatten(rec.values.get(name))[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                grad_bytes[i] += _nbytes(t)
    outputs = np.zeros(n_ops)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
            made_by = producer.get(_storage_key(t))
            if made_by is not None:
                outputs[made_by] += _nbytes(t)
    extra = 0
    for n in gm.graph.nodes:  # oneDNN's LSTM workspace, which the fake kernel leaves empty
        if n.op == "call_module" and n.args and isinstance(n.args[0], torch.fx.Node):
            for ws in _lstm_workspaces(gm.get_submodule(str(n.target)), rec.values.get(n.args[0].name)):
                extra -= 1
                saved[extra] = [ws, {op_of_fx[n.name]}]
    keys = sorted(saved)
    ptr = np.zeros(len(keys) + 1, dtype=np.int64)
    ops: list[int] = []
    for k, key in enumerate(keys):
        ops += sorted(saved[key][1])
        ptr[k + 1] = len(ops)
    sac_ptr = np.zeros(n_ops + 1, dtype=np.int64)  # the calls are in execution order, so per op in order
    np.add.at(sac_ptr, [c[0] + 1 for c in sac.calls], 1)
    order = sorted(range(len(sac.calls)), key=lambda k: sac.calls[k][0])  # stable: execution order inside an op
    return {
        "format": FORMAT,
        "trainable_bytes": trainable.tolist(),
        "largest_param_bytes": largest.tolist(),
        "buffer_tensors": buffers.tolist(),
        "input_bytes": inputs.tolist(),
        "grad_bytes": grad_bytes.tolist(),
        "output_bytes": outputs.tolist(),
        "saved_bytes": [float(saved[k][0]) for k in keys],
        "saved_ptr": ptr.tolist(),
        "saved_ops": ops,
        "saved_producer": [int(producer.get(k, -1)) for k in keys],
        "sac_ptr": np.cumsum(sac_ptr).tolist(),
        "sac_mm": [bool(sac.calls[k][1]) for k in order],
        "sac_bytes": [sac.calls[k][2] for k in order],
        "sac_flops": [sac.calls[k][3] for k in order],
        "sac_autograd": [float(sum(saved[key][0] for key in sac.calls[k][4] if key in saved)) for k in order],
    }


def attach(graph: "OpGraph", gm: torch.fx.GraphModule, placeholders: Mapping[str, Any],
           op_of_fx: Mapping[str, int]) -> "OpGraph":
    """``graph`` with its memory facts in ``meta["memory"]``; when the fake-tensor forward
    fails (a module that branches on tensor values), ``meta["memory_error"]`` says why and the
    simulator keeps its plain sum for this graph."""
    from dataclasses import replace

    try:
        facts = measure(gm, placeholders, op_of_fx, graph)
    except Exception as e:  # noqa: BLE001 - any failure leaves the graph as it was, said in meta
        return replace(graph, meta={**graph.meta, "memory_error": f"{type(e).__name__}: {str(e)[:200]}"})
    try:  # the same forward in bf16 (a bf16 stage's activations, fp32 upcasts included); absent if it fails
        half = measure(gm, placeholders, op_of_fx, graph, dtype=torch.bfloat16)
        facts["bf16"] = {k: half[k] for k in DTYPE_KEYS}
    except Exception:  # noqa: BLE001 - a model that cannot run in bf16 on fake tensors keeps its fp32 facts, scaled
        pass
    return replace(graph, meta={**graph.meta, "memory": facts})
