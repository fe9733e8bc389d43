"""Benchmark 4: the sampler's share of a training step, and the policy-update time per step, cost-aware vs GRPO.

    python benchmarks/overhead.py --quick        # own runs: GRPO + cost-aware at kept 0.25/0.5/1.0, 15 steps, 1 seed
    python benchmarks/overhead.py                # own runs at 40 steps, 2 seeds
    python benchmarks/overhead.py --from outputs/bench/<folder>   # the timers of existing run_many runs

Every benchmark run (`benchmarks/_common.py`) times, per optimizer step: `_draw_kept_rows` (distribution, draw,
weights, diagnostics, gathers), `_process_new_buffer` (micro-batch trimming, token counters), `_prepare_inputs`
(generation, scoring, sampling) and `training_step` (all of it plus the policy forward/backward). The sampler's share
is (draw + process_buffer) / (wall time per step); the policy-update time is training_step − prepare_inputs. Medians
over steps (the first 2 steps dropped), then mean over seeds. The embedded model is tiny (138k parameters), so the
policy update is a small part of a step here and the share of the sampler is an upper bound for real models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

ARMS = {
    "grpo": ("grpo", {}),
    "ca_kept1.0": ("cost_aware", {"cost_aware_kept_fraction": 1.0}),
    "ca_kept0.5": ("cost_aware", {"cost_aware_kept_fraction": 0.5}),
    "ca_kept0.25": ("cost_aware", {"cost_aware_kept_fraction": 0.25}),
}
SKIP = 2


def run_stats(res: dict) -> dict:
    import numpy as np

    t = {k: np.array(v[SKIP:] if len(v) > SKIP + 2 else v, float) for k, v in res["timers"].items()}
    steps = res["spec"]["steps"]
    step_time = res["wall_train_s"] / steps
    draw = float(np.median(t["draw"])) if len(t["draw"]) else 0.0
    buf = float(np.median(t["process_buffer"])) if len(t["process_buffer"]) else 0.0
    n = min(len(t["training_step"]), len(t["prepare_inputs"]))
    policy = float(np.median(t["training_step"][:n] - t["prepare_inputs"][:n]))
    return {
        "step_s": step_time,
        "draw_ms": 1e3 * draw,
        "process_buffer_ms": 1e3 * buf,
        "sampler_share_pct": 100.0 * (draw + buf) / step_time,
        "policy_update_s": policy,
        "generation_s": float(np.median(t["prepare_inputs"])) - draw - buf,
        "policy_tokens_per_step": res["totals"]["policy_tokens"] / steps,
        "policy_tokens_padded_per_step": res["totals"]["policy_tokens_padded"] / steps,
    }


def label_of(res: dict) -> str:
    spec = res["spec"]
    if spec["arm"] != "cost_aware":
        return spec["arm"] if spec["arm"] != "grpo" else "grpo"
    s = spec.get("settings", {})
    extra = [f"{k.replace('cost_aware_', '')}={v}" for k, v in sorted(s.items()) if k != "cost_aware_kept_fraction"]
    return f"cost_aware kept={s.get('cost_aware_kept_fraction', 0.5)}" + (f" ({', '.join(extra)})" if extra else "")


def analyse(dirs: list[str]) -> dict:
    import numpy as np

    by_label: dict[str, list[dict]] = {}
    for d in dirs:
        res = common.load_result(d)
        if res is None or res["spec"].get("settings", {}).get("loss_type", "dapo") != "dapo":
            continue
        by_label.setdefault(label_of(res), []).append(run_stats(res))
    out = {}
    base = by_label.get("grpo")
    base_policy = np.mean([r["policy_update_s"] for r in base]) if base else None
    base_tok = np.mean([r["policy_tokens_per_step"] for r in base]) if base else None
    base_pad = np.mean([r["policy_tokens_padded_per_step"] for r in base]) if base else None
    for label, stats in sorted(by_label.items(), key=lambda kv: (kv[0] != "grpo", kv[0])):
        agg = {k: common.spread([s[k] for s in stats]) for k in stats[0]}
        row = {"runs": len(stats), **{k: v["mean"] for k, v in agg.items()}, "spread": agg}
        if base_policy:
            row["policy_time_vs_grpo"] = row["policy_update_s"] / base_policy
            row["policy_tokens_vs_grpo"] = row["policy_tokens_per_step"] / base_tok
            row["padded_tokens_vs_grpo"] = row["policy_tokens_padded_per_step"] / base_pad
        out[label] = row
    return out


def markdown(res: dict) -> str:
    lines = [
        "| arm | runs | step (s) | draw (ms) | process buffer (ms) | sampler share of step | policy update (s) | "
        "policy time / GRPO | policy tokens / GRPO | padded tokens / GRPO |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in res.items():
        rel = (
            f"{r['policy_time_vs_grpo']:.2f} | {r['policy_tokens_vs_grpo']:.2f} | {r['padded_tokens_vs_grpo']:.2f}"
            if "policy_time_vs_grpo" in r
            else "n/a | n/a | n/a"
        )
        lines.append(
            f"| {label} | {r['runs']} | {r['step_s']:.2f} | {r['draw_ms']:.2f} | {r['process_buffer_ms']:.2f} | "
            f"{r['sampler_share_pct']:.2f}% | {r['policy_update_s']:.3f} | {rel} |"
        )
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [
        (r["policy_tokens_vs_grpo"], r["policy_time_vs_grpo"], k) for k, r in res.items() if "policy_time_vs_grpo" in r
    ]
    if not rows:
        return
    fig = Figure(figsize=(6, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([0, 1.05], [0, 1.05], color="gray", linestyle="--", linewidth=0.8, label="time ∝ tokens")
    for x, y, k in rows:
        ax.scatter([x], [y])
        ax.annotate(k, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("policy tokens per step / GRPO")
    ax.set_ylabel("policy-update time per step / GRPO")
    ax.set_title("policy-update time vs kept tokens (median per step)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="15 steps, 1 seed")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40; quick 15)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 2; quick 1)")
    p.add_argument("--from", dest="from_dir", default=None, help="analyse the runs in this folder instead")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--tag", default=None, help="results file suffix (default quick / full / from-<folder>)")
    args = p.parse_args(argv)
    os.makedirs(common.RESULTS, exist_ok=True)
    if args.from_dir:
        tag = args.tag or f"from_{os.path.basename(os.path.normpath(args.from_dir))}"
        dirs = [os.path.join(args.from_dir, d) for d in sorted(os.listdir(args.from_dir))]
        dirs = [d for d in dirs if os.path.exists(os.path.join(d, common.RESULT_FILE))]
        if not dirs:
            raise SystemExit(
                f"--from {args.from_dir}: no run folder holds {common.RESULT_FILE}. Only runs made by "
                "benchmarks/_common.run_many (this script, the sums6 token-efficiency runs) record the sampler's "
                "timers; the testbed runs of token_efficiency.py (run_result.json) do not."
            )
    else:
        tag = args.tag or ("quick" if args.quick else "full")
        steps = args.steps or (15 if args.quick else 40)
        seeds = args.seeds or (1 if args.quick else 2)
        root = os.path.join(common.ROOT, "outputs", "bench", f"overhead_{tag}")
        specs = [
            dict(
                output_dir=os.path.join(root, f"{label}__s{seed}"),
                seed=seed,
                steps=steps,
                arm=arm,
                settings=settings,
                eval_n=0,
                group="overhead",
            )
            for seed in range(seeds)
            for label, (arm, settings) in ARMS.items()
        ]
        print(f"overhead ({tag}): {len(specs)} runs of {steps} steps in {root}", flush=True)
        common.run_many(specs, jobs=args.jobs)
        dirs = [s["output_dir"] for s in specs]
    res = analyse(dirs)
    base = os.path.join(common.RESULTS, f"overhead_{tag}")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(
            {"command": " ".join(["python", "benchmarks/overhead.py", *(argv or sys.argv[1:])]), "arms": res},
            fh,
            indent=1,
        )
    plot(res, base + ".png")
    md = markdown(res)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
