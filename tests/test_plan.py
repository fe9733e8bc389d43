"""The sampler's decision for one generation batch (`trl_costaware.rows.plan.plan_batch`), tested alone: no trainer."""

from __future__ import annotations

import inspect
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testing_utils import recorded_draws
from trl import GRPOTrainer

from trl_costaware.rows.batching import KNOWN_KEYS, check_keys, select_rows, trim_to_longest
from trl_costaware.rows.plan import LOSS_NORMALISERS, PlanSettings, RowStats, check_loss_type, plan_batch
from trl_costaware.rows.sampling import stream_seed


def ht_settings(**kwargs) -> PlanSettings:
    """PlanSettings with the Horvitz–Thompson weights ("none", the default) whose exact math these tests check."""
    return PlanSettings(**{"weight_normalization": "none", **kwargs})


def make_rows(advantages, loss_tokens=None, costs=None, prompt=4.0) -> RowStats:
    a = torch.as_tensor(advantages, dtype=torch.float32)
    n = len(a)
    t = torch.full((n,), 8.0) if loss_tokens is None else torch.as_tensor(loss_tokens, dtype=torch.float32)
    c = t + prompt if costs is None else torch.as_tensor(costs, dtype=torch.float32)
    completion = t.clamp(min=1.0)
    return RowStats(
        advantages=a,
        costs=c,
        loss_tokens=t,
        proxy_factors=torch.ones(n),
        rollout_lengths=completion + prompt,
        generated_tokens=completion,
        prompt_tokens=torch.full((n,), prompt),
        completion_tokens=t,
    )


def _full_support_rank(m: int) -> torch.Tensor:
    return torch.stack([torch.ones(m), torch.zeros(m), torch.ones(m), torch.ones(m)], 1)


class OtherRank:
    """A two-rank collective seen from rank 0: the other rank's contributions are given."""

    rank, size = 0, 2

    def __init__(self, ints, weights=None, sums=None):
        self.ints, self.weights, self.sums = ints, weights, sums or {}

    def max_ints(self, values):
        return [max(a, b) for a, b in zip(values, self.ints, strict=True)]

    def cat(self, x):
        """Each slot: weight, filler flag and 1/m of the rank's two design sums (`design_weight_terms`). Default: the
        other rank can draw all its rows, m weights of 1 (π = m/N everywhere), E[Σ w] = m, K = m."""
        other = self.weights if self.weights is not None else _full_support_rank(len(x))
        return torch.cat([x, other.to(x.dtype)])

    def sum(self, values):
        return {k: float(v) + float(self.sums.get(k, v)) for k, v in values.items()}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- item 2: one table of loss types
def test_the_table_covers_exactly_trls_loss_types():
    """Every loss type TRL's `_compute_loss` branches on has a normaliser here, and nothing else: a loss type TRL
    adds shows up as a failure, not as a silently wrong factor."""
    source = inspect.getsource(GRPOTrainer._compute_loss)
    trl_types = set()
    for match in re.finditer(r"self\.loss_type (?:==|in) (\[[^\]]*\]|\"[a-z_]+\")", source):
        trl_types |= set(re.findall(r"\"([a-z_]+)\"", match.group(1)))
    assert trl_types == set(LOSS_NORMALISERS)


@pytest.mark.parametrize("name", ["dapo2", "token_sum", ""])
def test_unknown_loss_type_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match="loss_type") as err:
        check_loss_type(name)
    assert "grpo" in str(err.value) and "bnpo" in str(err.value)
    with pytest.raises(ValueError, match="loss_type"):
        ht_settings(loss_type=name)


def test_proxy_and_plan_read_the_same_table():
    from trl_costaware.rows import proxy

    assert set(proxy.LOSS_TYPES) == set(LOSS_NORMALISERS)
    assert set(proxy.ROW_MEAN_LOSSES) == {k for k, z in LOSS_NORMALISERS.items() if z.row_length}


@pytest.mark.parametrize("loss_type", list(LOSS_NORMALISERS))
def test_factor_follows_the_normaliser(loss_type):
    rows = make_rows([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5])
    plan = plan_batch(rows, ht_settings(loss_type=loss_type, kept_fraction=0.5), gen())
    weights = plan.draw.weights
    scale = 1.0 if LOSS_NORMALISERS[loss_type].rows else 8 / 4
    torch.testing.assert_close(plan.factors, weights * scale)
    assert (plan.kl_scale is not None) == (loss_type in ("dapo", "cispo", "vespo"))
    assert (plan.micro_tokens_full is not None) == (loss_type == "bnpo")


def test_token_budget_keeps_the_smallest_count_over_ranks():
    rows = make_rows([1.0, -1.0] * 8)
    s = ht_settings(token_budget=60.0, zero_advantage_carries_gradient=True)
    alone = plan_batch(rows, s, gen())
    assert plan_batch(rows, s, gen(), OtherRank([-(alone.m - 1), 16])).m == alone.m - 1


# ---------------------------------------------------------------- item 5: filler rows
def _filler_case(method="none"):
    """This rank: 3 eligible rows of 8; the other rank: 8 eligible, so m = 0.75·8 = 6 here too (3 fillers)."""
    rows = make_rows([1.0, -2.0, 0.5, 0, 0, 0, 0, 0])
    s = ht_settings(kept_fraction=0.75, smoothing=0.1, weight_normalization=method)
    other = _full_support_rank(6)  # the other rank's 6 weights of 1, no fillers
    return plan_batch(rows, s, gen(), OtherRank([-6, 8], weights=other, sums={"fillers": 0.0}))


def test_filler_rows_get_factor_zero_and_stay_out_of_the_metrics():
    plan = _filler_case()
    assert plan.m == 6 and int(plan.filler.sum()) == 3
    assert (plan.factors[plan.filler] == 0).all()
    informative = plan.factors[~plan.filler]
    assert (informative > 0).all()
    assert plan.metrics["filler_row_fraction"] == pytest.approx(3 / 12)
    real = torch.cat([plan.draw.weights[~plan.filler], torch.ones(6, dtype=torch.float64)])
    assert plan.metrics["weight_max"] == pytest.approx(float(real.max()))
    assert plan.metrics["weight_ess"] == pytest.approx(float(real.sum() ** 2 / (real**2).sum()))


def test_recenter_ignores_filler_weights():
    """The informative rows' recentred weights are max(0, w − mean(non-filler w) + w̄₀): filler weights (m/(Nπ) with
    π spread over cheap zero-signal rows, unbounded) do not shift them, and the centre counts non-filler slots only:
    this rank's 3 rows of S (π = 1, w = 6/8) and the other rank's 6 (E[Σ w] = 6): w̄₀ = (6·3/8 + 6) / (3 + 6)."""
    plan = _filler_case("recenter")
    w = plan.draw.weights[~plan.filler]
    center = (6 * 3 / 8 + 6) / 9
    assert plan.metrics["weight_center"] == pytest.approx(center)
    real_mean = torch.cat([w, torch.ones(6, dtype=torch.float64)]).mean()
    torch.testing.assert_close(plan.factors[~plan.filler], (w - real_mean + center).clamp(min=0.0))
    assert (plan.factors[plan.filler] == 0).all()
    assert plan.metrics["weight_mean"] == pytest.approx(center)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-3, 3), min_size=2, max_size=24),
    st.floats(0.01, 1.0),
    st.floats(0.1, 1.0),
    st.integers(0, 2**31),
)
def test_weights_of_rows_that_carry_gradient_are_bounded_by_one_over_alpha(adv, alpha, fraction, seed):
    """p ≥ α/|S| on the support, so w ≤ |S|/(α N) ≤ 1/α for every kept row that can carry gradient (the help text's
    bound); fillers are outside it and get 0."""
    rows = make_rows(adv)
    plan = plan_batch(rows, ht_settings(kept_fraction=fraction, smoothing=alpha), gen(seed))
    k, n = int(plan.eligible.sum()), len(adv)
    real = plan.draw.weights[~plan.filler]
    if k:
        assert float(real.max()) <= k / (alpha * n) + 1e-9
    assert (plan.factors[plan.filler] == 0).all()
    assert plan.metrics["weight_ess"] <= int((~plan.filler).sum()) + 1e-9


# ---------------------------------------------------------------- the plan is a pure function
def test_plan_is_deterministic_given_the_generator():
    rows = make_rows([1.0, -1.0, 2.0, -0.5, 0.0, 3.0, -2.0, 0.25])
    a = plan_batch(rows, ht_settings(), gen(7))
    b = plan_batch(rows, ht_settings(), gen(7))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.factors, b.factors) and a.metrics == b.metrics


def test_plan_calls_its_math_through_module_globals(monkeypatch):
    """tests/test_unbiased.py records the draw by patching `plan.draw_systematic`."""
    seen = recorded_draws(monkeypatch)
    plan = plan_batch(make_rows([1.0, -1.0, 2.0, -2.0]), ht_settings(), gen())
    assert seen and seen[0] is plan.draw


def test_zero_signal_batch_plans_and_logs():
    plan = plan_batch(make_rows([0.0] * 8), ht_settings(), gen())
    assert plan.m >= 1 and (plan.factors == 0).all()
    assert plan.metrics["informative_fraction"] == 0.0 and plan.metrics["zero_signal_ranks"] == 1.0
    assert plan.metrics["filler_row_fraction"] == 1.0


# ---------------------------------------------------------------- item 7: explicit batch keys
def test_unknown_batch_key_is_refused():
    batch = {
        "prompt_ids": torch.ones(4, 3, dtype=torch.long),
        "prompt_mask": torch.ones(4, 3, dtype=torch.long),
        "completion_ids": torch.ones(4, 5, dtype=torch.long),
        "completion_mask": torch.ones(4, 5, dtype=torch.long),
        "advantages": torch.ones(4),
        "num_items_in_batch": torch.tensor(20),
    }
    check_keys(batch)
    assert select_rows(batch, torch.tensor([0, 2]))["advantages"].shape == (2,)
    batch["per_row_reward_vector"] = torch.ones(4, 5)  # a per-row entry that shape alone would take as per-token
    for fn in (lambda b: select_rows(b, torch.tensor([0])), trim_to_longest, check_keys):
        with pytest.raises(ValueError, match="per_row_reward_vector"):
            fn(batch)
    assert "num_items_in_batch" in KNOWN_KEYS


def test_trim_with_host_widths_equals_trim_from_masks():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    pmask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    batch = {
        "prompt_ids": pmask.clone(),
        "prompt_mask": pmask,
        "completion_ids": mask.clone(),
        "completion_mask": mask,
        "old_per_token_logps": torch.randn(2, 5),
        "advantages": torch.ones(2),
    }
    a = trim_to_longest(batch)
    b = trim_to_longest(batch, widths=(2, 3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["completion_ids"].shape == (2, 3) and a["prompt_ids"].shape == (2, 2)


# ---------------------------------------------------------------- item 9: independent random streams
def test_streams_of_ranks_and_names_never_collide():
    """The old offsets (seed·1_000_003 + rank, + 7 for grouping) made rank r's grouping stream rank r+7's sampler."""
    seeds = {stream_seed(s, r, name) for s in (0, 1, 42) for r in range(16) for name in ("sampler", "grouping")}
    assert len(seeds) == 3 * 16 * 2
    assert stream_seed(0, 0, "grouping") != stream_seed(0, 7, "sampler")
    assert stream_seed(-5, 0, "sampler") >= 0 and stream_seed(2**70, 3, "sampler") < 2**63


def test_plan_settings_mirror_the_config():
    """`PlanSettings.from_args` reads every field the plan uses; the defaults are the config's ("none": the exactly
    unbiased weights; a kept fraction of 0.5)."""
    from testing_utils import make_config

    s = PlanSettings()
    default = PlanSettings.from_args(make_config(), False, 1)
    assert (s.kept_fraction, s.token_budget, s.weight_normalization, s.proxy) == (0.5, None, "none", default.proxy)
    assert (default.kept_fraction, default.weight_normalization, default.proxy) == (0.5, "none", "loss_aware")
    args = make_config(
        loss_type="dapo",
        cost_aware_kept_fraction=0.25,
        cost_aware_token_budget=300,
        cost_aware_proxy="uniform",
        cost_aware_smoothing=0.3,
        cost_aware_weight_normalization="recenter",
        steps_per_generation=4,
        gradient_accumulation_steps=2,
    )
    s = PlanSettings.from_args(args, True, 2)
    assert s == PlanSettings(
        loss_type="dapo",
        kept_fraction=0.25,
        token_budget=300,
        proxy="uniform",
        smoothing=0.3,
        weight_normalization="recenter",
        steps_per_generation=4,
        zero_advantage_carries_gradient=True,
        kept_multiple=2,
    )


# ---------------------------------------------------------------- the weights' centre
def test_recentred_weights_keep_the_gradient_scale_when_rows_cannot_be_drawn():
    """Half the rows cannot be drawn (a zero-advantage group of 4, 4 rows without loss tokens): the weights' mean is
    |S|/N = 1/2 in expectation, and the normalised weights are centred there (`weight_center`), so
    (1/m) Σ_kept w̃ L estimates (1/N) Σ L (L > 0 on S, 0 outside: the scale; a signed sum that nearly cancels shows
    the normalised estimators' own bias, which the trainer's Monte Carlo matrix measures). Centred at 1 they doubled
    it (the estimate was 2.1–2.2× the target here). "none" is unbiased whatever the centre."""
    adv = [1.0, -0.5, 2.0, -2.5, 0.0, 0.0, 0.0, 0.0] + [0.7, -1.3, 0.4, -0.2] + [1.0, -1.0, 1.0, -1.0]
    tokens = [6.0, 9.0, 3.0, 12.0] + [8.0] * 4 + [5.0, 7.0, 11.0, 4.0] + [0.0] * 4
    rows = make_rows(adv, loss_tokens=tokens)
    s = PlanSettings(kept_fraction=0.25, smoothing=0.1, weight_normalization="recenter")
    a, t = torch.tensor(adv, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    loss = (1.0 + a.abs()) * t.sqrt() * (a != 0)
    target = float(loss.sum() / 16)
    g, estimates, centres = gen(3), [], set()
    for _ in range(3000):
        plan = plan_batch(rows, s, g)
        centres.add(plan.metrics.get("weight_center"))
        estimates.append(float((plan.factors * loss[plan.indices]).sum() / plan.m))
    est = torch.tensor(estimates)
    se = float(est.std() / math.sqrt(len(est)))
    # The recentred estimator's own bias at m = 4 (not the scale): under 2% here.
    assert abs(float(est.mean()) / target - 1.0) < 0.05 + 4 * se / abs(target), (float(est.mean()), target, se)
    assert len(centres) == 1 and centres.pop() == pytest.approx(0.5)


def test_fillers_are_the_cheapest_rows_the_loss_sees():
    """A rank whose rows all have A = 0, beside a rank with signal, fills its m slots with the cheapest rows the loss
    sees, for sure (issue 54: an 8-row batch kept rows of 24 and 9 tokens instead of 5 and 6); a rank with some signal
    gives the slots its support cannot take to the cheapest of its other rows."""
    costs = [24.0, 9.0, 5.0, 30.0, 6.0, 40.0, 12.0, 3.0]
    tokens = [20.0, 5.0, 1.0, 26.0, 2.0, 36.0, 8.0, 0.0]  # the cheapest row has no loss token
    for seed in range(10):
        rows = make_rows([0.0] * 8, loss_tokens=tokens, costs=costs)
        other = OtherRank([-2, 8], weights=_full_support_rank(2))
        plan = plan_batch(rows, ht_settings(kept_fraction=0.25), gen(seed), other)
        assert plan.m == 2 and plan.filler.all()
        assert sorted(rows.costs[plan.indices].tolist()) == [5.0, 6.0]
        rows = make_rows([0.0, 0.0, 0.0, 1.0, 0.0, -1.0, 0.0, 0.0], loss_tokens=tokens, costs=costs)
        other = OtherRank([-4, 8], weights=_full_support_rank(4))
        plan = plan_batch(rows, ht_settings(kept_fraction=0.5), gen(seed), other)
        assert plan.m == 4 and int(plan.filler.sum()) == 2
        assert sorted(rows.costs[plan.indices].tolist()) == [5.0, 6.0, 30.0, 40.0]
