"""Version guard: we test against one TRL range and say so loudly outside it."""

import warnings

from packaging.version import Version

# The TRL releases the test suite runs against. The trainer post-processes TRL's private
# `_generate_and_score_completions` / `_prepare_inputs` outputs, whose layout drifts between releases.
TESTED_TRL_RANGE = (">=1.16.0", "<1.17.0")
_MIN, _MAX = Version("1.16.0"), Version("1.17.0")


def check_trl_version(version: str | None = None) -> bool:
    """Warn (once per call) when the installed TRL is outside `TESTED_TRL_RANGE`; return whether it is inside."""
    if version is None:
        import trl

        version = trl.__version__
    inside = _MIN <= Version(version) < _MAX
    if not inside:
        warnings.warn(
            f"trl-costaware is tested with trl{','.join(TESTED_TRL_RANGE)}, but trl=={version} is installed. "
            "CostAwareGRPOTrainer post-processes GRPOTrainer internals that change between TRL releases; "
            f"install a tested version with `pip install 'trl{','.join(TESTED_TRL_RANGE)}'`.",
            UserWarning,
            stacklevel=2,
        )
    return inside
