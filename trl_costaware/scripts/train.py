"""Full Cost-Aware GRPO training script: any causal LM on any dataset with a prompt column.

    trl-costaware train --config examples/recipes/qwen2.5-0.5b-gsm8k-lora.yaml
    accelerate launch examples/train_cost_aware_grpo.py --config examples/recipes/qwen2.5-0.5b-gsm8k-lora.yaml
    trl-costaware train --config examples/recipes/embedded_default.yaml   # no download: tiny model and task

Arguments are the fields of `CostAwareScriptArguments` (below), `CostAwareGRPOConfig` (every `GRPOConfig` field plus
`cost_aware_*`) and TRL's `ModelConfig` (model id, dtype, LoRA); a YAML file given with ``--config`` sets defaults
that command-line flags override. ``--model_name_or_path`` is required, as for ``trl grpo``; ``--embedded_default``
trains the built-in warmed-up tiny model instead (no download). Without ``--dataset_name`` the built-in arithmetic
task (with its exact-match reward) is used.

The model is loaded the way TRL's own ``trl/scripts/grpo.py`` loads it: the trainer receives the model id and
``model_init_kwargs`` built from `ModelConfig`; LoRA comes from ``get_peft_config(model_args)``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from ..config import CostAwareGRPOConfig

logger = logging.getLogger(__name__)

EMBEDDED_EVAL_SEED = 12345  # the held-out seed of `trl_costaware.embedded.warmup.evaluate_accuracy`


@dataclass
class CostAwareScriptArguments(ScriptArguments):
    """Script arguments (TRL's `ScriptArguments`: ``dataset_name``, ``dataset_config``, ``dataset_train_split``,
    ``dataset_test_split``, ``dataset_streaming``, plus the fields below)."""

    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Dataset column holding the prompt (text or a list of chat messages); renamed to 'prompt'."},
    )
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column holding the reference answer, renamed to 'answer' for the accuracy rewards. None: "
            "use an 'answer' or 'solution' column as it is (GSM8K: 'answer'; MATH: 'solution')."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: math_accuracy, gsm8k_accuracy, format, boxed_format, arithmetic, "
            "arithmetic_format, or an import path 'module.function' / 'module:function'. Weights: "
            "--reward_weights. Default: arithmetic for the built-in task, math_accuracy otherwise."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Optional reward model (hub id or path), used in addition to the reward functions."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System prompt: a system message in chat format, else prepended to the prompt text."},
    )
    chat_format: bool | None = field(
        default=None,
        metadata={
            "help": "Wrap text prompts as chat messages so the tokenizer's chat template is applied. None: yes when a "
            "dataset is named and the tokenizer has a chat template."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows (after an optional shuffle)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep only the first N evaluation rows."})
    shuffle_before_select: bool = field(
        default=True, metadata={"help": "Shuffle (with --seed) before taking --max_train_samples rows."}
    )
    embedded_train_size: int = field(
        default=4096, metadata={"help": "Built-in task (no --dataset_name): number of training problems."}
    )
    embedded_eval_size: int = field(
        default=256, metadata={"help": "Built-in task: number of held-out problems (used when eval_strategy != no)."}
    )
    embedded_max_terms: int = field(default=4, metadata={"help": "Built-in task: most terms in a problem (1-6...)."})
    embedded_default: bool = field(
        default=False,
        metadata={
            "help": "Train the built-in warmed-up tiny model (no download) when --model_name_or_path is not given. "
            "Without it, --model_name_or_path is required."
        },
    )
    embedded_model_seed: int = field(
        default=0, metadata={"help": "Built-in model (--embedded_default): seed of the warmed-up tiny model."}
    )


def reward_registry() -> dict[str, Callable]:
    """Reward functions selectable by name with ``--reward_funcs``."""
    from ..embedded.arithmetic import arithmetic_format_reward, arithmetic_reward
    from ..rewards import boxed_format_reward, gsm8k_accuracy_reward, math_accuracy_reward, think_answer_format_reward

    return {
        "math_accuracy": math_accuracy_reward,
        "gsm8k_accuracy": gsm8k_accuracy_reward,
        "format": think_answer_format_reward,
        "think_answer_format": think_answer_format_reward,
        "boxed_format": boxed_format_reward,
        "arithmetic": arithmetic_reward,
        "arithmetic_format": arithmetic_format_reward,
    }


def resolve_reward_funcs(names: Sequence[str]) -> list[Callable]:
    """Reward functions for `names`: registry names or import paths ``module.function`` / ``module:function``."""
    registry = reward_registry()
    funcs = []
    for name in names:
        if name in registry:
            if name == "math_accuracy":
                from ..rewards import _require_math_verify

                _require_math_verify()  # fail here, before the model loads, not at the first reward call
            funcs.append(registry[name])
            continue
        if ":" in name:
            module_name, _, attr = name.partition(":")
        elif "." in name:
            module_name, _, attr = name.rpartition(".")
        else:
            raise ValueError(f"Unknown reward function {name!r}: expected one of {sorted(registry)} or 'module.func'")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # like TRL's grpo.py: local modules are importable
        try:
            funcs.append(getattr(importlib.import_module(module_name), attr))
        except (ImportError, AttributeError) as err:
            raise ValueError(f"Cannot load reward function {name!r}: {err}") from err
    return funcs


def make_parser(prog: str | None = None) -> TrlParser:
    """The script's parser; `prog` names the command in its usage line (default: the script's file name, as
    argparse does; ``trl-costaware train`` from the CLI)."""
    return TrlParser((CostAwareScriptArguments, CostAwareGRPOConfig, ModelConfig), prog=prog)


def model_choice_error(script_args: CostAwareScriptArguments, model_args: ModelConfig) -> str | None:
    """Why the model arguments name no model to train (`--model_name_or_path` / `--embedded_default`), else None."""
    if model_args.model_name_or_path is None and not script_args.embedded_default:
        return (
            "--model_name_or_path is required (a hub id or a local path), as for `trl grpo`. To train the built-in "
            "warmed-up tiny model instead, pass --embedded_default true (or `embedded_default: true` in the YAML, as "
            "in examples/recipes/embedded_default.yaml)."
        )
    if model_args.model_name_or_path is not None and script_args.embedded_default:
        return (
            "--embedded_default trains the built-in tiny model; it cannot be combined with --model_name_or_path "
            f"{model_args.model_name_or_path!r}"
        )
    return None


def parse_args(argv: Sequence[str] | None = None, prog: str | None = None):
    """(script_args, training_args, model_args) from `argv` (default ``sys.argv[1:]``), ``--config x.yaml`` included.

    Parsing loads nothing (no model, dataset or tokenizer), and checks no more than the dataclasses do: `main` refuses
    arguments that name no model to train (`model_choice_error`).
    """
    return _parse(make_parser(prog), argv)


def _parse(parser: TrlParser, argv: Sequence[str] | None):
    argv = list(argv) if argv is not None else sys.argv[1:]
    if argv and argv[-1] == "--config":  # TRL's parse_args_and_config reads argv[index + 1]: an IndexError
        parser.error("argument --config: expected one argument")
    return parser.parse_args_and_config(argv)


# ---------------------------------------------------------------------------------------------------- data
def _load_named_dataset(script_args: CostAwareScriptArguments):
    """A hub dataset id, a local dataset folder or data files (load_dataset), or a save_to_disk folder."""
    from datasets import load_dataset, load_from_disk

    name = script_args.dataset_name
    if os.path.isdir(name) and (
        os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(os.path.join(name, "state.json"))
    ):
        return load_from_disk(name)
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def _split(dataset, split: str):
    if hasattr(dataset, "keys"):  # DatasetDict / IterableDatasetDict
        if split not in dataset:
            raise ValueError(f"Split {split!r} not found; the dataset has {list(dataset.keys())}")
        return dataset[split]
    return dataset  # a single Dataset (save_to_disk of one split): used for training only


def _limit(ds, n: int | None, shuffle_seed: int | None):
    if ds is None or n is None:
        return ds
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed)
    if hasattr(ds, "select"):
        return ds.select(range(min(n, len(ds))))
    return ds.take(n)  # IterableDataset


def _has_chat_template(model_id: str, model_args: ModelConfig, trust_remote_code: bool) -> bool:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_id, revision=model_args.model_revision, trust_remote_code=trust_remote_code
        )
    except Exception as err:  # noqa: BLE001 - e.g. a processor-only model: let TRL decide later
        logger.warning("Could not load the tokenizer of %s to look for a chat template (%s)", model_id, err)
        return False
    return getattr(tokenizer, "chat_template", None) is not None


def prepare_dataset(ds, script_args: CostAwareScriptArguments, chat_format: bool):
    """Rename the prompt/answer columns to 'prompt'/'answer' and apply the system prompt / chat format."""
    if ds is None:
        return None
    columns = ds.column_names or []
    renames = {script_args.prompt_column: "prompt"}
    if script_args.answer_column is not None:
        renames[script_args.answer_column] = "answer"
    for src, dst in renames.items():
        if src == dst:
            continue
        if columns and src not in columns:
            raise ValueError(f"Column {src!r} not found; the dataset has columns {columns}")
        if dst in columns:
            ds = ds.remove_columns(dst)
        ds = ds.rename_column(src, dst)
        columns = ds.column_names or []
    if columns and "prompt" not in columns:
        raise ValueError(f"No prompt column: set --prompt_column to one of {columns}")
    system = script_args.system_prompt

    def to_prompt(prompt):
        if isinstance(prompt, list):  # already conversational
            if system and not (prompt and prompt[0].get("role") == "system"):
                return [{"role": "system", "content": system}, *prompt]
            return prompt
        if chat_format:
            head = [{"role": "system", "content": system}] if system else []
            return [*head, {"role": "user", "content": prompt}]
        return f"{system}\n\n{prompt}" if system else prompt

    if system or chat_format:
        ds = ds.map(lambda row: {"prompt": to_prompt(row["prompt"])})
    return ds


def load_datasets(script_args: CostAwareScriptArguments, training_args: CostAwareGRPOConfig, chat_format: bool):
    """(train_dataset, eval_dataset or None), limited and prepared."""
    want_eval = training_args.eval_strategy != "no"
    if script_args.dataset_name is None:
        from ..embedded.arithmetic import arithmetic_dataset

        kw = {"max_terms": script_args.embedded_max_terms, "conversational": False}
        train = arithmetic_dataset(script_args.embedded_train_size, seed=training_args.seed, **kw)
        evaluation = (
            arithmetic_dataset(script_args.embedded_eval_size, seed=EMBEDDED_EVAL_SEED, **kw) if want_eval else None
        )
    else:
        dataset = _load_named_dataset(script_args)
        train = _split(dataset, script_args.dataset_train_split)
        evaluation = (
            _split(dataset, script_args.dataset_test_split) if want_eval and hasattr(dataset, "keys") else None
        )
        if want_eval and evaluation is None:
            raise ValueError("eval_strategy is set but the dataset has no splits: set eval_strategy=no")
    shuffle = training_args.seed if script_args.shuffle_before_select else None
    train = _limit(train, script_args.max_train_samples, shuffle)
    evaluation = _limit(evaluation, script_args.max_eval_samples, None)
    return prepare_dataset(train, script_args, chat_format), prepare_dataset(evaluation, script_args, chat_format)


# ---------------------------------------------------------------------------------------------------- training
def build_trainer(script_args: CostAwareScriptArguments, training_args: CostAwareGRPOConfig, model_args: ModelConfig):
    """The `CostAwareGRPOTrainer` for parsed arguments (loads the model, tokenizer and datasets)."""
    from ..trainer import CostAwareGRPOTrainer

    if error := model_choice_error(script_args, model_args):  # arguments built without `parse_args`
        raise ValueError(error)
    embedded_model = model_args.model_name_or_path is None
    if script_args.reward_funcs:
        reward_names = list(script_args.reward_funcs)
    elif script_args.reward_model_name_or_path:
        reward_names = []
    else:
        reward_names = ["arithmetic"] if script_args.dataset_name is None else ["math_accuracy"]
    reward_funcs: list = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    reward_funcs += resolve_reward_funcs(reward_names)

    if embedded_model:
        from ..embedded.warmup import warmed_up_model_path

        model_id = warmed_up_model_path(seed=script_args.embedded_model_seed)
        logger.info("--embedded_default: training the built-in warmed-up tiny model at %s", model_id)
    else:
        model_id = model_args.model_name_or_path
    if training_args.cost_aware:
        refuse_multimodal(model_id, model_args, training_args)  # before the model (or any dataset) loads

    chat_format = script_args.chat_format
    if chat_format is None:
        chat_format = script_args.dataset_name is not None and _has_chat_template(
            model_id, model_args, training_args.trust_remote_code
        )
    train_dataset, eval_dataset = load_datasets(script_args, training_args, chat_format)
    _check_reference_column(reward_funcs, train_dataset)

    # As in TRL's grpo.py: the trainer loads the model from its id with these kwargs.
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    trainer = CostAwareGRPOTrainer(
        model=model_id,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    return trainer  # the trainer attaches the tracking callbacks itself (local record, W&B group and x-axis)


def refuse_multimodal(model_id: str, model_args: ModelConfig, training_args: CostAwareGRPOConfig) -> None:
    """Refuse a model with a multimodal processor under ``cost_aware=True``, from its processor files alone.

    Loads the processor as `GRPOTrainer` does (``AutoProcessor.from_pretrained``), which reads no weights; the trainer
    refuses the same models, but only once the model has loaded.
    """
    from transformers import AutoProcessor, ProcessorMixin

    processor = AutoProcessor.from_pretrained(
        model_id, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    if isinstance(processor, ProcessorMixin):
        raise NotImplementedError(
            f"cost_aware=True supports text-only models; {model_id} has a multimodal processor "
            f"({type(processor).__name__}) whose image tensors are not per-row. Set --cost_aware false to train it "
            "with plain GRPO."
        )


def _check_reference_column(reward_funcs, dataset) -> None:
    """Fail before loading the model when an accuracy reward has no reference column to read."""
    from ..rewards import gsm8k_accuracy_reward, math_accuracy_reward

    columns = set(getattr(dataset, "column_names", None) or [])
    needs = [f.__name__ for f in reward_funcs if f in (math_accuracy_reward, gsm8k_accuracy_reward)]
    if columns and needs and not columns & {"answer", "solution"}:
        raise ValueError(
            f"{needs} read the reference answer from an 'answer' or 'solution' column; the dataset has "
            f"{sorted(columns)}: set --answer_column"
        )


def train(script_args: CostAwareScriptArguments, training_args: CostAwareGRPOConfig, model_args: ModelConfig):
    """Build the trainer, train, save the model (and push it when ``push_to_hub``); return the trainer."""
    trainer = build_trainer(script_args, training_args, model_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers and the process group
        trainer.end()
    return trainer


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """Parse `argv` (default ``sys.argv[1:]``; ``--config x.yaml`` supported) and train. `prog`: the command named in
    the usage line (`make_parser`). Arguments that name no model to train (`model_choice_error`) are a usage error
    (exit 2), before the trainer's modules are imported."""
    parser = make_parser(prog)
    script_args, training_args, model_args = _parse(parser, argv)
    if error := model_choice_error(script_args, model_args):  # as parser.error, with a short usage (the full is long)
        parser.exit(
            2,
            f"usage: {parser.prog} [--config CONFIG.yaml] (--model_name_or_path MODEL | --embedded_default true) "
            f"[ARGS ...]\n       (every argument: {parser.prog} --help)\n{parser.prog}: error: {error}\n",
        )
    train(script_args, training_args, model_args)


if __name__ == "__main__":
    main()
