"""Monte Carlo checks that the cost-aware gradient is an unbiased estimate of GRPOTrainer's full-batch gradient with
the Horvitz–Thompson weights ("none"), for every loss type, with controls that must be flagged; the KL term; and the
weights matrix, where "recenter" is measured against "none" and weights forced to 1.

I. The pipeline matrix.

One fixed generation batch of the warmed-up model (varied completion lengths: short problems end early, long ones run
to the cap). Target g: TRL's own loss on the whole generation batch as one micro-batch, differentiated. Estimate: the
trainer's real pipeline (draw, weights, TRL's shuffle and split into micro-batches, trimming, deferred log-prob
passes, TRL's `_compute_loss` on each micro-batch), gradients summed over the micro-steps of one optimizer step.

Statistic: the projection t_k = ⟨ĝ_k, g⟩/‖g‖² of draw k's gradient on the target; E[t] = 1 for an unbiased estimator.
The test passes when |mean(t) − 1| < 4·SE. A relative bias b along g shifts mean(t) by b; it is detected with
probability ≥ 90% when b ≥ (4 + 1.28)·SE, so K is chosen per case from the measured spread of t so that
SE ≤ 0.05/5.28 (a 5% bias) for the full matrix (`mc_full`, `make test-all`) and SE ≤ 0.10/5.28 (a 10% bias) in
`make test`. Negative controls use the same draws and statistic and must fail: the target scaled by ±5% (full
matrix), the dapo factor w instead of w·N/m, bnpo given grpo's factor, and every weight forced to 1.

Coverage: one optimizer step by default; `steps_per_generation = 2 × gradient_accumulation_steps` summed over the
whole generation batch (two optimizer steps); the second pass of `num_iterations=2` alone; β > 0 with a perturbed
reference model, where the target is the policy term and the KL term is checked separately (it is not reweighted: on
every draw it is TRL's KL term of the kept rows, at the full batch's scale through the β rescaling of batch-token
losses, whose removal is a control: part II). The even layout (which the trainer runs with an entropy bonus or a
router aux loss) is forced in its cases and in the controls.

II. The KL term (β > 0, perturbed reference): not reweighted, TRL's KL of the kept rows. On every draw it equals TRL's
KL term on the kept rows alone, at the full batch's scale through the β rescaling of batch-token losses; dropping the
rescaling is the control.

III. The weights matrix: bias of each weight normalisation along the full-batch GRPOTrainer gradient, on batches where
0%, 25%, 50% and 75% of the rows cannot be drawn.

Batches (`_mc.BATCHES`, 32 rows of the warmed-up model, 8 groups of 4): the rows that cannot be drawn come from
zero-std groups, or from the truncated rows `mask_truncated_completions` hides plus zero-std groups. Each batch is
crossed with grpo / dapo / bnpo, 1 and 2 micro-batches per optimizer step, and two kept fractions (0.25 and 0.5). Per
cell, through the trainer: the target g (TRL's loss on the whole batch), each row's gradient through the whole
pipeline (`_mc.row_probes`), and real trainer draws that must equal the linear combination of their plan's factors
(`_mc.check_linear`: the shortcut is tested in every cell, not assumed). Then K draws of the real `plan.plan_batch`
per weighting, evaluated exactly as linear combinations (`_mc.linear_draws`).

Statistic: bias = E[ĝ]·g/‖g‖² − 1, with two control variates of known mean (the draw's Horvitz–Thompson estimate of
Σ a_i, and the kept weights' mean minus its expectation w̄₀). Bounds:

- `none` (the Horvitz–Thompson weights): zero within 3 standard errors (its SE is ~0 with the control variate, so
  this is float-level agreement);
- weights forced to 1 (the control): detected, |bias| > max(3 SE, 1%);
- `recenter`: |bias| ≤ `NORMALISED_BOUND` = 15%, a third of the smallest error of the old centre (centred at 1,
  recentring measured +44% to +50% at 25%, +132% to +155% at 50%, +300% to +448% at 75% of rows undrawable, so this
  fails in every cell with undrawable rows on the old code). It is a ratio estimator with an O(1/m) bias, detected
  as biased where it is large enough to see (`test_recenter_is_biased`: beyond 1% and 3 SE with m = 8 of 32).

`make test` runs `SUITE` (every batch, every loss type, both micro-batch counts and both fractions appear), the
`mc_full` tests the whole products at more draws (`python tests/_mc.py K` prints the weights table).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from _mc import BATCHES, LOSSES, MICROS, RULES, batch_case, run_cell
from _mc import flat_grad as _flat_grad
from _mc import full_batch_grad as _full_batch_grad
from testing_utils import LOSS_TYPES, force_layout, loss_settings, make_config, recorded_draws, tiny_dataset
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.rows import plan as plan_module

BOUND = 4.0  # standard errors
POWER_Z = 1.2816  # one-sided 90% quantile of the normal: detect a bias b when b ≥ (BOUND + POWER_Z)·SE
PILOT = 48  # draws used to size K from the spread of t


def length_reward(completions, **kwargs):
    """Reward with within-group variance: completion length mod 4."""
    return [float(len(c) % 4) for c in completions]


def binary_reward(completions, **kwargs):
    """A 0/1 reward (even length): on the test batch one group is all equal (zero advantage on its 4 rows), the other
    three are informative on every row."""
    return [float(len(c) % 2 == 0) for c in completions]


REWARDS = {"length": length_reward, "binary": binary_reward}


@pytest.fixture(scope="module")
def dataset():
    return tiny_dataset(64, seed=3)  # the prompts `_mc.PROMPTS` index


def make_trainer(
    model_path,
    dataset,
    tmp_path,
    *,
    loss_type="grpo",
    micro=1,
    reward="length",
    spg=None,
    perturbed_reference=0.0,
    coverage="optimizer_step",
    layout=None,
    **overrides,
):
    """`micro` micro-batches per optimizer step (gradient_accumulation_steps), `spg` per generation batch (default
    `micro`). `perturbed_reference` > 0 adds Gaussian noise of that relative size to the reference model's weights, so
    the KL term has a gradient. `coverage` is what a draw's gradient is summed over (see `projections`). `layout`
    forces "even" (default: the trainer's, packed)."""
    spg = spg or micro
    settings = dict(
        per_device_train_batch_size=16 // spg,
        steps_per_generation=spg,
        gradient_accumulation_steps=micro,
        max_completion_length=16,
        max_steps=1,
        cost_aware_kept_fraction=0.5,
        cost_aware_smoothing=0.2,
        cost_aware_weight_normalization="none",  # the Horvitz–Thompson weights, the unbiased estimator checked here
    )
    args = make_config(tmp_path, **{**settings, **loss_settings(loss_type), **overrides})
    trainer = CostAwareGRPOTrainer(model_path, [REWARDS[reward]], args=args, train_dataset=dataset)
    if layout is not None:
        force_layout(trainer, layout)
    trainer.model.train()
    if perturbed_reference:
        assert trainer.ref_model is not None, "a perturbed reference needs beta > 0 (and no PEFT)"
        noise = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in trainer.ref_model.parameters():
                scale = perturbed_reference * float(param.std()) if param.numel() > 1 else 0.0
                param.add_(torch.randn(param.shape, generator=noise).to(param) * scale)
    trainer.cost_aware_test_coverage = coverage
    return trainer


@dataclass
class Case:
    trainer: CostAwareGRPOTrainer
    raw: list
    full: dict
    target: torch.Tensor  # g, the full-batch gradient (or a scaled one, for a control)
    rows: torch.Tensor  # a_i = ⟨h_i, g⟩/‖g‖², h_i row i's share of the true full-batch gradient (Σ_i h_i = g_true)
    kl_target: torch.Tensor | None = None  # the full batch's KL-term gradient, when the policy term is g (below)


def fixed_case(trainer, dataset, monkeypatch, target_scale: float = 1.0) -> Case:
    """Generate and score one batch with TRL, freeze it (every later generation returns a clone), compute the target g
    and each row's share of it (the gradient with every other row's advantage set to 0: the policy term is linear in
    the advantages at the first micro-step, and the KL term has zero gradient while the policy equals the
    reference)."""
    raw = [dataset[i] for i in range(16)]
    torch.manual_seed(0)  # the same generation batch whatever ran before in this process
    full = GRPOTrainer._generate_and_score_completions(trainer, raw)
    assert full["advantages"].abs().sum() > 0
    lengths = full["completion_mask"].sum(-1)
    assert lengths.min() < lengths.max(), "completion lengths must vary"

    def frozen(_self=None, _inputs=None):
        return {k: (v.clone() if isinstance(v, torch.Tensor) else copy.copy(v)) for k, v in full.items()}

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", frozen)
    batch = frozen()
    if trainer.beta != 0.0:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        with torch.no_grad():
            batch["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, ids, mask, batch["completion_ids"].size(1)
            )[0]
    g_true = _full_batch_grad(trainer, batch)
    # With a reference that differs from the policy the KL term has a gradient, g_kl (every advantage set to 0); the
    # target is then the policy term g_true − g_kl, the part the weights make unbiased (the KL term is not reweighted).
    perturbed = trainer.beta != 0.0 and any(
        not torch.equal(a, b) for a, b in zip(trainer.model.parameters(), trainer.ref_model.parameters(), strict=True)
    )
    g_kl = _full_batch_grad(trainer, dict(batch, advantages=torch.zeros_like(batch["advantages"])))
    if perturbed:
        assert g_kl.norm() > 0.05 * g_true.norm(), (float(g_kl.norm()), float(g_true.norm()))
    else:
        assert g_kl.norm() <= 1e-6 * g_true.norm()
    shares = []
    for i in range(len(lengths)):
        one = dict(batch, advantages=batch["advantages"] * (torch.arange(len(lengths)) == i))
        shares.append(_full_batch_grad(trainer, one) - (g_kl if perturbed else 0.0))
    shares = torch.stack(shares)
    g_policy = g_true - g_kl if perturbed else g_true
    torch.testing.assert_close(shares.sum(0), g_policy, rtol=1e-4, atol=1e-7)
    g = g_policy * target_scale
    return Case(trainer, raw, full, g, shares @ g / (g @ g), g_kl if perturbed else None)


def projections(case: Case, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `draws` runs of the whole pipeline: t_k = ⟨ĝ_k, g⟩/‖g‖², ĝ_k the gradient summed over the micro-steps of
    one optimizer step, and the control variate c_k = Σ_{i drawn} a_i/π_i (Horvitz–Thompson) from the design the
    sampler reported, whose mean Σ_i a_i is known exactly. A correct trainer makes t_k − c_k ≈ 0 draw by draw; a wrong
    factor or normaliser shifts it by the relative bias."""
    trainer, g = case.trainer, case.target
    first, steps, scale = _coverage(trainer)
    t = torch.empty(draws, dtype=torch.float64)
    c = torch.empty(draws, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        seen = recorded_draws(mp)
        for k in range(draws):
            trainer._buffered_inputs = None
            trainer._step = 0
            trainer.model.zero_grad()
            for step in range(first + steps):
                inputs = trainer._prepare_inputs(case.raw)
                if step >= first:
                    loss = trainer._compute_loss(trainer.model, inputs)
                    if case.kl_target is not None:  # the policy term: the loss minus its KL part (advantages 0)
                        kl_loss = trainer._compute_loss(
                            trainer.model, dict(inputs, advantages=torch.zeros_like(inputs["advantages"]))
                        )
                        loss = loss - kl_loss
                    loss.backward()
                trainer._step += 1
            t[k] = _flat_grad(trainer.model) @ g / (g @ g) / scale
            draw = seen.pop()
            assert not seen, "one draw per generation batch"
            a, probs, idx = case.rows, draw.probabilities.double(), draw.indices
            c[k] = (a[idx] / probs[idx]).sum()
    return t, c


def _coverage(trainer) -> tuple[int, int, float]:
    """(micro-steps to skip, micro-steps to differentiate, scale) of a draw's gradient:

    - "optimizer_step": the first optimizer step (gradient_accumulation_steps micro-steps);
    - "generation": every micro-step of the generation batch (steps_per_generation of them, several optimizer steps
      when steps_per_generation > gradient_accumulation_steps), divided by steps_per_generation / GA: TRL divides
      each micro-batch's loss by GA, so the whole generation batch sums to that multiple of the full-batch loss;
    - "second_iteration": the num_iterations=2 pass over the same buffer (micro-steps spg … 2·spg − 1), measured
      alone (the parameters are not updated in between, so its target is the same)."""
    args = trainer.args
    spg, ga = args.steps_per_generation, args.gradient_accumulation_steps
    coverage = getattr(trainer, "cost_aware_test_coverage", "optimizer_step")
    if coverage == "generation":
        return 0, spg, spg / ga
    if coverage == "second_iteration":
        assert trainer.num_iterations == 2 and spg == ga
        return spg, spg, 1.0
    return 0, ga, 1.0


@dataclass
class Result:
    mean: float  # of d_k = t_k − c_k + Σ a_i: E[d] = E[t], the relative size of E[ĝ] along g
    se: float
    plain_mean: float  # of t alone
    plain_se: float
    draws: int

    def biased(self, tolerance: float) -> bool:
        """|mean − 1| beyond BOUND standard errors and beyond `tolerance` (floating-point differences between the
        trimmed micro-batches and the full batch are ~1e-6; the control variate can make the SE that small)."""
        return abs(self.mean - 1.0) > max(BOUND * self.se, tolerance)


def run_case(case: Case, draws: int) -> Result:
    t, c = projections(case, draws)
    d = t - c + float(case.rows.sum())
    root = math.sqrt(draws)
    return Result(float(d.mean()), float(d.std() / root), float(t.mean()), float(t.std() / root), draws)


def draws_for(sd: float, detectable: float) -> int:
    """K such that (BOUND + POWER_Z)·SE ≤ detectable with SE = sd/√K."""
    return math.ceil((sd * (BOUND + POWER_Z) / detectable) ** 2)


# ---------------------------------------------------------------- the matrix (make test: control-variate statistic)
TOLERANCE = 0.01  # relative; a 5% bias is five times this
CHEAP_DRAWS = 32
OPTIONS = {
    "truncation_mask": dict(mask_truncated_completions=True, max_completion_length=12),
    "beta": dict(beta=0.05),
    "num_iterations_2": dict(num_iterations=2),
    # TRL's split (m/S rows per micro-step), as with an entropy bonus or a router aux loss; and with padding to 8
    "even_layout": dict(layout="even"),
    "even_layout_pad8": dict(layout="even", pad_to_multiple_of=8),
    # a zero-advantage group: with β = 0 its rows are outside the support (the draw and the smoothing spread over the
    # 12 informative rows only) and m = 0.9·16 → 14 is capped at 12; with β > 0 they are eligible (KL gradient)
    "zero_signal_support": dict(reward="binary"),
    "zero_signal_capped": dict(reward="binary", cost_aware_kept_fraction=0.9),
    "zero_signal_beta": dict(reward="binary", beta=0.05),
    "token_budget": dict(cost_aware_token_budget=150),
    "proxy_advantage": dict(cost_aware_proxy="advantage"),
    "proxy_uniform": dict(cost_aware_proxy="uniform"),
    # steps_per_generation = 2 × GA: 4 micro-batches of 2 kept rows, two optimizer steps, summed over the whole
    # generation batch (against 2 × the full-batch gradient, see `_coverage`)
    "spg_2x_ga": dict(spg=4, coverage="generation"),
    # the second pass of num_iterations=2 over the same kept micro-batches, measured alone
    "num_iterations_2_second": dict(num_iterations=2, coverage="second_iteration"),
    # β > 0 with a reference that differs from the policy: the KL term has a gradient (~0.3 ‖g‖ here); the target is
    # the policy term, which the weights make unbiased (the KL term is the kept rows' KL: `test_kl_term_*` below)
    "beta_perturbed_reference": dict(beta=0.1, perturbed_reference=0.05),
    # the shared-prompt forward under the draw (its layout over the kept rows); every loss type in `make test-all`
    "shared_prompts": dict(shared_prompt_forward=True),
}
THREE_LOSSES = ("truncation_mask", "beta", "even_layout", "spg_2x_ga", "beta_perturbed_reference", "shared_prompts")
MATRIX = [pytest.param(lt, micro, {}, id=f"{lt}-micro{micro}") for lt in LOSS_TYPES for micro in (1, 2)] + [
    pytest.param(lt, 2, opts, id=f"{lt}-micro2-{name}")
    for name, opts in OPTIONS.items()
    for lt in (
        ("grpo", "dapo", "bnpo")
        if name in THREE_LOSSES
        else ("grpo", "dapo")
        if name == "num_iterations_2_second"
        else ("grpo",)
    )
]


def _detects_5_percent(r: Result) -> bool:
    """A 5% relative bias would be flagged with probability ≥ 90%: 0.05 − z₉₀·SE clears both thresholds."""
    return 0.05 - POWER_Z * r.se >= max(BOUND * r.se, TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "micro", "options"), MATRIX)
def test_unbiased_matrix(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, micro, options):
    trainer = make_trainer(warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=micro, **options)
    case = fixed_case(trainer, dataset, monkeypatch)
    if "mask_truncated_completions" in options:  # some rows are truncated, their loss mask is empty
        assert (case.full["completion_mask"].sum(-1) == 0).any()
    informative = int((case.full["advantages"] != 0).sum())
    if options.get("reward") == "binary":  # the case has zero-signal rows to avoid, and informative ones
        assert 0 < informative < 14, informative
    assert trainer._cost_aware.layout == options.get("layout", "packed")
    r = run_case(case, CHEAP_DRAWS)
    assert _detects_5_percent(r), r
    assert not r.biased(TOLERANCE), r
    if options.get("reward") == "binary" and "beta" not in options:  # no slot for a zero-signal row
        metrics = trainer._metrics["train"]
        assert set(metrics["cost_aware/kept_informative_fraction"]) == {1.0}
        if options.get("cost_aware_kept_fraction", 0.5) > informative / 16:
            assert set(metrics["cost_aware/batch_rows_kept"]) == {informative}  # m capped at the informative rows


def _wrong_normaliser(monkeypatch, wrong: str, right: str):
    """A wrong-normaliser control: `wrong` given `right`'s entry of `plan.LOSS_NORMALISERS`."""
    table = plan_module.LOSS_NORMALISERS
    monkeypatch.setitem(table, wrong, table[right])


def _weights_forced_to_one(monkeypatch, trainer):
    original = trainer._draw_kept_rows

    def unweighted(batch):
        plan = original(batch)
        return dataclasses.replace(plan, factors=torch.ones_like(plan.factors))

    monkeypatch.setattr(trainer, "_draw_kept_rows", unweighted)


CONTROLS = {
    "target_plus_5pct": ("grpo", 1.05, None),
    "target_minus_5pct": ("grpo", 0.95, None),
    "dapo_factor_w": ("dapo", 1.0, ("dapo", "luspo")),  # w instead of w·N/m
    "bnpo_as_grpo": ("bnpo", 1.0, ("bnpo", "dr_grpo")),  # no N/m, TRL's own micro-batch token count
    "weights_one": ("grpo", 1.0, "ones"),
}


@pytest.mark.slow
@pytest.mark.parametrize("control", list(CONTROLS))
@pytest.mark.parametrize("micro", [1, 2])
def test_matrix_controls_fail(warm_model_path, dataset, tmp_path, monkeypatch, control, micro):
    """Each deliberately wrong estimator (or target) is flagged by the same statistic and thresholds."""
    loss_type, scale, patch = CONTROLS[control]
    # The even layout: the packed one corrects a row-mean loss per micro-batch from the same normaliser table the
    # patch changes, and with one packed micro-batch of 2·(m/2) rows that correction (×2) is exactly the N/m the
    # dapo control removes. The packed layout's own corrections are checked against the even layout's gradient
    # (tests/test_packed_layout.py, which fails without them).
    trainer = make_trainer(warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=micro, layout="even")
    if patch == "ones":
        _weights_forced_to_one(monkeypatch, trainer)
    elif patch is not None:
        _wrong_normaliser(monkeypatch, *patch)
    case = fixed_case(trainer, dataset, monkeypatch, target_scale=scale)
    # bnpo given grpo's factor is a ratio bias that varies draw by draw (2.1% with one micro-batch, 4.9% with two on
    # this batch): d has a real spread there, so more draws (z ≈ 7 and 6.5 at the sizes below).
    draws = {1: 1536, 2: 512}[micro] if control == "bnpo_as_grpo" else CHEAP_DRAWS
    r = run_case(case, draws)
    assert r.biased(TOLERANCE), r


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loss_type", "name"),
    [("grpo", "spg_2x_ga"), ("grpo", "num_iterations_2_second"), ("grpo", "beta_perturbed_reference")]
    + [("dapo", "beta_perturbed_reference"), ("grpo", "shared_prompts"), ("dapo", "shared_prompts")],
)
def test_new_coverage_weights_one_control_fails(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, name):
    """The cases added for spg = 2 × GA, the second iteration, the perturbed reference and shared prompts see the
    same deliberate error as the rest of the matrix: every weight forced to 1 is flagged."""
    trainer = make_trainer(warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=2, **OPTIONS[name])
    _weights_forced_to_one(monkeypatch, trainer)
    r = run_case(fixed_case(trainer, dataset, monkeypatch), CHEAP_DRAWS)
    assert r.biased(TOLERANCE), r


@pytest.mark.slow
def test_plain_statistic_sees_the_draw(warm_model_path, dataset, tmp_path, monkeypatch):
    """The control variate trusts the sampler's reported design; the plain projection t does not. Here K is sized so a
    20% bias of the whole pipeline (draw included) is detected with ≥ 90% probability (sd(t) ≈ 0.75 on this batch, so
    5% needs ~9000 draws: that is `mc_full`'s job)."""
    trainer = make_trainer(warm_model_path, dataset, tmp_path, loss_type="grpo", micro=2)
    case = fixed_case(trainer, dataset, monkeypatch)
    pilot = run_case(case, 64)
    k = draws_for(pilot.plain_se * math.sqrt(64) * 1.2, 0.20)
    r = run_case(case, k)
    assert abs(r.plain_mean - 1.0) < BOUND * r.plain_se, r
    assert (BOUND + POWER_Z) * r.plain_se <= 0.20, r


# ---------------------------------------------------------------- the matrix at full K (make test-all)
# the shared-prompt forward for the loss types `make test` leaves out (it runs one of each normaliser family)
MATRIX_FULL = MATRIX + [
    pytest.param(lt, 2, OPTIONS["shared_prompts"], id=f"{lt}-micro2-shared_prompts")
    for lt in LOSS_TYPES
    if lt not in ("grpo", "dapo", "bnpo")
]


@pytest.mark.mc_full
@pytest.mark.parametrize(("loss_type", "micro", "options"), MATRIX_FULL)
def test_unbiased_matrix_full(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, micro, options):
    """The plain projection t, K sized from a pilot so that a 5% relative bias of the whole pipeline is detected with
    ≥ 90% probability; the same draws against the target scaled by ±5% must be flagged."""
    trainer = make_trainer(warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=micro, **options)
    case = fixed_case(trainer, dataset, monkeypatch)
    t, _ = projections(case, 128)
    # Sized from the spread seen so far (+20%), extended while the measured SE is still too large for 5%.
    while (k := draws_for(float(t.std()) * 1.2, 0.05)) > len(t) and len(t) < 40_000:
        t = torch.cat([t, projections(case, k - len(t))[0]])
    mean, se = float(t.mean()), float(t.std() / math.sqrt(len(t)))
    print(f"mc_full {loss_type} micro={micro} {options}: K={len(t)} mean(t)={mean:.4f} SE={se:.4f}")
    assert (BOUND + POWER_Z) * se <= 0.05, (mean, se, len(t))
    # The floor matters only for a deterministic draw (m capped at the informative rows: π = 1, SE = 0).
    assert abs(mean - 1.0) < max(BOUND * se, TOLERANCE), (mean, se, len(t))
    for scale in (1.05, 0.95):  # ⟨ĝ, s·g⟩/‖s·g‖² = t/s
        assert abs(mean / scale - 1.0) >= max(BOUND * se / scale, TOLERANCE), (scale, mean, se)


# ---------------------------------------------------------------- II. the KL term
def _kept_rows_kl_grad(trainer, full, indices) -> torch.Tensor:
    """The gradient of TRL's KL term (advantages 0) on a batch of the kept rows alone, as one micro-batch, with the
    kept rows' own token count as `num_items_in_batch`: the kept rows' KL at the full batch's scale."""
    n = full["advantages"].shape[0]
    kept = {k: v[indices] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v for k, v in full.items()}
    kept["advantages"] = torch.zeros_like(kept["advantages"])
    kept["num_items_in_batch"] = kept["completion_mask"].sum().to(full["num_items_in_batch"])
    ids = torch.cat([kept["prompt_ids"], kept["completion_ids"]], 1)
    mask = torch.cat([kept["prompt_mask"], kept["completion_mask"]], 1)
    with torch.no_grad():
        kept["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, mask, kept["completion_ids"].size(1)
        )[0]
    return _full_batch_grad(trainer, kept)


def _pipeline_kl_grads(trainer, raw, draws: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(kept indices, gradient of the KL part summed over one optimizer step) for `draws` draws of the pipeline."""
    out = []
    with pytest.MonkeyPatch.context() as mp:
        seen = recorded_draws(mp)
        for _ in range(draws):
            trainer._buffered_inputs, trainer._step = None, 0
            trainer.model.zero_grad()
            for _ in range(trainer.args.gradient_accumulation_steps):
                inputs = trainer._prepare_inputs(raw)
                zero = dict(inputs, advantages=torch.zeros_like(inputs["advantages"]))
                trainer._compute_loss(trainer.model, zero).backward()
                trainer._step += 1
            out.append((seen.pop().indices.clone(), _flat_grad(trainer.model)))
    return out


def _without_kl_scale(monkeypatch, trainer):
    """The control: β no longer rescaled by T_full / T_kept (the plan's `kl_scale`) for batch-token losses."""
    original = trainer._compute_loss

    def unscaled(model, inputs):
        trainer._cost_aware.generation.plan = dataclasses.replace(trainer._cost_aware.generation.plan, kl_scale=None)
        return original(model, inputs)

    monkeypatch.setattr(trainer, "_compute_loss", unscaled)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_kl_term_is_the_kept_rows_kl_at_full_batch_scale(warm_model_path, dataset, tmp_path, monkeypatch, loss_type):
    """With a perturbed reference the KL term has a gradient, and it is not reweighted: on every draw it equals TRL's
    KL term on the kept rows alone, at the full batch's scale — for dapo that needs the β rescaling by T_full/T_kept
    (the plan's `kl_scale`); without it the KL term shrinks to T_kept/T_full of its size, which this test flags.
    (bnpo's KL term is each kept micro-batch's own token mean, as in TRL: not compared here.)"""
    trainer = make_trainer(
        warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=2, **OPTIONS["beta_perturbed_reference"]
    )
    case = fixed_case(trainer, dataset, monkeypatch)
    for indices, grad in _pipeline_kl_grads(trainer, case.raw, 3):
        expected = _kept_rows_kl_grad(trainer, case.full, indices)
        assert expected.norm() > 0
        torch.testing.assert_close(grad, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))


@pytest.mark.slow
def test_kl_term_without_kl_scale_is_flagged(warm_model_path, dataset, tmp_path, monkeypatch):
    """The control of the test above: dapo without the β rescaling is off by T_kept/T_full on every draw."""
    trainer = make_trainer(
        warm_model_path, dataset, tmp_path, loss_type="dapo", micro=2, **OPTIONS["beta_perturbed_reference"]
    )
    case = fixed_case(trainer, dataset, monkeypatch)
    _without_kl_scale(monkeypatch, trainer)
    lengths = case.full["completion_mask"].sum(-1)
    for indices, grad in _pipeline_kl_grads(trainer, case.raw, 3):
        expected = _kept_rows_kl_grad(trainer, case.full, indices)
        shrink = float(lengths[indices].sum() / lengths.sum())
        assert shrink < 0.9
        torch.testing.assert_close(grad, expected * shrink, rtol=1e-3, atol=1e-3 * float(expected.abs().max()))


# ---------------------------------------------------------------- III. the weights matrix
NONE_Z = 3.0
CONTROL_MIN = 0.01
NORMALISED_BOUND = 0.15  # a third of the old centre's smallest error (+44%); see the module docstring
RECENTER_BIAS = 0.01  # "recenter" is biased by more than this (test_recenter_is_biased)
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


def _check_cell(stats, worst, label, bound):
    none, ones = stats["none"], stats["ones"]
    assert worst <= CHECK_TOLERANCE, (label, worst)
    assert abs(none.bias) <= max(NONE_Z * none.se, 1e-5), (label, str(none))
    assert abs(ones.bias) > max(NONE_Z * ones.se, CONTROL_MIN), (label, str(ones))
    s = stats["recenter"]
    assert abs(s.bias) <= bound, (label, "recenter", str(s), s.draws)


def _run(
    warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro, k, rules=RULES, bound=NORMALISED_BOUND
):
    fz = batch_case(warm_model_path, dataset, tmp_path, monkeypatch, batch, loss_type, micro)
    draws = {"none": 100, "recenter": k, "ones": 200}
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
def test_recenter_is_biased(warm_model_path, dataset, tmp_path, monkeypatch):
    """Where its O(1/m) bias is large enough to see (m = 8 of 32, every row drawable: about +4%), `recenter` is
    detected as biased by the statistic that finds `none` unbiased in the same cell."""
    fz = batch_case(warm_model_path, dataset, tmp_path, monkeypatch, "0%", "grpo", 1)
    stats, _ = run_cell(fz, 0.25, monkeypatch, {"none": 100, "recenter": 3000}, checks=0)
    none, recenter = stats["none"], stats["recenter"]
    print("0% grpo micro=1 0.25:", {m: str(s) for m, s in stats.items()})
    assert abs(none.bias) <= max(NONE_Z * none.se, 1e-5), str(none)
    assert abs(recenter.bias) > max(NONE_Z * recenter.se, RECENTER_BIAS), str(recenter)
