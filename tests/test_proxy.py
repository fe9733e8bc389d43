"""Unit tests for the loss-aware gradient proxy (`trl_costaware.rows.proxy`, docs/budget_and_proxy.md §1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_costaware.rows.proxy import (
    LOSS_TYPES,
    ROW_MEAN_LOSSES,
    length_exponent,
    loss_aware_proxy,
    row_factor,
    token_weights,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def rows(draw, max_n=12, max_t=10):
    """(advantages, right-padded loss mask, log-probabilities): some empty rows, some zero or NaN advantages."""
    n = draw(st.integers(1, max_n))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(0, t), min_size=n, max_size=n))
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).double()
    adv = draw(
        st.lists(
            st.one_of(st.just(0.0), st.just(math.nan), st.floats(-5.0, 5.0, allow_nan=False)),
            min_size=n,
            max_size=n,
        )
    )
    logps = draw(st.lists(st.floats(-30.0, 0.0), min_size=n * t, max_size=n * t))
    return torch.tensor(adv), mask, torch.tensor(logps, dtype=torch.float64).view(n, t)


@FAST
@given(rows(), st.sampled_from(LOSS_TYPES), st.floats(0.05, 1.0))
def test_length_only_formula_per_loss_type(batch, loss_type, gamma):
    """Without log-probabilities G_i = |A_i| · L_i^γ (token-sum types) or |A_i| · L_i^(γ−1) (row-mean types)."""
    adv, mask, _ = batch
    g = loss_aware_proxy(adv, mask, loss_type, gamma)
    length = mask.sum(-1).double()
    a = torch.nan_to_num(adv.double()).abs()
    exponent = gamma - 1 if loss_type in ROW_MEAN_LOSSES else gamma
    assert length_exponent(loss_type, gamma) == pytest.approx(exponent)
    expected = torch.where(length > 0, a * length.clamp(min=1).pow(exponent), torch.zeros_like(a))
    torch.testing.assert_close(g, expected, rtol=1e-9, atol=1e-12)
    assert torch.isfinite(g).all() and (g >= 0).all()


@FAST
@given(rows(), st.sampled_from(LOSS_TYPES), st.floats(0.05, 1.0))
def test_zero_signal_rows_get_zero_proxy(batch, loss_type, gamma):
    adv, mask, logps = batch
    g = loss_aware_proxy(adv, mask, loss_type, gamma, logps)
    no_signal = (torch.nan_to_num(adv) == 0) | (mask.sum(-1) == 0)
    assert (g[no_signal] == 0).all()
    assert torch.isfinite(g).all()


@FAST
@given(rows(), st.floats(0.05, 1.0))
def test_row_mean_and_token_sum_differ_by_the_row_length(batch, gamma):
    """Same rows under dapo and grpo: h_dapo / h_grpo = L_i (the row-mean normaliser), with or without log-probs."""
    _, mask, logps = batch
    length = mask.sum(-1).double()
    for lp in (None, logps):
        h_sum, h_mean = row_factor(mask, "dapo", gamma, lp), row_factor(mask, "grpo", gamma, lp)
        torch.testing.assert_close(h_sum, h_mean * length, rtol=1e-9, atol=1e-12)


@FAST
@given(rows(), st.sampled_from(LOSS_TYPES), st.floats(0.05, 1.0))
def test_log_probabilities_weight_tokens_by_one_minus_probability(batch, loss_type, gamma):
    """h_i = (Σ_t u_t^(1/γ))^γ / Z_i with u_t = 1 − π(y_t): never above the length-only factor, equal to it when
    every sampled token had probability 0, and 0 when every sampled token was certain (no gradient at all)."""
    adv, mask, logps = batch
    h = row_factor(mask, loss_type, gamma, logps)
    h_len = row_factor(mask, loss_type, gamma)
    assert (h <= h_len * (1 + 1e-9)).all()
    torch.testing.assert_close(row_factor(mask, loss_type, gamma, torch.full_like(logps, -math.inf)), h_len)
    assert (row_factor(mask, loss_type, gamma, torch.zeros_like(logps)) == 0).all()
    u = token_weights(logps) * mask
    expected = u.pow(1 / gamma).sum(-1).pow(gamma)
    if loss_type in ROW_MEAN_LOSSES:
        length = mask.sum(-1).double()
        expected = torch.where(length > 0, expected / length.clamp(min=1), torch.zeros_like(expected))
    torch.testing.assert_close(h, expected, rtol=1e-9, atol=1e-12)


def test_gamma_one_and_one_half_are_the_aligned_and_orthogonal_norms():
    mask = torch.ones(1, 4)
    logps = torch.log(torch.tensor([[0.5, 0.75, 0.0 + 1e-12, 0.9]]))
    u = 1 - logps.exp()
    assert float(row_factor(mask, "dapo", 1.0, logps)) == pytest.approx(float(u.sum()))
    assert float(row_factor(mask, "dapo", 0.5, logps)) == pytest.approx(float(u.pow(2).sum().sqrt()))


def test_proxy_scales_with_the_advantage():
    mask = torch.ones(3, 5)
    adv = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(loss_aware_proxy(adv, mask, "dapo", 0.5), adv.abs().double() * 5**0.5)


def test_row_factor_follows_the_mask_dtype_and_device():
    """float32 for an integer or float32 mask (float64 is not available on every device), float64 for float64."""
    mask = torch.ones(2, 3, dtype=torch.long)
    assert row_factor(mask, "dapo").dtype == torch.float32
    assert row_factor(mask, "grpo", token_logps=torch.zeros(2, 3)).dtype == torch.float32
    assert row_factor(mask.double(), "dapo").dtype == torch.float64


def test_nan_log_probabilities_count_as_unknown():
    assert float(token_weights(torch.tensor(math.nan))) == 1.0
    assert float(token_weights(torch.tensor(0.5))) == 0.0  # log-prob > 0 is clamped to 0 (probability 1)


def test_every_trl_loss_type_is_classified():
    from trl import GRPOConfig

    choices = set(GRPOConfig.__dataclass_fields__["loss_type"].metadata.get("choices", []) or [])
    assert set(ROW_MEAN_LOSSES) < set(LOSS_TYPES)
    if choices:  # TRL lists its loss types: a new one must be classified before the proxy can be used with it
        assert choices <= set(LOSS_TYPES)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "dapo", "gamma": 0.0}, "gamma"),
        ({"loss_type": "dapo", "gamma": 2.5}, "gamma"),
        ({"loss_type": "dapo", "token_logps": torch.zeros(2, 3)}, "shape"),
    ],
)
def test_bad_input_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        loss_aware_proxy(torch.ones(2), torch.ones(2, 4), **kwargs)


def test_advantages_must_match_rows():
    with pytest.raises(ValueError, match="advantages"):
        loss_aware_proxy(torch.ones(3), torch.ones(2, 4), "dapo")
