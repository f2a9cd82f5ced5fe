"""Mars: a pre-trained graph encoder and a segment-level sequence-to-sequence placer.

Lan, Chen, Li, "Accelerated Device Placement Optimization with Contrastive Learning", ICPP
2021. Mars embeds every op with a GraphSAGE-style GNN pre-trained by Deep Graph Infomax
(:mod:`autoplace.planners.learned.mars.encoders`, :mod:`autoplace.planners.learned.pretrain`), then places the
ops in topological order, cut into segments, with a sequence-to-sequence network, trained
with PPO (:mod:`autoplace.planners.learned.ppo`). What this module computes, for ``N`` ops in
segments of ``S`` (``K = ceil(N / S)`` segments), ``D`` devices, width ``H``:

    z        = GNN(x, edges)                                   (N, H)  op embeddings
    E_k      = BiLSTM(z[kS : (k+1)S])                          (S, H)  segment k's encoder
    u_d      = MLP(device_features_d)                          (D, H)  device embeddings
    h_i, c_i = LSTM([z_i ; u_{a_{i-1}}], (h_{i-1}, c_{i-1}))           decoder, one op a step;
                                                                       its state runs on from
                                                                       one segment to the next
    ctx_i    = sum_t softmax_t(h_i . W_a E_k[t] / sqrt H) E_k[t]       attention within op i's
                                                                       segment k
    q_i      = tanh(W_q [h_i ; ctx_i] + b_q)
    logit_id = q_i . W_k u_d / sqrt H + (W_c q_i + b_c) . f_id         a pointer over devices
    a_i      ~ softmax_d(logit_i)

``f_id`` are the placement-state features of op ``i`` on device ``d`` given the devices
chosen for ops ``0..i-1`` (:mod:`autoplace.planners.learned.mars.decoder`: earliest finish time, input
transfer time, memory after placing, load, ...). ``u_{a_{-1}}`` is a learned start vector.
Devices the op would overflow (by the simulator's memory sum) get ``MASK`` added to their
logit while another device has room, so samples fit by construction.

Departures from the paper, and why:

- Devices are not output classes. Mars has one softmax output per device, so a network is
  tied to one device count. Here a device is chosen by scoring each device from its own
  features (a pointer network, Vinyals et al., NeurIPS 2015): static ones (speed, memory,
  link bandwidth) and the state features above, so one set of weights places on any cluster,
  and identical devices are told apart by what the partial placement has put on them.
- The attention context does not feed back into the decoder's input ("input feeding"): the
  decoder reads only the op embeddings and the previous choice, so a stored placement is
  re-scored by one ``nn.LSTM`` call over the whole sequence instead of ``N`` steps.
- The pointer starts from a prior, not from zero: the weights of the state features begin at
  :data:`PRIOR` (earlier estimated finish, less transfer, no memory overflow, where the inputs
  are), the other pointer weights near zero. An untrained network then decodes greedily
  about as m-ETF does instead of uniformly at random (whose placements are several times
  slower than any heuristic), and PPO starts from there.
- The GNN is fine-tuned with the placer by PPO (its gradients flow from the placer's loss), as
  in the paper; pretraining also runs PPO across many (graph, cluster) pairs of the corpus so
  the shipped weights place graphs zero-shot (:mod:`autoplace.planners.learned.pretrain`).

The planner ``"mars"`` (model mode): with ``budget_s=None`` it loads the shipped weights
(``autoplace/weights/mars.pt``), decodes greedily, draws ``zero_shot_samples`` samples and a
local search (``MarsConfig.search``) polishes the best until the plan has taken
``polish_s_per_kop`` (:mod:`.polish`); with ``budget_s=N`` it fine-tunes a copy of the network
with PPO for about ``(1 - refine_share) N`` seconds and the same search polishes the best
placement for the rest; with ``MarsConfig.expert`` it runs expert iteration instead
(:mod:`autoplace.planners.learned.expert`). It returns the best placement that fits among its
samples, the polished one and the heuristic seeds (:class:`~autoplace.planners.learned.env.PlacementEnv`);
``meta["policy_step_time_s"]`` is the policy's own best, before any post-processing.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import torch
from torch import Tensor, nn

from autoplace.planners.registry import register
from .encoders import SAGEEncoder
from .decoder import DEVICE_FEATURES, MASK, STATE_FEATURES, StateTracker, device_features
from ... import budget as _budget
from .polish import final_step, polish_budget_s, polish_zero_shot
from .tuned import tuned_dir, tuned_path
from ..critical import LOCAL_SEARCHES, local_search
from ..expert import ExpertConfig, expert_iteration
from ..ppo import PPOConfig, train
from ..run import REPORT_KEY, LearnedReport, LearnedRun

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.placement import Placement, PlacementMeta
    from ..ppo import PolicySample

__all__ = ["MarsNet", "MarsPolicy", "MarsConfig", "MarsPlanner", "new_net", "save_net", "load_net", "load_pretrained",
           "WEIGHTS_PATH", "keep_tuned", "tuned_dir", "PRIOR"]

_OVER = STATE_FEATURES.index("over_memory")
WEIGHTS_PATH = Path(__file__).resolve().parents[3] / "weights" / "mars.pt"
"""The shipped pretrained weights (made by ``python -m autoplace.planners.learned.pretrain``)."""

PRIOR: dict[str, float] = {"log_rel_finish": -4.0, "log_comm": -1.0, "over_memory": -4.0, "input_bytes_here": 1.0}
"""Initial weights of the state features in the device logits (the rest start at 0)."""


class MarsNet(nn.Module):
    """The parameters of Mars: GNN encoder, segment encoder, device encoder, decoder, pointer.

    ``node_in`` / ``edge_in``: widths of :func:`autoplace.planners.learned.features.to_pyg`'s ``x`` and
    ``edge_attr``; ``hidden``: H; ``gnn_layers``: GraphSAGE layers; ``segment``: S, ops per
    segment.
    """

    def __init__(self, node_in: int, edge_in: int, *, hidden: int = 64, gnn_layers: int = 3,
                 segment: int = 64) -> None:
        super().__init__()
        if hidden % 2 or hidden < 2:
            raise ValueError(f"MarsNet hidden is {hidden}; it must be an even number >= 2 (the segment "
                             "encoder is a bidirectional LSTM of hidden/2 per direction)")
        if segment < 1:
            raise ValueError(f"MarsNet segment is {segment}; it must be >= 1 op")
        self.node_in, self.edge_in, self.hidden, self.gnn_layers, self.segment = (
            node_in, edge_in, hidden, gnn_layers, segment)
        self.encoder = SAGEEncoder(node_in, hidden, edge_channels=edge_in, num_layers=gnn_layers)
        self.segment_encoder = nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)
        self.device_encoder = nn.Sequential(nn.Linear(len(DEVICE_FEATURES), hidden), nn.ReLU(),
                                            nn.Linear(hidden, hidden))
        self.decoder = nn.LSTM(2 * hidden, hidden, batch_first=True)
        self.start = nn.Parameter(torch.zeros(hidden))
        self.attn = nn.Linear(hidden, hidden, bias=False)
        self.mix = nn.Linear(2 * hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.coef = nn.Linear(hidden, len(STATE_FEATURES))
        with torch.no_grad():  # start near earliest-finish-time list scheduling (see the module doc)
            self.coef.weight.mul_(0.1)
            self.key.weight.mul_(0.1)
            self.coef.bias.copy_(torch.tensor([PRIOR.get(f, 0.0) for f in STATE_FEATURES]))

    def config(self) -> dict[str, int]:
        """Constructor arguments (saved with the weights)."""
        return {"node_in": self.node_in, "edge_in": self.edge_in, "hidden": self.hidden,
                "gnn_layers": self.gnn_layers, "segment": self.segment}


@dataclass
class _Context:
    """Everything of one forward pass that does not depend on the actions."""

    z: Tensor  # (N, H) op embeddings
    enc: Tensor  # (K, S, H) segment encoder outputs (zero padded)
    enc_keys: Tensor  # (K, S, H) W_a E
    mask: Tensor  # (K, S) True where a position is padding
    dev: Tensor  # (D, H) device embeddings u
    dev_keys: Tensor  # (D, H) W_k u / sqrt(H)
    seg: int  # S


class MarsPolicy(nn.Module):
    """A :class:`MarsNet` bound to one (graph, cluster, cost): the PPO policy protocol of
    :mod:`autoplace.planners.learned.ppo` (``sample``, ``score``, ``decode``). Actions are an
    ``(n, N)`` long tensor of device indices, one row per sampled placement."""

    def __init__(self, net: MarsNet, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None) -> None:
        super().__init__()
        from autoplace.cost.analytic import CostModel
        from autoplace.planners.learned.features import edge_features, node_features

        if graph.num_nodes < 1:
            raise ValueError("Mars needs a graph with at least one op; this one is empty")
        self.net = net
        self.graph, self.cluster = graph, cluster
        self.cost = cost if cost is not None else CostModel()
        # to_pyg's tensors, without building a torch_geometric Data (importing PyG costs ~1 s cold)
        self.x = torch.from_numpy(node_features(graph, cluster, cost=self.cost))
        self.edge_index = torch.from_numpy(np.array(graph.edges.T, dtype=np.int64, order="C"))
        self.edge_attr = torch.from_numpy(edge_features(graph))
        if self.x.shape[1] != net.node_in or self.edge_attr.shape[1] != net.edge_in:
            raise ValueError(f"the network was built for {net.node_in} node and {net.edge_in} edge features; "
                             f"the graph's features have {self.x.shape[1]} and {self.edge_attr.shape[1]}: they "
                             "changed since the weights were made; retrain them (python -m autoplace.planners.learned.pretrain)")
        self.dev_x = torch.from_numpy(device_features(graph, cluster, self.cost))
        self.tracker = StateTracker(graph, cluster, self.cost)
        self.num_ops, self.num_devices = graph.num_nodes, cluster.num_devices
        self.temperature = 1.0
        """logits are divided by it (above 1: more diverse samples; sampling and scoring agree)."""

    # ---- shared pieces ------------------------------------------------------------------

    def _context(self) -> _Context:
        net, n, h = self.net, self.num_ops, self.net.hidden
        z = net.encoder(self.x, self.edge_index, self.edge_attr)
        seg = min(net.segment, n)
        k = -(-n // seg)
        padded = torch.cat([z, z.new_zeros(k * seg - n, h)]) if k * seg > n else z
        enc, _ = net.segment_encoder(padded.view(k, seg, h))
        mask = (torch.arange(k * seg) >= n).view(k, seg)
        dev = net.device_encoder(self.dev_x)
        return _Context(z, enc, net.attn(enc), mask, dev, net.key(dev) / math.sqrt(h), seg)

    def _logits(self, ctx: _Context, q: Tensor, feats: Tensor) -> Tensor:
        """Device logits from queries ``q`` (..., H) and state features ``feats`` (..., D, F),
        with the memory mask of :mod:`autoplace.planners.learned.mars.decoder`."""
        pointer = q @ ctx.dev_keys.T
        logits = pointer + (self.net.coef(q).unsqueeze(-2) * feats).sum(-1)
        over = feats[..., _OVER] != 0
        room = (~over).any(-1, keepdim=True)
        return (logits + (over & room).to(logits.dtype) * MASK) / self.temperature

    # ---- the protocol -------------------------------------------------------------------

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> "PolicySample":
        """Draw ``n`` placements op by op (``greedy``: the most likely device at every op), in
        the compiled loop :func:`autoplace.planners.learned.mars.decoder.decode`."""
        from .decoder import decode
        from ..ppo import PolicySample

        if n < 1:
            raise ValueError(f"sample(n={n}): n must be >= 1")
        shape = (n, self.num_ops, self.num_devices)
        uniforms = np.full(shape, 0.5) if greedy else \
            torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12).numpy()
        actions = np.zeros((n, self.num_ops), dtype=np.int64)
        log_prob, entropy = np.zeros(n), np.zeros(n)
        kernel: Any = decode  # a numba dispatcher
        kernel(*self._decoder_arrays(), 1.0 / self.temperature, uniforms, greedy, *self.tracker.tables(), actions,
               log_prob, entropy)
        return PolicySample(torch.from_numpy(actions), torch.from_numpy(log_prob).float(),
                            torch.from_numpy(entropy).float())

    def _decoder_arrays(self) -> tuple:
        """What :func:`~autoplace.planners.learned.mars.decoder.decode` reads, as float64 arrays; kept
        until a parameter changes (consecutive samplings share one GNN pass)."""
        net, h = self.net, self.net.hidden
        versions = tuple(p._version for p in net.parameters())
        cached = getattr(self, "_arrays", None)
        if cached is not None and cached[0] == versions:
            return cached[1]

        def arr(t: Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().numpy(), dtype=np.float64)

        w_ih, w_hh, b_ih, b_hh = (cast(Tensor, getattr(net.decoder, f"{k}_l0"))
                                  for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        with torch.no_grad():
            ctx = self._context()
            op_gates = ctx.z @ w_ih[:, :h].T + b_ih + b_hh  # (N, 4H)
            prev_gates = torch.cat([net.start.unsqueeze(0), ctx.dev]) @ w_ih[:, h:].T  # (D + 1, 4H)
            valid = (~ctx.mask).sum(1).numpy().astype(np.int64)
            out = (arr(op_gates), arr(prev_gates), arr(w_hh), arr(ctx.enc), arr(ctx.enc_keys),
                   valid, ctx.seg, arr(net.mix.weight[:, :h]), arr(net.mix.weight[:, h:]), arr(net.mix.bias),
                   arr(ctx.dev_keys), arr(net.coef.weight), arr(net.coef.bias))
        self._arrays = (versions, out)
        return out

    def score(self, actions: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probability (m,) and entropy (m,) of stored placements ``actions`` (m, N) under
        the current parameters (teacher forcing: one LSTM call over the whole sequence)."""
        logp = self.step_log_probs(actions)
        chosen = logp.gather(2, actions.unsqueeze(2)).squeeze(2).sum(1)
        entropy = -(logp.exp() * logp).sum(2).sum(1)
        return chosen, entropy

    def step_log_probs(self, actions: Tensor) -> Tensor:
        """(m, N, D) log-probabilities of every device at every op, given the devices
        ``actions`` (m, N) chose for the ops before it."""
        net, h = self.net, self.net.hidden
        m, n = actions.shape
        if n != self.num_ops:
            raise ValueError(f"actions have {n} ops per placement; this graph has {self.num_ops}")
        ctx = self._context()
        feats = torch.from_numpy(self.tracker.replay(actions.numpy())).float()  # (m, N, D, F)
        prev = torch.cat([net.start.expand(m, 1, h), ctx.dev[actions[:, :-1]]], dim=1)  # (m, N, H)
        hs, _ = net.decoder(torch.cat([ctx.z.expand(m, n, h), prev], dim=2))
        k, seg = ctx.enc.shape[0], ctx.seg
        hp = torch.cat([hs, hs.new_zeros(m, k * seg - n, h)], dim=1).view(m, k, seg, h)
        scores = torch.einsum("mksh,kth->mkst", hp, ctx.enc_keys) / math.sqrt(h)
        scores = scores.masked_fill(ctx.mask.view(1, k, 1, seg), -math.inf)
        att = torch.einsum("mkst,kth->mksh", torch.softmax(scores, dim=3), ctx.enc).reshape(m, k * seg, h)[:, :n]
        q = torch.tanh(net.mix(torch.cat([hs, att], dim=2)))
        return torch.log_softmax(self._logits(ctx, q, feats), dim=2)

    def decode(self, actions: Tensor) -> list[np.ndarray]:
        """One ``device_of_node`` array per sampled placement."""
        return [row for row in actions.numpy().astype(np.int64)]


# ---- weights -------------------------------------------------------------------------------

def new_net(**overrides: Any) -> MarsNet:
    """A freshly initialised network sized for the current feature definitions."""
    from autoplace.planners.learned.features import EDGE_FEATURE_NAMES, FEATURE_NAMES

    return MarsNet(len(FEATURE_NAMES), len(EDGE_FEATURE_NAMES), **overrides)


def save_net(net: MarsNet, path: str | Path, **extra: Any) -> None:
    """Save ``net``'s config and parameters to ``path`` (a small ``.pt`` file)."""
    torch.save({"format": "autoplace.MarsNet/1", "config": net.config(),
                "state_dict": {k: v.detach().clone() for k, v in net.state_dict().items()}, **extra}, path)


def load_net(path: str | Path) -> MarsNet:
    """A :class:`MarsNet` from a file written by :func:`save_net`."""
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != "autoplace.MarsNet/1":
        raise ValueError(f"{path} is not a Mars weights file (expected format 'autoplace.MarsNet/1'); "
                         "make one with python -m autoplace.planners.learned.pretrain --out DIR")
    net = MarsNet(**blob["config"])
    net.load_state_dict(blob["state_dict"])
    return net


@lru_cache(maxsize=4)
def _cached(path: str, mtime: float) -> MarsNet:
    return load_net(path)


def load_pretrained(path: str | Path | None = None) -> MarsNet:
    """The shipped weights (``autoplace/weights/mars.pt``) or those at ``path``, as a fresh copy
    (fine-tuning it leaves the cached one untouched). Raises FileNotFoundError when absent."""
    p = Path(path) if path is not None else WEIGHTS_PATH
    if not p.exists():
        raise FileNotFoundError(f"Mars weights not found at {p}; make them with "
                                f"python -m autoplace.planners.learned.pretrain --out {p.parent}")
    return copy.deepcopy(_cached(str(p.resolve()), p.stat().st_mtime))


# ---- the planner ---------------------------------------------------------------------------

def _default_ppo() -> PPOConfig:
    return PPOConfig(lr=3e-3, samples_per_update=16, num_minibatches=1, ent_coef=0.001)


@dataclass(frozen=True)
class MarsConfig:
    """Settings of the Mars planner (``plan(..., planner="mars", config=MarsConfig(...))``)."""

    zero_shot_samples: int = 16
    """samples drawn after the greedy decode when there is no budget."""
    refine_share: float = 0.25
    """share of a fine-tuning run (of ``budget_s``; and up to ``max_samples`` more simulator
    calls) given to the local search ``search`` on the best placement found; 0 turns it off.
    Zero-shot plans are polished only with ``polish_s_per_kop``."""
    polish_s_per_kop: float | None = 1.8
    """zero-shot only: ``refine`` the policy's best proposals until the plan (weights, seeds, policy,
    polish) has taken this many s per 1,000 ops (:mod:`.polish`; benchmarks/results/ablation.md); None: off."""
    polish_starts: int = 2
    """proposals (distinct, fastest first) the polish refines in turn while its time lasts."""
    polish_seed_starts: int = 0
    """heuristic seeds (fastest first) the polish refines too, after those; with any, equal shares."""
    search: str = "critical"
    """the zero-shot polish's and fine-tuning's local search: ``"critical"`` (the critical chain's
    ops first, :mod:`autoplace.planners.learned.critical`) or ``"refine"`` (every op each pass)."""
    ppo: PPOConfig = field(default_factory=_default_ppo)
    """PPO of fine-tuning; its ``seed`` is replaced by the plan's ``seed``."""
    weights: str | None = None
    """the pretrained weights (None: the shipped ``autoplace/weights/mars.pt``)."""
    max_samples: int | None = None
    """bound fine-tuning by simulated samples (reproducible from ``seed``) instead of seconds;
    with ``budget_s=None`` it turns zero-shot placement into fine-tuning."""
    progress: bool = False
    """show fine-tuning progress."""
    expert: bool = False
    """fine-tune by expert iteration (:mod:`autoplace.planners.learned.expert`: the policy proposes,
    the search polishes, the policy learns from it) instead of PPO then ``refine``."""
    expert_config: ExpertConfig = field(default_factory=ExpertConfig)
    """expert iteration's settings (with ``expert``)."""

    def __post_init__(self) -> None:
        if self.zero_shot_samples < 1:
            raise ValueError(f"MarsConfig.zero_shot_samples is {self.zero_shot_samples}; it must be >= 1")
        if self.max_samples is not None and self.max_samples < 1:
            raise ValueError(f"MarsConfig.max_samples is {self.max_samples}; it must be >= 1 or None")
        if self.polish_s_per_kop is not None and not self.polish_s_per_kop > 0:
            raise ValueError(f"MarsConfig.polish_s_per_kop is {self.polish_s_per_kop}; it must be > 0 seconds per "
                             "1,000 ops, or None for no polish")
        if self.polish_starts < 1:
            raise ValueError(f"MarsConfig.polish_starts is {self.polish_starts}; it must be >= 1")
        if self.search not in LOCAL_SEARCHES:
            raise ValueError(f"MarsConfig.search is {self.search!r}; it must be one of {LOCAL_SEARCHES}")


@dataclass(frozen=True)
class MarsPlanner:
    """The registry entry ``"mars"`` (see the module docstring)."""

    config: MarsConfig = field(default_factory=MarsConfig)
    name: str = "mars"
    modes: tuple[str, ...] = ("model",)
    kind: str = "learned"
    summary: str = "Mars: DGI-pretrained GraphSAGE + segment seq2seq placer, PPO"
    config_type: ClassVar[type] = MarsConfig

    def place(self, graph: "OpGraph", cluster: "Cluster", *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0, weights: str | Path | None = None,
              max_samples: int | None = None, ppo: PPOConfig | None = None, progress: bool | None = None,
              config: MarsConfig | None = None) -> "Placement":
        """Zero-shot (``budget_s=None`` and ``max_samples=None``) or fine-tuned placement, with
        ``config`` (default: the planner's). ``weights``, ``max_samples`` and ``progress``
        override the config's; ``ppo`` replaces ``config.ppo`` as given (its own seed).

        ``placement.meta``: ``policy_step_time_s`` (the best of the policy's own samples that
        fit, greedy decode included), ``greedy_step_time_s``, ``reference_s`` (the best
        heuristic's), ``source`` (``"sample"``, ``"refine"``/``"critical"`` or a heuristic),
        ``samples``, ``step_s`` (seconds of the seeds, the policy, the polish), for fine-tuning
        ``updates``, ``history`` and ``refine``; with ``polish_s_per_kop``: ``polish`` and
        ``final_step`` (``"policy"``, ``"refine"`` or ``"seed"``)."""
        from autoplace.cost.analytic import CostModel

        cfg = config if config is not None else self.config
        weights = weights if weights is not None else cfg.weights
        max_samples = max_samples if max_samples is not None else cfg.max_samples
        progress = progress if progress is not None else cfg.progress
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s is {budget_s}; it must be > 0 seconds, or None for zero-shot placement")
        clock = _budget.Clock(budget_s)
        cost = cost if cost is not None else CostModel()
        source = str(weights) if weights is not None else "shipped"
        try:
            net = load_pretrained(weights)
        except FileNotFoundError:
            if weights is not None:
                raise
            warnings.warn(f"Mars has no pretrained weights at {WEIGHTS_PATH}; placing with an untrained network "
                          "(run python -m autoplace.planners.learned.pretrain)", RuntimeWarning, stacklevel=2)
            torch.manual_seed(seed)
            net, source = new_net(), "none (untrained)"
        t_seed = clock.elapsed_s()
        # seeded with the heuristics as every learned planner's (no fit among them: the lower bound scales rewards)
        env = LearnedRun.start(graph, cluster, cost, None, None).env
        t_policy = clock.elapsed_s()
        policy = MarsPolicy(net, graph, cluster, cost)
        gen = torch.Generator().manual_seed(seed)
        policy.eval()
        greedy = policy.sample(1, gen, greedy=True)
        _, greedy_ev = env.evaluate_many(policy.decode(greedy.actions))
        meta: PlacementMeta = {"weights": source, "greedy_step_time_s": float(greedy_ev[0].step_time_s),
                                "greedy_oom": bool(greedy_ev[0].oom),
                                "reference_s": env.reference_s, "seeds": [s.planner for s in env.seeds]}
        greedy_fit = math.inf if greedy_ev[0].oom else float(greedy_ev[0].step_time_s)
        train_s = 0.0
        if budget_s is None and max_samples is None:
            s = policy.sample(cfg.zero_shot_samples, gen)
            _, evs = env.evaluate_many(policy.decode(s.actions))
            fits = [e.step_time_s for e in evs if not e.oom]
            meta["best_sample_step_time_s"] = float(min(fits)) if fits else math.inf
            meta["policy_s"] = clock.elapsed_s() - t_policy
            if cfg.polish_s_per_kop is not None:
                meta["polish"] = polish_zero_shot(
                    env, policy.decode(greedy.actions) + policy.decode(s.actions), greedy_ev + evs, seed=seed,
                    budget_s=polish_budget_s(graph.num_nodes, cfg.polish_s_per_kop, clock.elapsed_s()),
                    starts=cfg.polish_starts, seeds=env.seeds, seed_starts=cfg.polish_seed_starts, search=cfg.search)
        elif cfg.expert:
            left = clock.left_s(1e-3)
            ex = expert_iteration(policy, env, cfg.expert_config, budget_s=left, max_samples=max_samples, seed=seed)
            meta.update({"best_sample_step_time_s": ex.policy_step_time_s, "updates": ex.rounds, "history": list(
                ex.history), "tuned_weights": str(keep_tuned(net)), "expert": {"first_polish_s": ex.first_polish_s}})
            train_s, meta["policy_step_time_s"] = ex.wall_s, min(greedy_fit, ex.policy_step_time_s)
        else:
            ppo_config = ppo if ppo is not None else dataclasses.replace(cfg.ppo, seed=seed)
            share = min(max(cfg.refine_share, 0.0), 1.0)
            left = clock.left_s(1e-3)
            result = train(policy, env, ppo_config, budget_s=None if left is None else left * (1 - share),
                           max_samples=max_samples, progress=progress)
            meta.update({"best_sample_step_time_s": result.best_sampled_step_time_s, "updates": result.updates,
                         "history": [tuple(p) for p in result.history], "tuned_weights": str(keep_tuned(net))})
            train_s = result.wall_s
            policy_best = min(greedy_fit, result.best_sampled_step_time_s)
            if share > 0 and isinstance(env.best_candidate, np.ndarray):
                left = clock.left_s(1e-3)
                r = local_search(cfg.search)(env, env.best_candidate, budget_s=left, seed=seed,
                                             max_evaluations=max_samples)
                meta["refine"] = {"start_step_time_s": r.start_step_time_s, "step_time_s": r.step_time_s, "moves": r.moves,
                                  "evaluations": r.evaluations, "wall_s": r.wall_s, "search": cfg.search}
            meta["policy_step_time_s"] = policy_best
        meta.setdefault("policy_step_time_s", min(greedy_fit, meta["best_sample_step_time_s"]))
        meta["samples"] = env.num_samples
        meta["source"] = env.best_source
        meta["final_step"] = final_step(env.best_source) if "polish" in meta else None
        meta["step_s"] = {"seeds": t_policy - t_seed, "policy": meta.get("policy_s"),
                          "polish": meta["polish"]["wall_s"] if "polish" in meta else None}
        meta["seed_s"] = t_policy - t_seed
        meta["total_s"] = clock.elapsed_s()
        details: dict[str, Any] = {k: meta[k] for k in ("weights", "greedy_step_time_s", "greedy_oom", "best_sample_step_time_s",
                                        "refine", "polish", "final_step", "expert", "total_s") if k in meta}
        meta[REPORT_KEY] = LearnedReport.of_env(
            self.name, env, updates=meta.get("updates", 0), policy_step_time_s=meta["policy_step_time_s"],
            seed_s=meta["seed_s"], train_s=train_s, history=meta.get("history", []), details=details).to_dict()
        return env.placement(planner=self.name, meta=meta)


def keep_tuned(net: MarsNet) -> Path:
    """Save a fine-tuned ``net`` as :func:`~autoplace.planners.learned.mars.tuned.tuned_path` names
    it (the same network is one file) and return the path (``placement.meta["tuned_weights"]``)."""
    path = tuned_path(net)
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        save_net(net, tmp)
        tmp.replace(path)
    return path


register(MarsPlanner())
