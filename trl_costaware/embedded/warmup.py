"""Short SFT warm-up of the tiny model on the arithmetic task, and accuracy evaluation."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from dataclasses import dataclass, replace

from ._cache import cache_root, cached_build
from .arithmetic import (
    DEFAULT_MAX_TERMS,
    LEGACY_MAX_TERMS,
    arithmetic_dataset,
    arithmetic_reward,
    max_completion_tokens,
)
from .counting import counting_dataset, run_on_completion
from .model import MODEL_VERSION, shipped_model_path, tiny_model_path
from .shipped import SHIPPED, rebuild_requested
from .tasks import get_task

# Bump when a recipe changes, so stale cache entries are not reused.
WARMUP_VERSION = "v2"
WARMUP_BATCH_SIZE = 64
WARMUP_LEARNING_RATE = 3e-3


@dataclass(frozen=True)
class WarmupRecipe:
    """An SFT warm-up: `steps` steps of 64 problems with 1 to `max_terms` terms, cosine lr 3e-3.

    `repeat_fraction` of the SFT completions repeat the answer after it (``"8,10|10|10"``), a habit the strict reward
    scores 0: a warm-up flaw that RL can fix (as RL fixes a real SFT model's formatting and stopping habits), so the
    testbed has room to improve that is shared by every prompt, not only per-problem arithmetic.
    """

    steps: int
    max_terms: int = DEFAULT_MAX_TERMS
    repeat_fraction: float = 0.0
    task: str = "arithmetic"  # a `tasks.TASKS` name; "counting" ignores max_terms and repeat_fraction
    run_on_fraction: float = 0.0  # counting: this fraction of the habit phase's completions run on past the stop
    learning_rate: float = WARMUP_LEARNING_RATE
    # A second phase (counting): `habit_steps` steps at constant `habit_learning_rate` on data where `run_on_fraction`
    # of the completions run on (`run_on_completion`), after `steps` clean steps. The clean phase learns the task and
    # its stop first; mixed in from the start, the run-ons keep the tiny model from ever learning the stop.
    habit_steps: int = 0
    habit_learning_rate: float = 1e-3


WARMUP_RECIPES = {
    # The default: 1-4 terms, 1000 steps, 30% repeated answers. Held-out (512 problems): greedy 0.99, sampled (T=1)
    # 0.65 (0.77 for one term, 0.54 for four): the arithmetic is learnt, sampling at T=1 and the habit are not.
    "default": WarmupRecipe(steps=1000, max_terms=DEFAULT_MAX_TERMS, repeat_fraction=0.3),
    # The earlier default (1-6 terms, 500 clean steps), on which plain GRPO does not learn.
    "sums6": WarmupRecipe(steps=500, max_terms=LEGACY_MAX_TERMS, repeat_fraction=0.0),
    # The long testbed: counting (`counting.py`), 1200 clean steps (held-out sampled accuracy 0.94, no run-ons), then
    # 150 steps at lr 3e-4 where 25% of the completions run on past the stop (sampled 0.56, 28% truncated at the cap).
    "long": WarmupRecipe(steps=1200, task="counting", run_on_fraction=0.25, habit_steps=150, habit_learning_rate=3e-4),
}
DEFAULT_WARMUP_STEPS = WARMUP_RECIPES["default"].steps


@contextlib.contextmanager
def torch_threads(n: int | None = 1):
    """Temporarily run torch on `n` CPU threads (None: leave as is).

    The tiny model gains nothing from intra-op parallelism, and on a shared 2-core machine two busy-waiting OpenMP
    threads per process are an order of magnitude slower than one (measured: 60 ms vs 670 ms per SFT step).
    """
    import torch

    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet_datasets():
    from datasets.utils import logging as ds_logging

    enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            ds_logging.enable_progress_bar()


def warmup_dataset(n: int, seed: int, recipe: WarmupRecipe):
    """The SFT data of `recipe`: prompt-completion rows; for the arithmetic task `recipe.repeat_fraction` of them
    repeat the answer, for the counting task `recipe.run_on_fraction` of them run on past the stop."""
    from datasets import Dataset

    if recipe.task == "counting":
        ds = counting_dataset(n, seed=seed)
        rng = random.Random(seed + 1)
        completions = [run_on_completion(s) if rng.random() < recipe.run_on_fraction else s for s in ds["solution"]]
        return Dataset.from_dict({"prompt": list(ds["prompt"]), "completion": completions})
    ds = arithmetic_dataset(n, seed=seed, max_terms=recipe.max_terms)
    rng = random.Random(seed + 1)
    repeat = [rng.random() < recipe.repeat_fraction for _ in range(n)]
    completions = [
        sol + ("|" + ans if r else "") for sol, ans, r in zip(ds["solution"], ds["answer"], repeat, strict=True)
    ]
    return Dataset.from_dict({"prompt": list(ds["prompt"]), "completion": completions})


def _run_warmup(base: str, out: str, *, seed: int, steps: int, recipe: WarmupRecipe) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    phases = [(steps, recipe.learning_rate, "cosine", replace(recipe, run_on_fraction=0.0), 10_000 + seed)]
    if recipe.habit_steps:
        phases.append((recipe.habit_steps, recipe.habit_learning_rate, "constant", recipe, 20_000 + seed))
    for phase_steps, lr, schedule, data_recipe, data_seed in phases:
        model = _sft_phase(model, tokenizer, phase_steps, lr, schedule, data_recipe, data_seed, seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _sft_phase(
    model, tokenizer, steps: int, lr: float, schedule: str, recipe: WarmupRecipe, data_seed: int, seed: int
):
    """`steps` SFT steps of `WARMUP_BATCH_SIZE` rows of `warmup_dataset(..., recipe)`; returns the trained model."""
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    with tempfile.TemporaryDirectory() as scratch, torch_threads(1), _quiet_datasets():
        train = warmup_dataset(steps * WARMUP_BATCH_SIZE, seed=data_seed, recipe=recipe)
        args = SFTConfig(
            output_dir=scratch,
            max_steps=steps,
            per_device_train_batch_size=WARMUP_BATCH_SIZE,
            learning_rate=lr,
            lr_scheduler_type=schedule,
            warmup_steps=max(1, steps // 20) if schedule == "cosine" else 0,
            weight_decay=0.0,
            max_length=64 if recipe.task == "arithmetic" else 160,  # counting: up to 7 + 96 tokens
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=seed,
            data_seed=seed,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
        trainer.remove_callback(PrinterCallback)  # no metrics dict on stdout
        trainer.train()
    return trainer.model


def warmed_up_model_path(
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    steps: int | None = None,
    recipe: str = "default",
    rebuild: bool | None = None,
) -> str:
    """`tiny_model_path` after a short SFT warm-up (prompt-completion, loss on the completion only).

    `recipe` names an entry of `WARMUP_RECIPES` (`steps` overrides its step count). The default warm-up stops early
    and teaches a habit the reward punishes (see `WarmupRecipe`): sampled at temperature 1 the model solves most short
    problems and few long ones, so GRPO groups have reward variance and GRPO has room to improve.

    The testbeds' models (recipes "default" and "long" at seed 0 and their own step counts) are shipped with the
    package (`shipped.py`): this returns a cache directory holding exactly those weights, checked by SHA-256, the
    same on every machine and with no training. With `rebuild` (default ``$TRL_COSTAWARE_REBUILD``), and for any other
    seed, step count or recipe, the recipe runs on this machine (~40 s on one core for "default", ~6-10 min for
    "long"), from `tiny_model_path(seed=seed, rebuild=rebuild)`; a rebuild need not match the shipped weights bit for
    bit on another CPU (docs/embedded.md). Cached like `tiny_model_path`.
    """
    if recipe not in WARMUP_RECIPES:
        raise ValueError(f"recipe must be one of {sorted(WARMUP_RECIPES)}, got {recipe!r}")
    spec = WARMUP_RECIPES[recipe]
    steps = spec.steps if steps is None else int(steps)
    root = cache_root(cache_dir)
    rebuild = rebuild_requested(rebuild)
    if recipe in SHIPPED and seed == 0 and steps == spec.steps and not rebuild:
        return shipped_model_path(root, recipe, trained=True)
    base = tiny_model_path(root, seed=seed, rebuild=rebuild)
    name = f"warm-{MODEL_VERSION}{WARMUP_VERSION}-{recipe}-seed{seed}-steps{steps}"
    return cached_build(root, name, lambda out: _run_warmup(base, out, seed=seed, steps=steps, recipe=spec))


def _load(model_path_or_model, tokenizer=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(model_path_or_model, (str, os.PathLike)):
        path = str(model_path_or_model)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    else:
        model = model_path_or_model
        if tokenizer is None:
            from .tokenizer import build_tokenizer

            tokenizer = build_tokenizer()
    return model, tokenizer


def sample_completions(
    model_path_or_model,
    prompts: list[str],
    *,
    tokenizer=None,
    num_generations: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    max_new_tokens: int = max_completion_tokens(),
    batch_size: int = 512,
    seed: int = 0,
    num_threads: int | None = 1,
) -> list[str]:
    """Completions (special tokens skipped) for each prompt, `num_generations` consecutive ones per prompt."""
    import torch

    model, tokenizer = _load(model_path_or_model, tokenizer)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    expanded = [p for p in prompts for _ in range(num_generations)]
    out: list[str] = []
    tokenizer.padding_side = "left"
    with torch.random.fork_rng(devices=[]), torch.no_grad(), torch_threads(num_threads):
        torch.manual_seed(seed)
        for start in range(0, len(expanded), batch_size):
            batch = tokenizer(expanded[start : start + batch_size], return_tensors="pt", padding=True).to(device)
            gen_kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample)
            if do_sample:
                gen_kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
            ids = model.generate(
                **batch,
                **gen_kwargs,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            completions = ids[:, batch["input_ids"].shape[1] :]
            out.extend(tokenizer.batch_decode(completions, skip_special_tokens=True))
    model.train(was_training)
    return out


def evaluate_accuracy(
    model_path_or_model,
    n: int = 256,
    seed: int = 12345,
    *,
    tokenizer=None,
    do_sample: bool = False,
    temperature: float = 1.0,
    min_terms: int = 1,
    max_terms: int = DEFAULT_MAX_TERMS,
    max_new_tokens: int | None = None,
    task: str = "arithmetic",
) -> float:
    """Fraction of `n` held-out problems (drawn with `seed`) solved; greedy unless `do_sample`.

    `max_new_tokens` defaults to `max_completion_tokens(max_terms)`, the training cap of the embedded recipes."""
    if task == "arithmetic":
        max_new_tokens = max_completion_tokens(max_terms) if max_new_tokens is None else max_new_tokens
        ds = arithmetic_dataset(n, seed=seed, min_terms=min_terms, max_terms=max_terms)
        reward = arithmetic_reward
    else:
        spec = get_task(task)
        max_new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
        ds, reward = spec.dataset(n, seed=seed), spec.reward
    completions = sample_completions(
        model_path_or_model,
        list(ds["prompt"]),
        tokenizer=tokenizer,
        do_sample=do_sample,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    rewards = reward(completions, ds["answer"])
    return sum(rewards) / max(1, len(rewards))
