"""The embedded testbeds: GRPO recipes on which plain GRPO learns a built-in task, held-out accuracy measured during
training, and one training run as a function (used by `make demo`, `make demo-long` and the benchmarks).

    from trl_costaware.embedded.testbed import train_run

    result = train_run(seed=0, output_dir="outputs/x")                       # plain GRPO (cost_aware=False)
    result = train_run(seed=0, output_dir="outputs/y", settings={"cost_aware": True})
    result = train_run(seed=0, output_dir="outputs/z", testbed="long")      # the long-completion testbed

Two testbeds (`TESTBEDS`):

- ``"default"``: short sums (`arithmetic.py`), completions of 3 to 12 tokens, 64 prompts x 16 rollouts per step. Fast.
- ``"long"``: counting (`counting.py`), completions of 2 to 96 tokens (the cap), a 4-token prompt, run-on wrong
  answers truncated at the cap, 16 prompts x 8 rollouts per step: the shape of a reasoning run, where rows differ in
  cost.

Held-out accuracy is the fraction of `HELDOUT_N` fixed problems (seed `HELDOUT_SEED`, never trained on: the training
problems use the run's seed) solved by ONE completion sampled at the training temperature (T = 1); its standard error
at 512 problems is ≈ 0.022. Greedy accuracy is measured at the start and at the end.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from .arithmetic import max_completion_tokens
from .counting import LONG_MAX_COMPLETION_LENGTH
from .tasks import get_task
from .warmup import WARMUP_RECIPES, evaluate_accuracy, warmed_up_model_path

# The GRPO recipe on the embedded default (docs/embedded.md): 64 prompts x 16 rollouts = 1,024 rollouts per
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
POOL_SEED = 4242  # the problems of a fixed training pool (`train_run(pool=...)`), the same for every run seed


# The long testbed (counting, `counting.py`): 16 prompts x 8 rollouts = 128 rollouts per generation batch and per
# optimizer step, split into 8 micro-batches of 16 rows (steps_per_generation = gradient_accumulation_steps, TRL's
# default), cap 96 tokens, the rest as the default recipe. Right completions are 2 to 80 tokens; one that misses its
# stop runs on to the cap. At 32 x 8 the update was nearly free to subsample (uniform kept 0.25: 1.17x GRPO's steps to
# the target, one seed); at 16 x 8 it is noise-limited as real GRPO updates are. docs/embedded.md.
LONG_RECIPE: dict[str, Any] = {
    **GRPO_RECIPE,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 8,
    "steps_per_generation": 8,
    "num_generations": 8,
    "max_completion_length": LONG_MAX_COMPLETION_LENGTH,
}
LONG_STEPS = 40


@dataclass(frozen=True)
class Testbed:
    """One embedded testbed: a warm-up (a `WARMUP_RECIPES` name, which names the task), a GRPO recipe, a run length."""

    name: str
    warmup: str
    recipe: dict[str, Any] = field(repr=False)
    steps: int
    eval_every: int

    @property
    def task(self):
        return get_task(WARMUP_RECIPES[self.warmup].task)

    def dataset(self, n: int, seed: int):
        return self.task.dataset(n, seed=seed)

    @property
    def reward(self):
        return self.task.reward

    def model_path(self) -> str:
        return warmed_up_model_path(recipe=self.warmup)


TESTBEDS = {
    "default": Testbed("default", "default", GRPO_RECIPE, DEFAULT_STEPS, EVAL_EVERY),
    "long": Testbed("long", "long", LONG_RECIPE, LONG_STEPS, EVAL_EVERY),
}


def get_testbed(name: str) -> Testbed:
    if name not in TESTBEDS:
        raise ValueError(f"testbed must be one of {sorted(TESTBEDS)}, got {name!r}")
    return TESTBEDS[name]


def heldout_accuracy(
    model, tokenizer, n: int = HELDOUT_N, *, do_sample: bool = True, testbed: str = "default"
) -> float:
    """Accuracy on the testbed's fixed held-out problems: one T = 1 sample per problem (greedy if not `do_sample`)."""
    was_training = model.training
    model.eval()
    task = get_testbed(testbed).task.name
    try:
        return evaluate_accuracy(model, n=n, seed=HELDOUT_SEED, tokenizer=tokenizer, do_sample=do_sample, task=task)
    finally:
        model.train(was_training)


def _callbacks():
    from transformers import TrainerCallback

    class HeldOut(TrainerCallback):
        """Held-out sampled accuracy before training and every `every` steps, with the policy tokens, generated
        tokens and training wall seconds (evaluation time excluded) at that point; greedy accuracy at both ends."""

        def __init__(self, trainer, every: int, n: int, bar, testbed: str = "default"):
            self.trainer, self.every, self.n, self.bar, self.testbed = trainer, every, n, bar, testbed
            self.curve: list[dict] = []
            self.eval_s = 0.0
            self.t0 = None
            self.greedy: dict[str, float] = {}

        def wall(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def measure(self, step: int) -> None:
            t = time.perf_counter()
            acc = heldout_accuracy(self.trainer.model, self.trainer.processing_class, self.n, testbed=self.testbed)
            totals = self.trainer._cost_aware.totals
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
            model, tok = self.trainer.model, self.trainer.processing_class
            self.greedy["start"] = heldout_accuracy(model, tok, do_sample=False, testbed=self.testbed)
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
            model, tok = self.trainer.model, self.trainer.processing_class
            self.greedy["end"] = heldout_accuracy(model, tok, do_sample=False, testbed=self.testbed)
            self.eval_s += time.perf_counter() - t

    return HeldOut


def train_run(
    *,
    seed: int,
    output_dir: str,
    steps: int | None = None,
    settings: dict[str, Any] | None = None,
    trainer_cls=None,
    eval_every: int | None = None,
    eval_n: int = HELDOUT_N,
    model_path: str | None = None,
    progress: str | None = None,
    run_group: str | None = None,
    testbed: str = "default",
    pool: int | None = None,
) -> dict[str, Any]:
    """Train one arm for one seed on an embedded testbed and return its measurements.

    Args:
        seed: training seed (the training problems, the rollouts, the cost-aware draw).
        output_dir: the run folder (the trainer writes its metrics record there).
        steps: optimizer steps, one per generation batch (default: the testbed's).
        settings: `CostAwareGRPOConfig` fields on top of the testbed's recipe (e.g. ``{"cost_aware": True}``); the
            default is plain GRPO (`cost_aware=False`).
        trainer_cls: a `CostAwareGRPOTrainer` subclass (default `CostAwareGRPOTrainer`).
        eval_every / eval_n: held-out sampled accuracy every that many steps, on that many problems.
        model_path: the starting policy (default: the testbed's warmed-up model).
        progress: a label for a tqdm progress bar (None: no bar).
        testbed: ``"default"`` or ``"long"`` (`TESTBEDS`).
        pool: a fixed pool of that many training problems (the same problems for every seed, `POOL_SEED`), revisited
            epoch after epoch; None: fresh problems for every step (drawn with `seed`).

    Returns a dict: ``curve`` (list of {step, policy_tokens, generated_tokens, wall_s, heldout_acc}, step 0 first),
    ``heldout_acc_start`` / ``heldout_acc_end`` (sampled), ``greedy_acc_start`` / ``greedy_acc_end``, ``totals`` (the
    trainer's cumulative counters: policy_tokens, generated_tokens, rollout_tokens, rows_generated, rows_kept, ...),
    ``train_wall_s`` (training only, evaluation excluded), ``eval_wall_s``, ``seed``, ``steps``, ``settings``,
    ``phase_s`` (seconds in generation + scoring and in training steps, see `_timed`) and ``batch_metrics`` (the
    sampler's per-batch metrics averaged over steps: J ratios, kept fractions).
    """
    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer

    bed = get_testbed(testbed)
    steps = bed.steps if steps is None else steps
    eval_every = bed.eval_every if eval_every is None else eval_every
    trainer_cls = _timed(trainer_cls or CostAwareGRPOTrainer)
    settings = {"cost_aware": False, **(settings or {})}
    recipe = {**bed.recipe, **settings}
    torch.manual_seed(seed)
    config = CostAwareGRPOConfig(
        output_dir=output_dir, max_steps=steps, seed=seed, cost_aware_run_group=run_group, **recipe
    )
    rows_per_generation = recipe["per_device_train_batch_size"] * recipe.get("steps_per_generation", 1)
    prompts_per_step = rows_per_generation // recipe["num_generations"]
    dataset = bed.dataset(steps * prompts_per_step + 64, seed) if pool is None else bed.dataset(pool, POOL_SEED)
    model_path = model_path or bed.model_path()
    trainer = trainer_cls(model_path, [bed.reward], args=config, train_dataset=dataset)
    for cb in (PrinterCallback, ProgressCallback):  # no metrics dict per step
        trainer.remove_callback(cb)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress, unit="step", dynamic_ncols=True)
    held = _callbacks()(trainer, eval_every, eval_n, bar, testbed)
    trainer.add_callback(held)
    try:
        trainer.train()
    finally:
        if bar is not None:
            bar.close()
    return {
        "seed": seed,
        "steps": steps,
        "testbed": testbed,
        "settings": settings,
        "trainer": trainer_cls.__name__,
        "curve": held.curve,
        "heldout_acc_start": held.curve[0]["heldout_acc"],
        "heldout_acc_end": held.curve[-1]["heldout_acc"],
        "greedy_acc_start": held.greedy["start"],
        "greedy_acc_end": held.greedy["end"],
        "totals": dict(trainer._cost_aware.totals),
        "phase_s": dict(trainer.phase_s),
        "batch_metrics": _batch_metric_means(output_dir),
        "train_wall_s": held.train_s,
        "eval_wall_s": held.eval_s,
    }


def _timed(cls):
    """`cls` with the wall seconds of its two phases summed over training: ``generate_and_score`` (TRL's generation
    and scoring, and the cost-aware draw) and ``training_step`` (everything a training step does, generation
    included when the step starts a generation batch). The update phase is their difference."""
    if getattr(cls, "_testbed_timed", False):
        return cls

    class Timed(cls):
        _testbed_timed = True

        def __init__(self, *args, **kwargs):
            self.phase_s = {"generate_and_score": 0.0, "training_step": 0.0}
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            if not self.model.training:
                return super()._generate_and_score_completions(inputs)
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.phase_s["generate_and_score"] += time.perf_counter() - t
            return out

        def training_step(self, *args, **kwargs):
            t = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            self.phase_s["training_step"] += time.perf_counter() - t
            return out

    Timed.__name__ = Timed.__qualname__ = cls.__name__
    return Timed


BATCH_METRICS = ("j_ratio_ideal", "j_ratio_achieved", "kept_row_fraction", "kept_token_fraction")
BATCH_METRICS += ("informative_fraction",)


def _batch_metric_means(output_dir: str) -> dict[str, float]:
    """Means over the run's logged steps of the per-generation-batch metrics in `BATCH_METRICS` (`cost_aware/...` in
    the trainer's local record; absent for plain GRPO, which does not sample)."""
    import json

    from ..tracking.callbacks import METRICS_FILE

    path = os.path.join(output_dir, METRICS_FILE)
    sums: dict[str, list[float]] = {k: [] for k in BATCH_METRICS}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                for k in BATCH_METRICS:
                    v = row.get(f"cost_aware/{k}")
                    if isinstance(v, (int, float)) and v == v and abs(v) != float("inf"):
                        sums[k].append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items() if v}


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
