"""`CostAwareGRPOConfig.__post_init__` refuses values the sampler cannot use, naming the field and what it allows."""

from __future__ import annotations

import pytest

from trl_costaware import CostAwareGRPOConfig


def make(tmp_path, **kwargs):
    return CostAwareGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, **kwargs)


@pytest.mark.parametrize("seed", ["x", 1.5, -1, True])
def test_bad_sampler_seed_refused(tmp_path, seed):
    with pytest.raises(ValueError, match=r"cost_aware_seed must be a whole number >= 0 or None"):
        make(tmp_path, cost_aware_seed=seed)


@pytest.mark.parametrize("budget", [0.5, 0, -3, "100", True, 99.5])
def test_bad_token_budget_refused(tmp_path, budget):
    with pytest.raises(ValueError, match=r"cost_aware_token_budget must be a whole number of tokens >= 1"):
        make(tmp_path, cost_aware_token_budget=budget)


def test_whole_values_accepted_as_ints(tmp_path):
    args = make(tmp_path, cost_aware_seed=3.0, cost_aware_token_budget=4096.0)
    assert (args.cost_aware_seed, args.cost_aware_token_budget) == (3, 4096)
    assert type(args.cost_aware_seed) is int and type(args.cost_aware_token_budget) is int
    args = make(tmp_path, cost_aware_seed=0, cost_aware_token_budget=1)
    assert (args.cost_aware_seed, args.cost_aware_token_budget) == (0, 1)


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
