"""The `trl-costaware` command: fast start for --help/--version/compare, and `train`'s refusals before any load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")


def _modules_after(code: str) -> list[str]:
    """The heavy modules imported by running `code` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cli(*argv: str) -> str:
    return (
        "import contextlib, io\nfrom trl_costaware.scripts.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main({list(argv)!r})"
    )


def test_package_import_is_lazy():
    """`import trl_costaware` imports none of torch/transformers/TRL (as TRL's own lazy __init__)."""
    assert _modules_after("import trl_costaware") == []


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_nothing_heavy(argv):
    assert _modules_after(_cli(*argv)) == []


def test_compare_help_imports_nothing_heavy():
    """`trl-costaware compare` reads JSON records: it needs neither torch nor transformers."""
    assert _modules_after(_cli("compare", "--help")) == [], (
        "trl_costaware.tracking.compare imports trl_costaware.tracking.callbacks (transformers) for its record names"
    )


def test_lazy_attributes_resolve():
    import trl_costaware

    assert trl_costaware.CostAwareGRPOTrainer.__name__ == "CostAwareGRPOTrainer"
    assert trl_costaware.CostAwareGRPOConfig.__name__ == "CostAwareGRPOConfig"
    assert {"CostAwareGRPOConfig", "CostAwareGRPOTrainer", "__version__"} <= set(dir(trl_costaware))
    with pytest.raises(AttributeError, match="no_such_name"):
        trl_costaware.no_such_name  # noqa: B018


def test_version_prints_the_package_version(capsys):
    import trl_costaware
    from trl_costaware.scripts.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"trl-costaware {trl_costaware.__version__}"


# ---------------------------------------------------------------------------------------------------- train refusals
COMMON = ["--bf16", "false", "--report_to", "none", "--use_cpu", "true"]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if the built-in model is built or the trainer constructed."""
    from trl_costaware import trainer as trainer_module
    from trl_costaware.embedded import warmup

    def built(*args, **kwargs):
        raise AssertionError("the built-in model was built")

    class Constructed:
        def __init__(self, *args, **kwargs):
            raise AssertionError("the trainer (and so the model) was constructed")

    monkeypatch.setattr(warmup, "warmed_up_model_path", built)
    monkeypatch.setattr(trainer_module, "CostAwareGRPOTrainer", Constructed)


def test_train_without_a_model_refuses(tmp_path, nothing_loads, capsys):
    """As `trl grpo`: no --model_name_or_path, no silent toy model. A usage error of `trl-costaware train` (exit 2,
    no traceback), raised as the arguments are parsed."""
    from trl_costaware.scripts.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", *COMMON, "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trl-costaware train ")
    assert "trl-costaware train: error: --model_name_or_path is required" in err and "--embedded_default true" in err


@pytest.mark.parametrize("where", ["flag", "flag=value", "yaml"])
def test_train_refuses_an_unknown_field_naming_it(tmp_path, nothing_loads, where):
    """A field the config does not have (here one that was removed) is refused by TRL's parser, naming it, on the
    command line and in the recipe's YAML, before anything loads."""
    from trl_costaware.scripts.cli import main

    extra = {
        "flag": ["--cost_aware_layout", "even"],
        "flag=value": ["--cost_aware_layout=even"],
        "yaml": ["--config", str(tmp_path / "recipe.yaml")],
    }[where]
    (tmp_path / "recipe.yaml").write_text("embedded_default: true\ncost_aware_layout: even\n")
    with pytest.raises(ValueError, match="cost_aware_layout"):
        main(["train", *COMMON, "--output_dir", str(tmp_path), *extra])


def test_a_trailing_config_flag_is_a_usage_error(tmp_path, nothing_loads, capsys):
    """`--config` with no path is a usage error, not an IndexError (in TRL's parser)."""
    from trl_costaware.scripts.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", *COMMON, "--output_dir", str(tmp_path), "--config"])
    assert exit_info.value.code == 2
    assert "argument --config: expected one argument" in capsys.readouterr().err


def test_train_without_a_model_refuses_before_the_trainer_is_imported():
    """The refusal comes from parsing, before `trl_costaware.trainer` (and TRL's GRPOTrainer) is imported: the
    command answers in the time `--help` takes, not 20 s later."""
    probe = (
        "import sys\nfrom trl_costaware.scripts.cli import main\n"
        "try:\n    main(['train', '--bf16', 'false', '--report_to', 'none', '--output_dir', 'unused'])\n"
        "except SystemExit as e:\n    print('exit', e.code)\n"
        "heavy = ('trl_costaware.trainer', 'trl.trainer.grpo_trainer')\n"
        "print('imported', sorted(m for m in heavy if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    out = result.stdout.splitlines()
    assert "exit 2" in out, result.stdout + result.stderr[-3000:]
    assert "imported []" in out
    assert "error: --model_name_or_path is required" in result.stderr and "Traceback" not in result.stderr


def test_build_trainer_without_a_model_refuses(tmp_path, nothing_loads):
    """The library path (arguments built without `parse_args`'s check) refuses the same way, as a ValueError."""
    from trl_costaware.scripts import train as train_script

    args = train_script.make_parser().parse_args_and_config([*COMMON, "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--model_name_or_path is required.*--embedded_default"):
        train_script.build_trainer(*args)


def test_cli_default_model_path_trains_the_built_in_model(tmp_path, monkeypatch, tiny_model_path):
    """`trl-costaware train --embedded_default true` (no --model_name_or_path, no --dataset_name): the built-in model
    goes to the trainer with the built-in task and its reward."""
    from trl_costaware import trainer as trainer_module
    from trl_costaware.embedded import warmup
    from trl_costaware.scripts.cli import main

    seen = {}

    class Stop(Exception):
        pass

    class Recorded:
        def __init__(self, model, reward_funcs, train_dataset, **kwargs):
            seen.update(model=model, rewards=[f.__name__ for f in reward_funcs], columns=train_dataset.column_names)
            raise Stop

    monkeypatch.setattr(warmup, "warmed_up_model_path", lambda seed=0: tiny_model_path)
    monkeypatch.setattr(trainer_module, "CostAwareGRPOTrainer", Recorded)
    with pytest.raises(Stop):
        main(["train", *COMMON, "--output_dir", str(tmp_path), "--embedded_default", "true"])
    assert seen["model"] == tiny_model_path
    assert seen["rewards"] == ["arithmetic_reward"]
    assert "prompt" in seen["columns"] and "answer" in seen["columns"]


def test_train_command_unavailable_says_so(monkeypatch, capsys):
    """An installation without the train script: one line, exit 2 (the import name is the reorganised module's)."""
    from trl_costaware.scripts.cli import main

    monkeypatch.setitem(sys.modules, "trl_costaware.scripts.train", None)  # makes the import raise ImportError
    assert main(["train", "--help"]) == 2
    assert capsys.readouterr().err.strip() == "error: the train command is not available in this installation"


def test_embedded_default_with_a_model_refuses(tmp_path, nothing_loads, capsys):
    from trl_costaware.scripts.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "train",
                *COMMON,
                "--output_dir",
                str(tmp_path),
                "--embedded_default",
                "true",
                "--model_name_or_path",
                "x",
            ]
        )
    assert exit_info.value.code == 2
    assert "error: --embedded_default trains the built-in tiny model; it cannot be combined" in capsys.readouterr().err


def test_embedded_default_trains_the_built_in_model(tmp_path, monkeypatch, tiny_model_path):
    """--embedded_default: the built-in model is the one handed to the trainer."""
    from trl_costaware import trainer as trainer_module
    from trl_costaware.embedded import warmup
    from trl_costaware.scripts import train as train_script

    seen = {}

    class Recorded:
        def __init__(self, model, **kwargs):
            seen["model"] = model

    monkeypatch.setattr(warmup, "warmed_up_model_path", lambda seed=0: tiny_model_path)
    monkeypatch.setattr(trainer_module, "CostAwareGRPOTrainer", Recorded)
    args = train_script.parse_args([*COMMON, "--output_dir", str(tmp_path), "--embedded_default", "true"])
    train_script.build_trainer(*args)
    assert seen["model"] == tiny_model_path


def test_multimodal_model_refused_before_it_loads(tmp_path, monkeypatch, nothing_loads):
    """A model whose processor is multimodal is refused from its processor files, before the weights load."""
    import transformers
    from transformers import ProcessorMixin

    class VisionProcessor(ProcessorMixin):
        pass

    def from_pretrained(model_id, **kwargs):
        return object.__new__(VisionProcessor)

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", from_pretrained)
    from trl_costaware.scripts.cli import main

    argv = ["train", *COMMON, "--output_dir", str(tmp_path), "--model_name_or_path", "some/vlm"]
    with pytest.raises(NotImplementedError, match="multimodal processor .*VisionProcessor"):
        main(argv)
