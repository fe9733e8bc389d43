"""The embedded testbed: a GRPO recipe on which plain GRPO learns the default task, held-out accuracy measured
during training, and one training run as a function (used by `make demo` and the benchmarks).

    from trl_costaware.embedded.testbed import train_run

    result = train_run(seed=0, output_dir="outputs/x")                       # plain GRPO (cost_aware=False)
    result = train_run(seed=0, output_dir="outputs/y", settings={"cost_aware": True})

Held-out accuracy is the fraction of `HELDOUT_N` fixed problems (seed `HELDOUT_SEED`, never trained on: the training
problems use the run's seed) solved by ONE completion sampled at the training temperature (T = 1); its standard error
at 512 problems is ≈ 0.022. Greedy accuracy is measured at the start and at the end.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .arithmetic import arithmetic_dataset, arithmetic_reward, max_completion_tokens
from .warmup import evaluate_accuracy, warmed_up_model_path

# The GRPO recipe on the embedded default (BENCHMARKS.md, "Testbed"): 64 prompts x 16 rollouts = 1,024 rollouts per
# optimizer step (at 256 the gradient is mostly noise), Adam lr 1e-4 after a 10-step linear warm-up (TRL ignores
# warmup_steps under "constant"), dapo loss, no KL, T = 1. Measured (seed 2): held-out sampled accuracy 0.654 -> 0.887
# at step 30 -> 0.92 at step 50, greedy 0.988 -> 0.986; lr 3e-4 learns as fast but greedy wanders (0.945-0.977).
GRPO_RECIPE: dict[str, Any] = dict(
    per_device_train_batch_size=1024,
    num_generations=16,
    steps_per_generation=1,
    max_completion_length=max_completion_tokens(),
    learning_rate=1e-4,
    lr_scheduler_type="constant_with_warmup",
    warmup_steps=10,
    loss_type="dapo",
    temperature=1.0,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
)
DEFAULT_STEPS = 40
HELDOUT_SEED = 12345
HELDOUT_N = 512
EVAL_EVERY = 2


def heldout_accuracy(model, tokenizer, n: int = HELDOUT_N, *, do_sample: bool = True) -> float:
    """Accuracy on the fixed held-out problems: one T = 1 sample per problem (greedy when not `do_sample`)."""
    was_training = model.training
    model.eval()
    try:
        return evaluate_accuracy(model, n=n, seed=HELDOUT_SEED, tokenizer=tokenizer, do_sample=do_sample)
    finally:
        model.train(was_training)


def _callbacks():
    from transformers import TrainerCallback

    class HeldOut(TrainerCallback):
        """Held-out sampled accuracy before training and every `every` steps, with the policy tokens, generated
        tokens and training wall seconds (evaluation time excluded) at that point; greedy accuracy at both ends."""

        def __init__(self, trainer, every: int, n: int, bar):
            self.trainer, self.every, self.n, self.bar = trainer, every, n, bar
            self.curve: list[dict] = []
            self.eval_s = 0.0
            self.t0 = None
            self.greedy: dict[str, float] = {}

        def wall(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def measure(self, step: int) -> None:
            t = time.perf_counter()
            acc = heldout_accuracy(self.trainer.model, self.trainer.processing_class, self.n)
            totals = self.trainer._cost_aware_totals
            point = {
                "step": step,
                "policy_tokens": totals["policy_tokens"],
                "generated_tokens": totals["generated_tokens"],
                "wall_s": 0.0 if self.t0 is None else self.wall(),
                "heldout_acc": acc,
            }
            self.curve.append(point)
            if self.bar is not None:
                self.bar.set_postfix_str(f"held-out acc {acc:.3f}")
            self.eval_s += time.perf_counter() - t

        def on_train_begin(self, args, state, control, **kwargs):
            self.greedy["start"] = heldout_accuracy(self.trainer.model, self.trainer.processing_class, do_sample=False)
            self.measure(0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(1)
            if state.global_step % self.every == 0 or state.global_step == state.max_steps:
                self.measure(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self.train_s = self.wall()
            t = time.perf_counter()
            self.greedy["end"] = heldout_accuracy(self.trainer.model, self.trainer.processing_class, do_sample=False)
            self.eval_s += time.perf_counter() - t

    return HeldOut


def train_run(
    *,
    seed: int,
    output_dir: str,
    steps: int = DEFAULT_STEPS,
    settings: dict[str, Any] | None = None,
    trainer_cls=None,
    eval_every: int = EVAL_EVERY,
    eval_n: int = HELDOUT_N,
    model_path: str | None = None,
    progress: str | None = None,
    run_group: str | None = None,
) -> dict[str, Any]:
    """Train one arm for one seed on the embedded default and return its measurements.

    Args:
        seed: training seed (the training problems, the rollouts, the cost-aware draw).
        output_dir: the run folder (the trainer writes its metrics record there).
        steps: optimizer steps (one per generation batch of 1,024 rollouts).
        settings: `CostAwareGRPOConfig` fields on top of `GRPO_RECIPE` (e.g. ``{"cost_aware": True}``); the default
            is plain GRPO (`cost_aware=False`).
        trainer_cls: a `CostAwareGRPOTrainer` subclass (default `CostAwareGRPOTrainer`).
        eval_every / eval_n: held-out sampled accuracy every that many steps, on that many problems.
        model_path: the starting policy (default `warmed_up_model_path()`).
        progress: a label for a tqdm progress bar (None: no bar).

    Returns a dict: ``curve`` (list of {step, policy_tokens, generated_tokens, wall_s, heldout_acc}, step 0 first),
    ``heldout_acc_start`` / ``heldout_acc_end`` (sampled), ``greedy_acc_start`` / ``greedy_acc_end``, ``totals`` (the
    trainer's cumulative counters: policy_tokens, generated_tokens, rollout_tokens, rows_generated, rows_kept, ...),
    ``train_wall_s`` (training only, evaluation excluded), ``eval_wall_s``, ``seed``, ``steps``, ``settings``.
    """
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer

    trainer_cls = trainer_cls or CostAwareGRPOTrainer
    settings = {"cost_aware": False, **(settings or {})}
    recipe = {**GRPO_RECIPE, **settings}
    torch.manual_seed(seed)
    config = CostAwareGRPOConfig(
        output_dir=output_dir, max_steps=steps, seed=seed, cost_aware_run_group=run_group, **recipe
    )
    prompts_per_step = recipe["per_device_train_batch_size"] // recipe["num_generations"]
    dataset = arithmetic_dataset(steps * prompts_per_step + 64, seed=seed)
    model_path = model_path or warmed_up_model_path()
    trainer = trainer_cls(model_path, [arithmetic_reward], args=config, train_dataset=dataset)
    for cb in (PrinterCallback, ProgressCallback):  # no metrics dict per step
        trainer.remove_callback(cb)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress, unit="step", dynamic_ncols=True)
    held = _callbacks()(trainer, eval_every, eval_n, bar)
    trainer.add_callback(held)
    try:
        trainer.train()
    finally:
        if bar is not None:
            bar.close()
    return {
        "seed": seed,
        "steps": steps,
        "settings": settings,
        "trainer": trainer_cls.__name__,
        "curve": held.curve,
        "heldout_acc_start": held.curve[0]["heldout_acc"],
        "heldout_acc_end": held.curve[-1]["heldout_acc"],
        "greedy_acc_start": held.greedy["start"],
        "greedy_acc_end": held.greedy["end"],
        "totals": dict(trainer._cost_aware_totals),
        "train_wall_s": held.train_s,
        "eval_wall_s": held.eval_s,
    }


def first_reach(curve: list[dict], target: float, x: str = "policy_tokens") -> float | None:
    """`x` at the first point of `curve` whose held-out accuracy is at least `target`; None if never.

    The curve is read as measured (one point every `eval_every` steps, no smoothing); a run counts as having reached
    the target from the first evaluation at or above it."""
    for point in curve:
        if point["heldout_acc"] >= target:
            return point[x]
    return None


def output_dir_for(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, f"{arm}__s{seed}")
