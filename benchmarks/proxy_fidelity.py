"""Benchmark 2: how well |A_i| predicts the true per-sequence gradient norm G_i (embedded default, mid-training).

    python benchmarks/proxy_fidelity.py --quick     # 10 GRPO steps, then 1 generation batch of 256 rows
    python benchmarks/proxy_fidelity.py             # 40 GRPO steps, then 3 generation batches

GRPO (the benchmark recipe, dapo loss, beta=0) trains the warmed-up tiny model for `--mid-steps` steps; then, for each
of `--batches` fresh generation batches (16 prompts x 16 rollouts), every row's own policy-loss term (TRL's
`_compute_loss` on that row alone, the full batch's token normaliser kept) is back-propagated separately, and G_i is
the norm of its gradient over all parameters. Reported: Pearson (and Spearman) correlation between |A_i| and G_i over
all rows and over the informative rows (A_i != 0; rows with A_i = 0 have G_i = 0 exactly when beta = 0), and the
distance of each sampling distribution from the optimum p* ∝ G_i/√c_i: χ²(r*‖r) with r_i ∝ p_i c_i, r*_i ∝ G_i √c_i,
which equals J(p)/J(p*) − 1 (ALGORITHM.md §1), computed with `trl_costaware.sampling`.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402


def chi2(g, c, p) -> float:
    """χ²(r*‖r), r_i ∝ p_i c_i, r*_i ∝ G_i √c_i (∞ if some G_i > 0 has p_i = 0)."""
    import torch

    g, c, p = g.double(), c.double(), p.double()
    r = p * c
    r = r / r.sum()
    rs = g * c.sqrt()
    rs = rs / rs.sum()
    if bool(((rs > 0) & (r <= 0)).any()):
        return float("inf")
    pos = r > 0
    return float((((rs - r) ** 2)[pos] / r[pos]).sum() + torch.zeros(()))


def pearson(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float:
    import numpy as np

    def rank(v):
        v = np.asarray(v, float)
        order = v.argsort(kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        # average ties
        for val in np.unique(v):
            idx = v == val
            r[idx] = r[idx].mean()
        return r

    return pearson(rank(x), rank(y))


def measure(args) -> dict:
    import torch

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.batching import select_rows
    from trl_costaware.embedded import arithmetic_dataset, arithmetic_reward, warmed_up_model_path
    from trl_costaware.sampling import (
        j_ratio_achieved,
        j_ratio_ideal,
        sampling_distribution,
        sampling_scores,
        sequence_costs,
    )

    torch.manual_seed(args.seed)
    s = common.BASE_SETTINGS
    prompts_per_step = s["per_device_train_batch_size"] // s["num_generations"]
    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.out, "train"),
        max_steps=max(args.mid_steps, 1),
        seed=args.seed,
        cost_aware=False,
        **s,
    )
    dataset = arithmetic_dataset(max(args.mid_steps, 1) * prompts_per_step + 64, seed=args.seed)
    trainer = CostAwareGRPOTrainer(warmed_up_model_path(), [arithmetic_reward], args=config, train_dataset=dataset)
    if args.mid_steps > 0:
        trainer.train()
    model = trainer.model
    model.train()
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by Trainer.train(); needed by dapo's loss
        trainer.current_gradient_accumulation_steps = s.get("gradient_accumulation_steps", 1)
    params = [p for p in model.parameters() if p.requires_grad]
    held = arithmetic_dataset(args.batches * prompts_per_step, seed=10_000 + args.seed)
    rows, batches = [], []
    for b in range(args.batches):
        prompts = [held[i] for i in range(b * prompts_per_step, (b + 1) * prompts_per_step)]
        inputs = [dict(p) for p in prompts for _ in range(s["num_generations"])]
        t0 = time.perf_counter()
        batch = trainer._generate_and_score_completions(inputs)
        adv = batch["advantages"].detach().float().cpu()
        costs = sequence_costs(batch["prompt_mask"], batch["completion_mask"]).cpu()
        g_true = torch.zeros(len(adv), dtype=torch.float64)
        for i in range(len(adv)):
            sub = select_rows(batch, torch.tensor([i]))
            loss = trainer._compute_loss(model, sub)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            g_true[i] = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
        absa = adv.abs().double()
        info = absa > 0
        res = {
            "batch": b,
            "rows": len(adv),
            "informative_rows": int(info.sum()),
            "seconds": time.perf_counter() - t0,
            "pearson_all": pearson(absa, g_true),
            "pearson_informative": pearson(absa[info], g_true[info]),
            "spearman_all": spearman(absa, g_true),
            "spearman_informative": spearman(absa[info], g_true[info]),
            "pearson_zero_grad_iff_zero_adv": bool(((g_true > 1e-12) == info).all()),
            "j_ideal_true": j_ratio_ideal(g_true, costs),
            "j_ideal_proxy": j_ratio_ideal(absa, costs),
            "distributions": {},
        }
        dists = {
            "advantage alpha=0": sampling_distribution(sampling_scores(adv, costs, "advantage"), 0.0),
            "advantage alpha=0.1": sampling_distribution(sampling_scores(adv, costs, "advantage"), 0.1),
            "advantage alpha=0.3": sampling_distribution(sampling_scores(adv, costs, "advantage"), 0.3),
            "uniform": sampling_distribution(sampling_scores(adv, costs, "uniform"), 0.0),
            "inverse_sqrt_cost": sampling_distribution(sampling_scores(adv, costs, "inverse_sqrt_cost"), 0.0),
            "optimal p* (true G)": sampling_distribution(g_true / costs.double().sqrt(), 0.0),
        }
        for name, p in dists.items():
            res["distributions"][name] = {
                "chi2": chi2(g_true, costs, p),
                "j_over_j_opt": j_ratio_achieved(g_true, costs, p) / res["j_ideal_true"],
                "j_over_j_uniform": j_ratio_achieved(g_true, costs, p),
            }
        batches.append(res)
        for i in range(len(adv)):
            rows.append(
                {
                    "batch": b,
                    "abs_advantage": float(absa[i]),
                    "grad_norm": float(g_true[i]),
                    "cost": float(costs[i]),
                    "completion_tokens": float(batch["completion_mask"][i].sum()),
                }
            )
        print(
            f"batch {b}: pearson all {res['pearson_all']:.3f}, informative {res['pearson_informative']:.3f}, "
            f"chi2(advantage, alpha=0.1) {res['distributions']['advantage alpha=0.1']['chi2']:.4f}",
            flush=True,
        )
    return {"mid_steps": args.mid_steps, "seed": args.seed, "batches": batches, "rows": rows}


def write_outputs(res: dict, tag: str) -> str:
    import numpy as np

    base = os.path.join(common.RESULTS, f"proxy_fidelity_{tag}")
    with open(base + ".csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(res["rows"][0]))
        w.writeheader()
        w.writerows(res["rows"])
    summary = {k: v for k, v in res.items() if k != "rows"}
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    a = np.array([r["abs_advantage"] for r in res["rows"]])
    g = np.array([r["grad_norm"] for r in res["rows"]])
    c = np.array([r["completion_tokens"] for r in res["rows"]])
    sc = ax.scatter(a, g, c=c, s=8, cmap="viridis", alpha=0.7)
    fig.colorbar(sc, ax=ax, label="completion tokens")
    ax.set_xlabel("|A_i| (proxy)")
    ax.set_ylabel("per-row policy-gradient norm G_i")
    ax.set_title(f"proxy fidelity after {res['mid_steps']} GRPO steps, Pearson {pearson(a, g):.3f}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(base + ".png")

    lines = [
        f"After {res['mid_steps']} GRPO steps (seed {res['seed']}); {len(res['batches'])} generation batch(es) of "
        f"{res['batches'][0]['rows']} rows.",
        "",
        "| batch | informative rows | Pearson \\|A\\| vs G (all rows) | Pearson (A≠0 rows) | Spearman (A≠0) | "
        "J(p*)/J(u) true G | J(p*)/J(u) proxy |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in res["batches"]:
        lines.append(
            f"| {b['batch']} | {b['informative_rows']}/{b['rows']} | {b['pearson_all']:.3f} | "
            f"{b['pearson_informative']:.3f} | {b['spearman_informative']:.3f} | {b['j_ideal_true']:.3f} | "
            f"{b['j_ideal_proxy']:.3f} |"
        )
    names = list(res["batches"][0]["distributions"])
    lines += [
        "",
        "χ²(r*‖r) = J(p)/J(p*) − 1 against the optimum built from the true G (mean over batches):",
        "",
        "| distribution | χ² | J(p)/J(p*) | J(p)/J(uniform) |",
        "|---|---|---|---|",
    ]
    for n in names:
        vals = [b["distributions"][n] for b in res["batches"]]
        lines.append(
            f"| {n} | {np.mean([v['chi2'] for v in vals]):.4f} | {np.mean([v['j_over_j_opt'] for v in vals]):.3f} |"
            f" {np.mean([v['j_over_j_uniform'] for v in vals]):.3f} |"
        )
    md = "\n".join(lines)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    return md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 GRPO steps, one generation batch")
    p.add_argument("--mid-steps", type=int, default=None, help="GRPO steps before measuring (default 40; quick 10)")
    p.add_argument("--batches", type=int, default=None, help="generation batches measured (default 3; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tag = "quick" if args.quick else "full"
    args.mid_steps = args.mid_steps if args.mid_steps is not None else (10 if args.quick else 40)
    args.batches = args.batches or (1 if args.quick else 3)
    args.out = args.out or os.path.join(common.ROOT, "outputs", "bench", f"proxy_fidelity_{tag}")
    for k, v in common.ENV.items():
        os.environ.setdefault(k, v)
    os.makedirs(common.RESULTS, exist_ok=True)
    res = measure(args)
    print(write_outputs(res, tag))


if __name__ == "__main__":
    main()
