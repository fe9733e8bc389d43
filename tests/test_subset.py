"""Static subset selection (`trl_costaware.subset`, docs/subset.md): the knapsack's greedy rule against the exact
optimum, the LP certificate, zero bounds, Γ = 0, the dataset front end and the docs' example."""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_costaware.subset import (
    SubsetReport,
    cost_factor,
    exact_subset,
    greedy_subset,
    pilot_statistics,
    select_subset,
)

FAST = settings(max_examples=80, deadline=None)
_ONE = Dataset.from_dict({"c": [1.0]})
DOC = Path(__file__).resolve().parents[1] / "docs" / "subset.md"


def _instance(rng: np.random.Generator, n: int, zero_frac: float = 0.1):
    c = rng.uniform(1.0, 10.0, n)
    g = rng.lognormal(0.0, 1.0, n) * (rng.random(n) >= zero_frac)
    return c, g, rng.uniform(0.0, 1.0) * g.sum() / n


def _break_value(c: np.ndarray, g: np.ndarray, budget: float) -> float:
    """v_k = G_k √c_k of the first example, in decreasing c, that does not fit the prefix rule's budget."""
    left = budget
    for i in np.argsort(-c, kind="stable"):
        if g[i] == 0:
            continue
        if g[i] <= left * (1 + 1e-12):
            left -= g[i]
        else:
            return float(g[i] * math.sqrt(c[i]))
    return 0.0


def _check_valid(rep: SubsetReport, c: np.ndarray, g: np.ndarray, gamma: float, n: int | None = None):
    n = max(len(c), 1) if n is None else n
    assert sorted(rep.kept.tolist() + rep.dropped.tolist()) == list(range(len(c)))
    assert len(set(rep.dropped.tolist())) == rep.dropped.size
    assert np.all(np.diff(rep.kept) > 0)
    bias = math.fsum(g[rep.dropped].tolist()) / n
    assert bias == pytest.approx(rep.bias_bound, rel=1e-12, abs=1e-15)
    assert bias <= gamma * (1 + 1e-9) + 1e-15, "bias budget exceeded"
    assert rep.cost_factor_after == pytest.approx(cost_factor(c, g, rep.kept), rel=1e-12, abs=1e-300)
    assert rep.cost_factor_before == pytest.approx(cost_factor(c, g), rel=1e-12)
    assert rep.cost_factor_after <= rep.cost_factor_before * (1 + 1e-12)
    assert rep.cost_factor_lower_bound <= rep.cost_factor_after * (1 + 1e-12)
    assert rep.total_cost_after == pytest.approx(c[rep.kept].sum(), rel=1e-12, abs=0)
    assert len(rep.reasons) == rep.dropped.size
    for i, reason in zip(rep.dropped.tolist(), rep.reasons, strict=True):
        assert reason == ("zero_bound" if g[i] == 0 else "budget")


def test_greedy_against_exact_on_random_small_instances(capsys):
    """Greedy vs the exact optimum on 600 random instances with n ≤ 12.

    Guaranteed (Dantzig's LP bound): √J(greedy) ≤ √J(exact) + v_k, v_k the value of the first example that does not
    fit, and the LP certificate (V − D_LP)² ≤ J(exact). Ratios J(greedy)/J(exact) can be large when the optimum drops
    almost everything, so the additive bound is asserted and the ratios are reported.
    """
    rng = np.random.default_rng(0)
    ratios, trials = [], 600
    for _ in range(trials):
        n = int(rng.integers(1, 13))
        c, g, gamma = _instance(rng, n)
        exact = exact_subset(c, g, gamma)
        greedy = greedy_subset(c, g, gamma)
        _check_valid(exact, c, g, gamma)
        _check_valid(greedy, c, g, gamma)
        assert exact.cost_factor_after <= greedy.cost_factor_after * (1 + 1e-9)  # exact is optimal
        assert greedy.cost_factor_lower_bound <= exact.cost_factor_after * (1 + 1e-9) + 1e-12  # the certificate
        v_k = _break_value(c, g, n * gamma)
        assert math.sqrt(greedy.cost_factor_after) <= math.sqrt(exact.cost_factor_after) + v_k + 1e-9
        ratios.append(greedy.cost_factor_after / exact.cost_factor_after if exact.cost_factor_after > 0 else 1.0)
    r = np.asarray(ratios)
    hits = int((r <= 1 + 1e-9).sum())
    with capsys.disabled():
        print(
            f"\ngreedy vs exact over {trials} instances: exact in {hits}, median ratio {np.median(r):.4f}, "
            f"95th pct {np.quantile(r, 0.95):.3f}, worst {r.max():.3f}"
        )
    assert hits >= trials // 2  # typical behaviour, not a theorem: greedy is exact on most small instances


def test_greedy_is_exact_with_equal_bounds():
    """With equal G_i the weights are equal, so dropping the k most expensive examples is optimal."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 13))
        c = rng.uniform(1.0, 10.0, n)
        g = np.full(n, rng.uniform(0.1, 3.0))
        gamma = rng.uniform(0.0, 1.0) * g.sum() / n
        greedy = greedy_subset(c, g, gamma)
        assert greedy.cost_factor_after == pytest.approx(exact_subset(c, g, gamma).cost_factor_after, rel=1e-12)
        assert sorted(greedy.dropped.tolist()) == sorted(np.argsort(-c, kind="stable")[: greedy.dropped.size].tolist())


def test_greedy_is_exact_when_the_certificate_is_met():
    c = np.array([10.0, 8.0, 6.0, 4.0, 2.0])
    g = np.array([1.0, 2.0, 1.0, 1.0, 1.0])
    rep = greedy_subset(c, g, bias_budget=3.0 / 5)  # drops rows 0 and 1: Σ G = 3 = nΓ exactly
    assert rep.dropped.tolist() == [0, 1] and rep.bias_bound == pytest.approx(0.6)
    assert rep.cost_factor_after == pytest.approx(exact_subset(c, g, 3.0 / 5).cost_factor_after)
    assert rep.cost_factor_lower_bound == pytest.approx(rep.cost_factor_after)


def test_a_budget_used_up_exactly_does_not_make_greedy_exact():
    """Issue 54's counterexample to the old docstring: greedy uses the budget up (0.5 + 0.5 = nΓ = 1) and is not
    optimal; the LP certificate still bounds the optimum from below."""
    c, g = np.array([100.0, 99.0, 1.0]), np.array([0.5, 0.6, 0.5])
    greedy, exact = greedy_subset(c, g, 1 / 3), exact_subset(c, g, 1 / 3)
    assert greedy.bias_bound == pytest.approx(1 / 3) and greedy.dropped.tolist() == [0, 2]
    assert greedy.cost_factor_after == pytest.approx(0.6**2 * 99) and exact.cost_factor_after == pytest.approx(30.25)
    assert greedy.cost_factor_lower_bound <= exact.cost_factor_after < greedy.cost_factor_after


def test_select_subset_refuses_a_bool_budget_and_an_empty_result():
    ds = Dataset.from_dict({"c": [10.0, 20.0, 30.0], "g": [1.0, 1.0, 1.0]})
    with pytest.raises(TypeError, match="bias_budget"):
        select_subset(ds, costs="c", bounds="g", bias_budget=True)
    with pytest.raises(TypeError, match="bias_budget"):
        greedy_subset([1.0], [1.0], np.bool_(False))
    with pytest.raises(ValueError, match="drops every row"):
        select_subset(ds, costs="c", bounds="g", bias_budget=1.0)  # Γ = mean G: every row fits the budget
    kept, _ = select_subset(ds, costs="c", bounds="g", bias_budget=0.99)
    assert len(kept) == 1


def test_the_greedy_rule_worked_example():
    # Knapsack density v/w = √c: the greedy order is by cost. A cheaper example that still fits is dropped after a
    # more expensive one that does not.
    c = np.array([9.0, 4.0, 1.0, 16.0])
    g = np.array([1.0, 1.0, 1.0, 3.0])
    rep = greedy_subset(c, g, bias_budget=2.0 / 4)  # budget nΓ = 2
    assert rep.dropped.tolist() == [0, 1]  # row 3 (c=16) needs 3 > 2; then rows 0 and 1
    assert rep.kept.tolist() == [2, 3]
    assert rep.cost_factor_before == pytest.approx((3 + 2 + 1 + 12) ** 2)
    assert rep.cost_factor_after == pytest.approx((1 + 12) ** 2)
    assert exact_subset(c, g, bias_budget=2.0 / 4).cost_factor_after == pytest.approx(rep.cost_factor_after)
    assert rep.method == "greedy" and "greedy" in rep.summary()
    assert rep.cost_factor_ratio == pytest.approx(169 / 324)
    assert "expensive" in rep.why(0)
    with pytest.raises(ValueError, match="not dropped"):
        rep.why(2)


@FAST
@given(
    data=st.lists(
        st.tuples(st.floats(0.5, 100.0), st.one_of(st.just(0.0), st.floats(1e-3, 1e3))), min_size=1, max_size=40
    ),
    frac=st.floats(0.0, 1.5),
)
def test_budget_is_never_exceeded_and_the_selection_is_maximal(data, frac):
    c = np.array([x for x, _ in data])
    g = np.array([y for _, y in data])
    gamma = frac * g.sum() / len(c)
    rep = greedy_subset(c, g, gamma)
    _check_valid(rep, c, g, gamma)
    # No kept example with a positive bound would still fit.
    slack = len(c) * gamma - g[rep.dropped].sum()
    kept_pos = rep.kept[g[rep.kept] > 0]
    assert np.all(g[kept_pos] > slack * (1 + 1e-12) - 1e-12)
    # The selection is a pure function of its inputs.
    again = greedy_subset(c.copy(), g.copy(), gamma)
    assert np.array_equal(rep.kept, again.kept) and np.array_equal(rep.dropped, again.dropped)
    assert rep.reasons == again.reasons and rep.cost_factor_after == again.cost_factor_after


@FAST
@given(
    data=st.lists(st.tuples(st.floats(0.5, 100.0), st.one_of(st.just(0.0), st.floats(1e-2, 10.0))), max_size=10),
    frac=st.floats(0.0, 1.0),
)
def test_exact_is_optimal_and_certified(data, frac):
    c = np.array([x for x, _ in data], dtype=float)
    g = np.array([y for _, y in data], dtype=float)
    gamma = frac * g.sum() / max(len(c), 1)
    exact, greedy = exact_subset(c, g, gamma), greedy_subset(c, g, gamma)
    _check_valid(exact, c, g, gamma)
    assert exact.cost_factor_lower_bound <= exact.cost_factor_after * (1 + 1e-9) + 1e-12
    assert exact.cost_factor_after <= greedy.cost_factor_after * (1 + 1e-9) + 1e-12


def test_zero_budget_keeps_every_example_with_a_nonzero_bound():
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        c, g, _ = _instance(rng, n, zero_frac=0.3)
        for solve in (greedy_subset, exact_subset) if (g > 0).sum() <= 12 else (greedy_subset,):
            rep = solve(c, g, 0.0)
            assert set(rep.kept.tolist()) == set(np.flatnonzero(g > 0).tolist())
            assert set(rep.dropped.tolist()) == set(np.flatnonzero(g == 0).tolist())
            assert all(r == "zero_bound" for r in rep.reasons)
            assert rep.bias_bound == 0.0
            assert rep.cost_factor_after == pytest.approx(rep.cost_factor_before)
            kept_all = solve(c, g, 0.0, drop_zero_bound=False)
            assert kept_all.kept.size == n and kept_all.dropped.size == 0


def test_deterministic_tie_breaking():
    c = np.array([5.0, 5.0, 5.0, 1.0])
    g = np.array([1.0, 1.0, 1.0, 1.0])
    for _ in range(3):
        assert greedy_subset(c, g, 2 / 4).dropped.tolist() == [0, 1]  # equal costs: lower index first
        assert exact_subset(c, g, 2 / 4).dropped.tolist() == [0, 1]


def test_normaliser_n():
    c = np.array([10.0, 1.0])
    g = np.array([1.0, 1.0])
    assert greedy_subset(c, g, 0.4).dropped.size == 0  # budget 2·0.4 = 0.8 < 1
    rep = greedy_subset(c, g, 0.4, n=5)  # five examples in the full set: budget 2
    assert rep.dropped.tolist() == [0, 1] and rep.bias_bound == pytest.approx(0.4) and rep.n == 5
    empty = greedy_subset(np.zeros(0), np.zeros(0), 0.0)
    assert empty.kept.size == 0 and empty.cost_factor_ratio == 1.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: greedy_subset([1.0, 0.0], [1.0, 1.0], 0.1), "costs"),
        (lambda: greedy_subset([1.0, np.inf], [1.0, 1.0], 0.1), "costs"),
        (lambda: greedy_subset([1.0, 1.0], [1.0, np.nan], 0.1), "bounds"),
        (lambda: greedy_subset([1.0, 1.0], [1.0, -1.0], 0.1), "bounds"),
        (lambda: greedy_subset([1.0, 1.0], [1.0], 0.1), "same length"),
        (lambda: greedy_subset([1.0], [1.0], -0.1), "bias_budget"),
        (lambda: greedy_subset([1.0], [1.0], float("nan")), "bias_budget"),
        (lambda: greedy_subset([1.0, 1.0], [1.0, 1.0], 0.1, n=1), "n=1"),
        (lambda: exact_subset(np.ones(30), np.ones(30), 0.1), "method='greedy'"),
        (lambda: select_subset(_ONE, costs="c", bounds="g", bias_budget=0), "bounds"),
        (lambda: select_subset(_ONE, costs=[1, 2], bounds=[1], bias_budget=0), "costs"),
        (lambda: select_subset(Dataset.from_dict({"c": ["a"]}), costs="c", bounds=[1], bias_budget=0), "costs"),
        (lambda: select_subset(_ONE, costs="c", bounds=[1], bias_budget=0, method="lp"), "method"),
        (lambda: select_subset(_ONE, costs="c", bounds=[1], bias_budget=-1), "bias_budget"),
    ],
)
def test_bad_inputs_name_the_argument(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


# ---------------------------------------------------------------------------------------------------- datasets
def test_select_subset_on_a_dataset_with_columns_or_arrays():
    ds = Dataset.from_dict(
        {"prompt": ["a", "b", "c", "d", "e"], "cost": [16.0, 440.0, 100.0, 450.0, 50.0], "g": [0, 0.5, 0.5, 0.5, 1]}
    )
    kept, rep = select_subset(ds, costs="cost", bounds="g", bias_budget=0.5 / 5)  # room for one bound of 0.5
    assert list(kept["prompt"]) == ["b", "c", "e"]
    assert rep.dropped.tolist() == [0, 3] and rep.reasons == ("zero_bound", "budget")
    same = greedy_subset(ds["cost"], ds["g"], 0.1)
    assert rep.kept.tolist() == same.kept.tolist() and rep.cost_factor_after == same.cost_factor_after
    by_array, rep_array = select_subset(ds, costs=np.asarray(ds["cost"]), bounds=list(ds["g"]), bias_budget=0.1)
    assert list(by_array["prompt"]) == list(kept["prompt"]) and rep_array.dropped.tolist() == [0, 3]
    exact, rep_exact = select_subset(ds, costs="cost", bounds="g", bias_budget=0.1, method="exact")
    assert list(exact["prompt"]) == list(kept["prompt"]) and rep_exact.method == "exact"
    zero, rep0 = select_subset(ds, costs="cost", bounds="g", bias_budget=0.0)
    assert list(zero["prompt"]) == ["b", "c", "d", "e"] and rep0.reasons == ("zero_bound",)


def test_rows_without_estimates_are_kept_and_count_in_n():
    ds = Dataset.from_dict({"prompt": list("abcd")})
    costs = [100.0, float("nan"), 10.0, 50.0]
    bounds = [1.0, 1.0, 1.0, float("nan")]
    kept, rep = select_subset(ds, costs=costs, bounds=bounds, bias_budget=1.0 / 4)  # n = 4: room for one bound 1
    assert list(kept["prompt"]) == ["b", "c", "d"]
    assert rep.dropped.tolist() == [0] and rep.unestimated.tolist() == [1, 3] and rep.n == 4
    assert rep.bias_bound == pytest.approx(0.25)
    assert rep.total_cost_before == pytest.approx(110.0) and rep.total_cost_after == pytest.approx(10.0)
    assert "2 kept without an estimate" in rep.summary()


def test_pilot_statistics_from_rollouts():
    conv = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    ds = Dataset.from_dict({"prompt": conv})
    records = [
        {"prompt": conv[0], "tokens": 100, "advantage": 1.0, "reward": 1.0},
        {"prompt": [{"content": "q0", "role": "user"}], "tokens": 120, "advantage": -1.0, "reward": 0.0},
        {"prompt": conv[2], "tokens": 1000, "advantage": float("nan"), "reward": 1.0},
        {"prompt": conv[2], "tokens": 1000, "advantage": 0.0, "reward": 1.0},
        {"prompt": [{"role": "user", "content": "q9"}], "tokens": 5, "advantage": 0.5, "reward": 0.0},
    ]
    c, g = pilot_statistics(ds, records)
    assert c[0] == pytest.approx(110.0) and g[0] == pytest.approx(1.0)  # conversations match by content
    assert np.isnan(c[1]) and np.isnan(g[1])  # no rollouts: no estimate
    assert c[2] == pytest.approx(1000.0) and g[2] == 0.0  # the NaN advantage is ignored
    _, std = pilot_statistics(ds, Dataset.from_list(records), bound="reward_std")
    assert std[0] == pytest.approx(0.5) and std[2] == 0.0  # population std of {1, 0}; {1, 1}
    counted, _ = pilot_statistics(ds, records, tokens=lambda r: r["tokens"] / 10)
    assert counted[0] == pytest.approx(11.0)
    kept, rep = select_subset(ds, costs=c, bounds=g, bias_budget=0.0)
    assert kept.num_rows == 2 and rep.dropped.tolist() == [2] and rep.unestimated.tolist() == [1]
    with pytest.raises(ValueError, match="advantage"):
        pilot_statistics(ds, [{"prompt": "p", "tokens": 3, "reward": 1.0}])
    with pytest.raises(ValueError, match="tokens"):
        pilot_statistics(ds, [{"prompt": "p", "advantage": 1.0}])
    with pytest.raises(ValueError, match="key"):
        pilot_statistics(ds, records, key="question")
    with pytest.raises(ValueError, match="bound"):
        pilot_statistics(ds, records, bound="grad_norm")


def _doc_blocks() -> tuple[str, str]:
    text = DOC.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    printed = re.search(r"prints\n\n```text\n(.*?)```", text, re.S).group(1)
    return code, printed


def test_the_docs_example_runs_and_prints_what_the_docs_show():
    code, printed = _doc_blocks()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_subset_example"})
    assert out.getvalue() == printed
