"""trl-costaware: Cost-Aware GRPO for TRL (Mohri et al., "Cost-Aware Learning", arXiv 2604.28020)."""

from ._compat import TESTED_TRL_RANGE, check_trl_version

__version__ = "0.1.0"

check_trl_version()

from .config import CostAwareGRPOConfig  # noqa: E402
from .trainer import CostAwareGRPOTrainer  # noqa: E402

__all__ = ["TESTED_TRL_RANGE", "CostAwareGRPOConfig", "CostAwareGRPOTrainer", "__version__", "check_trl_version"]
