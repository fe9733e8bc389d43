"""Which row draw pays when each group's prompt is run once (`shared_prompt_forward`): today's draw with either row
cost against the nested draw derived in docs/algorithm.md §6, on the passage task's real rollouts.

    python benchmarks/shared_prompt_draw.py                  # the committed GRPO run(s) of the passage task
    python benchmarks/shared_prompt_draw.py --runs benchmarks/results/real_model_learning_passage_table/runs/X.json

Data. A run record of `real_model_learning.py --task passage_table` holds, per generation batch, every group's
rewards and completion lengths; the prompt of a group is found again in the run's training set (`task_dataset`, the
run's seed; groups matched by (a, b, notes), the mean prompt length of the candidates) and measured with SmolLM2's
chat template (TRL's prompt tokens). Advantages as TRL's: A = (r − mean) / (std + 1e-4) per group.

Costs with sharing: a kept row costs r_i = its completion + 1 (the repeated last prompt token), a group whose rows are
kept pays P_g = its prompt − 1 once; without sharing a kept row costs P_g + 1 + r_i − 1 = P_g + n_i.

Designs, over a batch's informative rows (A ≠ 0; the rest carry no policy gradient), each swept over its budget:
- ``uniform``: π_i = k / n (the reference: k = n/2 sets the variance every design must match);
- ``today_pc`` / ``today_c``: the package's draw (`sampling_distribution`, smoothing 0.1, `inclusion_probabilities`,
  `draw_systematic`) with c = prompt + completion or c = completion, m = 1 .. n; the expected shared cost of its
  touched groups by Monte Carlo over `DRAWS` draws;
- ``today_grouped``: the grouped draw (package commit 8c2478c, since removed: RESULTS.md §0c): scores from §6's
  water-filling without λ (`grouped_scores`), smoothing 0.1, `inclusion_probabilities`, the systematic draw in
  `nested_order` (`nested_draw`), m = 1 .. n, cost by Monte Carlo as above;
- ``at_runs_m``: at the passage runs' own kept count (m = 8, kept ½ of 4 × 4; batches with more informative rows),
  the grouped draw's expected shared cost and design variance over today's (c = prompt + completion);
- ``today_pc_unshared``: today's draw (c = prompt + completion) without sharing, its cost a fraction of the
  unshared cost of all informative rows (the setting the draw was derived for);
- ``nested``: the derived draw (one uniform per group, row i kept iff U_g < π_i), π from the water-filling of §6
  (top set capped at 1; then a conservative, still valid design), its expected cost exact: Σ π_i r_i + Σ_g P_g max π.
Variance: the Horvitz–Thompson variance under §6's assumption (orthogonal row gradients), Σ_i G_i² (1/π_i − 1), with
G_i the proxy (``advantage``: |A_i|; ``loss_aware`` at γ = 1/2 for dapo without log-probs: |A_i| √n_i).

The assumption, checked where per-row gradients were measured (`real_model_rows.py` on SmolLM2's times-table
rollouts, K = 8 prompts × G = 8; its noise parts `within`, `total` and `signal` are exact functions of
a = Σ_i ‖x_i‖², b = Σ_k ‖S_k‖² / G and ‖T‖², which `cross_terms` inverts): Σ_k ‖S_k‖² / Σ_i ‖x_i‖² is 1 for
orthogonal rows, and it is the factor by which drawing whole groups (nested, equal π) changes the design variance.

Figure: per batch, the expected update cost (with sharing) at which a design has uniform-at-half's variance, as a
fraction of the shared cost of all informative rows (linear between a fixed-size draw's m); mean over batches and
[min, max]. The nested draw's figure is an upper bound on what a fixed-size version of it could save (its kept count
is random; the trainer keeps a fixed m per rank).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from real_model_learning import DATASET_N, task_dataset  # noqa: E402

from trl_costaware.rows.sampling import (  # noqa: E402
    draw_systematic,
    inclusion_probabilities,
    sampling_distribution,
)

RUNS = "benchmarks/results/real_model_learning_passage_table/runs/grpo*.json"
OUT = "benchmarks/results/shared_prompt_draw"
ROWS = "benchmarks/results/real_model_rows_smollm2.json"
DRAWS = 400
SMOOTHING = 0.1
PROXIES = ("advantage", "loss_aware")
KEPT_COUNT = 8  # the passage runs' m: kept ½ of 4 prompts × 4 rollouts


def prompt_lengths(seed: int, tokenizer) -> dict[tuple[int, int, int], float]:
    """(a, b, notes) → mean prompt tokens (chat template with the generation prompt) over the run's training set."""
    found = defaultdict(list)
    for row in task_dataset("passage_table", DATASET_N, seed):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
        found[(row["a"], row["b"], row["notes"])].append(len(ids))
    return {k: sum(v) / len(v) for k, v in found.items()}


def batches(record: dict, lengths: dict) -> list[dict]:
    """Per generation batch: informative rows' group index, proxy inputs and costs (tensors, float64)."""
    by_step = defaultdict(list)
    for g in record["groups"]:
        by_step[g["step"]].append(g)
    out = []
    for step, groups in sorted(by_step.items()):
        rows = defaultdict(list)
        for gi, g in enumerate(groups):
            r = torch.tensor(g["rewards"], dtype=torch.float64)
            adv = (r - r.mean()) / (r.std() + 1e-4)
            prompt = lengths[(g["a"], g["b"], g["notes"])]
            for a, n in zip(adv.tolist(), g["tokens"], strict=True):
                if a != 0.0 and n > 0:
                    rows["group"].append(gi)
                    rows["adv"].append(abs(a))
                    rows["n"].append(float(n))
                    rows["prompt"].append(prompt)
        if len(rows["adv"]) >= 2:
            out.append({"step": step, **{k: torch.tensor(v, dtype=torch.float64) for k, v in rows.items()}})
    return out


def proxy(batch: dict, name: str) -> torch.Tensor:
    return batch["adv"] if name == "advantage" else batch["adv"] * batch["n"].sqrt()


def shared_cost(batch: dict, keep: torch.Tensor) -> torch.Tensor:
    """Update tokens with sharing of kept sets `keep` (draws × rows, bool): Σ_kept (n_i + 1) + Σ_touched (P_g − 1)."""
    groups = batch["group"].long()
    rows = (keep.double() * (batch["n"] + 1)).sum(-1)
    touched = torch.zeros(keep.size(0), int(groups.max()) + 1, dtype=torch.float64)
    touched.index_reduce_(1, groups, keep.double(), "amax", include_self=True)
    prompt = torch.zeros(int(groups.max()) + 1, dtype=torch.float64).index_reduce_(
        0, groups, batch["prompt"] - 1, "amax", include_self=False
    )
    return rows + touched @ prompt


def variance(g: torch.Tensor, pi: torch.Tensor) -> float:
    return float((g**2 * (1 / pi.clamp(min=1e-12) - 1)).sum())


def grouped_scores(batch: dict, g: torch.Tensor) -> torch.Tensor:
    """The grouped draw's scores: §6's water-filling π without the multiplier (at a λ where no π reaches its cap, π is
    the λ-free score over √λ, and a sampling distribution ignores the scale)."""
    return nested_pi(batch, g, 1e12) * 1e6


def nested_order(pi: torch.Tensor, groups: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The grouped draw's row order: the groups in random order, stably sorted by their spread max π − min π; layer k
    lists the k-th most probable row of every group with at least k rows, layers one after the other."""
    ids = torch.unique(groups)
    ids = ids[torch.randperm(len(ids), generator=generator)]
    members = [(groups == i).nonzero().squeeze(1) for i in ids.tolist()]
    spread = torch.tensor([float(pi[rows].max() - pi[rows].min()) for rows in members], dtype=torch.float64)
    layers: list[list[int]] = []
    for j in torch.argsort(spread, stable=True).tolist():
        for k, row in enumerate(members[j][torch.argsort(pi[members[j]], descending=True, stable=True)].tolist()):
            layers.extend([] for _ in range(k + 1 - len(layers)))
            layers[k].append(row)
    return torch.tensor([row for layer in layers for row in layer], dtype=torch.long)


def nested_draw(p: torch.Tensor, m: int, generator: torch.Generator, groups: torch.Tensor) -> torch.Tensor:
    """The rows the grouped draw keeps: `draw_systematic`'s points u + k over π laid out in `nested_order`."""
    pi = inclusion_probabilities(p, m)
    perm = nested_order(pi, groups, generator)
    u = torch.rand((), generator=generator, dtype=torch.float64).item()
    cum = torch.cumsum(pi[perm], 0)
    cum = cum * (m / cum[-1])
    points = u + torch.arange(m, dtype=torch.float64)
    return perm[torch.searchsorted(cum, points, right=True).clamp(max=len(p) - 1)]


def kept_rows(p: torch.Tensor, m: int, generator: torch.Generator, groups: torch.Tensor | None) -> torch.Tensor:
    return draw_systematic(p, m, generator).indices if groups is None else nested_draw(p, m, generator, groups)


def draw_distribution(batch: dict, g: torch.Tensor, cost_kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The package's sampling distribution (smoothing 0.1) for `cost_kind` ("pc", "c", "grouped"), and the groups the
    grouped draw nests (None otherwise)."""
    if cost_kind == "grouped":
        groups = batch["group"]
        return sampling_distribution(grouped_scores(batch, g), SMOOTHING), groups
    c = batch["n"] + (batch["prompt"] if cost_kind == "pc" else 0)
    return sampling_distribution(g / c.sqrt(), SMOOTHING), None


def today_curve(
    batch: dict, g: torch.Tensor, cost_kind: str, gen: torch.Generator, shared: bool = True
) -> list[tuple[float, float]]:
    """(expected cost, variance) of the package's fixed-size draw at m = 1 .. n; the cost with sharing (Monte Carlo)
    or, with `shared` False, without it (Σ π_i (P_i + n_i), exact). `cost_kind` "pc" (c = prompt + completion), "c"
    (c = completion) or "grouped" (`grouped_scores` and `nested_draw`)."""
    p, groups = draw_distribution(batch, g, cost_kind)
    n = len(g)
    curve = []
    for m in range(1, n + 1):
        pi = inclusion_probabilities(p, m)
        if not shared:
            curve.append((float((pi * (batch["prompt"] + batch["n"])).sum()), variance(g, pi)))
            continue
        keep = torch.zeros(DRAWS, n, dtype=torch.bool)
        for d in range(DRAWS):
            keep[d, kept_rows(p, m, gen, groups)] = True
        curve.append((float(shared_cost(batch, keep).mean()), variance(g, pi)))
    return curve


def nested_pi(batch: dict, g: torch.Tensor, lam: float) -> torch.Tensor:
    """§6's water-filling at multiplier λ: per group the top rows by G/√r share t_g (capped at 1), the others
    π_i = min(G_i / √(λ r_i), t_g)."""
    r = batch["n"] + 1
    pi = torch.zeros_like(g)
    for gi in batch["group"].unique().tolist():
        rows = (batch["group"] == gi).nonzero().squeeze(1)
        prompt = float(batch["prompt"][rows[0]]) - 1
        order = rows[torch.argsort(g[rows] / r[rows].sqrt(), descending=True)]
        own = g[order] / (lam * r[order]).sqrt()
        k, t = 1, 0.0
        for size in range(1, len(order) + 1):
            top = order[:size]
            t_size = math.sqrt(float((g[top] ** 2).sum()) / (lam * (prompt + float(r[top].sum()))))
            if float(own[size - 1]) >= t_size or size == 1:
                k, t = size, t_size
        t = min(t, 1.0)
        pi[order[:k]] = t
        pi[order[k:]] = own[k:].clamp(max=t)
    return pi


def nested_point(batch: dict, g: torch.Tensor, lam: float) -> tuple[float, float]:
    pi = nested_pi(batch, g, lam)
    cost = float((pi * (batch["n"] + 1)).sum())
    for gi in batch["group"].unique().tolist():
        rows = batch["group"] == gi
        cost += float(pi[rows].max()) * (float(batch["prompt"][rows][0]) - 1)
    return cost, variance(g, pi)


def cost_at(curve: list[tuple[float, float]], target: float) -> float | None:
    """The cost at which a (cost ↑, variance ↓) curve reaches `target`, linear between its points."""
    for (c0, v0), (c1, v1) in zip(curve, curve[1:], strict=False):
        if v0 >= target >= v1:
            return c1 if v0 == v1 else c0 + (c1 - c0) * (v0 - target) / (v0 - v1)
    return curve[0][0] if curve and curve[0][1] <= target else None


def nested_cost_at(batch: dict, g: torch.Tensor, target: float) -> float:
    lo, hi = 1e-12, 1e12  # λ: variance grows with λ
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if nested_point(batch, g, mid)[1] > target:
            hi = mid
        else:
            lo = mid
    return nested_point(batch, g, lo)[0]


def analyse(paths: list[str], tokenizer=None) -> dict:
    """The figures of the run records `paths`, prompts measured with `tokenizer` (default SmolLM2's)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        from trl_costaware.embedded.smollm2 import smollm2

        tokenizer = AutoTokenizer.from_pretrained(smollm2())
    gen = torch.Generator().manual_seed(0)
    figures = {p: defaultdict(list) for p in PROXIES}
    meta = []
    for path in paths:
        record = json.load(open(path, encoding="utf-8"))
        lengths = prompt_lengths(record["seed"], tokenizer)
        for batch in batches(record, lengths):
            full = float(shared_cost(batch, torch.ones(1, len(batch["adv"]), dtype=torch.bool))[0])
            unshared_full = float((batch["prompt"] + batch["n"]).sum())
            meta.append(
                {"run": os.path.basename(path), "step": batch["step"], "rows": len(batch["adv"]),
                 "groups": len(batch["group"].unique()), "shared_over_unshared": full / unshared_full}
            )  # fmt: skip
            for name in PROXIES:
                g = proxy(batch, name)
                target = variance(g, torch.full_like(g, 0.5))
                f = figures[name]
                f["uniform"].append(cost_at(uniform_curve(batch, g), target) / full)
                for kind in ("pc", "c", "grouped"):
                    at = cost_at(today_curve(batch, g, kind, gen), target)
                    f[f"today_{kind}"].append(None if at is None else at / full)
                f["nested"].append(nested_cost_at(batch, g, target) / full)
                at = cost_at(today_curve(batch, g, "pc", gen, shared=False), target)
                f["today_pc_unshared"].append(None if at is None else at / unshared_full)
                if len(g) > KEPT_COUNT:  # below it the runs keep every informative row, with either draw
                    f["at_runs_m"].append(at_kept_count(batch, g, KEPT_COUNT, gen))
    return {"batches": meta, "figures": {k: dict(v) for k, v in figures.items()}}


def at_kept_count(batch: dict, g: torch.Tensor, m: int, gen: torch.Generator) -> dict:
    """Today's draw (c = prompt + completion) and the grouped draw at one kept count m: each one's expected shared
    cost (Monte Carlo) and design variance, and the grouped draw's over today's."""
    out = {}
    for kind in ("pc", "grouped"):
        p, groups = draw_distribution(batch, g, kind)
        keep = torch.zeros(DRAWS, len(g), dtype=torch.bool)
        for d in range(DRAWS):
            keep[d, kept_rows(p, m, gen, groups)] = True
        out[kind] = (float(shared_cost(batch, keep).mean()), variance(g, inclusion_probabilities(p, m)))
    return {"cost_ratio": out["grouped"][0] / out["pc"][0], "variance_ratio": out["grouped"][1] / out["pc"][1]}


def uniform_curve(batch: dict, g: torch.Tensor) -> list[tuple[float, float]]:
    """(expected shared cost, variance) of keeping each informative row with probability k/n, k = 1 .. n, rows drawn
    independently (a group is touched with probability 1 − (1 − k/n)^{its rows})."""
    n = len(g)
    groups = batch["group"].long()
    out = []
    for k in range(1, n + 1):
        q = k / n
        cost = float((q * (batch["n"] + 1)).sum())
        for gi in groups.unique().tolist():
            rows = groups == gi
            cost += (1 - (1 - q) ** int(rows.sum())) * (float(batch["prompt"][rows][0]) - 1)
        out.append((cost, variance(g, torch.full_like(g, q))))
    return out


def cross_terms(path: str, prompts: int = 8, generations: int = 8) -> list[dict]:
    """Per measured batch and loss family of a `real_model_rows.py` result: Σ_k ‖S_k‖² / Σ_i ‖x_i‖² (S_k the group
    sum of the rows' loss gradients x_i), from its noise parts (within = (a − b) / (K(G−1)·KG), total =
    (b/G − ‖T‖²/(KG²)) / ((K−1)K), signal = ‖T‖²/(KG)² − total)."""
    k, g = prompts, generations
    out = []
    for model in json.load(open(path, encoding="utf-8"))["models"].values():
        for batch in model["batches"]:
            for family, figures in batch["families"].items():
                noise = figures["noise"]
                t2 = (k * g) ** 2 * (noise["signal"] + noise["total"])
                b = g * (noise["total"] * k * (k - 1) + t2 / (k * g * g))
                a = noise["within"] * k * (g - 1) * k * g + b
                out.append({"mode": batch["mode"], "batch": batch["batch"], "family": family, "ratio": g * b / a})
    return out


def summary(result: dict) -> str:
    lines = ["| proxy | design | update cost to uniform-at-half's variance (mean [min, max] over batches) |",
             "|---|---|---|"]  # fmt: skip
    for name, figs in result["figures"].items():
        for design, values in figs.items():
            if design == "at_runs_m":
                continue
            got = [v for v in values if v is not None]
            missing = len(values) - len(got)
            cell = f"{sum(got) / len(got):.3f} [{min(got):.3f}, {max(got):.3f}]" if got else "never"
            lines.append(f"| {name} | {design} | {cell}" + (f" ({missing} batches never)" if missing else "") + " |")
    for name, figs in result["figures"].items():
        at = figs.get("at_runs_m", [])
        for key in ("cost_ratio", "variance_ratio") if at else ():
            v = [a[key] for a in at]
            what = f"today_grouped / today_pc at the runs' m = {KEPT_COUNT}, {key.split('_')[0]} ({len(v)} batches)"
            lines.append(f"| {name} | {what} | {sum(v) / len(v):.3f} [{min(v):.3f}, {max(v):.3f}] |")
        for design in ("nested", "today_grouped"):
            paired = [n / t for n, t in zip(figs[design], figs["today_pc"], strict=True) if n and t]
            lines.append(f"| {name} | {design} / today_pc, paired | {sum(paired) / len(paired):.3f} "
                         f"[{min(paired):.3f}, {max(paired):.3f}] |")  # fmt: skip
    ratio = [b["shared_over_unshared"] for b in result["batches"]]
    lines.append("")
    lines.append(f"{len(ratio)} batches; the shared cost of all informative rows over their unshared cost: "
                 f"{sum(ratio) / len(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}].")  # fmt: skip
    if result.get("cross_terms"):
        ratios = [c["ratio"] for c in result["cross_terms"]]
        source, mean = result["cross_terms_source"], sum(ratios) / len(ratios)
        lines.append(
            f"Σ_k ‖S_k‖² / Σ_i ‖x_i‖² on {source} ({len(ratios)} batches × families × modes): {mean:.3f} "
            f"[{min(ratios):.3f}, {max(ratios):.3f}] (1: orthogonal rows)."
        )
    return "\n".join(lines)


def main(argv=None, tokenizer=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="*", help=f"run records (default {RUNS})")
    parser.add_argument("--out", default=OUT, help="writes <out>.json and <out>.md")
    parser.add_argument("--rows", default=ROWS, help="a real_model_rows.py result for the cross-term check")
    args = parser.parse_args(argv)
    paths = args.runs or sorted(glob.glob(RUNS))
    if not paths:
        parser.error(f"no run records match {RUNS}")
    result = analyse(paths, tokenizer)
    result["runs"] = paths
    if os.path.exists(args.rows):
        result["cross_terms"], result["cross_terms_source"] = cross_terms(args.rows), args.rows
    text = summary(result)
    with open(f"{args.out}.json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    with open(f"{args.out}.md", "w", encoding="utf-8") as fh:
        fh.write(f"`python benchmarks/shared_prompt_draw.py {' '.join(argv or sys.argv[1:])}`\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
