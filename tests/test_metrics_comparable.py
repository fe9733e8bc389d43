"""What the trainer returns and logs, against GRPOTrainer on the same tiny run: `evaluate()` and `train()` return
GRPOTrainer's keys (the cumulative counters go on the logged rows only), every logged value is a plain number (also
with evaluations between logging steps, then a checkpoint), and under the packed layout TRL's per-micro-batch metrics
are means over the step's tokens."""

from __future__ import annotations

import json
import numbers
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from testing_utils import length_reward, make_config, make_trainer, tiny_dataset
from trl import GRPOConfig, GRPOTrainer

from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer


def _args(tmp_path, cls, **overrides):
    settings = dict(per_device_eval_batch_size=8, max_completion_length=10, max_steps=1)
    return make_config(tmp_path, cls, **{**settings, **overrides})


# ---------------------------------------------------------------------------------------------------- returned keys
@pytest.mark.parametrize(
    "shape",
    [{}, {"max_steps": 3, "logging_steps": 2, "disable_tqdm": True}],
    ids=["one-step", "open-window-no-tqdm"],
)
@pytest.mark.parametrize("cost_aware", [True, False])
def test_evaluate_and_train_return_grpo_trainers_keys(tmp_path, tiny_model_path, cost_aware, shape):
    """transformers returns the dict it passed to `log`: the counters must not land in it (a hyperparameter search's
    `default_compute_objective` sums every metric), while the logged rows still carry them. Also when training ends
    with a logging window open (its per-batch `cost_aware/*` means must not reach the returned metrics) and without
    tqdm (transformers' PrinterCallback then deletes `total_flos` from the dict it is given)."""
    train, evaluation = tiny_dataset(16), tiny_dataset(8, seed=1)
    base = GRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=_args(tmp_path / "a", GRPOConfig, **shape),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    base_train = base.train().metrics
    base_eval = base.evaluate()
    ours = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=_args(tmp_path / "b", CostAwareGRPOConfig, cost_aware=cost_aware, **shape),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    our_train = ours.train().metrics
    our_eval = ours.evaluate()
    assert sorted(our_eval) == sorted(base_eval)
    assert sorted(our_train) == sorted(base_train)
    # The logged rows (W&B, log_history) carry the counters, on train and eval rows alike.
    eval_rows = [row for row in ours.state.log_history if "eval_loss" in row]
    train_rows = [row for row in ours.state.log_history if "loss" in row]
    assert eval_rows and train_rows
    for row in (eval_rows[-1], train_rows[-1]):
        assert row["cost_aware/policy_tokens"] > 0 and row["cost_aware/rows_generated"] > 0


def test_callbacks_keep_the_row_they_were_given(tmp_path, tiny_model_path):
    """A callback that keeps the dict `on_log` hands it finds it as it was, counters included (before the fix the
    trainer deleted the counters from that very dict once the callbacks had returned)."""
    from transformers import TrainerCallback

    seen = []

    class Keep(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append((logs, dict(logs)))

    trainer = make_trainer(tiny_model_path, tmp_path, dataset=tiny_dataset(16), max_steps=2)
    trainer.add_callback(Keep())
    trainer.train()
    assert len(seen) == 3  # two steps and the end of training
    for kept, at_the_time in seen:
        assert kept == at_the_time and kept["cost_aware/policy_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("cost_aware", [True, False])
def test_eval_between_logging_steps_then_checkpoint(tmp_path, tiny_model_path, cost_aware):
    """eval_steps=2, logging_steps=5, save_steps=6: an evaluation-time `log` inside an open train window leaves no
    device tensor in the logged rows (TRL's `TrainerState.save_to_json` serialises `log_history`), and the
    checkpoint's trainer_state.json is written."""
    trainer = make_trainer(
        tiny_model_path,
        tmp_path,
        dataset=tiny_dataset(32),
        eval_dataset=tiny_dataset(4, seed=1),
        cost_aware=cost_aware,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_completion_length=6,
        max_steps=6,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=6,
        max_grad_norm=1e-8,
    )
    trainer.train()
    rows = trainer.state.log_history
    assert any("eval_loss" in row for row in rows) and any("loss" in row for row in rows)
    for row in rows:
        for key, value in row.items():
            assert value is None or isinstance(value, (numbers.Number, str)), (key, type(value))
    with open(os.path.join(trainer.args.output_dir, "checkpoint-6", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 6


# ---------------------------------------------------------------------------------------------------- packed metrics
# TRL's per-micro-batch metrics that are a global masked mean (`global_masked_mean` in `GRPOTrainer._compute_loss`):
# a mean over the micro-batch's loss tokens, or over its rows for a per-sequence value.
TOKEN_MEANS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class RecordingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer recording, per training micro-batch, its loss tokens and the metric values TRL appended for it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []

    def _compute_loss(self, model, inputs):
        metrics = self._metrics["train"]
        before = {key: len(values) for key, values in metrics.items()}
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            mask = inputs["completion_mask"]
            mask = mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
            new = {k: v[before.get(k, 0) :] for k, v in metrics.items() if len(v) > before.get(k, 0)}
            self.records.append((self.state.global_step, float(mask.sum()), new))
        return loss


def _token_means(records, key):
    """Per optimizer step: the mean of `key` over the step's loss tokens, from GRPOTrainer's micro-batch values."""
    steps = {}
    for step, tokens, new in records:
        if key in new:
            (value,) = new[key]
            total, weight = steps.get(step, (0.0, 0.0))
            steps[step] = (total + tokens * value, weight + tokens)
    return [total / weight for _, (total, weight) in sorted(steps.items())]


def test_packed_layouts_metrics_are_means_over_the_steps_tokens(tmp_path, tiny_model_path):
    """Every row kept (fraction 1.0), packed layout, one optimizer step of 2 micro-batches per generation batch, two
    iterations over it (the second trains off-policy, so the clip ratios move; β > 0 logs a KL): each optimizer step
    trains on the same rows as GRPOTrainer's, but the packed micro-batches hold them sorted by length, so their
    per-micro-batch means differ from GRPOTrainer's. The logged entropy, KL and clip ratios are the token means over
    each optimizer step's rows, which equal GRPOTrainer's token means over the same rows. (GRPOTrainer logs the mean
    of its micro-batches' token means: the same value when its micro-batches hold equal tokens.)"""
    common = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_iterations=2,
        max_steps=4,
        beta=0.1,
        epsilon=0.02,  # small clip range: the clip ratios are non-zero on the off-policy step
        learning_rate=0.5,
        optim="sgd",  # linear in the gradient: float-order noise in the gradient stays noise in the weights (Adam's
        # first step is sign-like and turns it into lr-sized moves on a few weights)
    )
    train = tiny_dataset(32)
    base = RecordingGRPOTrainer(
        tiny_model_path, [length_reward], args=_args(tmp_path / "a", GRPOConfig, **common), train_dataset=train
    )
    base.train()
    ours = CostAwareGRPOTrainer(
        tiny_model_path,
        [length_reward],
        args=_args(tmp_path / "b", CostAwareGRPOConfig, cost_aware_kept_fraction=1.0, **common),
        train_dataset=train,
    )
    assert ours._cost_aware.layout == "packed"  # the trainer's own choice
    ours.train()
    rows = [row for row in ours.state.log_history if "entropy" in row]
    assert len(rows) == common["max_steps"]
    tokens = [t for _, t, _ in base.records]
    assert len(set(tokens)) > 1, "the micro-batches must hold unequal tokens for the test to tell the means apart"
    mismatched = {}
    for key in TOKEN_MEANS:
        expected = _token_means(base.records, key)
        logged = [row[key] for row in rows]
        assert len(expected) == len(logged), key
        if not torch.allclose(torch.tensor(logged), torch.tensor(expected), rtol=1e-5, atol=1e-7):
            mismatched[key] = (logged, expected)
    assert not mismatched, f"logged vs GRPOTrainer's token means: {mismatched}"
    assert any(v > 0 for v in _token_means(base.records, "kl"))
    clipped = _token_means(base.records, "clip_ratio/region_mean")
    assert any(v > 0 for v in clipped), "no clipping: the test would not check the clip ratios"


class _Window:
    """The attributes `CostAwareGRPOTrainer._token_weighted_metrics` reads (it runs no collective)."""

    _token_weighted_metrics = CostAwareGRPOTrainer._token_weighted_metrics

    def __init__(self, level, weights, metrics):
        self.args = SimpleNamespace(importance_sampling_level=level)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"))
        self._metrics = {"train": defaultdict(list, metrics)}
        self._cost_aware = SimpleNamespace(metric_weights=list(weights))  # already summed over ranks


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_window_means_weigh_tokens_or_rows_as_trl_counts_them(level):
    """Two packed micro-batches of (30 tokens, 3 rows) and (10 tokens, 1 row): per-token values by tokens, per-row
    values (phi, and the clip ratios at sequence level) by rows; the extremes and unpaired entries stay TRL's."""
    window = _Window(
        level,
        [(30.0, 3.0), (10.0, 1.0)],
        {
            "entropy": [1.0, 2.0],
            "clip_ratio/region_mean": [0.0, 1.0],
            "vespo/phi_seq_mean": [1.0, 3.0],
            "clip_ratio/high_max": [0.5, 1.0],
            "kl": [1.0],  # not one entry per micro-batch: left as it is
        },
    )
    window._token_weighted_metrics()
    metrics = window._metrics["train"]
    assert metrics["entropy"] == [pytest.approx(1.25)]
    assert metrics["clip_ratio/region_mean"] == [pytest.approx(0.25)]  # 10/40 by tokens, 1/4 by rows: equal here
    assert metrics["vespo/phi_seq_mean"] == [pytest.approx(1.5)]
    assert metrics["clip_ratio/high_max"] == [0.5, 1.0] and metrics["kl"] == [1.0]
    assert window._cost_aware.metric_weights == []
    by_rows = _Window(level, [(30.0, 1.0), (10.0, 3.0)], {"clip_ratio/region_mean": [0.0, 1.0]})
    by_rows._token_weighted_metrics()
    expected = 0.75 if level == "sequence" else 0.25
    assert by_rows._metrics["train"]["clip_ratio/region_mean"] == [pytest.approx(expected)]
