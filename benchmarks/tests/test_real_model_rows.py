"""`benchmarks/real_model_rows.py`: its pure functions against closed forms (J ratios, the noise split, the matched
tokens) and its command line (no model)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import real_model_rows as rmr


def test_j_value_and_optimum():
    rng = np.random.default_rng(0)
    g, c = rng.uniform(0.1, 3.0, 20), rng.uniform(5, 200, 20)
    u = np.full(20, 1 / 20)
    assert rmr.j_value(g, u, c) == pytest.approx(20 * np.sum(g**2) * np.mean(c))
    p_star = rmr.sampling_p(g, c)
    assert rmr.j_value(g, p_star, c) == pytest.approx(rmr.j_optimal(g, c))
    assert rmr.j_optimal(g, c) == pytest.approx(np.sum(g * np.sqrt(c)) ** 2)
    for _ in range(20):  # p* is the minimum
        p = rng.dirichlet(np.ones(20))
        assert rmr.j_value(g, p, c) >= rmr.j_optimal(g, c) * (1 - 1e-12)
    # scale-free in g and c
    assert rmr.j_value(3 * g, p_star, 7 * c) / rmr.j_optimal(3 * g, 7 * c) == pytest.approx(1.0)
    # a row with gradient but no probability: infinite
    assert rmr.j_value([1.0, 1.0], [1.0, 0.0], [1.0, 1.0]) == np.inf
    # equal costs: p ∝ |A| on rows whose g = |A| is optimal
    a = rng.uniform(0.1, 2.0, 10)
    assert rmr.j_value(a, rmr.sampling_p(a, np.ones(10)), np.ones(10)) == pytest.approx(rmr.j_optimal(a, np.ones(10)))


def _direct_split(x, k, gen):
    """The split computed from explicit vectors x (K·G, d), grouped consecutively."""
    x = x.reshape(k, gen, -1)
    means = x.mean(1)
    grand = means.mean(0)
    within = np.sum((x - means[:, None]) ** 2) / (k * (gen - 1)) / (k * gen)
    total = np.sum((means - grand) ** 2) / (k - 1) / k
    return within, total, np.sum(grand**2) - total


def _from_sums(x, k, gen):
    rows = x.reshape(k, gen, -1)
    s = rows.sum(1)
    return rmr.noise_split(float(np.sum(x**2)), np.sum(s**2, axis=1), float(np.sum(s.sum(0) ** 2)), k, gen)


def test_noise_split_matches_explicit_vectors():
    rng = np.random.default_rng(1)
    k, gen, d = 5, 4, 7
    x = rng.normal(size=(k * gen, d)) + rng.normal(size=(k, 1, d)).repeat(gen, 1).reshape(k * gen, d)
    within, total, signal = _direct_split(x, k, gen)
    got = _from_sums(x, k, gen)
    assert got["within"] == pytest.approx(within)
    assert got["total"] == pytest.approx(total)
    assert got["signal"] == pytest.approx(signal)
    assert got["between"] == pytest.approx(total - within)
    assert got["within_share"] == pytest.approx(within / total)
    assert got["rho"] == pytest.approx(total / signal)


def test_noise_split_limits():
    k, gen = 4, 3
    # identical rows within each group: no within-group noise
    x = np.repeat(np.arange(k * 2, dtype=float).reshape(k, 1, 2), gen, axis=1).reshape(k * gen, 2)
    assert _from_sums(x, k, gen)["within"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        rmr.noise_split(1.0, [1.0], 1.0, 1, 3)


def test_noise_split_is_unbiased():
    """E[within] = σ_w² d/(KG), E[total] = (σ_b² + σ_w²/G) d / K, E[signal] = ‖μ‖² (two-stage Gaussian draws)."""
    rng = np.random.default_rng(2)
    k, gen, d, sb, sw = 4, 8, 3, 0.7, 1.3
    mu = np.array([0.5, -0.2, 1.0])
    acc = np.zeros(3)
    n = 20000
    for _ in range(n):
        prompt = mu + sb * rng.normal(size=(k, 1, d))
        x = (prompt + sw * rng.normal(size=(k, gen, d))).reshape(k * gen, d)
        s = _from_sums(x, k, gen)
        acc += [s["within"], s["total"], s["signal"]]
    acc /= n
    assert acc[0] == pytest.approx(sw**2 * d / (k * gen), rel=0.02)
    assert acc[1] == pytest.approx((sb**2 + sw**2 / gen) * d / k, rel=0.03)
    assert acc[2] == pytest.approx(float(mu @ mu), abs=0.03)


def test_matched_tokens_closed_form():
    rng = np.random.default_rng(3)
    n = 30
    g, c = rng.uniform(0.8, 1.2, n), rng.uniform(40, 60, n)
    # uniform p matches itself at kept 1/2
    assert rmr.matched_tokens(g, c, np.full(n, 1 / n)) == pytest.approx(0.5, rel=1e-8)
    # without capping (λ p_i < 1): Σ (1/(λ p_i) − 1) g_i² = Σ g_i² gives λ = Σ(g²/p) / (2 Σ g²), tokens λ Σ p c / Σ c
    p = rmr.sampling_p(g, c)
    lam = np.sum(g**2 / p) / (2 * np.sum(g**2))
    assert np.all(lam * p < 1)
    expect = lam * np.sum(p * c) / np.sum(c)
    assert rmr.matched_tokens(g, c, p) == pytest.approx(expect, rel=1e-8)
    assert expect == pytest.approx(rmr.j_value(g, p, c) / (2 * np.sum(g**2) * np.sum(c)))
    # the oracle needs fewest tokens among these designs
    for _ in range(10):
        q = rng.dirichlet(np.ones(n))
        assert rmr.matched_tokens(g, c, q) >= rmr.matched_tokens(g, c, p) - 1e-9


def test_matched_tokens_with_capping():
    """A design that puts most mass on one row: that row is kept for sure (π = 1), the rest carry the variance.
    g = 1, c = 1, p = (0.97, 0.01, 0.01, 0.01): target Σ g² = 4 = 3 (100/λ − 1) gives λ = 300/7, π = (1, 3/7, 3/7,
    3/7), tokens (1 + 9/7)/4 = 4/7."""
    g, c = np.ones(4), np.ones(4)
    p = np.array([0.97, 0.01, 0.01, 0.01])
    assert rmr.matched_tokens(g, c, p) == pytest.approx(4 / 7, rel=1e-8)
    assert np.isnan(rmr.matched_tokens(np.zeros(2), np.ones(2), np.full(2, 0.5)))
    assert rmr.matched_tokens([1.0, 1.0], [1.0, 1.0], [1.0, 0.0]) == 1.0  # a row with gradient is never drawn


def test_batch_figures_on_a_toy_record():
    """Both families from one record: grpo divides by L; A = 0 rows are left out; the oracle's J ratio is 1."""
    rows = {
        "adv": [1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 2.0, -2.0],
        "length": [4, 16, 8, 8, 2, 32, 10, 5],
        "cost": [10, 22, 14, 14, 8, 38, 16, 11],
        "s_norm": [2.0, 4.0, 0.0, 0.0, 1.0, 6.0, 3.0, 2.5],
    }
    noise = {"row_sq": 10.0, "group_sq": [1.0, 2.0], "total_sq": 0.5}
    for lt in ("grpo", "dapo"):
        f = rmr.batch_figures(rows, lt, 2, 4, noise)
        assert f["informative"] == 6
        assert f["J/J* oracle"] == pytest.approx(1.0)
        assert f["J/Ju uniform"] == pytest.approx(1.0)
        assert f["matched tokens uniform"] == pytest.approx(0.5, rel=1e-8)
        assert f["J/J* uniform"] >= f["J/J* oracle"]
    la = rmr.proxy_scores([1.0, 2.0], [4.0, 9.0], "grpo")
    assert la["loss_aware γ=0.5"] == pytest.approx([1.0 / 2.0, 2.0 / 3.0])
    assert la["loss_aware γ=1"] == pytest.approx([1.0, 2.0])
    la = rmr.proxy_scores([1.0, 2.0], [4.0, 9.0], "dapo")
    assert la["loss_aware γ=0.5"] == pytest.approx([2.0, 6.0])


def test_interval():
    iv = rmr.interval([1.0, 3.0, float("nan"), 2.0])
    assert {k: iv[k] for k in ("mean", "lo", "hi", "n")} == {"mean": 2.0, "lo": 1.0, "hi": 3.0, "n": 3}
    assert 1.0 <= iv["boot_lo"] <= 2.0 <= iv["boot_hi"] <= 3.0
    assert rmr.interval([])["n"] == 0


def test_rollout_cache_is_keyed_by_seed_and_settings(tmp_path):
    """Another seed gets its own folder; the same seed with other settings (a batch shape) is refused, not reused."""
    settings = {"num_generations": 8, "per_device_train_batch_size": 64}
    first = rmr.rollout_cache(str(tmp_path), "full", "smollm2", 0, settings)
    assert rmr.rollout_cache(str(tmp_path), "full", "smollm2", 0, dict(settings)) == first
    assert rmr.rollout_cache(str(tmp_path), "full", "smollm2", 1, settings) != first
    with pytest.raises(SystemExit, match="holds rollouts of"):
        rmr.rollout_cache(str(tmp_path), "full", "smollm2", 0, {**settings, "per_device_train_batch_size": 32})


def test_help_runs():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real_model_rows.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "matched tokens" in out.stdout and "--quick" in out.stdout


@pytest.mark.slow
def test_quick_run_on_the_default_testbed(tmp_path):
    """--quick end to end on the default testbed (one batch of 4 prompts): a report with both loss families and both
    fine-tuning modes, the oracle's J ratio 1, uniform's matched tokens 1/2; a rerun reads the cache."""
    import json

    rmr.main(["--quick", "--models", "default", "--cache", str(tmp_path)])
    with open(tmp_path / "quick.json", encoding="utf-8") as fh:
        res = json.load(fh)
    summary = res["summary"]["default"]
    for entry in res["models"]["default"]["batches"]:  # the oracle is the optimum J*: per batch, not in the table
        for lt in rmr.LOSS_FAMILIES:
            assert entry["families"][lt]["J/J* oracle"] == pytest.approx(1.0)
    for mode in rmr.MODES:
        for lt in rmr.LOSS_FAMILIES:
            s = summary[mode][lt]
            assert s["matched tokens uniform"]["mean"] == pytest.approx(0.5, rel=1e-6)
            assert s["informative"]["mean"] > 0
    md = (tmp_path / "quick.md").read_text()
    assert "loss family grpo" in md and "loss family dapo" in md and "default testbed lora" in md
    assert sorted(p.name for p in (tmp_path / "quick" / "default" / "seed0").glob("*_0.*")) == [
        "rollouts_0.pt",
        "scores_full_0.json",
        "scores_lora_0.json",
    ]
    rmr.main(["--quick", "--models", "default", "--cache", str(tmp_path)])  # from the cache
    with open(tmp_path / "quick.json", encoding="utf-8") as fh:
        assert json.load(fh)["summary"] == res["summary"]


def test_logp_proxy_weights_confident_tokens_less():
    """loss_aware with the sampler's log-probabilities: h = (Σ_t u_t²)^½ with u = 1 − π(y_t) (γ = ½, dapo); a row of
    certain tokens (π = 1) carries no gradient proxy; without log-probabilities u = 1 gives √L."""
    import math

    la = rmr.proxy_scores(
        [1.0, 2.0, 1.0], [2.0, 1.0, 2.0], "dapo", [[math.log(0.5), math.log(0.5)], [0.0], [-1e9, -1e9]]
    )
    assert la[rmr.LOGP] == pytest.approx([math.sqrt(0.5), 0.0, math.sqrt(2.0)])
    assert rmr.LOGP not in rmr.proxy_scores([1.0], [2.0], "dapo")


def test_design_inclusion_sums_to_the_kept_slots_and_caps_at_one():
    rng = np.random.default_rng(1)
    for n_info in (5, 20, 40, 64):
        score, c = rng.uniform(0.1, 3, n_info), rng.uniform(10, 200, n_info)
        pi = rmr.design_inclusion(score, c, 64)
        assert pi.sum() == pytest.approx(min(32, n_info))
        assert (pi <= 1 + 1e-12).all() and (pi > 0).all()
    # fewer informative rows than slots: every one kept, no added noise
    pi = rmr.design_inclusion(np.ones(10), np.full(10, 50.0), 64)
    assert pi == pytest.approx(np.ones(10))
    assert rmr.design_noise(np.ones(10), pi, 64) == 0.0
    # uniform over 64 rows at kept 1/2: D = Σ ‖x‖² / N²
    pi = rmr.design_inclusion(np.ones(64), np.full(64, 50.0), 64)
    assert pi == pytest.approx(np.full(64, 0.5))
    assert rmr.design_noise(np.full(64, 2.0), pi, 64) == pytest.approx(64 * 4.0 / 64**2)


def test_predicted_steps_ratio_of_means():
    fam = lambda signal, total, d: {"noise": {"signal": signal, "total": total}, "design noise": {"uniform": d}}  # noqa: E731
    pr = rmr.predicted_steps([fam(1.0, 3.0, 2.0), fam(3.0, 1.0, 0.0)])
    assert pr["uniform"]["ratio"] == pytest.approx(1 + 1.0 / 4.0)
    assert pr["rho"] == pytest.approx(2.0 / 2.0)
    assert pr["uniform"]["added_over_noise"] == pytest.approx(0.5)
    assert pr["uniform"]["lo"] <= pr["uniform"]["ratio"] <= pr["uniform"]["hi"]
    assert "advantage" not in pr  # not measured


def test_adapter_label():
    assert rmr.adapter_label("/x/runs/grpo__s0/adapters/step-10") == "grpo__s0-step-10"
    assert rmr.adapter_label("/x/my_adapter/") == "my_adapter"


@pytest.mark.slow
def test_quick_run_from_an_adapter(tmp_path):
    """--adapter: the testbed model with a saved LoRA adapter generates and is differentiated (LoRA mode only); the
    report has the predicted steps table and the log-probability proxy."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path, *_ = rmr.model_setup("default", quick=True)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(task_type="CAUSAL_LM", **rmr.LORA))
    with torch.no_grad():  # a trained adapter: B ≠ 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    adapter = tmp_path / "run" / "adapters" / "step-3"
    model.save_pretrained(adapter)
    rmr.main(["--quick", "--models", "default", "--cache", str(tmp_path), "--adapter", str(adapter), "--tag", "ad"])
    with open(tmp_path / "ad.json", encoding="utf-8") as fh:
        res = json.load(fh)
    assert {e["mode"] for e in res["models"]["default"]["batches"]} == {"lora"}
    assert (tmp_path / "quick" / "default@run-step-3" / "seed0" / "scores_lora_0.json").exists()
    pr = res["summary"]["default"]["lora"]["dapo"]["predicted steps"]
    assert pr["uniform"]["ratio"] >= 1.0 and rmr.LOGP in pr
    md = (tmp_path / "ad.md").read_text()
    assert "Predicted steps ratio" in md and rmr.LOGP in md


def test_batch_figures_without_an_informative_row():
    """A batch whose groups are all solved (late in training): no row figure, zero noise, nothing a design adds."""
    rows = {"adv": [0.0] * 4, "length": [3, 4, 5, 6], "cost": [9, 10, 11, 12], "s_norm": [0.0] * 4}
    f = rmr.batch_figures(rows, "dapo", 2, 2, {"row_sq": 0.0, "group_sq": [0.0, 0.0], "total_sq": 0.0})
    assert f["informative"] == 0 and f["noise"]["total"] == 0.0
    assert f["design noise"] == dict.fromkeys(rmr.DESIGNS, 0.0) and "J/J* advantage" not in f


def test_predicted_steps_interval_with_gradient_free_batches():
    fam = lambda signal, total, d: {"noise": {"signal": signal, "total": total}, "design noise": {"uniform": d}}  # noqa: E731
    pr = rmr.predicted_steps([fam(0.0, 0.0, 0.0), fam(1.0, 1.0, 1.0)])
    assert pr["uniform"]["ratio"] == pytest.approx(1.5)
    assert pr["uniform"]["lo"] == pytest.approx(1.0) and pr["uniform"]["hi"] == pytest.approx(1.5)
