"""Tests of the benchmark scripts (run by `make test` beside tests/): the same offline setup and fixtures as
tests/conftest.py, benchmarks/ on the import path so that a test imports a script by its name (``import
cost_aware_sgd``), and tests/ so that it imports the shared factories (``from testing_utils import make_config``).
No ``__init__.py`` here: a test file must not share its name with one in tests/."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

_spec = importlib.util.spec_from_file_location("_trl_costaware_tests_conftest", ROOT / "tests" / "conftest.py")
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)  # sets the offline environment before anything imports wandb or the hub

embedded_cache = _shared.embedded_cache
tiny_model_path = _shared.tiny_model_path
warm_model_path = _shared.warm_model_path
dataset = _shared.dataset
pytest_configure = _shared.pytest_configure
