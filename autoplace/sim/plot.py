"""Draw a :class:`SimResult`'s timeline as a Gantt chart (matplotlib, Agg backend, no display).

One lane per device (forward, backward, update), then one per link direction that carried a
transfer and one per replicated stage's all-reduce; time in milliseconds on the x axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import SimResult

__all__ = ["plot_timeline", "COLORS"]

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "update": "#55A868", "send": "#8172B3", "allreduce": "#C44E52"}


def _lane_key(lane: str) -> tuple[int, int, str]:
    head, _, rest = lane.partition(" ")
    order = {"dev": 0, "link": 1, "allreduce": 2}.get(head, 3)
    num = rest.split(" ")[0].split("->")[0].lstrip("s")
    return order, int(num) if num.isdigit() else 0, lane


def plot_timeline(result: "SimResult", path: str | Path, *, title: str | None = None) -> Path:
    """Write the Gantt chart of ``result`` to ``path`` (PNG); return the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not result.timeline:
        raise ValueError("this SimResult has no timeline; simulate with timeline=True to plot it")
    used = {e.device for e in result.timeline if e.kind != "send"}
    lanes = {e.lane for e in result.timeline}
    lanes |= {f"dev {d} {lab.split('(')[1].split(',')[0]}" for d, lab in enumerate(result.device_labels) if d in used}
    ordered = sorted(lanes, key=_lane_key)
    row = {lane: k for k, lane in enumerate(ordered)}
    fig_h = 1.0 + 0.42 * len(ordered)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    scale = 1e3
    for kind, color in COLORS.items():
        bars: dict[int, list[tuple[float, float]]] = {}
        for e in result.timeline:
            if e.kind == kind and e.end > e.start:
                bars.setdefault(row[e.lane], []).append((e.start * scale, (e.end - e.start) * scale))
        for y, spans in bars.items():
            ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=color, edgecolor="white", linewidth=0.3)
    if result.mode == "pipeline" and len(result.timeline) <= 600:
        for e in result.timeline:
            if e.kind in ("fwd", "bwd") and e.microbatch >= 0 and (e.end - e.start) * scale > 0:
                ax.text((e.start + e.end) / 2 * scale, row[e.lane], str(e.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
    ax.set_yticks(range(len(ordered)))
    ax.set_yticklabels(ordered)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("device / link")
    ax.set_xlim(0, max(result.step_time_s * scale, 1e-9) * 1.01)
    ax.grid(axis="x", alpha=0.3)
    head = title or (f"{result.mode} step {result.step_time_s * scale:.3f} ms"
                     + (f", {result.microbatches} micro-batches {result.schedule}, bubble "
                        f"{100 * result.bubble_fraction:.0f}%" if result.mode == "pipeline" else "")
                     + (", OUT OF MEMORY" if result.oom else ""))
    ax.set_title(head)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper left", bbox_to_anchor=(1.005, 1.0),
              fontsize=8, title="kind")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
