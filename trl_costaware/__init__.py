"""trl-costaware: Cost-Aware GRPO for TRL (Mohri et al., "Cost-Aware Learning", arXiv 2604.28020)."""

from ._compat import TESTED_TRL_RANGE, check_trl_version

__version__ = "0.1.0"

check_trl_version()

__all__ = ["TESTED_TRL_RANGE", "check_trl_version", "__version__"]
