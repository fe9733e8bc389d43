"""The "compute" rule's math (`trl_costaware/kept_count/compute_budget.py`): its limits, its search against an
exhaustive one, the expected kept tokens against real draws, and the gradient noise scale against a brute-force
computation from per-row gradients of a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_costaware.core.sampling import draw_rows, eligible_rows, sampling_distribution, sampling_scores
from trl_costaware.kept_count.budget import variance_inflation
from trl_costaware.kept_count.compute_budget import (
    ComputeSignal,
    Ema,
    NoiseScale,
    cheapest_kept_count,
    expected_kept_tokens,
    gradient_terms,
    noise_terms,
    predicted_cost,
    rows_per_optimizer_step,
)


def batch(n: int, seed: int, zero_share: float = 0.25):
    """Proxies, distribution and tokens of an n-row GRPO-like batch (a share of rows with A = 0)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen)
    a[torch.rand(n, generator=gen) < zero_share] = 0.0
    tokens = torch.randint(10, 200, (n,), generator=gen).double()
    eligible = eligible_rows(a, tokens, False)
    p = sampling_distribution(sampling_scores(a, tokens, "advantage"), 0.1, support=eligible)
    return a.abs() * eligible, p, tokens


def exhaustive(g, p, tokens, rho, fixed, per_token, multiple_of):
    costs = {}
    for m in range(multiple_of, p.numel() + 1, multiple_of):
        inflation = variance_inflation(g, p, m)
        kept = expected_kept_tokens(p, tokens, m)
        costs[m] = math.inf if math.isinf(inflation) else predicted_cost(rho, inflation, fixed, per_token, kept)
    return costs


# ---------------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("n,multiple", [(16, 1), (64, 2), (1024, 1), (96, 8)])
def test_no_noise_keeps_the_fewest_rows(n, multiple):
    g, p, tokens = batch(n, 0)
    choice = cheapest_kept_count(g, p, tokens, rho=0.0, fixed_cost=1000.0, token_cost=1.0, multiple_of=multiple)
    assert choice.m == multiple  # the update's noise costs no steps: only its price counts
    assert choice.cost_ratio < 1.0


@pytest.mark.parametrize("n,multiple", [(16, 1), (64, 2), (1024, 1), (96, 8)])
def test_dominant_noise_keeps_every_informative_row(n, multiple):
    """B_noise ≫ N: J → ρ (1 + I(m)) (C_fix + κ T(m)). With the fixed cost dominant, every row that can carry
    gradient is kept (I = 0; the plan's cap then drops the rows that cannot); ρ = ∞ keeps all N."""
    g, p, tokens = batch(n, 1)
    informative = int((g > 0).sum())
    choice = cheapest_kept_count(g, p, tokens, rho=1e6, fixed_cost=1e9, token_cost=1.0, multiple_of=multiple)
    assert choice.m >= informative and choice.inflation == 0.0
    choice = cheapest_kept_count(g, p, tokens, rho=math.inf, fixed_cost=1.0, token_cost=1.0, multiple_of=multiple)
    assert choice.m == n and choice.cost_ratio == 1.0


def test_dominant_noise_with_equal_rows_keeps_them_all_for_any_fixed_cost():
    """k equal rows: (1 + I(m)) T(m) = (k/m)(m/k) T(k) is flat, so any C_fix > 0 tips the choice to m = k."""
    n, k = 64, 40
    g = torch.zeros(n)
    g[:k] = 1.0
    p = torch.where(g > 0, 1.0 / k, 0.0).double()
    tokens = torch.full((n,), 50.0)
    for fixed in (1.0, 100.0, 1e5):
        assert cheapest_kept_count(g, p, tokens, rho=1e6, fixed_cost=fixed, token_cost=1.0).m == k


def test_dominant_noise_without_fixed_cost_is_the_papers_objective():
    """With C_fix = 0 and B_noise ≫ N the rule minimises (1 + I(m)) T(m), the variance-cost product of the paper's
    cost-aware SGD: rows that differ in G/√c can make a sample cheaper than every informative row."""
    g, p, tokens = batch(64, 4, zero_share=0.0)
    choice = cheapest_kept_count(g, p, tokens, rho=1e6, fixed_cost=0.0, token_cost=1.0)
    full = predicted_cost(1e6, 0.0, 0.0, 1.0, float(tokens.sum()))
    kept = predicted_cost(1e6, choice.inflation, 0.0, 1.0, expected_kept_tokens(p, tokens, choice.m))
    assert kept <= full


def test_kept_count_grows_with_the_noise_scale_and_the_fixed_cost():
    g, p, tokens = batch(256, 2)
    by_rho = [cheapest_kept_count(g, p, tokens, rho, 5000.0, 1.0).m for rho in (0.01, 0.1, 1.0, 10.0)]
    assert by_rho == sorted(by_rho) and by_rho[0] < by_rho[-1]
    by_fixed = [cheapest_kept_count(g, p, tokens, 0.5, fixed, 1.0).m for fixed in (100.0, 2000.0, 40000.0)]
    assert by_fixed == sorted(by_fixed) and by_fixed[0] < by_fixed[-1]


@settings(max_examples=40, deadline=None)
@given(
    n_units=st.integers(2, 60),
    multiple=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10_000),
    log_rho=st.floats(-4, 3),
    log_fixed=st.floats(0, 5),
    zero_share=st.floats(0, 0.8),
)
def test_search_finds_the_exhaustive_minimum(n_units, multiple, seed, log_rho, log_fixed, zero_share):
    n = n_units * multiple
    g, p, tokens = batch(n, seed, zero_share)
    rho, fixed = 10.0**log_rho, 10.0**log_fixed
    costs = exhaustive(g, p, tokens, rho, fixed, 1.0, multiple)
    choice = cheapest_kept_count(g, p, tokens, rho, fixed, 1.0, multiple)
    assert choice.m % multiple == 0 and multiple <= choice.m <= n
    best = min(costs.values())
    assert costs[choice.m] <= best * (1 + 1e-3) + 1e-12, (choice.m, min(costs, key=costs.get))
    assert choice.cost_ratio == pytest.approx(costs[choice.m] / costs[n], rel=1e-9)


# ------------------------------------------------------------------------------------------------ the re-derived rule
def test_predicted_cost_under_both_step_models_and_the_within_share():
    """J(m) = step_factor(ρ (1 + w I)) (C_fix + κ T): 1 + x under "sgd" (w = 1: the rule as first derived), √(1 + x)
    under "adam"; w scales only the sample's inflation, never the batch's own noise."""
    rho, inflation, fixed, kappa, kept = 0.8, 1.5, 10.0, 2.0, 30.0
    cost = fixed + kappa * kept
    assert predicted_cost(rho, inflation, fixed, kappa, kept) == pytest.approx((1 + rho * (1 + inflation)) * cost)
    assert predicted_cost(rho, inflation, fixed, kappa, kept, 0.2, "adam") == pytest.approx(
        math.sqrt(1 + rho * (1 + 0.2 * inflation)) * cost
    )
    assert predicted_cost(rho, inflation, fixed, kappa, kept, 0.0, "sgd") == pytest.approx((1 + rho) * cost)
    with pytest.raises(ValueError, match="within_share"):
        predicted_cost(rho, inflation, fixed, kappa, kept, 1.5)
    with pytest.raises(ValueError, match="model"):
        predicted_cost(rho, inflation, fixed, kappa, kept, 0.5, "momentum")


@pytest.mark.parametrize("model", ["sgd", "adam"])
def test_no_within_group_noise_keeps_the_fewest_rows(model):
    """w = 0: a row sample adds no noise that costs steps (all of it is which prompts were drawn), so the rule keeps
    the fewest rows whatever ρ; at w = 1 it keeps more."""
    g, p, tokens = batch(128, 5)
    choice = cheapest_kept_count(g, p, tokens, 5.0, 500.0, 1.0, within_share=0.0, step_model=model)
    assert choice.m == 1
    assert cheapest_kept_count(g, p, tokens, 5.0, 500.0, 1.0, within_share=1.0, step_model=model).m > 1


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), log_rho=st.floats(-2, 2), log_fixed=st.floats(1, 4))
def test_kept_count_grows_with_the_within_share_and_adam_keeps_no_more_than_sgd(seed, log_rho, log_fixed):
    """The more of the noise a sample multiplies, the more rows pay (monotone in w); and the square-root step model
    prices the sample's noise less than the linear one, so it never keeps more rows (the inflation's price
    ∂/∂I of log S is ρw / (2 (1 + ρ(1 + wI))) under "adam", twice that under "sgd")."""
    g, p, tokens = batch(96, seed)
    rho, fixed = 10.0**log_rho, 10.0**log_fixed
    by_w = [
        cheapest_kept_count(g, p, tokens, rho, fixed, 1.0, within_share=w, step_model="adam").m
        for w in (0.0, 0.3, 1.0)
    ]
    assert by_w == sorted(by_w)
    for w in (0.3, 1.0):
        adam = cheapest_kept_count(g, p, tokens, rho, fixed, 1.0, within_share=w, step_model="adam").m
        sgd = cheapest_kept_count(g, p, tokens, rho, fixed, 1.0, within_share=w, step_model="sgd").m
        assert adam <= sgd


def test_rule_refuses_bad_inputs():
    g, p, tokens = batch(16, 0)
    with pytest.raises(ValueError, match="rho"):
        cheapest_kept_count(g, p, tokens, -1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="multiple_of"):
        cheapest_kept_count(g, p, tokens, 1.0, 1.0, 1.0, multiple_of=3)
    with pytest.raises(ValueError, match="inflation"):
        noise_terms(1.0, 0.5, -0.1)


def test_expected_kept_tokens_matches_real_draws():
    g, p, tokens = batch(64, 3)
    gen = torch.Generator().manual_seed(0)
    for m in (5, 20, 40):
        kept = [float(tokens[draw_rows(p, m, "systematic", gen).indices].sum()) for _ in range(4000)]
        assert sum(kept) / len(kept) == pytest.approx(expected_kept_tokens(p, tokens, m), rel=0.01)
        kept = [float(tokens[draw_rows(p, m, "multinomial", gen).indices].sum()) for _ in range(4000)]
        assert sum(kept) / len(kept) == pytest.approx(expected_kept_tokens(p, tokens, m, "multinomial"), rel=0.02)


def test_signal_prices_the_token_model_from_generated_tokens():
    signal = ComputeSignal(rho=0.5, fixed_cost=None, token_cost=2.0, generation_token_cost=1.5)
    assert signal.costs(1000.0) == (1500.0, 2.0)
    assert ComputeSignal(rho=0.5, fixed_cost=3.0, token_cost=1e-4).costs(1000.0) == (3.0, 1e-4)


# ---------------------------------------------------------------------------------------------------- noise scale
def test_ema_removes_its_start_up_bias():
    ema = Ema(0.9)
    assert ema.value is None
    assert ema.update(2.0) == pytest.approx(2.0)
    assert ema.update(float("nan")) == pytest.approx(2.0)  # a non-finite value is skipped
    assert ema.update(4.0) == pytest.approx((0.9 * 0.1 * 2 + 0.1 * 4) / (0.9 * 0.1 + 0.1))


def test_noise_scale_ratio_states():
    ns = NoiseScale(0.9)
    assert ns.ratio is None  # no pair of steps yet
    ns.update(2.0, 1.0, 0.0)
    assert ns.ratio == pytest.approx(1.0)
    ns = NoiseScale(0.9)
    ns.update(2.0, -0.5, 0.0)
    assert ns.ratio == math.inf  # the dot product says noise dominates the signal
    state = NoiseScale(0.5)
    state.load_state_dict({"noise": 1.0, "signal": 4.0, "count": 3})
    assert state.ratio == 0.25 and state.state_dict() == {"noise": 1.0, "signal": 4.0, "count": 3}


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def _population(n=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen)
    y = torch.sin(x[:, 0]) + 0.5 * torch.randn(n, generator=gen)
    return x, y


def _flat_grad(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([q.grad.flatten() for q in model.parameters()]).clone()


def _brute_force(model, x, y):
    """Per-row gradients g_i of the squared error: (|mean g|², tr Cov(g)) over the population."""
    rows = torch.stack([_flat_grad(model, (model(x[i : i + 1]) - y[i : i + 1]).pow(2).mean()) for i in range(len(x))])
    mean = rows.mean(0)
    return float(mean.pow(2).sum()), float((rows - mean).pow(2).sum(1).mean()), rows


def _estimate(model, x, y, batch_size, steps, inflation, rows_told, seed):
    """Feeds the estimator the real gradients of `steps` batches of `batch_size` rows (with replacement) through a
    backward pass, each paired with the previous batch, the batch's claimed inflation over `rows_told` rows."""
    gen = torch.Generator().manual_seed(seed)
    ns = NoiseScale(decay=1 - 1 / steps)  # a long average: the test wants the expectation
    noise_sum = signal_sum = 0.0
    previous = None
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch_size,), generator=gen)
        grad = _flat_grad(model, (model(x[idx]) - y[idx]).pow(2).mean())
        if previous is not None:
            sq, dot = float(grad.pow(2).sum()), float(grad @ previous)
            ns.update(sq, dot, inflation)
            noise, signal = noise_terms(sq, dot, inflation)
            noise_sum, signal_sum = noise_sum + noise, signal_sum + signal
        previous = grad
    n = steps - 1
    return noise_sum / n * rows_told, signal_sum / n, ns


def test_noise_scale_matches_brute_force_on_a_tiny_model():
    """tr(Σ) and |G|² from every row's own gradient against the estimator fed with batch gradients: a full batch of
    B rows (I = 0), and a batch of B/2 rows presented as a B-row batch with inflation I = 1 (the kept sample's
    variance is (1 + I) times the full batch's) — both must recover tr(Σ) and |G|²."""
    torch.manual_seed(0)
    model = TinyModel()
    x, y = _population()
    signal_true, trace_true, _ = _brute_force(model, x, y)
    assert trace_true > 0 and signal_true > 0
    for batch_size, inflation in ((32, 0.0), (16, 1.0)):
        trace, signal, ns = _estimate(model, x, y, batch_size, 3000, inflation, rows_told=32, seed=1)
        assert trace == pytest.approx(trace_true, rel=0.08), (batch_size, inflation)
        assert signal == pytest.approx(signal_true, rel=0.15), (batch_size, inflation)
        assert ns.ratio == pytest.approx(trace_true / 32 / signal_true, rel=0.25)


def test_without_the_inflation_correction_the_estimate_is_biased():
    """The control: the B/2-row batch presented as B rows without its inflation (I = 0) doubles tr(Σ) — the check
    above detects a missing correction — and pairing a gradient with itself (two steps of one generation batch, which
    the trainer never pairs) reads no noise at all."""
    torch.manual_seed(0)
    model = TinyModel()
    x, y = _population()
    _, trace_true, _ = _brute_force(model, x, y)
    trace, _, _ = _estimate(model, x, y, 16, 3000, 0.0, rows_told=32, seed=1)
    assert trace != pytest.approx(trace_true, rel=0.08) and trace == pytest.approx(2 * trace_true, rel=0.1)
    grad = _flat_grad(model, (model(x[:32]) - y[:32]).pow(2).mean())
    assert noise_terms(float(grad @ grad), float(grad @ grad), 0.0)[0] == 0.0


def test_rows_per_optimizer_step():
    """N·G/S: a fraction of a generation batch per step when G < S, several batches when G > S, not rounded."""
    assert rows_per_optimizer_step(16, steps_per_generation=2, accumulation_steps=4) == 32
    assert rows_per_optimizer_step(24, steps_per_generation=3, accumulation_steps=2) == 16
    assert rows_per_optimizer_step(16, steps_per_generation=4, accumulation_steps=1) == 4
    with pytest.raises(ValueError):
        rows_per_optimizer_step(16, steps_per_generation=0, accumulation_steps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_terms_read_in_slices(dtype):
    """|G|² and G·H over tensors of any shape and dtype equal the float64 sums of their values, whatever the slice
    size (slices that split a tensor, one element, larger than every tensor)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2), (1,)]
    grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    previous = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    square = sum(float(g.double().pow(2).sum()) for g in grads)
    dot = sum(float((g.double() * h.double()).sum()) for g, h in zip(grads, previous, strict=True))
    for size in (1, 6, 35, 1 << 24):
        s, d = gradient_terms(grads, previous, slice_size=size)
        assert s.dtype == d.dtype == torch.float32 and s.dim() == d.dim() == 0
        assert float(s) == pytest.approx(square, rel=1e-6) and float(d) == pytest.approx(dot, rel=1e-5, abs=1e-6)
    alone, none = gradient_terms(grads, slice_size=6)
    assert none is None and float(alone) == pytest.approx(square, rel=1e-6)
    with pytest.raises(ValueError):
        gradient_terms(grads, previous[:-1])
    with pytest.raises(ValueError):
        gradient_terms(grads, [torch.zeros(2)] * len(grads))
