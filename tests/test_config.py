"""`CostAwareGRPOConfig.__post_init__` refuses values the sampler cannot use, naming the field and what it allows."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trl_costaware import CostAwareGRPOConfig


def make(tmp_path, **kwargs):
    return CostAwareGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, **kwargs)


@pytest.mark.parametrize(
    "name,value,replacement",
    [
        ("cost_aware_full_micro_batches", True, "use cost_aware_layout='full'"),
        ("cost_aware_group_by_length", True, "use cost_aware_layout='even_by_length'"),
        ("cost_aware_seed", 3, "seeded by `seed`"),
        ("cost_aware_weight_floor", 0.0, "no replacement"),
        ("cost_aware_noise_scale_factor", 0.3, "no replacement"),
        ("cost_aware_noise_ema", 0.9, "NOISE_EMA"),
    ],
)
def test_removed_field_is_refused_naming_its_replacement(tmp_path, name, value, replacement):
    """A field the audit removed is refused at construction, with what replaces it, whatever its value."""
    with pytest.raises(ValueError, match=rf"{name} was removed: .*{re.escape(replacement)}"):
        make(tmp_path, **{name: value})
    assert name not in {f.name for f in dataclasses.fields(CostAwareGRPOConfig)}


@pytest.mark.parametrize("budget", [0.5, 0, -3, "100", True, 99.5])
def test_bad_token_budget_refused(tmp_path, budget):
    with pytest.raises(ValueError, match=r"cost_aware_token_budget must be a whole number of tokens >= 1"):
        make(tmp_path, cost_aware_token_budget=budget)


def test_whole_values_accepted_as_ints(tmp_path):
    args = make(tmp_path, cost_aware_token_budget=4096.0)
    assert args.cost_aware_token_budget == 4096 and type(args.cost_aware_token_budget) is int
    assert make(tmp_path, cost_aware_token_budget=1).cost_aware_token_budget == 1


def test_unknown_loss_type_refused_at_config_time(tmp_path, monkeypatch):
    """A loss type whose normaliser is not derived is refused by the config, before a model is named or loaded."""
    from trl import GRPOConfig

    original = GRPOConfig.__post_init__

    def accept_any_loss(self):  # as if TRL had added a new loss type
        loss_type, self.loss_type = self.loss_type, "grpo"
        original(self)
        self.loss_type = loss_type

    monkeypatch.setattr(GRPOConfig, "__post_init__", accept_any_loss)
    with pytest.raises(ValueError, match=r"loss_type='new_token_sum' is not supported with cost_aware=True"):
        make(tmp_path, loss_type="new_token_sum")
    assert make(tmp_path, loss_type="new_token_sum", cost_aware=False).loss_type == "new_token_sum"


# ---------------------------------------------------------------- the kept fraction's default and its interactions
def test_kept_fraction_defaults_to_half(tmp_path):
    """Unset, the kept fraction is 0.5, decided on the regime matrix (BENCHMARKS.md §6)."""
    from trl_costaware.config import DEFAULT_KEPT_FRACTION

    assert DEFAULT_KEPT_FRACTION == 0.5 and make(tmp_path).cost_aware_kept_fraction == 0.5


def test_unset_kept_fraction_with_a_token_budget_lets_the_budget_choose(tmp_path):
    args = make(tmp_path, cost_aware_token_budget=4096)
    assert args.cost_aware_kept_fraction is None and args.cost_aware_token_budget == 4096


def test_explicit_auto_with_a_token_budget_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cost_aware_kept_fraction='auto' and cost_aware_token_budget both"):
        make(tmp_path, cost_aware_kept_fraction="auto", cost_aware_token_budget=4096)


def test_fixed_fraction_with_a_token_budget_is_kept_and_the_budget_chooses(tmp_path):
    args = make(tmp_path, cost_aware_kept_fraction=0.5, cost_aware_token_budget=4096)
    assert args.cost_aware_kept_fraction == 0.5 and args.cost_aware_token_budget == 4096


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1, "half", "0", True])
def test_bad_kept_fraction_refused(tmp_path, value):
    with pytest.raises(ValueError, match=r"must be a number in \(0, 1\], 'auto' or 'compute'"):
        make(tmp_path, cost_aware_kept_fraction=value)


@pytest.mark.parametrize("value", ["0.25", "AUTO", 1])
def test_kept_fraction_from_text(tmp_path, value):
    expected = {"0.25": 0.25, "AUTO": "auto", 1: 1.0}[value]
    assert make(tmp_path, cost_aware_kept_fraction=value).cost_aware_kept_fraction == expected


def test_full_micro_batches_need_a_fixed_fraction(tmp_path):
    kw = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, cost_aware_layout="full")
    assert make(tmp_path, **kw).cost_aware_kept_fraction == 0.5  # unset: the default fraction
    for rule in ("auto", "compute"):
        with pytest.raises(ValueError, match=r"cost_aware_layout='full' needs a fixed cost_aware_kept"):
            make(tmp_path, cost_aware_kept_fraction=rule, **kw)
    args = make(tmp_path, cost_aware_kept_fraction=0.5, **kw)
    assert args.cost_aware_kept_fraction == 0.5
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.steps_per_generation) == (8, 1, 1)


def test_kept_fraction_parses_from_the_command_line(tmp_path):
    """HfArgumentParser / TrlParser call the field's annotation on the text: a number, 'auto', or unset."""
    from trl import TrlParser

    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none", "--bf16", "false"]
    (args,) = TrlParser((CostAwareGRPOConfig,)).parse_args_and_config(base)
    assert args.cost_aware_kept_fraction == 0.5
    for text, expected in (("0.25", 0.25), ("auto", "auto")):
        (args,) = TrlParser((CostAwareGRPOConfig,)).parse_args_and_config(base + ["--cost_aware_kept_fraction", text])
        assert args.cost_aware_kept_fraction == expected
