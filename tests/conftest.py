"""Shared test setup: offline, quiet, and one embedded-model cache per test session (shared by xdist workers)."""

import os
from pathlib import Path

import pytest

# Before anything imports wandb / huggingface_hub / tokenizers.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Set this to a directory to keep the embedded models between test sessions (faster local iterations).
PERSISTENT_CACHE_ENV = "TRL_COSTAWARE_TEST_CACHE"


def _session_cache_dir(tmp_path_factory) -> Path:
    if os.environ.get(PERSISTENT_CACHE_ENV):
        return Path(os.environ[PERSISTENT_CACHE_ENV])
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's basetemp is <session>/popen-gwN: share the session directory above it.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / "trl_costaware_cache"


@pytest.fixture(scope="session", autouse=True)
def embedded_cache(tmp_path_factory):
    """Points ``TRL_COSTAWARE_CACHE`` at a per-session directory, so the embedded models are built at most once
    per session (concurrent builders wait on a lock) and never land in ``~/.cache``."""
    path = _session_cache_dir(tmp_path_factory)
    path.mkdir(parents=True, exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("TRL_COSTAWARE_CACHE", str(path))
    yield str(path)
    mp.undo()


@pytest.fixture(scope="session")
def tiny_model_path(embedded_cache):
    """The random tiny model (seed 0): a directory `AutoModelForCausalLM`/`AutoTokenizer` load."""
    from trl_costaware.embedded import tiny_model_path as build

    return build(embedded_cache, seed=0)


@pytest.fixture(scope="session")
def warm_model_path(embedded_cache):
    """The SFT-warmed tiny model (seed 0, default steps), the embedded default policy."""
    from trl_costaware.embedded import warmed_up_model_path

    return warmed_up_model_path(embedded_cache, seed=0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one (`make test-gpu`)")
    config.addinivalue_line(
        "markers",
        "mc_full: Monte Carlo matrix at full K (~9000 draws a case, about 2 h on one core); `make test-all` only",
    )


@pytest.fixture(scope="session")
def dataset():
    """The suite's training prompts: 64 embedded arithmetic prompts (seed 0)."""
    from testing_utils import tiny_dataset

    return tiny_dataset()
