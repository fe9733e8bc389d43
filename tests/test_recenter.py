"""The default weights, "recenter" (w − mean + 1 over the kept rows, floored at 0): not unbiased, so its bias is
measured rather than assumed. The Monte Carlo case and statistic are those of tests/test_unbiased.py (one fixed
generation batch of the warmed-up model, two micro-batches, E[ĝ] projected on the full-batch GRPO policy gradient g;
the control variate uses the draw's own inclusion probabilities, so it is valid for any weights). Measured by this
test (256 draws): E[ĝ]·g/‖g‖² = 0.9944 ± 0.0044 (grpo, "auto", which keeps 8 of 16 rows here), 0.9948 ± 0.0045 (dapo,
"auto") and 0.9885 ± 0.0088 (grpo, 0.25), against exactly 1 for "none": a bias of about half a percent along g, below
what the matrix's 1% tolerance flags. The 3% bound fails if recentring shifts the weights' mean away from 1 (w − mean
without the + 1 gives ~0) or flattens them: every weight forced to 1 gives 0.916 (grpo) and 0.464 (dapo), and the
control below checks that it is caught.
"""

from __future__ import annotations

import pytest
from test_unbiased import _weights_forced_to_one, fixed_case, make_trainer, run_case

from trl_costaware.embedded.arithmetic import arithmetic_dataset

DRAWS = 256
BOUND = 0.03


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=3)  # the batch of tests/test_unbiased.py


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_type", "kept"),
    [("grpo", "auto"), ("dapo", "auto"), ("grpo", 0.25)],
    ids=["grpo-auto", "dapo-auto", "grpo-0.25"],
)
def test_recentred_weights_bias_is_small_and_measured(
    warm_model_path, dataset, tmp_path, monkeypatch, loss_type, kept
):
    trainer = make_trainer(
        warm_model_path,
        dataset,
        tmp_path,
        loss_type=loss_type,
        micro=2,
        cost_aware_kept_fraction=kept,
        cost_aware_weight_normalization="recenter",
    )
    assert trainer.args.cost_aware_weight_floor == 0.0
    r = run_case(fixed_case(trainer, dataset, monkeypatch), DRAWS)
    assert abs(r.mean - 1.0) < BOUND, r
    assert r.mean != 1.0  # recentring is not the Horvitz–Thompson estimator: a test that saw exactly 1 measured "none"
    fractions = trainer._metrics["train"]["cost_aware/kept_row_fraction"]
    assert fractions and max(fractions) < 1.0  # rows were dropped


@pytest.mark.slow
def test_recentred_bound_catches_weights_forced_to_one(warm_model_path, dataset, tmp_path, monkeypatch):
    trainer = make_trainer(
        warm_model_path,
        dataset,
        tmp_path,
        micro=2,
        cost_aware_kept_fraction="auto",
        cost_aware_weight_normalization="recenter",
    )
    _weights_forced_to_one(monkeypatch, trainer)
    r = run_case(fixed_case(trainer, dataset, monkeypatch), DRAWS)
    assert abs(r.mean - 1.0) >= BOUND, r


def test_recenter_is_the_default():
    from trl_costaware import CostAwareGRPOConfig

    args = CostAwareGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", bf16=False)
    assert (args.cost_aware_weight_normalization, args.cost_aware_weight_floor) == ("recenter", 0.0)
