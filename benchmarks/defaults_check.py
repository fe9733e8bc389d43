"""Defaults chosen on one testbed, validated on the other: each default against its alternatives on both testbeds.

    python benchmarks/defaults_check.py   # reads token_efficiency_{full,kept}_{default,long}.json (benchmarks/results)

For every option with a default (the kept fraction `"auto"` with δ = 1 against the fixed fractions 0.5 and 0.25, the
|A| proxy vs `loss_aware`, the default weights "recenter" vs "none", the default micro-batch layout vs
`cost_aware_full_micro_batches`, the default order vs `cost_aware_group_by_length`), the paired comparison of two arms
of `benchmarks/token_efficiency.py` (alternative / default on their common seeds, from the per-seed rows of one
results file): the ratio of policy tokens to the target and the difference in end accuracy at equal steps, each a mean
with a bootstrap 95% interval, beside each arm's end accuracy − GRPO's. The rule: a default is kept only if no
alternative beats it beyond the intervals on either testbed — fewer policy tokens to the target with the interval's
upper end below 1, or a higher end accuracy with the interval's lower end above 0; where each wins on one of the two,
the verdict says "trade-off" and the accuracy tolerance (end accuracy ≥ GRPO's − 0.01) decides, in BENCHMARKS.md §5.
Writes `benchmarks/results/defaults_check.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402
from token_efficiency import bootstrap_ci  # noqa: E402

# (option, default arm, alternative arm, results file per testbed). The comparison is computed here from the two arms'
# per-seed rows (`paired`), alternative / default on their common seeds, so its direction does not depend on PAIRS.
FULL = {"default": "token_efficiency_full_default.json", "long": "token_efficiency_full_long.json"}
KEPT = {"default": "token_efficiency_kept_default.json", "long": "token_efficiency_kept_long.json"}
OPTIONS = [
    # the defaults: kept fraction "auto" (δ = 1) and recentred weights
    ("kept fraction: auto vs fixed 0.5 (recentred)", "cost_aware_auto_recenter", "cost_aware_0.5_recenter", FULL),
    ("kept fraction: auto vs fixed 0.5 (weights none)", "cost_aware_auto", "cost_aware_0.5", FULL),
    ("kept fraction: auto vs fixed 0.25 (recentred)", "cost_aware_auto_recenter", "cost_aware_0.25_recenter", KEPT),
    ("kept fraction: auto vs fixed 0.25 (weights none)", "cost_aware_auto", "cost_aware_0.25", KEPT),
    ("weights: recenter vs none (auto)", "cost_aware_auto_recenter", "cost_aware_auto", KEPT),
    ("weights: recenter vs none (fixed 0.5)", "cost_aware_0.5_recenter", "cost_aware_0.5", FULL),
    ("weights: recenter vs none (fixed 0.25)", "cost_aware_0.25_recenter", "cost_aware_0.25", KEPT),
    (
        "proxy: |A| vs loss_aware (auto, recentred)",
        "cost_aware_auto_recenter",
        "cost_aware_auto_recenter_loss_aware",
        KEPT,
    ),
    # measured at fixed 0.5 with weights "none" (the defaults of the matrix's time)
    ("proxy: |A| vs loss_aware (0.5, none)", "cost_aware_0.5", "cost_aware_0.5_loss_aware", FULL),
    ("layout: default vs full micro-batches (0.5, none)", "cost_aware_0.5", "cost_aware_0.5_full_micro", FULL),
    ("order: default vs group_by_length (0.5, none)", "cost_aware_0.5", "cost_aware_0.5_group_by_length", FULL),
]
# The accuracy a cheaper setting may give up against GRPO (issue 18's goal: end accuracy >= GRPO's - 0.01).
ACCURACY_TOLERANCE = 0.01


def paired(default: dict, alternative: dict) -> dict | None:
    """Alternative against default on their common seeds, from the per-seed rows of `token_efficiency.py`'s results:
    the ratio of policy tokens to the target (alternative / default, seeds where both reached it) and the difference
    in end accuracy at equal steps (alternative − default), each a mean with a bootstrap 95% interval; the same
    numbers as `token_efficiency.paired` (checked in tests/test_benchmarks_defaults.py)."""
    rows_d = {r["seed"]: r for r in default["per_seed"]}
    rows_a = {r["seed"]: r for r in alternative["per_seed"]}
    seeds = sorted(set(rows_d) & set(rows_a))
    if not seeds:
        return None
    tok, d_end = [], []
    for s in seeds:
        a, d = rows_a[s], rows_d[s]
        d_end.append(a["end_acc"] - d["end_acc"])
        if a.get("to_target_policy_tokens") and d.get("to_target_policy_tokens"):
            tok.append(a["to_target_policy_tokens"] / d["to_target_policy_tokens"])
    return {
        "seeds": seeds,
        "ratio_policy_tokens": {"ci": bootstrap_ci(tok), "n": len(tok)},
        "end_difference_equal_steps": bootstrap_ci(d_end),
    }


def verdict(entry: dict | None) -> dict:
    """Ratio (alternative / default) and Δ end (alternative − default) from the paired entry, and which of the two is
    better beyond the intervals: fewer policy tokens to the target (ratio interval below / above 1) or a higher end
    accuracy (Δ interval above / below 0). When each wins on one of the two it is a trade-off, named as such."""
    if entry is None:
        return {"status": "not run"}
    r, rlo, rhi = entry["ratio_policy_tokens"]["ci"]
    d, dlo, dhi = entry["end_difference_equal_steps"]
    alt = [
        name
        for name, won in (("tokens", rhi is not None and rhi < 1), ("accuracy", dlo is not None and dlo > 0))
        if won
    ]
    dflt = [
        name
        for name, won in (("tokens", rlo is not None and rlo > 1), ("accuracy", dhi is not None and dhi < 0))
        if won
    ]
    if alt and dflt:
        status = f"trade-off: alternative better on {', '.join(alt)}, default better on {', '.join(dflt)}"
    elif alt:
        status = "alternative better"
    elif dflt:
        status = "default better"
    else:
        status = "no difference beyond the intervals"
    return {
        "seeds": len(entry["seeds"]),
        "ratio": (r, rlo, rhi),
        "n_ratio": entry["ratio_policy_tokens"]["n"],
        "delta_end": (d, dlo, dhi),
        "status": status,
    }


def accuracy_vs_grpo(res: dict, arm: str) -> tuple | None:
    """(mean, low, high) of the arm's end accuracy − GRPO's at equal steps, paired on seeds (None if not run)."""
    a = (res.get("arms") or {}).get(arm)
    return tuple(a["end_minus_grpo_equal_steps"]) if a else None


def _ci(t, fmt) -> str:
    mean, lo, hi = t
    if mean is None:
        return "n/a"
    return fmt.format(mean) if lo is None else f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


HEADLINE_ARMS = ("cost_aware_auto_recenter", "cost_aware_auto", "cost_aware_0.5_recenter", "cost_aware_0.5")
HEADLINE_ARMS += ("uniform_0.5", "pods_0.5")
HEADLINE_PAIRS = (
    ("cost_aware_0.5_recenter", "uniform_0.5_recenter"),
    ("cost_aware_0.5_recenter", "pods_0.5"),
    ("cost_aware_0.5", "uniform_0.5"),
    ("cost_aware_0.5", "pods_0.5"),
)


def headline(results: dict[str, dict], more: dict[str, dict] | None = None) -> list[str]:
    """The README's table: per testbed GRPO's gain, each arm's policy tokens to the target / GRPO's, and what the row
    choice adds over uniform subsampling and PODS (paired ratios of policy tokens to the target). An arm is read from
    `more[bed]` (the kept-fraction runs) instead when that file has more seeds of it and the same target (the runs are
    deterministic per seed, so its first seeds are the same runs)."""
    more = more or {}
    lines = [
        "| testbed | GRPO gain (10 seeds) | "
        + " | ".join(f"{a} / GRPO" for a in HEADLINE_ARMS)
        + " | "
        + " | ".join(f"{a} / {b}" for a, b in HEADLINE_PAIRS)
        + " |",
        "|---|---|" + "---|" * (len(HEADLINE_ARMS) + len(HEADLINE_PAIRS)),
    ]
    for bed, res in results.items():
        gain = res["grpo_improvement"]
        cells = [_ci((gain["mean"], *gain["ci95"]), "{:+.3f}")]
        extra = more.get(bed) if more.get(bed, {}).get("target") == res.get("target") else None
        for arm in HEADLINE_ARMS:
            a = (res.get("arms") or {}).get(arm)
            b = ((extra or {}).get("arms") or {}).get(arm)
            if b and (a is None or b["n"] > a["n"]):
                a = b
            r = a["ratio_vs_grpo"]["policy_tokens"] if a else None
            cells.append(f"{_ci(r['ci'], '{:.2f}')} ({r['n']})" if r else "not run")
        for x, y in HEADLINE_PAIRS:
            v = (res.get("cost_aware_vs") or {}).get(f"{x} vs {y}")
            cells.append(f"{_ci(v['ratio_policy_tokens']['ci'], '{:.2f}')} ({len(v['seeds'])})" if v else "not run")
        lines.append(f"| {bed} | " + " | ".join(cells) + " |")
    return lines


def load(results_dir: str, name: str) -> dict | None:
    path = os.path.join(results_dir, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def check(results_dir: str) -> dict:
    """option -> testbed -> verdict, with each arm's end accuracy − GRPO's (same file, paired on seeds)."""
    table = {}
    for opt, default, alternative, files in OPTIONS:
        table[opt] = {}
        for bed, name in files.items():
            res = load(results_dir, name)
            arms = (res or {}).get("arms") or {}
            if default not in arms or alternative not in arms:
                table[opt][bed] = {"status": "not run", "file": name}
                continue
            v = verdict(paired(arms[default], arms[alternative]))
            v.update(
                file=name,
                default_minus_grpo=accuracy_vs_grpo(res, default),
                alternative_minus_grpo=accuracy_vs_grpo(res, alternative),
            )
            table[opt][bed] = v
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=common.RESULTS)
    args = p.parse_args(argv)
    table = check(args.results)
    results = {bed: r for bed, name in FULL.items() if (r := load(args.results, name)) is not None}
    lines = [
        "`python benchmarks/defaults_check.py`",
        "",
        "Each default against its alternative, paired seeds; ratio = alternative / default policy tokens to the "
        "target, Δ = alternative − default end accuracy at equal steps, and each arm's end accuracy − GRPO's at equal "
        f"steps (the issue's tolerance: ≥ −{ACCURACY_TOLERANCE}); mean [bootstrap 95% CI]. Source: the results file "
        "named in the last column (`token_efficiency.py` runs of the same code and seeds).",
        "",
        "| option | testbed | seeds | policy tokens to target, ratio | Δ end acc. | default − GRPO "
        "| alternative − GRPO | verdict | file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for opt, by_bed in table.items():
        for bed, v in by_bed.items():
            if v["status"] == "not run":
                lines.append(f"| {opt} | {bed} | — | — | — | — | — | not run | {v['file']} |")
                continue
            lines.append(
                f"| {opt} | {bed} | {v['seeds']} | {_ci(v['ratio'], '{:.2f}')} (n={v['n_ratio']}) | "
                f"{_ci(v['delta_end'], '{:+.3f}')} | {_ci(v['default_minus_grpo'], '{:+.3f}')} | "
                f"{_ci(v['alternative_minus_grpo'], '{:+.3f}')} | {v['status']} | {v['file']} |"
            )
    more = {bed: r for bed, name in KEPT.items() if (r := load(args.results, name)) is not None}
    lines += ["", *headline(results, more)]
    text = "\n".join(lines)
    with open(os.path.join(args.results, "defaults_check.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.results, "defaults_check.json"), "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=1)
    print(text)
    return table


if __name__ == "__main__":
    main()
