"""Monte Carlo check that the cost-aware gradient is an unbiased estimate of GRPOTrainer's full-batch gradient.

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
losses, whose removal is a control: tests/test_unbiased_kl.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from trl import GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware import trainer as trainer_module

try:  # the sampler's decision lives in plan.py once the trainer delegates to it
    from trl_costaware.rows import plan as plan_module
except ImportError:  # pragma: no cover - older layout
    plan_module = None
from trl_costaware.embedded.arithmetic import arithmetic_dataset

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LOSS_SETTINGS = {"luspo": {"importance_sampling_level": "sequence"}}
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
    return arithmetic_dataset(64, seed=3)


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
    **overrides,
):
    """`micro` micro-batches per optimizer step (gradient_accumulation_steps), `spg` per generation batch (default
    `micro`). `perturbed_reference` > 0 adds Gaussian noise of that relative size to the reference model's weights, so
    the KL term has a gradient. `coverage` is what a draw's gradient is summed over (see `projections`)."""
    spg = spg or micro
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=16 // spg,
        steps_per_generation=spg,
        gradient_accumulation_steps=micro,
        num_generations=4,
        max_completion_length=16,
        max_steps=1,
        save_strategy="no",
        bf16=False,
        seed=0,
        loss_type=loss_type,
        cost_aware_kept_fraction=0.5,
        cost_aware_smoothing=0.2,
        cost_aware_weight_normalization="none",  # the Horvitz–Thompson weights, the unbiased estimator checked here
        **LOSS_SETTINGS.get(loss_type, {}),
    )
    kwargs.update(overrides)
    trainer = CostAwareGRPOTrainer(
        model_path, [REWARDS[reward]], args=CostAwareGRPOConfig(**kwargs), train_dataset=dataset
    )
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


def _flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().double() for p in model.parameters() if p.grad is not None])


@dataclass
class Case:
    trainer: CostAwareGRPOTrainer
    raw: list
    full: dict
    target: torch.Tensor  # g, the full-batch gradient (or a scaled one, for a control)
    rows: torch.Tensor  # a_i = ⟨h_i, g⟩/‖g‖², h_i row i's share of the true full-batch gradient (Σ_i h_i = g_true)
    kl_target: torch.Tensor | None = None  # the full batch's KL-term gradient, when the policy term is g (below)


def _full_batch_grad(trainer, batch) -> torch.Tensor:
    """TRL's own loss on the whole generation batch as one micro-batch (no accumulation), differentiated."""
    args = trainer.args
    spg = args.steps_per_generation
    args.steps_per_generation, trainer.current_gradient_accumulation_steps = 1, 1
    try:
        trainer.model.zero_grad()
        GRPOTrainer._compute_loss(trainer, trainer.model, batch).backward()
        return _flat_grad(trainer.model)
    finally:
        args.steps_per_generation = spg
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps


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
    one optimizer step, and the control variate c_k = Σ_{i drawn} a_i/π_i (Horvitz–Thompson; Σ_draws a_i/(m p_i) for
    multinomial draws) from the design the sampler reported, whose mean Σ_i a_i is known exactly. A correct trainer
    makes t_k − c_k ≈ 0 draw by draw; a wrong factor or normaliser shifts it by the relative bias."""
    trainer, g = case.trainer, case.target
    first, steps, scale = _coverage(trainer)
    t = torch.empty(draws, dtype=torch.float64)
    c = torch.empty(draws, dtype=torch.float64)
    seen = []
    owners = [m for m in (trainer_module, plan_module) if m is not None and hasattr(m, "draw_rows")]
    originals = [owner.draw_rows for owner in owners]

    def recorded(p, m, scheme, *args, **kwargs):
        out = originals[0](p, m, scheme, *args, **kwargs)
        seen.append((out, scheme))
        return out

    for owner in owners:
        owner.draw_rows = recorded
    try:
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
            draw, scheme = seen.pop()
            assert not seen, "one draw per generation batch"
            a, probs, idx = case.rows, draw.probabilities.double(), draw.indices
            c[k] = (a[idx] / probs[idx]).sum() / (len(idx) if scheme == "multinomial" else 1.0)
    finally:
        for owner, original in zip(owners, originals, strict=True):
            owner.draw_rows = original
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
    "multinomial": dict(cost_aware_draw="multinomial"),
    "group_by_length_pad8": dict(cost_aware_layout="even_by_length", pad_to_multiple_of=8),
    # a zero-advantage group: with β = 0 its rows are outside the support (the draw and the smoothing spread over the
    # 12 informative rows only) and m = 0.9·16 → 14 is capped at 12; with β > 0 they are eligible (KL gradient)
    "zero_signal_support": dict(reward="binary"),
    "zero_signal_capped": dict(reward="binary", cost_aware_kept_fraction=0.9),
    "zero_signal_beta": dict(reward="binary", beta=0.05),
    "token_budget": dict(cost_aware_token_budget=150),
    # kept rows re-cut into full micro-batches (B' = B/f, S' = f·S, G' = f·G): one micro-batch of 8 here
    "full_micro_batches": dict(cost_aware_layout="full"),
    # steps_per_generation = 2 × GA: 4 micro-batches of 2 kept rows, two optimizer steps, summed over the whole
    # generation batch (against 2 × the full-batch gradient, see `_coverage`)
    "spg_2x_ga": dict(spg=4, coverage="generation"),
    # the second pass of num_iterations=2 over the same kept micro-batches, measured alone
    "num_iterations_2_second": dict(num_iterations=2, coverage="second_iteration"),
    # β > 0 with a reference that differs from the policy: the KL term has a gradient (~0.3 ‖g‖ here); the target is
    # the policy term, which the weights make unbiased (the KL term is the kept rows' KL: `test_kl_term_*` below)
    "beta_perturbed_reference": dict(beta=0.1, perturbed_reference=0.05),
}
THREE_LOSSES = ("truncation_mask", "beta", "full_micro_batches", "spg_2x_ga", "beta_perturbed_reference")
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
    if options.get("cost_aware_layout") == "full":  # the layout was applied: 16 rows, one micro-step per step
        assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (16, 1)
    r = run_case(case, CHEAP_DRAWS)
    assert _detects_5_percent(r), r
    assert not r.biased(TOLERANCE), r
    if options.get("reward") == "binary" and "beta" not in options:  # no slot for a zero-signal row
        metrics = trainer._metrics["train"]
        assert set(metrics["cost_aware/kept_informative_fraction"]) == {1.0}
        if options.get("cost_aware_kept_fraction", 0.5) > informative / 16:
            assert set(metrics["cost_aware/batch_rows_kept"]) == {informative}  # m capped at the informative rows


def _patched_constants(monkeypatch, **values):
    """The two wrong-normaliser controls, on the trainer's constants or, once the loss table lives in plan.py, on
    `plan.LOSS_NORMALISERS` (dapo given luspo's normaliser: factor w; bnpo given dr_grpo's: w, TRL's own count)."""
    for name, value in values.items():
        if hasattr(trainer_module, name):
            monkeypatch.setattr(trainer_module, name, value)
            continue
        table = plan_module.LOSS_NORMALISERS
        wrong, right = {"TOKEN_SUM_LOSSES": ("dapo", "luspo"), "MICRO_TOKEN_MEAN_LOSSES": ("bnpo", "dr_grpo")}[name]
        monkeypatch.setitem(table, wrong, table[right])


def _weights_forced_to_one(monkeypatch, trainer):
    original = trainer._draw_kept_rows

    def unweighted(batch):
        idx, factors = original(batch)
        return idx, torch.ones_like(factors)

    monkeypatch.setattr(trainer, "_draw_kept_rows", unweighted)


CONTROLS = {
    "target_plus_5pct": ("grpo", 1.05, {}),
    "target_minus_5pct": ("grpo", 0.95, {}),
    "dapo_factor_w": ("dapo", 1.0, {"TOKEN_SUM_LOSSES": ()}),  # w instead of w·N/m
    "bnpo_as_grpo": ("bnpo", 1.0, {"MICRO_TOKEN_MEAN_LOSSES": ()}),  # no N/m, TRL's own micro-batch token count
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
    trainer = make_trainer(
        warm_model_path, dataset, tmp_path, loss_type=loss_type, micro=micro, cost_aware_layout="even"
    )
    if patch == "ones":
        _weights_forced_to_one(monkeypatch, trainer)
    else:
        _patched_constants(monkeypatch, **patch)
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
    + [("dapo", "beta_perturbed_reference")],
)
def test_new_coverage_weights_one_control_fails(warm_model_path, dataset, tmp_path, monkeypatch, loss_type, name):
    """The cases added for spg = 2 × GA, the second iteration and the perturbed reference see the same deliberate
    error as the rest of the matrix: every weight forced to 1 is flagged."""
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
@pytest.mark.mc_full
@pytest.mark.parametrize(("loss_type", "micro", "options"), MATRIX)
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
