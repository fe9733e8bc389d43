"""Benchmark 2: how well a gradient proxy predicts the true per-row gradient norm G_i, per loss type.

    python benchmarks/proxy_fidelity.py --quick     # dapo only, 10 GRPO steps, 1 generation batch of 256 rows
    python benchmarks/proxy_fidelity.py --smoke --task testbed --results /tmp/pf   # the machinery only (its test)
    python benchmarks/proxy_fidelity.py             # dapo, grpo, dr_grpo: 40 GRPO steps each, 3 batches each
    python benchmarks/proxy_fidelity.py --task testbed --mid-steps 25   # the same on the learning testbed
    python benchmarks/proxy_fidelity.py --task long --mid-steps 20 --loss-types dapo grpo   # on the long testbed

`--task old` (default) is the original embedded task (sums of 1-6 digits, 16 x 16 rollouts at lr 1e-4, pinned here);
`--task testbed` uses the recipe, data and warm-up of `trl_costaware.embedded.testbed`; `--task long` those of its
long testbed (counting; one generation batch of 256 rollouts per step, held in one micro-batch here).

For each loss type, GRPO (the benchmark recipe with that loss type, beta=0) trains the warmed-up tiny model for
`--mid-steps` steps; then, for each of `--batches` fresh generation batches (of the task's size), every row's own
policy-loss term (TRL's `_compute_loss` on that row alone, the full batch's normaliser kept) is back-propagated
separately, and G_i is the norm of its gradient over all parameters. The sampled tokens' probabilities under the
sampling policy (a no-grad forward; vLLM returns them with the rollout) are recorded too.

Proxies compared (`trl_costaware.rows.proxy`, docs/budget_and_proxy.md §1):
- "advantage":            |A_i|                                      (the paper's proxy)
- "loss_aware γ":         |A_i| · L_i^γ / Z_i                        (length and the loss type's normaliser)
- "loss_aware+logp γ":    |A_i| · (Σ_t (1 − π(y_t))^(1/γ))^γ / Z_i   (also the sampled tokens' probabilities)
- "optimal p*":           the true G_i

Reported per loss type and batch: Pearson (and Spearman) between proxy and G_i over all rows and over the
informative rows (A_i != 0), and the cost factor of sampling ∝ proxy/√c against the optimum ∝ G_i/√c:
J(p)/J(p*) = 1 + χ²(r*‖r) (docs/algorithm.md §1), from `trl_costaware.rows.sampling`. The in-sample best γ (the grid
value with the smallest J(p)/J(p*) per batch, median over batches) is reported per loss type to check the fixed
default.
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

# The GRPO recipe of the original embedded task ("old task"), pinned here so this benchmark keeps measuring the same
# setting when the demo's recipe changes: 16 prompts x 16 rollouts, one optimizer step per generation batch, lr 1e-4.
OLD_TASK_SETTINGS = dict(
    per_device_train_batch_size=256,
    num_generations=16,
    steps_per_generation=1,
    max_completion_length=20,
    learning_rate=1e-4,
    lr_scheduler_type="constant",
    temperature=1.0,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    disable_tqdm=True,
    warmup_steps=0,
)
# --smoke: 4 prompts x 4 rollouts in one micro-batch (the machinery only).
SMOKE_SETTINGS = dict(
    per_device_train_batch_size=16, num_generations=4, steps_per_generation=1, gradient_accumulation_steps=1
)
GAMMAS = (0.5, 0.75, 1.0)
TASKS = ("old", "testbed", "long")


def task_setup(task: str) -> tuple[dict, dict, str]:
    """(GRPO settings, dataset keyword arguments, warmed-up model path) of a task.

    "old": the original embedded task (1-6 terms, the 500-step clean SFT warm-up, 16 x 16 rollouts at lr 1e-4);
    "testbed": the learning testbed of `trl_costaware.embedded.testbed` (its recipe, data and warm-up defaults)."""
    import inspect

    from trl_costaware.embedded import warmed_up_model_path

    if task == "old":
        legacy = "recipe" in inspect.signature(warmed_up_model_path).parameters  # the testbed keeps it as "sums6"
        model = warmed_up_model_path(recipe="sums6") if legacy else warmed_up_model_path()
        return OLD_TASK_SETTINGS, {"max_terms": 6}, model
    if task == "testbed":
        from trl_costaware.embedded.testbed import GRPO_RECIPE

        return {**GRPO_RECIPE, "warmup_steps": 0, "disable_tqdm": True}, {}, warmed_up_model_path()
    if task == "long":
        from trl_costaware.embedded.testbed import LONG_RECIPE

        rows = LONG_RECIPE["per_device_train_batch_size"] * LONG_RECIPE["steps_per_generation"]
        one_batch = {"per_device_train_batch_size": rows, "gradient_accumulation_steps": 1, "steps_per_generation": 1}
        settings = {**LONG_RECIPE, **one_batch, "warmup_steps": 0, "disable_tqdm": True}
        return settings, {}, warmed_up_model_path(recipe="long")
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


GAMMA_GRID = tuple(round(0.125 * k, 3) for k in range(1, 17))  # 0.125 ... 2


def pearson(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float:
    """Pearson correlation of the ranks (ties get their average rank)."""
    import numpy as np

    def rank(v):
        v = np.asarray(v, float)
        _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
        upper = np.cumsum(counts)
        return ((upper - counts + upper - 1) / 2.0)[inverse]

    return pearson(rank(x), rank(y))


def best_gamma(absa, g, costs, token_mask, token_logps, loss_type) -> float:
    """The γ of the grid `GAMMA_GRID` whose proxy (with `token_logps`, or length only when None) gives the smallest
    J(p)/J(p*) for sampling ∝ proxy/√c on this batch: an in-sample optimum, to check the fixed default."""
    from trl_costaware.rows.proxy import loss_aware_proxy
    from trl_costaware.rows.sampling import j_ratio_achieved, sampling_distribution

    def cost_factor(gamma):
        proxy = loss_aware_proxy(absa, token_mask, loss_type, gamma, token_logps)
        return j_ratio_achieved(g, costs, sampling_distribution(proxy / costs.double().sqrt(), 0.0))

    return min(GAMMA_GRID, key=cost_factor)


def sampled_token_logps(model, batch, temperature: float):
    """log π(y_t) of each sampled completion token under `model` at the sampling temperature, (N, T); no grad."""
    import torch

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].float() / temperature
        logps = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return logps


def proxies_for(absa, token_mask, token_logps, loss_type):
    """name -> proxy tensor (N,), float64."""
    from trl_costaware.rows.proxy import loss_aware_proxy

    out = {"advantage": absa.double()}
    for gamma in GAMMAS:
        out[f"loss_aware γ={gamma:g}"] = loss_aware_proxy(absa, token_mask, loss_type, gamma)
    for gamma in GAMMAS:
        out[f"loss_aware+logp γ={gamma:g}"] = loss_aware_proxy(absa, token_mask, loss_type, gamma, token_logps)
    return out


def measure_loss_type(args, loss_type: str) -> tuple[list[dict], list[dict]]:
    import torch

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
    from trl_costaware.embedded.tasks import get_task
    from trl_costaware.rows.batching import select_rows
    from trl_costaware.rows.sampling import j_ratio_achieved, j_ratio_ideal, sampling_distribution, sequence_costs

    torch.manual_seed(args.seed)
    settings, data_kwargs, model_path = task_setup(args.task)
    if args.smoke:
        settings = {**settings, **SMOKE_SETTINGS}
    task = get_task("counting" if args.task == "long" else "arithmetic")
    s = {**settings, "loss_type": loss_type}
    prompts_per_step = s["per_device_train_batch_size"] // s["num_generations"]
    config = CostAwareGRPOConfig(
        output_dir=os.path.join(args.out, loss_type),
        max_steps=max(args.mid_steps, 1),
        seed=args.seed,
        cost_aware=False,
        **s,
    )
    dataset = task.dataset(max(args.mid_steps, 1) * prompts_per_step + 64, seed=args.seed, **data_kwargs)
    trainer = CostAwareGRPOTrainer(model_path, [task.reward], args=config, train_dataset=dataset)
    t0 = time.perf_counter()
    if args.mid_steps > 0:
        trainer.train()
    train_s = time.perf_counter() - t0
    model = trainer.model
    model.train()
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by Trainer.train(); needed by the losses
        trainer.current_gradient_accumulation_steps = s.get("gradient_accumulation_steps", 1)
    params = [p for p in model.parameters() if p.requires_grad]
    held = task.dataset(args.batches * prompts_per_step, seed=10_000 + args.seed, **data_kwargs)
    rows, batches = [], []
    for b in range(args.batches):
        prompts = [held[i] for i in range(b * prompts_per_step, (b + 1) * prompts_per_step)]
        inputs = [dict(p) for p in prompts for _ in range(s["num_generations"])]
        t0 = time.perf_counter()
        batch = trainer._generate_and_score_completions(inputs)
        adv = batch["advantages"].detach().float().cpu()
        costs = sequence_costs(batch["prompt_mask"], batch["completion_mask"]).cpu()
        mask = batch["completion_mask"].cpu()
        logps = sampled_token_logps(model, batch, trainer.temperature).cpu()
        g_true = torch.zeros(len(adv), dtype=torch.float64)
        for i in range(len(adv)):
            sub = select_rows(batch, torch.tensor([i]))
            loss = trainer._compute_loss(model, sub)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            g_true[i] = torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))
        seconds = time.perf_counter() - t0
        absa = adv.abs().double()
        info = absa > 0
        length = mask.sum(-1).double()
        res = {
            "loss_type": loss_type,
            "batch": b,
            "rows": len(adv),
            "informative_rows": int(info.sum()),
            "seconds": seconds,
            "zero_grad_iff_zero_adv": bool(((g_true > 1e-12) == info).all()),
            "best_gamma_length": best_gamma(absa, g_true, costs, mask, None, loss_type),
            "best_gamma_logp": best_gamma(absa, g_true, costs, mask, logps, loss_type),
            "j_ideal_true": j_ratio_ideal(g_true, costs),
            "proxies": {},
        }
        for name, proxy in {**proxies_for(absa, mask, logps, loss_type), "optimal p*": g_true}.items():
            p = sampling_distribution(proxy / costs.double().sqrt(), 0.0)
            p_smooth = sampling_distribution(proxy / costs.double().sqrt(), 0.1)
            res["proxies"][name] = {
                "pearson_all": pearson(proxy, g_true),
                "pearson_informative": pearson(proxy[info], g_true[info]),
                "spearman_informative": spearman(proxy[info], g_true[info]),
                "j_over_j_opt": j_ratio_achieved(g_true, costs, p) / res["j_ideal_true"],
                "j_over_j_opt_alpha0.1": j_ratio_achieved(g_true, costs, p_smooth) / res["j_ideal_true"],
                "j_over_j_uniform": j_ratio_achieved(g_true, costs, p),
            }
        batches.append(res)
        u = 1.0 - logps.exp()
        for i in range(len(adv)):
            n_tok = int(length[i])
            rows.append(
                {
                    "loss_type": loss_type,
                    "batch": b,
                    "abs_advantage": float(absa[i]),
                    "grad_norm": float(g_true[i]),
                    "cost": float(costs[i]),
                    "completion_tokens": n_tok,
                    "token_u": " ".join(f"{float(x):.5f}" for x in u[i][mask[i].bool()][:n_tok]),
                }
            )
        pa, pl = res["proxies"]["advantage"], res["proxies"]["loss_aware γ=0.5"]
        print(
            f"{loss_type} batch {b} ({seconds:.0f}s, training {train_s:.0f}s): best γ {res['best_gamma_length']:g}, "
            f"{res['best_gamma_logp']:g} (+logp); "
            f"pearson |A| {pa['pearson_all']:.3f} loss_aware {pl['pearson_all']:.3f}; "
            f"J/J* |A| {pa['j_over_j_opt']:.3f} loss_aware {pl['j_over_j_opt']:.3f}",
            flush=True,
        )
    return batches, rows


def write_outputs(res: dict, tag: str, results: str = common.RESULTS) -> str:
    import numpy as np

    base = os.path.join(results, f"proxy_fidelity_{tag}")
    with open(base + ".csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(res["rows"][0]))
        w.writeheader()
        w.writerows(res["rows"])
    summary = {k: v for k, v in res.items() if k != "rows"}
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from trl_costaware.rows.proxy import DEFAULT_GAMMA, ROW_MEAN_LOSSES

    loss_types = res["loss_types"]
    fig = Figure(figsize=(4.2 * len(loss_types), 10.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for k, lt in enumerate(loss_types):
        rr = [r for r in res["rows"] if r["loss_type"] == lt]
        a = np.array([r["abs_advantage"] for r in rr])
        g = np.array([r["grad_norm"] for r in rr])
        L = np.array([r["completion_tokens"] for r in rr], float)
        e = DEFAULT_GAMMA - (1.0 if lt in ROW_MEAN_LOSSES else 0.0)
        u = [np.array([float(x) for x in r["token_u"].split()]) for r in rr]
        z = np.where(L > 0, L, 1.0) if lt in ROW_MEAN_LOSSES else np.ones_like(L)
        h_logp = np.array([(v ** (1 / DEFAULT_GAMMA)).sum() ** DEFAULT_GAMMA for v in u]) / z
        panels = (
            (a, "|A_i|"),
            (a * np.where(L > 0, L, 1.0) ** e, f"|A_i|·L_i^{e:g}"),
            (a * h_logp, f"|A_i|·h_i(logp), γ={DEFAULT_GAMMA:g}"),
        )
        for j, (x, label) in enumerate(panels):
            ax = fig.add_subplot(len(panels), len(loss_types), 1 + k + j * len(loss_types))
            sc = ax.scatter(x, g, c=L, s=6, cmap="viridis", alpha=0.7)
            ax.set_title(f"{lt}: Pearson {pearson(x, g):.3f}", fontsize=9)
            ax.set_xlabel(label, fontsize=8)
            ax.set_ylabel("per-row gradient norm G_i", fontsize=8)
            ax.grid(alpha=0.3)
    fig.colorbar(sc, ax=fig.axes, label="completion tokens", shrink=0.5)
    fig.savefig(base + ".png")

    lines = [
        f"Task: {res.get('task', 'old')}. After {res['mid_steps']} GRPO steps per loss type (seed {res['seed']}); "
        f"{res['batches_per_loss_type']} "
        f"generation batch(es) of {res['batches'][0]['rows']} rows per loss type. Means over batches; J(p)/J(p*) for "
        "sampling ∝ proxy/√c (α = 0), the ideal is 1.",
        "",
        "| loss type | informative rows | best γ (length / +logp) | proxy | Pearson (all rows) | Pearson (A≠0) | "
        "Spearman (A≠0) | J(p)/J(p*) | J(p)/J(p*), α=0.1 | J(p)/J(u) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lt in loss_types:
        bs = [b for b in res["batches"] if b["loss_type"] == lt]
        info = f"{np.mean([b['informative_rows'] for b in bs]):.0f}/{bs[0]['rows']}"
        gam = "/".join(f"{np.median([b[k] for b in bs]):g}" for k in ("best_gamma_length", "best_gamma_logp"))
        for name in bs[0]["proxies"]:
            v = {k: np.mean([b["proxies"][name][k] for b in bs]) for k in bs[0]["proxies"][name]}
            lines.append(
                f"| {lt} | {info} | {gam} | {name} | {v['pearson_all']:.3f} | {v['pearson_informative']:.3f} | "
                f"{v['spearman_informative']:.3f} | {v['j_over_j_opt']:.3f} | {v['j_over_j_opt_alpha0.1']:.3f} | "
                f"{v['j_over_j_uniform']:.3f} |"
            )
    if res.get("budget"):  # a replot of results measured with the removed adaptive budget ("auto", commit aa0a130)
        lines += budget_lines(res["budget"])
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump({k: v for k, v in res.items() if k != "rows"}, fh, indent=1)
    md = "\n".join(lines)
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    return md


BUDGET_DELTAS = (0.25, 0.5, 1.0)  # of the adaptive budget (kept count "auto", removed in aa0a130): replots only


def budget_lines(rows: list[dict]) -> list[str]:
    import numpy as np

    keys = [f"delta={d:g}" for d in BUDGET_DELTAS] + ["fixed 0.5"]
    lines = [
        "",
        "Adaptive budget (`budget.smallest_budget`, p ∝ proxy/√c, α = 0.1): kept fraction m/N, the inflation I(m) the "
        "proxy predicts, and I(m) with the true G_i for the same p and m (means over batches):",
        "",
        "| loss type | proxy | " + " | ".join(f"{k}: m/N, I pred, I true" for k in keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for lt in dict.fromkeys(r["loss_type"] for r in rows):
        for name in dict.fromkeys(r["proxy"] for r in rows):
            rr = [r for r in rows if r["loss_type"] == lt and r["proxy"] == name]
            cells = []
            for k in keys:
                frac = np.mean([r[k]["m"] / r["rows"] for r in rr])
                pred, true = np.mean([r[k]["predicted"] for r in rr]), np.mean([r[k]["true"] for r in rr])
                cells.append(f"{frac:.2f}, {pred:.2f}, {true:.2f}")
            lines.append(f"| {lt} | {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dapo only, 10 GRPO steps, one generation batch")
    p.add_argument("--smoke", action="store_true", help="the machinery only, seconds: 1 step, 1 batch of 4 x 4 rows")
    p.add_argument("--loss-types", nargs="+", default=None, help="default dapo grpo dr_grpo (quick: dapo)")
    p.add_argument("--mid-steps", type=int, default=None, help="GRPO steps before measuring (default 40; quick 10)")
    p.add_argument("--batches", type=int, default=None, help="generation batches measured (default 3; quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task", choices=TASKS, default="old", help="old embedded task (default), the testbed, or the long testbed"
    )
    p.add_argument("--tag", default=None, help="results file suffix (default: quick or full)")
    p.add_argument("--out", default=None)
    p.add_argument("--results", default=common.RESULTS, help="folder of the result files (default benchmarks/results)")
    p.add_argument("--replot", action="store_true", help="rewrite the .md/.png from the saved .json/.csv")
    args = p.parse_args(argv)
    kind = "smoke" if args.smoke else "quick" if args.quick else "full"
    tag = args.tag or kind + ("" if args.task == "old" else f"_{args.task}")
    if args.replot:
        base = os.path.join(args.results, f"proxy_fidelity_{tag}")
        with open(base + ".json", encoding="utf-8") as fh:
            res = json.load(fh)
        with open(base + ".csv", encoding="utf-8") as fh:
            text = ("loss_type", "token_u")
            res["rows"] = [{k: (v if k in text else float(v)) for k, v in r.items()} for r in csv.DictReader(fh)]
        print(write_outputs(res, tag, args.results))
        return
    short = args.quick or args.smoke
    args.loss_types = args.loss_types or (["dapo"] if short else ["dapo", "grpo", "dr_grpo"])
    args.mid_steps = args.mid_steps if args.mid_steps is not None else (1 if args.smoke else 10 if short else 40)
    args.batches = args.batches or (1 if short else 3)
    args.out = args.out or os.path.join(common.ROOT, "outputs", "bench", f"proxy_fidelity_{tag}")
    for k, v in common.ENV.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.results, exist_ok=True)
    batches, rows = [], []
    for lt in args.loss_types:
        b, r = measure_loss_type(args, lt)
        batches += b
        rows += r
    res = {
        "task": args.task,
        "mid_steps": args.mid_steps,
        "seed": args.seed,
        "loss_types": args.loss_types,
        "batches_per_loss_type": args.batches,
        "batches": batches,
        "rows": rows,
    }
    print(write_outputs(res, tag, args.results))


if __name__ == "__main__":
    main()
