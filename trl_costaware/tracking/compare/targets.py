"""The comparison of `trl-costaware compare`: arms, the baseline's targets (its peak and fractions of it), where
every arm and run first reaches them, the saving against the baseline, and the noise rule (`noise`) that decides
whether any of that is reported."""

from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..names import BASELINE_ARM, COST_AWARE_ARM
from .compute import GPU_VERL, Split, TokenWeights, check_alpha, token_weights
from .curves import COMPUTE_KEY, Curve, aggregate, first_crossing, raw_series, run_curve, smoothing_window
from .noise import NoiseCheck, baseline_improvement
from .readers import CompareError, RunHistory, canonical_key, canonical_x, default_arm, duplicated_steps

DEFAULT_METRIC = "reward"
DEFAULT_X = "cost_aware/policy_tokens"
DEFAULT_SMOOTH = 0.6
DEFAULT_FRACTIONS = (1.0, 0.99)
DEFAULT_SPLIT = GPU_VERL
GEN_KEY, POLICY_KEY = "cost_aware/generated_tokens", "cost_aware/policy_tokens"
ROWS_KEY = "cost_aware/rows_generated"


@dataclass
class Target:
    fraction: float
    value: float  # in the metric's units (sign as logged)
    baseline_x: float | None
    baseline_wall: float | None
    baseline_compute: float | None = None


@dataclass
class Result:
    metric: str
    x_key: str
    smoothing: float
    min_points: int
    minimize: bool
    baseline: str
    baseline_peak: float
    targets: list[Target]
    runs: list[dict]
    arms: list[dict]
    curves: dict  # "runs": name -> Curve ; "arms": arm label -> Curve
    arm_members: dict  # arm label -> [run names]
    noise: NoiseCheck  # did the baseline improve beyond noise? (no: no tokens-to-target numbers, no savings)
    compute_weights: TokenWeights | None = None  # None: no compute (no split, or rows without the token counters)
    warnings: list[str] = field(default_factory=list)  # one line each: a record with duplicated steps

    @property
    def claim(self) -> bool:
        return self.noise.improved

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "x": self.x_key,
            "smoothing": self.smoothing,
            "min_points": self.min_points,
            "minimize": self.minimize,
            "baseline": self.baseline,
            "baseline_peak": self.baseline_peak,
            "claim": self.claim,
            "baseline_improvement": self.noise.to_json(),
            "targets": [t.__dict__ for t in self.targets],
            "arms": self.arms,
            "runs": self.runs,
            "warnings": self.warnings,
            "compute": None
            if self.compute_weights is None
            else {
                "units": "baseline steps",
                "split": self.compute_weights.split.__dict__,
                "weight_per_generated_token": self.compute_weights.gen,
                "weight_per_policy_token": self.compute_weights.policy,
                "generation_alpha": self.compute_weights.alpha,
            },
        }


def assign_labels(runs: list[RunHistory], labels: list[str] | None = None, arm_by: list[str] | None = None) -> None:
    """``labels``: ``PATTERN=LABEL`` globs matched against a run's name, source and group (first match wins);
    ``arm_by``: info/config fields whose values name the arm; else the run's arm (baseline / cost_aware)."""
    rules = []
    for spec in labels or []:
        if "=" not in spec:
            raise CompareError(f"--label {spec!r}: expected PATTERN=LABEL, e.g. '*baseline*=baseline'")
        pattern, label = spec.rsplit("=", 1)
        rules.append((pattern, label))
    for run in runs:
        run.label = None
        for pattern, label in rules:
            names = [run.name, run.source, os.path.basename(run.source), str(run.info.get("group") or "")]
            if any(fnmatch.fnmatch(n, pattern) for n in names):
                run.label = label
                break
        if run.label is None and arm_by:
            parts = []
            for fld in arm_by:
                value = run.info.get(fld, (run.info.get("config") or {}).get(fld))
                parts.append(f"{fld}={value}")
            run.label = ",".join(parts)
        if run.label is None:
            if rules:
                raise CompareError(f"run {run.name} ({run.source}) matches no --label pattern")
            run.label = default_arm(run.info)


def _choose_baseline(arms: dict[str, list[RunHistory]], baseline: str | None) -> str:
    if baseline is not None:
        if baseline not in arms:
            raise CompareError(f"--baseline {baseline!r} is not an arm; arms: {', '.join(arms)}")
        return baseline
    if BASELINE_ARM in arms:
        return BASELINE_ARM
    off = [a for a, members in arms.items() if all(default_arm(r.info) != COST_AWARE_ARM for r in members)]
    if len(off) == 1:
        return off[0]
    raise CompareError(
        f"cannot tell which arm is the baseline (arms: {', '.join(arms)}); name it with --baseline, or run it "
        "with cost_aware=False"
    )


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rows_per_step(row: dict) -> float | None:
    """Rows generated per step up to this row (None without the counter or a step)."""
    rows, step = row.get(ROWS_KEY), row.get("step")
    return rows / step if _number(rows) and _number(step) and step > 0 and rows > 0 else None


def add_compute(
    runs: list[RunHistory], baseline: list[RunHistory], split: Split, alpha: float = 1.0
) -> TokenWeights | None:
    """Give every row with both token counters a derived compute (`COMPUTE_KEY`, in baseline-step units):
    w_gen · generated tokens · (B / B_base)^(α − 1) + w_pol · policy tokens, the weights calibrated on the baseline
    runs' mean tokens (and rows, B) per step (`compute.token_weights`). None (and no compute) when a baseline run
    lacks the counters or the step; with α ≠ 1 a row also needs the rows-generated counter and its step."""
    gen, pol, rows = [], [], []
    for run in baseline:
        last = [r for r in run.rows if all(_number(r.get(k)) for k in (GEN_KEY, POLICY_KEY, "step")) and r["step"] > 0]
        if alpha != 1.0:
            last = [r for r in last if _rows_per_step(r)]
        if not last:
            return None
        gen.append(last[-1][GEN_KEY] / last[-1]["step"])
        pol.append(last[-1][POLICY_KEY] / last[-1]["step"])
        rows.append(_rows_per_step(last[-1]))
    if min(gen) <= 0 or min(pol) <= 0:
        return None
    base_rows = float(np.mean(rows)) if alpha != 1.0 else None
    weights = token_weights(split, float(np.mean(gen)), float(np.mean(pol)), alpha, base_rows)
    for run in runs:
        for row in run.rows:
            per_step = _rows_per_step(row)
            if _number(row.get(GEN_KEY)) and _number(row.get(POLICY_KEY)) and (alpha == 1.0 or per_step):
                row[COMPUTE_KEY] = weights.compute(row[GEN_KEY], row[POLICY_KEY], per_step)
    return weights


def _step_cost(run: RunHistory) -> float | None:
    """The run's compute per step (baseline-step units) from its last row with compute and step."""
    rows = [r for r in run.rows if isinstance(r.get(COMPUTE_KEY), (int, float)) and (r.get("step") or 0) > 0]
    return rows[-1][COMPUTE_KEY] / rows[-1]["step"] if rows else None


def duplicated_steps_warning(run: RunHistory, dup: dict) -> str:
    """The report's line for a run whose record repeats train steps (`readers.duplicated_steps`)."""
    return (
        f"Warning: run `{run.name}` ({run.source}): {dup['steps']} of its {dup['train_steps']} train steps are logged "
        f"more than once (up to {dup['max_copies']} times): its record was written by several processes at once, and "
        "its curves and numbers mix the copies. Usually a duplicated launch: WORLD_SIZE processes that each trained "
        "a world of 1 (on CPU, `accelerate launch --multi_gpu --num_processes N` without --use_cpu true; the trainer "
        "now refuses it), or two runs sharing one output_dir. Rerun it."
    )


def _target_value(peak: float, start: float, fraction: float) -> float:
    """``fraction`` of the peak for a positive peak (the paper's "99% of peak"); else ``fraction`` of the way from
    the baseline's first value to its peak. Values in "higher is better" units."""
    if fraction == 1.0:
        return peak
    if peak > 0:
        return fraction * peak
    return start + fraction * (peak - start)


def _finite(v):
    return None if v is None or not math.isfinite(v) else float(v)


def _is_axis_key(key: str) -> bool:
    return key.endswith(("tokens", "tokens_padded")) or key in ("wall_time", "step")


def _curve_stats(c: Curve, targets: list[Target], sign: float, claim: bool) -> dict:
    """Final and peak value, totals, and per target the x and wall time of the first crossing and the savings
    against the baseline's (all None when there is no claim)."""
    finite = np.isfinite(c.y)
    ys, xs = c.y[finite], c.x[finite]
    i_peak = int(np.argmax(ys))
    out = {
        "final": sign * float(ys[-1]),
        "peak": sign * float(ys[i_peak]),
        "x_at_peak": float(xs[i_peak]),
        "x_total": float(xs[-1]),
        "wall_total": _finite(c.wall[finite][-1]),
        "points": int(finite.sum()),
        "targets": [],
    }
    compute = c.compute[finite] if c.compute is not None else np.full(len(xs), np.nan)
    out["compute_total"] = _finite(compute[-1])
    for t in targets:
        tx, tw, tc = first_crossing(xs, ys, sign * t.value, c.wall[finite], compute) if claim else (None,) * 3
        tw, tc = _finite(tw), _finite(tc)
        saving = 100.0 * (1.0 - tx / t.baseline_x) if tx is not None and t.baseline_x else None
        wall_saving = 100.0 * (1.0 - tw / t.baseline_wall) if tw is not None and t.baseline_wall else None
        compute_saving = 100.0 * (1.0 - tc / t.baseline_compute) if tc is not None and t.baseline_compute else None
        out["targets"].append(
            {
                "fraction": t.fraction,
                "x": tx,
                "saving_pct": saving,
                "wall": tw,
                "wall_saving_pct": wall_saving,
                "compute": tc,
                "compute_saving_pct": compute_saving,
            }
        )
    return out


def compare_runs(
    runs: list[RunHistory],
    metric: str = DEFAULT_METRIC,
    x: str = DEFAULT_X,
    smoothing: float = DEFAULT_SMOOTH,
    min_points: int | None = None,
    fractions=DEFAULT_FRACTIONS,
    baseline: str | None = None,
    labels: list[str] | None = None,
    arm_by: list[str] | None = None,
    band: str = "minmax",
    minimize: bool = False,
    compute_split: Split | None = DEFAULT_SPLIT,
    generation_alpha: float = 1.0,
) -> Result:
    """Group `runs` into arms, average each arm's seeds, take the baseline arm's peak (and `fractions` of it) as
    targets, and find where every arm and run first reaches them. Tokens-to-target numbers and savings are given
    only when the baseline improved beyond noise (`trl_costaware.tracking.compare.noise`); else they are None.

    With `compute_split` (default: verl's GPU split) every run also gets compute to each target in baseline-step
    units (`add_compute`), the arm's compute per step and the break-even steps ratio (1 / compute per step): the
    steps ratio to a target above which the arm costs more than the baseline. `generation_alpha` (in [0, 1]) prices
    generation as ∝ B^α in the rows B generated per step (`compute`'s module docstring); 1: per generated token."""
    metric, x_key = canonical_key(metric), canonical_x(x)
    if not runs:
        raise CompareError("no runs to compare")
    assign_labels(runs, labels, arm_by)
    sign = -1.0 if minimize else 1.0
    curves = {}
    for run in runs:
        c = run_curve(run, metric, x_key, smoothing, min_points)
        if c is None:
            have = sorted({k for r in run.rows for k in r})
            hint = [k for k in have if metric in k or k.endswith(metric.split("_")[-1])][:6]
            raise CompareError(
                f"run {run.name} ({run.source}) has no rows with both {metric!r} and {x_key!r}"
                + (f"; similar keys: {', '.join(hint)}" if hint else "")
                + (f"; x-axis candidates: {', '.join(k for k in have if _is_axis_key(k))}")
            )
        c.y, c.raw = sign * c.y, sign * c.raw  # internally always maximised
        curves[run.name] = c
    arms: dict[str, list[RunHistory]] = {}
    for run in runs:
        arms.setdefault(run.label, []).append(run)
    base_label = _choose_baseline(arms, baseline)
    alpha = check_alpha(generation_alpha)
    weights = add_compute(runs, arms[base_label], compute_split, alpha) if compute_split is not None else None
    if weights is not None:  # the curves carry the compute now
        for run in runs:
            c = run_curve(run, metric, x_key, smoothing, min_points)
            c.y, c.raw = sign * c.y, sign * c.raw
            curves[run.name] = c
    noise = baseline_improvement([sign * raw_series(r, metric, x_key)[1] for r in arms[base_label]])
    arm_curves = {label: aggregate([curves[r.name] for r in members], band) for label, members in arms.items()}
    base = arm_curves[base_label]
    peak = float(np.nanmax(base.y))
    start = float(base.y[np.isfinite(base.y)][0])
    targets = []
    for f in fractions:
        value = _target_value(peak, start, f)
        base_compute = base.compute if base.compute is not None else np.full(len(base.x), np.nan)
        bx, bw, bc = first_crossing(base.x, base.y, value, base.wall, base_compute) if noise.improved else (None,) * 3
        targets.append(Target(f, sign * value, bx, _finite(bw), _finite(bc)))

    run_rows, warnings = [], []
    for run in runs:
        s = _curve_stats(curves[run.name], targets, sign, noise.improved)
        s.update({"name": run.name, "arm": run.label, "seed": run.info.get("seed"), "source": run.source})
        s["kind"] = run.kind
        s["duplicated_steps"] = dup = duplicated_steps(run.rows)
        if dup is not None:
            warnings.append(duplicated_steps_warning(run, dup))
        run_rows.append(s)
    base_final = _curve_stats(base, targets, sign, noise.improved)["final"]
    arm_rows = []
    for label, members in arms.items():
        s = _curve_stats(arm_curves[label], targets, sign, noise.improved)
        s.update({"arm": label, "runs": len(members), "seeds": sorted({str(r.info.get("seed")) for r in members})})
        s["final_vs_baseline"] = s["final"] - base_final
        costs = [c for c in (_step_cost(r) for r in members) if c is not None]
        s["compute_per_step"] = float(np.mean(costs)) if costs else None
        s["break_even_steps_ratio"] = 1.0 / s["compute_per_step"] if costs else None
        arm_rows.append(s)
    arm_rows.sort(key=lambda r: (r["arm"] != base_label, r["arm"]))
    run_rows.sort(key=lambda r: (r["arm"] != base_label, r["arm"], str(r["seed"]), r["name"]))
    for c in list(curves.values()) + list(arm_curves.values()):  # back to the metric's sign for plotting
        c.y, c.raw = sign * c.y, sign * c.raw
        if c.lo is not None:
            c.lo, c.hi = (sign * c.lo, sign * c.hi) if sign > 0 else (sign * c.hi, sign * c.lo)
    return Result(
        metric=metric,
        x_key=x_key,
        smoothing=smoothing,
        min_points=smoothing_window(smoothing) if min_points is None else max(1, min_points),
        minimize=minimize,
        baseline=base_label,
        baseline_peak=sign * peak,
        targets=targets,
        runs=run_rows,
        arms=arm_rows,
        curves={"runs": curves, "arms": arm_curves},
        arm_members={label: [r.name for r in members] for label, members in arms.items()},
        noise=noise,
        compute_weights=weights,
        warnings=warnings,
    )
