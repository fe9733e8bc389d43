"""Tests for static cost-aware subset selection (`trl_costaware.prompts.subset`, docs/algorithm.md §3)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_costaware.prompts.subset import (
    SubsetSelection,
    canonical_key,
    cost_factor,
    filter_dataset,
    load_records,
    prompt_statistics,
    select_subset,
    select_subset_exact,
    select_subset_greedy,
)

FAST = settings(max_examples=80, deadline=None)


def _instance(rng: np.random.Generator, n: int, zero_frac: float = 0.1):
    c = rng.uniform(1.0, 10.0, n)
    g = rng.lognormal(0.0, 1.0, n) * (rng.random(n) >= zero_frac)
    gamma = rng.uniform(0.0, 1.0) * g.sum() / n
    return c, g, gamma


def _break_value(c: np.ndarray, g: np.ndarray, budget: float) -> float:
    """v_k = G_k √c_k of the first example, in decreasing c, that does not fit into the prefix greedy's budget."""
    left = budget
    for i in np.argsort(-c, kind="stable"):
        if g[i] == 0:
            continue
        if g[i] <= left * (1 + 1e-12):
            left -= g[i]
        else:
            return float(g[i] * math.sqrt(c[i]))
    return 0.0


def _check_valid(sel: SubsetSelection, c: np.ndarray, g: np.ndarray, gamma: float, n: int | None = None):
    n = len(c) if n is None else n
    assert sorted(sel.kept.tolist() + sel.dropped.tolist()) == list(range(len(c)))
    assert len(set(sel.dropped.tolist())) == sel.dropped.size
    assert np.all(np.diff(sel.kept) > 0)
    bias = math.fsum(g[sel.dropped].tolist()) / n
    assert bias == pytest.approx(sel.bias_bound, rel=1e-12, abs=1e-15)
    assert bias <= gamma * (1 + 1e-9) + 1e-15, "bias budget exceeded"
    assert sel.cost_factor_after == pytest.approx(cost_factor(c, g, sel.kept), rel=1e-12, abs=1e-300)
    assert sel.cost_factor_before == pytest.approx(cost_factor(c, g), rel=1e-12)
    assert sel.cost_factor_after <= sel.cost_factor_before * (1 + 1e-12)
    assert sel.cost_factor_lower_bound <= sel.cost_factor_after * (1 + 1e-12)
    assert sel.total_cost_after == pytest.approx(c[sel.kept].sum(), rel=1e-12, abs=0)
    assert len(sel.reasons) == sel.dropped.size
    for i, reason in zip(sel.dropped.tolist(), sel.reasons, strict=True):
        assert reason == ("zero_bound" if g[i] == 0 else "budget")


def test_greedy_against_exact_on_random_small_instances(capsys):
    """Greedy (each order) vs the exact optimum on 600 random instances with n ≤ 12.

    Guaranteed (module docstring, Dantzig's LP bound): for the cost order, √J(greedy) ≤ √J(exact) + v_k with v_k the
    value of the first example that does not fit, and the LP bound (V − D_LP)² ≤ J(exact). Ratios J(greedy)/J(exact)
    can be large when the exact optimum drops almost everything, so we assert the additive bound and report ratios.
    """
    rng = np.random.default_rng(0)
    stats = {order: [] for order in ("cost", "value", "best")}
    exact_hits = {order: 0 for order in stats}
    trials = 600
    for _ in range(trials):
        n = int(rng.integers(1, 13))
        c, g, gamma = _instance(rng, n)
        exact = select_subset_exact(c, g, gamma)
        _check_valid(exact, c, g, gamma)
        assert exact.cost_factor_lower_bound <= exact.cost_factor_after * (1 + 1e-12)
        v_k = _break_value(c, g, n * gamma)
        for order, ratios in stats.items():
            greedy = select_subset_greedy(c, g, gamma, order=order)
            _check_valid(greedy, c, g, gamma)
            # Exact is optimal; greedy never beats it.
            assert exact.cost_factor_after <= greedy.cost_factor_after * (1 + 1e-9)
            # The LP relaxation certifies a lower bound on the optimum, whatever order produced the selection.
            assert greedy.cost_factor_lower_bound <= exact.cost_factor_after * (1 + 1e-9) + 1e-12
            if order in ("cost", "best"):
                assert math.sqrt(greedy.cost_factor_after) <= math.sqrt(exact.cost_factor_after) + v_k + 1e-9
            ratio = greedy.cost_factor_after / exact.cost_factor_after if exact.cost_factor_after > 0 else 1.0
            ratios.append(ratio)
            exact_hits[order] += ratio <= 1 + 1e-9
    with capsys.disabled():
        print()
        for order, ratios in stats.items():
            r = np.asarray(ratios)
            print(
                f"greedy-{order} vs exact over {trials} instances: exact in {exact_hits[order]}, "
                f"median ratio {np.median(r):.4f}, 95th pct {np.quantile(r, 0.95):.3f}, worst {r.max():.3f}"
            )
    # Taking the better of the two orders can only help.
    assert np.all(np.asarray(stats["best"]) <= np.minimum(stats["cost"], stats["value"]) + 1e-12)
    # Sanity on typical behaviour (not a theorem): the cost order is exact on most small instances.
    assert exact_hits["cost"] >= trials // 2


def test_greedy_is_exact_with_equal_bounds():
    """With equal G_i the weights are equal, so dropping the k most expensive examples is optimal."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 13))
        c = rng.uniform(1.0, 10.0, n)
        g = np.full(n, rng.uniform(0.1, 3.0))
        gamma = rng.uniform(0.0, 1.0) * g.sum() / n
        greedy = select_subset_greedy(c, g, gamma)
        exact = select_subset_exact(c, g, gamma)
        assert greedy.cost_factor_after == pytest.approx(exact.cost_factor_after, rel=1e-12)
        assert sorted(greedy.dropped.tolist()) == sorted(np.argsort(-c, kind="stable")[: greedy.dropped.size].tolist())


def test_greedy_is_exact_when_the_budget_is_used_up():
    c = np.array([10.0, 8.0, 6.0, 4.0, 2.0])
    g = np.array([1.0, 2.0, 1.0, 1.0, 1.0])
    sel = select_subset_greedy(c, g, gamma=3.0 / 5)  # drops rows 0 and 1: Σ G = 3 = nΓ exactly
    assert sel.dropped.tolist() == [0, 1] and sel.bias_bound == pytest.approx(0.6)
    assert sel.cost_factor_after == pytest.approx(select_subset_exact(c, g, 3.0 / 5).cost_factor_after)
    assert sel.cost_factor_lower_bound == pytest.approx(sel.cost_factor_after)


def test_the_greedy_rule_worked_example():
    # Knapsack density v/w = √c, so the greedy order is by cost. With fill, a cheaper example that still fits is
    # dropped after a more expensive one that does not.
    c = np.array([9.0, 4.0, 1.0, 16.0])
    g = np.array([1.0, 1.0, 1.0, 3.0])
    sel = select_subset_greedy(c, g, gamma=2.0 / 4)  # budget nΓ = 2
    assert sel.dropped.tolist() == [0, 1]  # row 3 (c=16) needs 3 > 2; then rows 0 and 1
    assert sel.kept.tolist() == [2, 3]
    assert sel.cost_factor_before == pytest.approx((3 + 2 + 1 + 12) ** 2)
    assert sel.cost_factor_after == pytest.approx((1 + 12) ** 2)
    prefix = select_subset_greedy(c, g, gamma=2.0 / 4, fill=False)  # the plain prefix rule stops at row 3
    assert prefix.dropped.size == 0
    exact = select_subset_exact(c, g, gamma=2.0 / 4)
    assert exact.cost_factor_after == pytest.approx(sel.cost_factor_after)
    assert "greedy-cost" in sel.summary() and sel.cost_factor_ratio == pytest.approx(169 / 324)
    assert sel.kept_mask().tolist() == [False, False, True, True]


@FAST
@given(
    data=st.lists(
        st.tuples(st.floats(0.5, 100.0), st.one_of(st.just(0.0), st.floats(1e-3, 1e3))), min_size=1, max_size=40
    ),
    frac=st.floats(0.0, 1.5),
    order=st.sampled_from(["cost", "value", "best"]),
    fill=st.booleans(),
)
def test_budget_is_never_exceeded(data, frac, order, fill):
    c = np.array([x for x, _ in data])
    g = np.array([y for _, y in data])
    gamma = frac * g.sum() / len(c)
    sel = select_subset_greedy(c, g, gamma, order=order, fill=fill)
    _check_valid(sel, c, g, gamma)
    # Maximality of the fill rule: no kept positive-bound example would still fit.
    if fill and order == "cost":
        slack = len(c) * gamma - g[sel.dropped].sum()
        kept_pos = sel.kept[g[sel.kept] > 0]
        assert np.all(g[kept_pos] > slack * (1 + 1e-12) - 1e-12)
    # The selection is a pure function of its inputs.
    again = select_subset_greedy(c.copy(), g.copy(), gamma, order=order, fill=fill)
    assert np.array_equal(sel.kept, again.kept) and np.array_equal(sel.dropped, again.dropped)
    assert sel.reasons == again.reasons and sel.cost_factor_after == again.cost_factor_after


def test_zero_budget_keeps_every_example_with_a_nonzero_bound():
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        c, g, _ = _instance(rng, n, zero_frac=0.3)
        for method in ("greedy", "exact") if n <= 12 else ("greedy",):
            sel = select_subset(c, g, 0.0, method=method)
            assert set(sel.kept.tolist()) == set(np.flatnonzero(g > 0).tolist())
            assert set(sel.dropped.tolist()) == set(np.flatnonzero(g == 0).tolist())
            assert all(r == "zero_bound" for r in sel.reasons)
            assert sel.bias_bound == 0.0
            assert sel.cost_factor_after == pytest.approx(sel.cost_factor_before)
            kept_all = select_subset(c, g, 0.0, method=method, drop_zero_bound=False)
            assert kept_all.kept.size == n and kept_all.dropped.size == 0


def test_deterministic_tie_breaking():
    c = np.array([5.0, 5.0, 5.0, 1.0])
    g = np.array([1.0, 1.0, 1.0, 1.0])
    for _ in range(3):
        assert select_subset_greedy(c, g, gamma=2 / 4).dropped.tolist() == [0, 1]  # equal costs: lower index first
        assert select_subset_exact(c, g, gamma=2 / 4).dropped.tolist() == [0, 1]


def test_normaliser_n_and_validation():
    c = np.array([10.0, 1.0])
    g = np.array([1.0, 1.0])
    assert select_subset_greedy(c, g, 0.4).dropped.size == 0  # budget 2·0.4 = 0.8 < 1
    sel = select_subset_greedy(c, g, 0.4, n=5)  # five examples in the full set: budget 2
    assert sel.dropped.tolist() == [0, 1] and sel.bias_bound == pytest.approx(0.4) and sel.n == 5
    with pytest.raises(ValueError):
        select_subset_greedy(c, g, 0.1, n=1)
    with pytest.raises(ValueError):
        select_subset_greedy(np.array([1.0, 0.0]), g, 0.1)
    with pytest.raises(ValueError):
        select_subset_greedy(c, np.array([1.0, np.nan]), 0.1)
    with pytest.raises(ValueError):
        select_subset_greedy(c, g, -0.1)
    with pytest.raises(ValueError):
        select_subset_greedy(c, g[:1], 0.1)
    with pytest.raises(ValueError):
        select_subset_greedy(c, g, 0.1, order="ratio")
    with pytest.raises(ValueError):
        select_subset(c, g, 0.1, method="lp")
    with pytest.raises(ValueError):
        select_subset_exact(np.ones(30), np.ones(30), 0.1)
    empty = select_subset_greedy(np.zeros(0) + 1, np.zeros(0), 0.0)
    assert empty.kept.size == 0 and empty.cost_factor_ratio == 1.0


# --- per-prompt statistics and the dataset filter -------------------------------------------------------------------


def _records():
    """Rollouts of four prompts (two rollouts each, plus one prompt the dataset does not have)."""
    rows = []
    spec = {
        "short easy": (10, [5, 7], [1.0, 1.0]),  # zero reward variance: G = 0
        "long hard": (40, [300, 500], [1.0, 0.0]),
        "medium": (20, [100, 60], [1.0, 0.0]),
        "long mixed": (40, [400, 420], [0.0, 1.0]),
        "not in dataset": (5, [5, 5], [0.0, 1.0]),
    }
    for prompt, (p_tok, comps, rewards) in spec.items():
        mean_r = float(np.mean(rewards))
        for comp, r in zip(comps, rewards, strict=True):
            rows.append(
                {
                    "prompt": prompt,
                    "prompt_tokens": p_tok,
                    "completion_tokens": comp,
                    "reward": r,
                    "advantage": r - mean_r,
                }
            )
    return rows


def test_prompt_statistics_columns_and_inputs(tmp_path):
    pd = pytest.importorskip("pandas")
    records = _records()
    stats = prompt_statistics(records)
    assert stats.loc["long hard", "cost"] == pytest.approx(40 + 400)  # mean of 340 and 540
    assert stats.loc["long hard", "bound"] == pytest.approx(0.5)  # mean |A|
    assert stats.loc["short easy", "bound"] == 0.0
    assert stats.loc["medium", "n_rollouts"] == 2
    std = prompt_statistics(records, gradient="reward_std")
    assert std.loc["long hard", "bound"] == pytest.approx(0.5)  # population std of {1, 0}
    comp = prompt_statistics(records, cost="completion")
    assert comp.loc["medium", "cost"] == pytest.approx(80.0)
    # A `tokens` column (prompt + completion) takes precedence; the same records as a DataFrame, JSONL, parquet.
    df = pd.DataFrame(records)
    df["tokens"] = df["prompt_tokens"] + df["completion_tokens"]
    pd.testing.assert_frame_equal(prompt_statistics(df.drop(columns=["prompt_tokens"])), stats)
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    pd.testing.assert_frame_equal(prompt_statistics(path), stats)
    pq = tmp_path / "completions"
    pq.mkdir()
    df.iloc[:4].to_parquet(pq / "completions_00001.parquet")
    df.iloc[4:].to_parquet(pq / "completions_00002.parquet")
    assert len(load_records(pq)) == len(records)
    # Token counts from text when only the text is logged.
    text = [{"prompt": "a b c", "completion": "x y", "advantage": 1.0}, {"prompt": "a b c", "completion": "z"}]
    counted = prompt_statistics(text, token_counter=lambda s: len(s.split()))
    assert counted.loc["a b c", "cost"] == pytest.approx(3 + 1.5)
    assert counted.loc["a b c", "bound"] == pytest.approx(1.0)  # the missing advantage is ignored
    with pytest.raises(ValueError, match="prompt_tokens"):
        prompt_statistics([{"prompt": "p", "completion_tokens": 3, "advantage": 1.0}])
    with pytest.raises(ValueError, match="advantage"):
        prompt_statistics([{"prompt": "p", "tokens": 3, "reward": 1.0}])
    with pytest.raises(ValueError):
        prompt_statistics(records, gradient="grad_norm")


def test_canonical_keys_match_conversations():
    conv = [{"role": "user", "content": "hi"}]
    assert canonical_key(conv) == canonical_key([{"content": "hi", "role": "user"}])
    assert canonical_key(np.array(conv, dtype=object)) == canonical_key(conv)
    assert canonical_key(3) == canonical_key(np.int64(3)) == "3"


def test_filter_dataset_drops_expensive_prompts_and_reports_why():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "prompt": ["short easy", "long hard", "medium", "long mixed", "no records"],
            "answer": ["a", "b", "c", "d", "e"],
        }
    )
    # G: short easy 0, long hard 0.5, medium 0.5, long mixed 0.5; c: 16, 440, 100, 450. n = 5 rows.
    filtered, report = filter_dataset(ds, _records(), gamma=0.5 / 5)  # budget: one bound of 0.5
    assert filtered["prompt"] == ["long hard", "medium", "no records"]
    assert report.dropped["key"].tolist() == ["short easy", "long mixed"]
    assert report.dropped["reason"].tolist() == ["zero_bound", "budget"]
    assert report.dropped["index"].tolist() == [0, 3]
    assert report.dropped["cost"].tolist() == pytest.approx([16.0, 450.0])
    assert report.dropped["cumulative_bias"].tolist() == pytest.approx([0.0, 0.1])
    assert report.unmatched.tolist() == [4]
    assert report.unused_record_keys == ["not in dataset"]
    assert report.selection.n == 5 and report.selection.bias_bound <= 0.1 + 1e-12
    assert "no gradient signal" in report.dropped["why"].iloc[0]
    summary = report.summary()
    assert "long mixed" in summary and "1 without records" in summary
    # Γ = 0 only drops the zero-bound prompt; a bigger budget drops the next most expensive too.
    kept0, rep0 = filter_dataset(ds, _records(), gamma=0.0)
    assert kept0["prompt"] == ["long hard", "medium", "long mixed", "no records"]
    assert rep0.dropped["reason"].tolist() == ["zero_bound"]
    kept1, _ = filter_dataset(ds, _records(), gamma=1.0 / 5)
    assert kept1["prompt"] == ["medium", "no records"]
    # Exact agrees here, and results are deterministic.
    kept_exact, _ = filter_dataset(ds, _records(), gamma=0.5 / 5, method="exact")
    assert kept_exact["prompt"] == filtered["prompt"]
    again, report_again = filter_dataset(ds, _records(), gamma=0.5 / 5)
    assert again["prompt"] == filtered["prompt"] and report_again.dropped.equals(report.dropped)


def test_filter_dataset_by_id_and_conversations():
    datasets = pytest.importorskip("datasets")
    conv = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    ds = datasets.Dataset.from_dict({"prompt": conv, "id": [10, 11, 12]})
    records = [
        {"prompt": conv[i], "prompt_id": 10 + i, "tokens": tok, "advantage": adv}
        for i, tok, adv in [(0, 100, 1.0), (0, 120, -1.0), (1, 10, 0.5), (2, 1000, 2.0), (2, 1000, -2.0)]
    ]
    by_prompt, rep = filter_dataset(ds, records, gamma=2.0 / 3)  # matched on the conversation, not prompt_id
    by_id, rep_id = filter_dataset(ds, records, gamma=2.0 / 3, id_column="id", record_key="prompt_id")
    assert by_prompt["id"] == by_id["id"] == [10, 11]  # the 1000-token prompt (G = 2) fits the budget of 2
    assert rep.dropped["reason"].tolist() == ["budget"] and rep_id.unmatched.size == 0
