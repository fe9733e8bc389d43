"""Static cost-aware subset selection: trade a bounded bias for a lower sampling cost (docs/algorithm.md §3).

Setting. F(x) = (1/n) Σ_i f_i(x), component i costs c_i > 0 per gradient query and ‖∇f_i‖ ≤ G_i. Cost-aware SGD
with the optimal sampler p*_i ∝ G_i/√c_i needs a total cost proportional to J(p*) = (Σ_i G_i √c_i)² (see
`trl_costaware.core.sampling.j_ratio_ideal`). Dropping a set R of examples before training and running on the kept set
K = [n] \\ R changes two things:

    cost factor   J_K  = (Σ_{i∈K} G_i √c_i)²                       (what cost-aware SGD on K pays, up to constants)
    bias bound    β_R  = (1/n) Σ_{i∈R} G_i   ≥  ‖∇F(x) − (1/n) Σ_{i∈K} ∇f_i(x)‖   for every x.

We minimise J_K subject to β_R ≤ Γ. With v_i = G_i √c_i (value) and w_i = G_i (weight), and V = Σ_i v_i, this is

    maximise Σ_{i∈R} v_i   subject to   Σ_{i∈R} w_i ≤ nΓ,                                         (0/1 knapsack)

since J_K = (V − Σ_{i∈R} v_i)². "Drop the most expensive first" is defined by c_i, and it *is* the knapsack
density rule: v_i / w_i = G_i √c_i / G_i = √c_i, so ordering by value per unit of bias budget is ordering by c_i.
Consequences (Dantzig's LP relaxation): the fractional optimum drops the items in decreasing c_i and a fraction of
the first item k that does not fit, so for every feasible R*

    √J_K(greedy) − v_k  ≤  V − D_LP  ≤  √J_K(R*)  ≤  √J_K(greedy),         D_LP the LP relaxation's dropped value,

i.e. the greedy rule is within one item's value v_k = G_k √c_k of the exact optimum in √(cost factor), and exact
whenever the budget is used up exactly or all G_i are equal. `SubsetSelection.cost_factor_lower_bound` is
(V − D_LP)², an a-posteriori certificate. On large sets one item is a negligible part of V (n = 1000 in
benchmarks/subset_selection.py: J within ~1e-4 of the LP bound). On tiny sets the ratio J(greedy)/J(exact) can be
large when the exact optimum keeps almost nothing (tests/test_subset.py prints the worst ratio over random
instances). The alternative order by v_i (`order="value"`: drop the largest contributions to the cost factor first)
has no guarantee but does better on such tiny instances; `order="best"` runs both and keeps the better one.

Examples with G_i = 0 add nothing to the bias bound and nothing to J_K (cost-aware SGD never samples them), so they
are dropped for free (reason "zero_bound") unless `drop_zero_bound=False`; Γ = 0 therefore keeps exactly the
examples with a nonzero bound.

Per-prompt estimates for GRPO data come from a pilot run's records: c = mean rollout tokens (prompt + completion),
G = mean |A| or the reward standard deviation (`prompt_statistics`, `filter_dataset`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ORDERS = ("cost", "value", "best")
METHODS = ("greedy", "exact")
GRADIENT_ESTIMATES = ("abs_advantage", "reward_std")
COST_ESTIMATES = ("prompt_completion", "completion")

# Relative slack when comparing a dropped set's summed bound against the budget nΓ (float rounding only).
_BUDGET_RTOL = 1e-12
# The exact solver enumerates all subsets of the examples with G_i > 0.
EXACT_MAX_N = 22


@dataclass(frozen=True)
class SubsetSelection:
    """Result of a subset selection. Indices refer to the positions in the `costs`/`bounds` arrays."""

    kept: np.ndarray  # (|K|,) int64, ascending
    dropped: np.ndarray  # (|R|,) int64, in the order they were dropped (zero-bound examples first)
    reasons: tuple[str, ...]  # one per dropped index: "zero_bound" or "budget"
    n: int  # the n in the bias bound (1/n) Σ_R G_i
    gamma: float  # the bias budget Γ
    bias_bound: float  # (1/n) Σ_{i∈R} G_i  ≤ Γ
    cost_factor_before: float  # (Σ_all G_i √c_i)²
    cost_factor_after: float  # (Σ_{i∈K} G_i √c_i)²
    cost_factor_lower_bound: float  # (V − D_LP)²: no feasible R gives a smaller cost factor
    total_cost_before: float  # Σ_all c_i (the cost of one pass over the data)
    total_cost_after: float  # Σ_{i∈K} c_i
    method: str  # "greedy-cost", "greedy-value" or "exact"

    @property
    def cost_factor_ratio(self) -> float:
        """J_K / J_all: the theory's total-cost ratio of cost-aware SGD on the kept set against the full set."""
        return self.cost_factor_after / self.cost_factor_before if self.cost_factor_before > 0 else 1.0

    def kept_mask(self, size: int | None = None) -> np.ndarray:
        size = int(self.kept.size + self.dropped.size) if size is None else size
        mask = np.zeros(size, dtype=bool)
        mask[self.kept] = True
        return mask

    def summary(self) -> str:
        return (
            f"{self.method}: Γ={self.gamma:.4g}, dropped {self.dropped.size} of {self.kept.size + self.dropped.size} "
            f"(bias bound {self.bias_bound:.4g}), cost factor {self.cost_factor_before:.4g} → "
            f"{self.cost_factor_after:.4g} (×{self.cost_factor_ratio:.3f}, LP lower bound "
            f"{self.cost_factor_lower_bound:.4g}), pass cost {self.total_cost_before:.4g} → "
            f"{self.total_cost_after:.4g}"
        )


def _validate(costs, bounds, gamma: float, n: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    g = np.asarray(bounds, dtype=np.float64).reshape(-1)
    if c.shape != g.shape:
        raise ValueError(f"costs and bounds must have the same length, got {c.size} and {g.size}")
    if not (np.all(np.isfinite(c)) and np.all(c > 0)):
        raise ValueError("costs must be finite and positive")
    if not (np.all(np.isfinite(g)) and np.all(g >= 0)):
        raise ValueError("gradient bounds must be finite and non-negative")
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"the bias budget Γ must be finite and non-negative, got {gamma}")
    n = c.size if n is None else int(n)
    if n < c.size:
        raise ValueError(f"n={n} must be at least the number of examples {c.size}")
    return c, g, max(n, 1)


def cost_factor(costs, bounds, indices=None) -> float:
    """(Σ_{i∈indices} G_i √c_i)², the J(p*) of cost-aware SGD restricted to `indices` (all when None)."""
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    g = np.asarray(bounds, dtype=np.float64).reshape(-1)
    if indices is not None:
        idx = np.asarray(indices, dtype=np.int64)
        c, g = c[idx], g[idx]
    return float(math.fsum((g * np.sqrt(c)).tolist()) ** 2)


def _lp_dropped_value(c: np.ndarray, g: np.ndarray, budget: float) -> float:
    """Dantzig's fractional-knapsack optimum of Σ_R v_i s.t. Σ_R w_i ≤ budget (v = G√c, w = G, density √c)."""
    pos = np.flatnonzero(g > 0)
    order = pos[np.argsort(-c[pos], kind="stable")]
    left, value = budget, 0.0
    for i in order:
        if g[i] <= left:
            left -= g[i]
            value += g[i] * math.sqrt(c[i])
        else:
            value += left * math.sqrt(c[i])
            break
    return value


def _finish(c, g, n, gamma, dropped: list[int], reasons: list[str], method: str, budget: float) -> SubsetSelection:
    dropped_arr = np.asarray(dropped, dtype=np.int64)
    mask = np.ones(c.size, dtype=bool)
    mask[dropped_arr] = False
    kept = np.flatnonzero(mask).astype(np.int64)
    v = g * np.sqrt(c)
    total_v = math.fsum(v.tolist())
    kept_v = math.fsum(v[kept].tolist())
    lower = max(total_v - _lp_dropped_value(c, g, budget), 0.0)
    return SubsetSelection(
        kept=kept,
        dropped=dropped_arr,
        reasons=tuple(reasons),
        n=n,
        gamma=float(gamma),
        bias_bound=math.fsum(g[dropped_arr].tolist()) / n,
        cost_factor_before=total_v**2,
        cost_factor_after=kept_v**2,
        cost_factor_lower_bound=min(lower**2, kept_v**2),
        total_cost_before=math.fsum(c.tolist()),
        total_cost_after=math.fsum(c[kept].tolist()),
        method=method,
    )


def select_subset_greedy(
    costs,
    bounds,
    gamma: float,
    *,
    n: int | None = None,
    order: str = "cost",
    fill: bool = True,
    drop_zero_bound: bool = True,
) -> SubsetSelection:
    """Greedy cost-aware subset selection: drop the most expensive examples while the bias bound stays ≤ Γ.

    Examples with G_i > 0 are visited in decreasing c_i (`order="cost"`, the knapsack density √c_i = v_i/w_i, see
    the module docstring) or decreasing G_i √c_i (`order="value"`); ties go to the lower index. `order="best"` runs
    both and returns the one with the smaller cost factor (ties to "cost"): never worse than either. Example i is
    dropped when (1/n)(Σ_{j∈R} G_j + G_i) ≤ Γ. With `fill=True` the scan continues past an example that does not
    fit (a cheaper one may still fit: never worse); with `fill=False` it stops at the first one (the plain prefix
    rule). Zero-bound examples are dropped first, for free, when `drop_zero_bound`.

    `n` is the normaliser of the bias bound, the size of the full data set (defaults to len(costs); pass the full
    size when some examples were set aside, e.g. prompts without statistics).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    c, g, n = _validate(costs, bounds, gamma, n)
    if order == "best":
        kw = {"n": n, "fill": fill, "drop_zero_bound": drop_zero_bound}
        by_cost = select_subset_greedy(c, g, gamma, order="cost", **kw)
        by_value = select_subset_greedy(c, g, gamma, order="value", **kw)
        best = by_value if by_value.cost_factor_after < by_cost.cost_factor_after else by_cost
        return replace(best, method=f"greedy-best({best.method.removeprefix('greedy-')})")
    budget = n * float(gamma)
    dropped: list[int] = []
    reasons: list[str] = []
    if drop_zero_bound:
        zero = np.flatnonzero(g == 0).tolist()
        dropped += zero
        reasons += ["zero_bound"] * len(zero)
    pos = np.flatnonzero(g > 0)
    key = c[pos] if order == "cost" else g[pos] * np.sqrt(c[pos])
    used = 0.0
    for i in pos[np.argsort(-key, kind="stable")].tolist():
        if used + g[i] <= budget * (1 + _BUDGET_RTOL):
            used += g[i]
            dropped.append(i)
            reasons.append("budget")
        elif not fill:
            break
    return _finish(c, g, n, gamma, dropped, reasons, f"greedy-{order}", budget)


def select_subset_exact(
    costs,
    bounds,
    gamma: float,
    *,
    n: int | None = None,
    drop_zero_bound: bool = True,
    max_n: int = EXACT_MAX_N,
) -> SubsetSelection:
    """Exact minimum cost factor subject to the bias budget, by enumerating every subset of the examples with
    G_i > 0 (at most `max_n` of them: 2^max_n subsets). Among optimal sets the first in enumeration order wins
    (bit j of the subset number = j-th positive-bound example), so the result is deterministic."""
    c, g, n = _validate(costs, bounds, gamma, n)
    budget = n * float(gamma)
    pos = np.flatnonzero(g > 0)
    if pos.size > max_n:
        raise ValueError(f"exact selection enumerates 2^{pos.size} subsets; at most {max_n} positive-bound examples")
    w = g[pos]
    v = g[pos] * np.sqrt(c[pos])
    best_value, best_mask = -1.0, 0
    chunk = 1 << 16
    bits = np.arange(pos.size, dtype=np.int64)
    for start in range(0, 1 << pos.size, chunk):
        masks = np.arange(start, min(start + chunk, 1 << pos.size), dtype=np.int64)
        member = ((masks[:, None] >> bits) & 1).astype(np.float64)
        weight = member @ w
        value = np.where(weight <= budget * (1 + _BUDGET_RTOL), member @ v, -1.0)
        j = int(np.argmax(value))
        if value[j] > best_value:
            best_value, best_mask = float(value[j]), int(masks[j])
    dropped: list[int] = []
    reasons: list[str] = []
    if drop_zero_bound:
        zero = np.flatnonzero(g == 0).tolist()
        dropped += zero
        reasons += ["zero_bound"] * len(zero)
    chosen = [int(pos[j]) for j in range(pos.size) if best_mask >> j & 1]
    chosen.sort(key=lambda i: (-c[i], i))
    dropped += chosen
    reasons += ["budget"] * len(chosen)
    return _finish(c, g, n, gamma, dropped, reasons, "exact", budget)


def select_subset(costs, bounds, gamma: float, *, method: str = "greedy", **kwargs) -> SubsetSelection:
    """Dispatch to `select_subset_greedy` (default) or `select_subset_exact`."""
    if method == "greedy":
        return select_subset_greedy(costs, bounds, gamma, **kwargs)
    if method == "exact":
        return select_subset_exact(costs, bounds, gamma, **kwargs)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


# ----------------------------------------------------------------------------------------------------------------
# Per-prompt estimates from a finished run, and the dataset filter.


def canonical_key(value: Any) -> str:
    """A hashable, order-stable key for a prompt or prompt id: scalars by `str`, conversations (lists of message
    dicts, possibly numpy arrays after a parquet round trip) by sorted-key JSON."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(_to_plain(value), sort_keys=True, ensure_ascii=False, default=str)
    if isinstance(value, np.generic):
        value = value.item()
    return str(value)


def _to_plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_to_plain(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def load_records(records) -> Any:
    """Rollout records as a pandas DataFrame, one row per rollout.

    Accepts a DataFrame, a list of dicts, a dict of columns, a `datasets.Dataset`, or a path to a JSONL file, a
    parquet file, or a directory of parquet/JSONL files (e.g. TRL's `<output_dir>/completions/`, written with
    `log_completions=True`; note TRL keeps only the last generation batch per logging step there).
    """
    import pandas as pd

    if isinstance(records, pd.DataFrame):
        return records.reset_index(drop=True)
    if isinstance(records, (str, Path)):
        path = Path(records)
        files = sorted(path.glob("*.parquet")) + sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no *.parquet or *.jsonl records under {path}")
        frames = [pd.read_parquet(f) if f.suffix == ".parquet" else pd.read_json(f, lines=True) for f in files]
        return pd.concat(frames, ignore_index=True)
    if hasattr(records, "to_pandas"):
        return records.to_pandas()
    if isinstance(records, Mapping):
        return pd.DataFrame(dict(records))
    if isinstance(records, Iterable):
        return pd.DataFrame(list(records))
    raise TypeError(f"cannot read rollout records from {type(records).__name__}")


def _default_key_column(df) -> str:
    for name in ("prompt_id", "prompt"):
        if name in df.columns:
            return name
    raise ValueError(f"records need a 'prompt' or 'prompt_id' column (or pass record_key); got {list(df.columns)}")


def prompt_statistics(
    records,
    *,
    record_key: str | None = None,
    gradient: str = "abs_advantage",
    cost: str = "prompt_completion",
    reward_column: str = "reward",
    token_counter: Callable[[Any], int] | None = None,
):
    """Per-prompt cost c and gradient bound G from a finished run's rollout records.

    Columns used (one row per rollout):
      - key: `record_key`, else `prompt_id`, else `prompt` (text or a conversation);
      - tokens: `tokens` (prompt + completion) or `prompt_tokens` + `completion_tokens`; for `cost="completion"`,
        `completion_tokens`. Missing token columns are counted with `token_counter(text)` from `prompt` /
        `completion` when given;
      - gradient: `advantage` (`gradient="abs_advantage"`: G = mean |A| over the prompt's rollouts; note that with
        per-group std scaling, TRL's default, mean |A| is nearly constant across prompts that have any reward
        variance, so it mostly separates zero-variance prompts) or `reward_column`
        (`gradient="reward_std"`: G = population standard deviation of the prompt's rewards).

    c = mean rollout tokens of the prompt. Non-finite advantages/rewards are ignored. Returns a DataFrame indexed by
    the canonical key (`canonical_key`) with columns `key`, `n_rollouts`, `cost`, `bound`.
    """
    import pandas as pd

    if gradient not in GRADIENT_ESTIMATES:
        raise ValueError(f"gradient must be one of {GRADIENT_ESTIMATES}, got {gradient!r}")
    if cost not in COST_ESTIMATES:
        raise ValueError(f"cost must be one of {COST_ESTIMATES}, got {cost!r}")
    df = load_records(records)
    key_col = record_key or _default_key_column(df)
    if key_col not in df.columns:
        raise ValueError(f"records have no column {key_col!r}; got {list(df.columns)}")

    def count(column: str) -> pd.Series:
        if column in df.columns:
            return pd.to_numeric(df[column], errors="coerce").astype(float)
        text = column.removesuffix("_tokens")
        if token_counter is not None and text in df.columns:
            return df[text].map(lambda t: float(token_counter(t)))
        raise ValueError(
            f"records have no {column!r} column (and no token_counter with a {text!r} column) to derive rollout "
            f"costs from; got {list(df.columns)}"
        )

    if cost == "completion":
        tokens = count("completion_tokens")
    elif "tokens" in df.columns:
        tokens = pd.to_numeric(df["tokens"], errors="coerce").astype(float)
    else:
        tokens = count("prompt_tokens") + count("completion_tokens")

    if gradient == "abs_advantage":
        if "advantage" not in df.columns:
            raise ValueError(f"gradient='abs_advantage' needs an 'advantage' column; got {list(df.columns)}")
        signal = pd.to_numeric(df["advantage"], errors="coerce").astype(float).abs()
    else:
        if reward_column not in df.columns:
            raise ValueError(f"gradient='reward_std' needs a {reward_column!r} column; got {list(df.columns)}")
        signal = pd.to_numeric(df[reward_column], errors="coerce").astype(float)
    signal = signal.where(np.isfinite(signal))

    frame = pd.DataFrame(
        {"canon": df[key_col].map(canonical_key), "key": df[key_col], "tokens": tokens, "signal": signal}
    )
    grouped = frame.groupby("canon", sort=True)
    if gradient == "abs_advantage":
        bound = grouped["signal"].mean()
    else:
        bound = grouped["signal"].std(ddof=0)
    stats = pd.DataFrame(
        {
            "key": grouped["key"].first(),
            "n_rollouts": grouped.size(),
            "cost": grouped["tokens"].mean(),
            "bound": bound.fillna(0.0).clip(lower=0.0),
        }
    )
    stats.index.name = "canonical_key"
    return stats


@dataclass
class FilterReport:
    """What `filter_dataset` kept, dropped and why. Indices are row positions in the input dataset."""

    selection: SubsetSelection  # over the matched rows (positions in `matched`)
    matched: np.ndarray  # dataset rows with statistics, in dataset order
    kept: np.ndarray  # dataset rows kept (matched-and-kept plus unmatched), ascending
    dropped: Any  # DataFrame: index, key, n_rollouts, cost, bound, value, cumulative_bias, reason
    unmatched: np.ndarray  # dataset rows without records: kept, and excluded from the selection
    unused_record_keys: list[str] = field(default_factory=list)  # prompts in the records but not in the dataset

    def summary(self, max_rows: int = 20) -> str:
        lines = [
            self.selection.summary(),
            (
                f"kept {self.kept.size} rows ({self.unmatched.size} without records, kept unconditionally); "
                f"{len(self.unused_record_keys)} record prompts not in the dataset"
            ),
        ]
        if len(self.dropped):
            lines.append(self.dropped.head(max_rows).to_string(index=False))
            if len(self.dropped) > max_rows:
                lines.append(f"... {len(self.dropped) - max_rows} more dropped rows")
        return "\n".join(lines)


_REASONS = {
    "zero_bound": "G=0: no gradient signal in the pilot run; dropping it adds no bias",
    "budget": "expensive: dropped in decreasing cost while (1/n)·Σ_dropped G ≤ Γ",
}


def filter_dataset(
    dataset,
    records,
    gamma: float,
    *,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    record_key: str | None = None,
    gradient: str = "abs_advantage",
    cost: str = "prompt_completion",
    reward_column: str = "reward",
    token_counter: Callable[[Any], int] | None = None,
    method: str = "greedy",
    **selection_kwargs,
):
    """Drop expensive prompts from a `datasets.Dataset` within a bias budget Γ, from a pilot run's records.

    Rows are matched to records by `id_column` (against the records' `record_key` column, default the same name) or,
    without one, by `prompt_column` (against the records' `record_key`, default `prompt`); conversations match by
    content. Per-prompt c and G come from
    `prompt_statistics`; the selection (`select_subset`, greedy by default) runs over the matched rows with the bias
    normaliser n = len(dataset). Rows without records are kept and listed in `FilterReport.unmatched`.

    Returns (filtered dataset, FilterReport). The report's `dropped` table lists each dropped row with its c, G,
    G√c, the cumulative bias bound after dropping it and the reason.
    """
    import pandas as pd

    key_column = id_column or prompt_column
    if key_column not in dataset.column_names:
        raise ValueError(f"dataset has no column {key_column!r}; got {dataset.column_names}")
    rec_key = record_key or (id_column if id_column is not None else "prompt")
    stats = prompt_statistics(
        records,
        record_key=rec_key,
        gradient=gradient,
        cost=cost,
        reward_column=reward_column,
        token_counter=token_counter,
    )
    keys = [canonical_key(v) for v in dataset[key_column]]
    known = np.array([k in stats.index for k in keys], dtype=bool)
    matched = np.flatnonzero(known).astype(np.int64)
    unmatched = np.flatnonzero(~known).astype(np.int64)
    matched_keys = [keys[i] for i in matched]
    c = stats.loc[matched_keys, "cost"].to_numpy(dtype=np.float64) if matched.size else np.zeros(0)
    g = stats.loc[matched_keys, "bound"].to_numpy(dtype=np.float64) if matched.size else np.zeros(0)
    bad = ~(np.isfinite(c) & (c > 0))
    if bad.any():
        raise ValueError(
            f"non-positive or missing token counts for prompts {[matched_keys[i] for i in np.flatnonzero(bad)][:5]}"
        )
    selection = select_subset(c, g, gamma, method=method, n=len(dataset), **selection_kwargs)

    kept = np.sort(np.concatenate([matched[selection.kept], unmatched])).astype(np.int64)
    rows = []
    cumulative = 0.0
    for j, reason in zip(selection.dropped.tolist(), selection.reasons, strict=True):
        cumulative += g[j]
        rows.append(
            {
                "index": int(matched[j]),
                "key": _short(stats.loc[matched_keys[j], "key"]),
                "n_rollouts": int(stats.loc[matched_keys[j], "n_rollouts"]),
                "cost": float(c[j]),
                "bound": float(g[j]),
                "value": float(g[j] * math.sqrt(c[j])),
                "cumulative_bias": cumulative / selection.n,
                "reason": reason,
                "why": _REASONS[reason],
            }
        )
    columns = ["index", "key", "n_rollouts", "cost", "bound", "value", "cumulative_bias", "reason", "why"]
    dropped = pd.DataFrame(rows, columns=columns)
    unused = sorted(set(stats.index) - set(keys))
    report = FilterReport(
        selection=selection,
        matched=matched,
        kept=kept,
        dropped=dropped,
        unmatched=unmatched,
        unused_record_keys=unused,
    )
    return dataset.select(kept.tolist()), report


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else canonical_key(value)
    return text if len(text) <= width else text[: width - 1] + "…"


__all__ = [
    "COST_ESTIMATES",
    "EXACT_MAX_N",
    "GRADIENT_ESTIMATES",
    "METHODS",
    "ORDERS",
    "FilterReport",
    "SubsetSelection",
    "canonical_key",
    "cost_factor",
    "filter_dataset",
    "load_records",
    "prompt_statistics",
    "select_subset",
    "select_subset_exact",
    "select_subset_greedy",
]
