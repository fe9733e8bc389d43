"""Unit tests for the adaptive budget (`trl_costaware.kept_count.budget`, docs/budget_and_proxy.md §2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_costaware.core.sampling import draw_multinomial, draw_systematic, sampling_distribution
from trl_costaware.kept_count.budget import (
    AUTO,
    KeptFraction,
    inflation_terms,
    smallest_budget,
    variance_inflation,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw, min_n=2, max_n=40):
    """(G, c, p): proxies with some exact zeros, costs, and p ∝ G/√c smoothed with a random α."""
    n = draw(st.integers(min_n, max_n))
    g = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 10.0)), min_size=n, max_size=n))
    c = draw(st.lists(st.floats(1.0, 100.0), min_size=n, max_size=n))
    alpha = draw(st.sampled_from([0.0, 0.1, 0.5]))
    g, c = torch.tensor(g, dtype=torch.float64), torch.tensor(c, dtype=torch.float64)
    return g, c, sampling_distribution(g / c.sqrt(), alpha)


def informative_example(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k informative rows of equal G and cost among n; α = 0, so p is uniform on them."""
    g = torch.zeros(n, dtype=torch.float64)
    g[torch.randperm(n, generator=torch.Generator().manual_seed(n * 31 + k))[:k]] = 1.0
    return g, sampling_distribution(g, 0.0)


# ---------------------------------------------------------------- I(m)
@FAST
@given(st.integers(1, 64).flatmap(lambda k: st.tuples(st.just(k), st.integers(1, k), st.integers(0, 16))))
def test_k_informative_rows_give_k_over_m_minus_one(kmz):
    k, m, zeros = kmz
    g, p = informative_example(k + zeros, k)
    assert variance_inflation(g, p, m) == pytest.approx(k / m - 1, abs=1e-9)


@FAST
@given(batches(), st.sampled_from(["systematic", "multinomial"]))
def test_inflation_is_non_increasing_in_m(batch, scheme):
    g, _, p = batch
    values = [variance_inflation(g, p, m, scheme) for m in range(1, len(g) + 1)]
    assert all(v >= 0 for v in values)
    for a, b in zip(values, values[1:], strict=False):
        assert b <= a * (1 + 1e-9) + 1e-12


@FAST
@given(batches())
def test_keeping_every_row_adds_no_variance(batch):
    g, _, p = batch
    assert variance_inflation(g, p, len(g)) == pytest.approx(0.0, abs=1e-12)


def test_zero_signal_batch_needs_no_variance_budget():
    g = torch.zeros(16, dtype=torch.float64)
    p = sampling_distribution(g, 0.1)
    assert variance_inflation(g, p, 1) == 0.0
    assert smallest_budget(g, p, 0.0, multiple_of=4) == (4, 0.0)


def test_undrawable_informative_row_is_infinite_inflation():
    g = torch.tensor([1.0, 1.0, 0.0])
    p = torch.tensor([0.5, 0.0, 0.5])
    assert variance_inflation(g, p, 1, "multinomial") == math.inf
    assert variance_inflation(g, p, 1) == math.inf


@pytest.mark.parametrize("scheme", ["systematic", "multinomial"])
def test_predicted_inflation_matches_monte_carlo_with_orthogonal_rows(scheme):
    """Rows with orthogonal gradients g_i = G_i e_i: the importance-weighted mean's variance around the full batch's
    mean, over the full batch's own noise Σ G_i² / N², is I(m) (exact for multinomial; the Poisson approximation
    for the systematic draw, close when π is far from 1)."""
    gen = torch.Generator().manual_seed(0)
    n, m = 48, 12
    g = torch.rand(n, generator=gen, dtype=torch.float64) * 2.0
    g[:8] = 0.0
    c = 1.0 + 20.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    p = sampling_distribution(g / c.sqrt(), 0.1)
    draw = draw_systematic if scheme == "systematic" else draw_multinomial
    reps, sq = 6000, 0.0
    for _ in range(reps):
        d = draw(p, m, gen)
        est = torch.zeros(n, dtype=torch.float64)
        est.index_add_(0, d.indices, d.weights * g[d.indices] / m)  # (1/m) Σ_kept w_i g_i, in the e_i basis
        sq += float(((est - g / n) ** 2).sum())
    measured = sq / reps / float((g**2).sum() / n**2)
    predicted = variance_inflation(g, p, m, scheme)
    tol = 0.08 if scheme == "multinomial" else 0.15
    assert measured == pytest.approx(predicted, rel=tol)


# ---------------------------------------------------------------- the m rule
@FAST
@given(st.integers(1, 64).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, 16))), st.floats(0.0, 5.0))
def test_budget_on_k_informative_rows(kz, delta):
    """Smallest m with k/m − 1 ≤ δ is ⌈k/(1+δ)⌉ (up to float ties), and zero-signal rows are never needed."""
    k, zeros = kz
    g, p = informative_example(k + zeros, k)
    m, inflation = smallest_budget(g, p, delta)
    exact = k / (1 + delta)
    assert m <= k
    assert inflation <= delta
    assert math.ceil(exact - 1e-9) <= m <= math.ceil(exact + 1e-9)


@FAST
@given(batches(min_n=4), st.floats(0.0, 3.0), st.sampled_from([1, 2, 4]))
def test_budget_is_the_smallest_multiple_within_delta(batch, delta, multiple_of):
    g, _, p = batch
    n = len(g) - len(g) % multiple_of
    g, p = g[:n], p[:n] / p[:n].sum()
    m, inflation = smallest_budget(g, p, delta, multiple_of)
    assert m % multiple_of == 0 and multiple_of <= m <= n
    assert inflation == pytest.approx(variance_inflation(g, p, m))
    assert inflation <= delta
    if m > multiple_of:
        assert variance_inflation(g, p, m - multiple_of) > delta


@FAST
@given(batches(min_n=4), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_budget_grows_as_delta_shrinks(batch, d1, d2):
    g, _, p = batch
    lo, hi = sorted((d1, d2))
    assert smallest_budget(g, p, lo)[0] >= smallest_budget(g, p, hi)[0]


def test_multinomial_budget_may_not_reach_delta():
    g = torch.ones(8, dtype=torch.float64)
    p = sampling_distribution(g, 0.0)
    m, inflation = smallest_budget(g, p, 0.0, scheme="multinomial")  # I(m) = (N − 1)/m > 0 for every m
    assert m == 8 and inflation == pytest.approx(7 / 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"delta": -0.1}, "delta"),
        ({"delta": math.nan}, "delta"),
        ({"delta": 0.5, "multiple_of": 3}, "multiple_of"),
        ({"delta": 0.5, "scheme": "poisson"}, "draw scheme"),
    ],
)
def test_bad_budget_input_is_refused(kwargs, match):
    g = torch.ones(8)
    with pytest.raises(ValueError, match=match):
        smallest_budget(g, sampling_distribution(g), **kwargs)


@FAST
@given(st.lists(batches(min_n=8, max_n=8), min_size=2, max_size=4), st.floats(0.0, 2.0))
def test_largest_budget_over_ranks_keeps_the_step_within_delta(ranks, delta):
    """Every rank keeps max_r m_r rows: the step's inflation Σ_r num_r / Σ_r den_r (sums in G² units) is ≤ δ."""
    m = max(smallest_budget(g, p, delta)[0] for g, _, p in ranks)  # what plan.plan_batch keeps on every rank
    terms = [inflation_terms(g, p, m) for g, _, p in ranks]
    for (g, _, p), (num, den) in zip(ranks, terms, strict=True):
        assert (num / den if den > 0 else 0.0) == pytest.approx(variance_inflation(g, p, m), abs=1e-12)
    den = sum(d for _, d in terms)
    assert den == 0 or sum(n for n, _ in terms) / den <= delta + 1e-12


def test_inflation_terms_are_in_units_of_g_squared():
    g = torch.tensor([1.0, 2.0, 0.0, 3.0], dtype=torch.float64)
    p = sampling_distribution(g, 0.1)
    num, den = inflation_terms(1e3 * g, p, 2)
    assert den == pytest.approx(1e6 * 14.0)
    assert num / den == pytest.approx(variance_inflation(g, p, 2))


def test_a_row_that_cannot_carry_gradient_must_have_proxy_zero():
    """The budget's contract (item 1 of issue 20): a row never drawn (p = 0) with G > 0 makes I infinite at every
    m, so the caller (`plan.plan_batch`) passes G = 0 for rows outside the support."""
    g = torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=torch.float64)
    support = torch.tensor([True, False, True, True])
    p = sampling_distribution(g, 0.1, support=support)
    assert math.isinf(variance_inflation(g, p, 3))
    assert math.isfinite(variance_inflation(g * support, p, 2))
    assert smallest_budget(g * support, p, 1.0)[0] < 3


# ---------------------------------------------------------------- parsing "auto"
def test_kept_fraction_type_parses_numbers_and_auto():
    assert KeptFraction("0.25") == 0.25 and type(KeptFraction("0.25")) is float
    assert KeptFraction(0.5) == 0.5
    assert KeptFraction("auto") == AUTO and KeptFraction(" AUTO ") == AUTO
    with pytest.raises(ValueError, match="auto"):
        KeptFraction("half")


def test_kept_fraction_type_works_with_the_hf_argument_parser():
    """A dataclass field annotated `KeptFraction` takes "auto" or a number from the command line."""
    from dataclasses import dataclass, field

    from transformers import HfArgumentParser

    @dataclass
    class Args:
        kept: KeptFraction = field(default=0.5)

    parser = HfArgumentParser(Args)
    assert parser.parse_args_into_dataclasses(["--kept", "auto"])[0].kept == AUTO
    assert parser.parse_args_into_dataclasses(["--kept", "0.3"])[0].kept == 0.3
    assert parser.parse_args_into_dataclasses([])[0].kept == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--kept", "half"])
