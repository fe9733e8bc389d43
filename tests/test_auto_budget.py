"""The adaptive budget (`cost_aware_kept_fraction="auto"`) and the loss-aware proxy in the trainer: configuration,
the m rule on a real generation batch, the proxy's distribution, Monte Carlo unbiasedness (docs/budget_and_proxy.md).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_unbiased import (
    CHEAP_DRAWS,
    OPTIONS,
    TOLERANCE,
    _detects_5_percent,
    _weights_forced_to_one,
    fixed_case,
    make_trainer,
    run_case,
)
from transformers import HfArgumentParser

from trl_costaware import CostAwareGRPOConfig
from trl_costaware.core.sampling import capped_kept_count, eligible_rows, sampling_distribution
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.kept_count.budget import smallest_budget, variance_inflation
from trl_costaware.rows import plan as plan_module
from trl_costaware.rows.proxy import DEFAULT_GAMMA

BASE = dict(output_dir="unused", use_cpu=True, report_to="none", per_device_train_batch_size=8, num_generations=4)


# ---------------------------------------------------------------- configuration
def test_auto_and_delta_are_accepted():
    args = CostAwareGRPOConfig(
        **BASE, cost_aware_kept_fraction="auto", cost_aware_budget_delta=0.25, cost_aware_proxy="loss_aware"
    )
    assert args.cost_aware_kept_fraction == "auto" and args.cost_aware_budget_delta == 0.25
    assert CostAwareGRPOConfig(**BASE, cost_aware_kept_fraction="0.25").cost_aware_kept_fraction == 0.25


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"cost_aware_kept_fraction": "half"}, "cost_aware_kept_fraction"),
        ({"cost_aware_kept_fraction": 1.5}, "cost_aware_kept_fraction"),
        ({"cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": -0.1}, "cost_aware_budget_delta"),
        ({"cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": math.inf}, "cost_aware_budget_delta"),
        ({"cost_aware_kept_fraction": "auto", "cost_aware_token_budget": 100}, "cost_aware_token_budget"),
        ({"cost_aware_proxy": "loss"}, "cost_aware_proxy"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        CostAwareGRPOConfig(**BASE, **overrides)


def test_auto_parses_from_the_command_line(tmp_path):
    parser = HfArgumentParser(CostAwareGRPOConfig)
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--num_generations", "4"]
    args = parser.parse_args_into_dataclasses([*argv, "--cost_aware_kept_fraction", "auto"])[0]
    assert args.cost_aware_kept_fraction == "auto"
    assert (
        parser.parse_args_into_dataclasses([*argv, "--cost_aware_kept_fraction", "0.3"])[0].cost_aware_kept_fraction
        == 0.3
    )


# ---------------------------------------------------------------- the m rule on a real batch
@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=3)


def _recorded_draws(monkeypatch):
    seen = []
    original = plan_module.draw_rows

    def recorded(p, m, scheme, *args, **kwargs):
        out = original(p, m, scheme, *args, **kwargs)
        seen.append((p.clone(), m))
        return out

    monkeypatch.setattr(plan_module, "draw_rows", recorded)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("micro", [1, 2])
def test_auto_keeps_the_smallest_m_within_delta(warm_model_path, dataset, tmp_path, monkeypatch, micro):
    """On a frozen generation batch the trainer keeps exactly `smallest_budget`'s m (capped as usual), logs its
    predicted inflation (≤ δ), and keeps more rows for a smaller δ."""
    kept = {}
    for delta in (0.1, 0.5, 2.0):
        trainer = make_trainer(
            warm_model_path,
            dataset,
            tmp_path / str(delta),
            micro=micro,
            cost_aware_kept_fraction="auto",
            cost_aware_budget_delta=delta,
        )
        case = fixed_case(trainer, dataset, monkeypatch)
        seen = _recorded_draws(monkeypatch)
        trainer._prepare_inputs(case.raw)
        p, m = seen[-1]
        rows = trainer._host_row_stats(case.full)
        eligible = eligible_rows(rows["advantages"], rows["loss_tokens"], False)
        expected = sampling_distribution(rows["advantages"].abs() / rows["costs"].sqrt(), 0.2, support=eligible)
        torch.testing.assert_close(p, expected)
        g = rows["advantages"].abs() * eligible
        want, _ = smallest_budget(g, p, delta, micro)
        assert m == capped_kept_count(want, int(eligible.sum()), micro)
        logged = trainer._metrics["train"]["cost_aware/budget_inflation"][-1]
        assert logged == pytest.approx(variance_inflation(g, p, m))
        assert logged <= delta + 1e-12
        kept[delta] = m
        monkeypatch.undo()
    assert kept[0.1] >= kept[0.5] >= kept[2.0]
    assert kept[0.1] > kept[2.0]


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_loss_aware_proxy_samples_by_length_and_loss_type(warm_model_path, dataset, tmp_path, monkeypatch, loss_type):
    """The draw's distribution is ∝ |A_i| L_i^e / √c_i on the eligible rows, e = γ (dapo) or γ − 1 (grpo)."""
    trainer = make_trainer(
        warm_model_path,
        dataset,
        tmp_path,
        loss_type=loss_type,
        cost_aware_proxy="loss_aware",
        cost_aware_smoothing=0.0,
    )
    case = fixed_case(trainer, dataset, monkeypatch)
    seen = _recorded_draws(monkeypatch)
    trainer._prepare_inputs(case.raw)
    p, _ = seen[-1]
    adv = case.full["advantages"].double().abs()
    length = case.full["completion_mask"].sum(-1).double()
    costs = length + case.full["prompt_mask"].sum(-1).double()
    e = DEFAULT_GAMMA - (1.0 if loss_type == "grpo" else 0.0)
    expected = adv * length.clamp(min=1).pow(e) * (length > 0) / costs.sqrt()
    torch.testing.assert_close(p, expected / expected.sum(), rtol=1e-5, atol=1e-7)
    assert len(set(length.tolist())) > 1  # the length factor is exercised


# ---------------------------------------------------------------- Monte Carlo unbiasedness
AUTO_CASES = [
    pytest.param("grpo", 1, {}, id="grpo-micro1-auto"),
    pytest.param("dapo", 2, {}, id="dapo-micro2-auto"),
    pytest.param("bnpo", 2, {}, id="bnpo-micro2-auto"),
    pytest.param("dapo", 2, {"cost_aware_proxy": "loss_aware"}, id="dapo-micro2-auto-loss_aware"),
    pytest.param("grpo", 2, {"cost_aware_proxy": "loss_aware"}, id="grpo-micro2-auto-loss_aware"),
    # with replacement I(m) = (Σ G²/p / Σ G² − 1)/m never reaches 0: a looser δ so that m < N
    pytest.param(
        "dapo", 2, {"cost_aware_draw": "multinomial", "cost_aware_budget_delta": 4.0}, id="dapo-micro2-auto-mn"
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "micro", "options"), AUTO_CASES)
def test_auto_budget_is_unbiased(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, micro, options):
    """m depends on the batch, not on the draw, so the estimate stays unbiased given m (the control-variate statistic
    of tests/test_unbiased.py, which reads the design from the recorded draw)."""
    trainer = make_trainer(
        warm_model_path,
        dataset,
        tmp_path,
        loss_type=loss_type,
        micro=micro,
        **{"cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": 1.0, **options},
    )
    case = fixed_case(trainer, dataset, monkeypatch)
    r = run_case(case, CHEAP_DRAWS)
    assert _detects_5_percent(r), r
    assert not r.biased(TOLERANCE), r
    fractions = trainer._metrics["train"]["cost_aware/kept_row_fraction"]
    assert fractions and max(fractions) < 1.0  # rows were dropped: the test is not a full-batch copy


# "auto" is the default kept fraction, so it gets the TRL options of the fixed-fraction matrix (tests/test_unbiased.py
# OPTIONS): the truncation mask, β > 0 with a perturbed reference, steps_per_generation = 2 × GA over a whole
# generation batch, and the second pass of num_iterations = 2; each with a weights-forced-to-1 control.
AUTO_OPTION_CASES = [
    pytest.param(lt, name, id=f"{lt}-micro2-auto-{name}")
    for name in ("truncation_mask", "beta_perturbed_reference", "spg_2x_ga", "num_iterations_2_second")
    for lt in ("grpo", "dapo")
]


def _auto_trainer(warm_model_path, dataset, tmp_path, loss_type, name):
    return make_trainer(
        warm_model_path,
        dataset,
        tmp_path,
        loss_type=loss_type,
        micro=2,
        **{**OPTIONS[name], "cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": 1.0},
    )


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "name"), AUTO_OPTION_CASES)
def test_auto_budget_is_unbiased_with_trl_options(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, name):
    trainer = _auto_trainer(warm_model_path, dataset, tmp_path, loss_type, name)
    case = fixed_case(trainer, dataset, monkeypatch)
    if name == "truncation_mask":
        assert (case.full["completion_mask"].sum(-1) == 0).any()  # some rows are truncated, their loss mask empty
    r = run_case(case, CHEAP_DRAWS)
    assert _detects_5_percent(r), r
    assert not r.biased(TOLERANCE), r
    fractions = trainer._metrics["train"]["cost_aware/kept_row_fraction"]
    assert fractions and max(fractions) < 1.0  # rows were dropped: the test is not a full-batch copy


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, "spg_2x_ga", "beta_perturbed_reference"])
def test_auto_budget_weights_one_control_fails(warm_model_path, dataset, tmp_path, monkeypatch, name):
    """The same statistic flags `auto` with every weight forced to 1 (without the control the test proves nothing)."""
    if name is None:
        trainer = make_trainer(
            warm_model_path, dataset, tmp_path, micro=2, cost_aware_kept_fraction="auto", cost_aware_budget_delta=1.0
        )
    else:
        trainer = _auto_trainer(warm_model_path, dataset, tmp_path, "grpo", name)
    _weights_forced_to_one(monkeypatch, trainer)
    r = run_case(fixed_case(trainer, dataset, monkeypatch), CHEAP_DRAWS)
    assert r.biased(TOLERANCE), r


# ---------------------------------------------------------------- with the truncation mask (issue 20, item 1)
@pytest.mark.slow
def test_auto_with_truncation_mask_keeps_dropping_rows(tiny_model_path, tmp_path):
    """`auto` with mask_truncated_completions and a cap that truncates: a truncated row (|A| > 0, no loss token) used
    to
    make every m look infinitely noisy (it kept all eligible rows and logged inflation inf on every step)."""
    from test_trainer import last_metric, length_reward, make_args

    from trl_costaware import CostAwareGRPOTrainer

    args = make_args(
        tmp_path,
        max_completion_length=6,
        mask_truncated_completions=True,
        per_device_train_batch_size=16,
        max_steps=3,
        cost_aware_kept_fraction="auto",
        cost_aware_budget_delta=1.0,
    )
    trainer = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=args, train_dataset=arithmetic_dataset(64, seed=0)
    )
    truncated = []
    original = trainer._host_row_stats

    def recorded(batch):
        rows = original(batch)
        truncated.append(int(((rows["loss_tokens"] == 0) & (rows["advantages"] != 0)).sum()))
        return rows

    trainer._host_row_stats = recorded
    trainer.train()
    assert sum(truncated) > 0  # the cap did truncate rows that have an advantage
    inflation = [
        r["cost_aware/budget_inflation"] for r in trainer.state.log_history if "cost_aware/budget_inflation" in r
    ]
    kept = [r["cost_aware/batch_rows_kept"] for r in trainer.state.log_history if "cost_aware/batch_rows_kept" in r]
    eligible = [
        r["cost_aware/eligible_fraction"] * 16
        for r in trainer.state.log_history
        if "cost_aware/eligible_fraction" in r
    ]
    assert inflation and all(math.isfinite(i) and i <= 1.0 + 1e-9 for i in inflation), inflation
    assert any(k < e for k, e in zip(kept, eligible, strict=True)), (kept, eligible)
    assert last_metric(trainer, "cost_aware/kept_row_fraction") < 1.0


def test_auto_parses_from_a_yaml_recipe(tmp_path):
    """The training script's parser (TrlParser): `cost_aware_kept_fraction: auto` in a YAML recipe and on the command
    line."""
    import yaml

    from trl_costaware.scripts.train import parse_args

    recipe = tmp_path / "auto.yaml"
    recipe.write_text(yaml.safe_dump({"cost_aware_kept_fraction": "auto", "cost_aware_budget_delta": 0.5}))
    args = parse_args(["--config", str(recipe), "--output_dir", str(tmp_path), "--use_cpu", "true"])[1]
    assert args.cost_aware_kept_fraction == "auto" and args.cost_aware_budget_delta == 0.5
    args = parse_args(["--output_dir", str(tmp_path), "--use_cpu", "true", "--cost_aware_kept_fraction", "auto"])[1]
    assert args.cost_aware_kept_fraction == "auto" and args.cost_aware_budget_delta == 1.0
