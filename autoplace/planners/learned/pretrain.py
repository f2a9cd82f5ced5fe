"""Pretraining of the Mars policy: Deep Graph Infomax on the corpus, then PPO across many
(graph, cluster) pairs, so the shipped weights place graphs they have never seen.

    python -m autoplace.planners.learned.pretrain --out autoplace/weights/          # a full run
    python -m autoplace.planners.learned.pretrain --out autoplace/weights/ --resume # continue it
    python -m autoplace.planners.learned.pretrain --out /tmp/w --dgi-steps 20 --ppo-updates 4 --generated 4

Phase 1, Deep Graph Infomax (Velickovic et al., "Deep Graph Infomax", ICLR 2019), as Mars
(Lan, Chen, Li, ICPP 2021) pre-trains its encoder: for a graph with features ``X`` and
encoder ``E`` (:class:`autoplace.planners.learned.mars.encoders.SAGEEncoder`),

    H = E(X, A)                 positive patches (N, H)
    H~ = E(X[perm], A)          corruption: node features shuffled over the nodes
    s = sigmoid(mean_v H_v)     summary (H,)
    L = -mean_v log D(H_v, s) - mean_v log(1 - D(H~_v, s)),   D(h, s) = sigmoid(h^T W s)

minimised with Adam (``torch_geometric.nn.DeepGraphInfomax``), one corpus graph per step,
each paired with a random training cluster (the features include the op's time on the
cluster's fastest device).

Phase 2, PPO (Schulman et al., 2017) of the whole Mars network (encoder included) across
pairs drawn from the corpus graphs and the training clusters
(:func:`autoplace.planners.learned.corpus.training_clusters`): each update draws a pair, samples a
batch of placements, scores them in the simulator (reward ``-log(step / best heuristic)``,
OOM penalised: :class:`autoplace.planners.learned.env.PlacementEnv`) and runs the clipped update
of :mod:`autoplace.planners.learned.ppo` (its :class:`~autoplace.planners.learned.ppo.PPOUpdate`,
the rule the learned planners' loop runs, with ``PretrainConfig.ppo``). The baseline is kept
per pair (rewards of different pairs are not comparable), which is why the outer loop is not
:func:`autoplace.planners.learned.loop.run` (one environment); the rollout and update are its.
Pairs where no heuristic fits in memory are skipped.

The run writes to ``--work`` (default ``.cache/pretrain``, gitignored): ``checkpoint.pt``
(network, optimizer, baselines, random states, history; every ``--checkpoint-every``
updates and on exit) and ``log.jsonl`` (one line per step). ``--resume`` continues from the
checkpoint exactly where it stopped; ``--time-limit-s`` ends a sitting cleanly. When both
phases are done, ``--out`` gets ``mars.pt`` (the network), ``mars_dgi.pt`` (the encoder after
phase 1, with a fresh placer: the "pretrained GNN only" variant) and ``mars.json`` (corpus,
held-out list, clusters, seed, settings, durations, losses).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .corpus import CorpusGraph, describe_split, training_clusters, training_graphs
from .mars.planner import MarsNet, MarsPolicy, new_net, save_net
from .ppo import PPOConfig, PPOUpdate, progress_bar

__all__ = ["PretrainConfig", "pretrain", "dgi_model", "main"]


def _default_ppo() -> PPOConfig:
    return PPOConfig(lr=3e-4, samples_per_update=16, ent_coef=0.001, baseline_decay=0.8)


@dataclass(frozen=True)
class PretrainConfig:
    """Settings of a pretraining run (recorded in ``mars.json``)."""

    seed: int = 0
    """seed of everything: initial weights, corpus draws, pair draws, samples, shuffles."""
    hidden: int = 64
    """width H of the network."""
    gnn_layers: int = 3
    """GraphSAGE layers of the encoder."""
    segment: int = 64
    """ops per segment of the placer."""
    sources: str = "zoo,pipedream,generated"
    """corpus sources, comma separated (tests use "generated" alone: no tracing)."""
    pipedream_dir: str = ""
    """the folder of PipeDream profiles ("": ``$AUTOPLACE_PIPEDREAM_DIR``, else none are read)."""
    generated: int = 40
    """generated graphs in the corpus (random DAGs and layered networks)."""
    random_clusters: int = 8
    """random clusters added to the training presets."""
    dgi_steps: int = 3000
    """Deep Graph Infomax steps (one graph each)."""
    dgi_lr: float = 1e-3
    """Adam learning rate of DGI."""
    ppo_updates: int = 3000
    """PPO updates (one (graph, cluster) pair and one batch each)."""
    ppo: PPOConfig = field(default_factory=_default_ppo)
    """the PPO update (lr 3e-4, 16 placements per update, entropy bonus 0.001 (entropy is
    summed over a placement's ops), baseline decay 0.8 for each pair's own moving-average
    baseline); its ``seed`` and ``history_every`` are not read (``seed`` seeds everything)."""
    max_ops: int = 1600
    """graphs with more ops are left out of PPO (they still serve DGI)."""
    checkpoint_every: int = 25
    """PPO updates (or DGI steps / 20) between checkpoints."""

    def __post_init__(self) -> None:
        for name in ("hidden", "gnn_layers", "segment", "checkpoint_every", "max_ops"):
            if getattr(self, name) < 1:
                raise ValueError(f"PretrainConfig.{name} is {getattr(self, name)}; it must be >= 1")
        for name in ("dgi_steps", "ppo_updates", "generated", "random_clusters"):
            if getattr(self, name) < 0:
                raise ValueError(f"PretrainConfig.{name} is {getattr(self, name)}; it must be >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PretrainConfig":
        """The config ``asdict`` wrote (a checkpoint's, ``mars.json``'s); also reads the flat
        layout of older checkpoints, whose PPO fields sat beside the others."""
        d = dict(d)
        ppo = dict(d.pop("ppo", None) or {})
        ppo_names = {f.name for f in dataclasses.fields(PPOConfig)}
        for name in [k for k in d if k in ppo_names and k != "seed"]:
            ppo[name] = d.pop(name)
        return cls(**d, ppo=dataclasses.replace(_default_ppo(), **ppo))


def dgi_model(net: MarsNet, generator: torch.Generator) -> Any:
    """``torch_geometric.nn.DeepGraphInfomax`` around ``net.encoder``: corruption shuffles the
    node features (with ``generator``), the summary is the sigmoid of the mean embedding.
    Note: building it re-initialises the encoder (PyG resets its parameters)."""
    from torch_geometric.nn import DeepGraphInfomax

    def corruption(x: torch.Tensor, edge_index: torch.Tensor, edge_attr: torch.Tensor) -> tuple:
        return x[torch.randperm(x.shape[0], generator=generator)], edge_index, edge_attr

    def summary(z: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.sigmoid(z.mean(dim=0))

    return DeepGraphInfomax(net.hidden, net.encoder, summary=summary, corruption=corruption)


_EXTENDABLE = ("ppo_updates", "checkpoint_every")
"""Settings a resumed run may change (to extend a run or checkpoint more often)."""


class _Run:
    """The state of a pretraining run: what a checkpoint holds."""

    def __init__(self, config: PretrainConfig, work: Path, log: Callable[[str], None]) -> None:
        self.config, self.work, self.log = config, work, log
        torch.manual_seed(config.seed)
        self.graphs = training_graphs(generated=config.generated, seed=config.seed,
                                      sources=tuple(config.sources.split(",")), pipedream=config.pipedream_dir)
        if not self.graphs:
            raise ValueError(f"the corpus is empty for sources={config.sources!r} and generated={config.generated}")
        self.clusters = training_clusters(random=config.random_clusters, seed=config.seed)
        self.net = new_net(hidden=config.hidden, gnn_layers=config.gnn_layers, segment=config.segment)
        self.dgi_gen = torch.Generator().manual_seed(config.seed + 1)
        self.dgi = dgi_model(self.net, self.dgi_gen)  # re-initialises the encoder, seeded above
        self.gen = torch.Generator().manual_seed(config.seed + 2)
        self.rng = np.random.default_rng(config.seed + 3)
        self.phase = "dgi"
        self.step = 0
        self.dgi_opt = torch.optim.Adam(self.dgi.parameters(), lr=config.dgi_lr)
        self.opt: torch.optim.Optimizer | None = None
        self.baselines: dict[str, float] = {}
        self.skipped: dict[str, str] = {}
        self.history: list[dict[str, Any]] = []
        self.sittings: list[dict[str, Any]] = []
        self.elapsed = {"dgi": 0.0, "ppo": 0.0}
        self.dgi_state: dict[str, torch.Tensor] | None = None
        self._graph_cache: dict[str, Any] = {}
        self._envs: OrderedDict[str, tuple[Any, MarsPolicy]] = OrderedDict()

    # ---- checkpoints --------------------------------------------------------------------

    def save(self) -> None:
        blob = {
            "config": asdict(self.config), "phase": self.phase, "step": self.step,
            "net": self.net.state_dict(), "dgi_weight": self.dgi.weight.detach().clone(),
            "dgi_opt": self.dgi_opt.state_dict(), "opt": self.opt.state_dict() if self.opt else None,
            "dgi_gen": self.dgi_gen.get_state(), "gen": self.gen.get_state(),
            "rng": self.rng.bit_generator.state, "baselines": self.baselines, "skipped": self.skipped,
            "history": self.history, "sittings": self.sittings, "elapsed": self.elapsed,
            "dgi_state": self.dgi_state,
        }
        tmp = self.work / "checkpoint.tmp"
        torch.save(blob, tmp)
        tmp.replace(self.work / "checkpoint.pt")

    def load(self) -> None:
        blob = torch.load(self.work / "checkpoint.pt", map_location="cpu", weights_only=False)
        saved, given = asdict(PretrainConfig.from_dict(blob["config"])), asdict(self.config)
        diff = {k: (v, given[k]) for k, v in saved.items() if given[k] != v and k not in _EXTENDABLE}
        if diff:
            raise ValueError(f"--resume with different settings than the checkpoint in {self.work}: {diff} "
                             "(checkpoint value, given value); pass the same settings or use a new --work folder")
        self.phase, self.step = blob["phase"], blob["step"]
        self.net.load_state_dict(blob["net"])
        with torch.no_grad():
            self.dgi.weight.copy_(blob["dgi_weight"])
        self.dgi_opt.load_state_dict(blob["dgi_opt"])
        if blob["opt"] is not None:
            self.opt = self._ppo_optimizer()
            self.opt.load_state_dict(blob["opt"])
        self.dgi_gen.set_state(blob["dgi_gen"])
        self.gen.set_state(blob["gen"])
        self.rng.bit_generator.state = blob["rng"]
        self.baselines, self.skipped = blob["baselines"], blob["skipped"]
        self.history, self.sittings, self.elapsed = blob["history"], blob["sittings"], blob["elapsed"]
        self.dgi_state = blob["dgi_state"]

    # ---- data ---------------------------------------------------------------------------

    def graph(self, entry: CorpusGraph) -> Any:
        g = self._graph_cache.get(entry.key)
        if g is None:
            g = self._graph_cache[entry.key] = entry.load()
        return g

    def _ppo_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=self.config.ppo.lr, eps=1e-5)

    # ---- phase 1 ------------------------------------------------------------------------

    def dgi_step(self) -> dict[str, Any]:
        from autoplace.planners.learned.features import to_pyg

        entry = self.graphs[int(self.rng.integers(len(self.graphs)))]
        cluster = self.clusters[int(self.rng.integers(len(self.clusters)))]
        data = to_pyg(self.graph(entry), cluster)
        self.dgi.train()
        pos, neg, s = self.dgi(data.x, data.edge_index, data.edge_attr)
        loss = self.dgi.loss(pos, neg, s)
        self.dgi_opt.zero_grad()
        loss.backward()
        self.dgi_opt.step()
        return {"phase": "dgi", "step": self.step, "graph": entry.key, "loss": loss.item()}

    # ---- phase 2 ------------------------------------------------------------------------

    def pair(self) -> tuple[str, Any, MarsPolicy] | None:
        """Draw a (graph, cluster) pair; None when it is unusable (too big, nothing fits)."""
        from .env import PlacementEnv

        gi, ci = int(self.rng.integers(len(self.graphs))), int(self.rng.integers(len(self.clusters)))
        entry, cluster = self.graphs[gi], self.clusters[ci]
        key = f"{entry.key} @ {cluster.name}"
        if key in self.skipped:
            return None
        if key in self._envs:
            self._envs.move_to_end(key)
            env, policy = self._envs[key]
            return key, env, policy
        graph = self.graph(entry)
        if graph.num_nodes > self.config.max_ops:
            self.skipped[key] = f"{graph.num_nodes} ops > max_ops"
            return None
        try:
            env = PlacementEnv(graph, cluster, None, "model")
        except ValueError as e:
            self.skipped[key] = str(e)[:200]
            return None
        if env.best_candidate is None:
            self.skipped[key] = "no heuristic fits in memory"
            return None
        policy = MarsPolicy(self.net, graph, cluster)
        self._envs[key] = (env, policy)
        while len(self._envs) > 96:
            self._envs.popitem(last=False)
        return key, env, policy

    def ppo_step(self) -> dict[str, Any] | None:
        drawn = self.pair()
        if drawn is None:
            return None
        key, env, policy = drawn
        cfg = self.config.ppo
        if self.opt is None:
            self.opt = self._ppo_optimizer()
        n = cfg.samples_per_update
        rule = PPOUpdate(cfg, optimizer=self.opt, params=self.net.parameters)  # the planners' PPO update
        # ---- rollout -------------------------------------------------------------------
        s = rule.sample(policy, n, self.gen)
        rewards_np, evals = env.evaluate_many(policy.decode(s.actions))
        # ---- one PPO update, with this pair's own moving-average baseline -------------------
        self.baselines[key], upd = rule.update(policy, s, rewards_np, self.baselines.get(key), self.gen)
        fits = [e.step_time_s for e in evals if not e.oom]
        _, greedy = env.evaluate_many(policy.decode(policy.sample(1, self.gen, greedy=True).actions))
        return {"phase": "ppo", "step": self.step, "pair": key, "ops": policy.num_ops,
                "devices": policy.num_devices, "charts/mean_reward": upd["charts/mean_reward"],
                "charts/best_reward": float(np.max(rewards_np)),
                "charts/oom_share": float(np.mean([e.oom for e in evals])),
                "charts/best_sample_vs_heuristic": (min(fits) / env.reference_s) if fits else None,
                "charts/greedy_vs_heuristic": None if greedy[0].oom else greedy[0].step_time_s / env.reference_s,
                "losses/approx_kl": upd["losses/approx_kl"], "losses/clipfrac": upd["losses/clipfrac"],
                "losses/entropy_per_op": float(s.entropy.mean()) / policy.num_ops}


def pretrain(config: PretrainConfig, *, out: Path, work: Path, resume: bool = False,
             time_limit_s: float | None = None, sitting_steps: int | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Run (or continue, ``resume``) pretraining; this sitting ends after ``time_limit_s``
    seconds or ``sitting_steps`` steps (DGI steps and PPO updates) if given. Writes the
    weights and ``mars.json`` to ``out`` when both phases are done. Returns the run's record
    (what ``mars.json`` holds, or the progress so far)."""
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log_file = (work / "log.jsonl").open("a")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    run = _Run(config, work, log)
    if resume:
        if not (work / "checkpoint.pt").exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {work / 'checkpoint.pt'}; start without --resume")
        run.load()
        log(f"resumed {run.phase} at step {run.step}")
    elif (work / "checkpoint.pt").exists():
        raise FileExistsError(f"{work / 'checkpoint.pt'} exists; pass --resume to continue it or use a new --work")
    start = time.perf_counter()
    steps_done = 0
    sitting = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phase": run.phase, "step": run.step,
               "command": "python -m autoplace.planners.learned.pretrain " + " ".join(sys.argv[1:])}
    run.sittings.append(sitting)

    def out_of_time() -> bool:
        if sitting_steps is not None and steps_done >= sitting_steps:
            return True
        return time_limit_s is not None and time.perf_counter() - start > time_limit_s

    try:
        if run.phase == "dgi":
            bar = progress_bar(progress, config.dgi_steps, "graph", "dgi")
            bar.update(run.step)
            last, ema = time.perf_counter(), None
            while run.step < config.dgi_steps and not out_of_time():
                rec = run.dgi_step()
                run.step += 1
                steps_done += 1
                ema = rec["loss"] if ema is None else 0.98 * ema + 0.02 * rec["loss"]
                rec["loss_ema"] = ema
                log_file.write(json.dumps(rec) + "\n")
                bar.update(1, loss=f"{ema:.3f}")
                now = time.perf_counter()
                run.elapsed["dgi"] += now - last
                last = now
                if run.step % max(1, config.checkpoint_every * 20) == 0:
                    run.history.append({k: rec[k] for k in ("phase", "step", "loss_ema")})
                    run.save()
            bar.close()
            if run.step >= config.dgi_steps:
                run.history.append({"phase": "dgi", "step": run.step, "loss_ema": ema})
                run.dgi_state = {k: v.detach().clone() for k, v in run.net.encoder.state_dict().items()}
                run.phase, run.step = "ppo", 0
                run.save()
        if run.phase == "ppo":
            bar = progress_bar(progress, config.ppo_updates, "update", "ppo")
            bar.update(run.step)
            last = time.perf_counter()
            window: list[dict[str, Any]] = []
            while run.step < config.ppo_updates and not out_of_time():
                update = run.ppo_step()
                now = time.perf_counter()
                run.elapsed["ppo"] += now - last
                last = now
                if update is None:
                    continue
                run.step += 1
                steps_done += 1
                log_file.write(json.dumps(update) + "\n")
                window.append(update)
                bar.update(1, reward=f"{update['charts/mean_reward']:+.3f}")
                if run.step % config.checkpoint_every == 0 or run.step == config.ppo_updates:
                    run.history.append(_summary(window, run.step))
                    window = []
                    run.save()
                    log(json.dumps(run.history[-1]))
            bar.close()
            if run.step >= config.ppo_updates:
                run.phase = "done"
                run.save()
    finally:
        sitting.update(ended=time.strftime("%Y-%m-%d %H:%M:%S"), seconds=round(time.perf_counter() - start, 1),
                       to_phase=run.phase, to_step=run.step)
        run.save()
        log_file.close()
    record = _record(run)
    if run.phase == "done":
        save_net(run.net, out / "mars.pt", made_by="autoplace.planners.learned.pretrain", seed=config.seed)
        torch.manual_seed(config.seed + 4)  # the untrained placer of the DGI-only variant
        dgi_net = new_net(hidden=config.hidden, gnn_layers=config.gnn_layers, segment=config.segment)
        if run.dgi_state is not None:
            dgi_net.encoder.load_state_dict(run.dgi_state)
        save_net(dgi_net, out / "mars_dgi.pt", made_by="autoplace.planners.learned.pretrain (phase 1 only)",
                 seed=config.seed)
        (out / "mars.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _summary(window: list[dict[str, Any]], step: int) -> dict[str, Any]:
    def geomean(key: str) -> float | None:
        ratios = [r[key] for r in window if r[key]]
        return float(np.exp(np.mean(np.log(ratios)))) if ratios else None

    return {"phase": "ppo", "step": step, "mean_reward": float(np.mean([r["charts/mean_reward"] for r in window])),
            "best_reward": float(np.mean([r["charts/best_reward"] for r in window])),
            "oom_share": float(np.mean([r["charts/oom_share"] for r in window])),
            "best_sample_vs_heuristic_geomean": geomean("charts/best_sample_vs_heuristic"),
            "greedy_vs_heuristic_geomean": geomean("charts/greedy_vs_heuristic"),
            "greedy_oom_share": float(np.mean([r["charts/greedy_vs_heuristic"] is None for r in window])),
            "entropy_per_op": float(np.mean([r["losses/entropy_per_op"] for r in window]))}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _record(run: _Run) -> dict[str, Any]:
    split = describe_split(run.graphs)
    return {
        "made_by": "python -m autoplace.planners.learned.pretrain " + " ".join(sys.argv[1:]),
        "config": asdict(run.config), "phase": run.phase, "step": run.step,
        "corpus": split["corpus"], "held_out": split["held_out"], "held_out_families": split["held_out_families"],
        "clusters": [c.name for c in run.clusters], "skipped_pairs": len(run.skipped),
        "seconds": {k: round(v, 3) for k, v in run.elapsed.items()}, "sittings": run.sittings,
        "history": run.history, "parameters": sum(p.numel() for p in run.net.parameters()),
        "torch": torch.__version__, "python": platform.python_version(), "git_commit": _git_commit(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoplace.planners.learned.pretrain", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where mars.pt, mars_dgi.pt and mars.json go")
    parser.add_argument("--work", type=Path, default=Path(".cache/pretrain"), help="checkpoint and log folder")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    parser.add_argument("--time-limit-s", type=float, default=None, help="end this sitting after so many seconds")
    parser.add_argument("--sitting-steps", type=int, default=None, help="end this sitting after so many steps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    top = [f for f in dataclasses.fields(PretrainConfig) if f.name != "ppo"]
    ppo = [f for f in dataclasses.fields(PPOConfig) if f.name not in ("seed", "history_every")]
    default_ppo = _default_ppo()
    for f in top:
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                            help=f"PretrainConfig.{f.name} (default {f.default})")
    for f in ppo:  # the PPO fields under their own names, as before they moved into PretrainConfig.ppo
        default = getattr(default_ppo, f.name)
        kind: Callable[[str], Any] = float if f.name == "target_kl" else \
            (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default,
                            help=f"PretrainConfig.ppo.{f.name} (default {default})")
    args = parser.parse_args(argv)
    config = PretrainConfig(**{f.name: getattr(args, f.name) for f in top},
                            ppo=PPOConfig(**{f.name: getattr(args, f.name) for f in ppo}))
    torch.set_num_threads(1)

    def stop(signum: int, frame: Any) -> None:  # `kill` ends the sitting like Ctrl-C: checkpoint saved
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    record = pretrain(config, out=args.out, work=args.work, resume=args.resume, time_limit_s=args.time_limit_s,
                      sitting_steps=args.sitting_steps, progress=not args.no_progress)
    print(json.dumps({k: record[k] for k in ("phase", "step", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
