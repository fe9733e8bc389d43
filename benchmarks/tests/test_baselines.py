"""The token-efficiency benchmark's baselines (benchmarks/baselines.py): the row rules, and the trainers on a tiny
model (the zero-advantage filter must give exactly GRPO's update); and its analysis on synthetic curves."""

import itertools

import pytest
import torch
from baselines import (
    MaxVarianceTrainer,
    ZeroAdvantageFilterTrainer,
    group_advantages,
    max_variance_subset,
    zero_advantage_filter,
)


def test_zero_advantage_filter():
    a = torch.tensor([0.0, 1.2, -0.5, 0.0, 3.0])
    assert zero_advantage_filter(a).tolist() == [1, 2, 4]
    assert zero_advantage_filter(torch.zeros(4)).tolist() == [0]  # nothing informative: one row, no gradient
    # steps_per_generation = 4: padded to 4 rows with the cheapest zero-advantage row (no gradient, still exact)
    costs = torch.tensor([9.0, 5.0, 5.0, 2.0, 7.0])
    assert zero_advantage_filter(a, 4, costs).tolist() == [1, 2, 3, 4]
    assert zero_advantage_filter(a, 4).tolist() == [0, 1, 2, 4]
    assert zero_advantage_filter(torch.zeros(8), 4, torch.arange(8.0, 0, -1)).tolist() == [4, 5, 6, 7]
    assert zero_advantage_filter(torch.tensor([1.0, -1.0, 0.0, 0.0]), 2).tolist() == [0, 1]


@pytest.mark.parametrize("seed", range(30))
def test_max_variance_subset_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    g = int(torch.randint(2, 9, (1,), generator=gen))
    rewards = torch.randint(0, 2, (g,), generator=gen).float() if seed % 2 else torch.rand(g, generator=gen)
    for m in range(1, g + 1):
        idx = max_variance_subset(rewards, m)
        assert len(idx) == m and len(set(idx.tolist())) == m and idx.tolist() == sorted(idx.tolist())
        best = max(float(rewards[list(c)].var(unbiased=False)) for c in itertools.combinations(range(g), m))
        assert float(rewards[idx].var(unbiased=False)) == pytest.approx(best, abs=1e-9)


def test_max_variance_subset_binary_keeps_a_balanced_mix():
    rewards = torch.tensor([1.0, 0, 0, 0, 0, 0, 1, 0])
    idx = max_variance_subset(rewards, 4)
    assert sorted(rewards[idx].tolist()) == [0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="need 1 <= m"):
        max_variance_subset(rewards, 9)


def test_group_advantages_is_trl_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.allclose(group_advantages(r), (r - r.mean()) / (r.std() + 1e-4))
    assert torch.equal(group_advantages(torch.ones(3)), torch.zeros(3))


# ---------------------------------------------------------------------------------------------------------------------
# Trainers (tiny random model, one or two steps)


def parity_reward(completions, num_terms, **kwargs):
    """1 for an even-length completion of a problem with 3 or more terms, 0 otherwise: a random model gets reward
    variance in most groups of long problems and none in the groups of short ones."""
    return [float(len(c) % 2 == 0 and k >= 3) for c, k in zip(completions, num_terms, strict=True)]


def _trainer(cls, tmp_path, name, tiny_model_path, **overrides):
    from testing_utils import make_trainer

    settings = dict(
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        loss_type="dapo",
        beta=0.0,
        disable_tqdm=True,
    )
    return make_trainer(
        tiny_model_path, tmp_path / name, cls=cls, rewards=[parity_reward], **{**settings, **overrides}
    )


LAYOUTS = {
    "one_micro_batch": {},
    "spg2_ga2": {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "steps_per_generation": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_advantage_filter_is_exactly_grpo(tmp_path, tiny_model_path, layout):
    """Same seed, same rollouts: the filter's update equals GRPO's (plain SGD, so the update is the gradient), with
    one micro-batch per generation batch and with two (the kept rows padded to a multiple of 2)."""
    from transformers import AutoModelForCausalLM

    from trl_costaware import CostAwareGRPOTrainer

    start = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    sgd = {"optim": "sgd", "learning_rate": 1.0, "max_grad_norm": 0.0, **LAYOUTS[layout]}
    grpo = _trainer(CostAwareGRPOTrainer, tmp_path, "grpo", tiny_model_path, cost_aware=False, **sgd)
    grpo.train()
    filt = _trainer(ZeroAdvantageFilterTrainer, tmp_path, "filter", tiny_model_path, cost_aware=True, **sgd)
    filt.train()
    kept = filt._cost_aware.totals["rows_kept"] / filt._cost_aware.totals["rows_generated"]
    assert 0 < kept < 1  # some groups had equal rewards and were dropped
    assert filt._cost_aware.totals["policy_tokens"] < grpo._cost_aware.totals["policy_tokens"]
    a, b = grpo.model.state_dict(), filt.model.state_dict()
    step_a = {k: a[k] - start[k] for k in a}
    scale = max(float(v.abs().max()) for v in step_a.values())
    assert scale > 0
    diff = max(float((step_a[k] - (b[k] - start[k])).abs().max()) for k in a)
    assert diff <= 1e-4 * scale, (diff, scale)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_max_variance_trainer_keeps_half_of_each_group(tmp_path, tiny_model_path, layout):
    trainer = _trainer(
        MaxVarianceTrainer,
        tmp_path,
        "pods",
        tiny_model_path,
        cost_aware=True,
        cost_aware_kept_fraction=0.5,
        **LAYOUTS[layout],
    )
    trainer.train()
    totals = trainer._cost_aware.totals
    assert totals["rows_generated"] == 32 and totals["rows_kept"] == 16
    logs = [h for h in trainer.state.log_history if "cost_aware/kept_row_fraction" in h]
    assert logs and logs[0]["cost_aware/kept_row_fraction"] == 0.5


def test_baselines_refuse_what_they_cannot_do(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="needs cost_aware=True"):
        _trainer(ZeroAdvantageFilterTrainer, tmp_path, "x", tiny_model_path, cost_aware=False)
    with pytest.raises(ValueError, match="beta=0"):
        _trainer(ZeroAdvantageFilterTrainer, tmp_path, "y", tiny_model_path, cost_aware=True, beta=0.1)


# ---------------------------------------------------------------------------------------------------------------------
# The token-efficiency analysis (benchmarks/token_efficiency.py) on synthetic curves


def _run(accs, tokens_per_step, seed, steps_per_point=4):
    curve = [
        {
            "step": steps_per_point * i,
            "policy_tokens": tokens_per_step * steps_per_point * i,
            "generated_tokens": 100.0 * steps_per_point * i,
            "wall_s": 1.0 * steps_per_point * i,
            "heldout_acc": a,
        }
        for i, a in enumerate(accs)
    ]
    return {
        "seed": seed,
        "curve": curve,
        "heldout_acc_start": accs[0],
        "greedy_acc_start": 0.9,
        "greedy_acc_end": 0.9,
        "totals": {"policy_tokens": curve[-1]["policy_tokens"], "generated_tokens": curve[-1]["generated_tokens"]},
        "train_wall_s": curve[-1]["wall_s"],
    }


def test_analysis_halves_tokens_for_an_arm_learning_as_fast_per_step_on_half_the_tokens():
    import token_efficiency as te

    rising = [0.5, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9]
    runs = {
        "grpo": {s: _run(rising, 100.0, s) for s in range(4)},
        "cost_aware_0.5": {s: _run(rising, 50.0, s) for s in range(4)},
    }
    res = te.analyse(runs)
    assert res["target"] == pytest.approx(0.5 + 0.8 * 0.4)
    ratio = res["arms"]["cost_aware_0.5"]["ratio_vs_grpo"]["policy_tokens"]
    assert ratio["n"] == 4 and ratio["ci"][0] == pytest.approx(0.5)
    assert res["arms"]["cost_aware_0.5"]["ratio_vs_grpo"]["step"]["ci"][0] == pytest.approx(1.0)
    assert "| cost_aware_0.5 | 4 | 4/4 | 0.50" in te.markdown(res, "cmd")


def test_analysis_claims_nothing_when_grpo_does_not_improve():
    import token_efficiency as te

    flat = {s: _run([0.5, 0.52, 0.49, 0.51, 0.48, 0.5, 0.5], 100.0, s) for s in range(4)}
    flat[1] = _run([0.5, 0.5, 0.51, 0.5, 0.52, 0.53, 0.51], 100.0, 1)
    noisy = [0.5, 0.55, 0.5, 0.53, 0.5, 0.51, 0.5]
    runs = {"grpo": flat, "cost_aware_0.5": {s: _run(noisy, 50.0, s) for s in range(4)}}
    res = te.analyse(runs)
    assert res["target"] is None and "no tokens-to-target" in res["target_rule"]
    assert res["arms"]["cost_aware_0.5"]["ratio_vs_grpo"]["policy_tokens"]["n"] == 0
    assert "none: GRPO's improvement" in te.markdown(res, "cmd")


def test_compute_to_target_on_the_committed_runs():
    """`token_efficiency.py --compute-to-target`, from the committed per-seed rows: each arm's
    break-even is 1 / its step cost under the split; GRPO on half the prompts halves every phase, so its compute ratio
    equals its policy-token ratio under every split; and no arm run with recentred weights from before the recentring
    fix (scaled by the bug) is used."""
    import token_efficiency as te

    from trl_costaware.tracking.compare.compute import GPU_VERL, cpu_split, step_cost

    res = te.compute_to_target()
    for tb, t in res["testbeds"].items():
        assert all(a["file"] in te.CT_POST_FIX_NAMES for n, a in t["arms"].items() if "recenter" in n), tb
        cpu = cpu_split(t["splits"]["cpu"]["update"])
        for arm, a in t["arms"].items():
            f = a["kept_token_fraction"][0]
            if arm != "grpo_half":
                assert a["break_even_gpu"][0] == pytest.approx(1 / step_cost(f, GPU_VERL), rel=0.03)
                assert a["break_even_cpu"][0] == pytest.approx(1 / step_cost(f, cpu), rel=0.03)
        half = t["arms"]["grpo_half"]
        for s in te.CT_SPLIT_KEYS:
            assert half[f"ratio_compute_{s}"][0] == pytest.approx(half["ratio_policy_tokens"][0], rel=0.02)
        assert half["ratio_compute_phase"][0] is None  # the phase figure assumes the same generation per step
