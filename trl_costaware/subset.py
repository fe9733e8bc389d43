"""Static subset selection: drop expensive examples before training, for a bias that stays within a budget.

The paper's second algorithm; the derivation is in docs/subset.md. Example i costs c_i per gradient query and its
gradient is bounded, ‖∇f_i‖ ≤ G_i. Dropping a set R changes cost-aware SGD's cost factor to J_K = (Σ_{i∉R} G_i √c_i)²
and bounds the bias by β_R = (1/n) Σ_{i∈R} G_i. Minimising J_K subject to β_R ≤ Γ is a 0/1 knapsack (value G_i √c_i,
weight G_i, density √c_i), so greedy drops the most expensive first (`greedy_subset`). Dantzig's LP relaxation bounds
every feasible choice: √J_K(greedy) − G_k √c_k ≤ √(LP bound) ≤ √J_K(optimum) (k the first example that did not fit);
`SubsetReport.cost_factor_lower_bound` is that certificate, and greedy is exact when it meets it (always when all G_i
are equal), not whenever the budget is used up (c = [100, 99, 1], G = [0.5, 0.6, 0.5], Γ = 1/3: greedy 35.64,
optimum 30.25). `exact_subset` enumerates the subsets of small data sets. Examples with G_i = 0 are dropped for free
(reason "zero_bound") unless ``drop_zero_bound=False``. `select_subset` applies this to a `datasets.Dataset`;
`pilot_statistics` estimates c_i and G_i per prompt from a pilot run's rollouts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

METHODS = ("greedy", "exact")
BOUND_ESTIMATES = ("abs_advantage", "reward_std")
# `exact_subset` enumerates 2^m subsets of the m examples with G_i > 0.
EXACT_MAX_EXAMPLES = 22
# Relative slack when comparing a dropped set's summed bound with the budget nΓ (float rounding only).
_BUDGET_RTOL = 1e-12
_REASONS = {
    "zero_bound": "G = 0: no gradient signal; dropping it adds no bias",
    "budget": "expensive: dropped in decreasing cost while (1/n) Σ_dropped G ≤ Γ",
}


@dataclass(frozen=True)
class SubsetReport:
    """What a subset selection kept, dropped and why. Indices are positions in the input (dataset rows)."""

    kept: np.ndarray  # int64, ascending (includes `unestimated`)
    dropped: np.ndarray  # int64, in the order they were dropped (zero-bound examples first)
    reasons: tuple[str, ...]  # one per dropped index: "zero_bound" or "budget"
    n: int  # the n of the bias bound (1/n) Σ_R G_i
    bias_budget: float  # Γ
    bias_bound: float  # (1/n) Σ_{i∈R} G_i ≤ Γ
    cost_factor_before: float  # (Σ_i G_i √c_i)² over the examples with estimates
    cost_factor_after: float  # (Σ_{i∈K} G_i √c_i)²
    cost_factor_lower_bound: float  # (V − D_LP)²: no feasible R gives a smaller cost factor
    total_cost_before: float  # Σ_i c_i over the examples with estimates (one pass over them)
    total_cost_after: float  # Σ_{i∈K} c_i over the same
    method: str  # "greedy" or "exact"
    # rows kept outside the selection: no cost or bound given (NaN)
    unestimated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def cost_factor_ratio(self) -> float:
        """J_K / J: the theory's ratio of cost-aware SGD's total cost on the kept set to that on the full set."""
        return self.cost_factor_after / self.cost_factor_before if self.cost_factor_before > 0 else 1.0

    def summary(self) -> str:
        size = self.kept.size + self.dropped.size
        text = (
            f"{self.method}: Γ={self.bias_budget:.4g}, dropped {self.dropped.size} of {size} "
            f"({self.reasons.count('zero_bound')} with G=0; bias bound {self.bias_bound:.4g}), cost factor "
            f"{self.cost_factor_before:.4g} → {self.cost_factor_after:.4g} (×{self.cost_factor_ratio:.3f}; lower "
            f"bound {self.cost_factor_lower_bound:.4g}), pass cost {self.total_cost_before:.4g} → "
            f"{self.total_cost_after:.4g}"
        )
        if self.unestimated.size:
            text += f"; {self.unestimated.size} kept without an estimate"
        return text

    def why(self, index: int) -> str:
        """Why row `index` was dropped (ValueError when it was kept)."""
        where = np.flatnonzero(self.dropped == index)
        if not where.size:
            raise ValueError(f"index {index} was not dropped")
        return _REASONS[self.reasons[int(where[0])]]


# ---------------------------------------------------------------------------------------------------- the math
def _arrays(costs, bounds, bias_budget: float, n: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    g = np.asarray(bounds, dtype=np.float64).reshape(-1)
    if c.shape != g.shape:
        raise ValueError(f"costs and bounds must have the same length, got {c.size} and {g.size}")
    if not (np.all(np.isfinite(c)) and np.all(c > 0)):
        raise ValueError("costs must be finite and positive")
    if not (np.all(np.isfinite(g)) and np.all(g >= 0)):
        raise ValueError("bounds must be finite and non-negative")
    if isinstance(bias_budget, bool | np.bool_):  # float(True) would pass as Γ = 1
        raise TypeError(f"bias_budget must be a number (Γ, in the units of G), got {bias_budget!r}")
    bias_budget = float(bias_budget)
    if not (math.isfinite(bias_budget) and bias_budget >= 0):
        raise ValueError(f"bias_budget must be finite and non-negative, got {bias_budget}")
    n = c.size if n is None else int(n)
    if n < c.size:
        raise ValueError(f"n={n} must be at least the number of examples, {c.size}")
    return c, g, max(n, 1)


def cost_factor(costs, bounds, indices=None) -> float:
    """(Σ_{i∈indices} G_i √c_i)²: the cost factor J of cost-aware SGD on `indices` (all examples when None)."""
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    g = np.asarray(bounds, dtype=np.float64).reshape(-1)
    if indices is not None:
        idx = np.asarray(indices, dtype=np.int64)
        c, g = c[idx], g[idx]
    return float(math.fsum((g * np.sqrt(c)).tolist()) ** 2)


def _lp_dropped_value(c: np.ndarray, g: np.ndarray, budget: float) -> float:
    """D_LP: the fractional knapsack's optimum of Σ_R v_i s.t. Σ_R w_i ≤ budget (v = G√c, w = G, density √c)."""
    pos = np.flatnonzero(g > 0)
    left, value = budget, 0.0
    for i in pos[np.argsort(-c[pos], kind="stable")].tolist():
        if g[i] <= left:
            left -= g[i]
            value += g[i] * math.sqrt(c[i])
        else:
            return value + left * math.sqrt(c[i])
    return value


def _report(c, g, n, bias_budget, chosen: list[int], method: str, drop_zero_bound: bool) -> SubsetReport:
    zero = np.flatnonzero(g == 0).tolist() if drop_zero_bound else []
    dropped = np.asarray(zero + chosen, dtype=np.int64)
    mask = np.ones(c.size, dtype=bool)
    mask[dropped] = False
    kept = np.flatnonzero(mask).astype(np.int64)
    v = g * np.sqrt(c)
    total_v = math.fsum(v.tolist())
    kept_v = math.fsum(v[kept].tolist())
    lower = max(total_v - _lp_dropped_value(c, g, n * float(bias_budget)), 0.0)
    return SubsetReport(
        kept=kept,
        dropped=dropped,
        reasons=("zero_bound",) * len(zero) + ("budget",) * len(chosen),
        n=n,
        bias_budget=float(bias_budget),
        bias_bound=math.fsum(g[dropped].tolist()) / n,
        cost_factor_before=total_v**2,
        cost_factor_after=kept_v**2,
        cost_factor_lower_bound=min(lower**2, kept_v**2),
        total_cost_before=math.fsum(c.tolist()),
        total_cost_after=math.fsum(c[kept].tolist()),
        method=method,
    )


def greedy_subset(
    costs, bounds, bias_budget: float, *, n: int | None = None, drop_zero_bound: bool = True
) -> SubsetReport:
    """Drop the most expensive examples while the bias bound stays within the budget.

    Examples with G_i > 0 are visited in decreasing c_i (ties: lower index first); example i is dropped when
    (1/n)(Σ_{j∈R} G_j + G_i) ≤ Γ. The scan goes on past an example that does not fit, since a cheaper one with a
    smaller G may still fit (never worse than stopping there). √J_K is within G_k √c_k of the optimum, k the first
    example that did not fit; the report's `cost_factor_lower_bound` certifies how far from it this selection is.

    `n` normalises the bias bound: the size of the full data set (default len(costs); larger when examples were set
    aside, e.g. the rows `select_subset` keeps without an estimate).
    """
    c, g, n = _arrays(costs, bounds, bias_budget, n)
    budget = n * float(bias_budget) * (1 + _BUDGET_RTOL)
    pos = np.flatnonzero(g > 0)
    chosen, used = [], 0.0
    for i in pos[np.argsort(-c[pos], kind="stable")].tolist():
        if used + g[i] <= budget:
            used += g[i]
            chosen.append(i)
    return _report(c, g, n, bias_budget, chosen, "greedy", drop_zero_bound)


def exact_subset(
    costs, bounds, bias_budget: float, *, n: int | None = None, drop_zero_bound: bool = True
) -> SubsetReport:
    """The minimum cost factor within the bias budget, by enumerating every subset of the examples with G_i > 0
    (at most `EXACT_MAX_EXAMPLES` of them). Among optimal sets the first in enumeration order wins (bit j of the
    subset's number is the j-th example with G > 0), so the result is deterministic."""
    c, g, n = _arrays(costs, bounds, bias_budget, n)
    pos = np.flatnonzero(g > 0)
    if pos.size > EXACT_MAX_EXAMPLES:
        raise ValueError(
            f"costs/bounds: exact selection enumerates 2^{pos.size} subsets; at most {EXACT_MAX_EXAMPLES} examples "
            "with a positive bound (use method='greedy')"
        )
    budget = n * float(bias_budget) * (1 + _BUDGET_RTOL)
    w, v = g[pos], g[pos] * np.sqrt(c[pos])
    bits = np.arange(pos.size, dtype=np.int64)
    best_value, best_mask = -1.0, 0
    for start in range(0, 1 << pos.size, 1 << 16):
        masks = np.arange(start, min(start + (1 << 16), 1 << pos.size), dtype=np.int64)
        member = ((masks[:, None] >> bits) & 1).astype(np.float64)
        value = np.where(member @ w <= budget, member @ v, -1.0)
        j = int(np.argmax(value))
        if value[j] > best_value:
            best_value, best_mask = float(value[j]), int(masks[j])
    chosen = sorted((int(pos[j]) for j in range(pos.size) if best_mask >> j & 1), key=lambda i: (-c[i], i))
    return _report(c, g, n, bias_budget, chosen, "exact", drop_zero_bound)


# ---------------------------------------------------------------------------------------------------- datasets
def _column(dataset, value, name: str) -> np.ndarray:
    if isinstance(value, str):
        if value not in dataset.column_names:
            raise ValueError(f"{name}: the dataset has no column {value!r}; columns: {dataset.column_names}")
        value = dataset[value]
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be numbers (an array or a numeric column): {err}") from err
    if array.size != len(dataset):
        raise ValueError(f"{name} has {array.size} values for a dataset of {len(dataset)} rows")
    return array


def select_subset(
    dataset,
    *,
    costs: str | Sequence[float] | np.ndarray,
    bounds: str | Sequence[float] | np.ndarray,
    bias_budget: float,
    method: str = "greedy",
    drop_zero_bound: bool = True,
):
    """Drop the expensive rows of a `datasets.Dataset` whose summed gradient bound fits a bias budget.

    Minimises the kept cost factor (Σ_{i kept} G_i √c_i)² subject to (1/n) Σ_{i dropped} G_i ≤ Γ, n = len(dataset):
    `greedy_subset` (drop the most expensive first; default) or `exact_subset` (small data sets).

    Args:
        dataset: a `datasets.Dataset` (anything with `column_names`, `len`, column access and `select`).
        costs: c_i > 0 per row, e.g. the mean tokens of the prompt's rollouts: a column name or an array.
        bounds: G_i ≥ 0 per row, e.g. the mean |advantage| of the prompt's rollouts: a column name or an array.
        bias_budget: Γ ≥ 0, in the units of G (a bias of Γ is a gradient error of at most Γ at every x).
        method: "greedy" or "exact".
        drop_zero_bound: drop the rows with G_i = 0 (they carry no gradient signal, so dropping them adds no bias).

    A row whose cost or bound is NaN has no estimate (e.g. a prompt the pilot run did not see): it is kept, takes no
    part in the selection, and still counts in n. Returns ``(dataset.select(report.kept), report)``; a selection that
    would keep no row (Γ at or above the mean G drops everything) raises a ValueError instead.

    Greedy's bound is the LP certificate: `report.cost_factor_lower_bound` is below every feasible selection's cost
    factor, so cost_factor_after / cost_factor_lower_bound bounds its distance to the optimum; it is not exact in
    general, even with the budget used up exactly (module docstring). `method="exact"` is exact.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    c = _column(dataset, costs, "costs")
    g = _column(dataset, bounds, "bounds")
    missing = np.isnan(c) | np.isnan(g)
    rows = np.flatnonzero(~missing)
    solve = greedy_subset if method == "greedy" else exact_subset
    inner = solve(c[rows], g[rows], bias_budget, n=len(dataset), drop_zero_bound=drop_zero_bound)
    unestimated = np.flatnonzero(missing).astype(np.int64)
    if inner.kept.size + unestimated.size == 0:
        raise ValueError(
            f"select_subset: bias_budget={inner.bias_budget:g} drops every row (the mean bound is "
            f"{float(np.mean(g[rows])) if rows.size else 0.0:g}, and Γ at or above it lets every row go): nothing "
            "would be left to train on. Use a smaller bias_budget."
        )
    report = replace(
        inner,
        kept=np.union1d(rows[inner.kept], unestimated).astype(np.int64),
        dropped=rows[inner.dropped].astype(np.int64),
        unestimated=unestimated,
    )
    return dataset.select(report.kept.tolist()), report


def _key(value: Any) -> str:
    """A prompt as a hashable key: text as is, a conversation (list of message dicts) as sorted-key JSON."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return str(value)


def pilot_statistics(
    dataset,
    records: Iterable[Mapping[str, Any]],
    *,
    key: str = "prompt",
    tokens: str | Callable[[Mapping[str, Any]], float] = "tokens",
    bound: str = "abs_advantage",
    reward_column: str = "reward",
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row cost c and gradient bound G of `dataset` from the rollouts of a pilot run.

    `records` holds one row per rollout (dicts, or a `datasets.Dataset` such as TRL's ``log_completions`` parquet
    files loaded with ``Dataset.from_parquet``), matched to the dataset's rows by the `key` column (text, or a
    conversation by content). c = the mean of `tokens` over the prompt's rollouts (a column name, or a function of
    the record, e.g. counting prompt and completion with the tokenizer); G = the mean |advantage| of its rollouts
    (``bound="abs_advantage"``, the column ``advantage``) or the population standard deviation of `reward_column`
    (``bound="reward_std"``). With TRL's per-group std scaling, mean |A| is nearly the same for every prompt with any
    reward variance, so it mainly separates the prompts without any. Non-finite values are ignored.

    Returns ``(costs, bounds)`` aligned with the dataset's rows, NaN for rows without records (`select_subset` keeps
    those rows).
    """
    if bound not in BOUND_ESTIMATES:
        raise ValueError(f"bound must be one of {BOUND_ESTIMATES}, got {bound!r}")
    if key not in dataset.column_names:
        raise ValueError(f"key: the dataset has no column {key!r}; columns: {dataset.column_names}")
    signal_column = "advantage" if bound == "abs_advantage" else reward_column
    per_key: dict[str, tuple[list[float], list[float]]] = {}
    for i, record in enumerate(records):
        for column in (key, signal_column) + (() if callable(tokens) else (tokens,)):
            if column not in record:
                raise ValueError(f"records[{i}] has no {column!r} column; columns: {sorted(record)}")
        cost = float(tokens(record) if callable(tokens) else record[tokens])
        signal = float(record[signal_column])
        costs, signals = per_key.setdefault(_key(record[key]), ([], []))
        if math.isfinite(cost):
            costs.append(cost)
        if math.isfinite(signal):
            signals.append(abs(signal) if bound == "abs_advantage" else signal)
    c = np.full(len(dataset), np.nan)
    g = np.full(len(dataset), np.nan)
    for row, value in enumerate(dataset[key]):
        costs, signals = per_key.get(_key(value), ([], []))
        if costs:
            c[row] = float(np.mean(costs))
            g[row] = 0.0 if not signals else float(np.mean(signals) if bound == "abs_advantage" else np.std(signals))
    return c, g


__all__ = [
    "BOUND_ESTIMATES",
    "EXACT_MAX_EXAMPLES",
    "METHODS",
    "SubsetReport",
    "cost_factor",
    "exact_subset",
    "greedy_subset",
    "pilot_statistics",
    "select_subset",
]
