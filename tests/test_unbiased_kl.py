"""The KL term of the cost-aware loss (β > 0, perturbed reference): not reweighted, TRL's KL of the kept rows.

Same fixed generation batch and pipeline as `test_unbiased.py` (whose helpers this module uses). With a perturbed
reference the KL term has a gradient: on every draw it equals TRL's KL term on the kept rows alone, at the full batch's
scale through the β rescaling of batch-token losses (`cost_aware_kl_scale`); dropping the rescaling is the control.
"""

from __future__ import annotations

import pytest
import torch
from test_unbiased import OPTIONS, _flat_grad, _full_batch_grad, fixed_case, make_trainer, plan_module, trainer_module

from trl_costaware.embedded.arithmetic import arithmetic_dataset


@pytest.fixture(scope="module")
def dataset():
    return arithmetic_dataset(64, seed=3)  # as test_unbiased.py's


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
    seen, out = [], []
    owners = [m for m in (trainer_module, plan_module) if m is not None and hasattr(m, "draw_rows")]
    originals = [owner.draw_rows for owner in owners]

    def recorded(*args, **kwargs):
        draw = originals[0](*args, **kwargs)
        seen.append(draw)
        return draw

    for owner in owners:
        owner.draw_rows = recorded
    try:
        for _ in range(draws):
            trainer._buffered_inputs, trainer._step = None, 0
            trainer.model.zero_grad()
            for _ in range(trainer.args.gradient_accumulation_steps):
                inputs = trainer._prepare_inputs(raw)
                zero = dict(inputs, advantages=torch.zeros_like(inputs["advantages"]))
                trainer._compute_loss(trainer.model, zero).backward()
                trainer._step += 1
            out.append((seen.pop().indices.clone(), _flat_grad(trainer.model)))
    finally:
        for owner, original in zip(owners, originals, strict=True):
            owner.draw_rows = original
    return out


def _without_kl_scale(monkeypatch, trainer):
    """The control: β no longer rescaled by T_full / T_kept (`cost_aware_kl_scale`) for batch-token losses."""
    original = trainer._compute_loss

    def unscaled(model, inputs):
        if hasattr(trainer, "_buffer_kl_scale"):
            trainer._buffer_kl_scale = None
        return original(model, {k: v for k, v in inputs.items() if k != "cost_aware_kl_scale"})

    monkeypatch.setattr(trainer, "_compute_loss", unscaled)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_kl_term_is_the_kept_rows_kl_at_full_batch_scale(warm_model_path, dataset, tmp_path, monkeypatch, loss_type):
    """With a perturbed reference the KL term has a gradient, and it is not reweighted: on every draw it equals TRL's
    KL term on the kept rows alone, at the full batch's scale — for dapo that needs the β rescaling by T_full/T_kept
    (`cost_aware_kl_scale`); without it the KL term shrinks to T_kept/T_full of its size, which this test flags.
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
