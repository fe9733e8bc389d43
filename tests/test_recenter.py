"""The default weights are "none" (the exactly unbiased Horvitz–Thompson weights); "recenter" (w − mean(w) + w̄₀ over
the kept non-filler rows of all ranks) is floored at 0.

The recentred estimator's bias along the full-batch gradient is measured in tests/test_unbiased_matrix.py, on batches
where 0–75% of the rows cannot be drawn (w̄₀, the design's expected mean weight, is |S|/N there, not 1:
`sampling.design_weight_terms`). This module's earlier Monte Carlo measured on a batch where almost every row could be
drawn, so it could not see that centring at 1 scaled the gradient by N/|S|; the matrix replaces it.
"""

from __future__ import annotations

from trl_costaware.rows.plan import PlanSettings


def _args(**overrides):
    from trl_costaware import CostAwareGRPOConfig

    return CostAwareGRPOConfig(output_dir="unused", use_cpu=True, report_to="none", bf16=False, **overrides)


def test_none_is_the_default():
    args = _args()
    settings = PlanSettings.from_args(args, zero_advantage_carries_gradient=False)
    assert (args.cost_aware_weight_normalization, settings.weight_floor) == ("none", None)


def test_recenter_is_floored_at_zero():
    args = _args(cost_aware_weight_normalization="recenter")
    settings = PlanSettings.from_args(args, zero_advantage_carries_gradient=False)
    assert (args.cost_aware_weight_normalization, settings.weight_floor) == ("recenter", 0.0)
