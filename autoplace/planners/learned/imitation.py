"""Imitation of search: pretraining the Mars placer to put high probability on the placements a
search finds on the training corpus.

    python -m autoplace.planners.learned.imitation --out autoplace/weights/ --init autoplace/weights/mars.pt
    python -m autoplace.planners.learned.imitation --out autoplace/weights/ --resume      # continue a sitting

Expert iteration's first half (Anthony, Tian, Barber, "Thinking Fast and Slow with Deep
Learning and Tree Search", NeurIPS 2017), offline: the expert is the learning-free search
(:func:`autoplace.planners.learned.ils.iterated_local_search`), the apprentice the Mars
network, trained by maximum likelihood on the expert's answers:

    for each training pair (graph g, cluster c), drawn from the corpus's training graphs
    (<= max_ops ops) and training clusters (never a held-out one):
        a*(g, c) = canon(ILS(g, c, search_samples simulator calls))         the target
    minimise  L(theta) = mean over pairs, mean over ops i of  -log p_theta(a*_i | a*_<i, g, c)

with teacher forcing (:meth:`MarsPolicy.step_log_probs`: the decoder sees the target's own
earlier choices). ``canon`` relabels devices that are interchangeable (same kind, same host)
in the order of first use, as the greedy decode breaks ties (the lowest index first), and
keeps the relabelling only when the simulator gives the same step time; otherwise a target
would be an arbitrary one of several equal labellings. Ops whose target device the decoder
masks (its memory estimate says the op would overflow there while another device has room)
are left out of the loss (their log-probability is ``MASK``-sized).

Departure from the paper: one round, offline (the targets are computed once and cached in
``--work``); the online rounds, where the apprentice's samples seed the search, are
:mod:`autoplace.planners.learned.expert`.

Measured (``python benchmarks/ablation.py``, held-out split, simulated): neither variant
helps. The greedy decode of a network trained on these targets is slower than a fresh
network's (teacher forcing fits the targets, free running drifts off them: exposure bias),
and ``on_policy`` targets leave the shipped network slightly worse; so ``mars.pt`` stays the
default and these weights ship under their own names for the ablation.

The run is resumable: ``--work`` (default ``.cache/imitation``) holds ``targets.jsonl`` (one
line per pair, appended as they are found) and ``checkpoint.pt`` (network, optimizer, step,
random states); ``--time-limit-s`` ends a sitting cleanly. When done, ``--out`` gets
``--name`` ``.pt`` and ``.json`` (the split, the pairs, the settings, the command, the losses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .corpus import describe_split, training_clusters, training_graphs
from .expert import imitation_loss
from .mars.planner import MarsNet, MarsPolicy, load_net, new_net, save_net

__all__ = ["ImitationConfig", "imitation_loss", "canonical_target", "imitate", "main"]


@dataclass(frozen=True)
class ImitationConfig:
    """Settings of an imitation run (recorded in the weights' ``.json``)."""

    seed: int = 0
    """seed of the pair draws, the searches, the shuffles and a fresh network."""
    init: str = ""
    """weights to start from ("": a fresh network of ``new_net()``, seeded)."""
    pairs: int = 48
    """training (graph, cluster) pairs to search and imitate."""
    search_samples: int = 3000
    """simulator calls of the ILS per pair (a call limit, so targets do not depend on the machine's speed)."""
    max_ops: int = 700
    """graphs with more ops are not drawn (their search and their step cost more); pairs cycle
    over the smaller graphs in a seeded order, each with a random training cluster."""
    sources: str = "zoo,pipedream,generated"
    """corpus sources, comma separated."""
    pipedream_dir: str = ""
    """the folder of PipeDream profiles ("": ``$AUTOPLACE_PIPEDREAM_DIR``, else none)."""
    generated: int = 40
    """generated graphs in the corpus."""
    random_clusters: int = 8
    """random clusters beside the training presets."""
    steps: int = 400
    """Adam steps, one pair each."""
    lr: float = 1e-3
    """Adam learning rate."""
    max_grad_norm: float = 1.0
    """gradient clipping."""
    checkpoint_every: int = 25
    """steps between checkpoints."""
    on_policy: int = 0
    """0: imitate the cached ILS targets. N > 0: imitate, at each step, the policy's own greedy
    decode polished by ``refine`` with at most N simulator calls (a local expert around the
    states the policy visits, against the exposure bias of whole-placement targets; the ILS
    targets then only choose the pairs)."""

    def __post_init__(self) -> None:
        if self.on_policy < 0:
            raise ValueError(f"ImitationConfig.on_policy is {self.on_policy}; it must be >= 0 simulator calls")
        for name in ("pairs", "search_samples", "max_ops", "steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"ImitationConfig.{name} is {getattr(self, name)}; it must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"ImitationConfig.lr is {self.lr}; it must be > 0")


def canonical_target(device_of_node: np.ndarray, cluster: Any, sim: Any) -> np.ndarray:
    """``device_of_node`` with interchangeable devices (same kind and host) renamed in the order
    of first use, lowest index first; the original when the renamed one simulates differently."""
    dev = np.asarray(device_of_node, dtype=np.int64)
    groups: dict[tuple[str, int], list[int]] = {}
    for d, (device, host) in enumerate(zip(cluster.devices, cluster.hosts)):
        groups.setdefault((device.kind, int(host)), []).append(d)
    group_of = {d: g for g, members in groups.items() for d in members}
    mapping: dict[int, int] = {}
    taken: dict[tuple[str, int], int] = {g: 0 for g in groups}
    for d in dev.tolist():
        if d not in mapping:
            g = group_of[d]
            mapping[d] = groups[g][taken[g]]
            taken[g] += 1
    out = np.array([mapping[d] for d in dev.tolist()], dtype=np.int64)
    if np.array_equal(out, dev):
        return dev
    a, b = sim.evaluate(dev), sim.evaluate(out)
    same = bool(a.oom) == bool(b.oom) and abs(a.step_time_s - b.step_time_s) <= 1e-9 * max(a.step_time_s, 1e-30)
    return out if same else dev


# ---- the run -------------------------------------------------------------------------------

class _Run:
    def __init__(self, config: ImitationConfig, work: Path, targets: Path) -> None:
        self.config, self.work, self.targets_path = config, work, targets
        self.graphs = training_graphs(generated=config.generated, seed=config.seed,
                                      sources=tuple(config.sources.split(",")), pipedream=config.pipedream_dir)
        self.clusters = training_clusters(random=config.random_clusters, seed=config.seed)
        torch.manual_seed(config.seed)
        self.net: MarsNet = load_net(config.init) if config.init else new_net()
        self.opt = torch.optim.Adam(self.net.parameters(), lr=config.lr)
        self.rng = np.random.default_rng(config.seed + 11)
        self.step = 0
        self.losses: list[tuple[int, float]] = []
        self.seconds = {"search": 0.0, "train": 0.0}
        self._graphs: dict[str, Any] = {}
        self._policies: dict[str, MarsPolicy] = {}

    def graph(self, key: str) -> Any:
        if key not in self._graphs:
            self._graphs[key] = next(e for e in self.graphs if e.key == key).load()
        return self._graphs[key]

    # ---- targets ------------------------------------------------------------------------

    def targets(self, log: Any) -> list[dict[str, Any]]:
        """The pairs' targets, searching those not yet in ``targets.jsonl`` (resumable)."""
        from .env import PlacementEnv
        from .ils import iterated_local_search

        path = self.targets_path
        search = f"ils samples={self.config.search_samples} seed={self.config.seed}"
        have = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        have = [t for t in have if t.get("search") == search]
        draws = np.random.default_rng(self.config.seed + 7)
        order_g, order_c = draws.permutation(len(self.graphs)), draws.integers(len(self.clusters), size=10 * self.config.pairs)
        small = [self.graphs[g].key for g in order_g if self.graph(self.graphs[g].key).num_nodes <= self.config.max_ops]
        if not small:
            raise ValueError(f"no training graph has <= max_ops={self.config.max_ops} ops; raise max_ops")
        chosen = [(small[k % len(small)], int(order_c[k])) for k in range(self.config.pairs)]
        done = {(t["graph"], t["cluster"]) for t in have}
        with path.open("a") as f:
            for key, ci in chosen:
                cluster = self.clusters[ci]
                if (key, cluster.name) in done:
                    continue
                t0 = time.perf_counter()
                rec: dict[str, Any] = {"graph": key, "cluster": cluster.name, "cluster_index": ci, "search": search}
                graph = self.graph(key)
                try:
                    env = PlacementEnv(graph, cluster)
                    r = iterated_local_search(graph, cluster, budget_s=None, max_samples=self.config.search_samples,
                                              seed=self.config.seed + ci, seeds=env.seeds)
                    rec.update(target=canonical_target(r.device_of_node, cluster, env.sim).tolist(),
                               step_time_s=r.step_time_s, heuristic_s=env.reference_s, ops=graph.num_nodes)
                except (ValueError, RuntimeError) as e:  # nothing fits: no target
                    rec["skipped"] = str(e)[:200]
                rec["seconds"] = round(time.perf_counter() - t0, 2)
                self.seconds["search"] += rec["seconds"]
                f.write(json.dumps(rec) + "\n")
                f.flush()
                have.append(rec)
                log(f"target {len(have)}/{len(chosen)} {key} @ {cluster.name}: "
                    + (rec.get("skipped") or f"{rec['step_time_s'] / rec['heuristic_s']:.3f} of the best heuristic"))
        wanted = {(key, self.clusters[ci].name) for key, ci in chosen}
        return [t for t in have if "target" in t and (t["graph"], t["cluster"]) in wanted]

    # ---- training -----------------------------------------------------------------------

    def policy(self, t: dict[str, Any]) -> MarsPolicy:
        key = f"{t['graph']} @ {t['cluster']}"
        if key not in self._policies:
            self._policies[key] = MarsPolicy(self.net, self.graph(t["graph"]), self.clusters[t["cluster_index"]])
        return self._policies[key]

    def train_step(self, targets: list[dict[str, Any]]) -> float:
        t = targets[int(self.rng.integers(len(targets)))]
        policy = self.policy(t)
        target = torch.tensor([t["target"]], dtype=torch.long)
        if self.config.on_policy:
            from .env import PlacementEnv
            from .refine import refine

            policy.eval()
            with torch.no_grad():
                greedy = policy.decode(policy.sample(1, torch.Generator().manual_seed(self.step), greedy=True).actions)
            env = PlacementEnv(policy.graph, policy.cluster, reference_s=t["heuristic_s"])
            r = refine(env, greedy[0], seed=self.step, max_evaluations=self.config.on_policy)
            target = torch.from_numpy(r.device_of_node).unsqueeze(0)  # its own labels: no renaming
        policy.train()
        loss = imitation_loss(policy, target)
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.config.max_grad_norm)
        self.opt.step()
        return float(loss.item())

    def save(self) -> None:
        blob = {"config": asdict(self.config), "step": self.step, "net": self.net.state_dict(),
                "opt": self.opt.state_dict(), "rng": self.rng.bit_generator.state, "losses": self.losses,
                "seconds": self.seconds, "torch_rng": torch.get_rng_state()}
        tmp = self.work / "checkpoint.tmp"
        torch.save(blob, tmp)
        tmp.replace(self.work / "checkpoint.pt")

    def load(self) -> None:
        blob = torch.load(self.work / "checkpoint.pt", map_location="cpu", weights_only=False)
        saved = {k: v for k, v in blob["config"].items() if k not in ("steps", "checkpoint_every")}
        given = {k: v for k, v in asdict(self.config).items() if k not in ("steps", "checkpoint_every")}
        if saved != given:
            raise ValueError(f"--resume with different settings than the checkpoint in {self.work}: "
                             f"{ {k: (saved[k], given[k]) for k in saved if saved[k] != given.get(k)} } "
                             "(checkpoint, given); pass the same settings or use a new --work folder")
        self.step, self.losses, self.seconds = blob["step"], blob["losses"], blob["seconds"]
        self.net.load_state_dict(blob["net"])
        self.opt.load_state_dict(blob["opt"])
        self.rng.bit_generator.state = blob["rng"]
        torch.set_rng_state(blob["torch_rng"])


def imitate(config: ImitationConfig, *, out: Path, work: Path, name: str = "mars_imitation", resume: bool = False,
            time_limit_s: float | None = None, targets: Path | None = None, log: Any = None) -> dict[str, Any]:
    """Search the pairs' targets (cached in ``targets``, default ``work/targets.jsonl``; runs
    from different ``init`` weights can share one file), train on them for ``config.steps`` steps
    (or until ``time_limit_s``), and when done write ``out/name.pt`` and ``out/name.json``.
    Returns the record."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    work.mkdir(parents=True, exist_ok=True)
    run = _Run(config, work, targets if targets is not None else work / "targets.jsonl")
    if resume and (work / "checkpoint.pt").exists():
        run.load()
    elif (work / "checkpoint.pt").exists():
        raise FileExistsError(f"{work / 'checkpoint.pt'} exists; pass --resume to continue it or use a new --work")
    start = time.perf_counter()
    found = run.targets(log)
    if not found:
        raise ValueError(f"no training pair gave a target (pairs={config.pairs}, max_ops={config.max_ops}); "
                         "raise max_ops or pairs")
    last = time.perf_counter()
    window: list[float] = []
    while run.step < config.steps and not (time_limit_s is not None and time.perf_counter() - start > time_limit_s):
        window.append(run.train_step(found))
        run.step += 1
        now = time.perf_counter()
        run.seconds["train"] += now - last
        last = now
        if run.step % config.checkpoint_every == 0 or run.step == config.steps:
            run.losses.append((run.step, float(np.mean(window))))
            window = []
            run.save()
            log(f"step {run.step}/{config.steps}: mean NLL per op {run.losses[-1][1]:.4f}")
    run.save()
    record = {"made_by": "python -m autoplace.planners.learned.imitation " + " ".join(sys.argv[1:]),
              "config": asdict(config), "step": run.step, "done": run.step >= config.steps,
              "pairs": [{k: t[k] for k in ("graph", "cluster", "ops", "step_time_s", "heuristic_s", "seconds")}
                        for t in found],
              "clusters": [c.name for c in run.clusters], "losses": run.losses,
              "seconds": {k: round(v, 1) for k, v in run.seconds.items()},
              **{k: v for k, v in describe_split(run.graphs).items() if k != "corpus"},
              "torch": torch.__version__}
    if record["done"]:
        out.mkdir(parents=True, exist_ok=True)
        save_net(run.net, out / f"{name}.pt", made_by="autoplace.planners.learned.imitation", seed=config.seed)
        (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoplace.planners.learned.imitation",
                                     description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="where NAME.pt and NAME.json go")
    parser.add_argument("--name", default="mars_imitation", help="file name of the weights (without .pt)")
    parser.add_argument("--work", type=Path, default=Path(".cache/imitation"), help="targets, checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    parser.add_argument("--time-limit-s", type=float, default=None, help="end this sitting after so many seconds")
    parser.add_argument("--targets", type=Path, default=None, help="the targets file (default WORK/targets.jsonl)")
    for f in dataclasses.fields(ImitationConfig):
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"ImitationConfig.{f.name} (default {f.default!r})")
    args = parser.parse_args(argv)
    config = ImitationConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ImitationConfig)})
    torch.set_num_threads(1)
    record = imitate(config, out=args.out, work=args.work, name=args.name, resume=args.resume,
                     time_limit_s=args.time_limit_s, targets=args.targets)
    print(json.dumps({k: record[k] for k in ("step", "done", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
