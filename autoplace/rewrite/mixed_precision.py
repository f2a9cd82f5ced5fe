"""bf16 mixed precision for stages that are not sharded (DDP replicas, TP ranks with DDP replicas):
the semantics of FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, which
runs the FSDP stages (:func:`autoplace.rewrite.units.shard_stage`), without the sharding.

1. Compute: every FSDP unit (:mod:`autoplace.graph.units`, outlined into one call) and the stage
   module (for the parameters outside any unit) cast their floating parameters to bf16 on each
   forward call and their floating inputs to bf16, as ``fully_shard`` casts a unit's parameters
   and inputs. The cast is a differentiable ``.to`` of the fp32 ``Parameter``, swapped in for
   the call only: the optimizer holds fp32 master parameters, and gradients arrive in fp32 in
   their ``.grad``. A recomputed unit's checkpoint wraps the cast, so recompute casts again.
   Buffers keep their dtype (FSDP2 has no buffer dtype either). BatchNorm runs in fp32 (its
   input cast up, its output back), as FSDP1's ``MixedPrecision`` leaves it by default.
2. Outputs: the stage's floating outputs leave in bf16 (what the next stage receives), the last
   stage's in fp32 (FSDP's ``output_dtype``), so the loss sees fp32 logits.
3. Reduction in bf16: DDP's buckets go through a comm hook that does what torch's
   ``bf16_compress_hook`` does (each bucket cast to bf16, divided by the replicas, summed, copied
   back; DDP refuses torch's own without NCCL); replicas that average in torch's
   ``REDUCE_GRAD`` action (:func:`autoplace.rewrite.stage_replicas.average_grads`) do the same.

Where it departs from FSDP2: gradients accumulate over micro-batches in fp32 (FSDP2 keeps the
unsharded gradient in its reduce dtype between micro-batches), so they are rounded to bf16 once,
for the reduction (Megatron-LM goes further and also reduces in fp32).

Why not torch's own ``DistributedDataParallel(mixed_precision=_MixedPrecision(...))`` (torch
2.13): it is private and marked experimental; it records copy events on a side stream, which
the CPU backend refuses (``RuntimeError: cpu backend doesn't support events``), so it cannot run
under gloo on CPU; it arms each parameter's reduction in the forward pre-hook of the module that
owns it, which a traced stage never calls for the parameters it reads with ``get_attr`` (an
RMSNorm's weight, inlined by torch.fx), so those would never be reduced; and it casts buffers.
"""

# No ``from __future__ import annotations``: DDP reads the comm hook's annotations as objects.
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

__all__ = ["PARAM_DTYPE", "cast_stage", "bf16_ddp", "full_precision", "in_fp32"]

PARAM_DTYPE = torch.bfloat16

Slot = tuple[torch.nn.Module, str]


def full_precision(mod: torch.nn.Module) -> bool:
    """A module that runs in fp32 inside a bf16 stage: BatchNorm (torch's kernels on CPU refuse bf16
    weights beside its fp32 running statistics), as FSDP1's ``MixedPrecision`` leaves it by default
    (``_module_classes_to_ignore=(_BatchNorm,)``)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from .batchnorm import BatchStatsNorm

    return isinstance(mod, (_BatchNorm, BatchStatsNorm))


def _slots(root: torch.nn.Module, skip: Sequence[str] = ()) -> list[Slot]:
    """(module, parameter name) of every floating parameter under ``root``, but for the modules
    at or under the paths ``skip`` (units that cast their own) and those that run in fp32."""
    out: list[Slot] = []
    for path, mod in root.named_modules(remove_duplicate=False):
        if any(path == s or path.startswith(s + ".") for s in skip) or full_precision(mod):
            continue
        out.extend((mod, name) for name, p in mod._parameters.items() if p is not None and p.is_floating_point())
    return out


@contextmanager
def _cast(slots: Sequence[Slot], dtype: torch.dtype) -> Iterator[None]:
    """The parameters of ``slots`` as ``dtype`` copies (autograd flows back to them) for the block."""
    saved = []
    try:
        for mod, name in slots:
            p = mod._parameters[name]
            assert p is not None
            mod._parameters[name] = p.to(dtype)  # type: ignore[assignment]
            saved.append((mod, name, p))
        yield
    finally:
        for mod, name, p in reversed(saved):
            mod._parameters[name] = p


def _to(dtype: torch.dtype) -> Any:
    return lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _install(module: torch.nn.Module, slots: Sequence[Slot], dtype: torch.dtype,
             output_dtype: torch.dtype | None) -> None:
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(_to(dtype), (args, kwargs))
        with _cast(slots, dtype):
            out = inner(*args, **kwargs)
        return out if output_dtype is None else tree_map(_to(output_dtype), out)

    module.forward = forward  # type: ignore[method-assign]


def in_fp32(module: torch.nn.Module) -> None:
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return inner(x.float()).to(x.dtype)

    module.forward = forward  # type: ignore[method-assign]


def cast_stage(stage: torch.nn.Module, units: Sequence[str], *, output_dtype: torch.dtype,
               dtype: torch.dtype = PARAM_DTYPE) -> torch.nn.Module:
    """Run ``stage`` in ``dtype`` as the module docstring says (steps 1 and 2), in place: each unit
    of ``units`` (module paths in ``stage``) casts its own parameters and inputs, the stage the rest
    and returns its floating outputs in ``output_dtype``. Call it before checkpointing the units,
    so that recompute casts again. Returns ``stage``."""
    for mod in stage.modules():
        if full_precision(mod):  # fp32 inside: its input cast up, its output back to the input's dtype
            in_fp32(mod)
    for path in units:
        unit = stage.get_submodule(path)
        _install(unit, _slots(unit), dtype, None)
    _install(stage, _slots(stage, units), dtype, output_dtype)
    return stage


def _bf16_allreduce(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the bucket cast to bf16, divided by the replicas, summed, copied back. It
    is torch's ``bf16_compress_hook``, which DDP accepts only with NCCL (by the hook's name), not
    with gloo, whose all-reduce sums bf16 as well."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))

    def back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(low, group=group, async_op=True).get_future().then(back)  # type: ignore[union-attr]


def bf16_ddp(ddp: torch.nn.Module, group: Any) -> torch.nn.Module:
    """``ddp`` (a DistributedDataParallel over ``group``) reducing its gradient buckets in bf16 (step 3)."""
    ddp.register_comm_hook(group, _bf16_allreduce)  # type: ignore[operator]
    return ddp
