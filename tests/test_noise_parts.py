"""The between-prompt / within-group split of a batch's gradient noise (`kept_count.noise_parts`) against its closed
form on synthetic gradients with known covariances, and the steps it predicts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_costaware.kept_count.noise_parts import NoiseParts, mean_parts, noise_parts, predicted_steps_ratio

D, K, G = 6, 8, 4


def synthetic_batches(n, sigma_b, sigma_w, true, generator):
    """n batches of K prompts × G rollouts: μ_j = true + N(0, Σ_b), x_jr = μ_j + N(0, Σ_w) (diagonal covariances
    `sigma_b`, `sigma_w` given as per-coordinate standard deviations). Yields (prompt halves, rollout halves, g)."""
    for _ in range(n):
        mu = true + sigma_b * torch.randn(K, D, generator=generator, dtype=torch.float64)
        x = mu[:, None, :] + sigma_w * torch.randn(K, G, D, generator=generator, dtype=torch.float64)
        halves_p = (x[: K // 2].mean((0, 1)), x[K // 2 :].mean((0, 1)))
        halves_r = (x[:, : G // 2].mean((0, 1)), x[:, G // 2 :].mean((0, 1)))
        yield halves_p, halves_r, x.mean((0, 1))


def closed_form(sigma_b, sigma_w, true, weight=None):
    w = torch.ones(D, dtype=torch.float64) if weight is None else weight
    between = float((w * sigma_b).pow(2).sum()) / K
    within = float((w * sigma_w).pow(2).sum()) / (K * G)
    return between, within, float((w * true).pow(2).sum())


@pytest.mark.parametrize("preconditioned", [False, True])
def test_the_parts_match_their_closed_form(preconditioned):
    gen = torch.Generator().manual_seed(0)
    sigma_b = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 0.3], dtype=torch.float64)
    sigma_w = torch.tensor([2.0, 3.0, 0.5, 1.0, 0.0, 2.5], dtype=torch.float64)
    true = torch.tensor([0.5, -0.3, 0.2, 0.4, 0.0, -0.6], dtype=torch.float64)
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 0.25], dtype=torch.float64) if preconditioned else None
    batches = list(synthetic_batches(20000, sigma_b, sigma_w, true, gen))
    parts = mean_parts([noise_parts(p, r, weight) for p, r, _ in batches])
    between, within, signal = closed_form(sigma_b, sigma_w, true, weight)
    assert parts.within == pytest.approx(within, rel=0.03)
    assert parts.between == pytest.approx(between, rel=0.05)
    assert parts.signal == pytest.approx(signal, rel=0.05)
    # the total is the full batch's own variance (measured directly here from the batches' g)
    g = torch.stack([b[2] for b in batches])
    w = torch.ones(D, dtype=torch.float64) if weight is None else weight
    direct = float(((g - true) * w).pow(2).sum(1).mean())
    assert parts.total == pytest.approx(direct, rel=0.03)
    assert parts.rho == pytest.approx((between + within) / signal, rel=0.05)


def test_halving_by_rollouts_is_what_tells_the_parts_apart():
    """Control: an estimator that treats every row as independent (within = total, the I(m) model) is wrong by the
    between part, which this check detects; the rollout split is not."""
    gen = torch.Generator().manual_seed(1)
    sigma_b = torch.full((D,), 1.0, dtype=torch.float64)
    sigma_w = torch.full((D,), 1.0, dtype=torch.float64)
    true = torch.full((D,), 0.2, dtype=torch.float64)
    parts = mean_parts([noise_parts(p, r) for p, r, _ in synthetic_batches(5000, sigma_b, sigma_w, true, gen)])
    between, within, _ = closed_form(sigma_b, sigma_w, true)
    assert parts.within_share == pytest.approx(within / (between + within), rel=0.05)
    independent_rows = NoiseParts(total=parts.total, within=parts.total, signal=parts.signal)
    assert abs(independent_rows.within - within) > 0.5 * within  # 5x the truth here (between = 4 x within)


def test_predicted_steps_ratio_limits():
    parts = NoiseParts(total=2.0, within=0.5, signal=1.0)  # ρ = 2, between 1.5
    assert predicted_steps_ratio(parts) == pytest.approx(1.0)
    assert predicted_steps_ratio(parts, prompt_fraction=0.5) == pytest.approx((1 + 4) / 3)  # the large-batch model
    assert predicted_steps_ratio(parts, inflation=1.0) == pytest.approx((1 + 2.5) / 3)  # the within part only
    only_between = NoiseParts(total=2.0, within=0.0, signal=1.0)
    assert predicted_steps_ratio(only_between, inflation=10.0) == pytest.approx(1.0)  # a row sample costs nothing
    assert predicted_steps_ratio(NoiseParts(1.0, 0.5, 0.0)) == math.inf
    negative_between = NoiseParts(total=0.4, within=0.5, signal=1.0)  # an estimate's noise: between taken as 0
    assert predicted_steps_ratio(negative_between, inflation=1.0) == pytest.approx((1 + 1.0) / 1.5)
    with pytest.raises(ValueError, match="prompt_fraction"):
        predicted_steps_ratio(parts, prompt_fraction=0.0)
    with pytest.raises(ValueError, match="inflation"):
        predicted_steps_ratio(parts, inflation=-0.1)


@settings(max_examples=200, deadline=None)
@given(
    total=st.floats(0.0, 10.0),
    share=st.floats(0.0, 1.0),
    signal=st.floats(1e-3, 10.0),
    phi=st.floats(0.05, 1.0),
    inflation=st.floats(0.0, 10.0),
)
def test_fewer_prompts_or_rows_never_predict_fewer_steps(total, share, signal, phi, inflation):
    parts = NoiseParts(total=total, within=share * total, signal=signal)
    ratio = predicted_steps_ratio(parts, phi, inflation)
    assert ratio >= 1.0 - 1e-12
    assert predicted_steps_ratio(parts, phi / 2, inflation) >= ratio - 1e-12
    assert predicted_steps_ratio(parts, phi, inflation + 1.0) >= ratio - 1e-12
