"""pipeline-rl's fine-tuned networks, kept so that online tuning of a pipeline-rl plan proposes
from the network the planner tuned on the graph (``placement.meta["tuned_weights"]``), as Mars's
and EAGLE's trained networks are kept.

A fine-tuned :class:`~.policy.PipelinePolicy` belongs to one graph on one cluster: besides the
shared network (what the pretrained weights hold) it has per-graph tables (a bias per op, per
stage count, per device choice and per micro-batch option) whose shapes are the action space's.
The file holds the sizes of that space and every parameter, not the buffers (the graph's
features, edges and stage features): those are rebuilt from the graph, cluster and cost when it
is loaded, so a network tuned on the simulator's cost loads under a calibrated one. Files live
under :func:`~autoplace.planners.learned.mars.tuned.tuned_dir` ``("pipeline-rl")``, named by a
hash of the network (a path in the plan's meta, a few dozen bytes of its JSON); every plan
writes one, so the folder keeps the newest :data:`KEEP`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..mars.tuned import keep_network

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from .policy import PipelinePolicy

__all__ = ["FORMAT", "KEEP", "save_policy", "load_policy", "keep_tuned"]

FORMAT = "autoplace.PipelinePolicy/1"
KEEP = 32
"""Fine-tuned networks kept in the folder (the oldest go first)."""


def _sizes(policy: "PipelinePolicy") -> dict[str, Any]:
    sp = policy.space
    return {"num_nodes": sp.num_nodes, "num_devices": sp.num_devices, "max_stages": sp.max_stages,
            "microbatch_options": [int(m) for m in sp.microbatch_options], "hidden": int(policy.inp.out_features),
            "layers": len(policy.layers), "explore": float(policy.explore), "table_scale": float(policy.table_scale),
            "temperature": float(policy.temperature)}


def save_policy(policy: "PipelinePolicy", path: str | Path, graph_hash: str = "") -> None:
    """Write ``policy``'s sizes and parameters (not its graph buffers) to ``path``, with the hash
    of the graph it was tuned on (:attr:`autoplace.graph.ir.OpGraph.hash`) when given."""
    params = {k: v.detach().clone() for k, v in policy.named_parameters()}
    torch.save({"format": FORMAT, "config": {**_sizes(policy), "graph_hash": graph_hash}, "parameters": params}, path)


def load_policy(path: str | Path, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, *,
                seed: int = 0) -> "PipelinePolicy":
    """The network saved at ``path``, rebuilt for ``graph`` on ``cluster`` under ``cost`` (the graph
    it was tuned on, on a cluster of as many devices), at the sampling temperature the planner left
    it at (raised by its entropy floor while PPO converged: the distribution its last samples came
    from). Raises ValueError when the file is no such network or its action space is not this
    graph's and cluster's."""
    from autoplace.planners.learned.features import node_features
    from autoplace.sim import simulator_for
    from .policy import PipelinePolicy, device_features, summary_features
    from .space import PipelineSpace

    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"{path} is not a pipeline-rl network file (expected format {FORMAT!r}); "
                         "plan with planner='pipeline-rl' to make one")
    cfg: dict[str, Any] = blob["config"]
    if cfg["num_nodes"] != graph.num_nodes or cfg["num_devices"] != cluster.num_devices:
        raise ValueError(f"{path} holds a pipeline-rl network for {cfg['num_nodes']} ops on {cfg['num_devices']} "
                         f"devices; this graph has {graph.num_nodes} ops and the cluster {cluster.num_devices} "
                         "devices: a fine-tuned network places only the graph it was tuned on (plan it again)")
    if cfg.get("graph_hash") and cfg["graph_hash"] != graph.hash:
        raise ValueError(f"{path} holds a pipeline-rl network tuned on graph {cfg['graph_hash']}; this graph is "
                         f"{graph.hash}: a fine-tuned network places only the graph it was tuned on (plan it again)")
    sim = simulator_for(graph, cluster, cost)
    space = PipelineSpace.of(graph, cluster, sim, max_stages=int(cfg["max_stages"]),
                             extra_microbatches=cfg["microbatch_options"])
    if space.max_stages != cfg["max_stages"] or list(space.microbatch_options) != cfg["microbatch_options"]:
        raise ValueError(f"{path}: the network chooses among {cfg['max_stages']} stage counts and the micro-batch "
                         f"counts {cfg['microbatch_options']}; on this graph and cluster the choices are "
                         f"{space.max_stages} and {list(space.microbatch_options)} (another batch size or cluster): "
                         "plan it again with planner='pipeline-rl'")
    x = np.asarray(node_features(graph, cluster, cost=sim.cost), dtype=np.float32)
    policy = PipelinePolicy(space, x, device_features(space, cluster), summary_features(space, sim, sim.cost),
                            hidden=int(cfg["hidden"]), layers=int(cfg["layers"]), explore=float(cfg["explore"]),
                            seed=seed)  # as the planner builds it; the parameters are then the file's
    mine = dict(policy.named_parameters())
    theirs: dict[str, torch.Tensor] = blob["parameters"]
    wrong = sorted(set(mine) ^ set(theirs)) + [k for k in mine if k in theirs and mine[k].shape != theirs[k].shape]
    if wrong:
        raise ValueError(f"{path}: parameters {', '.join(wrong[:5])} do not match this version's pipeline policy "
                         "(the op features changed since it was saved); plan with planner='pipeline-rl' again")
    with torch.no_grad():
        for k, p in mine.items():
            p.copy_(theirs[k])
    policy.table_scale = float(cfg["table_scale"])
    policy.temperature = float(cfg["temperature"])
    return policy


def keep_tuned(policy: "PipelinePolicy", graph_hash: str = "") -> Path:
    """Save ``policy`` under ``tuned_dir("pipeline-rl")`` (the same network is one file), drop all
    but the newest :data:`KEEP` there, and return the path (``placement.meta["tuned_weights"]``)."""
    return keep_network(policy, "pipeline-rl", lambda path: save_policy(policy, path, graph_hash), KEEP)
