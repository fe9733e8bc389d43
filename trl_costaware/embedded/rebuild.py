"""Rebuild an embedded model from its recipe, and measure how far a rebuild is from the shipped weights.

    python -m trl_costaware.embedded.rebuild long --out /tmp/long-rebuilt              # build, compare with shipped
    python -m trl_costaware.embedded.rebuild long --out /tmp/a --trace 10              # + parameters every 10 steps
    python -m trl_costaware.embedded.rebuild --compare /tmp/a /tmp/b                   # where two traces part

The shipped weights (`shipped.py`) are what every testbed loads; this is the recipe that made them, kept so that
anyone can check it. A rebuild is bit-exact only on a machine whose float kernels round as the build machine's did
(docs/embedded.md): run it under ``ATEN_CPU_CAPABILITY=avx2`` to see how
far another CPU's rounding takes the long recipe.
"""

from __future__ import annotations

import argparse
import json
import os


def _flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


class _Stop(Exception):
    pass


def build(name: str, out: str, *, trace_every: int = 0, init: str = "shipped", stop_after: int = 0) -> dict:
    """Build `name`'s warm-up (`WARMUP_RECIPES`, seed 0) into `out` from the seed-0 tiny model (`init`: "shipped",
    the packaged initial weights; "recipe", `build_tiny_model(0)` on this machine; or a ``model.safetensors`` path);
    with `trace_every`, also save the flattened parameters every that many optimizer steps (both phases, one counter)
    to ``out/trace.pt``. `stop_after` > 0 ends the build after that many steps (the schedule unchanged): a trace
    only, no model."""
    import tempfile

    import torch
    import trl
    from transformers import TrainerCallback

    from . import warmup
    from .model import write_model_dir
    from .shipped import file_sha256, weights_path

    spec = warmup.WARMUP_RECIPES[name]
    trace: list = []
    steps_done = [0]

    class Trace(TrainerCallback):
        def __init__(self, model):
            self.model = model

        def on_step_end(self, args, state, control, **kwargs):
            steps_done[0] += 1
            if trace_every and steps_done[0] % trace_every == 0:
                trace.append((steps_done[0], _flat(self.model)))
            if stop_after and steps_done[0] >= stop_after:
                raise _Stop

    original = trl.SFTTrainer

    class TracedSFT(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if trace_every or stop_after:
                self.add_callback(Trace(self.model))

    os.makedirs(out, exist_ok=True)
    init_weights = {"shipped": weights_path("tiny"), "recipe": None}.get(init, init)
    stopped = False
    with tempfile.TemporaryDirectory() as base:
        write_model_dir(base, init_weights, seed=0)
        trl.SFTTrainer = TracedSFT
        try:
            warmup._run_warmup(base, out, seed=0, steps=spec.steps, recipe=spec)
        except _Stop:
            stopped = True
        finally:
            trl.SFTTrainer = original
    if trace_every:
        torch.save({"steps": [s for s, _ in trace], "params": torch.stack([v for _, v in trace])}, f"{out}/trace.pt")
    env = {
        k: os.environ.get(k)
        for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    }
    info = {
        "recipe": name,
        "init": init,
        "stopped_after": steps_done[0] if stopped else None,
        "sha256": None if stopped else file_sha256(os.path.join(out, "model.safetensors")),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": env,
        "torch": torch.__version__,
    }
    with open(os.path.join(out, "rebuild.json"), "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)
    return info


def max_abs_diff(file_a: str | os.PathLike, file_b: str | os.PathLike) -> float:
    """max |Δ| over all tensors of two ``model.safetensors`` files."""
    from safetensors.torch import load_file

    a, b = load_file(file_a), load_file(file_b)
    if set(a) != set(b):
        raise ValueError(f"different tensors: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def compare_traces(dir_a: str, dir_b: str) -> list[dict]:
    """Per step traced in both: max |Δθ| and ‖Δθ‖ / ‖θ‖ between two traces of the same recipe."""
    import torch

    a, b = torch.load(f"{dir_a}/trace.pt"), torch.load(f"{dir_b}/trace.pt")
    index_b = {step: i for i, step in enumerate(b["steps"])}
    rows = []
    for i, step in enumerate(a["steps"]):
        if step not in index_b:
            continue
        pa, pb = a["params"][i].double(), b["params"][index_b[step]].double()
        d = (pa - pb).abs()
        rows.append({"step": step, "max_abs": float(d.max()), "rel_l2": float(d.norm() / pa.norm())})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", choices=("default", "long"))
    parser.add_argument("--out", help="directory to build into")
    parser.add_argument("--trace", type=int, default=0, help="save the parameters every this many steps")
    parser.add_argument(
        "--init", default="shipped", help='the seed-0 tiny model: "shipped", "recipe" or a model.safetensors path'
    )
    parser.add_argument("--stop-after", type=int, default=0, help="stop after this many steps (trace only)")
    parser.add_argument("--compare", nargs=2, metavar="DIR", help="compare two traced builds")
    args = parser.parse_args(argv)
    if args.compare:
        for row in compare_traces(*args.compare):
            print(f"step {row['step']:5d}  max|Δθ| {row['max_abs']:.3e}  ‖Δθ‖/‖θ‖ {row['rel_l2']:.3e}")
        return
    if not (args.recipe and args.out):
        parser.error("give a recipe and --out (or --compare A B)")
    from .shipped import SHIPPED, weights_path

    info = build(args.recipe, args.out, trace_every=args.trace, init=args.init)
    info["identical_to_shipped"] = info["sha256"] == SHIPPED[args.recipe].sha256
    info["max_abs_diff_vs_shipped"] = max_abs_diff(
        os.path.join(args.out, "model.safetensors"), weights_path(args.recipe)
    )
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
