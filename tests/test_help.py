"""`--help` of every entry point and script exits 0, and every config field's help formats under argparse.

argparse %-formats each help string (`%(default)s`, ...), so a bare `%` in a field's help (e.g. "55%,") crashes
`--help` of every parser built from the config: `trl-costaware train --help`, the example script, TRL's own parsers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = str(Path(sys.executable).parent / "trl-costaware")

# Every command a user types with --help. Keep in step with the completeness checks below.
COMMANDS = {
    "trl-costaware --help": [CLI, "--help"],
    "trl-costaware train --help": [CLI, "train", "--help"],
    "trl-costaware compare --help": [CLI, "compare", "--help"],
    "python -m trl_costaware.scripts.cli train --help": [
        sys.executable,
        "-m",
        "trl_costaware.scripts.cli",
        "train",
        "--help",
    ],
    "python -m trl_costaware.scripts.train --help": [sys.executable, "-m", "trl_costaware.scripts.train", "--help"],
    "python -m trl_costaware.tracking.compare --help": [
        sys.executable,
        "-m",
        "trl_costaware.tracking.compare",
        "--help",
    ],
    "python -m trl_costaware.scripts.demo --help": [sys.executable, "-m", "trl_costaware.scripts.demo", "--help"],
    "python -m trl_costaware.embedded.diagnose --help": [
        sys.executable,
        "-m",
        "trl_costaware.embedded.diagnose",
        "--help",
    ],
    "python -m trl_costaware.embedded.rebuild --help": [
        sys.executable,
        "-m",
        "trl_costaware.embedded.rebuild",
        "--help",
    ],
    "python examples/train_cost_aware_grpo.py --help": [
        sys.executable,
        str(ROOT / "examples" / "train_cost_aware_grpo.py"),
        "--help",
    ],
    "python examples/quickstart.py --help": [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--help"],
}
# Scripts that take no arguments at all (not even --help): none today.
NO_ARGUMENTS: set[str] = set()
# No network: the hub offline, and every HTTP(S) request sent to a closed local port (refused at once).
DEAD_PROXY = "http://127.0.0.1:9"
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HTTP_PROXY": DEAD_PROXY,
    "HTTPS_PROXY": DEAD_PROXY,
    "http_proxy": DEAD_PROXY,
    "https_proxy": DEAD_PROXY,
    "NO_PROXY": "",
    "no_proxy": "",
}


def _run_help(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", **OFFLINE)
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_exits_zero(name):
    result = _run_help(COMMANDS[name])
    assert result.returncode == 0, f"{name}: rc {result.returncode}\n{result.stderr[-3000:]}"
    assert "usage" in result.stdout.lower(), f"{name} printed no usage:\n{result.stdout[:2000]}"


@pytest.mark.parametrize(
    "name, usage",
    [
        ("trl-costaware train --help", "usage: trl-costaware train [-h] "),
        ("python -m trl_costaware.scripts.cli train --help", "usage: trl-costaware train [-h] "),
        ("python examples/train_cost_aware_grpo.py --help", "usage: train_cost_aware_grpo.py [-h] "),
        ("python examples/quickstart.py --help", "usage: accelerate launch examples/quickstart.py"),
    ],
)
def test_usage_line_names_the_command(name, usage):
    """The usage line is the command the user typed: `trl-costaware train`, not `trl-costaware`."""
    result = _run_help(COMMANDS[name])
    assert result.returncode == 0, result.stderr[-3000:]
    line = next((line for line in result.stdout.splitlines() if line.startswith("usage:")), "")
    assert line.startswith(usage), result.stdout[:300]


def test_quickstart_help_touches_neither_the_hub_nor_torch():
    """`examples/quickstart.py --help` answers before the script's imports (datasets, TRL): nothing is downloaded."""
    probe = (
        "import runpy, sys\nsys.argv = ['quickstart.py', '--help']\n"
        f"try:\n    runpy.run_path({str(ROOT / 'examples' / 'quickstart.py')!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    print('exit', e.code)\n"
        "print('imported', sorted(m for m in ('datasets', 'torch', 'trl', 'huggingface_hub') if m in sys.modules))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", **OFFLINE)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert "imported []" in result.stdout.splitlines(), result.stdout + result.stderr[-3000:]
    assert {"exit 0", "exit None"} & set(result.stdout.splitlines()), result.stdout


def test_every_script_and_module_main_is_checked():
    """A new example script or `python -m` module must be added to COMMANDS (or NO_ARGUMENTS)."""
    named = " ".join(COMMANDS)
    for script in sorted((ROOT / "examples").glob("*.py")):
        rel = script.relative_to(ROOT).as_posix()
        assert rel in NO_ARGUMENTS or rel in named, f"{rel} has no --help check in tests/test_help.py"
    for module in sorted((ROOT / "trl_costaware").rglob("*.py")):
        text = module.read_text()
        if module.name == "__main__.py":
            dotted = ".".join(module.relative_to(ROOT).with_suffix("").parts[:-1])
        elif '__name__ == "__main__"' in text:
            dotted = ".".join(module.relative_to(ROOT).with_suffix("").parts)
        else:
            continue
        assert f"-m {dotted} " in named or dotted == "trl_costaware.scripts.cli", (
            f"python -m {dotted} has no --help check in tests/test_help.py"
        )


def _parsers():
    from transformers import HfArgumentParser
    from trl import ModelConfig, TrlParser

    from trl_costaware import CostAwareGRPOConfig
    from trl_costaware.scripts.train import CostAwareScriptArguments

    return {
        "HfArgumentParser(CostAwareGRPOConfig)": HfArgumentParser(CostAwareGRPOConfig),
        "TrlParser(script, config, model)": TrlParser((CostAwareScriptArguments, CostAwareGRPOConfig, ModelConfig)),
    }


@pytest.mark.parametrize("which", ["HfArgumentParser(CostAwareGRPOConfig)", "TrlParser(script, config, model)"])
def test_config_parsers_format_help(which):
    import dataclasses

    from trl_costaware import CostAwareGRPOConfig

    text = _parsers()[which].format_help()
    for field in dataclasses.fields(CostAwareGRPOConfig):
        if field.name.startswith("cost_aware"):
            assert f"--{field.name}" in text, field.name


def test_every_cost_aware_field_help_formats():
    """Each cost_aware field's help %-formats with the dict argparse gives it (HelpFormatter._expand_help)."""
    import dataclasses

    from trl_costaware import CostAwareGRPOConfig

    parser = _parsers()["HfArgumentParser(CostAwareGRPOConfig)"]
    actions = {action.dest: action for action in parser._actions}
    fields = [f.name for f in dataclasses.fields(CostAwareGRPOConfig) if f.name.startswith("cost_aware")]
    assert fields
    for name in fields:
        action = actions[name]
        params = dict(vars(action), prog=parser.prog)
        for key in list(params):
            if params[key] is argparse.SUPPRESS:
                del params[key]
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        try:
            action.help % params
        except (ValueError, TypeError, KeyError) as err:
            pytest.fail(f"help of {name} does not %-format under argparse: {err}\n{action.help!r}")
