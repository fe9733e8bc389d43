"""`make demo` (trl_costaware.scripts.demo): the target rule, tokens and compute to target, the summary of a tiny
run."""

import json

import pytest

from trl_costaware.scripts import demo


def _curve(accs, tokens_per_point=1000.0):
    return [{"step": 5 * i, "policy_tokens": tokens_per_point * i, "heldout_acc": a} for i, a in enumerate(accs)]


def test_target_is_start_plus_80_percent_of_grpo_improvement():
    target, why = demo.demo_target(_curve([0.40, 0.45, 0.50, 0.58, 0.60, 0.62]), n=512)
    assert target == pytest.approx(0.40 + 0.8 * (0.60 - 0.40))
    assert "80%" in why


def test_no_target_when_grpo_does_not_improve_beyond_noise():
    # +0.02 on 512 problems is below 2 standard errors of a difference (~0.06): no claim.
    target, why = demo.demo_target(_curve([0.40, 0.43, 0.38, 0.41, 0.42, 0.43]), n=512)
    assert target is None and "not above the noise" in why
    assert demo.tokens_to_target(_curve([0.4, 0.9]), None) is None


def test_tokens_to_target_first_crossing_interpolated():
    curve = _curve([0.40, 0.47, 0.52, 0.49, 0.60])
    assert demo.tokens_to_target(curve, 0.52) == pytest.approx(2000.0)
    assert demo.tokens_to_target(curve, 0.50) == pytest.approx(1000.0 + 1000.0 * 0.03 / 0.05)
    assert demo.tokens_to_target(curve, 0.40) == 0.0
    assert demo.tokens_to_target(curve, 0.61) is None


def _arm(policy_per_step, gen_per_step, accs, phase_s=None):
    curve = [
        {
            "step": 2 * i,
            "policy_tokens": 2 * i * policy_per_step,
            "generated_tokens": 2 * i * gen_per_step,
            "heldout_acc": a,
        }
        for i, a in enumerate(accs)
    ]
    steps = curve[-1]["step"]
    return {
        "curve": curve,
        "totals": {"policy_tokens": steps * policy_per_step, "generated_tokens": steps * gen_per_step},
        "phase_s": phase_s,
    }


def test_compute_prices_tokens_in_grpo_steps_at_gen55_and_the_measured_split():
    """One GRPO step costs 1 at every split; an arm that keeps half the policy tokens of the same rollouts costs
    s_gen + (1 − s_gen)/2 per step: 0.775 at generation 55%, and at the machine's split (GRPO's measured update share
    0.6: generation 40%) 0.7. Compute to target is read on the same curve as policy tokens."""
    from trl_costaware.tracking.compare.compute import GPU_VERL

    grpo = _arm(1000, 400, [0.5, 0.6, 0.7, 0.8], {"training_step": 10.0, "generate_and_score": 4.0})
    ca = _arm(500, 400, [0.5, 0.6, 0.7, 0.8])
    results = {"grpo": grpo, "cost_aware_grpo": ca}
    splits = demo.compute_splits(grpo)
    assert splits["gen55"] is GPU_VERL and splits["machine"].generation == pytest.approx(0.4)
    assert splits["machine"].update == pytest.approx(0.6) and splits["machine"].passes == 0
    demo.add_compute(results, splits)
    assert grpo["curve"][-1]["compute_gen55"] == pytest.approx(6.0)  # 6 steps
    assert ca["curve"][-1]["compute_gen55"] == pytest.approx(6 * 0.775)
    assert ca["curve"][-1]["compute_machine"] == pytest.approx(6 * 0.7)
    target = 0.75
    assert demo.tokens_to_target(ca["curve"], target, "compute_gen55") == pytest.approx(5 * 0.775)
    assert demo.tokens_to_target(ca["curve"], target) / demo.tokens_to_target(grpo["curve"], target) == 0.5
    # No phase timers (a run recorded without them): gen 55% only.
    assert list(demo.compute_splits({"phase_s": None})) == ["gen55"]


def test_summary_table_puts_compute_to_target_beside_policy_tokens(tmp_path, monkeypatch):
    """The table's columns, the ratio line (policy tokens and compute at both splits) and the figure's panels, from a
    summary built the way `run_demo` builds it (training replaced by fixed curves)."""
    grpo = _arm(1000, 400, [0.5, 0.6, 0.7, 0.8], {"training_step": 10.0, "generate_and_score": 4.0})
    ca = _arm(500, 400, [0.5, 0.6, 0.7, 0.8])
    for r in (grpo, ca):
        r.update(heldout_acc_start=0.5, heldout_acc_end=0.8, greedy_acc_start=0.9, greedy_acc_end=0.9, train_wall_s=1)
    runs = iter([grpo, ca])
    monkeypatch.setattr("trl_costaware.embedded.testbed.train_run", lambda **kw: next(runs))
    panels = []
    real_subplots = __import__("matplotlib.pyplot", fromlist=["subplots"]).subplots

    def spy(*args, **kwargs):
        fig, axes = real_subplots(*args, **kwargs)
        panels.append(axes)
        return fig, axes

    monkeypatch.setattr("matplotlib.pyplot.subplots", spy)
    summary = demo.run_demo(steps=6, output_dir=str(tmp_path), eval_n=512, progress=False)
    arm = summary["arms"]["cost_aware_grpo"]
    assert set(arm["compute_to_target"]) == {"gen55", "machine"}
    assert arm["compute"]["gen55"] == pytest.approx(6 * 0.775)
    labels = [ax.get_xlabel() for ax in panels[0][0]]
    assert labels[0].startswith("policy-optimisation tokens") and all("compute" in x for x in labels[1:])
    assert len(labels) == 3 and "generation 55%" in panels[0][0][1].get_title()
    assert "generation 40%" in panels[0][0][2].get_title()
    text = demo.format_summary(summary)
    header = next(line for line in text.splitlines() if line.startswith("| arm"))
    assert (
        "| policy tokens to target | compute to target (gen 55%) | compute to target (this machine, gen 40%) |"
        in header
    )
    assert (
        "0.50x GRPO's policy tokens, 0.78x its compute at gen 55%, 0.70x its compute at this machine, gen 40%" in text
    )
    assert json.loads((tmp_path / "summary.json").read_text())["compute_splits"]["gen55"]["generation"] == 0.55


@pytest.mark.slow
def test_demo_summary_of_a_tiny_run(tmp_path, tiny_model_path):
    out = tmp_path / "demo"
    summary = demo.run_demo(
        steps=2,
        seed=0,
        output_dir=str(out),
        eval_every=1,
        eval_n=16,
        settings={"per_device_train_batch_size": 32, "num_generations": 8},
        progress=False,
        model_path=tiny_model_path,
    )
    on_disk = json.loads((out / "summary.json").read_text())
    assert set(on_disk["arms"]) == {"grpo", "cost_aware_grpo"}
    for arm in on_disk["arms"].values():
        for key in ("heldout_accuracy_start", "heldout_accuracy_end", "policy_tokens", "tokens_to_target"):
            assert key in arm
        assert set(arm["compute_to_target"]) == {"gen55", "machine"}  # the GRPO arm's phases were timed
        assert 0.0 <= arm["heldout_accuracy_start"] <= 1.0 and 0.0 <= arm["heldout_accuracy_end"] <= 1.0
        assert [p["step"] for p in arm["curve"]] == [0, 1, 2]
        tokens = [p["policy_tokens"] for p in arm["curve"]]
        assert tokens[0] == 0 and tokens == sorted(tokens) and tokens[-1] == arm["policy_tokens"] > 0
    grpo, ca = on_disk["arms"]["grpo"], on_disk["arms"]["cost_aware_grpo"]
    assert ca["policy_tokens"] < grpo["policy_tokens"]  # same rollouts, about half of them trained on
    assert grpo["heldout_accuracy_start"] == ca["heldout_accuracy_start"]  # same checkpoint, same held-out draw
    # The random model does not learn in 2 steps: no target, so no tokens-to-target claim.
    assert on_disk["target"] is None and grpo["tokens_to_target"] is None and ca["tokens_to_target"] is None
    assert (out / "heldout_accuracy.png").stat().st_size > 1000
    text = demo.format_summary(summary)
    assert "No tokens-to-target claim" in text and "no target" in text
    assert "compute to target (gen 55%)" in text and "compute to target (this machine, gen " in text


@pytest.mark.slow
def test_demo_on_the_long_testbed_records_phases_and_padding(tmp_path, tiny_model_path):
    """`make demo-long`'s code path on a tiny run: the long recipe's 8 micro-batches per generation batch (here 2 of
    8 rows), the counting task and its cap, the phase timers and padded-token counters the benchmarks read."""
    from trl_costaware.embedded.testbed import train_run

    out = tmp_path / "demo-long"
    small = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_generation": 2}
    summary = demo.run_demo(
        steps=1,
        seed=0,
        output_dir=str(out),
        eval_every=1,
        eval_n=8,
        settings={**small, "num_generations": 4, "max_completion_length": 16},
        progress=False,
        model_path=tiny_model_path,
        testbed="long",
    )
    assert summary["testbed"] == "long" and "long testbed" in demo.format_summary(summary)
    run = train_run(
        seed=0,
        output_dir=str(tmp_path / "run"),
        steps=1,
        settings={**small, "num_generations": 4, "max_completion_length": 16, "cost_aware": True},
        eval_every=1,
        eval_n=8,
        model_path=tiny_model_path,
        testbed="long",
    )
    assert run["testbed"] == "long"
    assert run["phase_s"]["training_step"] > run["phase_s"]["generate_and_score"] > 0
    assert run["totals"]["policy_tokens_padded"] >= run["totals"]["policy_tokens"] > 0
    assert 0 < run["batch_metrics"]["kept_row_fraction"] <= 0.5 + 1e-9
    assert 0 < run["batch_metrics"]["j_ratio_ideal"] <= run["batch_metrics"]["j_ratio_achieved"] + 1e-9
