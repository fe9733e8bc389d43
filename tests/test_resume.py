"""Resume: a missing per-rank state file (another world size, several nodes without a shared filesystem) warns once and
keeps the counters monotone; a checkpoint inside a buffer keeps the sampler's stream on the uninterrupted run's; the
state goes through the trainer's extensible hooks (`_cost_aware_state` / `_restore_cost_aware_state`)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from testing_utils import length_reward, logged, make_trainer, tiny_dataset

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.trainer import STATE_FILE

TOTALS = ("rollout_tokens", "generated_tokens", "policy_tokens", "policy_tokens_padded", "rows_generated", "rows_kept")


def position_reward(completions, **kwargs):
    """Varies within each group whatever the completions are (greedy decoding makes a group's completions equal)."""
    return [float(i % 3) for i in range(len(completions))]


# Checkpoints every 2 of 4 optimizer steps, 8-token completions.
RESUME = dict(max_completion_length=8, max_steps=4, save_strategy="steps", save_steps=2)


def _trainer(model, tmp_path, rewards=(length_reward,), cls=None, **overrides):
    return make_trainer(model, tmp_path, rewards=rewards, cls=cls, **{**RESUME, **overrides})


def _logged(trainer, key, after: int = 0):
    """The logged values of a counter, on the rows after step `after`."""
    return logged(trainer, f"cost_aware/{key}", after)


def _resume_warnings(trainer, checkpoint):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=checkpoint)
    return [str(w.message) for w in caught if STATE_FILE.format(rank=0) in str(w.message)]


# ---------------------------------------------------------------------------------------------------- missing file
def test_missing_state_file_warns_once_and_keeps_the_counters_monotone(tmp_path, tiny_model_path):
    straight = _trainer(tiny_model_path, tmp_path)
    straight.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    os.remove(os.path.join(checkpoint, STATE_FILE.format(rank=0)))
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    at_checkpoint = {k: max(row[f"cost_aware/{k}"] for row in history if f"cost_aware/{k}" in row) for k in TOTALS}
    assert at_checkpoint["policy_tokens"] > 0

    resumed = _trainer(tiny_model_path, tmp_path / "resumed", output_dir=str(tmp_path / "out"))
    messages = _resume_warnings(resumed, checkpoint)
    assert len(messages) == 1, messages
    assert "trainer_state.json" in messages[0]  # says where the counters came from
    for key in TOTALS:
        values = _logged(resumed, key, after=2)
        assert values and values[0] >= at_checkpoint[key], key  # the x-axis does not run backwards
        assert values == sorted(values), key
        # Logged at the checkpoint's step (logging_steps=1), outside a buffer: the uninterrupted run's totals.
        assert values[-1] == _logged(straight, key)[-1], key


def test_missing_state_file_of_another_rank_falls_back_to_rank_0s(tmp_path, tiny_model_path, monkeypatch):
    """A rank without its file (world size grew): rank 0's global counters, this rank's own streams (not rank
    0's)."""
    trainer = _trainer(tiny_model_path, tmp_path, max_steps=2)
    trainer.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)
    assert saved["rank"] == 0 and saved["world_size"] == 1
    fresh = _trainer(tiny_model_path, tmp_path / "fresh", max_steps=2)
    stream = fresh._cost_aware.sampler.get_state()
    monkeypatch.setattr(type(fresh.accelerator), "process_index", property(lambda self: 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh._load_cost_aware_state(checkpoint)
    messages = [str(w.message) for w in caught if STATE_FILE.format(rank=1) in str(w.message)]
    assert len(messages) == 1 and STATE_FILE.format(rank=0) in messages[0]
    assert fresh._cost_aware.totals == saved["totals"]
    assert torch.equal(fresh._cost_aware.sampler.get_state(), stream)


def test_cost_aware_state_is_extensible(tmp_path, tiny_model_path):
    """A subclass adds its entries to the checkpoint through `super()` (`_cost_aware_state`) and gets them back on
    restore (`_restore_cost_aware_state`), with the trainer's own entries."""

    class Trainer(CostAwareGRPOTrainer):
        restored = None

        def _cost_aware_state(self):
            state = super()._cost_aware_state()
            state["extra"] = {"value": 7}
            return state

        def _restore_cost_aware_state(self, state):
            super()._restore_cost_aware_state(state)
            Trainer.restored = state.get("extra")

    trainer = _trainer(tiny_model_path, tmp_path, cls=Trainer, dataset=tiny_dataset(32), max_steps=2)
    trainer.train()
    state = trainer._cost_aware_state()
    assert state["extra"] == {"value": 7} and "totals" in state and "generator" in state
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    saved = torch.load(os.path.join(checkpoint, STATE_FILE.format(rank=0)), weights_only=True)
    assert saved["extra"] == {"value": 7}
    trainer._load_cost_aware_state(checkpoint)
    assert Trainer.restored == {"value": 7}


# ---------------------------------------------------------------------------------------------------- mid-buffer
def _record(trainer):
    """Each generation batch's draw: the sampler stream's state before it, the kept rows and their factors."""
    seen = []
    original = trainer._draw_kept_rows

    def recorded(batch):
        before = trainer._cost_aware.sampler.get_state()
        plan = original(batch)
        seen.append((before, plan.indices.clone(), plan.factors.clone()))
        return plan

    trainer._draw_kept_rows = recorded
    return seen


# Two optimizer steps per generation batch (S = 2, G = 1): checkpoint-3 is inside the second buffer, so TRL
# regenerates that buffer on resume (and restarts its own step count there, so its later buffers start one step
# later than the uninterrupted run's, on the same prompts).
MID_BUFFER = dict(max_steps=6, save_steps=3, steps_per_generation=2, gradient_accumulation_steps=1)


@pytest.mark.parametrize("deterministic", [True, False], ids=["same_rollouts", "new_rollouts"])
def test_resume_inside_a_buffer_keeps_the_samplers_stream(tmp_path, tiny_model_path, deterministic):
    """same_rollouts: learning rate 0 and top_k=1 (greedy), so TRL's regenerated buffer holds the interrupted one's
    rollouts: the resumed run draws exactly the uninterrupted run's rows with its weights, from the regenerated
    buffer on. new_rollouts (a real run): TRL regenerates the buffer with the moved policy and another torch RNG
    state, so its rollouts, hence its rows and weights, differ; what matches is the sampler's stream: each draw
    starts from the uninterrupted run's state for that generation batch."""
    overrides = dict(MID_BUFFER)
    rewards = (length_reward,)
    if deterministic:
        overrides.update(learning_rate=0.0, top_k=1)
        rewards = (position_reward,)
    straight = _trainer(tiny_model_path, tmp_path / "a", rewards, **overrides)
    straight_draws = _record(straight)
    straight.train()
    assert len(straight_draws) == 3
    resumed = _trainer(tiny_model_path, tmp_path / "b", rewards, **overrides)
    resumed_draws = _record(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-3"))
    # The resumed run regenerates the second generation batch, then draws the third (and, with TRL's shifted
    # schedule, would start a fourth after max_steps): compare the draws the two runs share.
    pairs = list(zip(straight_draws[1:], resumed_draws, strict=False))
    assert len(pairs) == 2
    for (state_a, rows_a, factors_a), (state_b, rows_b, factors_b) in pairs:
        if deterministic:
            assert torch.equal(rows_a, rows_b)
            torch.testing.assert_close(factors_a, factors_b, rtol=0, atol=0)
        assert torch.equal(state_a, state_b)


def test_resume_inside_a_buffer_ends_with_the_uninterrupted_runs_counters(tmp_path, tiny_model_path):
    """checkpoint-3 lies inside the second generation batch, which TRL regenerates on resume: the saved totals leave
    out that batch's generation counters (before the fix they held them, and the regenerated batch added them
    again). Greedy rollouts at learning rate 0 reproduce the interrupted batches, and every row has the same tokens
    (one prompt, completions held to the cap), so the micro-batches the resumed run trains (TRL restarts its step
    count, training the regenerated batch from its first micro-step) hold the uninterrupted run's tokens: every
    counter ends equal."""
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ["Add 12 and 34."] * 64})
    overrides = dict(MID_BUFFER, learning_rate=0.0, top_k=1, dataset=dataset, generation_kwargs={"min_new_tokens": 8})
    straight = _trainer(tiny_model_path, tmp_path / "a", (position_reward,), **overrides)
    straight.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-3"
    saved = torch.load(checkpoint / STATE_FILE.format(rank=0), weights_only=True)["totals"]
    assert saved["rows_generated"] == _logged(straight, "rows_generated")[0]  # one batch: the second is left out
    resumed = _trainer(tiny_model_path, tmp_path / "b", (position_reward,), **overrides)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed._cost_aware.totals == straight._cost_aware.totals
    assert straight._cost_aware.totals["rows_generated"] == 3 * 16  # three generation batches of 16 rows


def test_the_state_file_is_written_before_the_checkpoint_is_pushed(tmp_path, tiny_model_path):
    """transformers pushes a checkpoint to the hub at the end of `_save_checkpoint`: this rank's state file must
    already be in it (before the fix it was written after `_save_checkpoint` returned)."""
    trainer = _trainer(tiny_model_path, tmp_path, max_steps=2)
    trainer.args.push_to_hub = True  # after construction: no hub repository is created
    pushed = []
    trainer._push_from_checkpoint = lambda folder: pushed.append(os.listdir(folder))
    trainer.train()
    assert len(pushed) == 1 and STATE_FILE.format(rank=0) in pushed[0]
