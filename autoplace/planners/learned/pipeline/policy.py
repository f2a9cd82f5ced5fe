"""The pipeline policy network: stage count, devices per stage, stay/open per op, micro-batches
and schedule, sampled in that order (the action space is :mod:`.pipeline_space`).

Network (hidden size ``H``, 64 by default):

- **Op encoder**: op features (``autoplace.planners.learned.features.node_features``) -> Linear(F, H) ->
  ReLU, then ``layers`` residual message-passing rounds (GraphSAGE-style, Hamilton et al. 2017:
  ``h <- h + ReLU(W [h, mean over predecessors, mean over successors])``) -> ``h_i`` (H). A
  recurrent net over the topological order (the Mirhoseini et al. placer) was the first
  choice, but on the 2 shared CPU cores this runs on its forward and backward pass over NASNet's
  1,251 ops took 1.8-3.1 s against 0.1-0.2 s for three message-passing rounds (hidden 64), and
  PPO runs it for every minibatch. The decoding context below carries the global position (how
  full the op's stage is), so the encoder only needs the neighbourhood.
- **Open head**: ``logit_i = u(h_i) + b_i + v(h_i) . ctx_i`` (ctx: the 5 numbers of the
  decoding context, above all how full the op's stage is against its balanced share). ``u``
  starts at -3 and ``v`` at +8 on "fill after this op - 1", so the untrained policy already
  cuts near balanced loads and training moves the cuts.
- **Summary** ``z = MLP([mean_i h_i, max_i h_i, cluster/graph summary])`` (H).
- **Count head**: ``MLP([z, S / D, log2 S / 6, 1 / S])`` per stage count ``S`` (so the same weights
  serve every cluster size: what pretraining carries across graphs and clusters).
- **Device head**: ``logit(d, s | S) = MLP([z, device_d, stage_s|S]) + w * |pos_d - pos_s| S`` for
  stage ``s`` of ``S``, and ``MLP_u([z, device_d])`` for leaving ``d`` unused (device features:
  relative speed, memory, host, position; stage features: position, count). ``w`` starts at -3:
  contiguous device runs per stage (host-aligned) are the prior.
- **Micro-batch head**: ``MLP([z, stages used, widest replicas, log2 M])`` per allowed option.
- **Schedule head**: ``MLP([z, stages used, widest replicas, log2 M])`` -> 2 logits.
- **Per-graph tables** added to the logits: ``b_i`` per op, one per (S, device, choice), one per
  micro-batch option, one per stage count. The policy is fine-tuned for one graph on one
  cluster, so these let imitation and PPO move a single decision without going through the
  network; they enter times ``table_scale`` (10 during the imitation warm start, then folded to
  1). The rest (:data:`SHARED`) is the network that :meth:`PipelinePolicy.shared_state` saves
  and pretraining (:mod:`.pretrain`) fits across graphs and clusters.

Exploration: all logits are divided by ``temperature`` (raised by the planner when a sample's
entropy falls under its floor), and each group of decisions mixes ``explore`` of uniform
probability over its allowed choices into the policy's (per device ``explore / D``, per op
``explore / N``); log-probabilities and entropies are those of the mixture.

``sample`` runs the encoder once for all ``n`` samples; the stay/open walk is compiled
(:func:`~.pipeline_space.walk`); ``score`` replays the stored bits to rebuild every decision's
context and mask, so the log-probabilities it returns are exactly those ``sample`` drew from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from .space import (CONTEXT, MODE_REPLAY, MODE_SAMPLE, PipelineActions, PipelinePlan, PipelineSpace,
                             device_mask, walk)
from ..ppo import PolicySample

__all__ = ["PipelinePolicy", "device_features", "summary_features", "SHARED", "TABLES"]

SHARED = ("inp", "layers", "u", "v", "z", "count_mlp", "dev_head", "unused_head", "dist_w", "micro_head", "sched_head")
"""The modules and parameters whose shapes do not depend on the graph or the cluster: the
network that pretrained weights hold."""
TABLES = ("op_bias", "dev_bias", "micro_bias", "count_bias")
"""The per-graph tables (never saved: their shapes are the graph's and the cluster's)."""

_NEG = -1e9
_BIAS_SCALE = 10.0  # per-graph tables start this many times faster than the network (see table_scale)


def device_features(space: PipelineSpace, cluster: Any) -> np.ndarray:
    """(D, 6) per device: relative speed, memory / largest, host / hosts, bandwidth inside its host
    and to other hosts (/ the fastest link), position in the cluster order."""
    d = cluster.num_devices
    hosts = np.asarray(cluster.hosts, dtype=float)
    bw = np.asarray(cluster.bandwidth_matrix, dtype=float).copy()
    np.fill_diagonal(bw, np.nan)
    top = np.nanmax(bw) if d > 1 else 1.0
    same = hosts[:, None] == hosts[None, :]
    with np.errstate(invalid="ignore"):
        intra = np.array([np.nanmean(np.where(same[i], bw[i], np.nan)) if same[i].sum() > 1 else top
                          for i in range(d)])
        inter = np.array([np.nanmean(np.where(~same[i], bw[i], np.nan)) if (~same[i]).any() else top
                          for i in range(d)])
    mem = np.asarray(cluster.memory, dtype=float)
    return np.stack([space.speed, mem / mem.max(), hosts / max(hosts.max(), 1.0), intra / top, inter / top,
                     (np.arange(d) + 0.5) / d], axis=1).astype(np.float32)


def summary_features(space: PipelineSpace, sim: Any, cost: Any) -> np.ndarray:
    """(8,) the graph against the cluster: model copy and activations against the smallest memory,
    all-reduce of all parameters over the slowest link against the compute of one device, device
    count, op count, batch size, hosts, slowest/fastest device."""
    g = sim.graph
    cap = float(np.min(sim.capacity))
    static = float(g.param_bytes.sum()) * (2.0 + float(cost.optimizer_state_factor))
    act = float(g.out_bytes.sum())
    inv = float(np.max(sim.inv_bw)) if sim.inv_bw.size else 0.0
    compute = float(space.work.sum())
    ar = 2.0 * float(g.param_bytes.sum()) * inv
    hosts = len(set(sim.cluster.hosts))
    return np.array([math.log1p(static / cap), math.log1p(act / cap), math.log1p(ar / max(compute, 1e-30)),
                     math.log2(space.num_devices) / 6.0, math.log2(space.num_nodes) / 12.0,
                     math.log2(space.batch_size) / 10.0, hosts / space.num_devices, float(space.speed.min())],
                    dtype=np.float32)


def _mlp(i: int, h: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, o))


def _mixed_logp(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """log of ``(1 - eps) softmax(logits) + eps x uniform over the allowed entries`` (masked entries
    hold ``_NEG`` and keep probability 0)."""
    logp = torch.log_softmax(logits, dim=-1)
    if eps <= 0:
        return logp
    allowed = logits > _NEG / 2
    k = allowed.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)
    floor = torch.where(allowed, math.log(eps) - torch.log(k), torch.full_like(logp, -math.inf))
    return torch.logaddexp(math.log1p(-eps) + logp, floor)


def _cat_sample(logits: torch.Tensor, gen: torch.Generator, greedy: bool, eps: float) -> torch.Tensor:
    if greedy:
        return logits.argmax(-1)
    probs = torch.exp(_mixed_logp(logits, eps))
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _cat_terms(logits: torch.Tensor, chosen: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probability of ``chosen`` and entropy of the (floored) masked distribution."""
    logp = _mixed_logp(logits, eps)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return logp.gather(-1, chosen[..., None]).squeeze(-1), ent


class PipelinePolicy(nn.Module):
    """The policy of :mod:`.pipeline_rl` for one graph on one cluster (see the module doc)."""

    x: torch.Tensor
    dev: torch.Tensor
    summ: torch.Tensor
    e_src: torch.Tensor
    e_dst: torch.Tensor
    inv_in: torch.Tensor
    inv_out: torch.Tensor
    opt_log: torch.Tensor
    stage_feat: torch.Tensor
    dist: torch.Tensor
    stage_ok: torch.Tensor
    count_feat: torch.Tensor

    def __init__(self, space: PipelineSpace, op_features: np.ndarray, dev_features: np.ndarray,
                 summary: np.ndarray, *, hidden: int = 64, layers: int = 3, explore: float = 0.1,
                 seed: int = 0) -> None:
        super().__init__()
        x = np.asarray(op_features, dtype=np.float32)
        if x.ndim != 2 or x.shape[0] != space.num_nodes:
            raise ValueError(f"op_features has shape {x.shape}; it must be ({space.num_nodes}, F): one row per op")
        self.space = space
        self.temperature = 1.0
        """every logit is divided by this (the planner raises it to keep exploring, see pipeline_rl)."""
        if not 0 <= explore < 1:
            raise ValueError(f"explore is {explore}; it must be in [0, 1)")
        self.explore = float(explore)
        """exploration floor: each group of decisions (stage count, devices, stay/open bits,
        micro-batches, schedule) mixes about this much probability, spread uniformly over the
        allowed choices (per device ``explore / D``, per op ``explore / N``), into the policy's."""
        self.table_scale = _BIAS_SCALE
        """the per-graph tables enter the logits times this: they move that much faster than the
        network under Adam (for imitation); :meth:`fold_tables` sets it to 1."""
        h = int(hidden)
        self.register_buffer("x", torch.from_numpy(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)))
        self.register_buffer("dev", torch.from_numpy(np.asarray(dev_features, dtype=np.float32)))
        self.register_buffer("summ", torch.from_numpy(np.asarray(summary, dtype=np.float32)))
        n = space.num_nodes
        dst = np.repeat(np.arange(n), np.diff(space.pred_ptr))  # edge q: pred_idx[q] -> dst[q]
        self.register_buffer("e_src", torch.from_numpy(space.pred_idx.astype(np.int64)))
        self.register_buffer("e_dst", torch.from_numpy(dst.astype(np.int64)))
        indeg = np.maximum(np.diff(space.pred_ptr), 1).astype(np.float32)
        outdeg = np.maximum(np.bincount(space.pred_idx, minlength=n), 1).astype(np.float32)
        self.register_buffer("inv_in", torch.from_numpy(1.0 / indeg)[:, None])
        self.register_buffer("inv_out", torch.from_numpy(1.0 / outdeg)[:, None])
        s_max, d = space.max_stages, space.num_devices
        self.register_buffer("opt_log", torch.log2(torch.tensor(space.microbatch_options, dtype=torch.float32)) / 5.0)
        # stage features for every (S, s): position, next position, 1/S, S / S_max; distance prior
        big_s = torch.arange(1, s_max + 1, dtype=torch.float32)[:, None].expand(s_max, s_max)
        small_s = torch.arange(s_max, dtype=torch.float32)[None, :].expand(s_max, s_max)
        self.register_buffer("stage_feat", torch.stack([small_s / big_s, (small_s + 1) / big_s, 1.0 / big_s,
                                                        big_s / s_max], dim=-1))
        pos_d = (torch.arange(d, dtype=torch.float32) + 0.5) / d
        pos_s = (small_s + 0.5) / big_s
        self.register_buffer("dist", (pos_d[None, :, None] - pos_s[:, None, :]).abs() * big_s[:, None, :])
        self.register_buffer("stage_ok", small_s < big_s)  # (S, s): s exists when S stages
        counts = torch.arange(1, s_max + 1, dtype=torch.float32)
        self.register_buffer("count_feat", torch.stack([counts / d, torch.log2(counts) / 6.0, 1.0 / counts], dim=-1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.inp = nn.Linear(x.shape[1], h)
            self.layers = nn.ModuleList(nn.Linear(3 * h, h) for _ in range(layers))
            self.u = nn.Linear(h, 1)
            self.v = nn.Linear(h, CONTEXT)
            self.z = _mlp(2 * h + self.summ.shape[0], h, h)
            self.count_mlp = _mlp(h + 3, h, 1)
            self.count_bias = nn.Parameter(torch.zeros(s_max))
            self.dev_head = _mlp(h + self.dev.shape[1] + 4, h, 1)
            self.unused_head = _mlp(h + self.dev.shape[1], h, 1)
            self.dist_w = nn.Parameter(torch.tensor(-3.0))
            # per-graph tables next to the network: what imitation and fine-tuning adjust fastest
            self.op_bias = nn.Parameter(torch.zeros(n))
            self.dev_bias = nn.Parameter(torch.zeros(s_max, d, s_max + 1))
            self.micro_bias = nn.Parameter(torch.zeros(len(space.microbatch_options)))
            self.micro_head = _mlp(h + 3, h, 1)
            self.sched_head = _mlp(h + 3, h, 2)
            count_last = self.count_mlp[-1]
            assert isinstance(count_last, nn.Linear)
            for lin in (self.u, self.v, count_last):
                nn.init.normal_(lin.weight, std=0.01)
            with torch.no_grad():
                self.u.bias.fill_(-3.0)
                self.v.bias.zero_()
                self.v.bias[1] = 8.0
                count_last.bias.zero_()
                last = self.unused_head[-1]
                assert isinstance(last, nn.Linear)
                last.bias.fill_(-2.0)

    # ---- the shared forward pass ----------------------------------------------------------------

    def _encode(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u (N,), v (N, K), z (H,), device logits (S_max, D, S_max + 1), count logits (S_max,)."""
        hseq = torch.relu(self.inp(self.x))
        for layer in self.layers:
            from_pred = torch.zeros_like(hseq).index_add_(0, self.e_dst, hseq[self.e_src]) * self.inv_in
            from_succ = torch.zeros_like(hseq).index_add_(0, self.e_src, hseq[self.e_dst]) * self.inv_out
            hseq = hseq + torch.relu(layer(torch.cat([hseq, from_pred, from_succ], dim=-1)))
        u = self.u(hseq).squeeze(-1) + self.table_scale * self.op_bias
        v = self.v(hseq)
        z = self.z(torch.cat([hseq.mean(0), hseq.max(0).values, self.summ]))
        s_max, d = self.space.max_stages, self.space.num_devices
        zd = torch.cat([z.expand(d, -1), self.dev], dim=-1)  # (D, H + Fd)
        unused = self.unused_head(zd).squeeze(-1)  # (D,)
        pair = torch.cat([zd[None, :, None, :].expand(s_max, d, s_max, -1),
                          self.stage_feat[:, None, :, :].expand(s_max, d, s_max, -1)], dim=-1)
        st = self.dev_head(pair).squeeze(-1) + self.dist_w * self.dist  # (S, D, s)
        st = torch.where(self.stage_ok[:, None, :], st, torch.full_like(st, _NEG))
        dev_logits = torch.cat([unused[None, :, None].expand(s_max, d, 1), st], dim=-1) + self.table_scale * self.dev_bias
        count = self.count_mlp(torch.cat([z.expand(s_max, -1), self.count_feat], dim=-1)).squeeze(-1)
        count = count + self.table_scale * self.count_bias
        t = self.temperature
        return u / t, v / t, z, dev_logits / t, count / t

    def _tail_logits(self, z: torch.Tensor, used: torch.Tensor, widest: torch.Tensor,
                     micro_ok: torch.Tensor) -> torch.Tensor:
        n, o = micro_ok.shape
        s_max, d = self.space.max_stages, self.space.num_devices
        feats = torch.stack([used.float() / s_max, widest.float() / d], dim=-1)  # (n, 2)
        inp = torch.cat([z.expand(n, o, -1), feats[:, None, :].expand(n, o, 2),
                         self.opt_log[None, :, None].expand(n, o, 1)], dim=-1)
        logits = (self.micro_head(inp).squeeze(-1) + self.table_scale * self.micro_bias) / self.temperature
        return torch.where(micro_ok, logits, torch.full_like(logits, _NEG))

    def _sched_logits(self, z: torch.Tensor, used: torch.Tensor, widest: torch.Tensor,
                      micro: torch.Tensor) -> torch.Tensor:
        n = used.shape[0]
        s_max, d = self.space.max_stages, self.space.num_devices
        feats = torch.stack([used.float() / s_max, widest.float() / d, self.opt_log[micro]], dim=-1)
        return self.sched_head(torch.cat([z.expand(n, -1), feats], dim=-1)) / self.temperature

    # ---- the policy protocol --------------------------------------------------------------------

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> PolicySample:
        sp = self.space
        u, v, z, dev_logits, count_logits = self._encode()
        e, e_dev, e_op = self._floors()
        count = _cat_sample(count_logits.expand(n, -1), generator, greedy, e)
        per = dev_logits[count]  # (n, D, S_max + 1)
        devices = torch.zeros(n, sp.num_devices, dtype=torch.int64)
        counts = np.zeros((n, sp.max_stages), dtype=np.int64)
        cnt_np = count.numpy()
        for k in range(sp.num_devices):
            ok = torch.from_numpy(device_mask(counts, cnt_np + 1, sp.num_devices - k, sp.batch_size))
            c = _cat_sample(torch.where(ok, per[:, k], torch.full_like(per[:, k], _NEG)), generator, greedy, e_dev)
            devices[:, k] = c
            cn = c.numpy()
            rows = np.nonzero(cn > 0)[0]
            counts[rows, cn[rows] - 1] += 1
        dev_np = devices.numpy()
        share = sp.shares(dev_np, cnt_np)
        uniforms = (np.full((n, sp.num_nodes), 0.5) if greedy else
                    torch.rand(n, sp.num_nodes, generator=generator, dtype=torch.float64).numpy())
        opens, stage, _, _ = walk(MODE_SAMPLE, _Z2I, u.detach().double().numpy(), v.detach().double().numpy(),
                                  uniforms, _Z2I, cnt_np + 1, share, sp.work, sp.pred_ptr, sp.pred_idx, False, e_op)
        used = stage.max(axis=1) + 1
        widest = sp.widest(dev_np, used)
        micro_ok = torch.from_numpy(sp.micro_mask(widest))
        micro = _cat_sample(self._tail_logits(z, torch.from_numpy(used), torch.from_numpy(widest), micro_ok),
                            generator, greedy, e)
        sched = _cat_sample(self._sched_logits(z, torch.from_numpy(used), torch.from_numpy(widest), micro),
                            generator, greedy, e)
        actions = (count, devices, torch.from_numpy(opens), micro, sched)
        lp, ent = self.score(actions, _encoded=(u, v, z, dev_logits, count_logits))
        return PolicySample(actions, lp, ent)

    def score(self, actions: Any, _encoded: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        sp = self.space
        count, devices, opens, micro, sched = (torch.as_tensor(a) for a in actions)
        u, v, z, dev_logits, count_logits = self._encode() if _encoded is None else _encoded
        n = count.shape[0]
        e, e_dev, e_op = self._floors()
        lp, ent = _cat_terms(count_logits.expand(n, -1), count, e)
        per = dev_logits[count]  # (n, D, S_max + 1)
        cnt_np, dev_np = count.numpy(), devices.numpy()
        counts = np.zeros((n, sp.max_stages), dtype=np.int64)
        masks = []
        for k in range(sp.num_devices):
            masks.append(device_mask(counts, cnt_np + 1, sp.num_devices - k, sp.batch_size))
            cn = dev_np[:, k]
            rows = np.nonzero(cn > 0)[0]
            counts[rows, cn[rows] - 1] += 1
        ok = torch.from_numpy(np.stack(masks, axis=1))  # (n, D, S_max + 1)
        a, b = _cat_terms(torch.where(ok, per, torch.full_like(per, _NEG)), devices, e_dev)
        lp, ent = lp + a.sum(-1), ent + b.sum(-1)
        share = sp.shares(dev_np, cnt_np)
        _, stage, can, ctx = walk(MODE_REPLAY, np.ascontiguousarray(opens.numpy(), dtype=np.int64), _Z1, _Z2, _Z2,
                                  _Z2I, cnt_np + 1, share, sp.work, sp.pred_ptr, sp.pred_idx, True, e_op)
        logit = u[None, :] + (v[None, :, :] * torch.from_numpy(ctx).float()).sum(-1)  # (n, N)
        canm = torch.from_numpy(can)
        lp1, lp0 = nn.functional.logsigmoid(logit), nn.functional.logsigmoid(-logit)
        if e_op > 0:
            half = math.log(e_op / 2)
            lp1 = torch.logaddexp(math.log1p(-e_op) + lp1, torch.full_like(lp1, half))
            lp0 = torch.logaddexp(math.log1p(-e_op) + lp0, torch.full_like(lp0, half))
        lp_op = torch.where(opens.bool(), lp1, lp0)
        ent_op = -(lp1.exp() * lp1 + lp0.exp() * lp0)
        zero = torch.zeros_like(logit)
        lp = lp + torch.where(canm, lp_op, zero).sum(-1)
        ent = ent + torch.where(canm, ent_op, zero).sum(-1)
        used = torch.from_numpy(stage.max(axis=1) + 1)
        widest_np = sp.widest(dev_np, used.numpy())
        widest = torch.from_numpy(widest_np)
        micro_ok = torch.from_numpy(sp.micro_mask(widest_np))
        a, b = _cat_terms(self._tail_logits(z, used, widest, micro_ok), micro, e)
        lp, ent = lp + a, ent + b
        a, b = _cat_terms(self._sched_logits(z, used, widest, micro), sched, e)
        return lp + a, ent + b

    def decode(self, actions: Any) -> list[PipelinePlan]:
        return self.space.decode(as_numpy(actions))

    def _floors(self) -> tuple[float, float, float]:
        """Exploration floors: per whole-plan choice, per device, per op."""
        return self.explore, self.explore / self.space.num_devices, self.explore / self.space.num_nodes

    def fold_tables(self) -> None:
        """Keep the logits, but let the per-graph tables learn at the network's pace from now on."""
        with torch.no_grad():
            for t in (self.op_bias, self.dev_bias, self.micro_bias, self.count_bias):
                t.mul_(self.table_scale)
        self.table_scale = 1.0

    def shared_state(self) -> dict[str, torch.Tensor]:
        """The network's parameters that carry across graphs and clusters (:data:`SHARED`)."""
        return {k: v.detach().clone() for k, v in self.state_dict().items() if k.split(".")[0] in SHARED}

    def load_shared(self, state: dict[str, torch.Tensor]) -> None:
        """Load :meth:`shared_state` of another policy (pretrained weights); raises ValueError naming
        the first missing or mis-shaped entry (weights saved with another hidden size or feature set)."""
        mine = self.shared_state()
        for k, v in mine.items():
            if k not in state or tuple(state[k].shape) != tuple(v.shape):
                got = tuple(state[k].shape) if k in state else "missing"
                raise ValueError(f"pretrained pipeline weights: {k} is {got}, this policy needs {tuple(v.shape)}; "
                                 "load weights made with the same hidden size and features, or none")
        self.load_state_dict({k: state[k] for k in mine}, strict=False)

    def tie(self, other: "PipelinePolicy") -> None:
        """Use ``other``'s network (:data:`SHARED`, the same objects): pretraining fits one network
        through many graphs' policies."""
        for name in SHARED:
            setattr(self, name, getattr(other, name))

    def actions_of(self, plan: PipelinePlan) -> tuple[torch.Tensor, ...]:
        """The actions closest to ``plan`` (:meth:`PipelineSpace.encode`), as tensors."""
        return tuple(torch.from_numpy(a) for a in self.space.encode(plan))


def as_numpy(actions: Any) -> PipelineActions:
    return PipelineActions(*(np.asarray(torch.as_tensor(a).numpy(), dtype=np.int64) for a in actions))


_Z1 = np.zeros(0)
_Z2 = np.zeros((0, 0))
_Z2I = np.zeros((0, 0), dtype=np.int64)
