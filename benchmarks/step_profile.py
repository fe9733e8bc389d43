"""Step profile: where the time of a GRPO step goes, and what Cost-Aware GRPO removes from it.

Builds a randomly initialised causal LM with real shapes from a config shipped in `benchmarks/configs/`
(`qwen2.5-0.5b`, `qwen2.5-1.5b`: Qwen2.5's own shapes; `tiny`: for the CPU test), with the package's character
tokenizer padded with placeholder tokens to the config's vocabulary size (no download; the embedding and LM head cost
what they cost in the real model), and trains it for a few steps on random prompts with a pseudo-random reward, once
per arm, in one process: GRPO (``cost_aware=False``), Cost-Aware GRPO (unnormalised weights) and Cost-Aware GRPO with
recentred weights (``cost_aware_weight_normalization="recenter"``). Generation is Hugging Face ``generate``, or vLLM
in colocate mode when vLLM is installed and a GPU is there (``--vllm auto``).

Per phase it reports wall time per step, its share of the step, tokens per second and peak memory:

| phase | measured at (methods of the trainer instance, wrapped) | tokens counted |
|---|---|---|
| generation | ``_generate`` | completion tokens generated |
| reward | ``_calculate_rewards`` | completion tokens scored |
| old/ref log-probs | ``_get_per_token_logps_and_entropies`` without grad | real tokens in the pass |
| cost-aware sampling | ``_draw_kept_rows`` (cost-aware arms) | rollouts considered |
| policy forward+backward | ``compute_loss`` and ``accelerator.backward`` | real tokens of the micro-batch |
| optimizer | ``_clip_grad_norm``; ``optimizer.step`` (``on_pre_optimizer_step`` to ``on_optimizer_step``) | — |
| other | the rest of the step (batching, advantages, logging) | — |

Times are exclusive (a phase nested in another is subtracted from it), taken with ``time.perf_counter`` after
``torch.cuda.synchronize()`` on CUDA. Peak memory is ``torch.cuda.max_memory_allocated`` while the phase runs on
CUDA, and on CPU the process RSS at the end of the phase (largest seen). The first ``--warmup-steps`` steps are left
out of the means. Output: a markdown table (stdout and ``--out``.md) and JSON (``--out``.json).

On a GPU machine, one command (here ≤ 10 minutes)::

    timeout 540 python benchmarks/step_profile.py --config qwen2.5-0.5b --bf16 --steps 4 --rollouts 64 \\
        --max-completion-length 256 --out benchmarks/results/step_profile_qwen2.5-0.5b

Random weights do not write text: completions are long runs of random tokens. HF generation ends them at random
lengths with ``exponential_decay_length_penalty`` (``--eos-after``: EOS becomes likely some tokens after that
position), so that rows differ in cost as real rollouts do; vLLM ignores it (its completions run to the cap).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import resource
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "configs")
PHASES = (
    "generation",
    "reward",
    "old/ref log-probs",
    "cost-aware sampling",
    "policy forward+backward",
    "optimizer",
    "other",
)
# The row-stage arms name their proxy (the one the committed profiles used): an arm must not change with a default.
ADV = {"cost_aware_proxy": "advantage"}
ARMS = {
    "grpo": {"cost_aware": False},
    "cost_aware": {"cost_aware": True, "cost_aware_weight_normalization": "none", **ADV},
    "cost_aware_recenter": {"cost_aware": True, "cost_aware_weight_normalization": "recenter", **ADV},
    # Same generation batch and sample as `cost_aware` (packed), under TRL's even split of the kept rows ("layout" is
    # not a config field: the trainer's layout is forced after construction).
    "cost_aware_even": {"cost_aware": True, "cost_aware_weight_normalization": "none", **ADV, "layout": "even"},
}


# ---------------------------------------------------------------------------------------------------- model and data
def available_configs() -> list[str]:
    return sorted(f[: -len(".json")] for f in os.listdir(CONFIGS) if f.endswith(".json"))


def build_model(name: str, dtype, seed: int = 0):
    """(model, tokenizer): random weights with the shapes of ``configs/<name>.json``, the character tokenizer."""
    import torch
    from tokenizers import models
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from trl_costaware.embedded.tokenizer import UNK_TOKEN, build_tokenizer, vocabulary

    path = os.path.join(CONFIGS, f"{name}.json")
    if not os.path.exists(path):
        raise SystemExit(f"--config {name!r}: no {path}; choose one of {', '.join(available_configs())}")
    with open(path, encoding="utf-8") as fh:
        shape = {k: v for k, v in json.load(fh).items() if not k.startswith("_")}
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = shape["max_position_embeddings"]
    # One token per id of the model's vocabulary, so that every sampled id decodes (vLLM's detokenizer needs it):
    # placeholders in the word-level vocabulary itself (151k added tokens would take ~10 s to load, these 0.2 s).
    vocab = vocabulary()
    vocab.update({f"<t{i}>": i for i in range(len(vocab), shape["vocab_size"])})
    tokenizer.backend_tokenizer.model = models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN)
    special = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = AutoConfig.for_model(shape.pop("model_type"), **shape, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(**special)
    return model, tokenizer


def random_prompts(n: int, length: int, seed: int = 0) -> list[str]:
    """`n` prompts of `length` characters drawn from the tokenizer's characters (one token each)."""
    import random

    from trl_costaware.embedded.tokenizer import CHARACTERS

    rng = random.Random(seed)
    letters = [c for c in CHARACTERS if c.isalnum() or c in " +-*=.,"]
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]


def hash_reward(completions, completion_ids=None, **kwargs) -> list[float]:
    """A pseudo-random reward in [0, 1) from each completion's token ids (deterministic, with spread inside a
    group)."""
    keys = completion_ids if completion_ids is not None else completions
    return [int(hashlib.sha256(str(list(k)).encode()).hexdigest()[:8], 16) / 2**32 for k in keys]


# ---------------------------------------------------------------------------------------------------- the profiler
class PhaseProfiler:
    """Exclusive wall time, token counts and peak memory per (step, phase). Phases nest: a phase's time excludes the
    phases that run inside it."""

    def __init__(self, cuda: bool):
        import psutil
        import torch

        self.torch, self.cuda, self.process = torch, cuda, psutil.Process()
        self.stack: list[dict] = []
        self.step = 0
        self.time = defaultdict(float)  # (step, phase) -> seconds
        self.calls = defaultdict(int)
        self.tokens = defaultdict(float)
        self.peak = defaultdict(float)  # phase -> bytes
        self.step_time: dict[int, float] = {}

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def _memory(self) -> float:
        if self.cuda:
            return float(self.torch.cuda.max_memory_allocated())
        return float(self.process.memory_info().rss)

    def enter(self, phase: str) -> None:
        self._sync()
        if self.cuda:
            if self.stack:
                self.stack[-1]["peak"] = max(self.stack[-1]["peak"], self._memory())
            self.torch.cuda.reset_peak_memory_stats()
        self.stack.append({"phase": phase, "start": time.perf_counter(), "inner": 0.0, "peak": 0.0})

    def exit(self, tokens: float = 0.0) -> None:
        self._sync()
        frame = self.stack.pop()
        elapsed = time.perf_counter() - frame["start"]
        key = (self.step, frame["phase"])
        self.time[key] += elapsed - frame["inner"]
        self.calls[key] += 1
        self.tokens[key] += tokens
        peak = max(frame["peak"], self._memory())
        self.peak[frame["phase"]] = max(self.peak[frame["phase"]], peak)
        if self.stack:
            self.stack[-1]["inner"] += elapsed
            self.stack[-1]["peak"] = max(self.stack[-1]["peak"], peak)

    @contextlib.contextmanager
    def phase(self, name: str, tokens=None):
        """`tokens`: a number, or a callable of the wrapped call's result giving one (set via the yielded dict)."""
        box = {"tokens": tokens or 0.0}
        self.enter(name)
        try:
            yield box
        finally:
            self.exit(float(box["tokens"]))

    def summary(self, warmup: int) -> dict:
        steps = sorted(s for s in self.step_time if s >= warmup) or sorted(self.step_time)
        n = max(len(steps), 1)
        step_mean = sum(self.step_time[s] for s in steps) / n
        rows = {}
        for phase in PHASES:
            t = sum(self.time[(s, phase)] for s in steps) / n
            if phase == "other":
                t = step_mean - sum(r["seconds_per_step"] for r in rows.values())
            tokens = sum(self.tokens[(s, phase)] for s in steps) / n
            rows[phase] = {
                "seconds_per_step": t,
                "share": t / step_mean if step_mean else None,
                "calls_per_step": sum(self.calls[(s, phase)] for s in steps) / n,
                "tokens_per_step": tokens or None,
                "tokens_per_second": tokens / t if tokens and t > 0 else None,
                "peak_memory_gib": self.peak[phase] / 2**30 if phase in self.peak else None,
            }
        return {"steps_measured": steps, "step_seconds": step_mean, "phases": rows}


def _real_tokens(mask) -> float:
    return float(mask.sum()) if mask is not None else 0.0


def instrument(trainer, profiler: PhaseProfiler):
    """Wrap the trainer's phase methods (a subclass made for this instance, so that the trainer's own
    per-call method patching keeps working), its accelerator's ``backward``, and add a callback for the optimizer step
    and the step boundaries."""
    import torch
    from transformers import TrainerCallback

    base = type(trainer)

    class Profiled(base):
        def _generate(self, prompts):
            with profiler.phase("generation") as box:
                out = super()._generate(prompts)
                box["tokens"] = sum(len(ids) for ids in out[1])  # (prompt_ids, completion_ids, ...)
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            with profiler.phase("reward", tokens=sum(len(ids) for ids in completion_ids_list)):
                return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
            # the policy pass (counted in compute_loss), or a pass the cost-aware trainer defers (a placeholder)
            if torch.is_grad_enabled() or getattr(getattr(self, "_cost_aware", None), "deferring", False):
                return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
            with profiler.phase("old/ref log-probs", tokens=_real_tokens(attention_mask)):
                return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)

        def compute_loss(self, model, inputs, *args, **kwargs):
            tokens = _real_tokens(inputs.get("prompt_mask")) + _real_tokens(inputs.get("completion_mask"))
            with profiler.phase("policy forward+backward", tokens=tokens):
                return super().compute_loss(model, inputs, *args, **kwargs)

        def _clip_grad_norm(self, model):
            with profiler.phase("optimizer"):
                return super()._clip_grad_norm(model)

    if hasattr(base, "_draw_kept_rows"):

        def _draw_kept_rows(self, batch):
            with profiler.phase("cost-aware sampling", tokens=len(batch["advantages"])):
                return base._draw_kept_rows(self, batch)

        Profiled._draw_kept_rows = _draw_kept_rows
    Profiled.__name__ = Profiled.__qualname__ = f"Profiled{base.__name__}"
    trainer.__class__ = Profiled

    backward = trainer.accelerator.backward

    def timed_backward(loss, **kwargs):
        with profiler.phase("policy forward+backward"):
            return backward(loss, **kwargs)

    trainer.accelerator.backward = timed_backward

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            profiler._sync()
            profiler.step = state.global_step
            self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            profiler.enter("optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            profiler.exit()

        def on_step_end(self, args, state, control, **kwargs):
            profiler._sync()
            profiler.step_time[profiler.step] = time.perf_counter() - self.start

    trainer.add_callback(StepClock())
    return trainer


# ---------------------------------------------------------------------------------------------------- one arm
def profile_arm(arm: str, model_path: str, opts, device: str, use_vllm: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback

    from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer

    cuda = device == "cuda"
    micro = min(opts.micro_batch, opts.rollouts)
    if opts.rollouts % micro or opts.rollouts % opts.num_generations:
        raise SystemExit(
            f"--rollouts {opts.rollouts} must be a multiple of --micro-batch {micro} and --num-generations "
            f"{opts.num_generations}"
        )
    accumulation = opts.rollouts // micro
    prompts_per_step = opts.rollouts // opts.num_generations
    data = Dataset.from_dict({"prompt": random_prompts(prompts_per_step * opts.steps, opts.prompt_length, opts.seed)})
    generation_kwargs = None
    if not use_vllm and opts.eos_after is not None:
        generation_kwargs = {"exponential_decay_length_penalty": (opts.eos_after, opts.eos_decay)}
    args = CostAwareGRPOConfig(
        output_dir=os.path.join(opts.workdir, arm),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=None,  # TRL's default: one generation batch per optimizer step
        num_generations=opts.num_generations,
        max_completion_length=opts.max_completion_length,
        max_steps=opts.steps,
        learning_rate=1e-6,
        beta=opts.beta,
        loss_type="dapo",
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=opts.bf16 and cuda,
        # --bf16: bf16 weights as well (TRL would load them in float32 and train in mixed precision otherwise)
        model_init_kwargs={"dtype": "bfloat16" if opts.bf16 and cuda else "float32"},
        use_cpu=not cuda,
        disable_tqdm=True,
        gradient_checkpointing=opts.gradient_checkpointing,
        generation_kwargs=generation_kwargs,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=opts.vllm_memory,
        cost_aware_kept_fraction=opts.kept_fraction,
        seed=opts.seed,
        **{k: v for k, v in ARMS[arm].items() if k != "layout"},
    )
    layout = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    trainer = CostAwareGRPOTrainer(model_path, [hash_reward], args=args, train_dataset=data)
    if "layout" in ARMS[arm]:
        trainer._cost_aware.layout = ARMS[arm]["layout"]
    trainer.remove_callback(PrinterCallback)  # no dict per step on stdout (the tables are the output)
    profiler = PhaseProfiler(cuda)
    instrument(trainer, profiler)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    totals = dict(trainer._cost_aware.totals)
    out = profiler.summary(opts.warmup_steps)
    out.update(
        {
            "arm": arm,
            "settings": ARMS[arm],
            "micro_batches_per_step": layout[1],
            "rows_per_micro_batch": layout[0] * (opts.kept_fraction if ARMS[arm]["cost_aware"] else 1.0),
            "train_seconds": wall,
            "totals": totals,
            "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30) if cuda else None,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        }
    )
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------------- report
def _fmt(v, spec="{:.3g}") -> str:
    return "—" if v is None else spec.format(v)


def markdown(result: dict) -> str:
    s = result["setup"]
    lines = [
        f"Step profile on {s['device_name']} ({s['device']}), config `{s['config']}` ({s['parameters_m']:.4g}M "
        f"parameters, random weights), {s['dtype']}, generation: {s['generation']}. {s['rollouts']} rollouts per step "
        f"({s['rollouts'] // s['num_generations']} prompts × {s['num_generations']}), prompts {s['prompt_length']} "
        f"tokens, completions ≤ {s['max_completion_length']} tokens, micro-batch {s['micro_batch']}, kept fraction "
        f"{s['kept_fraction']} (cost-aware arms), beta {s['beta']}. Means over steps {s['steps_measured']} "
        f"(first {s['warmup_steps']} left out).",
        "",
    ]
    head = "| phase | " + " | ".join(f"{a['arm']} s/step (share)" for a in result["arms"])
    head += " | " + " | ".join(f"{a['arm']} tok/s" for a in result["arms"])
    head += " | " + " | ".join(f"{a['arm']} peak GiB" for a in result["arms"]) + " |"
    lines += [head, "|" + "---|" * (1 + 3 * len(result["arms"]))]
    for phase in PHASES:
        rows = [a["phases"][phase] for a in result["arms"]]
        cells = [f"{r['seconds_per_step']:.3f} ({100 * (r['share'] or 0):.0f}%)" for r in rows]
        cells += [_fmt(r["tokens_per_second"], "{:,.0f}") for r in rows]
        cells += [_fmt(r["peak_memory_gib"], "{:.2f}") for r in rows]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    step = [f"**{a['step_seconds']:.3f}**" for a in result["arms"]]
    lines.append("| **step** | " + " | ".join(step) + " |" + " |" * (2 * len(result["arms"])))
    lines += [
        "",
        "| arm | step s | vs grpo | micro-batches × rows | policy tokens / step (vs grpo) "
        "| policy fwd+bwd s (vs grpo) | rollout tokens / step | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = next((a for a in result["arms"] if a["arm"] == "grpo"), None)
    n_steps = max(s["steps"], 1)
    for a in result["arms"]:
        ratio = f"{a['step_seconds'] / base['step_seconds']:.2f}×" if base and base["step_seconds"] else "—"
        peak = a["peak_memory_gib"] if a["peak_memory_gib"] is not None else a["max_rss_gib"]
        tokens, policy = a["totals"]["policy_tokens"], a["phases"]["policy forward+backward"]["seconds_per_step"]
        tok_ratio = f" ({tokens / base['totals']['policy_tokens']:.2f}×)" if base else ""
        base_policy = base["phases"]["policy forward+backward"]["seconds_per_step"] if base else 0
        pol_ratio = f" ({policy / base_policy:.2f}×)" if base_policy else ""
        layout = f"{a.get('micro_batches_per_step', '—')} × {_fmt(a.get('rows_per_micro_batch'), '{:g}')}"
        lines.append(
            f"| {a['arm']} | {a['step_seconds']:.3f} | {ratio} | {layout} | {tokens / n_steps:,.0f}{tok_ratio} | "
            f"{policy:.3f}{pol_ratio} | {a['totals']['rollout_tokens'] / n_steps:,.0f} | {_fmt(peak, '{:.2f}')} |"
        )
    memory = "CUDA max_memory_allocated" if s["device"] == "cuda" else "process RSS (CPU; peak GiB: max RSS)"
    lines += ["", f"Memory: {memory}. Token counts are means over all steps (warm-up included)."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b", choices=available_configs(), help="model shapes")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per arm (default 4)")
    p.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the means (default 1)")
    p.add_argument("--rollouts", type=int, default=64, help="rollouts per step (default 64)")
    p.add_argument("--num-generations", type=int, default=8, help="rollouts per prompt (default 8)")
    p.add_argument("--micro-batch", type=int, default=16, help="rows per policy forward/backward (default 16)")
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--prompt-length", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--bf16", action="store_true", help="bf16 weights and bf16 mixed precision (CUDA only)")
    p.add_argument("--kept-fraction", type=float, default=0.5, help="cost-aware kept fraction (default 0.5)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 adds the reference pass")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}")
    p.add_argument("--vllm", choices=("auto", "on", "off"), default="auto", help="vLLM colocate generation")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vllm_gpu_memory_utilization (default 0.3)")
    p.add_argument(
        "--eos-after",
        type=int,
        default=None,
        help="HF generation: EOS grows likely after this many tokens (default: a quarter of the cap)",
    )
    p.add_argument("--eos-decay", type=float, default=1.5, help="growth factor of that EOS bonus per token")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", default=None, help="output prefix: writes OUT.md and OUT.json")
    p.add_argument("--workdir", default=None, help="trainer output dirs (default: a temporary folder)")
    return p


def main(argv: list[str] | None = None) -> dict:
    import importlib.util
    import tempfile

    import torch

    opts = build_parser().parse_args(argv)
    arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    device = opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    has_vllm = importlib.util.find_spec("vllm") is not None
    use_vllm = device == "cuda" and has_vllm if opts.vllm == "auto" else opts.vllm == "on"
    if use_vllm and not (device == "cuda" and has_vllm):
        raise SystemExit("--vllm on needs vLLM installed and a CUDA device")
    if opts.eos_after is None:
        opts.eos_after = max(1, opts.max_completion_length // 4)
    with tempfile.TemporaryDirectory() as tmp:
        opts.workdir = opts.workdir or tmp
        # One checkpoint for every arm (TRL loads the policy, the reference model and vLLM's copy from a folder).
        dtype = torch.bfloat16 if opts.bf16 and device == "cuda" else torch.float32
        model, tokenizer = build_model(opts.config, dtype, seed=opts.seed)
        parameters = sum(p.numel() for p in model.parameters())
        model_path = os.path.join(opts.workdir, f"model-{opts.config}")
        model.save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
        del model
        setup = {
            "config": opts.config,
            "parameters_m": parameters / 1e6,
            "device": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU",
            "dtype": "bf16" if opts.bf16 and device == "cuda" else "fp32",
            "generation": "vLLM colocate" if use_vllm else f"HF generate (EOS bonus after {opts.eos_after} tokens)",
            "rollouts": opts.rollouts,
            "num_generations": opts.num_generations,
            "micro_batch": min(opts.micro_batch, opts.rollouts),
            "max_completion_length": opts.max_completion_length,
            "prompt_length": opts.prompt_length,
            "kept_fraction": opts.kept_fraction,
            "beta": opts.beta,
            "steps": opts.steps,
            "warmup_steps": opts.warmup_steps,
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
        }
        result = {"setup": setup, "arms": []}
        for arm in arms:
            result["arms"].append(profile_arm(arm, model_path, opts, device, use_vllm))
            setup["steps_measured"] = result["arms"][-1]["steps_measured"]
            _write(result, opts.out)  # after each arm: a timeout keeps what finished
    text = markdown(result)
    print(text)
    return result


def _write(result: dict, out: str | None) -> None:
    if not out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    with open(out + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown(result) + "\n")


if __name__ == "__main__":
    main()
