"""The PNG of `trl-costaware compare`: the smoothed metric against the x-axis and against compute at the comparison's
split, per arm and run, with the targets."""

from __future__ import annotations

import os

import numpy as np

from .._extras import require
from .noise import NO_CLAIM
from .report import NOT_REACHED, fmt_pct, target_name
from .targets import Result

PLOT_FEATURE = "trl-costaware compare's plot"
PLOT_ALTERNATIVE = "pass --no-plot"
X_LABELS = {
    "cost_aware/policy_tokens": "policy-optimisation tokens",
    "cost_aware/policy_tokens_padded": "policy-optimisation tokens (with padding)",
    "cost_aware/generated_tokens": "generated (completion) tokens",
    "cost_aware/rollout_tokens": "rollout tokens (prompt + completion)",
    "num_tokens": "rollout tokens (TRL num_tokens)",
    "wall_time": "wall time (s)",
    "step": "global step",
}


def plot(result: Result, path: str, show_runs: bool = True, title: str | None = None) -> str:
    """Write `figure` as a PNG to `path`; returns `path`."""
    fig = figure(result, show_runs, title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def figure(result: Result, show_runs: bool = True, title: str | None = None):
    """The smoothed metric against the x-axis: one line per arm (mean over seeds, band), thin lines for the runs of
    arms with several seeds, the targets and where each arm first reaches them. When the comparison has a
    compute split (`--compute-split`, default verl's generation 55%), a second panel draws the same curves against
    compute in baseline steps at that split, which counts the generation every step pays; policy tokens alone
    overstate what a kept fraction saves. Uses the Agg canvas only."""
    require("matplotlib", PLOT_FEATURE, PLOT_ALTERNATIVE)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    weights = result.compute_weights
    with_compute = weights is not None and any(
        c.compute is not None and np.isfinite(c.compute).any() for c in result.curves["arms"].values()
    )
    fig = Figure(figsize=(15.0 if with_compute else 8.5, 5.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2 if with_compute else 1, 1)
    x_name = X_LABELS.get(result.x_key, result.x_key)
    _panel(ax, result, show_runs, lambda c: c.x, "x", x_name)
    ax.set_title(title or f"{result.metric} vs {x_name}", fontsize=11)
    ax.text(
        0.01, 0.01, _savings_text(result, "saving_pct", "x", "tokens"), transform=ax.transAxes, fontsize=8, va="bottom"
    )
    if with_compute:
        cx = fig.add_subplot(1, 2, 2, sharey=ax)
        _panel(cx, result, show_runs, lambda c: c.compute, "compute", COMPUTE_LABEL)
        cx.set_title(f"{result.metric} vs compute at {weights.split.describe()}", fontsize=11)
        cx.text(
            0.01,
            0.01,
            _savings_text(result, "compute_saving_pct", "compute", "compute")
            + f"\nsplit: {weights.split.source or weights.split.name}",
            transform=cx.transAxes,
            fontsize=8,
            va="bottom",
        )
    fig.tight_layout()
    return fig


COMPUTE_LABEL = "compute (baseline steps: one baseline step = 1)"


def _savings_text(result: Result, key: str, reached_key: str, what: str) -> str:
    savings = []
    for a in result.arms:
        if a["arm"] != result.baseline:
            s = a["targets"][0][key]
            reached = a["targets"][0][reached_key] is not None
            savings.append(f"{a['arm']}: {fmt_pct(s) if reached else NOT_REACHED if result.claim else NO_CLAIM}")
    if not savings:
        return ""
    return (f"{what} to baseline peak vs baseline — " if result.claim else "baseline within noise — ") + "; ".join(
        savings
    )


def _panel(ax, result: Result, show_runs: bool, xs, target_key: str, xlabel: str) -> None:
    """One panel: the curves against ``xs(curve)``, the targets, and each arm's first crossing (``target_key`` of
    its target rows: ``x`` or ``compute``)."""
    colors = ["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    for i, label in enumerate(a["arm"] for a in result.arms):
        color = colors[i % len(colors)]  # the baseline comes first: gray
        c = result.curves["arms"][label]
        members = result.arm_members[label]
        if show_runs and len(members) > 1:
            for name in members:
                rc = result.curves["runs"][name]
                if xs(rc) is not None:
                    ax.plot(xs(rc), rc.y, color=color, alpha=0.25, linewidth=0.8)
        x = xs(c)
        if x is None:
            continue
        if c.n > 1 and c.lo is not None:
            ax.fill_between(x, c.lo, c.hi, color=color, alpha=0.18, linewidth=0)
        n_txt = f" ({c.n} runs)" if c.n > 1 else ""
        ax.plot(x, c.y, color=color, linewidth=2.0, label=f"{label}{n_txt}")
        arm = next(a for a in result.arms if a["arm"] == label)
        for t, at in zip(result.targets, arm["targets"], strict=True):
            if at.get(target_key) is not None:
                ax.plot([at[target_key]], [t.value], marker="o" if t.fraction == 1.0 else "v", color=color, ms=6)
    span = float(np.nanmax([np.nanmax(np.abs(c.y)) for c in result.curves["arms"].values()]) or 1.0)
    labelled = []
    for t in result.targets:
        ax.axhline(t.value, color="black", linestyle="--" if t.fraction == 1.0 else ":", linewidth=0.8, alpha=0.7)
        near = [lab for lab in labelled if abs(lab[0] - t.value) <= 0.02 * span]
        if near:  # targets on top of each other (a flat or tiny peak): one label
            near[0][1].set_text(near[0][1].get_text() + f" = {target_name(t.fraction)}")
            continue
        text = ax.annotate(
            f"baseline {target_name(t.fraction)}",
            xy=(1.0, t.value),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom" if t.fraction == 1.0 else "top",
            fontsize=8,
            alpha=0.8,
        )
        labelled.append((t.value, text))
    ax.set_xlabel(xlabel)
    smooth_txt = "" if result.smoothing <= 0 else f" (smoothed {result.smoothing:g})"
    ax.set_ylabel(f"{result.metric}{smooth_txt}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=9)
