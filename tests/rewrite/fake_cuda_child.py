"""Child process of test_rewrite_fake_cuda.py: place the test models on fake cuda:0..3.

Everything runs under FakeTensorMode (tensors carry a device and a shape, no data) and no_grad,
so a CPU-only torch can check device logic: a fake op given tensors on two devices raises as a
real CUDA op would, and a TorchDispatchMode above the fake mode records every op's devices.
Prints one JSON line per case.

Two shims, both for what fake tensors cannot do on a CPU-only build, nothing else patched:

- ``tensor.data = other`` (how place_module moves parameters, as ``nn.Module.to`` does) changes
  a real tensor's device, but a FakeTensor keeps reporting its old ``fake_device``; and the fake
  mode holds weak references to its tensors, so ``torch.utils.swap_tensors`` refuses them too.
  The shim makes the ``.data`` setter of a FakeTensor also take the new tensor's fake device,
  i.e. behave as it does on real tensors.
  The getter likewise returns the fake device (a real ``.data`` is on the tensor's device).
- the Python bindings of ``Tensor.copy_`` and of indexing (``x[...]``) set a CUDA device guard
  before dispatch and fail ("not linked with support for cuda devices"); the ops themselves
  work under fake mode. ``Tensor.copy_`` is routed to ``aten.copy_``; indexing first checks
  that the tensor and its tensor indices share one device (recorded as a mix otherwise), then
  runs on the same fake tensors relabelled as CPU and labels the result with the device.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).parent))
import rewrite_models as rm  # noqa: E402

from autoplace.rewrite.placed import place_module  # noqa: E402


def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return torch.ops.aten.copy_.default(self, src, non_blocking)


torch.Tensor.copy_ = _copy_  # type: ignore[method-assign,assignment]

_DATA = torch._C.TensorBase.data  # the C-level getset descriptor


SHIM_DEPTH = [0]  # > 0 while a shim runs: the checker skips the ops a shim issues itself


def _get_data(self: torch.Tensor) -> torch.Tensor:
    SHIM_DEPTH[0] += 1
    try:
        out = _DATA.__get__(self)
    finally:
        SHIM_DEPTH[0] -= 1
    if isinstance(self, FakeTensor) and isinstance(out, FakeTensor):
        out.fake_device = self.fake_device
    return out  # type: ignore[no-any-return]


def _set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    _DATA.__set__(self, new)
    if isinstance(self, FakeTensor) and isinstance(new, FakeTensor):
        self.fake_device = new.fake_device


FakeTensor.data = property(_get_data, _set_data)  # type: ignore[assignment,method-assign]

_GETITEM = torch.Tensor.__getitem__
INDEXING_MIXES: list[str] = []
INDEXED_ON: set[str] = set()


def _on_device(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)


def _getitem(self: torch.Tensor, idx: Any) -> Any:
    fakes = [t for t in tree_leaves((self, idx)) if isinstance(t, FakeTensor)]
    devices = {str(t.device) for t in tree_leaves((self, idx)) if _on_device(t)}
    if not isinstance(self, FakeTensor) or self.device.type == "cpu":
        return _GETITEM(self, idx)
    if len(devices) > 1:
        INDEXING_MIXES.append(f"indexing: {sorted(devices)}")
    INDEXED_ON.update(devices)
    saved = [(t, t.fake_device) for t in fakes]
    for t in fakes:
        t.fake_device = torch.device("cpu")
    SHIM_DEPTH[0] += 1
    try:
        out = _GETITEM(self, idx)
    finally:
        SHIM_DEPTH[0] -= 1
        for t, d in saved:
            t.fake_device = d
    out.fake_device = saved[0][1]
    return out


torch.Tensor.__getitem__ = _getitem  # type: ignore[method-assign,assignment]


class DeviceCheck(TorchDispatchMode):
    """Records, for every op, the devices of its tensor arguments and results.

    A 0-dim CPU tensor may join a CUDA op (torch allows it, as a scalar), so it is not counted.
    ``_to_copy`` (the transfer) is the one op allowed to produce a tensor on another device.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []
        self.devices: set[str] = set()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if SHIM_DEPTH[0]:
            return func(*args, **kwargs)
        ins = {str(t.device) for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(ins) > 1:
            self.mixed.append(f"{func}: inputs on {sorted(ins)}")
        out = func(*args, **kwargs)
        outs = {str(t.device) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        self.ops += 1
        self.devices |= ins | outs
        if ins and func is not torch.ops.aten._to_copy.default and not outs <= ins:
            self.mixed.append(f"{func}: inputs on {sorted(ins)}, output on {sorted(outs)}")
        return out


def planned_devices(gm: torch.fx.GraphModule, targets: dict[str, int], devices: list[str]) -> dict[int, str]:
    """id(tensor) -> device of the first node in graph order that uses it (the documented rule)."""

    def attr(path: str) -> Any:
        obj: Any = gm
        for p in path.split("."):
            obj = getattr(obj, p)
        return obj

    home: dict[int, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = attr(n.target)
            for _, t in [*m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False)]:
                home.setdefault(id(t), devices[targets[n.name]])
        elif n.op == "get_attr":
            home.setdefault(id(attr(n.target)), devices[targets[n.name]])
    return home


def run_case(name: str, k: int, seed: int, train: bool) -> dict[str, Any]:
    devices = [f"cuda:{i}" for i in range(4)][:k] if k == 4 else [f"cuda:{2 * i + 1}" for i in range(k)]
    with FakeTensorMode(), torch.no_grad():
        model, inputs, _ = rm.build(name, seed)
        model.train(train)
        gm = torch.fx.symbolic_trace(model)
        rng = random.Random(seed)
        targets = {n.name: rng.randrange(k) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
        want = planned_devices(gm, targets, devices)
        state = {id(t): (qual, t) for qual, t in [*gm.named_parameters(remove_duplicate=False),
                                                  *gm.named_buffers(remove_duplicate=False)]}
        placed = place_module(gm, targets, devices)
        misplaced = [f"{qual} on {t.device}, planned {want[i]}" for i, (qual, t) in state.items()
                     if i in want and str(t.device) != want[i]]
        x = tuple(t.to("cuda:0") for t in inputs)
        check = DeviceCheck()
        INDEXING_MIXES.clear()
        INDEXED_ON.clear()
        with check:
            out = placed(*x)
        return {
            "name": name, "k": k, "seed": seed, "train": train, "ops": check.ops,
            "mixed": (check.mixed + INDEXING_MIXES)[:5], "devices_seen": sorted(check.devices | INDEXED_ON),
            "planned": sorted(set(want.values())), "unplanned_state": len(state) - len(want),
            "misplaced": misplaced[:5], "out_device": str(out.device),
        }


def control_case() -> dict[str, Any]:
    """The unplaced Factories model, parameters on the CPU, input on cuda:0: must be caught."""
    with FakeTensorMode(), torch.no_grad():
        model, inputs, _ = rm.build("factories", 0)
        check = DeviceCheck()
        try:
            with check:
                model(inputs[0].to("cuda:0"))
        except Exception as e:
            return {"name": "control", "mixed": check.mixed[:5], "raised": f"{type(e).__name__}: {e}"[:500]}
        return {"name": "control", "mixed": check.mixed[:5], "raised": ""}


def main() -> None:
    print(json.dumps(control_case()), flush=True)
    for name in rm.NAMES:
        for k, seed, train in ((2, 0, True), (4, 1, True), (4, 2, False)):
            if True:
                try:
                    print(json.dumps(run_case(name, k, seed, train)), flush=True)
                except Exception as e:  # report, so the parent names the case
                    print(json.dumps({"name": name, "k": k, "seed": seed, "train": train,
                                      "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)


if __name__ == "__main__":
    main()
