"""The policies online fine-tuning samples from, and the PPO update on live rewards.

Model parallel (:func:`model_policy`): in order of preference,

0. ``"mars"``: when the plan came from the Mars planner, the network it placed with
   (:func:`planner_network`: the shipped or given weights it loaded,
   :func:`autoplace.planners.learned.mars.planner.load_pretrained`), bound to the graph as a
   :class:`~autoplace.planners.learned.mars.planner.MarsPolicy`: online PPO goes on training
   the planner's own network instead of a fresh one. (A Mars plan fine-tuned with
   ``budget_s`` was made by a copy the planner does not keep: the policy starts from the
   weights that copy was fine-tuned from, and its note says so.)
1. ``"eagle"``: the EAGLE network (:mod:`autoplace.planners.learned.eagle.planner`; Lan, Chen, Li,
   IPDPS 2021): for a plan the EAGLE planner made, the network it trained
   (``meta["tuned_weights"]``, :mod:`autoplace.planners.learned.eagle.weights`), else a fresh
   one; centred on the current placement by the planner's own warm start (its samples differ
   from the placement by about one op and two groups, whole runs of ops moved to another device);
2. ``"independent"``: :func:`autoplace.planners.learned.ppo.IndependentPolicy`, one categorical per op
   whose logits put probability ``1 - perturb_ops / N`` on the op's current device: a sample is
   the placement with about ``perturb_ops`` ops moved. This is the documented fallback when
   the EAGLE policy cannot be built (the reason is recorded).

``"auto"`` tries them in that order (Mars only for a Mars plan). After a new best placement is measured, the policy is
centred on it again (EAGLE's self-imitation re-centring).

Pipeline (:class:`CutPolicy`): ``S - 1`` categoricals over the cut positions in topological
order; the sorted cuts give every op its stage (``stage = number of cuts at or before it``),
so stages never decrease along an edge. Two equal cuts would leave a stage empty; such a
sample decodes to ``None`` and is never tried.

Both are trained by :func:`autoplace.planners.learned.ppo.ppo_update`, the update that
:func:`autoplace.planners.learned.ppo.train` runs, here on batches whose rewards arrive later, from
live steps, rather than from the simulator.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..planners.learned.ppo import PolicySample

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from ..placement import Placement
    from ..planners.learned.mars.planner import MarsNet

__all__ = ["model_policy", "planner_network", "recentre", "centred_logits", "CutPolicy", "POLICIES"]

POLICIES = ("auto", "mars", "eagle", "independent")


def planner_network(plan: "Placement") -> tuple["MarsNet | None", str]:
    """The trained network the learned planner that made ``plan`` placed with, and a note:
    ``(None, why)`` when there is none (a heuristic's plan, or Mars with no weights)."""
    if plan.planner != "mars":
        return None, f"the plan came from {plan.planner!r}, which has no network to start from"
    from ..planners.learned.mars.planner import load_net, load_pretrained

    weights = plan.meta.get("weights", "shipped")
    if not isinstance(weights, str) or weights.startswith("none"):
        return None, "Mars placed with an untrained network (no weights to start from)"
    tuned = plan.meta.get("tuned_weights")
    if isinstance(tuned, str) and Path(tuned).exists():  # fine-tuned: the network as training left it
        return load_net(tuned), f"Mars's fine-tuned network ({tuned}, from {weights} weights)"
    net = load_pretrained(None if weights == "shipped" else weights)
    gone = " (its fine-tuned copy is no longer on disk: its starting weights)" if "updates" in plan.meta else ""
    return net, f"Mars's own network ({weights} weights){gone}"


def _eagle_network(plan: "Placement | None", graph: "OpGraph", cluster: "Cluster",
                   cost: "CostModel | None") -> tuple[Any, str]:
    """The network the EAGLE planner trained for ``plan`` (``meta["tuned_weights"]``), and a
    note; ``(None, note)`` for a fresh EAGLE network when there is none or it does not load."""
    if plan is None or plan.planner != "eagle":
        return None, "a fresh EAGLE network"
    path = plan.meta.get("tuned_weights")
    if not isinstance(path, str) or not Path(path).exists():
        return None, "a fresh EAGLE network (the plan's trained network is not on disk)"
    from ..planners.learned.eagle.weights import load_policy

    try:
        return load_policy(path, graph, cluster, cost), f"EAGLE's trained network ({path})"
    except ValueError as e:
        return None, f"a fresh EAGLE network ({str(e)[:160]})"


def centred_logits(device_of_node: np.ndarray, num_devices: int, moves: float) -> np.ndarray:
    """(N, D) logits giving each op's current device probability ``1 - moves / N`` and the
    other devices the rest, equally."""
    n = len(device_of_node)
    out = np.zeros((n, num_devices), dtype=np.float32)
    if num_devices == 1:
        return out
    stay = min(max(1.0 - moves / max(n, 1), 0.5), 0.999)
    out[:] = math.log((1.0 - stay) / (num_devices - 1))
    out[np.arange(n), np.asarray(device_of_node, dtype=np.int64)] = math.log(stay)
    return out


def _check_protocol(policy: Any, n: int, d: int) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        s = policy.sample(2, gen)
    cands = policy.decode(s.actions)
    if len(cands) != 2 or any(np.asarray(c).shape != (n,) for c in cands):
        raise ValueError("the policy's decode() does not give one device per op")
    if any(np.asarray(c).min() < 0 or np.asarray(c).max() >= d for c in cands):
        raise ValueError("the policy samples device indices out of range")


def model_policy(kind: str, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None",
                 device_of_node: np.ndarray, *, seed: int, perturb_ops: float,
                 planned: "Placement | None" = None) -> tuple[Any, str, str]:
    """(policy, its name, a note on why it was chosen) for model-parallel fine-tuning;
    ``planned``: the plan being tuned (its planner's network is the ``"mars"`` policy)."""
    if kind not in POLICIES:
        raise ValueError(f"policy is {kind!r}; use one of {POLICIES}")
    note = ""
    if kind == "mars" or (kind == "auto" and planned is not None and planned.planner == "mars"):
        from ..planners.learned.mars.planner import MarsPolicy

        net, why = planner_network(planned) if planned is not None else (None, "no plan was given")
        if net is not None:
            pol = MarsPolicy(net, graph, cluster, cost)
            pol.eval()  # as the planner samples it
            _check_protocol(pol, graph.num_nodes, cluster.num_devices)
            return pol, "mars", why
        if kind == "mars":
            raise ValueError(f"policy 'mars' needs a plan made by the Mars planner with weights: {why}")
        note = f"{why}; "
    if kind in ("auto", "eagle"):
        try:
            from ..planners.learned.eagle.planner import EagleConfig, build_policy, center

            cfg = EagleConfig(warm_op_moves=max(perturb_ops / 2, 0.5), warm_group_moves=max(perturb_ops, 1.0))
            pol, why = _eagle_network(planned, graph, cluster, cost)
            if pol is None:
                pol = build_policy(graph, cluster, cost, cfg, seed)
            center(pol, np.asarray(device_of_node), cfg)
            _check_protocol(pol, graph.num_nodes, cluster.num_devices)
            pol.__dict__["_online_eagle_config"] = cfg
            return pol, "eagle", f"{why}, centred on the plan (warm start)"
        except Exception as e:  # the learned planner is optional here: fall back, say why
            if kind == "eagle":
                raise
            note = f"EAGLE policy not usable ({type(e).__name__}: {str(e)[:120]}); "
    from ..planners.learned.ppo import IndependentPolicy

    pol = IndependentPolicy(graph.num_nodes, cluster.num_devices,
                            init_logits=centred_logits(device_of_node, cluster.num_devices, perturb_ops))
    return pol, "independent", note + f"independent per-op policy centred on the plan (~{perturb_ops:g} ops moved)"


def recentre(policy: Any, name: str, device_of_node: np.ndarray, *, perturb_ops: float) -> None:
    """Centre ``policy`` on ``device_of_node`` again (after a new best was measured)."""
    if name == "eagle":
        from ..planners.learned.eagle.planner import center

        center(policy, np.asarray(device_of_node), policy.__dict__["_online_eagle_config"])
    elif name == "independent":
        with torch.no_grad():
            policy.logits.copy_(torch.from_numpy(centred_logits(device_of_node, policy.logits.shape[1], perturb_ops)))
    elif isinstance(policy, CutPolicy):
        policy.centre(device_of_node)


class CutPolicy(nn.Module):
    """Where to cut a chain of ``num_ops`` ops (topological order) into ``num_stages`` stages.

    Actions: an ``(n, S-1)`` long tensor, one cut position in ``1..N-1`` per categorical (cut
    ``c`` starts a new stage at op ``c``). Candidates: ``(stage_of_node, *rest)`` with ``rest``
    the fixed part (stage devices, micro-batches, schedule), or None when two cuts coincide
    (an empty stage).
    """

    def __init__(self, num_ops: int, num_stages: int, *, rest: tuple[Any, ...] = (), start: np.ndarray | None = None,
                 spread: float = 3.0) -> None:
        super().__init__()
        if num_stages < 2 or num_ops < num_stages:
            raise ValueError(f"CutPolicy needs 2 <= stages <= ops; got {num_stages} stages of {num_ops} ops")
        self.num_ops, self.num_stages, self.spread = num_ops, num_stages, float(spread)
        self.rest = tuple(rest)
        self.logits = nn.Parameter(torch.zeros(num_stages - 1, num_ops - 1))
        if start is not None:
            self.centre(start)

    def cuts_of(self, stage_of_node: np.ndarray) -> list[int]:
        """The cut positions of a stage assignment (first op of each stage after the first)."""
        st = np.asarray(stage_of_node)
        return [int(np.argmax(st >= s)) for s in range(1, self.num_stages)]

    def centre(self, stage_of_node: np.ndarray) -> None:
        """Logits peaked at the cuts of ``stage_of_node``, falling off over ``spread`` ops."""
        pos = torch.arange(1, self.num_ops, dtype=torch.float32)
        with torch.no_grad():
            for j, c in enumerate(self.cuts_of(stage_of_node)):
                self.logits[j] = -((pos - c).abs() / self.spread)

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> PolicySample:
        probs = torch.softmax(self.logits, dim=-1)
        if greedy:
            idx = probs.argmax(-1).expand(n, -1).clone()
        else:
            idx = torch.multinomial(probs, n, replacement=True, generator=generator).T.contiguous()
        actions = idx + 1
        lp, ent = self.score(actions)
        return PolicySample(actions, lp, ent)

    def score(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = torch.distributions.Categorical(logits=self.logits)
        return d.log_prob(actions - 1).sum(-1), d.entropy().sum().expand(actions.shape[0])

    def decode(self, actions: torch.Tensor) -> list[tuple[Any, ...] | None]:
        out: list[tuple[Any, ...] | None] = []
        for row in actions.cpu().numpy():
            cuts = sorted(int(c) for c in row)
            if len(set(cuts)) < len(cuts):
                out.append(None)
                continue
            st = np.searchsorted(np.array(cuts), np.arange(self.num_ops), side="right").astype(np.int64)
            out.append((st, *self.rest))
        return out


