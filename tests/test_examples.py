"""The examples run: the quick-start swap, the full training script (wrapper and `main`), and the YAML recipes.

Everything trains for two steps on the embedded default (tiny model and arithmetic task); nothing is downloaded. The
quick start names a hub model and dataset, so this test swaps them for the embedded ones from outside the script.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

import trl_costaware
from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
from trl_costaware.embedded.arithmetic import arithmetic_dataset, arithmetic_reward
from trl_costaware.embedded.warmup import warmed_up_model_path
from trl_costaware.scripts.train import main, parse_args, reward_registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RECIPES = EXAMPLES / "recipes"

# TRL's documented GRPO quick start (docs/source/grpo_trainer.md, "Quick start").
TRL_QUICKSTART = """\
# train_grpo.py
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
"""

# Small enough for two CPU steps in a few seconds.
TINY_OVERRIDES = [
    "--max_steps", "2",
    "--per_device_train_batch_size", "8",
    "--gradient_accumulation_steps", "2",
    "--num_generations", "4",
    "--max_completion_length", "20",
    "--logging_steps", "1",
    "--save_strategy", "no",
    "--report_to", "none",
    "--dataloader_num_workers", "0",
    "--disable_tqdm", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def warm_model():
    return warmed_up_model_path()  # the embedded default policy (built once, then cached)


# ---------------------------------------------------------------------------------------------------- quick start
def _quickstart_parts() -> tuple[str, str]:
    """(the --help preamble, TRL's script with the swap) of examples/quickstart.py."""
    script = (EXAMPLES / "quickstart.py").read_text()
    start = script.index("# train_grpo.py\n")
    return script[:start], script[start:]


def test_quickstart_is_trls_with_only_the_swap():
    """Below a --help preamble, the script is TRL's quick start, line for line, but for the swap."""
    preamble, script = _quickstart_parts()
    swapped_back = script.replace(
        "from trl_costaware import CostAwareGRPOTrainer", "from trl import GRPOTrainer"
    ).replace("CostAwareGRPOTrainer(", "GRPOTrainer(")
    assert swapped_back == TRL_QUICKSTART

    # The shown diff is the real one: its "-" side is TRL's script, its "+" side ours.
    diff = (EXAMPLES / "quickstart.diff").read_text().splitlines()
    body = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    old = [line[1:] for line in body if line[:1] in (" ", "-")]
    new = [line[1:] for line in body if line[:1] in (" ", "+")]
    assert old == TRL_QUICKSTART.splitlines()
    assert new == (preamble + script).splitlines()


def test_quickstart_preamble_only_answers_help():
    """The preamble is a docstring and a --help guard that exits: nothing else runs before TRL's script."""
    import ast

    preamble, _ = _quickstart_parts()
    body = ast.parse(preamble).body
    assert isinstance(body[0], ast.Expr) and ast.get_docstring(ast.Module(body=body, type_ignores=[]))
    assert [type(node).__name__ for node in body[1:]] == ["Import", "If"]
    assert ast.unparse(body[2]).splitlines()[-1].strip() == "sys.exit(0)"
    assert "usage: accelerate launch examples/quickstart.py" in preamble


def test_quickstart_runs_on_the_embedded_default(monkeypatch, tmp_path, warm_model):
    import datasets
    import trl.rewards

    seen = {}

    def fake_load_dataset(path, *args, split=None, **kwargs):
        seen["dataset"] = (path, split)
        return arithmetic_dataset(32, seed=0)

    class EmbeddedTrainer(CostAwareGRPOTrainer):
        """Keeps the script's call, swaps the hub model for the embedded one and the default args for tiny ones."""

        def __init__(self, model, reward_funcs, args=None, **kwargs):
            seen.update(model=model, reward_funcs=reward_funcs, args=args, trainer=self)
            tiny = CostAwareGRPOConfig(
                output_dir=str(tmp_path / "quickstart"),
                max_steps=2,
                per_device_train_batch_size=8,
                num_generations=4,
                max_completion_length=20,
                logging_steps=1,
                save_strategy="no",
                report_to="none",
                bf16=False,
                learning_rate=1e-3,
                disable_tqdm=True,
            )
            super().__init__(warm_model, reward_funcs, args=tiny, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    # accuracy_reward needs math_verify and DeepMath's `solution` column; the embedded task's reward reads `answer`.
    monkeypatch.setattr(trl.rewards, "accuracy_reward", arithmetic_reward)
    monkeypatch.setattr(trl_costaware, "CostAwareGRPOTrainer", EmbeddedTrainer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["quickstart.py"])  # as launched: no arguments

    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")

    assert seen["dataset"] == ("trl-lib/DeepMath-103K", "train")
    assert seen["model"] == "Qwen/Qwen2-0.5B-Instruct"
    assert seen["reward_funcs"] is arithmetic_reward
    assert seen["args"] is None
    trainer = seen["trainer"]
    assert trainer.state.global_step == 2
    assert trainer._cost_aware.totals["rows_generated"] > trainer._cost_aware.totals["rows_kept"] > 0


# ---------------------------------------------------------------------------------------------------- full script
def test_training_script_on_embedded_recipe(monkeypatch, tmp_path, warm_model):
    """`python examples/train_cost_aware_grpo.py --config embedded_default.yaml`: tiny model and task, with eval."""
    out = tmp_path / "embedded"
    argv = [
        "train_cost_aware_grpo.py",
        "--config", str(RECIPES / "embedded_default.yaml"),
        *TINY_OVERRIDES,
        "--output_dir", str(out),
        "--embedded_train_size", "64",
        "--embedded_eval_size", "8",
        "--eval_steps", "2",
        "--per_device_eval_batch_size", "16",
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(EXAMPLES / "train_cost_aware_grpo.py"), run_name="__main__")

    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    metrics = out / "cost_aware_metrics.jsonl"  # written by the trainer's tracking callback
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert any("eval_reward" in row for row in rows)
    assert any("reward" in row and row.get("step") == 2 for row in rows)


def test_training_script_on_a_named_dataset_with_lora(tmp_path, warm_model):
    """A dataset by name (a local folder of GSM8K-format files), a model by path, chat prompts, math rewards, LoRA."""
    data = tmp_path / "gsm8k_like"
    data.mkdir()
    for split, n in (("train", 32), ("test", 8)):
        rows = [
            {"question": r["prompt"], "answer": f"Add the terms.\n#### {r['answer']}", "extra": 1}
            for r in arithmetic_dataset(n, seed={"train": 1, "test": 2}[split])
        ]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "named"
    main(
        [
            *TINY_OVERRIDES,
            "--output_dir", str(out),
            "--model_name_or_path", warm_model,
            "--dataset_name", str(data),
            "--prompt_column", "question",
            "--reward_funcs", "gsm8k_accuracy", "arithmetic_format", "trl_costaware.rewards.boxed_format_reward",
            "--reward_weights", "1.0", "0.5", "0.1",
            "--system_prompt", "Sum:",
            "--max_train_samples", "16",
            "--use_peft", "true",
            "--lora_r", "4",
            "--lora_target_modules", "q_proj", "v_proj",
            "--bf16", "false",
            "--cost_aware_kept_fraction", "0.5",
        ]
    )  # fmt: skip
    assert (out / "adapter_config.json").exists()


def test_console_entry_point_runs_the_script(tmp_path, warm_model):
    """`trl-costaware train --config embedded_default.yaml ...`."""
    from trl_costaware.scripts.cli import main as cli_main

    out = tmp_path / "cli"
    argv = ["train", "--config", str(RECIPES / "embedded_default.yaml"), *TINY_OVERRIDES, "--output_dir", str(out)]
    assert cli_main([*argv, "--eval_strategy", "no", "--embedded_train_size", "32"]) == 0
    assert (out / "model.safetensors").exists()


def test_missing_reference_column_fails_before_loading_the_model(tmp_path, warm_model):
    data = tmp_path / "no_answer"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"question": "1+1=", "label": "2"}) + "\n")
    argv = ["--dataset_name", str(data), "--prompt_column", "question", "--model_name_or_path", warm_model]
    with pytest.raises(ValueError, match="--answer_column"):
        main([*argv, "--bf16", "false", "--report_to", "none", "--output_dir", str(tmp_path / "out")])


def test_reward_names_resolve():
    registry = reward_registry()
    for name in ("math_accuracy", "gsm8k_accuracy", "format", "boxed_format", "arithmetic"):
        assert callable(registry[name])
    with pytest.raises(ValueError, match="Unknown reward function"):
        main(
            ["--reward_funcs", "no_such_reward", "--embedded_default", "true"]
            + ["--bf16", "false", "--report_to", "none", "--output_dir", "unused"]
        )


def test_math_accuracy_without_math_verify_fails_at_resolution(monkeypatch):
    """--reward_funcs math_accuracy without the `math` extra: the error names the extra before any model loads."""
    from trl_costaware.scripts.train import resolve_reward_funcs

    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=r"trl-costaware\[math\]"):
        resolve_reward_funcs(["gsm8k_accuracy", "math_accuracy"])
    assert len(resolve_reward_funcs(["gsm8k_accuracy"])) == 1


# ---------------------------------------------------------------------------------------------------- recipes
def test_real_recipe_parses(monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "unchanged")  # restored after the test; the recipe's `env` sets it
    # bf16 needs a GPU at parse time; --use_cpu lets the bf16 recipe parse on a CPU-only machine.
    script_args, training_args, model_args = parse_args(
        ["--config", str(RECIPES / "qwen2.5-0.5b-gsm8k-lora.yaml"), "--use_cpu", "true"]
    )
    assert isinstance(training_args, CostAwareGRPOConfig)
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_args.use_peft and model_args.lora_r == 16 and model_args.dtype == "bfloat16"
    assert (script_args.dataset_name, script_args.dataset_config) == ("openai/gsm8k", "main")
    assert script_args.prompt_column == "question" and script_args.answer_column == "answer"
    assert set(script_args.reward_funcs) <= set(reward_registry())
    assert len(training_args.reward_weights) == len(script_args.reward_funcs)
    assert training_args.bf16 and training_args.report_to == ["wandb"]
    assert training_args.cost_aware and training_args.cost_aware_run_group
    assert training_args.generation_batch_size % training_args.num_generations == 0
    assert "\\boxed{}" in script_args.system_prompt
    import os

    assert os.environ["WANDB_PROJECT"] == "trl-costaware"


def test_embedded_recipe_parses_without_a_model_or_dataset():
    script_args, training_args, model_args = parse_args(["--config", str(RECIPES / "embedded_default.yaml")])
    assert model_args.model_name_or_path is None and script_args.dataset_name is None
    assert script_args.embedded_default  # the recipe asks for the built-in model explicitly (no model: refused)
    assert training_args.cost_aware and not training_args.bf16
    assert set(script_args.reward_funcs) <= set(reward_registry())


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_has_only_known_keys(recipe):
    import yaml

    from trl_costaware.scripts.train import make_parser

    config = yaml.safe_load((RECIPES / recipe).read_text())
    config.pop("env", None)
    assert make_parser().set_defaults_with_config(**config) == []  # every key is a field of one of the dataclasses


def test_docs_recipe_table_states_the_recipes_steps():
    """docs/examples.md's recipe table gives the embedded recipe's step count as the file sets it (it said 200 while
    the file ran 40)."""
    import re

    import yaml

    text = (ROOT / "docs" / "examples.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| [`embedded_default.yaml`]"))
    steps = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) steps", row)]
    recipe = yaml.safe_load((RECIPES / "embedded_default.yaml").read_text())
    assert steps == [recipe["max_steps"]], row
    header = (RECIPES / "embedded_default.yaml").read_text().split("\n\n")[0]
    assert f"{recipe['max_steps']} steps of" in header
