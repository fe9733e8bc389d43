"""The prompt stage's lag (issue 38): draws are made ahead of training by the Trainer's read-ahead (one optimizer step
of `gradient_accumulation_steps` micro-batches fetched at once, plus accelerate's one-batch prefetch), so the lag
between a draw and the newest history it may see is counted in generation batches per optimizer step, not fixed at 2.

Each case trains the embedded tiny model with the prompt stage for a few optimizer steps; before the fix,
steps_per_generation=1 with gradient_accumulation_steps=2 stopped at step 1 with an error blaming
dataloader_num_workers."""

from __future__ import annotations

import pytest
from test_prompt_stage import model_path, prompt_args  # noqa: F401  (fixtures)
from test_trainer import length_reward

from trl_costaware import CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset
from trl_costaware.prompts import history as history_module
from trl_costaware.prompts.stage import loader_lag

# (steps_per_generation, gradient_accumulation_steps, per-device rows, optimizer steps): spg < GA, spg = GA, spg > GA
CASES = [(1, 2, 8, 3), (1, 4, 8, 2), (2, 2, 8, 3), (4, 2, 4, 4), (4, 1, 4, 4)]


@pytest.mark.parametrize("spg,ga,rows,steps", CASES, ids=[f"spg{c[0]}-ga{c[1]}" for c in CASES])
def test_training_runs_whatever_the_generation_batches_per_step(tmp_path, model_path, spg, ga, rows, steps):  # noqa: F811
    pool = arithmetic_dataset(32, seed=3)  # epochs longer than an optimizer step: the read-ahead is not cut short
    args = prompt_args(
        tmp_path,
        steps_per_generation=spg,
        gradient_accumulation_steps=ga,
        per_device_train_batch_size=rows,
        max_steps=steps,
    )
    trainer = CostAwareGRPOTrainer(model_path, [length_reward], args=args, train_dataset=pool)
    h = trainer._prompt_history
    made: list[tuple[int, int]] = []  # (draw, the newest generation batch whose update had been submitted)
    draw = h.draw

    def recording(t, k):
        made.append((t, max(h.pending, default=h.applied)))
        return draw(t, k)

    h.draw = recording
    trainer.train()
    assert trainer.state.global_step == steps
    batches = steps * ga // spg  # generation batches trained on
    assert h.taken == batches - 1
    # the lag is the smallest that the read-ahead allows: no draw is made more than `lag` batches after the newest
    # update in (else the run would stop), and some draw is made exactly `lag` after it (a smaller lag would stop)
    lag = loader_lag(trainer.args)
    assert lag == h.lag
    assert max(t - seen for t, seen in made) == lag, (lag, made)


@pytest.mark.parametrize("spg,ga,expected", [(1, 2, 3), (1, 4, 5), (2, 2, 2), (4, 2, 1), (4, 1, 1), (1, 1, 2)])
def test_loader_lag_counts_generation_batches_per_optimizer_step(tmp_path, spg, ga, expected):
    args = prompt_args(tmp_path, steps_per_generation=spg, gradient_accumulation_steps=ga)
    assert loader_lag(args) == expected


def test_a_missing_update_names_the_read_ahead(tmp_path):
    h = history_module.PromptHistory(8, 4, smoothing=0.2, forgetting=0.5, scale="group", seed=0, lag=2)
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps"):
        h.apply_until(0)
