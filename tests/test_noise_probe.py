"""The noise probe (`kept_count/noise_probe.py`): the split and its estimator against closed forms (odd prompt and
rollout counts included), the probe's gradients against per-row gradients of a tiny model, runs (it measures without
changing training; the rules act on it; its state round-trips), and the config's refusals."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainer import length_reward, make_args, weights_of

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.kept_count.noise_parts import noise_parts, parts_from_sums, quarter_labels
from trl_costaware.kept_count.noise_probe import MIN_PROBES, PROBE_WARMUP, probe_due
from trl_costaware.trainer import STATE_FILE


# ---------------------------------------------------------------------------------------------------- pure
@settings(max_examples=40, deadline=None)
@given(groups=st.integers(2, 9), generations=st.integers(2, 7), seed=st.integers(0, 1000))
def test_quarter_labels_split_prompts_and_rollouts(groups, generations, seed):
    labels, a, b = quarter_labels(groups, generations, torch.Generator().manual_seed(seed))
    assert labels.shape == (groups * generations,)
    per_group = labels.view(groups, generations)
    half = per_group // 2  # prompt half, the same for every rollout of a group
    assert bool((half == half[:, :1]).all())
    assert int((half[:, 0] == 0).sum()) == groups // 2 and a == pytest.approx((groups // 2) / groups)
    rollout = per_group % 2
    assert bool(((rollout == 0).sum(1) == generations // 2).all()) and b == pytest.approx(
        (generations // 2) / generations
    )


def test_quarter_labels_need_two_groups_and_two_rollouts():
    for groups, generations in ((1, 4), (4, 1)):
        with pytest.raises(ValueError, match=">= 2 groups"):
            quarter_labels(groups, generations, torch.Generator())


@settings(max_examples=40, deadline=None)
@given(
    a=st.sampled_from([0.5, 0.4, 1 / 3, 2 / 7]),
    b=st.sampled_from([0.5, 1 / 3, 0.25]),
    rows=st.integers(1, 50),
    seed=st.integers(0, 10_000),
)
def test_parts_from_sums_is_noise_parts_of_the_half_means(a, b, rows, seed):
    """The four scalars of the three accumulated sums give what `noise_parts` gives on the half means."""
    gen = torch.Generator().manual_seed(seed)
    q = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(4)]
    h_a, h_b = q[0] + q[1], q[2] + q[3]
    r = (q[0] + q[2]) / b - (q[1] + q[3]) / (1 - b)
    got = parts_from_sums(float(h_a @ h_a), float(h_b @ h_b), float(h_a @ h_b), float(r @ r), a, b, rows)
    g_1, g_2 = (q[0] + q[2]) / (b * rows), (q[1] + q[3]) / ((1 - b) * rows)
    want = noise_parts((h_a / (a * rows), h_b / ((1 - a) * rows)), (g_1, g_2), prompt_share=a, rollout_share=b)
    assert got.total == pytest.approx(want.total, rel=1e-9, abs=1e-12)
    assert got.within == pytest.approx(want.within, rel=1e-9, abs=1e-12)
    assert got.signal == pytest.approx(want.signal, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("share_formula", ["derived", "equal_halves"])
def test_unequal_halves_match_the_closed_form(share_formula):
    """K = 5 prompts and G = 3 rollouts (the halves hold 2 of 5 prompts and 1 of 3 rollouts): over many batches and
    random splits, the mean total and within terms are tr Σ_b/K + tr Σ_w/(KG) and tr Σ_w/(KG), the signal |𝐆|². The
    control treats the halves as equal (the shares 1/2): it misses the closed form, so the test can fail."""
    k, g, d = 5, 3, 4
    gen = torch.Generator().manual_seed(0)
    sigma_b = torch.tensor([1.0, 0.5, 2.0, 0.3], dtype=torch.float64)
    sigma_w = torch.tensor([2.0, 3.0, 0.5, 1.0], dtype=torch.float64)
    true = torch.tensor([0.5, -0.3, 0.2, 0.4], dtype=torch.float64)
    totals, withins, signals = [], [], []
    for _ in range(20000):
        mu = true + sigma_b * torch.randn(k, d, generator=gen, dtype=torch.float64)
        x = (mu[:, None, :] + sigma_w * torch.randn(k, g, d, generator=gen, dtype=torch.float64)).reshape(k * g, d)
        labels, a, b = quarter_labels(k, g, gen)
        if share_formula == "equal_halves":
            a = b = 0.5
        sums = [x[labels == q].sum(0) for q in range(4)]
        h_a, h_b = sums[0] + sums[1], sums[2] + sums[3]
        r = (sums[0] + sums[2]) / b - (sums[1] + sums[3]) / (1 - b)
        p = parts_from_sums(float(h_a @ h_a), float(h_b @ h_b), float(h_a @ h_b), float(r @ r), a, b, k * g)
        totals.append(p.total), withins.append(p.within), signals.append(p.signal)
    within = float(sigma_w.pow(2).sum()) / (k * g)
    total = float(sigma_b.pow(2).sum()) / k + within
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    close = (
        mean(totals) == pytest.approx(total, rel=0.05)
        and mean(withins) == pytest.approx(within, rel=0.05)
        and mean(signals) == pytest.approx(float(true @ true), rel=0.1)
    )
    assert close == (share_formula == "derived")


def test_probe_schedule():
    assert [i for i in range(1, 30) if probe_due(i, 8)] == [1, 2, 3, 11, 19, 27]
    assert [i for i in range(1, 6) if probe_due(i, 1)] == [1, 2, 3, 4, 5]
    assert not any(probe_due(i, 0) for i in range(1, 20))
    assert PROBE_WARMUP >= MIN_PROBES


# ---------------------------------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


# one optimizer step (2 micro-steps of 8 rows) per generation batch of 16 rows = 4 groups of 4
RUN = dict(max_steps=5, steps_per_generation=2, gradient_accumulation_steps=2)
MEASURE = dict(cost_aware_prompt_fraction="auto", cost_aware_max_step_ratio=1.0)  # measures, never cuts


def trainer_for(tiny_model_path, dataset, tmp_path, **overrides):
    args = make_args(tmp_path, **{**RUN, **overrides})
    return CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)


def series(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


@pytest.mark.parametrize("loss_type,tools", [("grpo", False), ("dapo", False), ("grpo", True)])
def test_probe_terms_equal_per_row_gradients(tiny_model_path, dataset, tmp_path, loss_type, tools):
    """The probe's (total, within, signal) on a batch of 4 groups × 4 rows equal those computed from each row's own
    gradient of −A_i Σ_t log π(y_it)/Z_i (Z_i the row's tokens for grpo, 1 for dapo), summed by the same split: the
    probe's micro-batching, trimming and normaliser are exact. Rows with A = 0 are skipped by the probe and add 0.
    With a tool mask hiding tokens 1–2 of every completion, the loss tokens after them still count: the micro-batch
    is trimmed to its longest completion, not to its count of loss tokens."""
    trainer = trainer_for(tiny_model_path, dataset, tmp_path, loss_type=loss_type, **MEASURE)
    model = trainer.model
    gen = torch.Generator().manual_seed(3)
    n, prompt_len, width = 16, 5, 7
    prompt_ids = torch.randint(3, 20, (n, prompt_len), generator=gen)
    completion_ids = torch.randint(3, 20, (n, width), generator=gen)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    completion_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    advantages = torch.randn(n, generator=gen)
    advantages[[2, 9]] = 0.0
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids * completion_mask,
        "completion_mask": completion_mask,
        "advantages": advantages,
    }
    loss_mask = completion_mask
    if tools:
        tool_mask = torch.ones_like(completion_mask)
        tool_mask[:, 1:3] = 0
        batch["tool_mask"] = tool_mask
        loss_mask = completion_mask * tool_mask
    state = trainer._probe_generator.get_state()
    total, within, signal = trainer._probe_terms(batch)
    labels, a, b = quarter_labels(4, 4, torch.Generator().set_state(state))
    params = [p for p in model.parameters() if p.requires_grad]
    sums = [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(4)]
    for i in range(n):
        ids = torch.cat([prompt_ids[i], batch["completion_ids"][i]])[None]
        logits = model(input_ids=ids).logits[0, prompt_len - 1 : -1].float() / trainer.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, prompt_len:, None]).squeeze(-1)
        per_row = (logp * loss_mask[i]).sum()
        if loss_type == "grpo":
            per_row = per_row / loss_mask[i].sum().clamp(min=1)
        grads = torch.autograd.grad(-advantages[i] * per_row, params, allow_unused=True)
        for s, gr in zip(sums[int(labels[i])], grads, strict=True):
            if gr is not None:
                s += gr.double()
    flat = [torch.cat([x.flatten() for x in q]) for q in sums]
    h_a, h_b = flat[0] + flat[1], flat[2] + flat[3]
    r = (flat[0] + flat[2]) / b - (flat[1] + flat[3]) / (1 - b)
    want = parts_from_sums(float(h_a @ h_a), float(h_b @ h_b), float(h_a @ h_b), float(r @ r), a, b, n)
    assert total == pytest.approx(want.total, rel=1e-4)
    assert within == pytest.approx(want.within, rel=1e-4)
    assert signal == pytest.approx(want.signal, rel=1e-4, abs=1e-6 * abs(want.total))
    assert all(p.grad is None for p in params)  # the trainer's own .grad is left as it was


@pytest.mark.parametrize("cost_aware", [True, False])
def test_probe_measures_without_changing_training(tiny_model_path, dataset, tmp_path, cost_aware):
    """A run probing every batch ends with exactly the weights of the same run with the probe off (its own random
    state, the trainer's .grad restored), logs finite terms on every batch, and has its moving averages."""
    runs = {}
    for every in (1, 0):
        trainer = trainer_for(
            tiny_model_path,
            dataset,
            tmp_path / str(every),
            cost_aware=cost_aware,
            cost_aware_noise_probe_every=every,
            **MEASURE,
        )
        trainer.train()
        runs[every] = trainer
    assert torch.equal(weights_of(runs[1].model), weights_of(runs[0].model))
    on, off = runs[1], runs[0]
    for key in ("total", "within", "signal"):
        values = series(on, f"cost_aware/noise_probe_{key}")
        assert len(values) == 5 and all(math.isfinite(v) for v in values)
        assert not series(off, f"cost_aware/noise_probe_{key}")
    assert all(t >= 0 for t in series(on, "cost_aware/noise_probe_total"))
    assert all(w >= 0 for w in series(on, "cost_aware/noise_probe_within"))
    assert on._probe_count == 5 and off._probe_count == 0 and not off._probe_on


def test_rules_act_on_the_probe(tiny_model_path, dataset, tmp_path, monkeypatch):
    """With the probe's terms fixed at total 1, within 0.2, signal 2 at the full batch (ρ = 0.5, w = 0.2; a batch of
    a fraction φ of the prompts reports 1/φ times the noise, which the probe scales back), "auto" decides from the
    batch after the `MIN_PROBES`-th probe (not after the consecutive steps' 4 pairs), with ρ = 0.5; and the "compute"
    kept rule gets ρ and w = 0.2 from it."""

    def terms(self, batch):  # a batch of a fraction φ of the 16 rows has 1/φ times the full batch's noise
        scale = 16 / len(batch["advantages"])
        return 1.0 * scale, 0.2 * scale, 2.0

    monkeypatch.setattr(CostAwareGRPOTrainer, "_probe_terms", terms)
    auto = trainer_for(
        tiny_model_path, dataset, tmp_path / "auto", cost_aware_prompt_fraction="auto", cost_aware_cost_model="tokens"
    )
    auto.train()
    fallback = series(auto, "cost_aware/prompt_rule_fallback")
    assert fallback[:MIN_PROBES] == [1.0] * MIN_PROBES and fallback[MIN_PROBES:] == [0.0] * (5 - MIN_PROBES)
    assert series(auto, "cost_aware/prompt_noise_to_signal") == pytest.approx([0.5] * (5 - MIN_PROBES))
    assert series(auto, "cost_aware/noise_probe_within_share")[-1] == pytest.approx(0.2)
    compute = trainer_for(
        tiny_model_path,
        dataset,
        tmp_path / "compute",
        cost_aware_kept_fraction="compute",
        cost_aware_cost_model="tokens",
    )
    compute.train()
    shares = series(compute, "cost_aware/compute_within_share")
    assert shares and shares[-1] == pytest.approx(0.2)
    assert compute._compute_signal().rho == pytest.approx(0.5)
    assert compute._compute_signal().step_model == "adam"


def test_probe_state_round_trips_through_a_checkpoint(tiny_model_path, dataset, tmp_path):
    trainer = trainer_for(
        tiny_model_path, dataset, tmp_path, max_steps=4, save_strategy="steps", save_steps=4, **MEASURE
    )
    trainer.train()
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-4")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)
    assert saved["probe"]["count"] == trainer._probe_count == PROBE_WARMUP
    fresh = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=copy.deepcopy(trainer.args),
        train_dataset=dataset,
    )
    assert fresh._probe_count == 0
    fresh._load_cost_aware_state(checkpoint)
    assert fresh._probe_count == trainer._probe_count
    for x, y in zip(
        (fresh._probe_total, fresh._probe_within, fresh._probe_signal),
        (trainer._probe_total, trainer._probe_within, trainer._probe_signal),
        strict=True,
    ):
        assert (x.total, x.weight) == pytest.approx((y.total, y.weight))
    assert torch.equal(fresh._probe_generator.get_state(), trainer._probe_generator.get_state())


def test_probe_off_where_a_rank_holds_one_group(tiny_model_path, dataset, tmp_path):
    """A rank's generation batch of one group cannot be split by prompts: the probe is off, with a warning naming the
    fields, and the rules fall back to the consecutive steps' noise."""
    with pytest.warns(UserWarning, match="at least two whole groups"):
        trainer = trainer_for(
            tiny_model_path,
            dataset,
            tmp_path,
            per_device_train_batch_size=4,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            **MEASURE,
        )
    assert not trainer._probe_on


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_config_refuses_a_bad_probe_interval(tmp_path, value):
    with pytest.raises(ValueError, match="cost_aware_noise_probe_every must be an integer >= 0"):
        CostAwareGRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", cost_aware_noise_probe_every=value
        )


@pytest.mark.parametrize("terms", [(math.nan, 0.1, 1.0), (1.0, 0.1, math.inf), (1.0, 0.5, -2.0)])
def test_degenerate_probe_falls_back_and_shows(tiny_model_path, dataset, tmp_path, monkeypatch, terms):
    """A probe whose terms are not finite is not counted (the rule keeps waiting: every prompt, fallback 1 in the
    logs); one whose signal is ≤ 0 reads ρ = ∞, and the rule generates every prompt and says so."""
    monkeypatch.setattr(CostAwareGRPOTrainer, "_probe_terms", lambda self, batch: terms)
    trainer = trainer_for(
        tiny_model_path,
        dataset,
        tmp_path,
        cost_aware_prompt_fraction="auto",
        cost_aware_cost_model="tokens",
        cost_aware_noise_probe_every=1,
    )
    trainer.train()
    finite = all(math.isfinite(v) for v in terms)
    assert trainer._probe_count == (5 if finite else 0)
    assert series(trainer, "cost_aware/prompt_rule_fallback")[:3] == [1.0] * 3
    if finite:
        assert trainer._probe_rho() == math.inf
        assert series(trainer, "cost_aware/prompt_rule_fallback") == [1.0] * 5
        assert series(trainer, "cost_aware/prompt_fraction") == [1.0] * 5
