"""Shared helpers of the GRPO benchmarks on the embedded default (tiny model, arithmetic task).

The testbed harness (`run_arm`, `ARMS`): one arm for one seed, in this process, with held-out accuracy along the way
(`trl_costaware.embedded.testbed.train_run`), its result checkpointed to JSON. The token-efficiency benchmark runs the
arms of a seed side by side in one process with it; other benchmarks may reuse it (arms are plain data).

Every run writes the trainer's `cost_aware_metrics.jsonl` and `cost_aware_run.json` to its output dir (read by
`trl_costaware.tracking.compare`). (The subprocess runner `train_one`/`run_many` went with `overhead.py`, retired in
issue 33: `git show 5b408c2:benchmarks/_common.py`.)
"""

from __future__ import annotations

import json
import os
import subprocess

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


def package_commit(script: str) -> str:
    """The commit of the code this process runs (its checkout, which may be a pinned worktree), '+dirty' when the
    package or `script` (a path from the repository root) differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "trl_costaware", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def free_port() -> int:
    """A TCP port free on this machine now: for a process that sets up a (world-size-1) process group, so that it does
    not wait on accelerate's default 29500, which another run on the machine may hold."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ==================================================================================================== testbed arms
# An arm is plain data: the trainer kind and CostAwareGRPOConfig fields on top of the testbed recipe.
#   trainer: "grpo" (CostAwareGRPOTrainer, cost_aware=False), "cost_aware", "zero_adv_filter", "max_variance"
# The arms name their kept fraction and weights: an arm must not change meaning when a default does.
HALF = {"cost_aware_kept_fraction": 0.5}
NONE = {"cost_aware_weight_normalization": "none"}
ADV = {"cost_aware_proxy": "advantage"}  # the proxy these arms were measured with
ARMS: dict[str, dict] = {
    "grpo": {"trainer": "grpo", "settings": {}},
    "zero_adv_filter": {"trainer": "zero_adv_filter", "settings": {}},
    "uniform_0.5": {"trainer": "cost_aware", "settings": {"cost_aware_proxy": "uniform", **HALF, **NONE}},
    "pods_0.5": {"trainer": "max_variance", "settings": {"cost_aware_kept_fraction": 0.5}},
    "cost_aware_0.25": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": 0.25, **NONE, **ADV}},
    "cost_aware_0.5": {"trainer": "cost_aware", "settings": {**HALF, **NONE, **ADV}},
    "cost_aware_0.75": {"trainer": "cost_aware", "settings": {"cost_aware_kept_fraction": 0.75, **NONE, **ADV}},
    "cost_aware_0.5_recenter": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_weight_normalization": "recenter", **ADV},
    },
    "cost_aware_0.25_recenter": {
        "trainer": "cost_aware",
        "settings": {"cost_aware_kept_fraction": 0.25, "cost_aware_weight_normalization": "recenter", **ADV},
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
    "cost_aware_0.5_loss_aware": {
        "trainer": "cost_aware",
        "settings": {**HALF, "cost_aware_proxy": "loss_aware", **NONE},
    },
    # the row stage at half the prompts per step
    "cost_aware_0.5_half": {
        "trainer": "cost_aware",
        "settings": {**HALF, **NONE, **ADV, "per_device_train_batch_size": 512},
    },
}
# Settings an arm needs on a testbed whose recipe differs from the default one (e.g. half the rollouts per step).
TESTBED_ARM_SETTINGS: dict[str, dict[str, dict]] = {
    "long": {  # 8 prompts x 8 = 64 rollouts per step
        "grpo_half": {"per_device_train_batch_size": 8},
        "cost_aware_0.5_half": {"per_device_train_batch_size": 8},
    },
}


def trainer_for(kind: str):
    """(trainer class, settings it needs) for an arm's trainer kind."""
    from trl_costaware import CostAwareGRPOTrainer

    if kind == "grpo":
        return CostAwareGRPOTrainer, {"cost_aware": False}
    if kind == "cost_aware":
        return CostAwareGRPOTrainer, {"cost_aware": True}
    from baselines import MaxVarianceTrainer, ZeroAdvantageFilterTrainer

    if kind == "zero_adv_filter":
        return ZeroAdvantageFilterTrainer, {"cost_aware": True}
    if kind == "max_variance":
        return MaxVarianceTrainer, {"cost_aware": True}
    raise ValueError(f"trainer kind must be grpo, cost_aware, zero_adv_filter or max_variance, got {kind!r}")


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


def checked_names(flag: str, given: str, allowed) -> list[str]:
    """The comma-separated names of a command-line list (`--cells`, `--arms`), each one of `allowed`; otherwise
    SystemExit naming the flag, the unknown names and the allowed ones (every benchmark script's check)."""
    names = [n for n in given.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown}; allowed: {', '.join(allowed)}")
    return names


def write_results(tag: str, payload: dict, md: str) -> None:
    """`benchmarks/results/<tag>.json` (the payload) and `<tag>.md` (the tables)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{tag}.json"), "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=1)
    with open(os.path.join(RESULTS, f"{tag}.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
