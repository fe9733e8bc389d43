"""The weights matrix: bias of each weight normalisation along the full-batch GRPOTrainer gradient, on batches where
0%, 25%, 50% and 75% of the rows cannot be drawn.

Batches (`_mc.BATCHES`, 32 rows of the warmed-up model, 8 groups of 4): the rows that cannot be drawn come from
zero-std groups, or from the truncated rows `mask_truncated_completions` hides plus zero-std groups. Each batch is
crossed with grpo / dapo / bnpo, 1 and 2 micro-batches per optimizer step, and two kept-row rules (a fixed fraction
0.25, and "auto"). Per cell, through the trainer: the target g (TRL's loss on the whole batch), each row's gradient
through the whole pipeline (`_mc.row_probes`), and real trainer draws that must equal the linear combination of
their plan's factors (`_mc.check_linear`: the shortcut is tested in every cell, not assumed). Then K draws of the real
`plan.plan_batch` per weighting, evaluated exactly as linear combinations (`_mc.linear_draws`).

Statistic: bias = E[ĝ]·g/‖g‖² − 1, with two control variates of known mean (the draw's Horvitz–Thompson estimate of
Σ a_i, and the kept weights' mean minus its expectation w̄₀). Bounds:

- `none` (the Horvitz–Thompson weights): zero within 3 standard errors (its SE is ~0 with the control variate, so
  this is float-level agreement);
- weights forced to 1 (the control): detected, |bias| > max(3 SE, 1%);
- `recenter`, `self_normalize`: |bias| ≤ `NORMALISED_BOUND` = 15%, a third of the smallest error of the old centre
  (centred at 1, recentring measured +44% to +50% at 25%, +132% to +155% at 50%, +300% to +448% at 75% of rows
  undrawable, so this fails in every cell with undrawable rows on the old code). The issue's bound, 1%, is NOT met:
  both are ratio estimators with an O(1/m) bias, measured at +1% to +4% (`recenter`) and +1% to +5%
  (`self_normalize`) for m = 7–14 kept rows of 32 and up to +8% / +13% for m = 4, and as large with every row
  drawable (where the centre is 1 either way). `test_issue_bound_of_one_percent` states that bound as a strict
  xfail: it turns into a failure once the bias does meet it.

`make test` runs `SUITE` (every batch, every loss type, both micro-batch counts and both rules appear), the `mc_full`
test the whole product at more draws. The measured table is in docs/algorithm.md §2.5 (`python tests/_mc.py K`).
"""

from __future__ import annotations

import pytest
from _mc import BATCHES, LOSSES, MICROS, RULES, batch_case, run_cell

from trl_costaware.embedded.arithmetic import arithmetic_dataset

NONE_Z = 3.0
CONTROL_MIN = 0.01
NORMALISED_BOUND = 0.15  # a third of the old centre's smallest error (+44%); see the module docstring
ISSUE_BOUND = 0.01  # issue 26's bound for "recenter" and "self_normalize", not met (test_issue_bound_of_one_percent)
CHECK_TOLERANCE = 1e-4  # real trainer draw vs the linear combination, relative to Σ |f_k b_k| (float32 model)

# 7 (batch, loss, micro) triples, one per batch, both rules each: every value of every axis appears, each loss type
# with 1 and with 2 micro-batches, and each loss type on both kinds of undrawable rows (zero-std groups, truncation).
SUITE = [
    ("0%", "grpo", 1),
    ("groups 25%", "dapo", 2),
    ("groups 50%", "bnpo", 1),
    ("groups 75%", "grpo", 2),
    ("truncated 25%", "dapo", 1),
    ("truncated 50%", "bnpo", 2),
    ("truncated 75%", "grpo", 1),
]
FULL = [(batch, loss, micro) for batch in BATCHES for loss in LOSSES for micro in MICROS]


def _id(value) -> str:
    return str(value).replace(" ", "").replace("%", "pct")


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=3)


def _check_cell(stats, worst, label, bound):
    none, ones = stats["none"], stats["ones"]
    assert worst <= CHECK_TOLERANCE, (label, worst)
    assert abs(none.bias) <= max(NONE_Z * none.se, 1e-5), (label, str(none))
    assert abs(ones.bias) > max(NONE_Z * ones.se, CONTROL_MIN), (label, str(ones))
    for method in ("recenter", "self_normalize"):
        s = stats[method]
        assert abs(s.bias) <= bound, (label, method, str(s), s.draws)


def _run(
    warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro, k, rules=RULES, bound=NORMALISED_BOUND
):
    fz = batch_case(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro)
    draws = {"none": 100, "recenter": k, "self_normalize": k, "ones": 200}
    for rule in rules:
        stats, worst = run_cell(fz, rule, monkeypatch, draws)
        print(f"{batch} {loss_type} micro={micro} {rule}: m={stats['none'].m}", {m: str(s) for m, s in stats.items()})
        _check_cell(stats, worst, (batch, loss_type, micro, rule), bound)


def test_the_suites_cells_cover_every_axis():
    assert {b for b, _, _ in SUITE} == set(BATCHES)
    assert {(loss, micro) for _, loss, micro in SUITE} == {(loss, micro) for loss in LOSSES for micro in MICROS}
    for kind in ("groups", "truncated"):
        assert {loss for b, loss, _ in SUITE if b.startswith(kind)} == set(LOSSES), kind


@pytest.mark.slow
@pytest.mark.parametrize(("batch", "loss_type", "micro"), SUITE, ids=_id)
def test_weights_matrix(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro):
    _run(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro, k=3000)


@pytest.mark.mc_full
@pytest.mark.parametrize(("batch", "loss_type", "micro"), FULL, ids=_id)
def test_weights_matrix_full(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro):
    _run(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro, k=20_000)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue 26's 1% bound: the recentred and self-normalised estimators' O(1/m) bias is +4% here (m = 8 of 32, "
    "every row drawable); measured in docs/algorithm.md §2.5",
)
def test_issue_bound_of_one_percent(warm_model_path, dataset, tmp_path, monkeypatch):
    _run(warm_model_path, dataset, tmp_path, monkeypatch, "0%", "grpo", 1, k=3000, rules=(0.25,), bound=ISSUE_BOUND)
