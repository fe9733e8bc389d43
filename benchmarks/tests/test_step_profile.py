"""benchmarks/step_profile.py: the shipped model shapes, the phase profiler, and one real CPU run of every arm."""

from __future__ import annotations

import json
import time

import pytest


@pytest.fixture(scope="module")
def step_profile():
    import step_profile

    return step_profile


@pytest.mark.parametrize("name, millions", [("qwen2.5-0.5b", 494.0), ("qwen2.5-1.5b", 1543.7)])
def test_shipped_configs_have_the_real_shapes(step_profile, name, millions):
    """Qwen2.5-0.5B has 494M parameters and -1.5B 1.54B (tied embeddings): built on the meta device, no weights."""
    import torch

    with torch.device("meta"):
        model, tokenizer = step_profile.build_model(name, torch.bfloat16)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.1)
    assert model.config.eos_token_id == tokenizer.eos_token_id and model.config.vocab_size == len(tokenizer) == 151936


def test_profiler_times_are_exclusive(step_profile):
    profiler = step_profile.PhaseProfiler(cuda=False)
    profiler.step = 1
    with profiler.phase("policy forward+backward", tokens=10):
        time.sleep(0.02)
        with profiler.phase("old/ref log-probs", tokens=4):
            time.sleep(0.05)
    profiler.step_time[1] = 0.1
    summary = profiler.summary(warmup=0)["phases"]
    outer, inner = summary["policy forward+backward"], summary["old/ref log-probs"]
    assert 0.015 < outer["seconds_per_step"] < 0.045  # the nested 50 ms are not counted twice
    assert 0.045 < inner["seconds_per_step"] < 0.08
    assert outer["tokens_per_step"] == 10
    assert inner["tokens_per_second"] == pytest.approx(4 / inner["seconds_per_step"])
    other = summary["other"]["seconds_per_step"]
    assert other == pytest.approx(0.1 - outer["seconds_per_step"] - inner["seconds_per_step"])
    assert inner["peak_memory_gib"] > 0  # RSS on CPU


@pytest.mark.slow
def test_tiny_cpu_run_all_arms(step_profile, tmp_path, capsys):
    out = tmp_path / "profile"
    args = ["--config", "tiny", "--steps", "2", "--rollouts", "16", "--num-generations", "4", "--micro-batch", "8"]
    args += ["--max-completion-length", "24", "--prompt-length", "16", "--beta", "0.04", "--out", str(out)]
    result = step_profile.main([*args, "--device", "cpu", "--workdir", str(tmp_path / "work")])
    assert [a["arm"] for a in result["arms"]] == ["grpo", "cost_aware", "cost_aware_recenter", "cost_aware_even"]
    grpo, cost_aware, _, even = result["arms"]
    assert (grpo["micro_batches_per_step"], grpo["rows_per_micro_batch"]) == (2, 8)
    assert (cost_aware["micro_batches_per_step"], cost_aware["rows_per_micro_batch"]) == (2, 4)
    # even: the same sample under TRL's split, the same kept tokens
    assert even["totals"]["rows_kept"] == even["totals"]["rows_generated"] / 2 == 16 * 2 / 2
    assert even["totals"]["policy_tokens"] == cost_aware["totals"]["policy_tokens"]
    for arm in result["arms"]:
        phases = arm["phases"]
        assert arm["steps_measured"] == [1]  # step 0 is the warm-up
        for name in ("generation", "reward", "old/ref log-probs", "policy forward+backward", "optimizer"):
            assert phases[name]["seconds_per_step"] > 0, (arm["arm"], name)
        assert phases["generation"]["tokens_per_step"] > 0 and phases["generation"]["tokens_per_second"] > 0
        assert phases["policy forward+backward"]["calls_per_step"] >= 2  # forward and backward of each micro-batch
        assert phases["optimizer"]["calls_per_step"] == 2  # gradient clipping, then the step
        assert sum(p["seconds_per_step"] for p in phases.values()) == pytest.approx(arm["step_seconds"])
    assert grpo["phases"]["cost-aware sampling"]["calls_per_step"] == 0
    assert cost_aware["phases"]["cost-aware sampling"]["calls_per_step"] == 1
    # the sampler keeps half the rows: fewer policy tokens and fewer reference-pass tokens than GRPO
    assert cost_aware["totals"]["rows_kept"] == cost_aware["totals"]["rows_generated"] / 2
    assert cost_aware["totals"]["policy_tokens"] < grpo["totals"]["policy_tokens"]
    ref = [a["phases"]["old/ref log-probs"]["tokens_per_step"] for a in (grpo, cost_aware)]
    assert ref[1] < ref[0]
    text = capsys.readouterr().out
    assert "| generation |" in text and "| **step** |" in text and "vs grpo" in text
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["setup"]["device"] == "cpu" and len(saved["arms"]) == 4
    assert (tmp_path / "profile.md").read_text().startswith("Step profile on")
