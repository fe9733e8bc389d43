"""Static cost-aware subset selection on the synthetic convex problem (docs/algorithm.md §3): cost and error against Γ.

Same problem family as benchmarks/cost_aware_sgd.py (weighted LAD, n = 1000, d = 20, G_i ~ LogNormal(0, 0.7),
c_i ~ U[1, 10], one instance per seed). For each bias budget Γ (in units of Ḡ = (1/n) Σ G_i):

1. `trl_costaware.subset.greedy_subset` drops the most expensive examples while (1/n) Σ_dropped G_i ≤ Γ;
2. cost-aware SGD (p_i ∝ G_i/√c_i on the kept set, 0 on the dropped ones, step x ← x − η ∇f_i/(n p_i)) runs on the
   kept set, with the theory's step η = κ ε_abs/S_K(p), S_K(p) = (1/n²) Σ_{i∈K} G_i²/p_i, ε_abs = ε (F(x₀) − F*),
   and κ tuned for every Γ as in benchmarks/cost_aware_sgd.py (tuning instances, seeds 1000+; the κ with the
   smallest worst-case cost to ε; if no κ reaches ε on every tuning instance, the smallest κ of the grid);
3. the error is measured on the FULL objective: (F(x) − F*)/(F(x₀) − F*), F* the full optimum.

Reported against Γ: the total cost (Σ c of sampled components) until the replicate-mean error reaches ε = 0.01
(or "not reached" within the budget B), the error at the fixed cost budget B (replicate-mean, averaged over the
checks in the last 10% of B: constant-step SGD keeps a noise floor of its own), the deterministic bias floor
(F(x*_K) − F*)/(F(x₀) − F*) with x*_K the exact minimiser of the kept sum, and the theory's cost factor ratio
J_K/J_all = (Σ_K G√c)²/(Σ G√c)². B = 2.5 × the mean tuning cost to ε at Γ = 0.

    python benchmarks/subset_selection.py --seeds 20 --out benchmarks/results
    python benchmarks/subset_selection.py --quick
    python benchmarks/subset_selection.py --smoke --out /tmp/subset   # the machinery only, seconds (its test)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_aware_sgd import (
    KAPPAS,
    QUICK_KAPPAS,
    Run,
    downsample,
    lad_minimize,
    make_problem,
    sampler_distribution,
    sanitize,
    simulate,
    step_size,
    tune_kappa,
)

from trl_costaware.subset import greedy_subset

GAMMA_FRACTIONS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
QUICK_GAMMA_FRACTIONS = (0.0, 0.02, 0.1)


def kept_distribution(G: np.ndarray, c: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """p* restricted to the kept set: ∝ G_i/√c_i on K, 0 elsewhere (built with trl_costaware.rows.sampling)."""
    G_k = np.where(np.isin(np.arange(G.size), kept), G, 0.0)
    return sampler_distribution("gradient_over_sqrt_cost", G_k, c)


def bias_floor(pr, kept: np.ndarray) -> float:
    """(F(x*_K) − F*)/(F(x₀) − F*): the full-objective error of the exact minimiser of the kept sum."""
    x_k = lad_minimize(pr.U[kept], pr.b[kept], pr.G[kept])
    return float(pr.relative_error(x_k[None])[0])


def run_family(label, kw, seeds, tune_seeds, replicates, fractions, kappas, target) -> dict:
    t0 = time.time()
    # κ per Γ, tuned as in cost_aware_sgd.py (worst case over the tuning instances, same number of chains): a step
    # tuned on the full data puts the SGD noise floor right at ε and leaves no room for any bias.
    tune_problems = [make_problem(s, **kw) for s in tune_seeds]
    cap = 60.0 * float(np.mean([pr.c.sum() for pr in tune_problems]))
    dists = {
        f"{frac:g}": [
            kept_distribution(q.G, q.c, greedy_subset(q.c, q.G, frac * q.G.mean()).kept) for q in tune_problems
        ]
        for frac in fractions
    }
    best, table = tune_kappa(tune_problems, dists, kappas, target, cap, replicates, allow_failures=True)
    # The fixed cost budget B: 2.5 × the mean tuning cost to ε of p* on the full data (Γ = 0).
    budget = 2.5 * float(np.mean(table["0"][f"{best['0']:.6g}"]))
    t_tune = time.time() - t0

    problems = [make_problem(s, **kw) for s in seeds]
    runs, meta = [], []
    for k, pr in enumerate(problems):
        g_bar = pr.G.mean()
        for frac in fractions:
            sel = greedy_subset(pr.c, pr.G, frac * g_bar)
            p = kept_distribution(pr.G, pr.c, sel.kept)
            kappa = best[f"{frac:g}"]
            runs.append(Run(k, p, step_size(kappa, target, pr, pr.G, p), pr.seed))
            meta.append(
                {
                    "seed": pr.seed,
                    "gamma_fraction": frac,
                    "gamma": frac * g_bar,
                    "kappa": kappa,
                    "dropped": int(sel.dropped.size),
                    "bias_bound": sel.bias_bound,
                    "bias_bound_fraction": sel.bias_bound / g_bar,
                    "pass_cost_ratio": sel.total_cost_after / sel.total_cost_before,
                    "cost_factor_ratio": sel.cost_factor_ratio,
                    "lp_gap": sel.cost_factor_after / sel.cost_factor_lower_bound - 1.0,
                    "mean_cost_per_step": float((p * pr.c).sum()),
                    "bias_floor": bias_floor(pr, sel.kept),
                }
            )
    res = simulate(problems, runs, target, replicates=replicates, cost_cap=budget, run_until=budget, record=True)
    for j, m in enumerate(meta):
        m["hit_cost"] = float(res.hit_cost[j])
        cc, ee = res.curves[j]
        m["final_error"] = float(ee[cc >= 0.9 * budget].mean())  # mean over the last 10% of the budget
        m["min_error"] = float(res.min_error[j])
        m["curve"] = downsample(cc, ee, points=100)
    t_eval = time.time() - t0 - t_tune
    return {
        "label": label,
        "problem": kw,
        "seeds": seeds,
        "tune_seeds": tune_seeds,
        "replicates": replicates,
        "kappa": best,
        "kappa_grid": kappas,
        "tuning_table": table,
        "budget": budget,
        "gamma_fractions": list(fractions),
        "summary": summarize(meta, fractions),
        "runs": meta,
        "seconds": {"tune": t_tune, "eval": t_eval},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tune-seeds", type=int, default=6)
    ap.add_argument("--replicates", type=int, default=4, help="SGD chains per seed and Γ (the error is their mean)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the machinery only, in seconds: n = 200, ε = 0.1, 1 seed")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default benchmarks/results, or benchmarks/results/tmp with --quick)",
    )
    ap.add_argument("--target", type=float, default=0.01)
    ap.add_argument("--g-sigma", type=float, default=0.7)
    ap.add_argument("--no-noise-free", action="store_true", help="skip the noise-free (consistent data) family")
    args = ap.parse_args(argv)
    if args.out is None:  # quick and smoke runs never overwrite the committed full results
        args.out = Path("benchmarks/results/tmp" if args.quick or args.smoke else "benchmarks/results")

    problem = {}
    if args.smoke:
        seeds, tune_seeds, replicates, fractions = [0], [1000], 1, QUICK_GAMMA_FRACTIONS
        kappas, problem, args.target = QUICK_KAPPAS[:2], {"n": 200, "d": 5}, max(args.target, 0.1)
    elif args.quick:
        seeds, tune_seeds, replicates, fractions = list(range(3)), [1000, 1001], 2, QUICK_GAMMA_FRACTIONS
        kappas = QUICK_KAPPAS
    else:
        seeds, tune_seeds = list(range(args.seeds)), list(range(1000, 1000 + args.tune_seeds))
        replicates, fractions = args.replicates, GAMMA_FRACTIONS
        kappas = KAPPAS
    families = [("noisy data (Laplace noise 0.3)", {"g_sigma": args.g_sigma, "noise": 0.3, **problem})]
    if not args.no_noise_free:
        # Consistent data: every subset that spans R^d has the same minimiser, so the bias floor is 0 and only the
        # cost side of the trade-off remains (the best case for dropping examples).
        families.append(("noise-free data (b = Ux_true)", {"g_sigma": args.g_sigma, "noise": 0.0, **problem}))
    results = []
    for label, kw in families:
        fam = run_family(label, kw, seeds, tune_seeds, replicates, fractions, kappas, args.target)
        results.append(fam)
        print(markdown_table(fam, args.target))
        print(f"(tuning {fam['seconds']['tune']:.0f}s, evaluation {fam['seconds']['eval']:.0f}s)\n", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "subset_selection",
        "command": "python benchmarks/subset_selection.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick,
        "smoke": args.smoke,
        "target": args.target,
        "families": results,
    }
    (args.out / "subset_selection.json").write_text(json.dumps(sanitize(payload)))
    plot(results, args.target, args.out / "subset_selection.png")
    print(f"wrote {args.out / 'subset_selection.json'} and {args.out / 'subset_selection.png'}")
    return payload


def _ms(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=float)
    fin = x[np.isfinite(x)]
    if not fin.size:
        return float("nan"), float("nan")
    return float(fin.mean()), float(fin.std(ddof=1)) if fin.size > 1 else 0.0


def summarize(meta: list[dict], fractions) -> list[dict]:
    rows = []
    base = {m["seed"]: m["hit_cost"] for m in meta if m["gamma_fraction"] == 0.0}
    for frac in fractions:
        ms = [m for m in meta if m["gamma_fraction"] == frac]
        hits = np.asarray([m["hit_cost"] for m in ms])
        ratios = np.asarray([m["hit_cost"] / base[m["seed"]] for m in ms])
        row = {"gamma_fraction": frac, "not_reached": int(np.isnan(hits).sum()), "n": len(ms)}
        for key in (
            "kappa",
            "dropped",
            "bias_bound",
            "bias_bound_fraction",
            "pass_cost_ratio",
            "cost_factor_ratio",
            "lp_gap",
            "mean_cost_per_step",
            "bias_floor",
            "final_error",
            "min_error",
        ):
            row[key], row[key + "_std"] = _ms([m[key] for m in ms])
        row["hit_cost"], row["hit_cost_std"] = _ms(hits)
        row["cost_ratio_to_gamma0"], row["cost_ratio_to_gamma0_std"] = _ms(ratios)
        rows.append(row)
    return rows


def markdown_table(fam: dict, target: float) -> str:
    rows = fam["summary"]
    lines = [
        (
            f"**{fam['label']}**: greedy (cost order), {len(fam['seeds'])} seeds × {fam['replicates']} SGD "
            f"replicates, p ∝ G/√c on the kept set, η = κ ε_abs/S_K(p) with κ tuned per Γ; ε = {target}; "
            f"budget B = {fam['budget']:,.0f}"
        ),
        "",
        (
            "| Γ / Ḡ | dropped (of 1000) | bias bound / Ḡ | pass cost Σ_K c / Σ c | theory J_K/J_all | LP gap | κ | "
            "cost to ε on full F (mean ± std) | / Γ=0 (per seed) | error at B (mean ± std) | bias floor |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        g_frac = r["gamma_fraction"]
        hit = "not reached" if not np.isfinite(r["hit_cost"]) else f"{r['hit_cost']:,.0f} ± {r['hit_cost_std']:,.0f}"
        if r["not_reached"] and np.isfinite(r["hit_cost"]):
            hit += f" ({r['not_reached']}/{r['n']} not reached)"
        elif r["not_reached"]:
            hit = f"not reached ({r['not_reached']}/{r['n']})"
        ratio = (
            "—"
            if not np.isfinite(r["cost_ratio_to_gamma0"])
            else (f"{r['cost_ratio_to_gamma0']:.3f} ± {r['cost_ratio_to_gamma0_std']:.3f}")
        )
        lines.append(
            f"| {g_frac:g} | {r['dropped']:.1f} | {r['bias_bound_fraction']:.3f} | {r['pass_cost_ratio']:.3f} | "
            f"{r['cost_factor_ratio']:.3f} | {r['lp_gap']:.1e} | {r['kappa']:.3g} | {hit} | {ratio} | "
            f"{r['final_error']:.4f} ± {r['final_error_std']:.4f} | {r['bias_floor']:.4f} |"
        )
    return "\n".join(lines)


def plot(families: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(families), 2, figsize=(12, 4.2 * len(families)), squeeze=False)
    for (a1, a2), fam in zip(axes, families, strict=True):
        rows = fam["summary"]
        x = np.asarray([r["gamma_fraction"] for r in rows])
        hit = np.asarray([r["hit_cost"] for r in rows], dtype=float)  # None (from JSON) → nan
        hit_sd = np.asarray([r["hit_cost_std"] for r in rows], dtype=float)
        a1.errorbar(x, hit, yerr=hit_sd, marker="o", capsize=3, label="measured (mean ± std over seeds)")
        theory = hit[0] * np.asarray([r["cost_factor_ratio"] for r in rows], dtype=float)
        a1.plot(x, theory, "k--", label="cost(Γ=0) × J_K/J_all (same step)")
        for k, (xi, r) in enumerate(zip(x, rows, strict=True)):
            if r["not_reached"]:
                a1.annotate(
                    f"{r['not_reached']}/{r['n']}\nnot reached",
                    (xi, 0),
                    textcoords="offset points",
                    xytext=(0, 6 + 18 * (k % 2)),
                    ha="center",
                    fontsize=7,
                )
        a1.set_ylim(bottom=0)
        a1.set_xlabel("bias budget Γ / Ḡ")
        a1.set_ylabel(f"total cost to ε = {target} on the full F")
        a1.set_title(f"{fam['label']}: cost to target")
        a1.legend(fontsize=8)
        err = np.asarray([r["final_error"] for r in rows], dtype=float)
        err_sd = np.asarray([r["final_error_std"] for r in rows], dtype=float)
        a2.errorbar(x, err, yerr=err_sd, marker="o", capsize=3, label=f"SGD error at cost B = {fam['budget']:,.0f}")
        floor = np.asarray([r["bias_floor"] for r in rows], dtype=float)
        a2.plot(x, np.maximum(floor, 1e-6), "s-", label="bias floor (F(x*_K) − F*)/(F(x₀) − F*) (0 drawn at 1e-6)")
        a2.axhline(target, color="k", ls="--", lw=0.8, label=f"ε = {target}")
        a2.set_yscale("log")
        a2.set_xlabel("bias budget Γ / Ḡ")
        a2.set_ylabel("relative error on the full objective")
        a2.set_title(f"{fam['label']}: final error ({len(fam['seeds'])} seeds)")
        a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
