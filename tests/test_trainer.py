"""Real runs of CostAwareGRPOTrainer on the embedded tiny model (CPU, single process): forward accounting,
equivalence with GRPOTrainer, features, degenerate batches, TRL's options, the deferred passes and their drift guards,
resume of the sampler, and the trainer's shape (one class over GRPOTrainer)."""

from __future__ import annotations

import inspect
import math
import os
import unittest.mock

import pytest
import torch
from testing_utils import (
    constant_reward,
    fixed_batch,
    last_metric,
    length_reward,
    make_config,
    make_trainer,
    record_draws,
    weights_of,
)
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
from trl_costaware.rows.batching import row_lengths
from trl_costaware.rows.deferred import deferred_passes, scoring_window
from trl_costaware.rows.plan import Plan
from trl_costaware.trainer import STATE_FILE


# ---------------------------------------------------------------- the class
def test_one_class_over_grpo_trainer():
    """`CostAwareGRPOTrainer(GRPOTrainer)`: no mixin between the two."""
    assert CostAwareGRPOTrainer.__mro__[1] is GRPOTrainer


# ---------------------------------------------------------------- forward accounting
def test_dropped_rows_never_reach_a_forward(tmp_path, tiny_model_path, dataset):
    """After generation, forward passes (old-policy, reference, policy) see only kept rows, trimmed to width."""
    args = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=4,
        gradient_accumulation_steps=2,  # misaligned with steps_per_generation → TRL needs old-policy log-probs
        beta=0.05,  # → reference log-probs
        max_steps=2,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    seen = []

    def hook(module, args_, kwargs):
        if "labels" in kwargs:  # TRL's log-prob passes; generation calls the model without labels
            seen.append((kwargs["input_ids"].shape, kwargs["attention_mask"].clone(), torch.is_grad_enabled()))

    # The reference model is a separate module when beta > 0 and there is no PEFT adapter.
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in (trainer.model, trainer.ref_model)]
    trainer.train()
    for h in handles:
        h.remove()

    n, m = 8 * 4, 16  # generation batch rows per rank, kept rows
    no_grad_rows = sum(shape[0] for shape, _, grad in seen if not grad)
    grad_rows = sum(shape[0] for shape, _, grad in seen if grad)
    # One generation: old-policy pass + reference pass over the kept rows only (never the n generated rows).
    assert no_grad_rows == 2 * m, no_grad_rows
    # Two optimizer steps × 2 micro-steps × m / steps_per_generation rows.
    assert grad_rows == 2 * 2 * (m // 4), grad_rows
    for _, mask, grad in seen:
        if grad:  # each micro-batch is trimmed to its own longest row: first and last columns are used
            assert mask[:, 0].any() and mask[:, -1].any()
    assert last_metric(trainer, "cost_aware/batch_rows_kept") == m
    assert last_metric(trainer, "cost_aware/batch_rows_generated") == n
    assert last_metric(trainer, "cost_aware/rows_generated") == n  # cumulative, one generation batch
    assert last_metric(trainer, "cost_aware/rows_kept") == m


def test_micro_batches_trimmed_and_grouped_by_length(tmp_path, tiny_model_path, dataset):
    args = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        max_steps=1,
        cost_aware_kept_fraction=1.0,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    widths = []
    trainer.model.register_forward_pre_hook(
        lambda mod, a, kw: widths.append(kw["attention_mask"].sum(-1).tolist()) if "labels" in kw else None,
        with_kwargs=True,
    )
    trainer.train()
    # Grouped: row lengths of different micro-batches do not interleave.
    ranges = sorted((min(w), max(w)) for w in widths)
    for (_, hi1), (lo2, _) in zip(ranges, ranges[1:], strict=False):
        assert hi1 <= lo2
    padded, real = (
        last_metric(trainer, "cost_aware/policy_tokens_padded"),
        last_metric(trainer, "cost_aware/policy_tokens"),
    )
    assert real == sum(sum(w) for w in widths)
    assert padded >= real


# ---------------------------------------------------------------- equivalence
def test_switched_off_equals_grpo_trainer(tmp_path, tiny_model_path, dataset):
    common = dict(max_steps=3, beta=0.02)
    base = GRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "a", cls=GRPOConfig, **common),
        train_dataset=dataset,
    )
    base.train()
    off = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "b", cost_aware=False, **common),
        train_dataset=dataset,
    )
    off.train()
    base_losses = [r["loss"] for r in base.state.log_history if "loss" in r]
    off_losses = [r["loss"] for r in off.state.log_history if "loss" in r]
    assert base_losses == off_losses
    assert torch.equal(weights_of(base.model), weights_of(off.model))
    assert last_metric(off, "cost_aware/policy_tokens") > 0  # the baseline arm still logs its token counters


def test_kept_fraction_one_matches_grpo_trainer_weights(tmp_path, tiny_model_path, dataset):
    """Keeping every row (weights 1) trains like GRPOTrainer, with a KL term and two iterations over each generation
    batch: the same final weights (rows are reordered inside the one micro-batch, so float sums differ slightly)."""
    common = dict(max_steps=2, beta=0.1, num_iterations=2, learning_rate=1e-2)
    base = GRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "a", cls=GRPOConfig, **common),
        train_dataset=dataset,
    )
    start = weights_of(base.model)
    base.train()
    full = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=make_config(tmp_path / "b", cost_aware_kept_fraction=1.0, **common),
        train_dataset=dataset,
    )
    full.train()
    moved = (weights_of(base.model) - start).abs().max()
    assert moved > 1e-3
    # Adam turns float-summation-order differences into ~1e-5 moves on a few weights; a wrong row weight or a missing
    # KL/old-log-prob term would move weights by a sizeable fraction of `moved`.
    torch.testing.assert_close(weights_of(full.model), weights_of(base.model), rtol=0, atol=1e-2 * moved)
    assert last_metric(full, "cost_aware/kept_row_fraction") == 1.0


# ---------------------------------------------------------------- features
@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_iterations=2),
        dict(steps_per_generation=4, gradient_accumulation_steps=2),
        dict(cost_aware_weight_normalization="recenter"),
        dict(cost_aware_token_budget=60),
        dict(cost_aware_cost="completion", cost_aware_proxy="advantage"),
        dict(cost_aware_proxy="uniform"),
        dict(loss_type="dapo", beta=0.05),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_feature_runs(tmp_path, tiny_model_path, dataset, overrides):
    trainer = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward, arithmetic_reward],
        args=make_config(tmp_path, **overrides),
        train_dataset=dataset,
    )
    before = weights_of(trainer.model)
    trainer.train()
    assert not torch.equal(before, weights_of(trainer.model))
    ess = last_metric(trainer, "cost_aware/weight_ess")
    m = last_metric(trainer, "cost_aware/kept_row_fraction") * last_metric(trainer, "cost_aware/batch_rows_generated")
    assert 0 < ess <= m + 1e-6  # ESS ≤ number of weights
    for key in ("j_ratio_ideal", "j_ratio_achieved", "kept_token_fraction", "informative_fraction"):
        assert math.isfinite(last_metric(trainer, f"cost_aware/{key}"))
    # Rollout tokens count prompt + completion whatever the sampling cost is made of.
    assert last_metric(trainer, "cost_aware/rollout_tokens") > last_metric(trainer, "cost_aware/generated_tokens")


def test_lora(tmp_path, tiny_model_path, dataset):
    from peft import LoraConfig

    args = make_config(tmp_path, beta=0.05)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=args, train_dataset=dataset, peft_config=peft_config
    )
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if "lora_B" in n and not torch.equal(p, lora[n])]
    assert changed
    assert last_metric(trainer, "cost_aware/kept_row_fraction") == 0.5  # the default fraction dropped rows


def test_conversational_prompts(tmp_path, tiny_model_path):
    ds = arithmetic_dataset(32, seed=1, conversational=True)
    trainer = CostAwareGRPOTrainer(
        tiny_model_path, [arithmetic_reward, length_reward], args=make_config(tmp_path), train_dataset=ds
    )
    seen = record_draws(trainer)
    trainer.train()
    for batch, indices, _ in seen:  # 0.5 of 8 rows, at most the informative ones
        assert len(indices) == min(4, max(1, int((batch["advantages"] != 0).sum())))


def test_resume_draws_the_same_rows(tmp_path, tiny_model_path, dataset):
    common = dict(
        max_steps=4, save_strategy="steps", save_steps=2, steps_per_generation=2, gradient_accumulation_steps=1
    )
    straight = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=make_config(tmp_path / "a", **common), train_dataset=dataset
    )
    straight.train()
    resumed = CostAwareGRPOTrainer(
        tiny_model_path, [length_reward], args=make_config(tmp_path / "a", **common), train_dataset=dataset
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    torch.testing.assert_close(weights_of(straight.model), weights_of(resumed.model))
    assert last_metric(straight, "cost_aware/policy_tokens") == last_metric(resumed, "cost_aware/policy_tokens")


# ---------------------------------------------------------------- degenerate batches
def test_all_rewards_equal(tmp_path, tiny_model_path, dataset):
    trainer = CostAwareGRPOTrainer(
        tiny_model_path, [constant_reward], args=make_config(tmp_path, beta=0.0), train_dataset=dataset
    )
    before = weights_of(trainer.model)
    trainer.train()
    assert last_metric(trainer, "cost_aware/informative_fraction") == 0.0
    assert last_metric(trainer, "cost_aware/zero_signal_ranks") == 1.0
    assert last_metric(trainer, "cost_aware/j_ratio_ideal") == 1.0
    # Zero advantages: the policy term is zero, so an Adam step moves nothing.
    torch.testing.assert_close(before, weights_of(trainer.model))


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_one_token_and_truncated_completions(tmp_path, tiny_model_path, dataset, mask_truncated):
    args = make_config(tmp_path, max_completion_length=1, mask_truncated_completions=mask_truncated)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.train()
    assert math.isfinite(last_metric(trainer, "loss"))
    # Every generated token is counted, whether or not a truncation mask hides it from the loss.
    assert last_metric(trainer, "cost_aware/rollout_tokens") == trainer.state.num_input_tokens_seen


# ---------------------------------------------------------------- config
def test_plain_grpo_config_is_rejected(tmp_path, tiny_model_path, dataset):
    with pytest.raises(TypeError, match="CostAwareGRPOConfig"):
        CostAwareGRPOTrainer(
            tiny_model_path, [length_reward], args=make_config(tmp_path, cls=GRPOConfig), train_dataset=dataset
        )


def test_cost_callable_and_import_path(tmp_path, tiny_model_path, dataset):
    calls = []

    def flops(prompt_mask, completion_mask):
        calls.append(len(prompt_mask))
        return (prompt_mask.sum(-1) + 2 * completion_mask.sum(-1)).float()

    args = make_config(tmp_path, cost_aware_cost="trl_costaware.rows.sampling:sequence_costs")
    args.cost_aware_cost = flops  # a callable works from Python
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.train()
    assert calls


def test_model_loads_by_path_like_a_hub_id(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert sum(p.numel() for p in model.parameters()) > 0


# ---------------------------------------------------------------- TRL's options
@pytest.mark.parametrize("cost_aware", [True, False])
def test_truncation_mask_rows_never_drawn_and_tokens_counted(tmp_path, tiny_model_path, dataset, cost_aware):
    """mask_truncated_completions=True: rows whose loss mask is empty are never drawn while other rows can carry
    gradient, and the counters still count every generated token (TRL's own count is the reference)."""
    args = make_config(
        tmp_path,
        max_completion_length=6,
        mask_truncated_completions=True,
        max_steps=3,
        cost_aware=cost_aware,
        cost_aware_kept_fraction=0.5,
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    seen = record_draws(trainer)
    trainer.train()
    assert last_metric(trainer, "cost_aware/rollout_tokens") == trainer.state.num_input_tokens_seen
    if not cost_aware:
        return
    truncated = 0
    for batch, indices, _ in seen:
        loss_tokens = batch["completion_mask"].sum(-1)
        truncated += int((loss_tokens == 0).sum())
        assert (loss_tokens[indices] > 0).all(), (loss_tokens, indices)
    assert truncated > 0  # the setting did truncate rows


def test_no_slot_for_zero_signal_rows(tmp_path, tiny_model_path, dataset):
    """β = 0, no entropy term: rows with A = 0 carry nothing, so they get no probability (smoothing included) and m
    never exceeds the informative rows (rounded down to a multiple of steps_per_generation). With β > 0 they carry the
    KL gradient and are drawn."""
    args = make_config(tmp_path, max_steps=4, cost_aware_kept_fraction=1.0, cost_aware_smoothing=0.5)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    seen = record_draws(trainer)
    trainer.train()
    some_zero = False
    for batch, indices, _ in seen:
        informative = batch["advantages"] != 0
        some_zero |= bool((~informative).any())
        assert informative[indices].all()
        assert len(indices) == max(1, int(informative.sum()))
    assert some_zero  # the check had zero-advantage rows to avoid

    args = make_config(tmp_path / "kl", max_steps=2, beta=0.1, cost_aware_kept_fraction=1.0)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    seen = record_draws(trainer)
    trainer.train()
    assert all(len(indices) == len(batch["advantages"]) for batch, indices, _ in seen)


@pytest.mark.parametrize("layout", ["even", "packed"])
@pytest.mark.parametrize("rule", ["fraction", "token_budget"])
def test_kept_rows_follow_the_configured_rule(tmp_path, tiny_model_path, dataset, rule, layout):
    """m from the fraction (rounded down to steps_per_generation under the even layout, to 1 under the packed one) or
    from the token budget (budget / E_p[c]), then capped by the informative rows; β > 0 so every row is eligible and
    the cap does not bind."""
    from trl_costaware.rows.sampling import sampling_distribution, sampling_scores, sequence_costs

    # the expected count below is computed with the |A|/√c scores
    overrides = dict(
        steps_per_generation=2, gradient_accumulation_steps=2, max_steps=4, beta=0.05, cost_aware_proxy="advantage"
    )
    multiple = 2 if layout == "even" else 1
    if rule == "fraction":
        overrides["cost_aware_kept_fraction"] = 0.7  # 0.7 · 16 = 11.2 → 11 (packed) → 10 (even: multiple of 2)
    else:
        overrides["cost_aware_token_budget"] = 90  # a few rows of ~20 tokens: far from the default fraction's 8
    trainer = make_trainer(tiny_model_path, tmp_path, dataset=dataset, layout=layout, **overrides)
    seen = record_draws(trainer)
    trainer.train()
    assert seen
    for batch, indices, _ in seen:
        n = len(batch["advantages"])
        if rule == "fraction":
            expected = 10 if layout == "even" else 11
        else:
            costs = sequence_costs(batch["prompt_mask"], batch["completion_mask"])
            p = sampling_distribution(sampling_scores(batch["advantages"], costs), 0.1)
            expected = int(90 // float((p * costs.double()).sum()))
            expected = max(multiple, min(n, expected) // multiple * multiple)
            assert expected != n // 2, "retune the budget: it gives the default fraction's count"
        assert len(indices) == expected


@pytest.mark.parametrize(("bf16", "layout"), [(False, "even"), (True, "even"), (False, "packed")])
def test_deferred_old_logps_equal_policy_logps_at_first_micro_step(tmp_path, tiny_model_path, dataset, bf16, layout):
    """num_iterations=1, steps_per_generation = 2 × gradient_accumulation_steps: TRL needs old-policy log-probs, and
    before the first update they must equal the policy pass's exactly (ratio 1, as in TRL), in bf16 too, and on the
    packed layout's micro-batches (its no-op micro-steps carry none: they train on nothing)."""
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        dataset=dataset,
        layout=layout,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        bf16=bf16,
        beta=0.05,
    )
    pairs = []
    original_loss = trainer._compute_loss
    original_logps = trainer._get_per_token_logps_and_entropies

    def logps(model, *a, **kw):
        out = original_logps(model, *a, **kw)
        if kw.get("compute_entropy"):  # the policy pass
            pairs[-1]["new"] = out[0].detach()
        return out

    def loss(model, inputs):
        if trainer._cost_aware.generation.micro_step(trainer._step % 4).noop:
            return original_loss(model, inputs)
        pairs.append({"old": inputs["old_per_token_logps"], "ref": inputs["ref_per_token_logps"]})
        pairs[-1]["mask"] = inputs["completion_mask"].bool()
        return original_loss(model, inputs)

    trainer._compute_loss, trainer._get_per_token_logps_and_entropies = loss, logps
    trainer.train()
    # two micro-steps before the first (and only) optimizer step; packed: the real ones among them (at least the last)
    real = [not step.noop for step in trainer._cost_aware.generation.micro_steps[:2]]
    assert real[-1] and len(pairs) == sum(real) and (layout == "packed" or len(pairs) == 2)
    for pair in pairs:
        assert torch.equal(pair["old"][pair["mask"]], pair["new"][pair["mask"]])
        assert torch.equal(pair["ref"][pair["mask"]], pair["new"][pair["mask"]])  # ref = policy before any update
    if bf16:
        assert pairs[0]["new"].dtype == torch.float32  # log-probs are float32 from a bf16 autocast forward


def test_deferred_logps_match_trls_by_value(tmp_path, tiny_model_path, dataset):
    """The deferred old-policy log-probs of each kept row equal what TRL computes for that row on the full batch."""
    args = make_config(
        tmp_path, steps_per_generation=2, gradient_accumulation_steps=1, max_steps=1, cost_aware_kept_fraction=0.5
    )
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    raw = [dataset[i] for i in range(16)]
    full = GRPOTrainer._generate_and_score_completions(trainer, raw)
    assert "old_per_token_logps" in full  # TRL computed them for every row
    with unittest.mock.patch.object(GRPOTrainer, "_generate_and_score_completions", fixed_batch(full)):
        trainer._prepare_inputs(raw)
    key = lambda ids, mask: tuple(ids[mask.bool()].tolist())  # noqa: E731
    trl_rows = {
        key(torch.cat([p, c]), torch.cat([pm, cm])): (lp[cm.bool()])
        for p, c, pm, cm, lp in zip(
            full["prompt_ids"],
            full["completion_ids"],
            full["prompt_mask"],
            full["completion_mask"],
            full["old_per_token_logps"],
            strict=True,
        )
    }
    checked = 0
    for chunk in trainer._buffered_inputs:  # the processed micro-batches replace TRL's buffer
        for p, c, pm, cm, lp in zip(
            chunk["prompt_ids"],
            chunk["completion_ids"],
            chunk["prompt_mask"],
            chunk["completion_mask"],
            chunk["old_per_token_logps"],
            strict=True,
        ):
            torch.testing.assert_close(lp[cm.bool()], trl_rows[key(torch.cat([p, c]), torch.cat([pm, cm]))])
            checked += 1
    assert checked == 8


def test_pad_to_multiple_of_is_kept(tmp_path, tiny_model_path, dataset):
    args = make_config(tmp_path, pad_to_multiple_of=8, steps_per_generation=2, gradient_accumulation_steps=2)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    widths = []
    trainer.model.register_forward_pre_hook(
        lambda mod, a, kw: widths.append(kw["input_ids"].shape[1]) if "labels" in kw else None, with_kwargs=True
    )
    trainer.train()
    assert widths and all(w % 8 == 0 for w in widths), widths


def test_missing_chunk_fails_loudly(tmp_path, tiny_model_path, dataset):
    """TRL's micro-batch is matched to its processed one by TRL's own index (_step % steps_per_generation), checked:
    a TRL that indexed its buffer otherwise fails loudly instead of training on an unweighted micro-batch."""
    args = make_config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    raw = [dataset[i] for i in range(8)]
    original = GRPOTrainer._prepare_inputs

    def other_index(self, batch):  # a TRL returning the buffer's other entry
        original(self, batch)
        return self._buffered_inputs[1 - self._step % 2]

    with unittest.mock.patch.object(GRPOTrainer, "_prepare_inputs", other_index):
        with pytest.raises(RuntimeError, match="_step % steps_per_generation"):
            trainer._prepare_inputs(raw)


def test_processed_micro_batches_replace_trls_buffer(tmp_path, tiny_model_path, dataset):
    """No id() matching: after the first micro-step TRL indexes the processed list itself."""
    args = make_config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2)
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    trainer.model.train()
    raw = [dataset[i] for i in range(8)]
    first = trainer._prepare_inputs(raw)
    assert (
        trainer._buffered_inputs is trainer._cost_aware.generation.micro_batches
        and first is trainer._buffered_inputs[0]
    )
    trainer._step = 1
    assert trainer._prepare_inputs(raw) is trainer._buffered_inputs[1]
    assert "cost_aware_rows" not in first  # the host bookkeeping never reaches the loss


def test_unknown_loss_type_is_refused_at_construction(tmp_path, tiny_model_path, dataset, monkeypatch):
    """A loss type without a derived normaliser (e.g. one a later TRL adds) is refused before the model loads, naming
    the field and the allowed values; it used to get the row-mean factor silently (off by N/m for a token sum)."""
    args = make_config(tmp_path)
    monkeypatch.setattr(args, "loss_type", "token_sum_v2")  # as a newer TRL's config would accept
    with pytest.raises(ValueError, match="loss_type='token_sum_v2'.*'grpo'"):
        CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset)
    args.cost_aware = False  # plain GRPO is TRL's business
    with pytest.raises(ValueError, match="Unknown loss type|token_sum_v2"):
        CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=args, train_dataset=dataset).train()


def test_multimodal_processor_is_refused_before_the_model_loads(tmp_path, dataset, monkeypatch):
    """A library user's model path whose processor is multimodal is refused from the processor files alone, before
    `GRPOTrainer.__init__` loads any weights (it used to be refused only after the model had loaded); so is a
    multimodal processor passed in."""
    import transformers
    from transformers import ProcessorMixin
    from trl.trainer import grpo_trainer

    class VisionProcessor(ProcessorMixin):
        pass

    def load_weights(*args, **kwargs):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(grpo_trainer, "create_model_from_path", load_weights)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: object.__new__(VisionProcessor))
    args = make_config(tmp_path)
    with pytest.raises(NotImplementedError, match="multimodal processor"):
        CostAwareGRPOTrainer("some/vlm", [length_reward], args=args, train_dataset=dataset)
    with pytest.raises(NotImplementedError, match="multimodal processor"):
        CostAwareGRPOTrainer(
            "some/vlm",
            [length_reward],
            args=args,
            train_dataset=dataset,
            processing_class=VisionProcessor.__new__(VisionProcessor),
        )
    args.cost_aware = False  # plain GRPO is TRL's business: it goes on to load the model
    with pytest.raises(AssertionError, match="weights were loaded"):
        CostAwareGRPOTrainer("some/vlm", [length_reward], args=args, train_dataset=dataset)


def test_text_processor_loaded_as_trl_loads_it(tmp_path, tiny_model_path, dataset):
    """For a model path the trainer loads the processor before the model, as TRL does (left padding and truncation)."""
    trainer = CostAwareGRPOTrainer(tiny_model_path, [length_reward], args=make_config(tmp_path), train_dataset=dataset)
    assert trainer.processing_class.padding_side == "left"
    assert trainer.processing_class.truncation_side == "left"


# ---------------------------------------------------------------- resume: the sampler's state
@pytest.mark.slow
def test_resume_with_ignore_data_skip_restores_the_sampler(tmp_path, tiny_model_path, dataset):
    """`ignore_data_skip=True` restarts the data, not the sampler: its generators and counters come back from the
    checkpoint: `_load_cost_aware_state`, called from `_load_optimizer_and_scheduler`, restores them on every resume
    (they were once restored in `_load_rng_state` only, which HF's Trainer may skip)."""
    common = dict(max_completion_length=8, max_steps=4, save_strategy="steps", save_steps=2, steps_per_generation=2)
    first = make_trainer(tiny_model_path, tmp_path, dataset=dataset, **common)
    first.train()
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-2")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)

    resumed = make_trainer(tiny_model_path, tmp_path, dataset=dataset, ignore_data_skip=True, **common)
    states = []
    original = resumed._draw_kept_rows

    def draw(batch):
        states.append((resumed._cost_aware.sampler.get_state(), dict(resumed._cost_aware.totals)))
        return original(batch)

    resumed._draw_kept_rows = draw
    resumed.train(resume_from_checkpoint=checkpoint)
    generator, totals = states[0]  # at the first draw after the resume
    assert torch.equal(generator, saved["generator"])
    assert totals == saved["totals"] and totals["rows_generated"] > 0
    final = [r for r in resumed.state.log_history if "cost_aware/rows_generated" in r][-1]
    assert final["cost_aware/rows_generated"] == 2 * saved["totals"]["rows_generated"]


# ---------------------------------------------------------------- the deferred passes' placeholder and drift guards
@pytest.mark.slow
def test_user_code_during_scoring_gets_real_log_probs(tmp_path, tiny_model_path, dataset):
    """A reward function that calls `_get_per_token_logps_and_entropies` while TRL scores the batch gets the real
    log-probabilities; TRL's own passes still get the placeholder (they are deferred to the kept rows)."""
    holder = {}
    seen = []

    def reward_calling_the_model(completions, **kwargs):
        trainer = holder["trainer"]
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3)[0]
        seen.append(logps)
        return length_reward(completions)

    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        rewards=[reward_calling_the_model],
        dataset=dataset,
        max_completion_length=8,
        max_steps=1,
        beta=0.04,
        steps_per_generation=2,
        gradient_accumulation_steps=1,
    )
    holder["trainer"] = trainer
    trainer.train()
    assert seen and all(torch.isfinite(x).all() for x in seen)
    assert math.isfinite(last_metric(trainer, "loss"))


def test_placeholder_only_between_generation_and_rewards(tmp_path, tiny_model_path, dataset):
    """Inside `deferred.scoring_window`, `_get_per_token_logps_and_entropies` gives the NaN placeholder only after
    `_generate` has returned and before `_calculate_rewards`: generation and reward functions get real values, and
    outside the window (the trainer's own deferred passes, the loss) every call is real. No stack inspection."""
    trainer = make_trainer(tiny_model_path, tmp_path, dataset=dataset, max_completion_length=4)
    ids = torch.ones(2, 5, dtype=torch.long)
    model = trainer.model

    def call():
        return trainer._get_per_token_logps_and_entropies(model, ids, torch.ones_like(ids), 3)[0]

    real = {"generate": None, "rewards": None}
    with unittest.mock.patch.object(GRPOTrainer, "_generate", lambda self, *a, **k: real.update(generate=call())):
        with unittest.mock.patch.object(
            GRPOTrainer, "_calculate_rewards", lambda self, *a, **k: real.update(rewards=call())
        ):
            assert torch.isfinite(call()).all() and trainer._cost_aware.deferring is None
            with scoring_window(trainer._cost_aware):
                assert torch.isfinite(call()).all()  # before generation
                trainer._generate([])
                assert torch.isnan(call()).all()  # TRL's passes
                trainer._calculate_rewards([], [], [], [])
                assert torch.isfinite(call()).all()  # after the rewards
            assert trainer._cost_aware.deferring is None and torch.isfinite(call()).all()
    assert torch.isfinite(real["generate"]).all() and torch.isfinite(real["rewards"]).all()


def test_trl_indexes_the_buffer_it_splits():
    """Drift guard for the trainer's one write to TRL's buffer (`_process_new_buffer`): TRL's `_prepare_inputs`
    scores a generation batch, assigns its split to `self._buffered_inputs` once, then returns the entry at
    `self._step % self.args.steps_per_generation` (so the processed list, written over it, is what TRL indexes)."""
    source = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert source.count("self._buffered_inputs = ") == 1
    scored = source.index("self._generate_and_score_completions(")
    assigned = source.index("self._buffered_inputs = ")
    indexed = source.index("self._buffered_inputs[self._step % self.args.steps_per_generation]")
    assert scored < assigned < indexed


def test_trl_runs_its_passes_between_generate_and_rewards():
    """Drift guard for `scoring_window`: TRL's scoring calls `self._generate(` once, then its log-prob passes, then
    `self._calculate_rewards(`."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    gen, rewards = source.index("self._generate("), source.index("self._calculate_rewards(")
    passes = [i for i in range(len(source)) if source.startswith("self._get_per_token_logps_and_entropies(", i)]
    assert source.count("self._generate(") == 1 and source.count("self._calculate_rewards(") == 1
    assert passes and all(gen < i < rewards for i in passes)


@pytest.mark.slow
def test_deferred_pass_condition_is_trls(tmp_path, tiny_model_path, dataset):
    """`deferred.deferred_passes` re-derives when TRL's scoring runs its old-policy and reference passes: for each
    setting, the passes TRL itself runs (seen through `_get_per_token_logps_and_entropies`) are the ones it says."""
    trainer = make_trainer(tiny_model_path, tmp_path, dataset=dataset, max_completion_length=8, beta=0.04)
    trainer.model.train()
    raw = [dataset[i] for i in range(8)]
    calls = []

    def record(model, *a, **kw):
        calls.append("ref" if model is trainer.ref_model else "old")
        ids = a[0]
        return torch.zeros(ids.size(0), a[2]), None, None

    trainer._get_per_token_logps_and_entropies = record
    settings = [  # (gradient_accumulation_steps, steps_per_generation, num_iterations, beta)
        (1, 1, 1, 0.04),
        (1, 2, 1, 0.0),
        (2, 1, 1, 0.0),
        (2, 2, 2, 0.04),
        (4, 2, 2, 0.0),
    ]
    for accumulation, spg, iterations, beta in settings:
        trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation = accumulation, spg
        trainer.num_iterations, trainer.beta = iterations, beta
        calls.clear()
        GRPOTrainer._generate_and_score_completions(trainer, raw)
        expected = deferred_passes(accumulation, spg, iterations, False, beta)
        assert ("old" in calls, "ref" in calls) == expected, (accumulation, spg, iterations, beta)


# ---------------------------------------------------------------- a subclass's own row rule
class OwnDrawTrainer(CostAwareGRPOTrainer):
    """A subclass's own draw (every row, weight 1): no plan, so the trainer counts the kept tokens itself (the plan's
    other counters are the subclass's to keep)."""

    def _draw_kept_rows(self, batch):
        n = len(batch["completion_ids"])
        return Plan(torch.arange(n), torch.ones(n))


@pytest.mark.parametrize("cls", [CostAwareGRPOTrainer, OwnDrawTrainer])
def test_the_counters_gather_sends_the_same_keys_with_or_without_a_plan(tmp_path, tiny_model_path, dataset, cls):
    """Per generation batch the layout's counts (per micro-step position) go through ONE gather; its keys must not
    depend on whether this rank's draw came from the plan (a rank that sends an extra key would gather a tensor of
    another shape than its peers). With the subclass's draw the trainer counts the kept tokens itself."""
    trainer = make_trainer(tiny_model_path, tmp_path, cls=cls, dataset=dataset, max_completion_length=8, max_steps=1)
    sent = []
    gather = trainer._sum_over_ranks

    def recording(values, device):
        sent.append(sorted(values))
        return gather(values, device)

    trainer._sum_over_ranks = recording
    trainer.train()
    layout_gathers = [keys for keys in sent if "policy_tokens_padded/0" in keys]
    positions = trainer.args.steps_per_generation
    names = ("metric_rows", "metric_tokens", "policy_tokens", "policy_tokens_padded")
    assert layout_gathers == [sorted(f"{name}/{p}" for name in names for p in range(positions))]
    totals = trainer._cost_aware.totals
    assert 0 < totals["policy_tokens"] <= totals["policy_tokens_padded"]
    if cls is OwnDrawTrainer:  # counted by the trainer; the plan's other counters are the subclass's to keep
        assert totals["rows_kept"] == 0
    else:
        assert totals["policy_tokens"] < totals["rollout_tokens"]


@pytest.mark.parametrize(
    "settings",
    [{}, {"layout": "even"}, {"cost_aware": False}, {"num_iterations": 2}],
    ids=["packed", "even", "grpo", "mu2"],
)
def test_counters_equal_the_tokens_trained_up_to_each_logged_step(tmp_path, tiny_model_path, dataset, settings):
    """steps_per_generation = 2 x gradient_accumulation_steps: each generation batch spans two optimizer steps. The
    logged policy-token counters equal the tokens of the micro-batches trained up to each logged step (before the
    fix a batch's tokens were added when it was drawn, so the axis ran a step ahead of training); the generation
    counters are added when a batch is generated."""
    settings = dict(settings)
    layout = settings.pop("layout", None)
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        dataset=dataset,
        layout=layout,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        max_steps=4,
        max_completion_length=8,
        **settings,
    )
    trained = {"policy_tokens": [0.0] * 5, "policy_tokens_padded": [0.0] * 5}
    original = trainer._compute_loss

    def loss(model, inputs):
        if not trainer._cost_aware.generation.micro_step(trainer._step % 4).noop:  # a no-op skips the model here
            step = trainer.state.global_step + 1
            trained["policy_tokens"][step] += float(row_lengths(inputs).sum())
            trained["policy_tokens_padded"][step] += inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
        return original(model, inputs)

    trainer._compute_loss = loss
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for key, per_step in trained.items():
        cumulative = [sum(per_step[: row["step"] + 1]) for row in rows]
        assert [row[f"cost_aware/{key}"] for row in rows] == cumulative, key
        assert 0 < cumulative[0] < cumulative[1], key
    # the generation counters: a batch of 16 rows generated at steps 1 and 3 (every 2 x num_iterations steps)
    iterations = settings.get("num_iterations", 1)
    expected = [16, 16, 32, 32] if iterations == 1 else [16, 16, 16, 16]
    assert [row["cost_aware/rows_generated"] for row in rows] == expected


def test_model_card_cites_the_cost_aware_paper():
    assert CostAwareGRPOTrainer._paper["id"] == "2604.28020" != GRPOTrainer._paper["id"]
    assert "Cost-Aware Learning" in CostAwareGRPOTrainer._paper["citation"]


def test_the_trainers_own_state_is_one_attribute(tmp_path, tiny_model_path, dataset):
    """Beyond `GRPOTrainer`'s attributes the trainer adds exactly one, `_cost_aware` (before: six scattered names,
    any of which a future TRL attribute could shadow)."""
    ours = make_trainer(tiny_model_path, tmp_path / "a", dataset=dataset)
    base = make_trainer(tiny_model_path, tmp_path / "b", dataset=dataset, cls=GRPOTrainer)
    assert set(vars(ours)) - set(vars(base)) == {"_cost_aware"}


def test_micro_steps_are_found_by_position_not_by_tensor(tmp_path, tiny_model_path, dataset):
    """A subclass whose `_prepare_inputs` hands on copies of the micro-batch's tensors still gets each micro-step's
    `MicroStep` (before: a lookup by tensor identity missed them, so the packed metrics went unweighted and no-op
    micro-steps ran TRL's loss)."""

    class Copying(CostAwareGRPOTrainer):
        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        cls=Copying,
        dataset=dataset,
        max_steps=1,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
    )
    seen = []
    original = trainer._token_weighted_metrics

    def record():
        seen.append(list(trainer._cost_aware.metric_weights))
        original()

    trainer._token_weighted_metrics = record
    trainer.train()
    steps = trainer._cost_aware.generation.micro_steps
    real = [step for step in steps if not step.noop]
    assert trainer._cost_aware.layout == "packed" and len(real) < len(steps)  # the draw left no-op positions
    assert len(seen[0]) == len(real)  # every real micro-step's weights, found by position
