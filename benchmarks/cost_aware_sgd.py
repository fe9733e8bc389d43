"""Cost-Aware SGD on a synthetic convex finite sum (docs/algorithm.md §1): measured total cost against the theory's
J ratio.

Problem (one instance per seed). Weighted least absolute deviations, a convex finite sum whose components are
Lipschitz with known constants, so that the theory's G_i are exact gradient norms, not loose bounds:

    F(x) = (1/n) Σ_i f_i(x),   f_i(x) = G_i |u_iᵀx − b_i|,   ‖∇f_i(x)‖ = G_i  (for u_iᵀx ≠ b_i),

n = 1000, d = 20, u_i uniform on the unit sphere, b_i = u_iᵀx_true + Laplace noise (scale 0.3, ‖x_true‖ = 1),
heterogeneous gradient norms G_i ~ LogNormal(0, σ_G) (σ_G = 0.7 by default; σ_G = 0 gives G_i = 1 for all i), and
costs c_i ~ U[1, 10] independent of G_i. F* is computed by iteratively reweighted least squares.

Target. ε = 0.01 relative suboptimality: (F(x) − F*) / (F(x_0) − F*) ≤ ε with x_0 = 0 (the last iterate; no
averaging). Total cost = Σ c_i over the sampled components up to the check that meets the target.

SGD. Sample i ~ p (i.i.d., `draw_multinomial` below), step x ← x − η ∇f_i(x) / (n p_i). Samplers: uniform, ∝ 1/c
(ablation), ∝ 1/√c, ∝ G, ∝ G/√c (the method, p*), normalised by trl_costaware.rows.sampling.sampling_distribution
(the package's proxies give uniform and G/√c; the ablations 1/c and 1/√c are built here).

Step size, fair to every sampler. The theory's constant step for Lipschitz SGD is η = ε_abs / S(p) with
S(p) = (1/n²) Σ_i G_i²/p_i = E‖g‖² (the second moment of the stochastic gradient) and ε_abs = ε (F(x₀) − F*) the
target in absolute units. We use η = κ_s ε_abs / S(p) and tune κ_s separately for every sampler on a geometric grid
(factor √2) over tuning instances (seeds 1000+) disjoint from the evaluation seeds, with the same number of chains
per instance as the evaluation, taking the κ with the lowest worst-case cost over the tuning instances among those
that reach ε on all of them (a constant step has an error floor ∝ κ ε_abs; the worst case keeps the choice away from
the κ where the floor touches ε, which the mean over a few instances does not). The theory predicts the same κ for
every sampler; the table shows the tuned values.

Criterion. Each seed runs R independent SGD chains (default 4) on its instance; the cost to ε is the mean cumulative
cost at the first check (every 10 steps) where the chains' mean relative error is ≤ ε, an estimate of the theory's
E[F(x)] − F* ≤ ε. The single-chain first-hit costs are kept in the JSON.

Outputs: <out>/cost_aware_sgd.json (config, tuning table, raw per-seed costs and curves) and
<out>/cost_aware_sgd.png (relative error against cumulative cost, mean over seeds with a ±1 std band); a markdown
table on stdout.

    python benchmarks/cost_aware_sgd.py --seeds 20 --out benchmarks/results
    python benchmarks/cost_aware_sgd.py --quick
    python benchmarks/cost_aware_sgd.py --smoke --out /tmp/sgd   # the machinery only, seconds (its test)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

try:
    from trl_costaware.rows import sampling
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trl_costaware.rows import sampling

SAMPLERS = ("uniform", "inverse_cost", "inverse_sqrt_cost", "gradient", "gradient_over_sqrt_cost")
KAPPAS = [2 ** (k / 2) for k in range(0, 7)]  # 1 … 8, factor √2
QUICK_KAPPAS = [2 ** (k / 2) for k in range(2, 6, 1)]
SAMPLER_LABELS = {
    "uniform": "uniform",
    "inverse_cost": "∝ 1/c",
    "inverse_sqrt_cost": "∝ 1/√c",
    "gradient": "∝ G",
    "gradient_over_sqrt_cost": "∝ G/√c (p*)",
}


# ---------------------------------------------------------------------------------------------------------------
# Problem


@dataclass
class Problem:
    """One weighted-LAD instance. Arrays are float64 numpy."""

    U: np.ndarray  # (n, d) unit rows
    b: np.ndarray  # (n,)
    G: np.ndarray  # (n,) exact gradient norms
    c: np.ndarray  # (n,) costs
    x_star: np.ndarray  # (d,)
    f_star: float
    f0_gap: float  # F(x_0) − F*, x_0 = 0
    seed: int

    @property
    def n(self) -> int:
        return self.U.shape[0]

    @property
    def d(self) -> int:
        return self.U.shape[1]

    def objective(self, X: np.ndarray) -> np.ndarray:
        """F at each row of X (B, d)."""
        return (self.G[:, None] * np.abs(self.U @ X.T - self.b[:, None])).mean(0)

    def relative_error(self, X: np.ndarray) -> np.ndarray:
        return (self.objective(X) - self.f_star) / self.f0_gap


def lad_minimize(U: np.ndarray, b: np.ndarray, G: np.ndarray, iters: int = 300) -> np.ndarray:
    """argmin_x Σ_i G_i |u_iᵀx − b_i| by iteratively reweighted least squares with a shrinking smoothing δ."""
    x = np.linalg.lstsq(U, b, rcond=None)[0]
    for k in range(iters):
        delta = max(1e-13, 1e-3 * 0.9**k)
        w = G / np.maximum(np.abs(U @ x - b), delta)
        x = np.linalg.solve(U.T @ (w[:, None] * U) + 1e-14 * np.eye(U.shape[1]), U.T @ (w * b))
    return x


def make_problem(
    seed: int,
    n: int = 1000,
    d: int = 20,
    g_sigma: float = 0.7,
    noise: float = 0.3,
    cost_low: float = 1.0,
    cost_high: float = 10.0,
) -> Problem:
    rng = np.random.default_rng(seed)
    U = rng.normal(size=(n, d))
    U /= np.linalg.norm(U, axis=1, keepdims=True)
    G = rng.lognormal(0.0, g_sigma, n) if g_sigma > 0 else np.ones(n)
    c = rng.uniform(cost_low, cost_high, n)
    x_true = rng.normal(size=d)
    x_true /= np.linalg.norm(x_true)
    b = U @ x_true + noise * rng.laplace(size=n)
    x_star = lad_minimize(U, b, G)
    f_star = float((G * np.abs(U @ x_star - b)).mean())
    f0 = float((G * np.abs(b)).mean())
    return Problem(U=U, b=b, G=G, c=c, x_star=x_star, f_star=f_star, f0_gap=f0 - f_star, seed=seed)


def sampler_distribution(name: str, G: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The sampling distribution p (float64 numpy), from trl_costaware.rows.sampling (G plays the role of |A|)."""
    g_t, c_t = torch.as_tensor(G, dtype=torch.float64), torch.as_tensor(c, dtype=torch.float64)
    if name == "uniform":
        scores = sampling.sampling_scores(g_t, c_t, proxy="uniform")
    elif name == "inverse_cost":  # ablations the package no longer ships (docs/algorithm.md §1: 1/c is no gain)
        scores = 1.0 / c_t.clamp(min=sampling.MIN_COST)
    elif name == "inverse_sqrt_cost":
        scores = 1.0 / c_t.clamp(min=sampling.MIN_COST).sqrt()
    elif name == "gradient":
        scores = g_t
    elif name == "gradient_over_sqrt_cost":
        scores = sampling.sampling_scores(g_t, c_t, proxy="advantage")
    else:
        raise ValueError(f"unknown sampler {name!r}")
    return sampling.sampling_distribution(scores).numpy()


def draw_multinomial(p: torch.Tensor, m: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """m i.i.d. draws from p (with replacement) and their Hansen–Hurwitz weights w = 1/(n p_i):
    E[(1/m) Σ_k w_{i_k} L_{i_k}] = (1/n) Σ_i L_i. (The trainer draws without replacement; SGD draws one at a time.)"""
    p = p.double()
    idx = torch.multinomial(p, m, replacement=True, generator=generator)
    return idx, 1.0 / (p.numel() * p[idx])


def second_moment(G: np.ndarray, p: np.ndarray, n: int) -> float:
    """S(p) = (1/n²) Σ_i G_i²/p_i = E‖∇f_i/(n p_i)‖² (with the exact gradient norms of the LAD components), summed
    over the support of p: for a subset (p = 0 on the dropped rows) this is S_K(p), the second moment of the
    unbiased estimator of (1/n) Σ_{i∈K} ∇f_i."""
    pos = (G > 0) & (p > 0)
    return float((G[pos] ** 2 / p[pos]).sum() / n**2)


def step_size(kappa: float, target: float, pr: Problem, G: np.ndarray, p: np.ndarray) -> float:
    """The theory's constant step η = κ · ε_abs / S(p), ε_abs = ε · (F(x₀) − F*) the target in absolute units.

    For Lipschitz SGD, E F(x̄_T) − F* ≤ D²/(2ηT) + η S(p)/2: η = ε_abs/S(p) reaches ε_abs in T ∝ S(p) steps, i.e. a
    total cost ∝ S(p)·C(p) = J(p). The factor κ is tuned per sampler; the theory says one κ fits all samplers."""
    return kappa * target * pr.f0_gap / second_moment(G, p, pr.n)


def j_ratio(G: np.ndarray, c: np.ndarray, p: np.ndarray) -> float:
    return sampling.j_ratio_achieved(torch.as_tensor(G), torch.as_tensor(c), torch.as_tensor(p))


def j_ratio_ideal(G: np.ndarray, c: np.ndarray) -> float:
    return sampling.j_ratio_ideal(torch.as_tensor(G), torch.as_tensor(c))


# ---------------------------------------------------------------------------------------------------------------
# Batched SGD. A Run is one configuration (instance, p, η), simulated as `replicates` independent SGD chains; all
# chains of all runs advance in lock-step, so the replicates of a run always share their step count.


@dataclass
class Run:
    problem: int  # index into the problems list
    p: np.ndarray  # (n,) sampling distribution over the problem's components (0 for dropped components)
    eta: float
    seed: int  # replicate r draws with torch.Generator().manual_seed(seed * 1000 + r)


@dataclass
class RunResult:
    hit_cost: np.ndarray  # (runs,) mean cumulative cost at the first check where the replicate-mean error ≤ target
    single_hit_cost: np.ndarray  # (runs, replicates) per chain: cumulative cost at its own first check ≤ target
    final_error: np.ndarray  # (runs,) replicate-mean relative error at the end of the run
    min_error: np.ndarray  # (runs,) smallest replicate-mean relative error seen at a check
    final_cost: np.ndarray  # (runs,) mean cumulative cost at the end of the run
    curves: list[tuple[np.ndarray, np.ndarray]] | None  # per run: (mean cumulative cost, mean error) at each check


def simulate(
    problems: list[Problem],
    runs: list[Run],
    target: float,
    *,
    replicates: int,
    cost_cap: float,
    run_until: float = 0.0,
    every: int = 10,
    chunk: int = 500,
    record: bool = False,
) -> RunResult:
    """Constant-step SGD for every run until its replicate-mean relative error has met the target and it has spent
    at least `run_until`, or it has spent `cost_cap` (mean over its replicates).

    Each chain draws its indices with its own torch.Generator via `draw_multinomial`, whose
    Hansen–Hurwitz weight w = 1/(n p_i) is exactly the SGD importance factor: x ← x − η w G_i sign(u_iᵀx − b_i) u_i.
    """
    R = replicates
    n_runs = len(runs)
    d = problems[0].d
    U_all = np.stack([pr.U for pr in problems])  # (P, n, d)
    b_all = np.stack([pr.b for pr in problems])
    c_all = np.stack([pr.c for pr in problems])
    UG_all = U_all * np.stack([pr.G for pr in problems])[:, :, None]
    prob_of = np.repeat([r.problem for r in runs], R)  # per chain
    eta = np.repeat([r.eta for r in runs], R)
    gens = [torch.Generator().manual_seed(int(r.seed) * 1000 + k) for r in runs for k in range(R)]
    p_t = [torch.as_tensor(r.p, dtype=torch.float64) for r in runs]

    X = np.zeros((n_runs * R, d))
    cost = np.zeros(n_runs * R)
    hit = np.full(n_runs, np.nan)
    single_hit = np.full(n_runs * R, np.nan)
    final_err = np.full(n_runs, np.nan)
    min_err = np.full(n_runs, np.inf)
    final_cost = np.zeros(n_runs)
    log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (runs, mean cost, mean error) at each check
    active = np.arange(n_runs)  # runs still going

    while active.size:
        chains = (active[:, None] * R + np.arange(R)).reshape(-1)
        idx = np.empty((chunk, chains.size), dtype=np.int64)
        wts = np.empty((chunk, chains.size))
        for j, ch in enumerate(chains):
            indices, weights = draw_multinomial(p_t[ch // R], chunk, gens[ch])
            idx[:, j] = indices.numpy()
            wts[:, j] = weights.numpy()
        pa = prob_of[chains][None, :]
        Uc = U_all[pa, idx]  # (chunk, chains, d)
        UGc = UG_all[pa, idx]
        bc = b_all[pa, idx]
        coef = eta[chains][None, :] * wts  # η / (n p_i)
        cum = cost[chains][None, :] + np.cumsum(c_all[pa, idx], axis=0)
        groups = np.unique(prob_of[chains])
        Xa = X[chains]
        mean_err = None
        for t in range(chunk):
            r_t = np.einsum("bd,bd->b", Uc[t], Xa) - bc[t]
            Xa -= (coef[t] * np.sign(r_t))[:, None] * UGc[t]
            if (t + 1) % every:
                continue
            err = np.empty(chains.size)
            for k in groups:
                sel = prob_of[chains] == k
                err[sel] = problems[k].relative_error(Xa[sel])
            mean_err = err.reshape(-1, R).mean(1)
            mean_cost = cum[t].reshape(-1, R).mean(1)
            if record:
                log.append((active, mean_cost, mean_err))
            min_err[active] = np.minimum(min_err[active], mean_err)
            new = np.isnan(hit[active]) & (mean_err <= target)
            hit[active[new]] = mean_cost[new]
            new_chain = np.isnan(single_hit[chains]) & (err <= target)
            single_hit[chains[new_chain]] = cum[t][new_chain]
        X[chains] = Xa
        cost[chains] = cum[-1]
        spent = cost[chains].reshape(-1, R).mean(1)
        diverged = ~np.isfinite(Xa).all(axis=1).reshape(-1, R).all(axis=1)
        done = (~np.isnan(hit[active]) & (spent >= run_until)) | (spent >= cost_cap) | diverged
        final_err[active[done]] = mean_err[done]
        final_cost[active[done]] = spent[done]
        active = active[~done]

    curves = None
    if record:
        run_l = np.concatenate([a for a, _, _ in log])
        cost_l = np.concatenate([c for _, c, _ in log])
        err_l = np.concatenate([e for _, _, e in log])
        order = np.argsort(run_l, kind="stable")  # checks were appended in time order: stable keeps it per run
        run_l, cost_l, err_l = run_l[order], cost_l[order], err_l[order]
        bounds = np.searchsorted(run_l, np.arange(n_runs + 1))
        curves = [
            (np.r_[0.0, cost_l[bounds[r] : bounds[r + 1]]], np.r_[1.0, err_l[bounds[r] : bounds[r + 1]]])
            for r in range(n_runs)
        ]
    return RunResult(
        hit_cost=hit,
        single_hit_cost=single_hit.reshape(n_runs, R),
        final_error=final_err,
        min_error=min_err,
        final_cost=final_cost,
        curves=curves,
    )


# ---------------------------------------------------------------------------------------------------------------
# Tuning and evaluation


def tune_kappa(
    problems: list[Problem],
    distributions: dict[str, list[np.ndarray]],
    kappas: list[float],
    target: float,
    cost_cap: float,
    replicates: int,
    seed_offset: int = 10_000,
    allow_failures: bool = False,
) -> tuple[dict[str, float], dict[str, dict[str, list[float]]]]:
    """Per sampler, the κ (η = κ ε_abs / S(p)) with the lowest worst-case cost to target over the tuning problems,
    among the κ that met the target on all of them within `cost_cap` (with `allow_failures`, the smallest κ when none
    did). Returns (best κ per sampler, full table)."""
    runs, keys = [], []
    for name, dists in distributions.items():
        for kappa in kappas:
            for k, (pr, p) in enumerate(zip(problems, dists, strict=True)):
                runs.append(Run(problem=k, p=p, eta=step_size(kappa, target, pr, pr.G, p), seed=seed_offset + k))
                keys.append((name, kappa))
    res = simulate(problems, runs, target, replicates=replicates, cost_cap=cost_cap)
    table: dict[str, dict[str, list[float]]] = {name: {} for name in distributions}
    for (name, kappa), h in zip(keys, res.hit_cost, strict=True):
        table[name].setdefault(f"{kappa:.6g}", []).append(float(h))
    best: dict[str, float] = {}
    for name in distributions:
        # Robust choice: the κ with the smallest worst-case cost over the tuning instances (then the smallest mean).
        scores = {}
        for kappa in kappas:
            hits = np.asarray(table[name][f"{kappa:.6g}"])
            if np.isfinite(hits).all():
                scores[kappa] = (float(hits.max()), float(hits.mean()))
        if not scores:
            if not allow_failures:
                raise RuntimeError(f"no κ in the grid met the target on every tuning run for {name}; widen the grid")
            scores = {min(kappas): (math.inf, math.inf)}  # unreachable (e.g. bias above ε): the most careful step
        best[name] = min(scores, key=scores.get)
        if best[name] in (min(kappas), max(kappas)) and math.isfinite(scores[best[name]][0]):
            print(f"note: tuned κ for {name} is at the edge of the grid ({best[name]:.3g})", file=sys.stderr)
    return best, table


def downsample(cost: np.ndarray, err: np.ndarray, points: int = 150) -> list[list[float]]:
    """Keep at most `points` checks of a curve (evenly spaced in check count, always the first and last), with the
    cost rounded to integers and the error to 4 significant digits (to keep the JSON small)."""
    keep = np.unique(np.linspace(0, cost.size - 1, min(points, cost.size)).round().astype(int))
    return [cost[keep].round().tolist(), [float(f"{e:.4g}") for e in err[keep]]]


def mean_curve(curves: list[tuple[np.ndarray, np.ndarray]], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std over runs of the relative error at each cumulative cost in `grid` (last check at or before it)."""
    vals = np.full((len(curves), grid.size), np.nan)
    for k, (cc, ee) in enumerate(curves):
        pos = np.searchsorted(cc, grid, side="right") - 1
        ok = (pos >= 0) & (grid <= cc[-1])
        vals[k, ok] = ee[pos[ok]]
    return np.nanmean(vals, 0), np.nanstd(vals, 0)


def fmt_mean_std(x: np.ndarray, digits: int = 0) -> str:
    x = np.asarray(x, dtype=float)
    fin = x[np.isfinite(x)]
    if fin.size == 0:
        return "not reached"
    s = f"{fin.mean():,.{digits}f} ± {fin.std(ddof=1) if fin.size > 1 else 0.0:,.{digits}f}"
    return s + (f" ({x.size - fin.size} not reached)" if fin.size < x.size else "")


def evaluate_family(
    label: str,
    seeds: list[int],
    tune_seeds: list[int],
    kappas: list[float],
    target: float,
    problem_kwargs: dict,
    samplers: tuple[str, ...] = SAMPLERS,
    replicates: int = 4,
) -> dict:
    t0 = time.time()
    tune_problems = [make_problem(s, **problem_kwargs) for s in tune_seeds]
    tune_dists = {name: [sampler_distribution(name, pr.G, pr.c) for pr in tune_problems] for name in samplers}
    # Failure caps, in passes' worth of cost (Σ c ≈ 5,500 per pass): 60 for tuning, 100 for evaluation runs.
    pass_cost = float(np.mean([pr.c.sum() for pr in tune_problems]))
    cap = 100.0 * pass_cost
    best, table = tune_kappa(tune_problems, tune_dists, kappas, target, 60.0 * pass_cost, replicates)
    t_tune = time.time() - t0

    problems = [make_problem(s, **problem_kwargs) for s in seeds]
    runs, names = [], []
    ratios: dict[str, list[float]] = {name: [] for name in samplers}
    for k, pr in enumerate(problems):
        for name in samplers:
            p = sampler_distribution(name, pr.G, pr.c)
            ratios[name].append(j_ratio(pr.G, pr.c, p))
            runs.append(Run(problem=k, p=p, eta=step_size(best[name], target, pr, pr.G, p), seed=pr.seed))
            names.append(name)
    # Evaluation runs continue after the target up to a common cost (for the curves), and stop at the cap.
    res = simulate(problems, runs, target, replicates=replicates, cost_cap=cap, run_until=0.3 * cap, record=True)
    t_eval = time.time() - t0 - t_tune

    per_sampler = {}
    for name in samplers:
        sel = [j for j, nm in enumerate(names) if nm == name]
        per_sampler[name] = {
            "kappa": best[name],
            "second_moment": [second_moment(pr.G, runs[j].p, pr.n) for j, pr in zip(sel, problems, strict=True)],
            "hit_cost": [float(res.hit_cost[j]) for j in sel],
            "single_chain_hit_cost": [res.single_hit_cost[j].tolist() for j in sel],
            "final_error": [float(res.final_error[j]) for j in sel],
            "j_ratio": ratios[name],
            "curves": [downsample(*res.curves[j]) for j in sel],
        }
    uni = np.asarray(per_sampler["uniform"]["hit_cost"])
    uni_single = np.asarray(per_sampler["uniform"]["single_chain_hit_cost"])
    for name in samplers:
        h = np.asarray(per_sampler[name]["hit_cost"])
        per_sampler[name]["ratio_to_uniform_per_seed"] = (h / uni).tolist()
        single = np.asarray(per_sampler[name]["single_chain_hit_cost"])
        per_sampler[name]["single_chain_ratio_of_means"] = float(np.nanmean(single) / np.nanmean(uni_single))
        per_sampler[name]["single_chain_not_reached"] = int(np.isnan(single).sum())
    return {
        "label": label,
        "problem": problem_kwargs,
        "seeds": seeds,
        "tune_seeds": tune_seeds,
        "replicates": replicates,
        "kappa_grid": kappas,
        "cost_cap": cap,
        "tuning_table": table,
        "ideal_j_ratio": [j_ratio_ideal(pr.G, pr.c) for pr in problems],
        "samplers": per_sampler,
        "seconds": {"tune": t_tune, "eval": t_eval},
    }


def markdown_table(fam: dict) -> str:
    samplers = fam["samplers"]
    uni = np.asarray(samplers["uniform"]["hit_cost"], dtype=float)
    ideal = np.asarray(fam["ideal_j_ratio"])
    lines = [
        (
            f"**{fam['label']}**: {len(fam['seeds'])} seeds × {fam['replicates']} SGD replicates; theory's ideal "
            f"J(p*)/J(u) = {ideal.mean():.3f} ± {ideal.std(ddof=1) if ideal.size > 1 else 0.0:.3f}"
        ),
        "",
        (
            "| sampler | κ (η = κ ε_abs/S(p)) | total cost to ε (mean ± std over seeds) "
            "| cost / uniform (ratio of means) | cost / uniform (per-seed, mean ± std) | theory J(p)/J(u) |"
        ),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in samplers.items():
        h = np.asarray(s["hit_cost"], dtype=float)
        per_seed = np.asarray(s["ratio_to_uniform_per_seed"], dtype=float)
        fin = per_seed[np.isfinite(per_seed)]
        ratio_means = np.nanmean(h) / np.nanmean(uni) if np.isfinite(h).any() else float("nan")
        lines.append(
            f"| {SAMPLER_LABELS[name]} | {s['kappa']:.4g} | {fmt_mean_std(h)} | {ratio_means:.3f} | "
            f"{fin.mean():.3f} ± {fin.std(ddof=1) if fin.size > 1 else 0:.3f} | "
            f"{np.mean(s['j_ratio']):.3f} |"
        )
    return "\n".join(lines)


def plot(families: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.5), squeeze=False)
    for ax, fam in zip(axes[0], families, strict=True):
        top = max(max(cc[-1] for cc, _ in s["curves"]) for s in fam["samplers"].values())
        grid = np.linspace(0, top, 400)
        for name, s in fam["samplers"].items():
            curves = [(np.asarray(cc), np.asarray(ee)) for cc, ee in s["curves"]]
            end = min(cc[-1] for cc, _ in curves)
            g = grid[grid <= end]
            mean, std = mean_curve(curves, g)
            (line,) = ax.plot(g, mean, label=f"{SAMPLER_LABELS[name]} (J/J_u={np.mean(s['j_ratio']):.2f})")
            ax.fill_between(g, np.clip(mean - std, 1e-4, None), mean + std, color=line.get_color(), alpha=0.15)
        ax.axhline(fam["target"], color="k", ls="--", lw=0.8, label=f"ε = {fam['target']}")
        ax.set_yscale("log")
        ax.set_ylim(max(1e-3, fam["target"] / 5), 1.5)
        ax.set_xlabel("cumulative cost Σ c_i of sampled components")
        ax.set_ylabel("(F(x) − F*) / (F(x₀) − F*)")
        ax.set_title(f"{fam['label']}\n{len(fam['seeds'])} seeds × {fam['replicates']} chains, mean ± std over seeds")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20, help="evaluation seeds (problem instance + SGD draws)")
    ap.add_argument("--tune-seeds", type=int, default=6, help="tuning instances for κ (seeds 1000, 1001, ...)")
    ap.add_argument("--quick", action="store_true", help="few seeds and a coarse κ grid (for make bench-quick)")
    ap.add_argument("--smoke", action="store_true", help="the machinery only, in seconds: n = 200, ε = 0.1, 1 seed")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default benchmarks/results, or benchmarks/results/tmp with --quick)",
    )
    ap.add_argument("--target", type=float, default=0.01, help="relative suboptimality ε")
    ap.add_argument("--g-sigma", type=float, default=0.7, help="σ of the log-normal gradient norms G_i")
    ap.add_argument("--replicates", type=int, default=4, help="SGD chains per seed (the error is their mean)")
    ap.add_argument("--no-equal-g", action="store_true", help="skip the equal-G_i control family")
    args = ap.parse_args(argv)
    if args.out is None:  # quick and smoke runs never overwrite the committed full results
        args.out = Path("benchmarks/results/tmp" if args.quick or args.smoke else "benchmarks/results")

    problem = {}
    if args.smoke:
        seeds, tune_seeds, replicates, kappas = [0], [1000], 1, QUICK_KAPPAS[:2]
        problem, args.target = {"n": 200, "d": 5}, max(args.target, 0.1)
    elif args.quick:
        seeds, tune_seeds, replicates = list(range(3)), [1000, 1001], 2
        kappas = QUICK_KAPPAS
    else:
        seeds, tune_seeds = list(range(args.seeds)), list(range(1000, 1000 + args.tune_seeds))
        kappas = KAPPAS
        replicates = args.replicates

    families = [(f"heterogeneous G_i (σ_G = {args.g_sigma})", args.g_sigma, SAMPLERS)]
    if not args.no_equal_g:
        # With G_i = 1, ∝ G is uniform and ∝ G/√c is ∝ 1/√c: run the distinct samplers only.
        families.append(("equal G_i = 1 (control)", 0.0, ("uniform", "inverse_cost", "gradient_over_sqrt_cost")))
    results = []
    for label, g_sigma, samplers in families:
        fam = evaluate_family(
            label,
            seeds,
            tune_seeds,
            kappas,
            args.target,
            {"g_sigma": g_sigma, **problem},
            samplers,
            replicates=replicates,
        )
        fam["target"] = args.target
        results.append(fam)
        print(markdown_table(fam), flush=True)
        print(f"(tuning {fam['seconds']['tune']:.0f}s, evaluation {fam['seconds']['eval']:.0f}s)\n", flush=True)

    # The theory's ideal ratio for equal G and c ~ U[1, 10]: (Σ√c)²/(n Σc) → (E√c)²/E c.
    e_sqrt = (2 / 3) * (10**1.5 - 1) / 9
    equal_g_limit = e_sqrt**2 / 5.5
    print(
        f"Equal G_i, c ~ U[1, 10]: theory's best ratio (E√c)²/E[c] = {equal_g_limit:.4f} (saving ≤ "
        f"{1 - equal_g_limit:.1%})"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "cost_aware_sgd",
        "command": "python benchmarks/cost_aware_sgd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick,
        "smoke": args.smoke,
        "target": args.target,
        "equal_g_theory_limit": equal_g_limit,
        "families": results,
    }
    (args.out / "cost_aware_sgd.json").write_text(json.dumps(sanitize(payload)))
    plot(results, args.out / "cost_aware_sgd.png")
    print(f"wrote {args.out / 'cost_aware_sgd.json'} and {args.out / 'cost_aware_sgd.png'}")
    return payload


def sanitize(x):
    """JSON-safe copy: numpy to Python, non-finite floats to None ("not reached")."""
    if isinstance(x, dict):
        return {str(k): sanitize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [sanitize(v) for v in x]
    if isinstance(x, np.ndarray):
        return sanitize(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    main()
