"""``plan.save_png(path)``: the step's memory as a stacked area by category, the peak marked.

matplotlib is imported here only, when a picture is asked for (the ``[plot]`` extra); it draws
through its object API on an Agg canvas, leaving pyplot's global state and backend alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorscope._units import format_bytes
from tensorscope.errors import PlanFileError
from tensorscope.plan.data import CATEGORIES
from tensorscope.plan.snapshot import check_writable

if TYPE_CHECKING:
    from tensorscope.plan.model import MemoryPlan

__all__ = ["COLORS", "save_png"]

COLORS = {
    "parameter": "#4c72b0",
    "sharded_parameter": "#64b5cd",
    "unsharded_parameter": "#8da0cb",
    "gradient": "#dd8452",
    "optimizer_state": "#8172b3",
    "activation": "#55a868",
    "temporary": "#c44e52",
    "reduce_scatter": "#ccb974",
    "other": "#8c8c8c",
}
_PHASE_SHADES = {"backward": "#f2f2f2", "optimizer": "#e6e6f5"}


def _matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "tensorscope.plan: save_png() draws with matplotlib, which is not installed; "
            "install the plot extra: pip install 'tensorscope[plot]'"
        ) from error
    return Figure, FigureCanvasAgg


def _unit(peak: int) -> tuple[float, str]:
    for scale, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if peak >= 2 * scale:
            return float(scale), name
    return 1.0, "B"


def save_png(plan: MemoryPlan, path: Any, *, title: str | None = None) -> None:
    """Draw the plan (see the module docstring) into a PNG file at ``path``."""
    figure_type, canvas_type = _matplotlib()
    text = check_writable(path, "save_png()")
    scale, unit = _unit(plan.peak_bytes)
    ops = [row[0] for row in plan.timeline]
    shown = [c for c in CATEGORIES if c in plan.at_peak]
    series = [[row[2].get(c, 0) / scale for row in plan.timeline] for c in shown]
    figure = figure_type(figsize=(11, 5.5), dpi=110)
    canvas_type(figure)
    axes = figure.add_subplot(1, 1, 1)
    _shade_phases(axes, plan)
    axes.stackplot(
        ops,
        *series,
        labels=[c.replace("_", " ") for c in shown],
        colors=[COLORS[c] for c in shown],
        step="post",
        linewidth=0,
    )
    totals = [sum(row[2].values()) / scale for row in plan.timeline]
    # the outline keeps one-op spikes (a peak is often one) visible at any width
    axes.step(ops, totals, where="post", color="black", linewidth=0.5)
    peak = plan.peak_bytes / scale
    axes.axvline(plan.peak_op, color="black", linewidth=0.8, linestyle="--")
    axes.plot([plan.peak_op], [peak], marker="v", color="black")
    label = f"peak {format_bytes(plan.peak_bytes)} at op {plan.peak_op} ({plan.peak_phase})"
    if plan.peak_site:
        label += f"\n{plan.peak_site}"
    right = plan.peak_op > 0.6 * max(len(ops), 1)
    axes.annotate(
        label,
        xy=(plan.peak_op, peak),
        xytext=(-12 if right else 12, -6),
        textcoords="offset points",
        ha="right" if right else "left",
        va="top",
        fontsize=8.5,
        bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "alpha": 0.9, "linewidth": 0.5},
    )
    axes.set_xlim(0, max(len(ops) - 1, 1))
    axes.set_ylim(0, peak * 1.12 if peak else 1)
    axes.set_xlabel(f"op (of {len(ops)}; {plan.seconds:.2f} s recorded)")
    axes.set_ylabel(f"{unit} on {plan.device}")
    axes.set_title(title or "tensorscope: memory of one step by category", fontsize=11)
    axes.legend(loc="upper left", fontsize=8, ncol=3, frameon=False)
    axes.grid(axis="y", linewidth=0.3, alpha=0.6)
    figure.tight_layout()
    try:
        figure.savefig(text, format="png")
    except OSError as error:
        raise PlanFileError(
            f"tensorscope.plan: cannot write the picture to {text!r} "
            f"({error.strerror or 'error'}); choose a writable path."
        ) from error


def _shade_phases(axes: Any, plan: MemoryPlan) -> None:
    """Light bands behind the backward and the optimizer steps, labelled once each."""
    labelled: set[str] = set()
    start = 0
    ops = plan.ops
    for i in range(1, len(ops) + 1):
        if i < len(ops) and ops[i].phase == ops[start].phase:
            continue
        phase = ops[start].phase
        shade = _PHASE_SHADES.get(phase)
        if shade is not None:
            axes.axvspan(
                start,
                i - 1 if i == len(ops) else i,
                color=shade,
                zorder=0,
                label=None if phase in labelled else phase,
            )
            labelled.add(phase)
        start = i
