"""Online tuning over plan kinds: the candidate set and the policy that samples from it.

The runtime runs these kinds of plan on ``W`` processes: data parallelism (one stage replicated
on every rank: DDP, or FSDP with its parameters sharded over the ranks), and a pipeline of ``W``
stages scheduled by GPipe or 1F1B with some number of micro-batches. :func:`kind_candidates`
builds a small set of them from a planner's pick, the way a user would explore by hand:

- DDP over every rank (one micro-batch, and ``microbatches`` if asked for), and FSDP over every
  rank (``fsdp_microbatches``; without resharding after forward, as ``plan("best")`` picks it);
- every cut of :func:`cut_shares` (the planner's pipeline cut, its neighbours at
  ``cut_offsets`` of the profiled work, and fixed work shares such as an even and a skewed
  split), each with every schedule in ``schedules`` and micro-batch count in ``microbatches``;
- recompute (activation checkpointing, :mod:`autoplace.parallel`'s ``recompute`` option, which the
  runtime runs on one-stage DDP and FSDP plans and on pipeline stages): each value in
  ``recompute`` gives a variant of every DDP and FSDP plan above, each value in
  ``pipeline_recompute`` one of every pipeline at the planner's cut (every stage recomputing;
  :class:`~autoplace.online.pipeline.OnlinePipeline` switches into stage options on one stage
  only, so leave it empty there). A value that checkpoints no unit of the graph
  (:func:`autoplace.sim.stage_ops.recomputed_ops`) gives no variant: it would run as its plain plan does;
- ``proposals``: when the plan came from a learned pipeline planner (pipeline-rl), the plans its
  policy proposes for the same graph and cluster (:func:`planner_proposals`: greedy decode and a
  few samples, bounded in count and time, only kinds the online runtime runs), after the rest,
  labelled with where they came from (``1f1b M8 19/6 (pipeline-rl sample)``). They are priced,
  screened and measured as every other candidate is. Heuristics' plans get none.

A candidate is a :class:`KindPlan`: the planners' pipeline candidate
(:class:`~autoplace.planners.candidate.PipelinePlan`) with the stages' options (sharding,
recompute) beside it, which the planners' 4-field candidates do not carry; :func:`kind_of`,
:func:`kind_key`, :func:`kind_evaluate` and :func:`kind_placement` convert, key and simulate them
(a candidate without options keys as the planners' candidate of the same plan).

A cut is placed by the profiled work (measured forward + backward seconds; FLOPs where an op
was not measured): the first stage ends at the op where the running share of the work reaches
the cut's share. Duplicates are dropped, so a set stays small (17 plans for 4 cuts x 4
schedule/micro-batch pairs + DDP; the recompute variants come after every plain plan).

:class:`KindPolicy` is one categorical over that set (logits start equal): PPO
(:mod:`autoplace.online.search`) moves probability towards the plans whose live or calibrated
simulated step is fast; the learning-free control ranks the same set by the calibrated
simulator alone.
"""

from __future__ import annotations

import pickle
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from .host_probe_fsdp import fsdp_step_overhead_s
from ..parallel import Recompute, StageOptions
from ..placement import Placement
from ..planners.candidate import PipelinePlan, candidate_key, candidate_of, evaluate_candidate
from ..planners.learned.ppo import PolicySample
from ..sim.stage_ops import recomputed_ops

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from ..sim import Evaluation, Simulator

__all__ = ["kind_candidates", "cut_shares", "split_at_share", "kind_label", "KindPolicy", "pipeline_cut_share",
           "KindPlan", "kind_of", "kind_key", "kind_evaluate", "kind_placement", "has_options", "bn_sync_wall_s",
           "planner_proposals", "proposed_by", "online_problems", "online_rules", "PROPOSERS"]


class KindPlan(NamedTuple):
    """A pipeline plan with its stages' options: the kinds policy's candidate."""

    stage_of_node: np.ndarray
    """(N,) int64 stage of every op."""
    stage_devices: tuple[tuple[int, ...], ...]
    """the devices of each stage."""
    microbatches: int
    schedule: str
    options: StageOptions | None = None
    """the stages' shard, recompute, precision (None: the defaults, plain DDP in fp32)."""
    source: str = ""
    """who proposed it when not the enumeration: ``"pipeline-rl greedy"`` or ``"pipeline-rl sample"``
    (:func:`planner_proposals`); not part of its key, shown by :func:`kind_label`."""


def has_options(p: Placement) -> bool:
    """Whether ``p`` has stage options beyond the defaults (sharding, recompute, precision)."""
    return p.mode == "pipeline" and not StageOptions.of(p).is_default


def kind_of(p: Placement) -> KindPlan:
    """The :class:`KindPlan` of a pipeline-mode placement."""
    st, sd, m, sched = candidate_of(p)
    return KindPlan(st, sd, m, sched, StageOptions.of(p) if has_options(p) else None, proposed_by(p))


def kind_key(cand: Any) -> bytes:
    """A digest of a candidate: :func:`~autoplace.planners.candidate.candidate_key` of its plan,
    with its options (when it has any) hashed in."""
    if isinstance(cand, KindPlan):
        base = candidate_key(PipelinePlan(*cand[:4]))
        return base if cand.options is None else base + repr(cand.options).encode()
    return candidate_key(cand)


def kind_evaluate(sim: "Simulator", cand: Any) -> "Evaluation":
    """The simulator's evaluation of a candidate, its stage options included; on a host cost model,
    plus the measured wall terms the simulator does not charge: a sharded stage's FSDP residual
    (``fsdp_s``: :func:`autoplace.online.host_probe_fsdp.fsdp_step_overhead_s`), a replicated
    stage's BatchNorm sync calls (:func:`bn_sync_wall_s`). (A plan of DDP stages with options,
    recompute, gets the host model's per-stage terms from the simulator, as its plain twin does.)"""
    extra = bn_sync_wall_s(sim, cand)
    if isinstance(cand, KindPlan) and cand.options is not None:
        ev = sim.evaluate_pipeline(cand.stage_of_node, cand.stage_devices, int(cand.microbatches),
                                   schedule=str(cand.schedule), options=cand.options)
        extra += fsdp_step_overhead_s(getattr(sim.cost, "fsdp_s", {}), sim.graph, cand)
    else:
        ev = evaluate_candidate(sim, PipelinePlan(*cand[:4]) if isinstance(cand, KindPlan) else cand)
    return ev._replace(step_time_s=ev.step_time_s + extra) if extra else ev


def bn_sync_wall_s(sim: "Simulator", cand: Any) -> float:
    """Wall seconds the BatchNorm statistics' all-reduces of a replicated stage (DDP or FSDP, the
    runtime's ``batch_norm="sync"``: :func:`autoplace.sim.ddp.bn_sync_collectives` counts them, 80 a
    step on ResNet-18) add beyond the link the simulator prices them on: each one gloo call, costing
    what the host probe's ``busy_allreduce_s`` measured one all-reduce call adds to a step while
    both ranks compute (the cost model's; 0 on a cost model without it). The slowest stage's.
    Without it the runtime's DDP on ResNet-18 was predicted 34 ms and measured 136 ms on 2 CPU
    processes (benchmarks/results/online_kinds.md at 2362 s)."""
    per_call = float(getattr(sim.cost, "busy_allreduce_s", 0.0))
    if not per_call or getattr(sim.cost, "batch_norm", "sync") != "sync" or not isinstance(cand, tuple) \
            or len(cand) < 4 or not isinstance(cand[1], tuple):
        return 0.0
    from ..sim.ddp import bn_sync_collectives, graph_bn_channels

    st, sd, m = np.asarray(cand[0]), cand[1], int(cand[2])
    ch = graph_bn_channels(sim.graph)
    if not ch.any():
        return 0.0
    opts = cand.options if isinstance(cand, KindPlan) else None
    worst = 0.0
    for s, devs in enumerate(sd):
        if len(devs) > 1:  # a recomputed layer's checkpoint runs its forward's syncs again
            again = recomputed_ops(sim.graph, st, opts.recompute[s]) if opts is not None else None
            calls, _ = bn_sync_collectives(np.where(st == s, ch, 0.0), m, recomputed=again)
            worst = max(worst, per_call * calls)
    return worst


def kind_placement(graph: "OpGraph", cluster: "Cluster", cand: Any, *, planner: str = "online") -> Placement:
    """The Placement of a candidate (a :class:`KindPlan` or the planners' 4-field pipeline candidate)."""
    st, sd, m, sched = cand[:4]
    opts = cand.options if isinstance(cand, KindPlan) else None
    kw: dict[str, Any] = {}
    if opts is not None:
        kw = dict(shard=opts.shard, recompute=opts.recompute, precision=opts.precision,
                  reshard_after_forward=opts.reshard_after_forward)
    if isinstance(cand, KindPlan) and cand.source:
        kw["meta"] = {"source": cand.source}
    return Placement.pipeline(graph, cluster, st, sd, microbatches=int(m), schedule=sched, planner=planner, **kw)


def _work(graph: "OpGraph") -> np.ndarray:
    t = np.nan_to_num(np.asarray(graph.fwd_time_s, dtype=np.float64)) + np.nan_to_num(
        np.asarray(graph.bwd_time_s, dtype=np.float64))
    if t.sum() <= 0:
        t = np.asarray(graph.fwd_flops, dtype=np.float64) + np.asarray(graph.bwd_flops, dtype=np.float64)
    return t if t.sum() > 0 else np.ones(graph.num_nodes)


def split_at_share(graph: "OpGraph", share: float) -> np.ndarray:
    """Stage (0 or 1) of every op: 0 up to the op where the running share of the work reaches
    ``share``; both stages keep at least one op."""
    w = _work(graph)
    cut = int(np.searchsorted(np.cumsum(w) / w.sum(), share))
    cut = min(max(cut, 0), graph.num_nodes - 2)
    return (np.arange(graph.num_nodes) > cut).astype(np.int64)


def pipeline_cut_share(graph: "OpGraph", stage_of_node: Sequence[int]) -> float:
    """The share of the work in the first stage of a 2-stage assignment."""
    w = _work(graph)
    return float(w[np.asarray(stage_of_node) == 0].sum() / w.sum())


def cut_shares(centre: float, *, offsets: Sequence[float] = (-0.1, 0.0, 0.1),
               fixed: Sequence[float] = (0.5, 0.3)) -> list[float]:
    """Work shares of the first stage to try: ``centre`` plus ``offsets``, then ``fixed``, all in (0, 1)."""
    out = [min(max(centre + o, 0.02), 0.98) for o in offsets] + list(fixed)
    return [s for i, s in enumerate(out) if s not in out[:i]]


def kind_candidates(graph: "OpGraph", cluster: "Cluster", *, centre_share: float = 0.5,
                    cut_offsets: Sequence[float] = (-0.1, 0.0, 0.1), fixed_shares: Sequence[float] = (0.5, 0.3),
                    schedules: Sequence[str] = ("gpipe", "1f1b"), microbatches: Sequence[int] = (2, 4),
                    ddp_microbatches: Sequence[int] = (1,), fsdp_microbatches: Sequence[int] = (),
                    recompute: Sequence[Recompute] = (), pipeline_recompute: Sequence[Recompute] = (),
                    proposals: Sequence[Placement] = (), planner: str = "online-kinds") -> list[Placement]:
    """DDP, FSDP and 2-stage pipelines over ``cluster``'s first two devices (see the module doc);
    the DDP plans first, then FSDP, then the pipelines by cut, schedule and micro-batches, then the
    recompute variants (of DDP and FSDP by ``recompute``, of the pipelines at ``centre_share``'s cut
    by ``pipeline_recompute``), then ``proposals`` (:func:`planner_proposals`: a learned planner's
    own plans, kept as given); no duplicates (a proposal equal to an enumerated plan is dropped)."""
    if cluster.num_devices != 2:
        raise ValueError(f"kind_candidates builds plans for 2 processes; the cluster has {cluster.num_devices} "
                         "devices: pass a 2-device cluster")
    n = graph.num_nodes
    out: list[Placement] = []
    seen: set[bytes] = set()

    def add(p: Placement) -> None:
        key = kind_key(kind_of(p))
        if key not in seen:
            seen.add(key)
            out.append(p)

    for m in ddp_microbatches:
        add(Placement.pipeline(graph, cluster, np.zeros(n, dtype=np.int64), [[0, 1]], microbatches=int(m),
                               schedule="1f1b", planner=planner))
    for m in fsdp_microbatches:
        add(Placement.pipeline(graph, cluster, np.zeros(n, dtype=np.int64), [[0, 1]], microbatches=int(m),
                               schedule="1f1b", shard="fsdp", reshard_after_forward=False, planner=planner))
    for share in cut_shares(centre_share, offsets=cut_offsets, fixed=fixed_shares):
        st = split_at_share(graph, share)
        for sched in schedules:
            for m in microbatches:
                add(Placement.pipeline(graph, cluster, st, [0, 1], microbatches=int(m), schedule=sched,
                                       planner=planner))
    one = np.zeros(n, dtype=np.int64)
    for rc in recompute:
        if recomputed_ops(graph, one, rc).any():
            for m in ddp_microbatches:
                add(Placement.pipeline(graph, cluster, one, [[0, 1]], microbatches=int(m), schedule="1f1b",
                                       recompute=rc, planner=planner))
            for m in fsdp_microbatches:
                add(Placement.pipeline(graph, cluster, one, [[0, 1]], microbatches=int(m), schedule="1f1b",
                                       shard="fsdp", reshard_after_forward=False, recompute=rc, planner=planner))
    centre = split_at_share(graph, centre_share)
    for rc in pipeline_recompute:
        if recomputed_ops(graph, centre, rc).any():
            for sched in schedules:
                for m in microbatches:
                    add(Placement.pipeline(graph, cluster, centre, [0, 1], microbatches=int(m), schedule=sched,
                                           recompute=rc, planner=planner))
    for p in proposals:
        add(p)
    return out


PROPOSERS = ("pipeline-rl",)
"""The learned planners whose policy proposes online candidates (:func:`planner_proposals`)."""
_MODEL_PARALLEL = ("mars", "eagle", "reinforce")


def proposed_by(p: Placement) -> str:
    """Who proposed ``p`` when a learned planner's policy did (:func:`planner_proposals`: its
    ``meta["source"]``, e.g. ``"pipeline-rl sample"``); "" otherwise."""
    src = p.meta.get("source")
    if isinstance(src, str) and any(src in (f"{n} greedy", f"{n} sample") for n in PROPOSERS):
        return src
    return ""


def planner_proposals(graph: "OpGraph", cluster: "Cluster", plan: Placement, *, cost: "CostModel | None" = None,
                      samples: int = 8, time_cap_s: float = 5.0, seed: int = 0) -> tuple[list[Placement], str]:
    """The plans the learned planner that made ``plan`` proposes for ``graph`` on ``cluster``, in
    the kinds the online runtime runs, and a note saying what was proposed or why nothing was.

    ``pipeline-rl``: the policy network the planner fine-tuned on this graph when the plan carries
    it (``meta["tuned_weights"]``, :mod:`autoplace.planners.learned.pipeline.tuned`; at the sampling
    temperature the planner left it at), else (an older plan, or a file that is gone or does not
    fit this graph and cluster) the network as the planner loads it before fine-tuning (the weights
    of :class:`~autoplace.planners.learned.pipeline.planner.PipelineRLConfig`'s defaults, the
    shipped pretrained network; the planner's step 2); either built for this graph, cluster and
    ``cost``: its greedy decode, then ``samples`` samples (its exploration floor included, seeded by
    ``seed``), the samples skipped once ``time_cap_s`` has passed. The note says which network
    proposed. Each plan is laid out as the runtime runs it (stage ``s`` on ranks ``s*R ..
    s*R+R-1``, ``R`` replicas; one stage with the enumeration's schedule, which its data-parallel
    loop does not read), kept when the online runtime runs it (:func:`online_problems`), once, with
    ``meta["source"]`` naming it (:func:`proposed_by`).

    Mars, EAGLE (and reinforce) propose nothing here: they place ops on the devices of one process
    (model parallel), a device per op, which says nothing of the pipelines, DDP and FSDP over
    processes the online runtime switches between (a 2-device placement is a pipeline only when no
    edge runs from the second device back to the first); model-parallel online tuning samples their
    own networks instead (:func:`autoplace.online.policy.model_policy`). A heuristic's plan gets no
    proposals, and nothing learned is loaded for it."""
    if plan.planner in _MODEL_PARALLEL:
        return [], (f"{plan.planner} places ops on devices of one process (model parallel): its policy proposes no "
                    "pipeline, DDP or FSDP plan over processes")
    if plan.planner not in PROPOSERS:
        return [], f"the plan came from {plan.planner or 'no planner'!r}, not a learned pipeline planner"
    clock = time.perf_counter()
    pol, which = _pipeline_network(graph, cluster, plan, cost, seed)
    if pol is None:
        return [], which
    pol.eval()
    gen = torch.Generator().manual_seed(int(seed))
    drawn: list[tuple[str, Any]] = []
    with torch.no_grad():
        drawn += [("greedy", c) for c in pol.decode(pol.sample(1, gen, greedy=True).actions)]
        if samples > 0 and time.perf_counter() - clock < time_cap_s:
            drawn += [("sample", c) for c in pol.decode(pol.sample(int(samples), gen).actions)]
    out: list[Placement] = []
    seen: set[bytes] = set()
    refused = 0
    for how, c in drawn:
        reps, stages = len(c.stage_devices[0]), len(c.stage_devices)
        layout = [list(range(s * reps, (s + 1) * reps)) for s in range(stages)]
        try:  # one stage runs the data-parallel loop, whatever the schedule: keyed as the enumeration's DDP
            p = Placement.pipeline(graph, cluster, c.stage_of_node, layout, microbatches=int(c.microbatches),
                                   schedule=c.schedule if stages > 1 else "1f1b", planner=plan.planner,
                                   meta={"source": f"{plan.planner} {how}"})
        except ValueError:
            refused += 1
            continue
        key = kind_key(kind_of(p))
        if key in seen:
            continue
        if online_problems(p, graph, cluster):
            refused += 1
            continue
        seen.add(key)
        out.append(p)
    took = time.perf_counter() - clock
    return out, (f"{which}: {len(drawn)} plans drawn (greedy + {len(drawn) - 1} samples) "
                 f"in {took:.1f} s, {len(out)} distinct that the online runtime runs, {refused} it does not")


def _pipeline_network(graph: "OpGraph", cluster: "Cluster", plan: Placement, cost: "CostModel | None",
                      seed: int) -> tuple[Any, str]:
    """The pipeline-rl network that proposes for ``plan`` and its name in words: the one the planner
    fine-tuned (``meta["tuned_weights"]``) when it loads for this graph and cluster, else the
    pretrained one (None when there is none)."""
    from ..planners.learned.pipeline.planner import PipelineRLConfig
    from ..planners.learned.pipeline.tuned import load_policy
    from ..planners.learned.pipeline.weights import make_policy, weights_hidden

    why = ""
    tuned = plan.meta.get("tuned_weights")
    if tuned:
        try:
            return (load_policy(tuned, graph, cluster, cost, seed=seed),
                    f"{plan.planner}'s policy fine-tuned on this graph ({tuned})")
        except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as e:  # gone, another
            # graph's, or not a network file (a corrupt one fails to unpickle)
            why = f" (its fine-tuned network did not load: {str(e)[:400]})"
    cfg = PipelineRLConfig()
    if cfg.weights is None:
        return None, f"pipeline-rl has no pretrained weights to propose with (autoplace/weights/pipeline_rl.pt){why}"
    pol = make_policy(graph, cluster, cost, hidden=weights_hidden(cfg.weights), max_stages=cfg.max_stages,
                      explore=cfg.explore, seed=seed, weights=cfg.weights)
    return pol, f"{plan.planner}'s pretrained policy{why}"


def online_rules(p: Placement, world: int) -> list[str]:
    """The rules of the online switch (:meth:`~autoplace.online.pipeline.OnlinePipeline._check_plan`
    raises the first) that ``p`` breaks on ``world`` processes (empty: none): a pipeline plan;
    stages x replicas = processes, every stage replicated alike; no precision, tensor parallelism,
    HSDP or virtual stages; FSDP on one stage only; on several stages a schedule it switches between."""
    from ..pipeline_rules import SCHEDULES

    if p.mode != "pipeline" or p.stage_devices is None or p.stage_of_node is None:
        return ["OnlinePipeline needs a pipeline plan"]
    out = []
    reps = {len(s) for s in p.stage_devices}
    if len(reps) != 1 or p.num_stages * min(reps) != world:
        out.append(f"online pipeline tuning runs stages x replicas = {world} ranks, every stage replicated alike; "
                   f"the plan has {[len(s) for s in p.stage_devices]} device(s) per stage: pass one stage per rank, "
                   "or one stage replicated on every rank")
    if p.precision or p.tp != 1 or p.virtual_stages != 1 or "hsdp" in tuple(p.shard or ()):
        out.append(f"online pipeline tuning switches plans without precision, tensor parallelism, HSDP or virtual "
                   f"stages; this plan has them ({p.describe()}): pass a pipeline, DDP or FSDP plan (recompute "
                   "allowed)")
    opts = StageOptions.of(p)
    if p.num_stages != 1 and any(opts.sharded(s) for s in range(opts.num_stages)):
        out.append(f"online pipeline tuning runs FSDP on one stage replicated on every rank; this plan shards "
                   f"{p.num_stages} stages ({p.describe()}): pass a one-stage FSDP plan (recompute is fine on any "
                   "stage)")
    if p.num_stages > 1 and p.schedule not in SCHEDULES:
        out.append(f"online pipeline tuning switches between the schedules {SCHEDULES}; this plan's is "
                   f"{p.schedule!r}: pass one of those")
    return out


def online_problems(p: Placement, graph: "OpGraph", cluster: "Cluster") -> list[str]:
    """Why the online runtime cannot switch to ``p`` on ``cluster.num_devices`` processes (empty: it
    can): the plan's own problems, the runtime's (:func:`autoplace.capability.runtime_problems`), and
    the online switch's rules (:func:`online_rules`)."""
    from ..capability import runtime_problems

    world = cluster.num_devices
    return list(p.problems(graph, cluster)) + runtime_problems(p, graph, world) + online_rules(p, world)


def kind_label(cand: Any) -> str:
    """A short name of a candidate ``(stage_of_node, stage_devices, microbatches, schedule[, options])``:
    ``ddp`` (``ddp M2``, ``fsdp``, ``ddp recompute``, ``fsdp recompute 2 units``, ``ddp selective-op``),
    or ``1f1b M4 20/25`` (schedule, micro-batches, ops per stage; options after it: ``1f1b M4 20/25
    recompute``)."""
    st, sd, m, sched = cand[:4]
    opts = cand.options if isinstance(cand, KindPlan) else None
    bits = []
    if opts is not None:
        bits += ["reshard"] if any(opts.sharded(s) and opts.reshard_after_forward[s] for s in range(len(sd))) else []
        bits += sorted({_recompute_label(r) for r in opts.recompute if r})
        bits += sorted({p for p in opts.precision if p != "fp32"})
    if isinstance(cand, KindPlan) and cand.source:
        bits.append(f"({cand.source})")
    extra = "".join(" " + b for b in bits)
    if len(sd) == 1:
        kind = "fsdp" if opts is not None and opts.sharded(0) else "ddp"
        return (kind if int(m) == 1 else f"{kind} M{int(m)}") + extra
    sizes = "/".join(str(int(x)) for x in np.bincount(np.asarray(st), minlength=len(sd)))
    return f"{sched} M{int(m)} {sizes}" + extra


def _recompute_label(rc: Recompute) -> str:
    if rc is True:
        return "recompute"
    if isinstance(rc, str):
        return rc
    return f"recompute {len(rc) if isinstance(rc, tuple) else 0} units"


class KindPolicy(nn.Module):
    """One categorical over a fixed list of candidates (:class:`KindPlan` or the planners' pipeline
    tuples, :func:`autoplace.planners.candidate.candidate_of`). Actions: an ``(n, 1)`` long tensor of
    indices; :meth:`decode` gives the candidates. Logits start equal."""

    def __init__(self, candidates: Sequence[Any]) -> None:
        super().__init__()
        if len(candidates) < 2:
            raise ValueError(f"KindPolicy needs at least 2 candidates; got {len(candidates)}")
        self.candidates = list(candidates)
        self.logits = nn.Parameter(torch.zeros(len(self.candidates)))

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> PolicySample:
        probs = torch.softmax(self.logits, dim=-1)
        if greedy:
            idx = probs.argmax().expand(n).clone()
        else:
            idx = torch.multinomial(probs, n, replacement=True, generator=generator)
        actions = idx.view(n, 1)
        lp, ent = self.score(actions)
        return PolicySample(actions, lp, ent)

    def score(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = torch.distributions.Categorical(logits=self.logits)
        return d.log_prob(actions[:, 0]), d.entropy().expand(actions.shape[0])

    def decode(self, actions: torch.Tensor) -> list[Any]:
        return [self.candidates[int(i)] for i in actions[:, 0].cpu().tolist()]
