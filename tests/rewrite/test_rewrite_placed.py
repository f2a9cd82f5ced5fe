"""Transparency of the model-parallel rewrite (the contract of place_module).

Every model is traced with torch.fx.symbolic_trace, every node gets a random target among 2 to
4 targets that are all the CPU, and the placed model must give the unplaced model's outputs,
gradients, BatchNorm statistics and 20-step loss curves (max abs error <= 1e-5, fp32). The
expected transfer nodes are counted independently from the original graph.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest
import torch
import torch.fx

import rewrite_models as rm
from autoplace.rewrite.placed import PlacementRewriteError, place_module, transfer

TOL = 1e-5


def random_targets(gm: torch.fx.GraphModule, k: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    return {n.name: rng.randrange(k) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}


def attr(root: torch.nn.Module, path: str) -> object:
    for p in path.split("."):
        root = getattr(root, p)
    return root


def expected_transfers(gm: torch.fx.GraphModule, targets: dict[str, int]) -> set[tuple[str, int]]:
    """(producer, destination target) for every edge between targets, computed from scratch.

    A tensor of the model lives where its first user (in graph order) runs, so a get_attr
    produces its tensor there; a graph input has no target and is always moved.
    """
    home: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = attr(gm, n.target)
            for t in [*(p for _, p in m.named_parameters(remove_duplicate=False)),
                      *(b for _, b in m.named_buffers(remove_duplicate=False))]:
                home.setdefault(id(t), targets[n.name])
        elif n.op == "get_attr":
            home.setdefault(id(attr(gm, n.target)), targets[n.name])

    def where(n: torch.fx.Node) -> int | None:
        if n.op == "placeholder":
            return None
        if n.op == "get_attr":
            return home[id(attr(gm, n.target))]
        return targets[n.name]

    def device_arg_only(u: torch.fx.Node, v: torch.fx.Node) -> bool:
        # The rewrite replaces a `device=` argument by v's own device: nothing to move.
        return v.kwargs.get("device") is u and u not in v.args

    pairs = set()
    for v in gm.graph.nodes:
        if v.op == "output":
            continue
        for u in v.all_input_nodes:
            if where(u) != targets[v.name] and not device_arg_only(u, v):
                pairs.add((u.name, targets[v.name]))
    return pairs


def actual_transfers(placed: torch.fx.GraphModule, targets: dict[str, int]) -> list[tuple[str, int]]:
    out = []
    for n in placed.graph.nodes:
        if n.target is transfer:
            dests = {targets[u.name] for u in n.users}
            assert len(dests) == 1, f"transfer {n.name} feeds several targets {dests}"
            out.append((n.args[0].name, dests.pop()))
    return out


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max([(a[k] - b[k]).abs().max().item() for k in a] or [0.0])


CASES = [(name, k, seed) for name in rm.NAMES for k, seed in ((2, 0), (3, 1), (4, 2))]


@pytest.mark.parametrize("name,k,seed", CASES)
@pytest.mark.parametrize("always_copy", [False, True])
def test_outputs_gradients_and_buffers_match(name: str, k: int, seed: int, always_copy: bool) -> None:
    model, inputs, target = rm.build(name, seed)
    ref = copy.deepcopy(model)
    loss_fn = rm.loss_fn(name)
    gm = torch.fx.symbolic_trace(model)
    targets = random_targets(gm, k, seed)
    want = expected_transfers(gm, targets)
    placed = place_module(gm, targets, ["cpu"] * k, always_copy=always_copy)

    got = actual_transfers(placed, targets)
    assert len(got) == len(set(got)), "a (producer, target) pair got two transfers"
    assert set(got) == want
    assert {id(p) for p in placed.parameters()} == {id(p) for p in model.parameters()}
    assert sorted(placed.state_dict()) == sorted(ref.state_dict())

    for _ in range(2):  # twice, so BatchNorm statistics are updated and then used
        out = placed(*inputs)
        r = ref(*inputs)
        assert (out - r).abs().max().item() <= TOL
        loss_fn(out, target).backward()
        loss_fn(r, target).backward()
        assert max_err(grads(model), grads(ref)) <= TOL
    buf, rbuf = dict(model.named_buffers()), dict(ref.named_buffers())
    assert max_err(buf, rbuf) <= TOL
    placed.eval()
    # The leaf modules (those that compute) are shared, so eval() reaches the user's.
    assert not any(m.training for m in model.modules() if not list(m.children()))
    assert (placed(*inputs) - ref.eval()(*inputs)).abs().max().item() <= TOL


@pytest.mark.parametrize("name", rm.NAMES)
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_twenty_optimizer_steps_follow_the_same_losses(name: str, opt: str) -> None:
    model, inputs, target = rm.build(name, 3)
    ref = copy.deepcopy(model)
    loss_fn = rm.loss_fn(name)
    gm = torch.fx.symbolic_trace(model)
    placed = place_module(gm, random_targets(gm, 3, 3), ["cpu"] * 3, always_copy=True)

    def make(params: object) -> torch.optim.Optimizer:
        if opt == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
        return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]

    # The optimizer is built on the USER's model: place_module must keep its parameters valid.
    o1, o2 = make(model.parameters()), make(ref.parameters())
    losses, ref_losses = [], []
    for _ in range(20):
        for m, o, out_fn, ls in ((placed, o1, placed, losses), (ref, o2, ref, ref_losses)):
            o.zero_grad()
            loss = loss_fn(out_fn(*inputs), target)
            loss.backward()
            o.step()
            ls.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    assert losses[-1] < losses[0]
    if opt == "sgd":
        # Not for Adam: it rescales a gradient of 1e-9 (rounding noise, e.g. a conv bias right
        # before BatchNorm, whose true gradient is 0) into a full step, so such parameters drift
        # apart by ~lr per step although the losses stay equal.
        assert max_err(dict(model.named_parameters()), dict(ref.named_parameters())) <= TOL


def test_output_returns_on_the_input_device_and_factories_get_their_node_device() -> None:
    model, inputs, _ = rm.build("factories")
    gm = torch.fx.symbolic_trace(model)
    targets = random_targets(gm, 2, 0)
    placed = place_module(gm, targets, ["cpu", "cpu"])
    for n in placed.graph.nodes:
        if n.op == "call_function" and n.target in (torch.arange, torch.zeros, torch.full):
            assert n.kwargs["device"] == torch.device("cpu")
    assert placed(*inputs).device == torch.device("cpu")
    gm2 = torch.fx.symbolic_trace(model)
    out = place_module(gm2, random_targets(gm2, 2, 0), ["cpu", "cpu"], output_device="meta")(*inputs)
    assert out.device == torch.device("meta")


def test_shared_module_called_on_another_target_goes_through_moved_state() -> None:
    model, inputs, target = rm.build("shared_calls")
    gm = torch.fx.symbolic_trace(model)
    names = [n.name for n in gm.graph.nodes if n.op == "call_module"]
    assert names == ["lin", "bn", "mid", "lin_1", "bn_1"]
    targets = {n: 0 for n in names} | {"tanh": 1, "add": 0, "lin_1": 1, "bn_1": 1}
    placed = place_module(gm, targets, ["cpu", "cpu"], always_copy=True)
    moved_calls = [n.name for n in placed.graph.nodes if n.op == "call_function"
                   and getattr(n.target, "__name__", "") == "_call_moved"]
    assert moved_calls == ["lin_1", "bn_1"]
    ref = copy.deepcopy(model)
    out, r = placed(*inputs), ref(*inputs)
    torch.nn.functional.mse_loss(out, target).backward()
    torch.nn.functional.mse_loss(r, target).backward()
    assert (out - r).abs().max().item() <= TOL
    # Both calls of `lin` contribute to its one gradient; the BN statistics saw two batches.
    assert max_err(grads(model), grads(ref)) <= TOL
    assert model.bn.num_batches_tracked.item() == 2
    assert (model.bn.running_mean - ref.bn.running_mean).abs().max().item() <= TOL


# ---- bad input: clear errors, and the user's model untouched ---------------------------------------

def snapshot(model: torch.nn.Module) -> dict[str, tuple[torch.device, int, torch.Tensor]]:
    return {k: (v.device, v.data_ptr(), v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}


def assert_untouched(model: torch.nn.Module, before: dict[str, tuple[torch.device, int, torch.Tensor]]) -> None:
    for k, v in model.state_dict(keep_vars=True).items():
        dev, ptr, val = before[k]
        assert v.device == dev and v.data_ptr() == ptr, k
        assert v.device.type == "meta" or torch.equal(v.detach(), val), k


BAD: list[tuple[str, Callable[[dict[str, int]], tuple[dict[str, int], list[str]]], str]] = [
    ("empty device list", lambda t: (t, []), "non-empty list"),
    ("device torch rejects", lambda t: (t, ["cpu", "gpu:0"]), "not a device torch understands"),
    ("device this machine lacks", lambda t: (t, ["cpu", "cuda:7"]), "not available on this machine"),
    ("target out of range", lambda t: ({**t, "lin": 5}, ["cpu", "cpu"]), "target 5"),
    ("unknown node", lambda t: ({**t, "nope": 0}, ["cpu", "cpu"]), "nope"),
    ("missing node", lambda t: ({k: v for k, v in t.items() if k != "lin"}, ["cpu", "cpu"]), "no target"),
]


@pytest.mark.parametrize("case,mutate,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_and_leaves_the_model_alone(
        case: str, mutate: Callable[[dict[str, int]], tuple[dict[str, int], list[str]]], message: str) -> None:
    model, _, _ = rm.build("factories")
    gm = torch.fx.symbolic_trace(model)
    targets, devices = mutate(random_targets(gm, 2, 0))
    before = snapshot(model)
    with pytest.raises(PlacementRewriteError, match=message):
        place_module(gm, targets, devices)
    assert_untouched(model, before)


def test_model_already_spread_over_devices_is_refused() -> None:
    model, _, _ = rm.build("factories")
    model.lin2.to("meta")
    gm = torch.fx.symbolic_trace(model)
    before = snapshot(model)
    with pytest.raises(PlacementRewriteError, match="already spread over several devices"):
        place_module(gm, random_targets(gm, 2, 0), ["cpu", "cpu"])
    assert_untouched(model, before)
