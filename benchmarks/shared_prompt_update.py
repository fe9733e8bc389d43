"""The shared-prompt update on this CPU: seconds and peak memory of one policy forward + backward, with each prompt
run once per group (`shared_prompt_forward`) against once per row, for prompts of P tokens and groups of G rollouts,
against the token ratio (P + G·R̄) / (G·(P + R̄)).

The model is SmolLM2-135M-Instruct as the learning benchmark trains it (LoRA r 16 on every linear layer, gradient
checkpointing as TRL enables it, TRL's fused LM head with entropies, float32); `--smoke` takes the embedded tiny
model. One micro-batch is one group: a prompt of P random token ids, left-padded by nothing, and G completions whose
lengths are drawn uniformly from [R/2, 3R/2] (R = `--completion`) with a fixed seed, right-padded. The unshared pass
is TRL's (`model(..., labels=..., fused_lm_head=True)`), the shared one `rows.shared_prompt.shared_forward`, the
package's own; both end in `(log-probs + entropies).sum().backward()`.

Each cell (P, G, pass) runs in its own process, pinned to one core (`--core`): one warm-up pass (for batches of at
most `WARMUP_TOKENS` tokens; a larger one takes a minute or more, where the first pass's allocations weigh little),
then `--repeats` timed passes (median of the process's CPU seconds and of wall seconds), and the peak resident memory
above what the process held once the model was loaded (`ru_maxrss`: the cell's own peak, as each process runs one
cell). Cells land in ``<results>/cells.jsonl`` as they finish, with the package commit; a rerun skips them.
`--analyse` writes ``summary.md`` and ``update_vs_tokens.png``.

    python benchmarks/shared_prompt_update.py --core 0               # the grid below, then the analysis
    python benchmarks/shared_prompt_update.py --smoke --results /tmp/x   # the tiny model: checks the harness
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import ENV, package_commit  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results", "shared_prompt_update")
PROMPTS = (50, 250, 500, 1000)
GROUPS = (4, 8, 16)
COMPLETION = 64
REPEATS = 1
WARMUP_TOKENS = 3000  # a cell whose batch holds more tokens than this is timed without a warm-up pass
PASSES = ("unshared", "shared")
SMOKE = dict(prompts=(12,), groups=(2, 4), completion=6, repeats=1)
GOAL = (500, 8, 1.5)  # at P = 500, G = 8 the shared update's seconds ratio is at most 1.5 x its token ratio


# ====================================================================================================== one cell
def load_model(smoke: bool):
    """The policy as the learning benchmark trains it (see the module docstring)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    if smoke:
        from trl_costaware.embedded import tiny_model_path as path_of
    else:
        from trl_costaware.embedded.smollm2 import smollm2 as path_of
    model = AutoModelForCausalLM.from_pretrained(path_of(), dtype=torch.float32, attn_implementation="sdpa")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.train()
    return model


def make_group(vocab: int, prompt: int, generations: int, completion: int, seed: int = 0):
    """(input_ids, attention_mask, completion width, real completion lengths) of one group (module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + prompt * 101 + generations)
    lengths = torch.randint(max(1, completion // 2), completion * 3 // 2 + 1, (generations,), generator=gen).tolist()
    width = max(lengths)
    prompt_ids = torch.randint(3, vocab, (prompt,), generator=gen)
    ids, mask = [], []
    for n in lengths:
        tokens = torch.randint(3, vocab, (n,), generator=gen)
        pad = torch.zeros(width - n, dtype=torch.long)
        ids.append(torch.cat([prompt_ids, tokens, pad]))
        mask.append(torch.cat([torch.ones(prompt + n), torch.zeros(width - n)]).long())
    return torch.stack(ids), torch.stack(mask), width, lengths


def one_pass(model, ids, mask, width, shared: bool) -> int:
    """One forward + backward; returns the tokens the forward ran."""
    from trl_costaware.rows import shared_prompt

    if shared:
        groups = shared_prompt.prompt_groups(ids, mask, width)
        logps, entropy, tokens, _ = shared_prompt.shared_forward(
            model, ids, mask, width, groups, bias_dtype=None, compute_entropy=True
        )
    else:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-width] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logps, entropy, tokens = out.log_probs[:, -width:], out.entropy[:, -width:], ids.numel()
    (logps.sum() + entropy.sum()).backward()
    model.zero_grad(set_to_none=True)
    return tokens


def run_cell(prompt: int, generations: int, which: str, completion: int, repeats: int, smoke: bool) -> dict:
    import torch

    torch.manual_seed(0)
    model = load_model(smoke)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids, mask, width, lengths = make_group(model.config.vocab_size, prompt, generations, completion)
    shared = which == "shared"
    if ids.numel() <= WARMUP_TOKENS:
        one_pass(model, ids, mask, width, shared)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        tokens = one_pass(model, ids, mask, width, shared)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    mean_r = sum(lengths) / len(lengths)
    return {
        "prompt": prompt,
        "generations": generations,
        "pass": which,
        "completion_mean": mean_r,
        "token_ratio": (prompt + sum(lengths)) / sum(prompt + n for n in lengths),
        "tokens_run": int(tokens),
        "cpu_s": statistics.median(cpu),
        "wall_s": statistics.median(wall),
        "cpu_all": cpu,
        "peak_mb_above_model": (peak - loaded) / 1024,  # ru_maxrss is in KiB on Linux
        "load": os.getloadavg()[0],
        "commit": package_commit("benchmarks/shared_prompt_update.py"),
        "smoke": smoke,
    }


# ====================================================================================================== the grid
def cells_path(results: str) -> str:
    return os.path.join(results, "cells.jsonl")


def done_cells(results: str) -> set[tuple[int, int, str]]:
    path = cells_path(results)
    if not os.path.exists(path):
        return set()
    with open(path) as fh:
        return {(r["prompt"], r["generations"], r["pass"]) for r in map(json.loads, fh) if r}


def run_grid(args) -> None:
    os.makedirs(args.results, exist_ok=True)
    done = done_cells(args.results)
    for prompt in args.prompts:
        for generations in args.groups:
            for which in PASSES:
                if (prompt, generations, which) in done:
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(prompt), str(generations), which]
                cmd += ["--completion", str(args.completion), "--repeats", str(args.repeats)]
                cmd += ["--smoke"] if args.smoke else []
                if args.core is not None:
                    cmd = ["taskset", "-c", str(args.core), *cmd]
                env = {**os.environ, **ENV}
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    raise RuntimeError(f"cell {prompt} x {generations} {which} failed:\n{proc.stderr[-3000:]}")
                record = json.loads(proc.stdout.strip().splitlines()[-1])
                with open(cells_path(args.results), "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                print(f"P={prompt} G={generations} {which}: {record['cpu_s']:.2f} CPU s", flush=True)


# ====================================================================================================== analysis
def analyse(results: str) -> dict:
    """Per (P, G): the token ratio, the shared pass's CPU seconds and peak memory over the unshared pass's, and the
    seconds ratio over the token ratio; the goal's cell. Writes summary.md and the figure."""
    with open(cells_path(results)) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    by = {(r["prompt"], r["generations"], r["pass"]): r for r in records}
    rows = []
    for prompt, generations in sorted({(p, g) for p, g, _ in by}):
        u, s = by.get((prompt, generations, "unshared")), by.get((prompt, generations, "shared"))
        if u is None or s is None:
            continue
        seconds = s["cpu_s"] / u["cpu_s"]
        memory = s["peak_mb_above_model"] / u["peak_mb_above_model"] if u["peak_mb_above_model"] > 0 else None
        rows.append(
            dict(
                prompt=prompt,
                generations=generations,
                token_ratio=s["token_ratio"],
                unshared_s=u["cpu_s"],
                shared_s=s["cpu_s"],
                seconds_ratio=seconds,
                over_tokens=seconds / s["token_ratio"],
                unshared_mb=u["peak_mb_above_model"],
                shared_mb=s["peak_mb_above_model"],
                memory_ratio=memory,
                commit=s["commit"],
            )
        )
    goal = next((r for r in rows if (r["prompt"], r["generations"]) == GOAL[:2]), None)
    lines = [
        "# The shared-prompt update on this CPU",
        "",
        "Command: `python benchmarks/shared_prompt_update.py --core N`; cells in `cells.jsonl` (one process per cell,",
        "one core, CPU seconds of one policy forward + backward, median; peak memory above the loaded model).",
        "",
        "| P | G | token ratio | unshared s | shared s | seconds ratio | seconds / token ratio | unshared MB | "
        "shared MB | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mem = "—" if r["memory_ratio"] is None else f"{r['memory_ratio']:.2f}"
        lines.append(
            f"| {r['prompt']} | {r['generations']} | {r['token_ratio']:.3f} | {r['unshared_s']:.2f} | "
            f"{r['shared_s']:.2f} | {r['seconds_ratio']:.3f} | {r['over_tokens']:.2f} | {r['unshared_mb']:.0f} | "
            f"{r['shared_mb']:.0f} | {mem} |"
        )
    if goal is not None:
        verdict = "met" if goal["over_tokens"] <= GOAL[2] else "not met"
        lines += [
            "",
            f"Goal (P = {GOAL[0]}, G = {GOAL[1]}: seconds ratio at most {GOAL[2]} x the token ratio): {verdict}, "
            f"{goal['seconds_ratio']:.3f} against a token ratio of {goal['token_ratio']:.3f} "
            f"({goal['over_tokens']:.2f} x).",
        ]
    with open(os.path.join(results, "summary.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(results, "update_vs_tokens.png"))
    return {"rows": rows, "goal": goal}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for generations in sorted({r["generations"] for r in rows}):
        sel = [r for r in rows if r["generations"] == generations]
        ax.plot([r["token_ratio"] for r in sel], [r["seconds_ratio"] for r in sel], "o-", label=f"G = {generations}")
        for r in sel:
            ax.annotate(f"P={r['prompt']}", (r["token_ratio"], r["seconds_ratio"]), fontsize=7)
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="seconds = tokens")
    ax.plot([0, 1 / 1.5], [0, 1], "k:", lw=0.8, label="1.5 x tokens")
    ax.set_xlabel("token ratio (P + G·R̄) / (G·(P + R̄))")
    ax.set_ylabel("shared / unshared CPU seconds (forward + backward)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--prompts", type=_ints, default=PROMPTS, help="comma-separated prompt lengths P")
    parser.add_argument("--groups", type=_ints, default=GROUPS, help="comma-separated group sizes G")
    parser.add_argument("--completion", type=int, default=COMPLETION, help="mean completion length R (default 64)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed passes per cell after the warm-up")
    parser.add_argument("--core", type=int, default=None, help="pin every cell to this core (taskset)")
    parser.add_argument("--results", default=RESULTS_DIR, help="cells.jsonl, summary.md, figure (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="the embedded tiny model, two small cells")
    parser.add_argument("--analyse", action="store_true", help="only analyse the cells in --results")
    parser.add_argument("--worker", nargs=3, metavar=("P", "G", "PASS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.groups = SMOKE["prompts"], SMOKE["groups"]
        args.completion, args.repeats = SMOKE["completion"], SMOKE["repeats"]
    if args.worker:
        prompt, generations, which = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        print(json.dumps(run_cell(prompt, generations, which, args.completion, args.repeats, args.smoke)))
        return 0
    if not args.analyse:
        run_grid(args)
    summary = analyse(args.results)
    print(open(os.path.join(args.results, "summary.md")).read())
    return 0 if summary["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
