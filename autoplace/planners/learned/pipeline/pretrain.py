"""Pretraining of the pipeline policy: imitation of search over a corpus of graphs and clusters.

    python -m autoplace.planners.learned.pipeline.pretrain      # writes autoplace/weights/pipeline_rl.{pt,json}

Behaviour cloning of an expert (the DAgger family's first step, Ross, Gordon, Bagnell, AISTATS
2011, without the aggregation rounds): for every (graph, cluster) pair of the corpus the expert
is :func:`~.search.pipeline_search` (iterated local search from pipedream-dp's plan, a fixed
number of simulator calls), its best plan is encoded as the policy's actions by teacher forcing
(:meth:`~.space.PipelineSpace.encode`), and one network (:data:`~.policy.SHARED`, tied into every
pair's policy) is fitted to maximise

    L = mean over pairs of  log pi(target actions | graph, cluster) / decisions of the pair

(decisions: stage count, one per device, one per op that may open a stage, micro-batches,
schedule), with Adam. The per-graph tables stay at zero: what is saved is only what carries to
graphs and clusters the policy has not seen.

Corpus (:func:`pretraining_pairs`): :func:`~autoplace.planners.learned.corpus.training_graphs`
(zoo training configs, PipeDream training profiles when their folder is given, generated graphs)
without the GPT-2 family (kept out here so that gpt2 is a held-out graph of the pipeline
benchmark), each on ``clusters_per_graph`` clusters drawn from
:func:`~autoplace.planners.learned.corpus.training_clusters` and from :func:`large_cluster`
(16 to 64 GPUs on 2 to 8 hosts, one or two kinds; seeds from :data:`LARGE_SEED0` on, a range
the corpus's held-out clusters do not use). ``max_stages`` caps the stage count at 16 (the device
head costs S x D x S).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from autoplace.cluster import DEVICE_KINDS, LINKS, Cluster, Device, Link
from ... import budget as _budget
from ..adam import Adam
from ..corpus import HELD_OUT, CorpusGraph, held_out_clusters, held_out_graphs, training_clusters, training_graphs
from .policy import PipelinePolicy
from .search import pipeline_search
from .space import PipelinePlan
from .weights import MAX_STAGES, WEIGHTS_PATH, load_weights, make_policy, weights_hidden

__all__ = ["PretrainConfig", "make_policy", "imitate", "pretrain", "pretraining_pairs", "large_cluster",
           "load_weights", "weights_hidden", "split_record", "WEIGHTS_PATH", "LARGE_SEED0", "MAX_STAGES"]

LARGE_SEED0 = 70_000
"""First seed of :func:`large_cluster` in pretraining."""
_GPUS = ("V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100", "T4")


@dataclass(frozen=True)
class PretrainConfig:
    """Settings of the pipeline policy's pretraining."""

    hidden: int = 32
    """hidden size of the network (the planner's policy must use the same)."""
    generated: int = 24
    """generated graphs of the corpus."""
    clusters_per_graph: int = 3
    """clusters each graph is paired with."""
    search_calls: int = 1500
    """simulator calls of the expert search per pair."""
    epochs: int = 30
    """passes over the pairs."""
    lr: float = 3e-3
    """Adam learning rate."""
    seed: int = 0
    """seed of the pairing, the search and the network."""
    budget_s: float = 840.0
    """wall-clock limit of the whole run (the fitting stops early when it is reached)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "clusters_per_graph", "search_calls", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"PretrainConfig.{name} is {getattr(self, name)}; it must be >= 1")
        if not self.lr > 0 or not self.budget_s > 0:
            raise ValueError(f"PretrainConfig lr={self.lr}, budget_s={self.budget_s}; both must be > 0")


def large_cluster(seed: int) -> Cluster:
    """16 to 64 GPUs on 2 to 8 hosts of 8, one or two kinds (mixed per host), NVLink or PCIe in a
    host, 25/100 GbE or 400 Gb InfiniBand between hosts."""
    rng = np.random.default_rng(seed)
    hosts = int(rng.choice((2, 3, 4, 6, 8)))
    kinds = [str(k) for k in rng.choice(_GPUS, size=2, replace=False)]
    mixed = rng.random() < 0.5
    intra = LINKS[str(rng.choice(("pcie4", "nvlink3", "nvlink4")))]
    inter = LINKS[str(rng.choice(("eth25", "eth100", "ib400")))]
    devs = []
    for i in range(hosts * 8):
        kind = kinds[(i // 8) % 2] if mixed else kinds[0]
        fp32, tensor, bw, mem = DEVICE_KINDS[kind]
        devs.append(Device(f"cuda:{i}", kind, fp32, bw, mem, tensor, host=i // 8))

    def link_of(i: int, j: int) -> Link:
        return intra if devs[i].host == devs[j].host else inter

    return Cluster.from_links(devs, link_of, name=f"large-{seed}")


def imitate(policies: list[PipelinePolicy], targets: list[tuple[torch.Tensor, ...]], params: list[torch.nn.Parameter],
            opt: Adam, *, steps: int = 1) -> float:
    """``steps`` Adam steps on ``params`` raising the mean over pairs of log pi(target) per
    decision; returns the loss before the last step (mean negative log-probability per decision)."""
    loss_v = math.nan
    for _ in range(steps):
        total = torch.zeros(())
        for pol, tgt in zip(policies, targets):
            logp, _ = pol.score(tgt)
            total = total - logp.mean() / _decisions(pol)
        loss = total / max(len(policies), 1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_v = float(loss.detach())
    return loss_v


def _decisions(pol: PipelinePolicy) -> float:
    sp = pol.space
    return float(3 + sp.num_devices + sp.num_nodes)


def pretraining_pairs(cfg: PretrainConfig, *, pipedream: str | Path | None = None) -> list[tuple[CorpusGraph, Cluster]]:
    """The (graph, cluster) pairs of the corpus (see the module doc)."""
    rng = np.random.default_rng(cfg.seed)
    graphs = [e for e in training_graphs(generated=cfg.generated, seed=cfg.seed, pipedream=pipedream)
              if e.family != "gpt2"]
    held = {c.fingerprint for c in held_out_clusters()}
    clusters = training_clusters(seed=cfg.seed) + [c for c in (large_cluster(LARGE_SEED0 + k) for k in range(8))
                                                   if c.fingerprint not in held]
    return [(g, clusters[int(i)]) for g in graphs
            for i in rng.choice(len(clusters), size=cfg.clusters_per_graph, replace=False)]


def pretrain(cfg: PretrainConfig, *, pipedream: str | Path | None = None, max_ops: int = 1500,
             progress: bool = True) -> tuple[PipelinePolicy, dict[str, object]]:
    """Fit the shared network (see the module doc); returns the master policy and the record."""
    clock = _budget.Clock(cfg.budget_s)
    torch.manual_seed(cfg.seed)
    master: PipelinePolicy | None = None
    policies, targets, keys = [], [], []
    for k, (entry, cluster) in enumerate(pretraining_pairs(cfg, pipedream=pipedream)):
        if clock.elapsed_s() > cfg.budget_s / 2:
            break  # keep half the budget for the fitting
        graph = entry.load()
        if graph.num_nodes > max_ops:
            continue
        res = pipeline_search(graph, cluster, max_calls=cfg.search_calls, seed=cfg.seed + k)
        if res.plan is None:
            continue
        pol = make_policy(graph, cluster, hidden=cfg.hidden, seed=cfg.seed)
        if master is None:
            master = pol
        else:
            pol.tie(master)
        policies.append(pol)
        targets.append(pol.actions_of(res.plan))
        keys.append(f"{entry.key} @ {cluster.name}")
        if progress:
            print(f"[{clock.elapsed_s():6.1f}s] {keys[-1]}: {graph.num_nodes} ops, search "
                  f"{_describe(res.plan)}", flush=True)
    if master is None:
        raise RuntimeError("pipeline pretraining found no pair with a plan that fits; check the corpus")
    params = [p for name, p in master.named_parameters() if name.split(".")[0] not in ("op_bias", "dev_bias",
                                                                                        "micro_bias", "count_bias")]
    opt = Adam(params, lr=cfg.lr)
    losses: list[float] = []
    order = np.random.default_rng(cfg.seed)
    for epoch in range(cfg.epochs):
        if clock.spent():
            break
        perm = order.permutation(len(policies))
        for lo in range(0, len(perm), 8):  # minibatches of 8 pairs
            idx = perm[lo:lo + 8]
            losses.append(imitate([policies[i] for i in idx], [targets[i] for i in idx], params, opt))
        if progress:
            recent = float(np.mean(losses[-(len(perm) // 8 + 1):]))
            print(f"[{clock.elapsed_s():6.1f}s] epoch {epoch + 1}: loss {recent:.4f}", flush=True)
    record: dict[str, object] = {"config": asdict(cfg), "pairs": keys, "loss_first": losses[0] if losses else None,
                                 "loss_last": losses[-1] if losses else None, "steps": len(losses),
                                 "wall_s": clock.elapsed_s()}
    return master, record


def split_record() -> dict[str, object]:
    """What pretraining kept out (written into the weights' .json)."""
    return {"held_out_graphs": [e.key for e in held_out_graphs()],
            "held_out_families": {k: list(v) for k, v in HELD_OUT.items()}, "held_out_clusters": [c.name for c in held_out_clusters()], "also_left_out": ["zoo/gpt2 (every size)"],
            "large_cluster_seeds": [LARGE_SEED0, LARGE_SEED0 + 8]}


def _describe(plan: PipelinePlan) -> str:
    return f"{len(plan.stage_devices)} stages x {[len(g) for g in plan.stage_devices]} replicas, " \
           f"M={plan.microbatches} {plan.schedule}"


def main() -> None:  # pragma: no cover - the shipped weights' command
    ap = argparse.ArgumentParser(description="pretrain the pipeline-rl policy by imitation of search")
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    ap.add_argument("--pipedream", default=None, help="folder of PipeDream profiles (training ones are used)")
    ap.add_argument("--budget", type=float, default=PretrainConfig.budget_s)
    ap.add_argument("--epochs", type=int, default=PretrainConfig.epochs)
    ap.add_argument("--generated", type=int, default=PretrainConfig.generated)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = PretrainConfig(budget_s=args.budget, epochs=args.epochs, generated=args.generated)
    master, record = pretrain(cfg, pipedream=args.pipedream)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(master.shared_state(), args.out)
    record["command"] = "python -m autoplace.planners.learned.pipeline.pretrain" + (
        f" --pipedream {args.pipedream}" if args.pipedream else "") + f" --budget {args.budget:g} --epochs " \
        f"{args.epochs} --generated {args.generated}"
    record["split"] = split_record()
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} ({record['steps']} steps, loss {record['loss_first']} -> {record['loss_last']})")


if __name__ == "__main__":  # pragma: no cover
    main()
