"""The optional dependencies. Each feature that needs one imports it through `require` when it runs, never at module
import, so the trainer, the config and the command's ``--help`` work without them."""

from __future__ import annotations

import importlib

# Top-level module -> the pyproject extra that installs it.
EXTRAS = {"wandb": "tracking", "matplotlib": "plots"}


def install_hint(module: str) -> str:
    return f"pip install 'trl-costaware[{EXTRAS[module.split('.')[0]]}]'"


def require(module: str, feature: str, alternative: str = ""):
    """Import `module` for `feature`, or raise ImportError naming the extra that installs it (and `alternative`)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        hint = f", or {alternative}" if alternative else ""
        raise ImportError(f"{feature} needs {top}: {install_hint(top)}{hint} ({err})") from err
