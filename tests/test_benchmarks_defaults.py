"""`benchmarks/defaults_check.py`: the paired comparison it computes from per-seed rows is the one
`token_efficiency.py` computes from the runs, and its verdicts name a trade-off as such."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import defaults_check as dc  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


@pytest.mark.parametrize("name", ["token_efficiency_full_long.json", "token_efficiency_full_default.json"])
def test_paired_from_per_seed_rows_matches_the_runs_analysis(name):
    """Every pair the committed analysis computed from the runs (first vs second arm) comes out the same from the two
    arms' per-seed rows, so a default can be compared in either direction without the runs."""
    with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
        res = json.load(fh)
    checked = 0
    for key, entry in res["cost_aware_vs"].items():
        first, second = key.split(" vs ")
        mine = dc.paired(res["arms"][second], res["arms"][first])  # alternative = first, default = second
        assert mine["seeds"] == entry["seeds"]
        assert mine["ratio_policy_tokens"]["n"] == entry["ratio_policy_tokens"]["n"]
        assert mine["ratio_policy_tokens"]["ci"] == pytest.approx(entry["ratio_policy_tokens"]["ci"], rel=1e-12)
        assert mine["end_difference_equal_steps"] == pytest.approx(entry["end_difference_equal_steps"], rel=1e-12)
        checked += 1
    assert checked >= 8


def _entry(ratio, delta):
    return {"seeds": [0, 1, 2], "ratio_policy_tokens": {"ci": ratio, "n": 3}, "end_difference_equal_steps": delta}


@pytest.mark.parametrize(
    ("ratio", "delta", "status"),
    [
        ((0.7, 0.6, 0.8), (0.0, -0.01, 0.01), "alternative better"),
        ((1.0, 0.9, 1.1), (0.02, 0.01, 0.03), "alternative better"),
        ((1.3, 1.2, 1.4), (0.0, -0.01, 0.01), "default better"),
        ((1.0, 0.9, 1.1), (-0.02, -0.03, -0.01), "default better"),
        ((1.0, 0.9, 1.1), (0.0, -0.01, 0.01), "no difference beyond the intervals"),
        (
            (0.7, 0.6, 0.8),
            (-0.02, -0.03, -0.01),
            "trade-off: alternative better on tokens, default better on accuracy",
        ),
        (
            (1.3, 1.2, 1.4),
            (0.02, 0.01, 0.03),
            "trade-off: alternative better on accuracy, default better on tokens",
        ),
    ],
)
def test_verdict(ratio, delta, status):
    assert dc.verdict(_entry(ratio, delta))["status"] == status
    assert dc.verdict(None)["status"] == "not run"


def test_check_reads_both_testbeds_and_says_what_was_not_run(tmp_path):
    for name in ("token_efficiency_full_long.json",):
        with open(os.path.join(RESULTS, name), encoding="utf-8") as src:
            (tmp_path / name).write_text(src.read(), encoding="utf-8")
    table = dc.check(str(tmp_path))
    auto_vs_half = table["kept fraction: auto vs fixed 0.5 (weights none)"]
    assert auto_vs_half["default"]["status"] == "not run"  # no default-testbed file here
    assert auto_vs_half["long"]["seeds"] >= 5 and auto_vs_half["long"]["default_minus_grpo"] is not None
