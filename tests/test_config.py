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
