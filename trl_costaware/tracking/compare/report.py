"""The markdown report of `trl-costaware compare`: targets, the baseline's noise check, a table per arm (seeds
averaged) and per run."""

from __future__ import annotations

from .noise import NO_CLAIM
from .targets import Result

NOT_REACHED = "not reached"


def fmt_num(v, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.{digits}g}"


def fmt_tokens(v) -> str:
    if v is None:
        return NOT_REACHED
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"


def fmt_x(v, x_key: str) -> str:
    if v is None:
        return NOT_REACHED
    if x_key == "wall_time":
        return fmt_seconds(v)
    return fmt_tokens(v) if "token" in x_key else fmt_num(v)


def fmt_seconds(v) -> str:
    if v is None:
        return "n/a"
    if v >= 3600:
        return f"{v / 3600:.2f} h"
    if v >= 120:
        return f"{v / 60:.1f} min"
    return f"{v:.1f} s"


def fmt_pct(v) -> str:
    return "n/a" if v is None else f"{v:+.1f}%"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)])


def target_name(f: float) -> str:
    return "peak" if f == 1.0 else f"{100 * f:g}% peak"


def fmt_compute(v) -> str:
    """Compute in baseline-step units."""
    return NOT_REACHED if v is None else f"{v:.1f} steps"


def _target_cells(row: dict, x_key: str, claim: bool, compute: bool = False) -> list[str]:
    """Per target: x to reach it and the saving, then (with `compute`) per target the compute to it and its saving,
    then per target the wall time; "no claim" throughout when the baseline did not improve beyond noise."""
    per = 5 if compute else 3
    if not claim:
        return [NO_CLAIM] * (per * len(row["targets"]))
    cells = [c for t in row["targets"] for c in (fmt_x(t["x"], x_key), fmt_pct(t["saving_pct"]))]
    if compute:
        cells += [
            c for t in row["targets"] for c in (fmt_compute(t.get("compute")), fmt_pct(t.get("compute_saving_pct")))
        ]
    return cells + [fmt_seconds(t["wall"]) if t["x"] is not None else NOT_REACHED for t in row["targets"]]


def format_report(result: Result) -> str:
    """The comparison as markdown: targets, the baseline's noise check (`noise`), then a table per arm (seeds
    averaged) and per run. Without a baseline improvement beyond noise, every tokens-to-target, wall-to-target and
    saving cell reads "no claim"."""
    xk, fr, claim = result.x_key, result.targets, result.claim
    sign = -1.0 if result.minimize else 1.0
    smooth_txt = (
        "none"
        if result.smoothing <= 0
        else (f"EMA {result.smoothing:g}" if result.smoothing < 1 else f"rolling mean of {int(result.smoothing)}")
    )
    reached = (lambda t: f" (baseline reaches it at {fmt_x(t.baseline_x, xk)})") if claim else (lambda t: "")
    lines = [
        *result.warnings,
        (
            f"Metric `{result.metric}` ({'lower' if result.minimize else 'higher'} is better) against "
            f"`{xk}`; smoothing: {smooth_txt}"
            + (f"; first {result.min_points - 1} point(s) of each run dropped" if result.min_points > 1 else "")
            + f". Baseline arm: `{result.baseline}`."
        ),
        result.noise.describe(sign),
        "Targets: " + "; ".join(f"{target_name(t.fraction)} = {fmt_num(t.value)}{reached(t)}" for t in fr) + ".",
        "",
    ]
    x_word = "tokens" if "token" in xk else xk
    w = result.compute_weights
    target_columns = [c for t in fr for c in (f"{x_word} to {target_name(t.fraction)}", "saving")]
    if w is not None:
        target_columns += [c for t in fr for c in (f"compute to {target_name(t.fraction)}", "compute saving")]
    target_columns += [f"wall to {target_name(t.fraction)}" for t in fr] + [f"{x_word} total", "wall total"]
    arm_extra = ["compute / step", "break-even steps ratio"] if w is not None else []
    head = ["arm", "runs", "final", "Δ final", "peak", *target_columns, *arm_extra]
    rows = []
    for a in result.arms:
        r = [a["arm"], str(a["runs"]), fmt_num(a["final"]), f"{a['final_vs_baseline']:+.3g}", fmt_num(a["peak"])]
        r += _target_cells(a, xk, claim, w is not None) + [fmt_x(a["x_total"], xk), fmt_seconds(a["wall_total"])]
        if w is not None:
            r += [fmt_num(a.get("compute_per_step"), 3), fmt_num(a.get("break_even_steps_ratio"), 3)]
        rows.append(r)
    lines += ["Arms (seeds averaged on a common grid):", "", _markdown(head, rows), ""]
    head = ["run", "arm", "seed", "final", "peak", *target_columns]
    rows = []
    for run in result.runs:
        r = [run["name"], run["arm"], str(run["seed"]), fmt_num(run["final"]), fmt_num(run["peak"])]
        r += _target_cells(run, xk, claim, w is not None)
        rows.append(r + [fmt_x(run["x_total"], xk), fmt_seconds(run["wall_total"])])
    lines += ["Runs:", "", _markdown(head, rows), ""]
    if w is not None:
        lines.append(
            f"compute = what a run costs in steps of the baseline ({w.split.describe()}; {w.split.source or 'custom'}"
            f"): {w.gen:.3g} per generated token"
            + ("" if w.alpha == 1.0 else f" × (rows per step / the baseline's)^({w.alpha:g} − 1) (--generation-alpha)")
            + f" + {w.policy:.3g} per policy token (old/reference passes run on the "
            "kept rows, so they scale with the policy tokens). break-even steps ratio = 1 / compute per step: an arm "
            "whose steps to a target exceed this multiple of the baseline's costs more than the baseline. Change the "
            "split with --compute-split (e.g. cpu:0.55 for a measured update share of 55%)."
        )
    if claim:
        lines.append(
            f"saving = 1 − {x_word} to the target / the baseline arm's {x_word} to it (positive: fewer {x_word})."
        )
    else:
        lines.append(
            f"The baseline's peak is within its noise, so reaching it says nothing: {NO_CLAIM} on {x_word} to a "
            "target. Run more seeds or steps, or compare a held-out metric (--metric eval_...)."
        )
    return "\n".join(lines)
