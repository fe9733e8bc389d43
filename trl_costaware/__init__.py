"""trl-costaware: Cost-Aware GRPO for TRL (Mohri et al., "Cost-Aware Learning", arXiv 2604.28020).

The trainer and its config are imported on first use (module ``__getattr__``, as TRL does), so that
``import trl_costaware`` and the ``trl-costaware`` command's ``--help``, ``--version`` and ``compare`` start without
importing torch, transformers or TRL. Importing the config (directly or through the trainer) checks the installed TRL
version against `TESTED_TRL_RANGE`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._compat import TESTED_TRL_RANGE, check_trl_version
from ._version import __version__

_LAZY = {"CostAwareGRPOConfig": ".config", "CostAwareGRPOTrainer": ".trainer"}

if TYPE_CHECKING:  # pragma: no cover
    from .config import CostAwareGRPOConfig
    from .trainer import CostAwareGRPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "TESTED_TRL_RANGE",
    "CostAwareGRPOConfig",
    "CostAwareGRPOTrainer",
    "__version__",
    "check_trl_version",
]
