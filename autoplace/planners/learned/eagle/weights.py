"""EAGLE's trained networks, kept so that online fine-tuning of an EAGLE plan starts from the
network the planner trained (``placement.meta["tuned_weights"]``), as Mars's fine-tuned ones are.

An EAGLE network belongs to one graph on one device count (its per-op and per-group residual
tables, its G groups). The file holds the constructor sizes and the parameters only; the
buffers (the graph's features and edges) are rebuilt from the graph when it is loaded, so a
network trained on the simulator's cluster loads onto the same graph on a calibrated one.
Files live under :func:`~autoplace.planners.learned.mars.tuned.tuned_dir` ``("eagle")``, named
by a hash of the network; every plan writes one, so the folder keeps the newest :data:`KEEP`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..mars.tuned import keep_network

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from .network import EaglePolicy

__all__ = ["FORMAT", "KEEP", "save_policy", "load_policy", "keep_trained"]

FORMAT = "autoplace.EaglePolicy/1"
KEEP = 32
"""Trained networks kept in the folder (the oldest go first)."""


def _sizes(policy: "EaglePolicy") -> dict[str, int]:
    return {"num_nodes": policy.num_nodes, "num_devices": policy.num_devices, "groups": policy.num_groups,
            "hidden": policy.group_out.in_features}


def save_policy(policy: "EaglePolicy", path: str | Path) -> None:
    """Write ``policy``'s sizes and parameters (not its graph buffers) to ``path``."""
    params = {k: v.detach().clone() for k, v in policy.named_parameters()}
    torch.save({"format": FORMAT, "config": _sizes(policy), "parameters": params}, path)


def load_policy(path: str | Path, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None
                ) -> "EaglePolicy":
    """The network saved at ``path``, rebuilt for ``graph`` on ``cluster`` (the graph it was
    trained on, on a cluster of as many devices)."""
    from autoplace.planners.learned.features import node_features
    from .network import EaglePolicy

    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"{path} is not an EAGLE network file (expected format {FORMAT!r}); "
                         "plan with planner='eagle' to make one")
    cfg: dict[str, Any] = blob["config"]
    if cfg["num_nodes"] != graph.num_nodes or cfg["num_devices"] != cluster.num_devices:
        raise ValueError(f"{path} holds an EAGLE network for {cfg['num_nodes']} ops on {cfg['num_devices']} devices; "
                         f"this graph has {graph.num_nodes} ops and the cluster {cluster.num_devices} devices: "
                         "an EAGLE network places only the graph it was trained on (plan it again)")
    policy = EaglePolicy(graph, node_features(graph, cluster, cost=cost), cluster.num_devices, groups=cfg["groups"],
                         hidden=cfg["hidden"])  # as planner.build_policy builds it; the parameters are then the file's
    mine = dict(policy.named_parameters())
    theirs: dict[str, torch.Tensor] = blob["parameters"]
    wrong = sorted(set(mine) ^ set(theirs)) + [k for k in mine if k in theirs and mine[k].shape != theirs[k].shape]
    if wrong:
        raise ValueError(f"{path}: parameters {', '.join(wrong[:5])} do not match this version's EAGLE network "
                         "(the op features changed since it was saved); plan with planner='eagle' again")
    with torch.no_grad():
        for k, p in mine.items():
            p.copy_(theirs[k])
    return policy


def keep_trained(policy: "EaglePolicy") -> Path:
    """Save ``policy`` under ``tuned_dir("eagle")`` (the same network is one file), drop all but
    the newest :data:`KEEP` there, and return the path (``placement.meta["tuned_weights"]``)."""
    return keep_network(policy, "eagle", lambda path: save_policy(policy, path), KEEP)
