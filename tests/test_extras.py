"""The optional dependencies (pyproject's extras): the package works without wandb and matplotlib until a feature
needs one, that feature's error names the extra, and the package never imports pandas."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trl_costaware.tracking._extras import EXTRAS, install_hint, require

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_costaware"
OPTIONAL = ("wandb", "matplotlib", "pandas")


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name.split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        return [node.module.split(".")[0]]
    return []


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """Imports that run when the module is imported: everything outside function bodies."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        found += [(node.lineno, name) for name in _imports(node)]
        stack.extend(ast.iter_child_nodes(node))
    return found


def test_no_optional_dependency_is_imported_at_module_import():
    bad, pandas = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(ROOT)
        bad += [f"{rel}:{line} {name}" for line, name in _module_level_imports(tree) if name in OPTIONAL]
        pandas += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if "pandas" in _imports(n)]
    assert bad == []
    assert pandas == []  # not even inside a function: pandas is no dependency of ours (TRL brings its own)


def test_every_extra_named_in_an_error_exists_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        assert any(req.startswith(module) for req in extras[extra]), (module, extra)
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [req for req in core if req.split(">")[0].split("=")[0].strip() in OPTIONAL]


def test_require_names_the_extra(monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot"):  # import -> ImportError, even after another test imported it
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"^the figure needs matplotlib: pip install 'trl-costaware\[plots\]', or "):
        require("matplotlib.pyplot", "the figure", "skip it")
    assert install_hint("wandb.sdk") == "pip install 'trl-costaware[tracking]'"
    assert require("json", "anything") is sys.modules["json"]


# Run in a fresh interpreter in which wandb and matplotlib are not installed (a None entry in sys.modules is how
# Python marks a module absent: `import` raises and importlib.util.find_spec answers None, so transformers,
# accelerate and TRL see them as not installed) and in which trl_costaware may not import pandas (TRL imports it).
_SCRIPT = r"""
import builtins, contextlib, io, os, sys, tempfile, types

for name in ("wandb", "matplotlib"):
    sys.modules[name] = None
_import = builtins.__import__

def _guarded(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    if name.split(".")[0] == "pandas" and importer.startswith("trl_costaware"):
        raise ImportError(f"{importer} imports pandas")
    return _import(name, globals, locals, fromlist, level)

builtins.__import__ = _guarded

import trl_costaware
from trl_costaware import CostAwareGRPOConfig, CostAwareGRPOTrainer
import trl_costaware.tracking.callbacks, trl_costaware.tracking.compare
from trl_costaware.scripts import cli, demo, train

for argv in (["--help"], ["compare", "--help"], ["train", "--help"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    assert code in (0, None) and "usage" in out.getvalue(), (argv, code)
print("imports and --help: ok")
# Controls: the blockers do block.
for name, importer in (("wandb", "x"), ("matplotlib.pyplot", "x"), ("pandas", "trl_costaware.x")):
    try:
        exec(f"import {name}", {"__name__": importer})
    except ImportError:
        pass
    else:
        raise AssertionError(f"{name} was not blocked")

def expect(call, *needles):
    try:
        call()
    except Exception as err:
        assert all(n in str(err) for n in needles), (str(err), needles)
        print(type(err).__name__ + ":", err)
        return
    raise AssertionError(f"no error, expected {needles}")

from trl_costaware.tracking.callbacks import WandbTokenAxisCallback, validate_report_to
from trl_costaware.tracking.compare.plot import figure
from trl_costaware.tracking.compare.readers import CompareError, _wandb_api

expect(lambda: validate_report_to(types.SimpleNamespace(report_to=["wandb"])), "pip install 'trl-costaware[tracking]'")
expect(WandbTokenAxisCallback._wandb, "pip install 'trl-costaware[tracking]'")
os.environ.pop("WANDB_MODE", None)
expect(lambda: _wandb_api("entity/project/abc123"), "reading W&B runs needs wandb", "trl-costaware[tracking]")
expect(lambda: figure(None), "compare's plot needs matplotlib", "trl-costaware[plots]", "--no-plot")
err = io.StringIO()
with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(err):
    code = cli.main(["compare", tmp])
assert code == 2 and "pip install 'trl-costaware[plots]', or pass --no-plot" in err.getvalue(), (code, err.getvalue())
print("compare without --no-plot:", err.getvalue().strip())
with tempfile.TemporaryDirectory() as tmp:
    expect(lambda: demo.run_demo(steps=1, output_dir=tmp), "the demo's figure needs matplotlib", "[plots]")
    assert os.listdir(tmp) == []  # refused before anything ran
print("OK")
"""


def test_core_works_without_the_extras_and_features_name_them():
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.strip().endswith("OK"), proc.stdout
