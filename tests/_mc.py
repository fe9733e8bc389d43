"""Monte Carlo harness of tests/test_unbiased.py: the full-batch target gradient (`full_batch_grad`), and for the
weights matrix exact per-row gradients through the trainer, then many draws of `plan.plan_batch` evaluated as linear
combinations of them.

Why it is exact. On one optimizer step of a frozen generation batch (β = 0, the first micro-step, so the policy equals
the old policy), the trainer's gradient is linear in the kept slots' advantage factors, and a slot's contribution
depends only on its row and the number m of kept rows (grpo: the micro-batch's row mean over m/spg rows; dapo: the
full batch's token count; bnpo: the micro-batch's own tokens, which the trainer's per-micro-batch correction cancels).
So for a draw with slots k (rows i_k, factors f_k)

    t = ⟨ĝ, g⟩/‖g‖² = Σ_k f_k b_i_k,     b_i = ⟨u_i, g⟩/‖g‖²,

with u_i the gradient of the whole pipeline for a plan that keeps row i in one slot with factor 1 and every other slot
at factor 0 (`row_probes`, one trainer run per row that can be drawn). The statement is not assumed: `check_linear`
runs real draws of the trainer (its own `plan_batch`, TRL's shuffle and micro-batches, trimming, deferred log-prob
passes, TRL's loss) and compares each one's projection with the linear combination of its plan.

Statistic (as in tests/test_unbiased.py): d = t − c + Σ_i a_i, with a_i row i's share of the full-batch GRPOTrainer
gradient g (TRL's own loss on the whole batch, one micro-batch) and c = Σ_{drawn} a_i/π_i the Horvitz–Thompson
control variate of the draw's own design: E[c] = Σ a_i exactly, so E[d] = E[t] for any weights, and
bias = E[d] − 1 = E[ĝ]·g/‖g‖² − 1.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, replace

import torch
from testing_utils import make_config
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware import trainer as trainer_module
from trl_costaware.rows import plan as plan_module
from trl_costaware.rows.layout import kept_multiple
from trl_costaware.rows.plan import PlanSettings, plan_batch

ROWS = 32  # 8 groups of 4 generations
GROUP = 4
# Dataset rows (arithmetic_dataset(64, seed=3)) of the 8 prompts: the first ones on which the warmed-up model does not
# give 4 identical completions (the reward below then has a spread in every group: the 0% batch has no A = 0 row).
PROMPTS = (0, 1, 2, 3, 4, 5, 9, 11)

# The batches: rows that cannot be drawn come from zero-std groups ("solved" prompts: equal rewards) and, under
# `mask_truncated_completions` with 12 completion tokens, from the 5 truncated rows (1, 2, 1 and 1 in groups 2, 3, 4,
# 6: part of a group, with A ≠ 0). Solving group 6 also removes its 3 other rows: 5 + 3 = 8, + 8 = 16, + 16 = 24.
BATCHES = {
    "0%": dict(solved=(), truncation_mask=False, max_len=16, undrawable=0),
    "groups 25%": dict(solved=(0, 1), truncation_mask=False, max_len=16, undrawable=8),
    "groups 50%": dict(solved=(0, 1, 5, 7), truncation_mask=False, max_len=16, undrawable=16),
    "groups 75%": dict(solved=(0, 1, 5, 7, 6, 2), truncation_mask=False, max_len=16, undrawable=24),
    "truncated 25%": dict(solved=(6,), truncation_mask=True, max_len=12, undrawable=8),
    "truncated 50%": dict(solved=(6, 0, 1), truncation_mask=True, max_len=12, undrawable=16),
    "truncated 75%": dict(solved=(6, 0, 1, 5, 7), truncation_mask=True, max_len=12, undrawable=24),
}
LOSSES = ("grpo", "dapo", "bnpo")
MICROS = (1, 2)
RULES = (0.25, 0.5)  # kept fractions: m = 8 and 16 of 32 (capped at the drawable rows)


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


def full_batch_grad(trainer, batch) -> torch.Tensor:
    """TRL's own loss on the whole generation batch as one micro-batch (no accumulation), differentiated."""
    args = trainer.args
    spg = args.steps_per_generation
    args.steps_per_generation, trainer.current_gradient_accumulation_steps = 1, 1
    try:
        trainer.model.zero_grad()
        GRPOTrainer._compute_loss(trainer, trainer.model, batch).backward()
        return flat_grad(trainer.model)
    finally:
        args.steps_per_generation = spg
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps


def group_reward(solved: frozenset):
    """A hash of the completion's text (equal only for equal completions), except for the prompts in `solved`, which
    get 1.0 on every row: a group with zero reward std, so zero advantage (rows outside the support)."""

    def reward(completions, prompts=None, **kwargs):
        return [
            1.0 if p in solved else float(zlib.crc32(str(c).encode()) % 101)
            for c, p in zip(completions, prompts, strict=True)
        ]

    reward.__name__ = "group_reward"
    return reward


def make_trainer(model_path, dataset, out_dir, *, loss_type, micro, solved, truncation_mask, max_len):
    args = make_config(
        out_dir,
        per_device_train_batch_size=ROWS // micro,
        steps_per_generation=micro,
        gradient_accumulation_steps=micro,
        num_generations=GROUP,
        max_completion_length=max_len,
        mask_truncated_completions=truncation_mask,
        max_steps=1,
        loss_type=loss_type,
        cost_aware_kept_fraction=0.25,
        cost_aware_smoothing=0.2,
        cost_aware_weight_normalization="none",
    )
    trainer = CostAwareGRPOTrainer(model_path, [group_reward(solved)], args=args, train_dataset=dataset)
    trainer.model.train()
    return trainer


def raw_batch(dataset):
    """The 8 prompts, each repeated 4 times in a row (what TRL's sampler hands `_prepare_inputs`)."""
    return [dataset[j] for j in PROMPTS for _ in range(GROUP)]


def solved_prompts(dataset, groups) -> frozenset:
    return frozenset(dataset[PROMPTS[k]]["prompt"] for k in groups)


def batch_case(model_path, dataset, out_dir, monkeypatch, batch: str, loss_type: str, micro: int) -> Frozen:
    """The frozen batch of `BATCHES[batch]` for a trainer of that loss type and micro-batch count, checked to have
    exactly its share of rows that cannot be drawn."""
    spec = BATCHES[batch]
    trainer = make_trainer(
        model_path,
        dataset,
        out_dir,
        loss_type=loss_type,
        micro=micro,
        solved=solved_prompts(dataset, spec["solved"]),
        truncation_mask=spec["truncation_mask"],
        max_len=spec["max_len"],
    )
    raw = raw_batch(dataset)
    fz = freeze(trainer, raw, generate(trainer, raw), monkeypatch)
    assert ROWS - int(fz.support.sum()) == spec["undrawable"], (batch, int(fz.support.sum()))
    if spec["truncation_mask"]:
        assert int((fz.rows.loss_tokens == 0).sum()) == 5
    return fz


def generate(trainer, raw):
    torch.manual_seed(0)  # the same generation batch whatever ran before in this process
    return GRPOTrainer._generate_and_score_completions(trainer, raw)


@dataclass
class Frozen:
    trainer: CostAwareGRPOTrainer
    raw: list
    full: dict
    g: torch.Tensor  # the full-batch GRPOTrainer gradient
    shares: torch.Tensor  # a_i = ⟨h_i, g⟩/‖g‖², h_i row i's share of g (0 outside the support)
    support: torch.Tensor  # the rows that can be drawn (A ≠ 0 and a loss token)
    rows: plan_module.RowStats


def freeze(trainer, raw, full, monkeypatch) -> Frozen:
    """Every later generation returns a clone of `full`; the target g and each drawable row's share of it (the
    gradient with every other advantage set to 0). Rows outside the support must carry no gradient: Σ_S h_i = g."""

    def frozen(_self=None, _inputs=None):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in full.items()}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", frozen)
    batch = frozen()
    g = full_batch_grad(trainer, batch)
    rows = trainer._host_row_stats(batch)
    support = (rows.advantages != 0) & (rows.loss_tokens > 0)
    shares = torch.zeros(len(rows), dtype=torch.float64)
    parts = []
    for i in torch.nonzero(support).flatten().tolist():
        one = dict(batch, advantages=batch["advantages"] * (torch.arange(len(rows)) == i))
        h = full_batch_grad(trainer, one)
        parts.append(h)
        shares[i] = float(h @ g / (g @ g))
    torch.testing.assert_close(torch.stack(parts).sum(0), g, rtol=1e-4, atol=1e-7)
    return Frozen(trainer, raw, full, g, shares, support, rows)


def pipeline_projection(fz: Frozen) -> float:
    """One real optimizer step of the trainer's pipeline on the frozen batch: ⟨ĝ, g⟩/‖g‖²."""
    trainer = fz.trainer
    trainer._buffered_inputs = None
    trainer._step = 0
    trainer.model.zero_grad()
    for _ in range(trainer.args.gradient_accumulation_steps):
        inputs = trainer._prepare_inputs(fz.raw)
        trainer._compute_loss(trainer.model, inputs).backward()
        trainer._step += 1
    return float(flat_grad(trainer.model) @ fz.g / (fz.g @ fz.g))


def settings_for(fz: Frozen, kept, method) -> PlanSettings:
    """The trainer's own PlanSettings (its layout's unit included), with the kept fraction and the weights of the
    cell."""
    trainer, args = fz.trainer, fz.trainer.args
    unit = kept_multiple(trainer._cost_aware.layout, args.steps_per_generation, args.gradient_accumulation_steps)
    base = PlanSettings.from_args(args, trainer._zero_advantage_carries_gradient, unit)
    return replace(base, kept_fraction=kept, weight_normalization=method)


def _set_rule(trainer, kept, method):
    trainer.args.cost_aware_kept_fraction = kept
    trainer.args.cost_aware_weight_normalization = method


def row_probes(fz: Frozen, kept, monkeypatch) -> tuple[torch.Tensor, int]:
    """(b, m): b_i = ⟨u_i, g⟩/‖g‖² for every row that can be drawn (0 elsewhere), u_i the pipeline's gradient for a
    plan of m slots whose first slot holds row i with factor 1 and every other slot factor 0 (the trainer's own plan,
    indices and factors replaced), and the cell's m."""
    trainer = fz.trainer
    _set_rule(trainer, kept, "none")
    real = plan_module.plan_batch
    probe = {}

    def forced(rows, *args, **kwargs):
        plan = real(rows, *args, **kwargs)
        probe["m"] = plan.m
        plan.indices = plan.indices.clone()
        plan.indices[0] = probe["row"]
        plan.factors = torch.zeros_like(plan.factors)
        plan.factors[0] = 1.0
        # the kept rows' host statistics (the layout's lengths and widths) follow the replaced index by themselves
        assert torch.equal(plan.kept_stats["loss_tokens"], rows["loss_tokens"][plan.indices])
        return plan

    monkeypatch.setattr(trainer_module, "plan_batch", forced)
    b = torch.zeros(len(fz.rows), dtype=torch.float64)
    try:
        for i in torch.nonzero(fz.support).flatten().tolist():
            probe["row"] = i
            b[i] = pipeline_projection(fz)
    finally:
        monkeypatch.setattr(trainer_module, "plan_batch", real)
    return b, probe["m"]


def check_linear(fz: Frozen, b: torch.Tensor, kept, method, draws: int) -> float:
    """Real trainer draws (its own plan) against the linear combination Σ_k f_k b_i_k of their plans; returns the
    largest relative difference."""
    trainer = fz.trainer
    _set_rule(trainer, kept, method)
    worst = 0.0
    for _ in range(draws):
        t = pipeline_projection(fz)
        plan = trainer._cost_aware.generation.plan
        combo = plan.factors.double() * b[plan.indices]
        lin = float(combo.sum())
        scale = float(combo.abs().sum()) + 1e-12
        worst = max(worst, abs(t - lin) / scale)
    _set_rule(trainer, kept, "none")
    return worst


@dataclass
class Stat:
    bias: float  # E[d] − 1 = E[ĝ]·g/‖g‖² − 1
    se: float
    draws: int
    m: int
    floored: float  # mean fraction of weights the floor moved

    def __str__(self):
        return f"{self.bias:+.4f} ± {self.se:.4f}"


def _control(fz: Frozen, plan) -> float:
    probs, idx = plan.draw.probabilities.double(), plan.indices
    return float((fz.shares[idx] / probs[idx]).sum())


def _design_centre(plan) -> float:
    """w̄₀ = m |S⁺| / (N K) on one rank, computed here from the draw's design (not read from the plan under test)."""
    probs, n = plan.draw.probabilities.double(), len(plan.p)
    drawable = int((plan.eligible & (probs > 0)).sum())
    slots = float(probs[plan.eligible].sum())
    return plan.m * drawable / n / slots if slots > 0 else 1.0


def _mean_and_se(d: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """Mean of d and its standard error, with x (E[x] = 0 exactly) as a regression control variate: the mean of
    d − β̂ x, β̂ = Cov(d, x)/Var(x) (its bias is O(1/K)); the plain mean when x has no spread."""
    var = float(x.var())
    beta = float(((d - d.mean()) * (x - x.mean())).mean() / var) if var > 1e-30 else 0.0
    adj = d - beta * x
    return float(adj.mean()), float(adj.std() / math.sqrt(len(adj)))


def linear_draws(fz: Frozen, b: torch.Tensor, kept, draws: dict[str, int], seed: int = 0) -> dict[str, Stat]:
    """`draws[method]` draws of the real `plan_batch` for each method, on the same generator stream (so the same rows
    each draw), each evaluated as d = Σ_k f_k b_i_k − c + Σ a_i. "ones" is the control: the same draws with every
    non-filler weight forced to 1 (the factor then 1, or N/m for a loss whose normaliser is not a row mean).

    Second control variate: the kept weights' mean w̄ has E[w̄] = w̄₀ exactly (`design_weight_terms`, its
    exact-enumeration test), so x = w̄ − w̄₀ has mean 0; the recentred estimator's spread is mostly
    (w̄₀ − w̄)·Σ_k b_k, which x absorbs (`_mean_and_se`)."""
    out = {}
    total = float(fz.shares.sum())
    rows_loss = plan_module.LOSS_NORMALISERS[fz.trainer.args.loss_type].rows
    for method, k_draws in draws.items():
        s = settings_for(fz, kept, "none" if method == "ones" else method)
        gen = torch.Generator().manual_seed(seed)
        d = torch.empty(k_draws, dtype=torch.float64)
        x = torch.empty(k_draws, dtype=torch.float64)
        floored = 0.0
        for k in range(k_draws):
            plan = plan_batch(fz.rows, s, gen)
            f = plan.factors.double()
            if method == "ones":
                f = (~plan.filler).double() * (1.0 if rows_loss else len(fz.rows) / plan.m)
            d[k] = float((f * b[plan.indices]).sum()) - _control(fz, plan) + total
            real = ~plan.filler
            x[k] = float(plan.draw.weights[real].double().mean()) - _design_centre(plan) if real.any() else 0.0
            floored += plan.metrics["weight_frac_floored"]
        mean, se = _mean_and_se(d, x)
        out[method] = Stat(mean - 1.0, se, k_draws, plan.m, floored / k_draws)
    return out


def run_cell(fz: Frozen, kept, monkeypatch, draws: dict[str, int], checks: int = 1) -> tuple[dict[str, Stat], float]:
    """One cell: the row probes for its m, `checks` real trainer draws per weighting against their linear
    combinations (the largest relative difference is returned), then the linear draws."""
    b, m = row_probes(fz, kept, monkeypatch)
    worst = max(check_linear(fz, b, kept, method, checks) for method in draws if method != "ones") if checks else 0.0
    stats = linear_draws(fz, b, kept, draws)
    assert all(s.m == m for s in stats.values()), (m, {k: s.m for k, s in stats.items()})
    return stats, worst


def main(argv=None):  # pragma: no cover - the table of docs/algorithm.md: `python tests/_mc.py [K]`
    import os
    import sys
    import tempfile

    import pytest

    from trl_costaware.embedded import warmed_up_model_path
    from trl_costaware.embedded.arithmetic import arithmetic_dataset

    argv = sys.argv[1:] if argv is None else argv
    k = int(argv[0]) if argv else 10_000
    path = warmed_up_model_path(os.environ.get("TRL_COSTAWARE_CACHE"), seed=0)
    dataset = arithmetic_dataset(64, seed=3)
    draws = {"none": 200, "recenter": k, "ones": 500}
    print("batch | loss | micro | rule | m | " + " | ".join(draws) + " | floored (recenter) | check", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for batch in BATCHES:
            for loss_type in LOSSES:
                for micro in MICROS:
                    mp = pytest.MonkeyPatch()
                    try:
                        fz = batch_case(path, dataset, tmp, mp, batch, loss_type, micro)
                        for rule in RULES:
                            stats, worst = run_cell(fz, rule, mp, draws)
                            cells = " | ".join(f"{s.bias:+.4f} ± {s.se:.4f}" for s in stats.values())
                            m = stats["none"].m
                            floored = stats["recenter"].floored
                            row = f"{batch} | {loss_type} | {micro} | {rule} | {m} | {cells} | {floored:.3f}"
                            print(f"{row} | {worst:.1e}", flush=True)
                    finally:
                        mp.undo()


if __name__ == "__main__":  # pragma: no cover
    main()
