"""`benchmarks/noise_probe_check.py`: the probe's predictions against closed forms, the per-cell aggregation of the
probe's logged terms, and the command line (no training)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import noise_probe_check as npc  # noqa: E402
import response_model as resp  # noqa: E402


@pytest.mark.parametrize("rho", [0.0, 0.3, 1.5, 9.0, math.inf])
def test_kept_rows_closed_forms(rho):
    for inflation in (0.0, 0.73, 2.46):
        # w = 0: the row sample adds nothing (all the noise is which prompts were drawn)
        assert npc.adam_kept(rho, 0.0, inflation) == pytest.approx(1.0)
        assert npc.predict("cost_aware_0.5", 1.0 + inflation, rho, 0.0) == pytest.approx(1.0)
        # w = 1: the old adam model with m = 1 + I (rows priced as independent)
        assert npc.adam_kept(rho, 1.0, inflation) == pytest.approx(resp.adam_model(rho, 1.0 + inflation))
        assert npc.predict("cost_aware_0.25", 1.0 + inflation, rho, 1.0) == pytest.approx(
            resp.adam_model(rho, 1.0 + inflation)
        )
    # in between: √((1 + ρ(1 + w I)) / (1 + ρ))
    if math.isfinite(rho):
        assert npc.adam_kept(rho, 0.4, 2.0) == pytest.approx(math.sqrt((1 + rho * 1.8) / (1 + rho)))
    # w is clamped to [0, 1] as the trainer does
    assert npc.predict("cost_aware_0.5", 3.0, rho, -0.2) == pytest.approx(npc.adam_kept(rho, 0.0, 2.0))
    assert npc.predict("cost_aware_0.5", 3.0, rho, 1.3) == pytest.approx(npc.adam_kept(rho, 1.0, 2.0))


@pytest.mark.parametrize("rho", [0.0, 0.33, 3.5, math.inf])
def test_prompt_rows_ignore_w(rho):
    for m in (2.0, 4.0):
        expected = resp.adam_model(rho, m)  # φ = 1/m: √((1 + ρ/φ)/(1 + ρ))
        assert npc.adam_prompt(rho, 1.0 / m) == pytest.approx(expected)
        for w in (0.0, 0.3, 1.0, math.nan):
            assert npc.predict(f"grpo_p{1 / m:g}", m, rho, w) == pytest.approx(expected)
    with pytest.raises(ValueError):
        npc.predict("grpo", 1.0, 0.5, 0.5)


def _write_run(root, cell, seed, batches, terms, signals_only=None):
    """A finished run of `cell`/`seed` whose metrics record logs the probe's (total, within, signal) per batch."""
    d = os.path.join(root, cell, f"s{seed}")
    os.makedirs(d)
    with open(os.path.join(d, "cost_aware_metrics.jsonl"), "w", encoding="utf-8") as fh:
        for i, (total, within, signal) in enumerate(terms, 1):
            row = {"step": i, "split": "train", "cost_aware/prompt_fraction": 1.0}
            row.update(
                {
                    "cost_aware/noise_probe_total": total,
                    "cost_aware/noise_probe_within": within,
                    "cost_aware/noise_probe_signal": signal,
                }
            )
            fh.write(json.dumps(row) + "\n")
        fh.write(json.dumps({"step": len(terms), "split": "train", "train_runtime": 1.0}) + "\n")  # no probe
    with open(os.path.join(d, npc.RUN_FILE), "w", encoding="utf-8") as fh:
        json.dump({"key": npc.run_key(cell, seed, batches)}, fh)


def test_aggregation_ratio_of_means(tmp_path):
    root = str(tmp_path)
    # seed 0: mean total 3, within 1.5, signal 6 -> ρ 0.5, w 0.5; seed 1: total 6, within 1.2, signal 3 -> ρ 2, w 0.2
    _write_run(root, "default", 0, 2, [(2.0, 1.0, 5.0), (4.0, 2.0, 7.0)])
    _write_run(root, "default", 1, 2, [(5.0, 1.0, 2.0), (7.0, 1.4, 4.0)])
    # a run with other settings (not this cell's key) is not read
    _write_run(root, "long", 0, 2, [(1.0, 0.5, 1.0), (1.0, 0.5, 1.0)])
    with open(os.path.join(root, "long", "s0", npc.RUN_FILE), "w", encoding="utf-8") as fh:
        json.dump({"key": {**npc.run_key("long", 0, 2), "pool": 64}}, fh)
    out = npc.collect(["default", "long"], 3, root)
    assert set(out) == {"default"}
    s = out["default"]
    assert s["seeds"] == [0, 1] and s["batches"] == 4
    assert s["per_seed"]["0"]["rho"] == pytest.approx(0.5) and s["per_seed"]["0"]["w"] == pytest.approx(0.5)
    assert s["per_seed"]["1"]["rho"] == pytest.approx(2.0) and s["per_seed"]["1"]["w"] == pytest.approx(0.2)
    # pooled: mean total 4.5, within 1.35, signal 4.5 (a ratio of means, not a mean of ratios)
    assert s["rho"] == pytest.approx(1.0) and s["w"] == pytest.approx(0.3)
    lo, hi = s["rho_ci"]
    assert lo == pytest.approx(0.5) and hi == pytest.approx(2.0)
    assert s["w_ci"][0] == pytest.approx(0.2) and s["w_ci"][1] == pytest.approx(0.5)


def test_aggregation_infinite_rho_and_one_seed(tmp_path):
    root = str(tmp_path)
    _write_run(root, "long_epochs", 0, 2, [(1.0, 0.5, 0.5), (1.0, 0.5, -1.5)])  # mean signal -0.5
    s = npc.collect(["long_epochs"], 1, root)["long_epochs"]
    assert math.isinf(s["rho"]) and s["rho_ci"] is None and s["w"] == pytest.approx(0.5)
    assert s["per_seed"]["0"]["negative_signal_batches"] == 1
    assert npc.adam_kept(s["rho"], s["w"], 2.0) == pytest.approx(math.sqrt(2.0))


def test_scoring_rows(tmp_path):
    probes = {"default": {"rho": 1.0, "w": 0.5}}
    response = {
        "rows": [
            {
                "cell": "default",
                "arm": "grpo_p0.5",
                "config": "prompts_0.5",
                "target": 0.5,
                "m_model": 2.0,
                "measured": [math.sqrt(1.5), 1.0, 1.4],
                "reached": "3/3",
                "adam_model_m": 1.0,
            },
            {
                "cell": "default",
                "arm": "cost_aware_0.25",
                "config": "kept_0.25",
                "target": 0.8,
                "m_model": 3.0,
                "measured": [1.6, 1.5, 1.7],
                "reached": "3/3",
            },
            {
                "cell": "long",
                "arm": "cost_aware_0.5",
                "config": "kept_0.5",
                "target": 0.8,
                "m_model": 1.5,
                "measured": [None, None, None],
                "reached": "0/3",
            },
        ]
    }
    rows = npc.score(response, probes)
    assert rows[0]["adam_probe"] == pytest.approx(math.sqrt(1.5)) and rows[0]["adam_probe_holds"] is True
    assert rows[0]["adam_model_m_holds"] is False and rows[0]["adam_run_model_m"] is None
    assert rows[1]["adam_probe"] == pytest.approx(math.sqrt(1.5)) and rows[1]["adam_probe_holds"] is False
    assert rows[1]["adam_probe_w1"] == pytest.approx(math.sqrt(2.0)) and rows[1]["adam_probe_w1_holds"] is True
    assert rows[2]["adam_probe"] is None and rows[2]["adam_probe_holds"] is None  # no probe, no measured ratio
    sh = npc.shares(rows)
    assert sh["adam_probe"] == {"all": [1, 2], "prompt fractions": [1, 1], "kept fractions": [0, 1]}
    assert sh["adam_probe_w1"]["all"] == [2, 2]


def test_cell_settings_match_the_regime_matrix():
    assert npc.check_against_regime_matrix() == []
    testbed, settings, pool = npc.cell_settings("default_variance")
    assert testbed == "default" and pool is None
    assert settings["per_device_train_batch_size"] == 256 and settings["learning_rate"] == 1e-4
    testbed, settings, pool = npc.cell_settings("long_variance")
    assert testbed == "long" and settings["per_device_train_batch_size"] == 8 and settings["learning_rate"] == 3e-4
    testbed, settings, pool = npc.cell_settings("long_epochs")
    assert testbed == "long" and pool == 128 and "learning_rate" not in settings
    for cell in npc.CELLS:
        assert {k: npc.cell_settings(cell)[1][k] for k in npc.PROBE} == npc.PROBE


def test_help_and_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        npc.main(["--help"])
    assert exit_info.value.code == 0 and "issue 39" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--cells: unknown \['nowhere'\]; allowed: default, default_variance"):
        npc.main(["--cells", "default,nowhere"])
    with pytest.raises(SystemExit, match="--seeds must be >= 1"):
        npc.main(["--seeds", "0"])
    with pytest.raises(SystemExit, match="--batches must be >= 1"):
        npc.main(["--batches", "0"])
