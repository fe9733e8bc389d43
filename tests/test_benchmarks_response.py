"""`benchmarks/response_model.py`: the candidate response models and the noise summary, against closed forms."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import response_model as resp  # noqa: E402


def test_sgd_and_adam_models():
    assert resp.sgd_model(0.5, 2.0) == pytest.approx(2.0 / 1.5)
    assert resp.adam_model(0.5, 2.0) == pytest.approx(math.sqrt(2.0 / 1.5))
    assert resp.sgd_model(math.inf, 4.0) == 4.0 and resp.adam_model(math.inf, 4.0) == 2.0
    assert resp.sgd_model(0.0, 4.0) == 1.0  # no noise: the batch does not matter
    assert resp.sgd_model(0.3, 1.0) == pytest.approx(1.0)


def test_per_coordinate_model_reduces_to_the_global_one_at_a_common_snr():
    """With σᵢ² = ρ 𝐆ᵢ² on every coordinate (and n large, so the bias correction vanishes), P(1)/P(m) =
    √((1 + ρ m)/(1 + ρ)), the global model; with the noise on coordinates that carry no signal, the batch does not
    matter (ratio 1) while the global ρ says it does."""
    rng = np.random.default_rng(0)
    mean = rng.normal(size=500)
    rho, n = 0.7, 10**9
    var = rho * mean**2
    for m in (2.0, 4.0, 1.5):
        assert resp.adam_coordinate_model(mean, var, n, m) == pytest.approx(resp.adam_model(rho, m), rel=1e-9)
    signal = np.concatenate([mean, np.zeros(500)])
    noise = np.concatenate([np.zeros(500), np.full(500, 3.0)])
    assert resp.adam_coordinate_model(signal, noise, n, 4.0) == pytest.approx(1.0)


def test_noise_summary_recovers_rho_and_multipliers():
    """Synthetic lr-0 records: G_t = 𝐆 + noise with tr Var = v (full) and 2v (half), so ρ = v / |𝐆|² and m = 2."""
    rng = np.random.default_rng(1)
    d, steps, v = 200, 4000, 0.5
    g = np.full(d, 0.1)  # |𝐆|² = 2

    def record(scale):
        x = g + rng.normal(scale=math.sqrt(scale * v / d), size=(steps, d))
        sq = [float(x[i] @ x[i]) for i in range(1, steps)]
        dot = [float(x[i] @ x[i - 1]) for i in range(1, steps)]
        return {
            "sq": sq,
            "dot": dot,
            "signal": float(np.mean(dot)),
            "noise": float(np.mean(sq) - np.mean(dot)),
            "inflation": 0.0,
        }

    s = resp.noise_summary({"full": record(1.0), "prompts_0.5": record(2.0)}, resamples=200)
    assert s["rho"] == pytest.approx(v / 2.0, rel=0.1)
    c = s["configs"]["prompts_0.5"]
    assert c["m_model"] == 2.0 and c["m_measured"] == pytest.approx(2.0, rel=0.1)
    assert c["m_measured_ci"][0] <= c["m_measured"] <= c["m_measured_ci"][1] < 2.5


def test_cross_factor_fits_on_other_cells_only():
    rows = [
        {"cell": "a", "rho": 1.0, "m_model": 2.0, "measured": [resp.sgd_model(0.5, 2.0)]},
        {"cell": "b", "rho": 1.0, "m_model": 2.0, "measured": [9.0]},
    ]
    assert resp.cross_factor(rows, {"a"}) == pytest.approx(0.5, rel=0.01)
    assert resp.cross_factor(rows, {"c"}) is None


@pytest.mark.parametrize("script", ["response_model", "prompt_count_matrix"])
def test_scripts_help_and_bad_input(script, capsys):
    import importlib

    mod = importlib.import_module(script)
    with pytest.raises(SystemExit) as exit_info:
        mod.main(["--help"])
    assert exit_info.value.code == 0 and "issue 39" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--cells: unknown"):
        mod.main(["--cells", "nowhere"])
    with pytest.raises(SystemExit, match="--arms: unknown"):
        mod.main(["--arms", "no_such_arm"])


def test_step_priced_settings_split_the_55_percent_price():
    import _common as common
    import prompt_count_matrix as pcm

    price = common.generation_token_cost("default", 0.55)
    s = pcm.step_priced_settings("default", 7224.0)
    assert s["cost_aware_cost_model"] == "tokens"
    # per step: half of GRPO's generation cost; per token: the other half of the price
    assert s["cost_aware_generation_step_cost"] == pytest.approx(0.5 * price * 7224.0, rel=1e-6)
    assert s["cost_aware_generation_token_cost"] == pytest.approx(0.5 * price, rel=1e-5)
