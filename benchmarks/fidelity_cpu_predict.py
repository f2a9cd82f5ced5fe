"""The predictions of :mod:`fidelity_cpu`: every timed plan as a :class:`~autoplace.Placement`,
simulated before (the profile as ``benchmarks/runtime.py`` had it) and after (the profiler and
the host probe as they are now), the two runtime constants fitted on ``FIT_MODELS``' pipeline
rows, and the ablation of the in-step passes (``no_in_step``: the same profile with its whole
passes timed back to back instead of inside training steps, and Adam's step timed alone; see
``autoplace.cost.profile``), with its own fit on the same rows."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

import autoplace
from autoplace import Cluster, CostModel, OpGraph, Placement
from autoplace.cost.host import HostCostModel, host_cluster
from autoplace.cost.profile import rescaled

WITHOUT: list[str] = []
"""HostCostModel fields left at their defaults (``fidelity_cpu.py --repredict --without NAME``)."""
SEQUENTIAL_SETS: list[bool] = [False]
"""True: message sets charged what the probe measured with each set received one tensor at a time
(``HostProbe.sequential_set_s``, the probe before ``shared_cores.receive_set``;
``fidelity_cpu.py --repredict --sequential-sets``), for a comparison on the same measurements."""
BN_OF_KIND = {"ddp": "local"}
"""``CostModel.batch_norm`` per plan kind as :mod:`fidelity_cpu` runs it: its ddp row is torch's own DDP
(``nn.BatchNorm`` per replica); its pipelines run the runtime's default, ``"sync"`` (one replica per
stage: no statistics all-reduce either)."""
FIT_MODELS: tuple[str, ...] = ("gpt2", "resnet18")
"""the models whose pipeline runs fit the two runtime constants (``fit_runtime``); the others
(GNMT-4 unrolled, Inception-V3) are held out."""


def placement(graph: OpGraph, plan: dict[str, Any], cluster: Cluster) -> Placement:
    n = graph.num_nodes
    kind = plan["kind"]
    if kind == "eager":
        return Placement.single(graph, cluster)
    if kind == "accumulate":
        return Placement.pipeline(graph, cluster, np.zeros(n, dtype=int), [0], microbatches=plan["microbatches"],
                                  schedule="gpipe")
    if kind == "model":
        return Placement.from_assignment(graph, cluster, plan["stage_of_node"])
    if kind == "ddp":
        return Placement.pipeline(graph, cluster, np.zeros(n, dtype=int), [[0, 1]], microbatches=1)
    return Placement.pipeline(graph, cluster, plan["stage_of_node"], [0, 1], microbatches=plan["microbatches"],
                              schedule=plan["schedule"])


def without_in_step(graph: OpGraph) -> OpGraph:
    """``graph`` as the profiler measured it before the in-step passes: every op's forward and
    backward scaled to the whole passes timed back to back (``whole_s["isolated"]``, at both
    batch sizes) and Adam's step timed alone (``update["alone_s"]``), by
    ``autoplace.cost.profile.rescaled``. The same measurement, so the difference is the term
    alone, not another moment's noise."""
    p = graph.meta["profile"]

    def isolated(whole: dict[str, Any]) -> dict[str, float]:
        iso = whole.get("isolated", {})
        return {k: iso.get(k, whole[k]) for k in ("fwd", "bwd")}

    whole = isolated(p["whole_s"])
    upd = p.get("update")
    if upd and upd.get("total_s", 0) > 0 and "alone_s" in upd:
        whole["update"] = upd["alone_s"]
    small = p.get("small")
    return rescaled(graph, whole, isolated(small["whole_s"]) if small and "fwd_time_s" in small else None)


def host_cost(probe: dict[str, Any], fit: tuple[float, float] = (0.0, 0.0), *, wall_terms: bool = True) -> HostCostModel:
    """The cost model with every probed term (and the fitted per-action and per-step constants);
    ``wall_terms=False`` leaves out the terms that are wall time outside the ranks' main-thread CPU
    (shared cores: ``busy_message_s``, ``idle_message_s``, ``spin_share``, ``busy_allreduce_s``), for the per-rank
    CPU comparison."""
    w = 1.0 if wall_terms else 0.0
    if SEQUENTIAL_SETS[0]:
        if not probe.get("sequential_set_s"):
            raise SystemExit("--sequential-sets: this run's probe has no sequential_set_s (probed before it existed)")
        probe = {**probe, "busy_set_s": probe["sequential_set_s"],
                 "set_spin_share": probe["sequential_set_spin_share"]}
    cost = HostCostModel(optimizer="adam", pipeline_action_s=probe["action_overhead_s"],
                         pipeline_step_s=probe.get("step_overhead_s", {}),
                         pipeline_tensor_s=probe.get("tensor_overhead_s", {}), batchnorm_s=probe.get("batchnorm_s", {}),
                         ddp_s=probe.get("ddp_s", {}), fitted_action_s=fit[0], fitted_step_s=fit[1],
                         busy_message_s=w * probe.get("busy_message_s", 0.0),
                         idle_message_s=w * probe.get("idle_message_s", 0.0),
                         spin_share=w * probe.get("spin_share", 0.0),
                         busy_set_s={n: w * v for n, v in probe.get("busy_set_s", {}).items()} if w else {},
                         set_spin_share=w * probe.get("set_spin_share", 0.0),
                         busy_allreduce_s=w * probe.get("busy_allreduce_s", 0.0))
    if WITHOUT:  # an ablation (--repredict --without NAME): the term left out
        blank = HostCostModel()
        cost = replace(cost, **{name: getattr(blank, name) for name in WITHOUT})
    return cost


def predictions(graph_old: OpGraph, graph: OpGraph, plans: dict[str, dict[str, Any]], probe: dict[str, Any],
                corun: float, fit: tuple[float, float] = (0.0, 0.0),
                fit_iso: tuple[float, float] = (0.0, 0.0), ahead: OpGraph | None = None) -> dict[str, dict[str, Any]]:
    """Simulated step seconds of every plan, before, after and after without the in-step passes
    (``fit_iso``: its own fitted constants; see the module docstring), and ``ahead_s``: after,
    from the profile ``ahead`` (as taken before the rounds; ``graph`` itself when None)."""
    iso = without_in_step(graph)
    iso_cost, iso_cpu = host_cost(probe, fit_iso), host_cost(probe, fit_iso, wall_terms=False)
    one = Cluster.from_devices(["cpu"])
    user_two = Cluster.from_devices(["cpu", "cpu"])
    p2p_old = host_cluster(2, latency_s=probe["latency_s"], bandwidth=probe["bandwidth"])
    p2p = host_cluster(2, latency_s=probe["latency_s"], bandwidth=probe["bandwidth"], corun=corun)
    ring = host_cluster(2, latency_s=probe["allreduce_latency_s"], bandwidth=probe["allreduce_bandwidth"],
                        corun=corun)
    before_cost = CostModel(optimizer="adam")
    after_cost = host_cost(probe, fit)
    cpu_cost = host_cost(probe, fit, wall_terms=False)
    out: dict[str, dict[str, Any]] = {}
    for key, plan in plans.items():
        kind = plan["kind"]
        if kind in ("eager", "accumulate"):
            cb = ca = one
        elif kind == "model":
            cb = ca = user_two  # what a user plans two targets on one CPU with
        elif kind == "ddp":
            cb, ca = p2p_old, ring
        else:
            cb, ca = p2p_old, p2p
        # fidelity_cpu runs its ddp row as torch's own DistributedDataParallel over nn.BatchNorm
        # (statistics per replica), not the runtime's batch_norm="sync": no statistics all-reduce
        bn = BN_OF_KIND.get(kind, "sync")
        before = autoplace.simulate(graph_old, placement(graph_old, plan, cb), cb,
                                    cost=replace(before_cost, batch_norm=bn), timeline=False)
        after = autoplace.simulate(graph, placement(graph, plan, ca), ca, cost=replace(after_cost, batch_norm=bn),
                                   timeline=False)
        cpu_only = autoplace.simulate(graph, placement(graph, plan, ca), ca, cost=replace(cpu_cost, batch_norm=bn),
                                      timeline=False)
        # CPU seconds each rank's main thread computes: its ops and update (no waiting, none of the
        # wall-time terms of shared cores)
        no_in = autoplace.simulate(iso, placement(iso, plan, ca), ca, cost=replace(iso_cost, batch_norm=bn),
                                   timeline=False)
        no_in_cpu = autoplace.simulate(iso, placement(iso, plan, ca), ca, cost=replace(iso_cpu, batch_norm=bn),
                                       timeline=False)
        out[key] = {"before_s": float(before.step_time_s), "after_s": float(after.step_time_s),
                    "cpu_terms_only_s": float(cpu_only.step_time_s),
                    "after_compute_s": [float(x) for x in cpu_only.compute_s],
                    "no_in_step_s": float(no_in.step_time_s),
                    "no_in_step_compute_s": [float(x) for x in no_in_cpu.compute_s]}
        out[key]["ahead_s"] = (float(autoplace.simulate(ahead, placement(ahead, plan, ca), ca,
                                                        cost=replace(after_cost, batch_norm=bn),
                                                        timeline=False).step_time_s)
                               if ahead is not None else out[key]["after_s"])
    return out


def in_round_graph(graph: OpGraph, model: dict[str, Any]) -> OpGraph | None:
    """The profile ``graph`` with its op times scaled to the whole passes timed inside the model's
    timed rounds (``fidelity_cpu_profile.IN_ROUND``; ``autoplace.cost.profile.rescaled``), or None for a
    run measured before they were."""
    passes = model.get("in_round") or {}
    if "whole_s" not in passes:
        return None
    return rescaled(graph, passes["whole_s"], passes.get("small_whole_s"))


def predict(models: list[dict[str, Any]], fit: tuple[float, float],
            fit_iso: tuple[float, float] = (0.0, 0.0)) -> None:
    """Fill every row's predictions (before, after with ``fit``, without the in-step passes with
    ``fit_iso``). ``after`` is from the profile scaled to the passes timed in the rounds where the
    run has them; ``ahead`` from the profile as it was taken before the rounds (the same fit)."""
    for m in models:
        old, graph, plans = m["_graphs"]
        now = in_round_graph(graph, m)
        pred = predictions(old, now if now is not None else graph, plans, m["probe"], m["corun"], fit, fit_iso,
                           ahead=graph if now is not None else None)
        for r in m["rows"]:
            p = pred[r["plan"]]
            med = r["measured_s"]["median"]
            r.update(ahead_s=p["ahead_s"], ratio_ahead=p["ahead_s"] / med)
            r.update(before_s=p["before_s"], after_s=p["after_s"], after_compute_s=p["after_compute_s"],
                     cpu_terms_only_s=p["cpu_terms_only_s"], no_in_step_s=p["no_in_step_s"],
                     no_in_step_compute_s=p["no_in_step_compute_s"],
                     ratio_before=p["before_s"] / med, ratio_after=p["after_s"] / med,
                     ratio_no_in_step=p["no_in_step_s"] / med)


def fit_runtime(models: list[dict[str, Any]], compute: str = "after_compute_s") -> dict[str, Any]:
    """Non-negative least squares of each rank's CPU seconds beyond its predicted compute
    (probed terms included) over the pipeline plans of ``FIT_MODELS``: ``residual = a x actions
    + b`` with ``a, b >= 0``, its actions ``2 M``. Returns a, b and the residuals."""
    fit_x, fit_y = [], []
    for m in models:
        for r in m["rows"]:
            if r["kind"] == "pipeline" and m["model"] in FIT_MODELS:
                for k in range(2):
                    fit_x.append([2 * r["microbatches"], 1.0])
                    fit_y.append(r["cpu_s_per_rank"][k] - r[compute][k])
    if len(fit_y) < 2:
        return {"action_s": 0.0, "step_s": 0.0, "rows": 0}
    from scipy.optimize import nnls

    (a, b), _ = nnls(np.array(fit_x), np.array(fit_y))  # a runtime adds time, never takes it away
    return {"action_s": float(a), "step_s": float(b), "rows": len(fit_y), "fit_models": list(FIT_MODELS),
            "residual_s": fit_y}
