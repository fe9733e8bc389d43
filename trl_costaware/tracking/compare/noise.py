r"""Did the baseline improve beyond noise? The rule `trl-costaware compare` applies before it reports any
tokens-to-target number or saving.

A "reached the baseline's peak with X% fewer tokens" claim means something only when the baseline's curve has a
trend: on a flat noisy curve, the peak is the largest noise excursion, and another arm "reaches" it at a random place.
So the baseline's improvement over its own start is tested first, on the raw (unsmoothed) logged values, each run's
values in x order with the metric's sign made "higher is better":

- window: ``m = max(1, ⌊n / 5⌋)`` points for a run of ``n`` points; the run's improvement is
  ``Δ = mean(last m values) − mean(first m values)``.
- **Two or more baseline seeds**: a percentile bootstrap 95% interval (10,000 resamples of the seeds, a fixed
  generator) of the mean of the per-seed ``Δ``. Improved when the interval's lower end is above 0 (with 2 seeds this
  means both seeds improved).
- **One baseline run**: the per-step noise ``σ̂ = sqrt(mean((y[i+1] − 2 y[i] + y[i−1])²) / 6)`` (second differences:
  a linear trend cancels; for independent noise of variance σ², each has variance 6σ²), the standard error of
  ``Δ`` as ``SE = σ̂ sqrt(2 / m)``, and improved when ``Δ > 2 SE``. Fewer than 3 points: no noise estimate, not
  improved.

Otherwise the report says "baseline did not improve beyond noise: no claim" and gives no tokens-to-target numbers and
no savings. Plain numpy functions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

Z_ONE_RUN = 2.0
BOOTSTRAP_RESAMPLES = 10_000
LEVEL = 0.95
NO_CLAIM = "no claim"


def window_size(n: int) -> int:
    """Points per start/end window: ``max(1, ⌊n / 5⌋)``."""
    return max(1, n // 5)


def improvement(values) -> float:
    """``mean(last m) − mean(first m)`` with ``m = window_size(n)``; NaN for an empty run."""
    y = np.asarray(values, dtype=float)
    if len(y) == 0:
        return math.nan
    m = window_size(len(y))
    return float(y[-m:].mean() - y[:m].mean())


def step_noise_sd(values) -> float:
    """``σ̂ = sqrt(mean(second differences²) / 6)``, the per-step noise of a curve with a smooth trend; NaN below 3
    points."""
    y = np.asarray(values, dtype=float)
    if len(y) < 3:
        return math.nan
    d2 = y[2:] - 2.0 * y[1:-1] + y[:-2]
    return float(math.sqrt(np.mean(d2**2) / 6.0))


def bootstrap_mean_interval(values, level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0):
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(resamples, len(v)))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1.0 - alpha))


@dataclass
class NoiseCheck:
    improved: bool
    rule: str  # "bootstrap over seeds", "one run: 2 standard errors", "too few points"
    improvement: float  # mean Δ over the baseline's runs, "higher is better" units
    lo: float | None  # 95% bootstrap interval, or Δ ± 2 SE for one run
    hi: float | None
    runs: int
    window: int  # smallest window m over the runs

    def describe(self, sign: float = 1.0) -> str:
        verdict = "improved beyond noise" if self.improved else f"did not improve beyond noise: {NO_CLAIM}"
        detail = f"Δ = {sign * self.improvement:+.4g}"
        if self.lo is not None:
            lo, hi = sorted((sign * self.lo, sign * self.hi))
            what = f"95% CI over {self.runs} seeds" if self.runs > 1 else "± 2 SE of the per-step noise"
            detail += f", {what} [{lo:+.4g}, {hi:+.4g}]"
        return (
            f"Baseline {verdict} ({detail}; mean of its last {self.window} logged values minus its first "
            f"{self.window}; rule: {self.rule})."
        )

    def to_json(self) -> dict:
        return asdict(self)


def baseline_improvement(runs: list) -> NoiseCheck:
    """The noise rule of this module on the baseline's runs (each an array of raw values in x order, higher is
    better)."""
    runs = [np.asarray(r, dtype=float) for r in runs if len(r)]
    if not runs:
        return NoiseCheck(False, "too few points", math.nan, None, None, 0, 0)
    window = min(window_size(len(r)) for r in runs)
    deltas = [improvement(r) for r in runs]
    if len(runs) >= 2:
        lo, hi = bootstrap_mean_interval(deltas)
        return NoiseCheck(lo > 0, "bootstrap over seeds", float(np.mean(deltas)), lo, hi, len(runs), window)
    sd = step_noise_sd(runs[0])
    if not math.isfinite(sd):
        return NoiseCheck(False, "too few points", deltas[0], None, None, 1, window)
    se = sd * math.sqrt(2.0 / window)
    delta = deltas[0]
    improved = delta > Z_ONE_RUN * se
    return NoiseCheck(improved, "one run: 2 standard errors", delta, delta - 2 * se, delta + 2 * se, 1, window)
