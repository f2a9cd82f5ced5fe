"""Draw a :class:`SimResult`'s timeline as a Gantt chart (matplotlib, Agg backend, no display).

One lane per device (forward, backward, update), then one per link direction that carried a
transfer and one per replicated stage's all-reduce; time in milliseconds on the x axis. The
legend lists only the kinds of work the step has; in a pipeline the number on a forward or
backward bar is its micro-batch (0 the first), and the legend says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AutoplaceError

if TYPE_CHECKING:
    from .result import SimResult

__all__ = ["plot_timeline", "legend_entries", "microbatch_note", "COLORS", "LABELS"]

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "update": "#55A868", "send": "#8172B3", "allreduce": "#C44E52"}
LABELS = {"fwd": "forward", "bwd": "backward", "update": "optimizer update", "send": "transfer (send)",
          "allreduce": "gradient all-reduce"}
_MAX_LABELLED = 600  # events; above it the micro-batch numbers would not be legible


class PlotError(AutoplaceError, ValueError):
    """A result that cannot be drawn (no timeline)."""


def legend_entries(result: "SimResult") -> list[tuple[str, str]]:
    """(label, color) of each kind of work drawn: only the kinds the timeline holds (no
    "transfer" entry for a step that sends nothing)."""
    drawn = {e.kind for e in result.timeline if e.end > e.start}
    return [(LABELS[k], c) for k, c in COLORS.items() if k in drawn]


def microbatch_note(result: "SimResult") -> str:
    """What the numbers on the bars mean, when the chart draws them ("" when it does not)."""
    if result.mode != "pipeline" or len(result.timeline) > _MAX_LABELLED:
        return ""
    if not any(e.kind in ("fwd", "bwd") and e.microbatch >= 0 and e.end > e.start for e in result.timeline):
        return ""
    return f"n on a bar: micro-batch n (0..{result.microbatches - 1})"


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
        raise PlotError("this SimResult has no timeline; simulate with timeline=True to plot it")
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
    note = microbatch_note(result)
    if note:
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
    handles = [Patch(color=c, label=label) for label, c in legend_entries(result)]
    if note:
        handles.append(Patch(facecolor="none", edgecolor="none", label=note))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, title="work")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
