"""The prompt stage's math and state (`prompt_sampling.py`, `prompt_history.py`): pure, no trainer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import RepeatSampler

from trl_costaware.prompts.history import PromptHistory, PromptSampler, PromptUpdate
from trl_costaware.prompts.sampling import (
    beta_binomial_pmf,
    draw_prompts,
    epoch_layout,
    fit_prior,
    forget_and_update,
    greso_adapt,
    greso_keep_probability,
    greso_select,
    group_second_moment,
    group_value,
    prompt_distribution,
    success_counts,
    token_normaliser_factor,
    zero_variance_probability,
)


def brute_pmf(a: float, b: float, n: int, grid: int = 20001) -> torch.Tensor:
    """P(k) = ∫ C(n,k) p^k (1-p)^(n-k) Beta(p; a, b) dp by the trapezoidal rule."""
    p = torch.linspace(1e-9, 1 - 1e-9, grid, dtype=torch.float64)
    density = p ** (a - 1) * (1 - p) ** (b - 1)
    density = density / torch.trapezoid(density, p)
    return torch.stack(
        [math.comb(n, k) * torch.trapezoid(p**k * (1 - p) ** (n - k) * density, p) for k in range(n + 1)]
    )


@pytest.mark.parametrize("a,b,n", [(1.0, 1.0, 4), (9.0, 1.0, 8), (2.5, 3.5, 16), (1.0, 17.0, 16)])
def test_beta_binomial_pmf_matches_the_integral(a, b, n):
    pmf = beta_binomial_pmf(torch.tensor([a]), torch.tensor([b]), n)[0]
    assert torch.allclose(pmf, brute_pmf(a, b, n), atol=2e-4)
    assert pmf.sum().item() == pytest.approx(1.0)


def test_uniform_prior_gives_the_closed_forms():
    n = 8
    pmf = beta_binomial_pmf(torch.ones(1), torch.ones(1), n)
    assert torch.allclose(pmf, torch.full((1, n + 1), 1 / (n + 1), dtype=torch.float64))
    assert zero_variance_probability(pmf).item() == pytest.approx(2 / (n + 1))
    # v̂ = √(E Σ A² / (G − 1)): √(1 − ẑ) with TRL's group std; √(ab / ((a+b)(a+b+1))) = √(1/6) unscaled
    assert group_value(pmf, "group").item() == pytest.approx(math.sqrt(1 - 2 / (n + 1)))
    assert group_value(pmf, "none").item() == pytest.approx(math.sqrt(1 / 6))


@pytest.mark.parametrize("a,b,g", [(1.0, 1.0, 8), (3.0, 0.5, 8), (0.2, 0.1, 16), (7.0, 2.0, 4)])
def test_second_moment_is_the_mean_of_sum_a_squared(a, b, g):
    """E[Σ A²] against TRL's advantages on every success count k, weighted by the Beta-binomial pmf: Bessel std
    ("group", ε = 1e-4 as TRL) and unscaled ("none"); and the "none" closed form (G − 1) ab / ((a+b)(a+b+1))."""
    pmf = beta_binomial_pmf(torch.tensor([a]), torch.tensor([b]), g)
    group, none = [], []
    for k in range(g + 1):
        r = torch.tensor([1.0] * k + [0.0] * (g - k), dtype=torch.float64)
        centred = r - r.mean()
        group.append(float((centred / (r.std() + 1e-4)).pow(2).sum()))
        none.append(float(centred.pow(2).sum()))
    assert group_second_moment(pmf, "group").item() == pytest.approx(
        float(pmf[0] @ torch.tensor(group, dtype=torch.float64)), rel=1e-3
    )
    assert group_second_moment(pmf, "none").item() == pytest.approx(
        float(pmf[0] @ torch.tensor(none, dtype=torch.float64))
    )
    assert group_second_moment(pmf, "none").item() == pytest.approx((g - 1) * a * b / ((a + b) * (a + b + 1)))


def test_a_solved_prompt_is_worth_less_and_predicted_zero_variance():
    # one visit of 16 successes of 16 on a uniform prior: P(all equal next time) = 17/33
    a, b = forget_and_update(torch.ones(2), torch.ones(2), torch.tensor([16.0, 8.0]), 16, 0.5)
    pmf = beta_binomial_pmf(a, b, 16)
    zero = zero_variance_probability(pmf)
    assert zero[0].item() == pytest.approx(17 / 33)
    assert zero[1] < 0.05
    value = group_value(pmf)
    assert value[0] < 0.75 * value[1]


def test_the_fitted_prior_lets_a_solved_prompt_become_near_certain():
    """Under the uniform prior a prompt solved at every visit (G = 8, γ = 0.5) tops out at P(zero) ≈ 0.68; under a
    prior fitted on a pool of solved and unsolved prompts (U-shaped, a₀, b₀ < 1) it passes 0.95."""
    g, gamma = 8, 0.5
    ea = eb = torch.zeros(1, dtype=torch.float64)
    for _ in range(30):
        ea, eb = forget_and_update(ea, eb, torch.tensor([8.0]), g, gamma, prior=(0.0, 0.0))
    uniform = zero_variance_probability(beta_binomial_pmf(1 + ea, 1 + eb, g)).item()
    assert uniform == pytest.approx(0.68, abs=0.01)
    pool = torch.tensor([8.0] * 30 + [0.0] * 10 + [3.0, 5.0, 4.0, 6.0, 2.0], dtype=torch.float64)
    a0, b0 = fit_prior(pool, g)
    assert a0 < 1 and b0 < 1 and a0 / (a0 + b0) == pytest.approx(float(pool.mean() / g), abs=1e-9)
    fitted = zero_variance_probability(beta_binomial_pmf(a0 + ea, b0 + eb, g)).item()
    assert fitted > 0.95


def test_fit_prior_recovers_a_beta_binomial_pool():
    gen = torch.Generator().manual_seed(0)
    p = torch.distributions.Beta(2.0, 6.0).sample((20000,))
    k = torch.binomial(torch.full_like(p, 8.0), p, generator=gen)
    a0, b0 = fit_prior(k, 8)
    assert a0 == pytest.approx(2.0, rel=0.1) and b0 == pytest.approx(6.0, rel=0.1)
    assert fit_prior(torch.tensor([8.0]), 8) == (1.0, 1.0) and fit_prior(torch.zeros(5), 8) == (1.0, 1.0)


def test_forgetting():
    a, b = torch.tensor([11.0]), torch.tensor([1.0])  # prior (1, 1) + 10 successes
    a1, b1 = forget_and_update(a, b, torch.tensor([0.0]), 4, 0.5)
    assert (a1.item(), b1.item()) == (6.0, 5.0)
    a0, b0 = forget_and_update(a, b, torch.tensor([0.0]), 4, 0.0)  # the last visit only
    assert (a0.item(), b0.item()) == (1.0, 5.0)


def test_success_counts_binary_and_graded():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0], [float("nan"), 1.0, 0.5, 0.0]])
    assert success_counts(r, 0.0, 1.0).tolist() == [2.0, 4.0, 1.5]
    assert success_counts(r, 1.0, 1.0).tolist() == [0.0, 0.0, 0.0]


@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=2, max_size=40),
    st.floats(0.01, 1.0),
)
@settings(max_examples=60, deadline=None)
def test_prompt_distribution_keeps_every_prompt_drawable(values, alpha):
    v = torch.tensor(values, dtype=torch.float64)
    c = torch.rand(len(values), generator=torch.Generator().manual_seed(len(values)), dtype=torch.float64) * 50 + 1
    q = prompt_distribution(v, c, alpha)
    assert q.sum().item() == pytest.approx(1.0)
    assert (q >= alpha / len(values) - 1e-12).all()
    s = v / c.sqrt()
    if s.sum() > 0:
        expected = (1 - alpha) * s / s.sum() + alpha / len(values)
        assert torch.allclose(q, expected)


def test_prompt_distribution_refuses_no_floor():
    with pytest.raises(ValueError, match="smoothing"):
        prompt_distribution(torch.ones(3), torch.ones(3), 0.0)


def test_draw_weights_are_unbiased_and_the_control_is_not():
    """E[Σ_drawn w_j g_j] = (K/P) Σ_j g_j for any q (z-score over draws); weights forced to 1 give Σ π_j g_j."""
    gen = torch.Generator().manual_seed(0)
    p, k, draws = 12, 4, 4000
    g = torch.randn(p, dtype=torch.float64, generator=gen) + 2.0
    q = prompt_distribution(torch.rand(p, generator=gen, dtype=torch.float64) ** 3, torch.ones(p), 0.1)
    est, control, counts = [], [], torch.zeros(p, dtype=torch.float64)
    for _ in range(draws):
        d = draw_prompts(q, k, gen)
        assert len(set(d.indices.tolist())) == k
        est.append(float((d.weights * g[d.indices]).sum()))
        control.append(float(g[d.indices].sum()))
        counts[d.indices] += 1
    target = k / p * float(g.sum())
    assert torch.allclose(counts / draws, d.probabilities, atol=0.03)  # prompt j is drawn with probability π_j

    def z(values):
        v = torch.tensor(values, dtype=torch.float64)
        return abs(float(v.mean()) - target) / float(v.std() / math.sqrt(len(v)))

    assert z(est) < 4.0
    assert z(control) > 10.0


def test_token_normaliser_factor():
    w = torch.tensor([2.0, 0.5])
    t = torch.tensor([10.0, 30.0])
    assert token_normaliser_factor(w, t) == pytest.approx(40.0 / 35.0)
    assert token_normaliser_factor(torch.ones(2), t) == pytest.approx(1.0)
    assert token_normaliser_factor(w, torch.zeros(2)) == 1.0


# ---------------------------------------------------------------- the history and the sampler
def history(size=16, g=4, lag=2, seed=0):
    return PromptHistory(size, g, smoothing=0.1, forgetting=0.5, scale="group", seed=seed, lag=lag)


def update_for(rec, g=4, reward=None):
    k = len(rec.indices)
    rewards = torch.tensor([[float((j + i) % 2) for i in range(g)] for j in rec.indices]) if reward is None else reward
    return PromptUpdate(rec.draw, rec.indices, rewards[:k], torch.full((k,), 5.0), torch.full((k,), 3.0))


def run_draws(h, n, k, early: bool):
    """n draws; each batch's update is submitted right after its draw (early) or one draw later (late, as when the
    loader has read one batch ahead): the draws must not depend on it."""
    records, waiting = [], None
    for t in range(n):
        rec = h.draw(t, k)
        records.append(rec)
        if waiting is not None:
            h.submit(waiting)
        waiting = update_for(rec)
        if early:
            h.submit(waiting)
            waiting = None
    if waiting is not None:
        h.submit(waiting)
    return records


def test_draws_do_not_depend_on_when_updates_arrive():
    a = run_draws(history(), 12, 4, early=True)
    b = run_draws(history(), 12, 4, early=False)
    assert [r.indices for r in a] == [r.indices for r in b]
    assert all(torch.equal(x.weights, y.weights) for x, y in zip(a, b, strict=True))
    assert not all(torch.allclose(r.weights, torch.ones(4, dtype=torch.float64)) for r in a)  # history did act


def test_a_missing_update_is_an_error():
    h = history()  # 16 prompts, K = 4: epochs of 4 draws; epoch 1's plan (draw 4) needs the updates <= 2
    for t in range(4):
        h.draw(t, 4)
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        h.draw(4, 4)


def test_state_round_trip_reproduces_later_draws():
    h = history()
    run_draws(h, 6, 4, early=False)
    copy = history()
    copy.load_state_dict(h.state_dict())
    for t in range(6, 10):
        x, y = h.draw(t, 4), copy.draw(t, 4)
        assert x.indices == y.indices and torch.equal(x.weights, y.weights)
        h.submit(update_for(x))
        copy.submit(update_for(y))
    with pytest.raises(ValueError, match="same data set"):
        history(size=17).load_state_dict(h.state_dict())


def test_take_record_prefers_the_next_draw_then_a_regenerated_one():
    h = history(size=4)  # K = P: every draw holds every prompt, only the order differs
    recs = [h.draw(t, 4) for t in range(2)]
    rows = lambda rec: [j for j in rec.indices for _ in range(4)]  # noqa: E731
    assert h.take_record(rows(recs[0])).draw == 0
    assert h.take_record(rows(recs[0])).draw == 0  # re-generated (resume inside a buffer)
    assert h.take_record(rows(recs[1])).draw == 1
    with pytest.raises(RuntimeError, match="match none"):
        h.take_record([99] * 16)


def test_sampler_has_repeat_samplers_layout_and_length():
    h = history(size=10, g=2)
    sampler = PromptSampler(h, mini_repeat_count=2, batch_size=3, repeat_count=2)
    reference = RepeatSampler(list(range(10)), mini_repeat_count=2, batch_size=3, repeat_count=2, seed=0)
    assert len(sampler) == len(reference) == 3 * 3 * 2 * 2
    h.lag = 10**6  # no updates needed for this check
    out = list(sampler)
    assert len(out) == len(sampler)
    for c in range(3):  # each batch: 3 distinct prompts, each twice in a row, the batch twice
        block = out[c * 12 : (c + 1) * 12]
        assert block[:6] == block[6:]
        assert block[0:6:2] == block[1:6:2] and len(set(block[:6])) == 3
    assert [r for r in h.records] == [0, 1, 2]
    sampler.set_epoch(5)
    list(sampler)
    assert list(h.records)[-3:] == [15, 16, 17]  # draw numbers run on: epoch · draws per epoch + c


def test_an_unseen_pool_is_drawn_uniformly_with_unit_weights():
    """Before any reward is in (and on a pool whose prompts are never revisited) the prompt stage is GRPO's draw:
    every prompt has the prior, q is uniform and every weight is 1."""
    h = history(size=64)
    for t in range(2):
        rec = h.draw(t, 8)
        assert torch.allclose(rec.weights, torch.ones(8, dtype=torch.float64))
        assert torch.allclose(rec.inclusion, torch.full((8,), 8 / 64, dtype=torch.float64))


# ---------------------------------------------------------------- balanced epochs
def test_epoch_layout_visits_every_prompt_floor_or_ceil_of_c_pi():
    """Each of the C batches holds K distinct prompts; prompt j is visited ⌊Cπ_j⌋ or ⌈Cπ_j⌉ times in the epoch
    (uniform q: every prompt exactly once when C K = P, TRL's epoch)."""
    gen = torch.Generator().manual_seed(1)
    for p, k, skew in [(128, 16, 3.0), (128, 16, 0.0), (50, 7, 2.0), (12, 4, 6.0)]:
        c = p // k
        for _ in range(50):
            q = torch.rand(p, generator=gen, dtype=torch.float64) ** skew
            idx, pi = epoch_layout(q / q.sum(), k, c, gen)
            assert idx.shape == (c, k)
            assert all(len(set(row.tolist())) == k for row in idx)
            visits = torch.bincount(idx.flatten(), minlength=p).double()
            expected = c * pi
            assert ((visits >= expected.floor() - 1e-9) & (visits <= expected.ceil() + 1e-9)).all()
            if skew == 0.0:
                assert (visits == 1).all()


def _inclusion_z(layout, q, k, c, epochs, seed):
    """Monte Carlo of each batch position's inclusion frequencies against π: the largest |z| over (batch, prompt)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(c, q.numel(), dtype=torch.float64)
    for _ in range(epochs):
        idx, pi = layout(q, k, c, gen)
        for r in range(c):
            counts[r, idx[r]] += 1
    freq = counts / epochs
    se = (pi * (1 - pi) / epochs).sqrt().clamp(min=1e-12)
    return float(((freq - pi) / se).abs().max())


def _layout_without_the_residue_shuffle(q, k, draws, generator):
    """The control: the same single pass, with residue r always going to batch r (no random σ)."""
    from trl_costaware.core.sampling import inclusion_probabilities

    n = q.numel()
    pi = inclusion_probabilities(q, k)
    perm = torch.randperm(n, generator=generator)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cum = torch.cumsum(draws * pi[perm], 0)
    cum = cum * (draws * k / cum[-1])
    points = u + torch.arange(draws * k, dtype=torch.float64)
    idx = perm[torch.searchsorted(cum, points, right=True).clamp(max=n - 1)]
    return idx.view(k, draws).t(), pi


def test_each_batch_of_an_epoch_includes_prompt_j_with_probability_pi():
    """Every batch position c of the epoch includes prompt j with probability exactly π_j (max |z| over 5 × 12
    cells, 6000 epochs); the control without the random residue order is detected (batch 0 starts on [0, 1), so
    the prompts laid out at the start are over-drawn there)."""
    q = torch.tensor([6.0, 5, 4, 3, 2, 2, 1, 1, 1, 0.5, 0.5, 0.25], dtype=torch.float64)
    q = q / q.sum()
    k, c = 2, 5
    assert _inclusion_z(epoch_layout, q, k, c, 6000, 0) < 4.5
    assert _inclusion_z(_layout_without_the_residue_shuffle, q, k, c, 6000, 0) > 10


def test_balanced_epochs_beat_independent_draws_on_coverage():
    """At uniform q (every prompt unseen) a history's epoch visits each prompt exactly once; independent draws per
    batch (the old behaviour) miss about a third of the pool per epoch."""
    h = history(size=128, g=4)
    h.lag = 10**6
    seen = torch.zeros(128)
    for t in range(8):
        seen[h.draw(t, 16).indices] += 1
    assert (seen == 1).all()
    gen = torch.Generator().manual_seed(0)
    old = torch.zeros(128)
    for _ in range(8):
        old[draw_prompts(torch.full((128,), 1 / 128, dtype=torch.float64), 16, gen).indices] += 1
    assert (old == 0).sum() > 20


# ---------------------------------------------------------------- GRESO
def test_greso_keep_probability_and_adaptation():
    streak = torch.tensor([0, 1, 2, 3, 50, 2])
    easy = torch.tensor([False, True, True, False, True, False])
    keep = greso_keep_probability(streak, easy, 0.5, 0.8)
    assert torch.allclose(keep, torch.tensor([1.0, 0.5, 0.25, 0.8**3, 0.01, 0.64], dtype=torch.float64))
    assert greso_adapt(0.5, 0.3, 0.125) == pytest.approx(0.49)
    assert greso_adapt(0.5, 0.1, 0.125) == pytest.approx(0.51)
    assert greso_adapt(0.01, 0.9, 0.1) == 0.01 and greso_adapt(1.0, 0.0, 0.1) == 1.0


def test_greso_select_walks_in_order_and_stops_at_k():
    gen = torch.Generator().manual_seed(0)
    order = torch.arange(10)
    keep = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    kept, consumed = greso_select(order, keep, 3, gen)
    assert kept.tolist() == [0, 2, 4] and consumed == 5
    kept, consumed = greso_select(order, torch.zeros(10, dtype=torch.float64), 3, gen)
    assert kept.tolist() == [] and consumed == 10


def test_greso_history_skips_solved_prompts_and_adapts():
    """Rule "greso": prompts solved at every visit are drawn less and less (n grows), p_easy falls while the batch's
    share of easy zero-variance groups is above its target; weights stay 1."""
    g = 4
    h = PromptHistory(16, g, smoothing=0.1, forgetting=0.5, scale="group", seed=0, lag=1, rule="greso")
    draws_of_solved = []
    for t in range(40):
        rec = h.draw(t, 4)
        assert len(set(rec.indices)) == 4 and torch.equal(rec.weights, torch.ones(4, dtype=torch.float64))
        rewards = torch.tensor([[1.0] * g if j < 8 else [1.0, 0.0, 1.0, 0.0] for j in rec.indices])
        h.submit(PromptUpdate(t, rec.indices, rewards, torch.full((4,), 5.0), torch.full((4,), 3.0)))
        draws_of_solved.append(sum(j < 8 for j in rec.indices))
    assert sum(draws_of_solved[-10:]) < sum(draws_of_solved[:10])
    assert h.greso_p[0] < 0.5 and h.streak[:8].max() >= 2
