"""The layout a trainer runs is its own (`trainer._layout`): a router aux loss makes `cost_aware_layout="auto"` fall
back to the even layout without rewriting the user's config, with a warning true of the even layout, and the plan
rounds the kept rows to the even layout's unit."""

from __future__ import annotations

import warnings

import pytest
import torch

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.embedded.tokenizer import build_tokenizer


def length_reward(completions, **kwargs):
    return [float(len(c) % 4) for c in completions]


def tiny_moe():
    """A 1-layer, 2-expert Mixtral on the embedded tokenizer: TRL turns its router aux loss on."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = build_tokenizer()
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=128,
        router_aux_loss_coef=0.01,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,  # S = G = 4, one row per micro-batch: the packed layout could drop rows
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        seed=0,
        cost_aware_kept_fraction=0.5,
    )
    kwargs.update(overrides)
    return CostAwareGRPOConfig(**kwargs)


def test_auto_falls_back_to_even_without_rewriting_args_and_says_what_it_keeps(tmp_path):
    model, tokenizer = tiny_moe()
    with warnings.catch_warnings(record=True) as config_warnings:
        warnings.simplefilter("always")
        args = _args(tmp_path)
    assert not [w for w in config_warnings if "keeps" in str(w.message)]  # packed: 2 of 4 rows, as asked
    with pytest.warns(UserWarning, match="uses the even layout") as caught:
        trainer = CostAwareGRPOTrainer(
            model, [length_reward], args=args, train_dataset=arithmetic_dataset(8, seed=0), processing_class=tokenizer
        )
    assert trainer.aux_loss_enabled
    assert args.cost_aware_layout == "auto"  # the user's config is left as given
    assert trainer._layout == "even"
    (message,) = [str(w.message) for w in caught if "uses the even layout" in str(w.message)]
    # True of the layout that runs: at one row per micro-batch the even layout keeps every row.
    assert "keeps 4/4 = 1.00" in message and "cost_aware_layout='even'" in message
    assert "lifts the even layout's limit" not in message  # the packed layout is not available to this model
    trainer.train()
    kept = [
        row["cost_aware/kept_row_fraction"]
        for row in trainer.state.log_history
        if "cost_aware/kept_row_fraction" in row
    ]
    assert kept == [1.0]  # the plan rounded m to the even layout's unit (S = 4), as the warning said


def test_packed_by_name_is_refused_with_a_router_aux_loss(tmp_path):
    model, tokenizer = tiny_moe()
    with pytest.raises(ValueError, match="router aux loss"):
        CostAwareGRPOTrainer(
            model,
            [length_reward],
            args=_args(tmp_path, cost_aware_layout="packed"),
            train_dataset=arithmetic_dataset(8, seed=0),
            processing_class=tokenizer,
        )
