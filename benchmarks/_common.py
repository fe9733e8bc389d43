"""Shared helpers of the GRPO benchmarks on the embedded default (tiny model, arithmetic task).

The testbed harness (`run_arm`, `ARMS`): one arm for one seed, in this process, with held-out accuracy along the way
(`trl_costaware.embedded.testbed.train_run`), its result checkpointed to JSON. The token-efficiency benchmark runs the
arms of a seed side by side in one process with it; other benchmarks may reuse it (arms are plain data).

The older subprocess runner (`train_one`, `run_many`, used by `overhead.py`): one training run is one subprocess
(`python benchmarks/_common.py SPEC.json`), so a benchmark can keep both cores busy
with one single-threaded run each (`OMP_NUM_THREADS=1`; two threads per run were measured ~10x slower on 2 cores).
Every run writes the trainer's `cost_aware_metrics.jsonl` and `cost_aware_run.json` to its output dir (read by
`trl_costaware.compare`), plus `bench_result.json`: wall times, per-step timings of the sampler and of the policy
update, and held-out accuracy at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from trl_costaware.embedded.testbed import DEFAULT_STEPS, EVAL_EVERY, GRPO_RECIPE, HELDOUT_N, train_run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
RESULT_FILE = "bench_result.json"

# The GRPO recipe of the testbed (one place to change it: trl_costaware.embedded.testbed.GRPO_RECIPE).
BASE_SETTINGS = {**GRPO_RECIPE, "disable_tqdm": True}

ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


# ==================================================================================================== testbed arms
# An arm is plain data: the trainer kind and CostAwareGRPOConfig fields on top of the testbed recipe.
#   trainer: "grpo" (CostAwareGRPOTrainer, cost_aware=False), "cost_aware", "zero_adv_filter", "max_variance"
# The fixed-fraction arms name their kept fraction: the config's default is "auto", and an arm must not change
# meaning when a default does.
HALF = {"cost_aware_kept_fraction": 0.5}
# Arms without "recenter" in their name name their weights too: from 0a2f1ba until the default went back to "none",
# they silently inherited the recentred default (the partial regime-matrix runs of BENCHMARKS.md §6 did).
NONE = {"cost_aware_weight_normalization": "none"}
ARMS: dict[str, dict] = {
    "grpo": {"trainer": "grpo", "settings": {}},
    "zero_adv_filter": {"trainer": "zero_adv_filter", "settings": {}},
    "uniform_0.5": {"trainer": "cost_aware", "settings": {"cost_aware_proxy": "uniform", **HALF, **NONE}},
    "pods_0.5": {"trainer": "max_variance", "settings": {"cost_aware_kept_fraction": 0.5}},
    "cost_aware_0.25": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": 0.25, **NONE}},
    "cost_aware_0.5": {"trainer": "cost_aware", "settings": {**HALF, **NONE}},
    "cost_aware_0.75": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": 0.75, **NONE}},
    "cost_aware_0.5_recenter": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_weight_normalization": "recenter"},
    },
    "cost_aware_0.25_recenter": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_kept_fraction": 0.25, "cost_aware_weight_normalization": "recenter"},
    },
    # View B: GRPO on half the rollouts per step (32 prompts x 16), the policy tokens per step of a kept-0.5 arm.
    "grpo_half": {"trainer": "grpo", "settings": {"per_device_train_batch_size": 512}},
    "uniform_0.25": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_proxy": "uniform", "cost_aware_kept_fraction": 0.25},
    },
    "uniform_0.5_recenter": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_proxy": "uniform", **HALF, "cost_aware_weight_normalization": "recenter"},
    },
    "cost_aware_auto": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": "auto", **NONE}},
    "cost_aware_auto_recenter": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_kept_fraction": "auto", "cost_aware_weight_normalization": "recenter"},
    },
    "cost_aware_0.5_loss_aware": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_proxy": "loss_aware", **NONE},
    },
    "cost_aware_auto_recenter_loss_aware": {  # the loss-aware proxy at the package defaults
        "trainer": "cost_aware",
        "settings": {
            "cost_aware_kept_fraction": "auto",
            "cost_aware_weight_normalization": "recenter",
            "cost_aware_proxy": "loss_aware",
        },
    },
    "cost_aware_0.5_group_by_length": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_group_by_length": True, **NONE},
    },
    "cost_aware_0.5_full_micro": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_full_micro_batches": True, **NONE},
    },
    # Issue 25's rule: the kept count that minimises the predicted cost to the target. Priced by this machine's
    # measured phase times (the CPU-like split), or by the token model at a published GPU split (the price of a
    # generated token per testbed: `generation_token_cost` below).
    "cost_aware_compute": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": "compute", **NONE}},
    "cost_aware_compute_gen55": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_kept_fraction": "compute", "cost_aware_cost_model": "tokens", **NONE},
    },
    "cost_aware_compute_gen77": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_kept_fraction": "compute", "cost_aware_cost_model": "tokens", **NONE},
    },
    # Issue 34: cost-aware before generation (the prompt stage), alone and with the row stage; a GRESO-style biased
    # skip (`GresoTrainer`); both stages with half the prompts per step (the saving taken as cheaper steps).
    "prompt": {"trainer": "grpo", "settings": {"cost_aware_prompt_sampling": True}},
    "both": {"trainer": "cost_aware", "settings": {**HALF, **NONE, "cost_aware_prompt_sampling": True}},
    "greso": {"trainer": "greso", "settings": {"cost_aware_prompt_sampling": True}},
    "both_half": {
        "trainer": "cost_aware",
        "settings": {**HALF, **NONE, "cost_aware_prompt_sampling": True, "per_device_train_batch_size": 512},
    },
    # the controls of both_half: the same halved prompt count without the prompt stage (rows only), and GRPO's
    "cost_aware_0.5_half": {"trainer": "cost_aware", "settings": {**HALF, **NONE, "per_device_train_batch_size": 512}},
}
# The same rule with the noise scale scaled by 0.3: the median (0.32) of the measured response of the steps to
# halving the batch over the model's prediction, on the four regime-matrix cells that have GRPO-half runs
# (BENCHMARKS.md §8, benchmarks/noise_scale_check.py): 0.31, 0.33, 0.22, 0.63.
NOISE_FACTOR = 0.3
for _name in ("cost_aware_compute", "cost_aware_compute_gen55", "cost_aware_compute_gen77"):
    _spec = ARMS[_name]
    ARMS[_name.replace("compute", "compute_cal", 1)] = {
        "trainer": "cost_aware",
        "settings": {**_spec["settings"], "cost_aware_noise_scale_factor": NOISE_FACTOR},
    }
# GRPO's tokens per step on each testbed (token_efficiency_full_<testbed>.json, BENCHMARKS §7): generated tokens G and
# policy tokens P (prompt + completion of every row).
GRPO_TOKENS_PER_STEP = {"default": (7224.0, 12334.0), "long": (5839.0, 6351.0)}


def generation_token_cost(testbed: str, generation_share: float) -> float:
    """The token model's price of a generated token, in policy tokens, at which GRPO's step on `testbed` spends
    `generation_share` of its cost on generation and scoring (the rest on passes and update, per policy token):
    (s_gen / (1 − s_gen)) · P / G."""
    gen, pol = GRPO_TOKENS_PER_STEP[testbed]
    return generation_share / (1.0 - generation_share) * pol / gen


# Settings an arm needs on a testbed whose recipe differs from the default one (e.g. half the rollouts per step).
TESTBED_ARM_SETTINGS: dict[str, dict[str, dict]] = {
    "long": {  # 8 prompts x 8 = 64 rollouts per step
        "grpo_half": {"per_device_train_batch_size": 8},
        "both_half": {"per_device_train_batch_size": 8},
        "cost_aware_0.5_half": {"per_device_train_batch_size": 8},
    },
}
for _tb in GRPO_TOKENS_PER_STEP:
    for _arm, _share in (("cost_aware_compute_gen55", 0.55), ("cost_aware_compute_gen77", 0.77)):
        _price = round(generation_token_cost(_tb, _share), 4)
        for _name in (_arm, _arm.replace("compute", "compute_cal", 1)):
            TESTBED_ARM_SETTINGS.setdefault(_tb, {})[_name] = {"cost_aware_generation_token_cost": _price}


# GRESO-style skip (arXiv 2506.02177, simplified as issue 34 states it): a prompt whose last visit was zero-variance
# is drawn with relative chance GRESO_EXPLORE, every other prompt with chance 1; no weights (biased by design).
GRESO_EXPLORE = 0.2


def greso_trainer():
    """`CostAwareGRPOTrainer` whose prompt stage runs the GRESO-style rule (`prompt_history.RULES`)."""
    from trl_costaware import CostAwareGRPOTrainer

    class GresoTrainer(CostAwareGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._prompt_history.rule, self._prompt_history.explore = "greso", GRESO_EXPLORE

    return GresoTrainer


def trainer_for(kind: str):
    """(trainer class, settings it needs) for an arm's trainer kind."""
    from trl_costaware import CostAwareGRPOTrainer

    if kind == "grpo":
        return CostAwareGRPOTrainer, {"cost_aware": False}
    if kind == "cost_aware":
        return CostAwareGRPOTrainer, {"cost_aware": True}
    if kind == "greso":
        return greso_trainer(), {"cost_aware": False, "cost_aware_prompt_sampling": True}
    from baselines import MaxVarianceTrainer, ZeroAdvantageFilterTrainer

    if kind == "zero_adv_filter":
        return ZeroAdvantageFilterTrainer, {"cost_aware": True}
    if kind == "max_variance":
        return MaxVarianceTrainer, {"cost_aware": True}
    raise ValueError(f"trainer kind must be grpo, cost_aware, greso, zero_adv_filter or max_variance, got {kind!r}")


def run_arm(
    arm: str | dict,
    seed: int,
    root: str,
    *,
    name: str | None = None,
    steps: int | None = DEFAULT_STEPS,
    eval_every: int | None = EVAL_EVERY,
    eval_n: int = HELDOUT_N,
    progress: bool = False,
    extra_settings: dict | None = None,
    testbed: str = "default",
) -> dict:
    """Train one arm for one seed in this process; return `train_run`'s dict plus ``arm``, and checkpoint it.

    `arm` is a key of `ARMS` or a dict ``{"trainer": kind, "settings": {...}}`` (then `name` names it);
    `extra_settings` go on top of the arm's (e.g. a smaller batch for a smoke test). The result is written to
    ``root/<name>__s<seed>/run_result.json`` and reused when it exists with the same arm, settings and steps."""
    if isinstance(arm, str):
        name, spec = name or arm, ARMS[arm]
        override = TESTBED_ARM_SETTINGS.get(testbed, {}).get(arm)
        if override:
            spec = {**spec, "settings": {**spec.get("settings", {}), **override}}
    else:
        if name is None:
            raise ValueError("run_arm: a dict arm needs a name")
        spec = arm
    if extra_settings:
        spec = {**spec, "settings": {**spec.get("settings", {}), **extra_settings}}
    out = os.path.join(root, f"{name}__s{seed}")
    path = os.path.join(out, "run_result.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if cached.get("spec") == spec and cached.get("steps") == steps and cached.get("testbed", "default") == testbed:
            return cached
    cls, needed = trainer_for(spec["trainer"])
    result = train_run(
        seed=seed,
        output_dir=out,
        steps=steps,
        settings={**spec.get("settings", {}), **needed},
        trainer_cls=cls,
        eval_every=eval_every,
        eval_n=eval_n,
        progress=f"{name} s{seed}" if progress else None,
        run_group=f"testbed-{testbed}-{name}",
        testbed=testbed,
    )
    result.update(arm=name, spec=spec)
    os.makedirs(out, exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)
    return result


# ==================================================================================================== one run
HELDOUT_SEED = 12345  # the fixed held-out problems (the same for every run and for the final evaluation)


def _trainer_classes():
    import torch
    from transformers import TrainerCallback

    class HeldOutCallback(TrainerCallback):
        """Greedy accuracy on a fixed set of held-out problems every `every` steps (and before training): a reward
        curve free of the prompt-difficulty noise of the training batches."""

        def __init__(self, trainer, every: int, n: int, sampled: bool):
            self.trainer, self.every, self.n, self.sampled = trainer, every, n, sampled

        def measure(self, step):
            acc = {"heldout_acc": self.trainer.heldout_accuracy(self.n)}
            if self.sampled:  # at the training temperature (1.0), on twice as many problems (noisier per problem)
                acc["heldout_sampled_acc"] = self.trainer.heldout_accuracy(2 * self.n, do_sample=True)
            tokens = self.trainer._cost_aware_totals["policy_tokens"]
            self.trainer.heldout_curve.append((step, tokens, *acc.values()))
            return acc

        def on_train_begin(self, args, state, control, **kwargs):
            self.measure(0)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % self.every == 0:
                self.trainer._heldout = self.measure(state.global_step)

    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.batching import select_rows, trim_to_longest

    class TimedTrainer(CostAwareGRPOTrainer):
        """Times the sampler (`_draw_kept_rows`, `_process_new_buffer`), generation and the policy update."""

        def __init__(self, *a, heldout_every: int = 0, heldout_n: int = 512, heldout_sampled: bool = False, **k):
            self.bench_timers = {"draw": [], "process_buffer": [], "prepare_inputs": [], "training_step": []}
            super().__init__(*a, **k)
            self._heldout = None
            self.heldout_curve = []  # (step, policy tokens, greedy accuracy)
            if heldout_every:
                self.add_callback(HeldOutCallback(self, heldout_every, heldout_n, heldout_sampled))

        def heldout_accuracy(self, n: int, do_sample: bool = False) -> float:
            from trl_costaware.embedded import evaluate_accuracy

            was_training = self.model.training
            self.model.eval()
            try:
                return evaluate_accuracy(
                    self.model, n=n, seed=HELDOUT_SEED, tokenizer=self.processing_class, do_sample=do_sample
                )
            finally:
                self.model.train(was_training)

        def log(self, logs, start_time=None):
            if self._heldout is not None and "loss" in logs:
                logs.update(self._heldout)
                self._heldout = None
            super().log(logs, start_time)

        def _timed(self, key, fn, *a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.bench_timers[key].append(time.perf_counter() - t0)
            return out

        def _draw_kept_rows(self, batch):
            return self._timed("draw", super()._draw_kept_rows, batch)

        def _process_new_buffer(self):
            return self._timed("process_buffer", super()._process_new_buffer)

        def _prepare_inputs(self, generation_batch):
            if not self.model.training:
                return super()._prepare_inputs(generation_batch)
            return self._timed("prepare_inputs", super()._prepare_inputs, generation_batch)

        def training_step(self, *a, **k):
            return self._timed("training_step", super().training_step, *a, **k)

    class ZeroVarianceFilterTrainer(TimedTrainer):
        """GRPO (cost_aware=False) that drops the rows of groups whose rewards are all equal (zero advantage for
        every row of the group) before the policy update, and renormalises the token-sum losses by the kept tokens
        (as DAPO's dynamic sampling trains on the informative rows only). Single process only."""

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            if not self.model.training:
                return batch
            g = self.num_generations
            adv = batch["advantages"].detach().float()
            informative = adv.view(-1, g).abs().amax(1) > 0  # a group with equal rewards has A = 0 on every row
            keep = informative.repeat_interleave(g).nonzero().flatten()
            spg = self.args.steps_per_generation
            if len(keep) < spg:  # nothing to learn from: keep spg rows (zero advantage, no gradient)
                keep = torch.arange(spg)
            keep = keep[: len(keep) - len(keep) % spg]
            batch = trim_to_longest(select_rows(batch, keep))
            mask = batch["completion_mask"]
            batch["num_items_in_batch"] = mask.sum().clamp(min=1).to(batch["num_items_in_batch"])
            self._metrics["train"]["bench/zero_variance_kept_fraction"].append(len(keep) / len(adv))
            return batch

    return TimedTrainer, ZeroVarianceFilterTrainer


def train_one(spec: dict) -> dict:
    """Train one run described by `spec` and write `bench_result.json` to its output dir.

    spec: output_dir, seed, steps, arm ("grpo", "cost_aware", "grpo_zero_var_filter"), settings (CostAwareGRPOConfig
    overrides on top of BASE_SETTINGS), eval_n (held-out problems at the end; 0: none), heldout_every (greedy held-out
    accuracy on heldout_n problems every that many steps, logged as `heldout_acc`; 0: none), group.
    """
    import torch

    from trl_costaware import CostAwareGRPOConfig
    from trl_costaware.embedded import arithmetic_dataset, arithmetic_reward, evaluate_accuracy, warmed_up_model_path

    torch.manual_seed(spec["seed"])
    timed_cls, filter_cls = _trainer_classes()
    arm = spec["arm"]
    settings = {**BASE_SETTINGS, **spec.get("settings", {})}
    config = CostAwareGRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        seed=spec["seed"],
        cost_aware=arm == "cost_aware",
        cost_aware_run_group=spec.get("group"),
        **settings,
    )
    prompts_per_step = settings["per_device_train_batch_size"] // settings["num_generations"]
    dataset = arithmetic_dataset(spec["steps"] * prompts_per_step + 64, seed=spec["seed"])
    cls = filter_cls if arm == "grpo_zero_var_filter" else timed_cls
    model_path = warmed_up_model_path()
    trainer = cls(
        model_path,
        [arithmetic_reward],
        args=config,
        train_dataset=dataset,
        heldout_every=spec.get("heldout_every", 0),
        heldout_n=spec.get("heldout_n", 512),
        heldout_sampled=spec.get("heldout_sampled", False),
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    result = {
        "spec": spec,
        "wall_train_s": wall,
        "timers": trainer.bench_timers,
        "totals": dict(trainer._cost_aware_totals),
        "heldout_curve": trainer.heldout_curve,
    }
    if spec.get("eval_n", 0):
        model = trainer.model.eval()
        tok = trainer.processing_class
        result["eval_greedy_acc"] = evaluate_accuracy(model, n=spec["eval_n"], tokenizer=tok)
        result["eval_sampled_acc"] = evaluate_accuracy(model, n=spec["eval_n"], tokenizer=tok, do_sample=True)
    with open(os.path.join(spec["output_dir"], RESULT_FILE), "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return result


# ==================================================================================================== many runs
def run_many(specs: list[dict], jobs: int = 2, log_dir: str | None = None) -> list[dict]:
    """Run the specs as subprocesses, `jobs` at a time (one single-threaded run per core); skip a run whose
    `bench_result.json` already exists. Returns the results in spec order (None for a run that failed)."""
    env = {**os.environ, **ENV, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    pending = [s for s in specs if not os.path.exists(os.path.join(s["output_dir"], RESULT_FILE))]
    running: list[tuple[subprocess.Popen, dict, float]] = []
    t_start = time.perf_counter()
    done = len(specs) - len(pending)
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            os.makedirs(spec["output_dir"], exist_ok=True)
            spec_path = os.path.join(spec["output_dir"], "bench_spec.json")
            with open(spec_path, "w", encoding="utf-8") as fh:
                json.dump(spec, fh)
            log = open(os.path.join(spec["output_dir"], "bench_log.txt"), "w", encoding="utf-8")  # noqa: SIM115
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), spec_path], env=env, stdout=log, stderr=subprocess.STDOUT
            )
            running.append((proc, spec, time.perf_counter()))
        time.sleep(0.5)
        for item in list(running):
            proc, spec, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            done += 1
            status = "ok" if proc.returncode == 0 else f"FAILED rc={proc.returncode} (see bench_log.txt)"
            print(
                f"  [{done}/{len(specs)}] {os.path.basename(spec['output_dir'])}: {status}, "
                f"{time.perf_counter() - t0:.0f}s (elapsed {time.perf_counter() - t_start:.0f}s)",
                flush=True,
            )
    return [load_result(s["output_dir"]) for s in specs]


def load_result(output_dir: str) -> dict | None:
    path = os.path.join(output_dir, RESULT_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def spread(values: list[float]) -> dict:
    """mean, median, min, max and sample std of the finite values (None when empty)."""
    import numpy as np

    v = np.array([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if len(v) == 0:
        return {"n": 0, "mean": None, "median": None, "min": None, "max": None, "std": None}
    return {
        "n": int(len(v)),
        "mean": float(v.mean()),
        "median": float(np.median(v)),
        "min": float(v.min()),
        "max": float(v.max()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
    }


def fmt_spread(s: dict, fmt: str = "{:.1f}") -> str:
    if not s or s.get("n", 0) == 0:
        return "n/a"
    if s["n"] == 1:
        return fmt.format(s["mean"])
    sd = fmt.replace("+", "").format(s["std"])
    return f"{fmt.format(s['mean'])} ± {sd} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    with open(sys.argv[1], encoding="utf-8") as fh:
        train_one(json.load(fh))
