"""The regime matrix (issue 26): cells chosen by a measured property, arms given GRPO's compute, decided by compute.

    python benchmarks/regime_matrix.py                       # every default-testbed cell, 3 seeds, the arms below
    python benchmarks/regime_matrix.py --cells default_late --arms grpo,cost_aware_0.5 --seeds 3
    python benchmarks/regime_matrix.py --analyze-only        # re-read the runs in --out, rewrite the results
    python benchmarks/regime_matrix.py --smoke               # tiny batches, 3 steps: checks the machinery

Cells (`CELLS`); each is chosen by its PROPERTY, measured from GRPO runs and printed, never by how an arm does:

- ``<testbed>``: the testbed as it is (a).
- ``<testbed>_late``: a late phase (b). GRPO (seed `CHECKPOINT_SEED`, outside the cells' seeds) trains from the
  warm-up until, at a check every `CHECK_EVERY` steps, its held-out accuracy has passed the testbed's committed target
  AND the informative-row share (1 − TRL's ``frac_reward_zero_std``, mean over the last `CHECK_EVERY` steps) is at
  most `LATE_INFORMATIVE_MAX` (40%); that model is the cell's start (fresh optimizer, the recipe's schedule).
- ``<testbed>_variance``: a variance-limited cell (c). The first of `VARIANCE_CANDIDATES` (rollouts per step,
  learning rate; fixed order) at which GRPO on half the rollouts keeps at most 85% of GRPO's held-out gain at equal
  steps (paired seeds: the cell's own GRPO and GRPO-half runs), i.e. loses >= `VARIANCE_LOSS_MIN` of it.

Arms (`MATRIX_ARMS`): GRPO, fixed 0.5 `none` (the package default), fixed 0.5 recentred, fixed 0.25 `none` (any arm
of `_common.ARMS` can be named with --arms). Every arm gets the compute of the same seed's GRPO run (`compute.py`:
tokens weighted by the cell's CPU-like split, i.e. GRPO's measured update share, which is the split under which a kept
fraction buys the most steps): an arm with cheaper steps runs more of them, under the same constant-after-warm-up
schedule, and stops when its compute reaches GRPO's under every split (`SPLITS`). The end accuracy "at equal compute"
under the GPU splits is then read at the earlier point of the same curve where its compute under that split equals
GRPO's. Per cell and arm: steps / generated / policy tokens to the target and compute to it under each split (paired
ratios against GRPO, bootstrap 95% intervals over seeds), end accuracy at equal compute and at equal steps against
GRPO. `regime_analysis.py` applies the decision rule to the results (it imports the cells and run readers from
`regime_runs.py`; this runner imports it).

Results: `benchmarks/results/regime_matrix[_smoke].{json,md}`; runs under `outputs/bench/regime_matrix[_smoke]/`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from regime_analysis import write_results  # noqa: E402
from regime_runs import (  # noqa: E402, F401  (the records' readers, re-exported for the matrix's users)
    CELLS,
    END_POINTS,
    SPLITS,
    ZERO_SHARE_KEY,
    grpo_split_weights,
    informative_shares,
    load_cell_runs,
    read_metrics,
    zero_variance_shares,
)
from token_efficiency import bootstrap_ci  # noqa: E402

MATRIX_ARMS = ("grpo", "cost_aware_0.5", "cost_aware_0.5_recenter", "cost_aware_0.25")
CHECKPOINT_SEED = 1000
CHECK_EVERY = 10
LATE_MAX_STEPS = 600  # at 200 the default testbed was at a 44% share (criterion <= 40%): the cap was raised
LATE_INFORMATIVE_MAX = 0.40
VARIANCE_LOSS_MIN = 0.15
# (prompts per generation batch, learning rate), tried in this order; rollouts per prompt as the testbed's recipe.
VARIANCE_CANDIDATES = {"default": [(16, 1e-4), (16, 3e-4), (8, 3e-4)], "long": [(8, 1e-4), (8, 3e-4)]}
# Committed targets of the testbeds (token_efficiency_full_<testbed>.json): the late checkpoint must have passed them.
TARGET_FILES = {"default": "token_efficiency_full_default.json", "long": "token_efficiency_full_long.json"}
EVAL_EVERY = 4
# Multi-epoch cells (issue 34): a fixed pool of problems revisited epoch after epoch. Candidates (pool size, GRPO's
# steps), tried in this order with the cell's first GRPO seed; the first on which every prompt is revisited at least
# `MIN_REVISITS` times and GRPO's share of generated tokens in zero-variance groups passes `ZERO_SHARE_MIN` over the
# last quarter of its steps is the cell.
EPOCH_CANDIDATES = {"default": [(256, 40), (128, 40), (128, 80)], "long": [(128, 80), (64, 80)]}
MIN_REVISITS = 10
ZERO_SHARE_MIN = 0.5
SMOKE = {"per_device_train_batch_size": 32, "num_generations": 8}  # 4 prompts x 8 rollouts, for --smoke
SMOKE_EVAL_N = 32


# ==================================================================================================== runs
def _budget_callback(weights: list, budget: float):
    from transformers import TrainerCallback

    class BudgetStop(TrainerCallback):
        """Stops training once the run's compute (tokens weighted per split) has reached `budget` under every split;
        it runs before the held-out callback, which then measures the final step."""

        def __init__(self, trainer):
            self.trainer = trainer

        def on_step_end(self, args, state, control, **kwargs):
            t = self.trainer._cost_aware.totals
            if min(w.compute(t["generated_tokens"], t["policy_tokens"]) for w in weights) >= budget - 1e-9:
                state.max_steps = state.global_step
                control.should_training_stop = True

    return BudgetStop


def _with_budget(cls, weights, budget):
    stop = _budget_callback(weights, budget)

    class Budgeted(cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(stop(self))

    Budgeted.__name__ = Budgeted.__qualname__ = cls.__name__
    return Budgeted


def zero_variance_token_share(advantages, completion_mask, num_generations: int) -> float:
    """The share of completion tokens in groups (`num_generations` consecutive rows, TRL's order) whose advantages
    are all 0, i.e. whose rewards are all equal: the rows GRPO generates and cannot learn from."""
    tokens = completion_mask.sum(-1).double().view(-1, num_generations)
    zero = (advantages.view(-1, num_generations) == 0).all(-1, keepdim=True)
    total = float(tokens.sum())
    return float((tokens * zero).sum()) / total if total > 0 else 0.0


def with_zero_variance_share(cls):
    """`cls` (a trainer that trains on the full generation batch) logging `ZERO_SHARE_KEY` per generation batch."""

    class ZeroShare(cls):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            if self.model.training:
                share = zero_variance_token_share(batch["advantages"], batch["completion_mask"], self.num_generations)
                self._metrics["train"][ZERO_SHARE_KEY].append(share)
            return batch

    ZeroShare.__name__ = ZeroShare.__qualname__ = cls.__name__
    return ZeroShare


def run_one(
    name, spec, seed, root, *, testbed, steps, model_path=None, budget=None, eval_n=common.HELDOUT_N, pool=None
):
    """One run of a cell (cached in ``root/<name>__s<seed>/run_result.json`` when spec, steps and start agree).
    `budget`: (weights per split, compute) — the run stops when its compute reaches it under every split."""
    from trl_costaware.embedded.testbed import train_run

    out = os.path.join(root, f"{name}__s{seed}")
    path = os.path.join(out, "run_result.json")
    key = {"spec": spec, "steps": steps, "model_path": model_path, "budget": None if budget is None else budget[1]}
    if pool is not None:
        key["pool"] = pool
    if os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            cached = json.load(fh)
        if cached.get("key") == key:
            return cached
    stale = os.path.join(out, "cost_aware_metrics.jsonl")  # a run killed before its result: start it afresh
    if os.path.exists(stale):
        os.remove(stale)
    cls, needed = common.trainer_for(spec["trainer"])
    if spec["trainer"] == "grpo":  # the full batch: its zero-variance token share (the multi-epoch cell's property)
        cls = with_zero_variance_share(cls)
    if budget is not None:
        cls = _with_budget(cls, *budget)
    result = train_run(
        seed=seed,
        output_dir=out,
        steps=steps,
        settings={**spec.get("settings", {}), **needed},
        trainer_cls=cls,
        eval_every=EVAL_EVERY,
        eval_n=eval_n,
        model_path=model_path,
        run_group=f"regime-{name}",
        testbed=testbed,
        pool=pool,
    )
    result.update(
        arm=name,
        spec=spec,
        key=key,
        informative_shares=informative_shares(out),
        zero_variance_shares=zero_variance_shares(out),
    )
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(path + ".tmp", path)
    return result


def committed_target(testbed: str) -> float:
    with open(os.path.join(common.RESULTS, TARGET_FILES[testbed]), encoding="utf-8") as fh:
        return float(json.load(fh)["target"])


def late_checkpoint(testbed: str, root: str, *, smoke: bool = False) -> dict:
    """Train GRPO until the late-phase property holds (module docstring); save that model. Returns its record."""
    import torch  # noqa: F401  (the trainer needs it imported first on some setups)

    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.embedded.testbed import heldout_accuracy, train_run

    folder = os.path.join(root, f"late_checkpoint_{testbed}")
    record_path = os.path.join(folder, "late_checkpoint.json")
    if os.path.exists(record_path):
        with open(record_path, encoding="utf-8") as fh:
            return json.load(fh)
    target = committed_target(testbed)
    every, max_steps, share_max = (2, 4, 1.0) if smoke else (CHECK_EVERY, LATE_MAX_STEPS, LATE_INFORMATIVE_MAX)
    eval_n = SMOKE_EVAL_N if smoke else common.HELDOUT_N
    checks: list[dict] = []
    model_dir = os.path.join(folder, "model")

    from transformers import TrainerCallback

    class Check(TrainerCallback):
        """Every step: TRL's frac_reward_zero_std of the step (still in the trainer's metrics at on_step_end, before
        the step is logged); every `every` steps: held-out accuracy and the property."""

        def __init__(self, trainer):
            self.trainer, self.zero_std = trainer, []

        def on_step_end(self, args, state, control, **kwargs):
            tr = self.trainer
            values = tr._metrics["train"].get("frac_reward_zero_std") or []
            if values:
                self.zero_std.append(float(values[-1]))
            if state.global_step % every or not self.zero_std:
                return
            share = 1.0 - float(np.mean(self.zero_std[-every:]))
            acc = heldout_accuracy(tr.model, tr.processing_class, eval_n, testbed=testbed)
            checks.append({"step": state.global_step, "informative_share": share, "heldout_acc": acc})
            if (acc >= target and share <= share_max) or state.global_step >= max_steps:
                tr.save_model(model_dir)
                tr.processing_class.save_pretrained(model_dir)
                state.max_steps = state.global_step
                control.should_training_stop = True

    class WithCheck(CostAwareGRPOTrainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(Check(self))

    settings = {"cost_aware": False, **(SMOKE if smoke else {})}
    train_run(
        seed=CHECKPOINT_SEED,
        output_dir=os.path.join(folder, "run"),
        steps=max_steps,
        settings=settings,
        trainer_cls=WithCheck,
        eval_every=10**6,
        eval_n=eval_n,
        testbed=testbed,
    )
    last = checks[-1]
    rec = {
        "testbed": testbed,
        "seed": CHECKPOINT_SEED,
        "target": target,
        "informative_max": share_max,
        "checks": checks,
        "step": last["step"],
        "heldout_acc": last["heldout_acc"],
        "informative_share": last["informative_share"],
        "property_holds": last["heldout_acc"] >= target and last["informative_share"] <= share_max,
        "model_path": model_dir,
    }
    with open(record_path, "w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1)
    return rec


def arm_spec(arm: str, testbed: str, extra: dict) -> dict:
    spec = common.ARMS[arm]
    override = common.TESTBED_ARM_SETTINGS.get(testbed, {}).get(arm) or {}
    return {**spec, "settings": {**spec.get("settings", {}), **override, **extra}}


def variance_cell(testbed, root, seeds, steps, *, smoke=False) -> dict:
    """Try `VARIANCE_CANDIDATES` in order with GRPO and GRPO on half the prompts (the cell's seeds); the first whose
    half-rollouts arm loses >= 15% of GRPO's gain at equal steps is the cell. Returns the choice and every try."""
    from trl_costaware.embedded.testbed import get_testbed

    recipe = get_testbed(testbed).recipe
    per_prompt, spg = recipe["num_generations"], recipe.get("steps_per_generation", 1)
    tries = []
    candidates = VARIANCE_CANDIDATES[testbed][:1] if smoke else VARIANCE_CANDIDATES[testbed]
    for prompts, lr in candidates:
        full = {"per_device_train_batch_size": prompts * per_prompt // spg, "learning_rate": lr}
        half = {"per_device_train_batch_size": prompts * per_prompt // spg // 2, "learning_rate": lr}
        if smoke:
            full, half = {**full, **SMOKE}, {**half, **SMOKE, "per_device_train_batch_size": 16}
        tag = f"variance_{testbed}_p{prompts}_lr{lr:g}"
        gains, halves = [], []
        eval_n = SMOKE_EVAL_N if smoke else common.HELDOUT_N
        for s in seeds:  # the cell's own GRPO runs (the cell reuses them) and GRPO on half the prompts
            g = run_one(
                "grpo",
                arm_spec("grpo", testbed, full),
                s,
                os.path.join(root, tag),
                testbed=testbed,
                steps=steps,
                eval_n=eval_n,
            )
            h = run_one(
                "grpo_half",
                arm_spec("grpo", testbed, half),
                s,
                os.path.join(root, tag),
                testbed=testbed,
                steps=steps,
                eval_n=eval_n,
            )
            gains.append(end_acc(g) - g["heldout_acc_start"])
            halves.append(end_acc(h) - h["heldout_acc_start"])
        loss = half_loss(gains, halves)
        tries.append({"prompts": prompts, "learning_rate": lr, "tag": tag, "settings": full, **loss})
        if loss["loss"] is not None and loss["loss"] >= VARIANCE_LOSS_MIN and loss["grpo_gain"][1] > 0:
            return {"chosen": tries[-1], "tries": tries}
    return {"chosen": None, "tries": tries}


def epochs_cell(testbed, root, seeds, *, smoke=False) -> dict:
    """Try `EPOCH_CANDIDATES` in order with GRPO (the cell's first seed; the cell reuses the run); the first with the
    property is the cell. Returns the choice and every try, each with its measured properties."""
    from trl_costaware.embedded.testbed import get_testbed

    extra = dict(SMOKE) if smoke else {}
    recipe = {**get_testbed(testbed).recipe, **extra}
    rows = recipe["per_device_train_batch_size"] * recipe.get("steps_per_generation", 1)
    prompts = rows // recipe["num_generations"]
    candidates = [(2 * prompts, 6)] if smoke else EPOCH_CANDIDATES[testbed]
    tries = []
    for pool, steps in candidates:
        tag = f"epochs_{testbed}_pool{pool}_steps{steps}"
        run = run_one(
            "grpo",
            arm_spec("grpo", testbed, extra),
            seeds[0],
            os.path.join(root, tag),
            testbed=testbed,
            steps=steps,
            eval_n=SMOKE_EVAL_N if smoke else common.HELDOUT_N,
            pool=pool,
        )
        shares = run["zero_variance_shares"]
        last = shares[-max(1, len(shares) // 4) :]
        late_share = float(np.mean(last)) if last else 0.0
        revisits = steps * prompts / pool
        holds = revisits >= MIN_REVISITS and late_share > ZERO_SHARE_MIN
        tries.append(
            {
                "pool": pool,
                "steps": steps,
                "tag": tag,
                "revisits": revisits,
                "zero_variance_share_last_quarter": late_share,
                "zero_variance_share_run": float(np.mean(shares)) if shares else None,
                "property_holds": holds,
            }
        )
        print(f"{tag}: revisits {revisits:.1f}, zero-variance token share (last quarter) {late_share:.3f}", flush=True)
        if holds or smoke:
            return {"chosen": tries[-1], "tries": tries}
    return {"chosen": None, "tries": tries}


def half_loss(gains, halves, resamples=10_000) -> dict:
    """1 − mean(half gain) / mean(GRPO gain) over paired seeds, with a bootstrap 95% interval (seeds resampled)."""
    g, h = np.asarray(gains, float), np.asarray(halves, float)
    out = {"grpo_gain": bootstrap_ci(g), "half_gain": bootstrap_ci(h), "loss": None, "loss_ci": (None, None)}
    if len(g) == 0 or g.mean() <= 0:
        return out
    out["loss"] = float(1 - h.mean() / g.mean())
    if len(g) > 1:
        rng = np.random.default_rng(0)
        idx = rng.integers(0, len(g), size=(resamples, len(g)))
        ratios = 1 - h[idx].mean(1) / np.maximum(g[idx].mean(1), 1e-12)
        out["loss_ci"] = tuple(float(q) for q in np.quantile(ratios, [0.025, 0.975]))
    return out


def end_acc(run: dict) -> float:
    return float(np.mean([p["heldout_acc"] for p in run["curve"][1:]][-END_POINTS:]))


# ==================================================================================================== the cells
def cell_setup(cell, root, seeds, steps, smoke):
    """(settings on top of each arm, starting model or None, the cell's run folder, its property record)."""
    testbed, kind = CELLS[cell]
    extra = dict(SMOKE) if smoke else {}
    if kind == "as_is":
        return extra, None, os.path.join(root, cell), {"kind": kind}
    if kind == "late":
        rec = late_checkpoint(testbed, root, smoke=smoke)
        return extra, rec["model_path"], os.path.join(root, cell), {"kind": kind, "checkpoint": rec}
    if kind == "epochs":
        ep = epochs_cell(testbed, root, seeds, smoke=smoke)
        if ep["chosen"] is None:
            return None, None, None, {"kind": kind, **ep}
        return extra, None, os.path.join(root, ep["chosen"]["tag"]), {"kind": kind, **ep}
    var = variance_cell(testbed, root, seeds, steps, smoke=smoke)
    if var["chosen"] is None:
        return None, None, None, {"kind": kind, **var}
    return (
        {**extra, **var["chosen"]["settings"]},
        None,
        os.path.join(root, var["chosen"]["tag"]),
        {"kind": kind, **var},
    )


def setup_cell(cell, root, seeds, steps, smoke=False) -> dict | None:
    """Measure the cell's property (a late checkpoint, a variance candidate) and write its record; the run context,
    or None when no candidate has the property."""
    testbed, _ = CELLS[cell]
    extra, model_path, cell_root, prop = cell_setup(cell, root, seeds, steps, smoke)
    record = {"cell": cell, "testbed": testbed, "extra": extra, "model_path": model_path, "runs": cell_root, **prop}
    os.makedirs(os.path.join(root, "cells"), exist_ok=True)
    with open(os.path.join(root, "cells", f"{cell}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
    if extra is None:
        print(f"{cell}: no candidate has the property; no arms run", flush=True)
        return None
    eval_n = SMOKE_EVAL_N if smoke else common.HELDOUT_N
    chosen = prop.get("chosen") if prop["kind"] == "epochs" else None
    return {
        "cell": cell,
        "testbed": testbed,
        "extra": extra,
        "model_path": model_path,
        "root": cell_root,
        "steps": chosen["steps"] if chosen else steps,
        "eval_n": eval_n,
        "pool": chosen["pool"] if chosen else None,
    }


def run_in_cell(ctx: dict, arm: str, seed: int) -> dict:
    """GRPO for `steps`; any other arm with the same seed's GRPO compute as its budget (GRPO must have run)."""
    steps, kw = ctx["steps"], {"testbed": ctx["testbed"], "model_path": ctx["model_path"], "eval_n": ctx["eval_n"]}
    kw["pool"] = ctx.get("pool")
    spec = arm_spec(arm, ctx["testbed"], ctx["extra"])
    if arm == "grpo":
        return run_one("grpo", spec, seed, ctx["root"], steps=steps, **kw)
    weights = grpo_split_weights(load_cell_runs(ctx["root"])["grpo"], seed, steps)
    floor = min(w.split.generation for w in weights.values())
    # A step costs at least the generation share of GRPO's step; the budget stops the run, this only caps it.
    max_steps = int(math.ceil(steps / max(floor, 0.02)))
    r = run_one(arm, spec, seed, ctx["root"], steps=max_steps, budget=(list(weights.values()), float(steps)), **kw)
    print(
        f"{ctx['cell']} {arm} s{seed}: {r['steps']} max steps, stopped at {r['curve'][-1]['step']}, held-out "
        f"{r['heldout_acc_start']:.3f} -> {r['heldout_acc_end']:.3f}",
        flush=True,
    )
    return r


def schedule(
    cells: list[str], arms: list[str], seeds: list[int], seed_major: bool = False
) -> list[tuple[str, str, int]]:
    """(cell, arm, seed) in run order: GRPO for every seed of every cell first (each arm's budget is its GRPO's
    compute, and an arm's step cap depends on every GRPO seed's measured split), then arm-major (arms in the given
    order, the package default first), seed, cell: a partial matrix holds the first arms in every cell at the same
    seeds. `seed_major`: seed, arm, cell instead, so that a partial matrix holds complete paired seeds."""
    order = [(c, "grpo", s) for s in seeds for c in cells]
    if seed_major:
        return order + [(c, a, s) for s in seeds for a in arms if a != "grpo" for c in cells]
    return order + [(c, a, s) for a in arms if a != "grpo" for s in seeds for c in cells]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="default,default_late,default_variance", help="comma-separated cells")
    p.add_argument("--arms", default=",".join(MATRIX_ARMS), help="comma-separated arms (GRPO always runs)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="GRPO's steps per cell (default: the testbed's)")
    p.add_argument("--out", default=None, help="run folder (default outputs/bench/regime_matrix[_smoke])")
    p.add_argument("--smoke", action="store_true", help="tiny batches, 3 steps, 1 seed, 2 arms: the machinery only")
    p.add_argument("--analyze-only", action="store_true")
    p.add_argument(
        "--seed-major",
        action="store_true",
        help="after GRPO, run the arms seed by seed (complete paired seeds first) instead of arm by arm",
    )
    p.add_argument("--tag", default="regime_matrix", help="results name: benchmarks/results/<tag>.{json,md}")
    args = p.parse_args(argv)
    tag = f"{args.tag}_smoke" if args.smoke else args.tag
    root = args.out or os.path.join(common.ROOT, "outputs", "bench", tag)
    cells = common.checked_names("--cells", args.cells, CELLS)
    arms = ["grpo", *[a for a in common.checked_names("--arms", args.arms, common.ARMS) if a != "grpo"]]
    if args.smoke:
        arms, seeds, steps = arms[:1] + ["cost_aware_0.5"], [0], args.steps or 3
    else:
        seeds, steps = list(range(args.seeds)), args.steps
    results = root if args.smoke else common.RESULTS  # the smoke run's results stay beside its runs
    command = " ".join(["python benchmarks/regime_matrix.py", *(argv if argv is not None else sys.argv[1:])])
    from trl_costaware.embedded.testbed import get_testbed

    if not args.analyze_only:
        contexts = {}
        for cell in cells:
            contexts[cell] = setup_cell(cell, root, seeds, steps or get_testbed(CELLS[cell][0]).steps, args.smoke)
            write_results(root, cells, tag, command, results)
        for cell, arm, seed in schedule([c for c in cells if contexts[c]], arms, seeds, args.seed_major):
            run_in_cell(contexts[cell], arm, seed)
            write_results(root, cells, tag, command, results)
    res = write_results(root, cells, tag, command, results)
    print(res["markdown"])
    return res


if __name__ == "__main__":
    main()
