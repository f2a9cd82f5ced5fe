"""Transparency of both rewrites on every autoplace.zoo workload (small configs).

place_module with random targets over 2 to 4 CPU targets: outputs and gradients equal the
unplaced model's (max abs error <= 1e-5), and 20 SGD steps follow the same losses.
split_stages with a random stage assignment: the chained stages equal the model.

Where a rewrite adds nodes to the autograd graph (always_copy=True copies, stage boundaries),
gradients that meet at a fork are summed in another order; in float32 that moves a gradient by
a few ulps of its size. The small Inception-V3 has gradients near 1.6e3, so there the bound
is 1e-5 relative to the largest gradient (measured: 1.8e-3 absolute, 1.1e-6 relative); plain
place_module adds no such nodes on one device and matches to 0.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.fx

from autoplace import zoo
from autoplace.rewrite.pipeline import split_stages
from autoplace.rewrite.placed import place_module
from test_rewrite_split import random_monotone

TOL = 1e-5
HEAVY = {"inception_v3", "nasnet", "resnet50", "gnmt8-unrolled"}


def names(heavy_slow: bool) -> list[object]:
    return [pytest.param(n, marks=pytest.mark.slow) if heavy_slow and n in HEAVY else n for n in zoo.names()]


def grad_errors(model: torch.nn.Module, ref: torch.nn.Module) -> tuple[float, float]:
    """(max abs gradient difference, largest reference gradient)."""
    rp = dict(ref.named_parameters())
    pairs = [(p.grad, rp[k].grad) for k, p in model.named_parameters() if rp[k].grad is not None]
    return (max((a - b).abs().max().item() for a, b in pairs),
            max(b.abs().max().item() for _, b in pairs))


@pytest.mark.parametrize("name", names(heavy_slow=False))
def test_placed_zoo_model_matches(name: str) -> None:
    k = 2 + sum(map(ord, name)) % 3
    for always_copy in (False, True):
        wl = zoo.build(name, small=True)
        ref = copy.deepcopy(wl.model)
        gm = torch.fx.symbolic_trace(wl.model)
        rng = random.Random(k)
        targets = {n.name: rng.randrange(k) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
        placed = place_module(gm, targets, ["cpu"] * k, always_copy=always_copy, original=wl.model)
        assert sorted(placed.state_dict()) == sorted(ref.state_dict())  # checkpoints load either way
        out, r = placed(*wl.example_inputs), ref(*wl.example_inputs)
        assert (out - r).abs().max().item() <= TOL
        wl.loss_fn(out, wl.target).backward()
        wl.loss_fn(r, wl.target).backward()
        err, scale = grad_errors(wl.model, ref)
        assert err <= (TOL * max(1.0, scale) if always_copy else TOL), (always_copy, err, scale)
        rb = dict(ref.named_buffers())
        for key, b in wl.model.named_buffers():
            torch.testing.assert_close(b, rb[key], atol=TOL, rtol=0, msg=key)  # masks hold -inf


@pytest.mark.parametrize("name", names(heavy_slow=True))
def test_placed_zoo_model_trains_like_the_original(name: str) -> None:
    wl = zoo.build(name, small=True)
    ref = copy.deepcopy(wl.model)
    gm = torch.fx.symbolic_trace(wl.model)
    rng = random.Random(1)
    targets = {n.name: rng.randrange(3) for n in gm.graph.nodes if n.op not in ("placeholder", "output")}
    placed = place_module(gm, targets, ["cpu"] * 3)
    opt = torch.optim.SGD(wl.model.parameters(), lr=1e-3, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(20):
        losses = []
        for m, o in ((placed, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = wl.loss_fn(m(*wl.example_inputs), wl.target)
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= TOL


@pytest.mark.parametrize("name", names(heavy_slow=True))
def test_split_zoo_model_chains_to_the_model(name: str) -> None:
    wl = zoo.build(name, small=True)
    ref = copy.deepcopy(wl.model)
    gm = torch.fx.symbolic_trace(wl.model)
    stages = split_stages(gm, random_monotone(gm, 3, 1), example_inputs=wl.example_inputs, num_stages=3)
    values = wl.example_inputs
    for m in stages:
        values = m(*values)
    r = ref(*wl.example_inputs)
    assert (values - r).abs().max().item() <= TOL
    wl.loss_fn(values, wl.target).backward()
    wl.loss_fn(r, wl.target).backward()
    err, scale = grad_errors(wl.model, ref)
    assert err <= TOL * max(1.0, scale), (err, scale)
