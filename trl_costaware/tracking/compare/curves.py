"""Curve maths for `trl-costaware compare`: a run's metric against an x-axis, smoothing, first crossings of a level,
and the mean of several seeds on a common grid. Plain numpy functions."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from .readers import RunHistory


def smooth(values: np.ndarray, spec: float) -> np.ndarray:
    """``spec`` = 0: none; 0 < spec < 1: debiased exponential moving average with weight `spec` on the past (as
    TensorBoard/W&B's smoothing slider); spec >= 1: trailing rolling mean over `int(spec)` points."""
    values = np.asarray(values, dtype=float)
    if spec <= 0 or len(values) == 0:
        return values.copy()
    if spec < 1:
        out, last = np.empty_like(values), 0.0
        for i, v in enumerate(values):
            last = last * spec + (1 - spec) * v
            out[i] = last / (1 - spec ** (i + 1))
        return out
    window = int(spec)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def smoothing_window(spec: float) -> int:
    """Points a smoother averages over once it is warmed up: the window, or about 1/(1 − w) for an EMA."""
    if spec <= 0:
        return 1
    if spec < 1:
        return max(1, round(1.0 / (1.0 - spec)))
    return int(spec)


def first_crossing(x, y, target: float, *others) -> tuple[float | None, ...]:
    """x at which the curve ``y(x)`` first reaches ``target`` (linear interpolation between logged points), and each
    of `others` (curves on the same points, e.g. wall time) at the same place; Nones if it never does."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    tol = 1e-9 * max(1.0, abs(target))
    hits = np.nonzero(y >= target - tol)[0]
    if len(hits) == 0:
        return (None,) * (1 + len(others))
    j = int(hits[0])
    if j == 0 or y[j] - y[j - 1] <= 0:
        return (float(x[j]), *(float(np.asarray(o, float)[j]) for o in others))
    t = float(np.clip((target - y[j - 1]) / (y[j] - y[j - 1]), 0.0, 1.0))

    def at(c):
        c = np.asarray(c, float)
        return float(c[j - 1] + t * (c[j] - c[j - 1]))

    return (at(x), *(at(o) for o in others))


@dataclass
class Curve:
    x: np.ndarray
    y: np.ndarray  # smoothed
    raw: np.ndarray
    wall: np.ndarray  # wall time at each point (NaN where unknown)
    lo: np.ndarray | None = None  # band (arms)
    hi: np.ndarray | None = None
    n: int = 1
    compute: np.ndarray | None = None  # compute in baseline-step units at each point (NaN where unknown)


COMPUTE_KEY = "cost_aware/compute"  # derived by `targets.add_compute`: the run's compute in baseline-step units


def _points(run: RunHistory, metric: str, x_key: str, extra: tuple[str, ...]) -> list[np.ndarray]:
    pts = []
    for i, row in enumerate(run.rows):
        xv, yv = row.get(x_key), row.get(metric)
        if isinstance(xv, (int, float)) and isinstance(yv, (int, float)) and math.isfinite(xv) and math.isfinite(yv):
            more = [row.get(k) for k in extra]
            more = [float(v) if isinstance(v, (int, float)) else math.nan for v in more]
            pts.append((float(xv), i, float(yv), *more))
    pts.sort()
    return [np.array([p[0] for p in pts]), np.array([p[2] for p in pts])] + [
        np.array([p[3 + j] for p in pts]) for j in range(len(extra))
    ]


def raw_series(run: RunHistory, metric: str, x_key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, metric, wall time) of every row that has a finite `metric` and `x_key`, sorted by x (then log order)."""
    x, y, wall = _points(run, metric, x_key, ("wall_time",))
    return x, y, wall


def run_curve(
    run: RunHistory, metric: str, x_key: str, smoothing: float, min_points: int | None = None
) -> Curve | None:
    """The run's (x, smoothed metric) points, sorted by x. The first ``min_points − 1`` smoothed points (default: the
    smoother's window) are dropped: there the average rests on a few noisy values, and an early spike would count as
    reaching a target. A run with fewer points keeps its last one. The curve also carries the wall time and the
    derived compute (`COMPUTE_KEY`, NaN where the rows have none) at each point."""
    x, raw, wall, compute = _points(run, metric, x_key, ("wall_time", COMPUTE_KEY))
    if len(x) == 0:
        return None
    y = smooth(raw, smoothing)
    skip = min((smoothing_window(smoothing) if min_points is None else max(1, min_points)) - 1, len(x) - 1)
    return Curve(x=x[skip:], y=y[skip:], raw=raw[skip:], wall=wall[skip:], compute=compute[skip:])


def _interp(x_new, x, y):
    y_new = np.interp(x_new, x, y)
    y_new[(x_new < x[0]) | (x_new > x[-1])] = np.nan
    return y_new


def aggregate(curves: list[Curve], band: str = "minmax") -> Curve:
    """Mean over seeds on a common grid: the union of the runs' x values inside the range every run covers (the
    union of ranges if they do not overlap), each run linearly interpolated. Band: ``minmax``, ``std`` or ``none``."""
    if len(curves) == 1:
        c = curves[0]
        return Curve(x=c.x, y=c.y, raw=c.raw, wall=c.wall, lo=c.y, hi=c.y, n=1, compute=c.compute)
    lo = max(c.x[0] for c in curves)
    hi = min(c.x[-1] for c in curves)
    grid = np.unique(np.concatenate([c.x for c in curves]))
    if lo < hi:
        grid = grid[(grid >= lo) & (grid <= hi)]
    ys = np.vstack([_interp(grid, c.x, c.y) for c in curves])
    raws = np.vstack([_interp(grid, c.x, c.raw) for c in curves])
    walls = np.vstack([_interp(grid, c.x, c.wall) if np.isfinite(c.wall).all() else grid * np.nan for c in curves])
    computes = np.vstack(
        [
            _interp(grid, c.x, c.compute) if c.compute is not None and np.isfinite(c.compute).all() else grid * np.nan
            for c in curves
        ]
    )
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns (outside a run's range)
        mean = np.nanmean(ys, axis=0)
        if band == "std":
            sd = np.nanstd(ys, axis=0)
            band_lo, band_hi = mean - sd, mean + sd
        elif band == "none":
            band_lo = band_hi = mean
        else:
            band_lo, band_hi = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
        raw = np.nanmean(raws, axis=0)
        wall = np.nanmean(walls, axis=0)
        compute = np.nanmean(computes, axis=0)
    return Curve(x=grid, y=mean, raw=raw, wall=wall, lo=band_lo, hi=band_hi, n=len(curves), compute=compute)
