"""The prompt count (`cost_aware_prompt_fraction`, issue 39): the pure rule (`kept_count.prompt_count`), the config's
refusals, and real runs of the trainer on the embedded tiny model (one process; the 2-process test is in
tests/test_distributed.py): fewer prompts generated, the "auto" rule's fallback, probe and metrics, a degenerate noise
estimate, the resume round trip and the device discipline of the path."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from fake_device import FAKE, mark
from hypothesis import given, settings
from hypothesis import strategies as st
from test_collectives import NoFloat64Device
from test_trainer import length_reward, make_args
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.kept_count.prompt_count import (
    AUTO,
    MIN_NOISE_PAIRS,
    STEP_MODELS,
    PromptFraction,
    StepCostFit,
    allowed_counts,
    check_prompt_fields,
    choose_prompt_count,
    draw_groups,
    fixed_count,
    predicted_compute_ratio,
    predicted_step_ratio,
    step_model_for,
)
from trl_costaware.trainer import STATE_FILE

# ---------------------------------------------------------------------------------------------------- pure rule


def test_prompt_fraction_parses():
    assert PromptFraction("0.5") == 0.5 and PromptFraction(" Auto ") == AUTO
    for bad in ("half", True, None):
        with pytest.raises(ValueError, match="'auto'"):
            PromptFraction(bad)


def test_allowed_counts_split_into_equal_micro_batches():
    assert allowed_counts(4, 4, 2) == [1, 2, 3, 4]
    assert allowed_counts(6, 1, 3) == [3, 6]  # k·G must be a multiple of S
    assert allowed_counts(5, 1, 4) == [4, 5]  # the whole batch is always allowed
    assert fixed_count(8, 0.5, allowed_counts(8, 4, 2)) == 4
    assert fixed_count(6, 0.25, [3, 6]) == 3  # at least the smallest allowed count


def test_draw_groups_is_uniform():
    """Every group is left out equally often (k of K, uniformly without replacement): each group's inclusion
    frequency is k/K within 4 standard errors over 4000 draws."""
    generator, counts, n = torch.Generator().manual_seed(0), torch.zeros(6), 4000
    for _ in range(n):
        chosen = draw_groups(6, 2, generator)
        assert chosen == sorted(set(chosen)) and len(chosen) == 2
        counts[chosen] += 1
    p = 2 / 6
    assert (counts / n - p).abs().max() < 4 * math.sqrt(p * (1 - p) / n)
    assert draw_groups(6, 6, generator) == list(range(6))
    with pytest.raises(ValueError):
        draw_groups(6, 0, generator)


@settings(max_examples=200, deadline=None)
@given(
    rho=st.floats(1e-3, 1e3),
    fixed=st.floats(0.0, 10.0),
    variable=st.floats(1e-3, 10.0),
    bound=st.floats(1.0, 4.0),
    groups=st.integers(1, 16),
    model=st.sampled_from(STEP_MODELS),
)
def test_choice_is_the_constrained_argmin(rho, fixed, variable, bound, groups, model):
    """The chosen k minimises J over the allowed counts that meet the step bound (the full batch always allowed),
    under either step model."""
    allowed = list(range(1, groups + 1))
    decision = choose_prompt_count(groups, allowed, rho, fixed, variable, bound, model)
    assert not decision.fallback
    feasible = [
        k for k in allowed if predicted_step_ratio(rho, k / groups, model) <= bound * (1 + 1e-12) or k == groups
    ]
    best = min(predicted_compute_ratio(rho, k / groups, fixed, variable, model) for k in feasible)
    assert decision.count in feasible
    assert decision.compute_ratio == pytest.approx(best, rel=1e-9)
    assert decision.step_ratio <= max(bound, 1.0) * (1 + 1e-9)
    assert decision.compute_ratio <= 1.0 + 1e-12  # never predicted dearer than the full batch


@settings(max_examples=100, deadline=None)
@given(rho=st.floats(1e-3, 1e3), phi=st.floats(0.05, 1.0))
def test_step_ratio_models(rho, phi):
    """ "sgd": S(φ)/S(1) = (1 + ρ/φ)/(1 + ρ), between 1 and 1/φ, 1/φ as ρ → ∞ (noise-limited), 1 as ρ → 0; "adam"
    (the default): its square root, between 1 and 1/√φ."""
    r = predicted_step_ratio(rho, phi, "sgd")
    assert r == pytest.approx((1 + rho / phi) / (1 + rho))
    assert 1.0 - 1e-12 <= r <= 1.0 / phi + 1e-9
    assert predicted_step_ratio(math.inf, phi, "sgd") == pytest.approx(1 / phi)
    assert predicted_step_ratio(rho, phi) == predicted_step_ratio(rho, phi, "adam") == pytest.approx(math.sqrt(r))
    assert predicted_step_ratio(math.inf, phi) == pytest.approx(1 / math.sqrt(phi))
    # no per-step cost and a token cost only: J(φ) = (φ + ρ)/(1 + ρ) under "sgd", φ √((1 + ρ/φ)/(1 + ρ)) under "adam"
    assert predicted_compute_ratio(rho, phi, 0.0, 1.0, "sgd") == pytest.approx((phi + rho) / (1 + rho))
    assert predicted_compute_ratio(rho, phi, 0.0, 1.0) == pytest.approx(phi * math.sqrt(r))
    with pytest.raises(ValueError, match="model"):
        predicted_step_ratio(rho, phi, "momentum")


def test_step_model_follows_the_optimizer():
    from transformers.training_args import OptimizerNames

    assert step_model_for("sgd") == step_model_for(OptimizerNames.SGD) == "sgd"
    for name in ("adamw_torch", "adamw_torch_fused", OptimizerNames.ADAFACTOR, "adagrad", "rmsprop", "lion_32bit"):
        assert step_model_for(name) == "adam"


def test_choice_limits():
    """Small ρ with no per-step cost cuts to the bound; a large per-step cost keeps every prompt, and so does large ρ
    with a per-step cost; the unconstrained optimum is √(ρA/B) under "sgd", (ρ/4)(√(1 + 8A/(ρB)) − 1) under "adam"."""
    allowed = list(range(1, 65))
    d = choose_prompt_count(64, allowed, 0.05, 0.0, 1.0, 1.5, "sgd")  # bound φ_min = ρ/(r(1+ρ)−1) = 0.0870
    assert d.count == math.ceil(64 * 0.05 / (1.5 * 1.05 - 1))
    d = choose_prompt_count(64, allowed, 0.05, 0.0, 1.0, 1.5)  # "adam": φ_min = ρ/(r²(1+ρ)−1) = 0.0367
    assert d.count == math.ceil(64 * 0.05 / (1.5**2 * 1.05 - 1)) == 3
    for model in STEP_MODELS:
        assert choose_prompt_count(64, allowed, 0.05, 100.0, 1.0, 1.5, model).count == 64
        assert choose_prompt_count(64, allowed, 1e4, 1.0, 1.0, 1.5, model).count == 64  # φ* ≥ 1 under both
        assert choose_prompt_count(64, allowed, 0.05, 0.0, 1.0, 1.0, model).count == 64  # r_max = 1: predict only
    assert choose_prompt_count(64, allowed, 100.0, 1.0, 1.0, 1.5, "sgd").count == 64  # φ* = √(ρA/B) = 10
    assert choose_prompt_count(64, allowed, 100.0, 1.0, 1.0, 1.5).count == 63  # φ* = 25 (√1.08 − 1) = 0.98
    d = choose_prompt_count(64, allowed, 0.25, 1.0, 1.0, 100.0, "sgd")  # φ* = √(0.25) = 0.5
    assert d.count == 32
    d = choose_prompt_count(64, allowed, 0.25, 1.0, 1.0, 100.0)  # φ* = 0.0625 (√33 − 1) = 0.297
    assert abs(d.count - 64 * 0.0625 * (math.sqrt(33) - 1)) <= 1


@pytest.mark.parametrize("rho", [None, math.nan, 0.0, -1.0, math.inf])
def test_degenerate_noise_falls_back(rho):
    d = choose_prompt_count(8, [1, 2, 4, 8], rho, 1.0, 1.0, 1.5)
    assert d.fallback and d.count == 8 and d.fraction == 1.0
    assert d.metrics(rho, 1.0, 1.0) == {
        "prompt_fraction": 1.0,
        "prompt_rule_fallback": 1.0,
        "predicted_step_ratio": 1.0,
        "predicted_compute_ratio": 1.0,
    }


@pytest.mark.parametrize("costs", [(None, 1.0), (1.0, None), (-1.0, 1.0), (0.0, 0.0), (math.nan, 1.0)])
def test_unusable_costs_fall_back(costs):
    assert choose_prompt_count(8, [1, 2, 4, 8], 0.1, *costs, 1.5).fallback


def test_step_cost_fit_recovers_both_terms():
    """y = a + b x + noise at two alternating sizes: the EW least squares finds (a, b); one size only fits through
    the origin (not identified); negative terms are clamped."""
    fit, generator = StepCostFit(), torch.Generator().manual_seed(0)
    for t in range(40):
        x = 1000.0 if t % 2 else 500.0
        fit.update(x, 2.0 + 0.004 * x + 0.01 * float(torch.randn((), generator=generator)))
    a, b = fit.fit()
    assert fit.identified() and a == pytest.approx(2.0, abs=0.1) and b == pytest.approx(0.004, rel=0.05)
    same = StepCostFit()
    for _ in range(5):
        same.update(1000.0, 6.0)
    assert not same.identified() and same.fit() == pytest.approx((0.0, 0.006))
    falling = StepCostFit()
    for x, y in ((500.0, 5.0), (1000.0, 4.0)) * 3:
        falling.update(x, y)
    a, b = falling.fit()
    assert b == 0.0 and a == pytest.approx(4.5, abs=0.1)
    restored = StepCostFit()
    restored.load_state_dict(fit.state_dict())
    assert restored.fit() == fit.fit()
    assert StepCostFit().fit() is None


# ---------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(cost_aware_prompt_fraction=0.0), "cost_aware_prompt_fraction must be a number in"),
        (dict(cost_aware_prompt_fraction=1.5), "cost_aware_prompt_fraction must be a number in"),
        (dict(cost_aware_prompt_fraction="some"), "cost_aware_prompt_fraction must be a number in"),
        (dict(cost_aware_max_step_ratio=0.9), "cost_aware_max_step_ratio"),
        (dict(cost_aware_generation_step_cost=-1.0), "cost_aware_generation_step_cost"),
        (dict(cost_aware_prompt_fraction=AUTO, cost_aware_prompt_sampling=True), "cost_aware_prompt_sampling"),
        (dict(cost_aware_prompt_fraction=0.5, cost_aware_layout="full"), "cost_aware_layout='full'"),
    ],
)
def test_config_refuses(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **overrides)


def test_a_group_split_over_ranks_is_refused(tmp_path):
    """2 rows per rank with groups of 4 (2 ranks: TRL accepts it, a group spans both ranks): no rank can leave a
    prompt out alone, so a fraction below 1 is refused, naming the fields (the check is called as the config calls
    it, with the world size TRL would see)."""
    args = make_args(tmp_path)
    args.per_device_train_batch_size, args.steps_per_generation = 2, 1
    args.cost_aware_prompt_fraction = 0.5
    with pytest.raises(ValueError, match=r"per_device_train_batch_size x steps_per_generation = 2 x 1 = 2"):
        check_prompt_fields(args)
    args.cost_aware_prompt_fraction = 1.0
    assert check_prompt_fields(args) == 1.0


def test_config_parses_and_warns(tmp_path):
    assert make_args(tmp_path, cost_aware_prompt_fraction="auto").cost_aware_prompt_fraction == AUTO
    assert make_args(tmp_path, cost_aware_prompt_fraction="0.5").cost_aware_prompt_fraction == 0.5
    # 16 rows = 8 groups of 2 per rank, 4 micro-steps: k must be even, so 0.9 (7.2 groups) keeps all 8, and says so
    with pytest.warns(UserWarning, match="rounds to every prompt"):
        make_args(
            tmp_path,
            cost_aware_prompt_fraction=0.9,
            num_generations=2,
            per_device_train_batch_size=4,
            steps_per_generation=4,
            gradient_accumulation_steps=4,
        )


# ---------------------------------------------------------------------------------------------------- trainer runs


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=0)


# one optimizer step (2 micro-steps of 8 rows) per generation batch of 16 rows = 4 groups
RUN = dict(max_steps=6, steps_per_generation=2, gradient_accumulation_steps=2)


def train(tiny_model_path, dataset, tmp_path, cls=CostAwareGRPOTrainer, **overrides):
    trainer = cls(
        tiny_model_path, [length_reward], args=make_args(tmp_path, **{**RUN, **overrides}), train_dataset=dataset
    )
    trainer.train()
    return trainer


def series(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


class Recording(CostAwareGRPOTrainer):
    """Records the inputs TRL is handed per training generation batch."""

    def _init_prompt_count(self):
        super()._init_prompt_count()
        self.handed = []

    def _select_prompts(self, inputs):
        chosen = super()._select_prompts(inputs)
        self.handed.append(chosen)
        return chosen


@pytest.mark.parametrize("cost_aware", [True, False])
def test_fixed_fraction_generates_half_the_prompts(tiny_model_path, dataset, tmp_path, cost_aware):
    """φ = 0.5: every training generation batch hands TRL 2 of its 4 groups, whole (G copies of one prompt), and the
    counters count half the rows of a full run; the rest of the step is TRL's at that batch size."""
    trainer = train(
        tiny_model_path, dataset, tmp_path, Recording, cost_aware=cost_aware, cost_aware_prompt_fraction=0.5
    )
    assert len(trainer.handed) == 6
    for handed in trainer.handed:
        prompts = [x["prompt"] for x in handed]
        assert len(prompts) == 8 and len(set(prompts)) == 2 and prompts[:4] == [prompts[0]] * 4
    totals = trainer._cost_aware_totals
    assert totals["rows_generated"] == 6 * 8
    assert totals["rows_kept"] == (6 * 4 if cost_aware else 6 * 8)  # the row sampler keeps half of what is generated
    assert series(trainer, "cost_aware/prompt_fraction") == [0.5] * 6
    assert not trainer._signals_on  # a fixed fraction measures nothing


@pytest.mark.parametrize("cost_aware", [True, False])
def test_auto_falls_back_probes_then_decides(tiny_model_path, dataset, tmp_path, cost_aware):
    """ "auto" (time model), noise probe off: every prompt until the noise scale has MIN_NOISE_PAIRS pairs (fallback
    1), with a probe at half the prompts on the second batch so that the generation-time fit sees two sizes; then
    predictions from the measured ρ and costs (fallback 0), in GRPO runs too. 9 generation batches."""
    trainer = train(
        tiny_model_path,
        dataset,
        tmp_path,
        Recording,
        cost_aware=cost_aware,
        cost_aware_prompt_fraction=AUTO,
        cost_aware_noise_probe_every=0,  # the consecutive steps' noise (the probe's path: tests/test_noise_probe.py)
        max_steps=9,
    )
    fallback = series(trainer, "cost_aware/prompt_rule_fallback")
    probes = series(trainer, "cost_aware/prompt_probe")
    fractions = series(trainer, "cost_aware/prompt_fraction")
    assert len(fallback) == len(probes) == len(fractions) == 9
    assert probes[:2] == [0.0, 1.0] and fractions[1] == 0.5 and len(trainer.handed[1]) == 8
    assert trainer._generation_fit.identified()
    assert all(f == 1.0 for f in fallback[: MIN_NOISE_PAIRS + 1])  # pairs start at the second step
    assert 0.0 in fallback[MIN_NOISE_PAIRS + 1 :]  # decided (where the signal estimate is positive: else ρ = ∞)
    assert trainer._noise.count >= MIN_NOISE_PAIRS
    decided = [row for row in trainer.state.log_history if row.get("cost_aware/prompt_rule_fallback") == 0.0]
    for row in decided:
        assert row["cost_aware/prompt_noise_to_signal"] > 0
        assert 0.0 <= row["cost_aware/step_cost_fixed_share"] <= 1.0
        assert row["cost_aware/predicted_steps_half"] == pytest.approx(
            predicted_step_ratio(row["cost_aware/prompt_noise_to_signal"], 0.5)
        )
        assert row["cost_aware/predicted_step_ratio"] <= 1.5 + 1e-9
        assert row["cost_aware/predicted_compute_ratio"] <= 1.0 + 1e-9


@pytest.mark.parametrize("rho", [math.nan, 0.0, -1.0, math.inf])
def test_degenerate_noise_estimate_trains_on_in_full(tiny_model_path, dataset, tmp_path, monkeypatch, rho):
    """A degenerate ρ (NaN, ≤ 0, ∞) after the noise scale has its pairs: every prompt, fallback 1 in the logs."""
    monkeypatch.setattr(CostAwareGRPOTrainer, "_full_batch_rho", lambda self: rho)
    trainer = train(
        tiny_model_path,
        dataset,
        tmp_path,
        cost_aware_prompt_fraction=AUTO,
        cost_aware_cost_model="tokens",
        max_steps=7,
    )
    assert trainer._noise.count >= MIN_NOISE_PAIRS
    assert series(trainer, "cost_aware/prompt_rule_fallback") == [1.0] * 7
    assert series(trainer, "cost_aware/prompt_fraction") == [1.0] * 7
    assert trainer._cost_aware_totals["rows_generated"] == 7 * 16


def test_tokens_model_cuts_where_the_noise_is_small(tiny_model_path, dataset, tmp_path, monkeypatch):
    """With a small measured ρ and no per-step cost the token model cuts to the step bound (here 1 of 4 groups:
    S ratio (1 + 0.1·4)/1.1 = 1.27 ≤ 1.5), and a per-step cost (`cost_aware_generation_step_cost`) stops the cut."""
    monkeypatch.setattr(CostAwareGRPOTrainer, "_full_batch_rho", lambda self: 0.1)
    cheap = train(
        tiny_model_path,
        dataset,
        tmp_path / "a",
        cost_aware_prompt_fraction=AUTO,
        cost_aware_cost_model="tokens",
        max_steps=7,
    )
    assert series(cheap, "cost_aware/prompt_fraction")[-1] == 0.25
    dear = train(
        tiny_model_path,
        dataset,
        tmp_path / "b",
        cost_aware_prompt_fraction=AUTO,
        cost_aware_cost_model="tokens",
        cost_aware_generation_step_cost=1e6,
        max_steps=7,
    )
    assert series(dear, "cost_aware/prompt_fraction")[-1] == 1.0
    assert series(dear, "cost_aware/prompt_rule_fallback")[-1] == 0.0


def test_rule_state_round_trips_through_a_checkpoint(tiny_model_path, dataset, tmp_path):
    """The checkpoint's state file holds the prompt stream, the probe counter, the generation-time fit and the cost
    averages; a fresh trainer that loads it has them all (and the next draw is the saved stream's)."""
    trainer = train(
        tiny_model_path,
        dataset,
        tmp_path,
        cost_aware_prompt_fraction=AUTO,
        max_steps=4,
        save_strategy="steps",
        save_steps=4,
    )
    checkpoint = os.path.join(trainer.args.output_dir, "checkpoint-4")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)
    fresh = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=copy.deepcopy(trainer.args), train_dataset=dataset
    )
    assert fresh._generation_fit.sums != trainer._generation_fit.sums
    fresh._load_cost_aware_state(checkpoint)
    assert fresh._prompt_batches == trainer._prompt_batches == 4
    assert fresh._generation_fit.sums == pytest.approx(trainer._generation_fit.sums)
    for a, b in zip(fresh._prompt_emas(), trainer._prompt_emas(), strict=True):
        assert (a.total, a.weight) == pytest.approx((b.total, b.weight))
    assert torch.equal(fresh._prompt_generator.get_state(), saved["prompt_generator"])
    assert draw_groups(8, 3, fresh._prompt_generator) == draw_groups(8, 3, trainer._prompt_generator)


# ---------------------------------------------------------------------------------------------------- device


@pytest.mark.parametrize("cost_aware", [True, False])
def test_prompt_rule_on_device(tiny_model_path, dataset, tmp_path, monkeypatch, cost_aware):
    """The rule's path on the emulated accelerator (tests/fake_device.py): the decision from host numbers (a measured
    ρ and costs set on the trainer), the draw of the groups, TRL's generation of those groups replayed on the
    device, then the sampler (cost_aware=True) or the counters (False). The rule adds no device→host transfer: 1 per
    generation batch in both arms, and no tensor of the batch leaves the device."""
    trainer = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        train_dataset=dataset,
        args=make_args(
            tmp_path, cost_aware=cost_aware, cost_aware_prompt_fraction=AUTO, cost_aware_max_step_ratio=3.0, **RUN
        ),
    )
    trainer.model.train()
    trainer._noise.noise, trainer._noise.signal, trainer._noise.count = 0.05, 1.0, MIN_NOISE_PAIRS
    for x, y in ((100.0, 0.3), (50.0, 0.2), (100.0, 0.3)):
        trainer._generation_fit.update(x, y)
    trainer._optimizer_cost.update(0.0)
    trainer._token_cost.update(1e-3)
    trainer._generated_full.update(100.0)
    trainer._policy_full.update(150.0)
    raw = [dataset[i // 4] for i in range(16)]  # 4 groups of 4 copies, as TRL's sampler lays them out
    state, batches = trainer._prompt_generator.get_state(), trainer._prompt_batches
    chosen = trainer._select_prompts(raw)
    assert len(chosen) < len(raw)  # the rule cuts on these numbers
    trainer._prompt_generator.set_state(state)
    trainer._prompt_batches = batches
    full = GRPOTrainer._generate_and_score_completions(trainer, chosen)
    monkeypatch.setattr(
        GRPOTrainer,
        "_generate_and_score_completions",
        lambda self, given: (
            {k: mark(v.clone()) if isinstance(v, torch.Tensor) else copy.copy(v) for k, v in full.items()}
            if given == chosen
            else pytest.fail("the rule drew other groups than the same stream did")
        ),
    )
    mode = NoFloat64Device()
    with mode:
        batch = trainer._generate_and_score_completions(raw)
        misplaced = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.device != FAKE]
    assert not misplaced, misplaced
    assert mode.transfers == 1, mode.transfers
    metrics = trainer._metrics["train"]
    assert metrics["cost_aware/prompt_rule_fallback"][-1] == 0.0
    assert metrics["cost_aware/prompt_fraction"][-1] == len(chosen) / len(raw)


# ------------------------------------------------------------------------------------------------ the row stage's b
def test_step_ratio_with_the_row_stages_noise_multiplier():
    """b = 1 + w I multiplies the noise at every fraction: S(φ)/S(1) = step_factor(ρb/φ) / step_factor(ρb); b = 1 is
    the ratio without the row stage; ρ = ∞ ignores b; b < 1 is refused."""
    rho, phi, b = 0.6, 0.25, 1.4
    assert predicted_step_ratio(rho, phi, "sgd", 1.0) == pytest.approx((1 + rho / phi) / (1 + rho))
    assert predicted_step_ratio(rho, phi, "sgd", b) == pytest.approx((1 + rho * b / phi) / (1 + rho * b))
    assert predicted_step_ratio(rho, phi, "adam", b) == pytest.approx(math.sqrt((1 + rho * b / phi) / (1 + rho * b)))
    assert predicted_step_ratio(math.inf, phi, "adam", b) == pytest.approx(1 / math.sqrt(phi))
    with pytest.raises(ValueError, match="base"):
        predicted_step_ratio(rho, phi, "adam", 0.5)


@settings(max_examples=40, deadline=None)
@given(
    rho=st.floats(0.01, 20.0),
    fixed=st.floats(0.0, 10.0),
    variable=st.floats(0.1, 10.0),
    bound=st.floats(1.05, 3.0),
    w=st.floats(0.0, 1.0),
    inflation=st.floats(0.0, 5.0),
)
def test_noisier_rows_raise_the_bounds_smallest_count(rho, fixed, variable, bound, w, inflation):
    """The more noise the row stage adds (b = 1 + w I), the more each fraction's step ratio grows (it rises with ρb
    toward 1/√φ), so the step bound's smallest allowed count never falls as b grows, and the rule stays above it."""
    allowed = list(range(1, 17))
    plain = choose_prompt_count(16, allowed, rho, fixed, variable, bound, "adam", 1.0)
    noisy = choose_prompt_count(16, allowed, rho, fixed, variable, bound, "adam", 1.0 + w * inflation)
    min_plain = min(k for k in allowed if predicted_step_ratio(rho, k / 16, "adam", 1.0) <= bound * (1 + 1e-12))
    min_noisy = min(
        k for k in allowed if predicted_step_ratio(rho, k / 16, "adam", 1.0 + w * inflation) <= bound * (1 + 1e-12)
    )
    assert min_noisy >= min_plain
    assert noisy.count >= min_noisy and plain.count >= min_plain
