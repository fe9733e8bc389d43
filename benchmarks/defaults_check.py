"""Defaults chosen on one testbed, validated on the other: each default against its alternatives on both testbeds.

    python benchmarks/defaults_check.py            # reads token_efficiency_full_default.json and ..._full_long.json

For every option with a default (kept fraction 0.5 vs the `auto` budget with δ = 1, the |A| proxy vs `loss_aware`,
weights "none" vs "recenter", the default micro-batch layout vs `cost_aware_full_micro_batches`, the default order
vs `cost_aware_group_by_length`), the paired comparison of `benchmarks/token_efficiency.py` (alternative / default
on their common seeds): the ratio of policy tokens to the target and the difference in end accuracy at equal steps,
each a mean with a bootstrap 95% interval. The rule: a default is kept only if no alternative beats it beyond the
intervals on either testbed — fewer policy tokens to the target with the interval's upper end below 1, or a higher
end accuracy with the interval's lower end above 0. Writes `benchmarks/results/defaults_check.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402

# (option, default arm, alternative arm); the pairs are those of token_efficiency.PAIRS, read as alternative / default.
OPTIONS = [
    ("kept fraction 0.5 vs auto (δ = 1)", "cost_aware_0.5", "cost_aware_auto"),
    ("kept fraction 0.5 vs auto (δ = 1), recentred weights", "cost_aware_0.5_recenter", "cost_aware_auto_recenter"),
    ("proxy |A| vs loss_aware", "cost_aware_0.5", "cost_aware_0.5_loss_aware"),
    ("weights none vs recenter", "cost_aware_0.5", "cost_aware_0.5_recenter"),
    ("default layout vs full micro-batches", "cost_aware_0.5", "cost_aware_0.5_full_micro"),
    ("default order vs group_by_length", "cost_aware_0.5", "cost_aware_0.5_group_by_length"),
]
TESTBED_FILES = {"default": "token_efficiency_full_default.json", "long": "token_efficiency_full_long.json"}


def verdict(entry: dict | None) -> dict:
    """Ratio (alternative / default) and Δ end (alternative − default) from the paired entry, and whether the
    alternative beats the default (or the default the alternative) beyond the intervals."""
    if entry is None:
        return {"status": "not run"}
    r, rlo, rhi = entry["ratio_policy_tokens"]["ci"]
    d, dlo, dhi = entry["end_difference_equal_steps"]
    if (rhi is not None and rhi < 1) or (dlo is not None and dlo > 0):
        status = "alternative better"
    elif (rlo is not None and rlo > 1) or (dhi is not None and dhi < 0):
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


def _ci(t, fmt) -> str:
    mean, lo, hi = t
    if mean is None:
        return "n/a"
    return fmt.format(mean) if lo is None else f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


HEADLINE_ARMS = ("cost_aware_0.5", "cost_aware_0.5_recenter", "uniform_0.5", "pods_0.5", "cost_aware_auto")
HEADLINE_PAIRS = (
    ("cost_aware_0.5", "uniform_0.5"),
    ("cost_aware_0.5", "pods_0.5"),
    ("cost_aware_0.5_recenter", "uniform_0.5_recenter"),
    ("cost_aware_0.5_recenter", "pods_0.5"),
)


def headline(results: dict[str, dict]) -> list[str]:
    """The README's table: per testbed GRPO's gain, each arm's policy tokens to the target / GRPO's, and what the row
    choice adds over uniform subsampling and PODS (paired ratios of policy tokens to the target)."""
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
        for arm in HEADLINE_ARMS:
            a = (res.get("arms") or {}).get(arm)
            r = a["ratio_vs_grpo"]["policy_tokens"] if a else None
            cells.append(f"{_ci(r['ci'], '{:.2f}')} ({a['n']})" if r else "not run")
        for x, y in HEADLINE_PAIRS:
            v = (res.get("cost_aware_vs") or {}).get(f"{x} vs {y}")
            cells.append(f"{_ci(v['ratio_policy_tokens']['ci'], '{:.2f}')} ({len(v['seeds'])})" if v else "not run")
        lines.append(f"| {bed} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=common.RESULTS)
    args = p.parse_args(argv)
    results = {}
    for bed, name in TESTBED_FILES.items():
        path = os.path.join(args.results, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                results[bed] = json.load(fh)
    table = {
        opt: {bed: verdict((res.get("cost_aware_vs") or {}).get(f"{a} vs {d}")) for bed, res in results.items()}
        for opt, d, a in OPTIONS
    }
    lines = [
        "`python benchmarks/defaults_check.py`",
        "",
        "Each default against its alternative, paired seeds; ratio = alternative / default policy tokens to the "
        "target,"
        " Δ = alternative − default end accuracy at equal steps (mean [bootstrap 95% CI]).",
        "",
        "| option | testbed | seeds | policy tokens to target, ratio | Δ end acc. | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for opt, by_bed in table.items():
        for bed, v in by_bed.items():
            if v["status"] == "not run":
                lines.append(f"| {opt} | {bed} | — | — | — | not run |")
                continue
            lines.append(
                f"| {opt} | {bed} | {v['seeds']} | {_ci(v['ratio'], '{:.2f}')} (n={v['n_ratio']}) | "
                f"{_ci(v['delta_end'], '{:+.3f}')} | {v['status']} |"
            )
    lines += ["", *headline(results)]
    text = "\n".join(lines)
    with open(os.path.join(args.results, "defaults_check.md"), "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.results, "defaults_check.json"), "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=1)
    print(text)
    return table


if __name__ == "__main__":
    main()
