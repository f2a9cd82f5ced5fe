"""The op-kind vocabulary: raw kinds (module classes, function names, profile descriptions)
mapped onto a small set of classes that the cost model and the policies share.

A kind is what the tracer or the profile loader wrote (``"Conv2d"``, ``"linear"``,
``"scaled_dot_product_attention"``, ``"Add"``); its class is one of :data:`CLASSES`.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["CLASSES", "kind_class", "normalize_kind"]

CLASSES: tuple[str, ...] = (
    "conv",
    "matmul",
    "rnn",
    "attention",
    "embedding",
    "norm",
    "pool",
    "activation",
    "elementwise",
    "reduce",
    "concat",
    "dropout",
    "input",
    "loss",
    "other",
)

_RULES: tuple[tuple[str, str], ...] = (
    (r"^input\d*$|^placeholder$", "input"),
    (r"conv", "conv"),
    (r"lstm|gru|^rnn", "rnn"),
    (r"attention|sdpa|multiheadattention", "attention"),
    (r"embedding", "embedding"),
    (r"linear|matmul|^mm$|^bmm$|^addmm$|baddbmm|einsum|bilinear|dense|classifier", "matmul"),
    (r"norm", "norm"),
    (r"pool", "pool"),
    (r"relu|gelu|silu|sigmoid|tanh|softmax|elu|swish|mish|hardtanh|softplus|activation|glu", "activation"),
    (r"dropout", "dropout"),
    (r"^cat$|concat|^stack$", "concat"),
    (r"loss|cross_entropy|nll|mse", "loss"),
    (r"^sum$|^mean$|^max$|^min$|^amax$|^var$|^std$|reduce", "reduce"),
    (r"add|sub|mul|div|pow|sqrt|rsqrt|exp|log|neg|abs|where|masked_fill|clamp|iadd|getitem|flatten|"
     r"transpose|permute|contiguous|view|reshape|expand|chunk|split|squeeze|to|type|float|zeros|ones|"
     r"arange|cumsum|triu|tril|pad|interpolate|upsample|identity|scale", "elementwise"),
)


def normalize_kind(kind: str) -> str:
    """``"Conv2d(64, 96, kernel_size=(3, 3))"`` -> ``"Conv2d"``; ``"torch.nn.functional.relu"`` -> ``"relu"``;
    ``"__getitem__(0)"`` -> ``"getitem"``."""
    k = kind.strip()
    k = k.split("(", 1)[0]
    k = k.rsplit(".", 1)[-1]
    k = k.strip("_")
    k = re.sub(r"\.(default|Tensor|Scalar|int)$", "", k)
    return k or "other"


@lru_cache(maxsize=4096)
def kind_class(kind: str) -> str:
    """The class of a raw kind (one of :data:`CLASSES`); ``"other"`` when nothing matches."""
    k = normalize_kind(kind).lower()
    for pattern, cls in _RULES:
        if re.search(pattern, k):
            return cls
    return "other"
