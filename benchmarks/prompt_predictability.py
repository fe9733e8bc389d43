"""How well does a prompt's own reward history predict that its next group carries no gradient, and how much
zero-variance generation could a draw built on that history avoid? (issue 34; BENCHMARKS.md §9)

    python benchmarks/prompt_predictability.py [--testbed long --pool 128 --steps 80 --seed 0]

Trains plain GRPO on a regime-matrix multi-epoch cell (a fixed pool revisited epoch after epoch, TRL's own sampler)
and records every visit: the prompt, its group's rewards, its generated tokens. Then, offline, for the prompt stage's
posterior (`prompts.history.PromptHistory`, forgetting γ) at several γ, with the prior fitted on the pool (refitted
every epoch of P/K steps, as the stage refits it at each epoch's plan) and with the uniform Beta(1, 1) prior, each
visit's predicted P(zero variance), value and cost from the visits BEFORE it (the visit's own rewards and tokens enter
only after its predictions are read: issue 38 removed a leak where q was divided by the visit's realised tokens):

- calibration and discrimination: mean predicted vs observed, the Brier score against the constant predictor at the
  observed rate, the AUC (the probability that a zero-variance visit was predicted higher than an informative one);
- P(zero variance | the last visit was zero-variance) and P(zero variance | it was informative), as issue 34 states
  them;
- the bound: the zero-variance share of generated tokens a draw ∝ (1 − predicted P(zero variance)) would have had
  (each visit re-weighted by its chance under that draw, from the same visits), against uniform's, with the
  prompt stage's uniform share α = 0.1. A draw cannot skip what its history does not predict;
- J(q)/J(u) per step, with each group's realised gradient norm √(Σ A²) (TRL's Bessel std: √(G − 1) or 0) and its
  realised tokens as the cost: for the prompt stage's q ∝ v̂/√ĉ (v̂ = √(1 − ẑ), ĉ the predicted cost, both from
  before the visit) and for perfect foresight (q ∝ realised norm / √realised tokens).

Results: benchmarks/results/prompt_predictability.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

FORGETTING = (0.0, 0.5, 0.9, 1.0)
PRIORS = ("fitted", "uniform")
ALPHA = 0.1


def record_visits(testbed: str, pool: int, steps: int, seed: int, out: str) -> list[dict]:
    from trl_costaware import CostAwareGRPOTrainer
    from trl_costaware.embedded.testbed import POOL_SEED, get_testbed, train_run

    prompts = {row["prompt"]: j for j, row in enumerate(get_testbed(testbed).dataset(pool, POOL_SEED))}
    visits: list[dict] = []

    class Recording(CostAwareGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            if self.model.training:
                g = self.num_generations
                rewards = self._group_rewards()
                lengths = self._generated_lengths(batch).double().cpu().view(-1, g).sum(1)
                for k in range(len(rewards)):
                    visits.append(
                        {
                            "step": self.state.global_step,
                            "prompt": prompts[inputs[k * g]["prompt"]],
                            "rewards": rewards[k].tolist(),
                            "tokens": float(lengths[k]),
                        }
                    )
            return batch

    train_run(
        seed=seed,
        output_dir=out,
        steps=steps,
        settings={"cost_aware": False},
        trainer_cls=Recording,
        eval_every=10**6,
        eval_n=16,
        testbed=testbed,
        pool=pool,
    )
    return visits


def _auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """P(a zero-variance visit scored above an informative one), ties counted half."""
    pos, neg = scores[labels], scores[~labels]
    if len(pos) == 0 or len(neg) == 0:
        return None
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


def j_ratio(value: np.ndarray, cost: np.ndarray, q: np.ndarray) -> float:
    """Cost-aware SGD's J(q)/J(u) = (Σ G²/q · Σ q c) / (n Σ G² · Σ c / n) over one step's groups (G = the group's
    realised Σ|A|, c its tokens); q = u gives 1, q ∝ G/√c the minimum (Σ G√c)² / (Σ G² Σ c)."""
    n = len(value)
    keep = q > 0
    if value.sum() <= 0:
        return float("nan")
    s_q = (value[keep] ** 2 / q[keep]).sum() * (q * cost).sum()
    s_u = (value**2).sum() * n * cost.sum() / n
    return float(s_q / s_u)


def analyse(visits: list[dict], pool: int, g: int) -> dict:
    from trl_costaware.prompts.history import PromptHistory, PromptUpdate

    zero = np.array([max(v["rewards"]) - min(v["rewards"]) <= 1e-12 for v in visits])
    tokens = np.array([v["tokens"] for v in visits])
    steps = np.array([v["step"] for v in visits])
    # the group's realised gradient norm ∝ √(Σ A²) under TRL's std scaling (√(G − 1), or 0 for a zero-variance group)
    realised = np.array(
        [
            np.sqrt(
                (((np.array(v["rewards"]) - np.mean(v["rewards"])) / (np.std(v["rewards"], ddof=1) + 1e-4)) ** 2).sum()
            )
            for v in visits
        ]
    )
    per_step = max(len(visits) // max(len(set(steps)), 1), 1)
    per_epoch = max(pool // per_step, 1)  # steps per epoch of the prompt stage (C = P // K)
    last: dict[int, bool] = {}
    after = {"zero": [], "informative": []}
    for v, z in zip(visits, zero, strict=True):
        if v["prompt"] in last:
            after["zero" if last[v["prompt"]] else "informative"].append(z)
        last[v["prompt"]] = bool(z)
    out = {
        "visits": len(visits),
        "zero_variance_visits": float(zero.mean()),
        "zero_variance_token_share": float(tokens[zero].sum() / tokens.sum()),
        "p_zero_after_zero": float(np.mean(after["zero"])) if after["zero"] else None,
        "p_zero_after_informative": float(np.mean(after["informative"])) if after["informative"] else None,
        "by_forgetting": {},
    }
    for gamma, prior in [(x, y) for y in PRIORS for x in FORGETTING]:
        h = PromptHistory(pool, g, smoothing=ALPHA, forgetting=gamma, scale="group", seed=0, lag=0)
        predicted, values, costs = [], [], []
        step_seen = None
        for d, v in enumerate(visits):
            if prior == "fitted" and v["step"] != step_seen and (v["step"] - steps[0]) % per_epoch == 0:
                h.refit_prior()  # at each epoch's first step, from the visits before it
            step_seen = v["step"]
            value, p_zero, cost = h.predictions()  # before this visit: nothing of it is in yet
            predicted.append(float(p_zero[v["prompt"]]))
            values.append(float(value[v["prompt"]]))
            costs.append(float(cost[v["prompt"]]) * g)  # ĉ per row × G rows: the group's predicted tokens
            h.submit(
                PromptUpdate(
                    d, [v["prompt"]], torch.tensor([v["rewards"]]), torch.tensor([v["tokens"] / g]), torch.zeros(1)
                )
            )
            h.apply_until(d)
        p, values, costs = np.array(predicted), np.array(values), np.array(costs)
        seen = np.array([i > 0 for i in range(len(visits))])  # every visit, first visits included
        base = zero.mean()
        # a draw ∝ (1 − p̂) mixed with uniform: each visit counts with its relative chance under that draw
        chance = (1 - ALPHA) * (1 - p) / max((1 - p).mean(), 1e-12) + ALPHA
        # per step: J(q)/J(u) of the prompt stage's own q (∝ v̂/√ĉ from the history, α-mixed) and of perfect
        # foresight (q ∝ realised Σ|A| / √tokens), with the realised Σ|A| as each group's gradient norm
        ratios, ideal = [], []
        for step in sorted(set(steps)):
            idx = np.nonzero(steps == step)[0]
            if realised[idx].sum() <= 0:
                continue
            s_hat = values[idx] / np.sqrt(np.maximum(costs[idx], 1.0))  # predicted, never the visit's own tokens
            q = (1 - ALPHA) * s_hat / s_hat.sum() + ALPHA / len(idx)
            ratios.append(j_ratio(realised[idx], tokens[idx], q / q.sum()))
            best = realised[idx] / np.sqrt(np.maximum(tokens[idx], 1.0))
            ideal.append(j_ratio(realised[idx], tokens[idx], best / best.sum()))
        out["by_forgetting"][f"{gamma} {prior}"] = {
            "forgetting": gamma,
            "prior": prior,
            "prior_at_end": list(h.prior),
            "predicted": float(p[seen].mean()),
            "brier": float(((p - zero) ** 2).mean()),
            "brier_base_rate": float(base * (1 - base)),
            "auc": _auc(p, zero),
            "zero_variance_token_share_under_draw": float((chance * tokens)[zero].sum() / (chance * tokens).sum()),
            "j_ratio_history": float(np.nanmean(ratios)),
            "j_ratio_foresight": float(np.nanmean(ideal)),
        }
    return out


def markdown(res: dict, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        f"GRPO on {res['cell']} (seed {res['seed']}): {res['visits']} visits, zero-variance "
        f"{res['zero_variance_visits']:.3f} of visits and {res['zero_variance_token_share']:.3f} of generated "
        f"tokens; P(zero variance | last visit zero-variance) = {res['p_zero_after_zero']:.2f}, "
        f"P(zero variance | last visit informative) = {res['p_zero_after_informative']:.2f}.",
        "",
        "| forgetting γ, prior | mean predicted P(zero variance) | Brier | Brier, base rate | AUC | zero-variance "
        "token share under a draw ∝ (1 − p̂), α = 0.1 (uniform: above) | J(q)/J(u), the prompt stage's q | J(q)/J(u), "
        "perfect foresight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gamma, r in res["by_forgetting"].items():
        auc = "n/a" if r["auc"] is None else f"{r['auc']:.3f}"
        lines.append(
            f"| {gamma} | {r['predicted']:.3f} | {r['brier']:.3f} | {r['brier_base_rate']:.3f} | {auc} | "
            f"{r['zero_variance_token_share_under_draw']:.3f} | {r['j_ratio_history']:.3f} | "
            f"{r['j_ratio_foresight']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--testbed", default="long")
    p.add_argument("--pool", type=int, default=128)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(common.RESULTS, "prompt_predictability"))
    args = p.parse_args(argv)
    from trl_costaware.embedded.testbed import get_testbed

    run_dir = os.path.join(common.ROOT, "outputs", "bench", "prompt_predictability")
    visits_path = os.path.join(run_dir, f"visits_{args.testbed}_p{args.pool}_s{args.steps}_seed{args.seed}.json")
    if os.path.exists(visits_path):
        with open(visits_path, encoding="utf-8") as fh:
            visits = json.load(fh)
    else:
        visits = record_visits(args.testbed, args.pool, args.steps, args.seed, os.path.join(run_dir, "run"))
        os.makedirs(run_dir, exist_ok=True)
        with open(visits_path, "w", encoding="utf-8") as fh:
            json.dump(visits, fh)
    g = get_testbed(args.testbed).recipe["num_generations"]
    res = {
        "cell": f"{args.testbed}, pool {args.pool}, {args.steps} steps",
        "seed": args.seed,
        **analyse(visits, args.pool, g),
    }
    command = " ".join(["python benchmarks/prompt_predictability.py", *(argv if argv is not None else sys.argv[1:])])
    md = markdown(res, command)
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump({"command": command, **res}, fh, indent=1)
    with open(args.out + ".md", "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    print(md)
    return res


if __name__ == "__main__":
    main()
