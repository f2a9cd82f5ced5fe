"""A PipeDream profile's layer lines: what each says (:class:`Layer`) and the forward FLOPs its
description implies (:func:`layer_flops`), as :mod:`autoplace.graph.pipedream`'s docstring
("FLOPs") states the rules; :func:`in_place` tells the layers that write their input's storage.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ProfileError
from .kinds import normalize_kind

__all__ = ["Layer", "layer_flops", "layer_args", "ints", "in_place", "DTYPE_BYTES"]

DTYPE_BYTES = 4
"""Bytes per element of the profiled tensors (fp32)."""


@dataclass(frozen=True)
class Layer:
    id: str
    description: str
    fwd_ms: float
    bwd_ms: float
    outputs: tuple[float, ...]
    param_bytes: float
    line: int

    @property
    def kind(self) -> str:
        if re.fullmatch(r"Input\d*", self.description.strip()):
            return "Input"
        return normalize_kind(self.description)


# ---- FLOPs -------------------------------------------------------------------------------


def _split_top(s: str) -> list[str]:
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def layer_args(desc: str) -> tuple[list[str], dict[str, str]]:
    """Positional and keyword arguments of a flat module repr ``Name(a, b, k=v)``."""
    open_ = desc.find("(")
    if open_ < 0 or not desc.rstrip().endswith(")"):
        return [], {}
    pos: list[str] = []
    kw: dict[str, str] = {}
    for part in _split_top(desc[open_ + 1 : desc.rstrip().rfind(")")]):
        if "=" in part and not part.startswith("("):
            k, v = part.split("=", 1)
            kw[k.strip()] = v.strip()
        else:
            pos.append(part)
    return pos, kw


def ints(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"-?\d+", v))


def _children(desc: str) -> list[tuple[str, str]]:
    """``(name, repr)`` of the direct sub-modules printed in a composite module's repr."""
    out = []
    for m in re.finditer(r"\((\w+)\): (\w+)\(", desc):
        depth, j = 0, m.end() - 1
        for j in range(m.end() - 1, len(desc)):
            depth += {"(": 1, ")": -1}.get(desc[j], 0)
            if depth == 0:
                break
        out.append((m[1], desc[m.start(2) : j + 1]))
    return out


def _window(kind: str, kw: dict[str, str]) -> float:
    """Kernel area of a conv or pool layer (``kernel_size=3`` of a 2d layer is 3x3)."""
    k = ints(kw.get("kernel_size", "1"))
    if not k:
        raise ValueError(f"kernel_size={kw['kernel_size']!r} holds no size")
    dims = int(kind[-2]) if kind[-2:-1].isdigit() else len(k)
    return float(k[0] ** dims if len(k) == 1 else math.prod(k))


def _lstm_flops(desc: str, tokens_out_bytes: float) -> float:
    args, kw = layer_args(desc)
    x, h = ints(args[0])[0], ints(args[1])[0]
    layers = ints(kw.get("num_layers", "1"))[0]
    dirs = 2 if kw.get("bidirectional") == "True" else 1
    tokens = tokens_out_bytes / DTYPE_BYTES / (h * dirs)
    total = 0.0
    for layer in range(layers):
        width = x if layer == 0 else h * dirs
        total += 2.0 * tokens * dirs * 4 * h * (width + h)
    return total


def _forward_flops(layer: Layer) -> float | None:
    """Forward FLOPs of one layer, or None when the description says too little."""
    kind, desc = layer.kind, layer.description
    elems = [o / DTYPE_BYTES for o in layer.outputs]
    out = sum(elems)
    if kind in ("Input", "Concat", "View", "Size", "getitem", "hidden", "Flatten"):
        return 0.0
    if re.fullmatch(r"Conv(Transpose)?[123]d", kind):
        args, kw = layer_args(desc)
        groups = ints(kw.get("groups", "1"))[0]
        return 2.0 * out * ints(args[0])[0] / groups * _window(kind, kw)
    if kind == "Linear":
        _, kw = layer_args(desc)
        return 2.0 * out * ints(kw["in_features"])[0]
    if kind in ("LSTM",):
        return _lstm_flops(desc, layer.outputs[0])
    if kind.startswith("BatchNorm"):
        return 4.0 * out
    if re.fullmatch(r"(Max|Avg)Pool[123]d", kind):
        return _window(kind, layer_args(desc)[1]) * out
    if kind in ("ReLU", "ReLU6", "Dropout", "Add", "Mul", "Sigmoid", "Tanh", "Hardtanh", "ELU", "GELU"):
        return out
    children = _children(desc)
    if kind == "EmuBidirLSTM":
        bidir = [c for name, c in children if name == "bidir"]
        return _lstm_flops(bidir[0], layer.outputs[0]) if bidir else None
    if kind == "RecurrentAttention":
        rnn = [c for name, c in children if name == "rnn"]
        if not rnn or len(layer.outputs) != 5:
            return None
        h = ints(layer_args(rnn[0])[0][1])[0]
        batch = layer.outputs[1] / DTYPE_BYTES / h
        t = layer.outputs[0] / DTYPE_BYTES / h / batch
        s = layer.outputs[4] / DTYPE_BYTES / (batch * t)
        proj = 2.0 * (t + s) * batch * h * h  # linear_q on the decoder steps, linear_k on the encoder's
        return _lstm_flops(rnn[0], layer.outputs[0]) + proj + 6.0 * h * batch * t * s
    linears = [c for _, c in children if c.startswith("Linear(")]
    if len(linears) == 1 and len(children) == 1:
        return 2.0 * out * ints(layer_args(linears[0])[1]["in_features"])[0]
    return None


# How each kind whose FLOPs are read from its arguments is described (PyTorch's module repr).
_DESCRIBED_AS = {
    "Conv": "Conv2d(in_channels, out_channels, kernel_size=(3, 3), stride=(1, 1), groups=1)",
    "Linear": "Linear(in_features=4096, out_features=1000, bias=True)",
    "LSTM": "LSTM(input_size, hidden_size, num_layers=1, bidirectional=False)",
    "Pool": "MaxPool2d(kernel_size=3, stride=2, padding=0)",
}


def layer_flops(layer: Layer, path: Path) -> float | None:
    """:func:`_forward_flops`, or a ProfileError naming the node when its description lacks the
    arguments its FLOPs are computed from (``Conv2d(a)``, ``Linear(10)``, ``groups=0``)."""
    try:
        return _forward_flops(layer)
    except (IndexError, KeyError, ValueError, ArithmeticError):
        key = next((k for k in _DESCRIBED_AS if k in layer.kind), None)
        example = f", e.g. {_DESCRIBED_AS[key]}" if key else " (with its sub-modules, e.g. (rnn): LSTM(1024, 1024))"
        raise ProfileError(
            f"{path}:{layer.line}: node {layer.id!r} is described as {layer.description!r}, which lacks the arguments "
            f"its FLOPs are computed from (sizes, as whole numbers > 0); write the description as PyTorch prints "
            f"the module{example}") from None


def in_place(layer: Layer) -> bool:
    """An in-place layer (``ReLU(inplace)``, ``Add(inplace)``, ``inplace=True``) writes its result
    into its input's storage: it allocates no activation of its own."""
    return bool(re.search(r"\(inplace\b|inplace=True", layer.description))
