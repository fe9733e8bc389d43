"""The ``trl-costaware`` command: ``trl-costaware train ...`` and ``trl-costaware compare RUN [RUN ...]``."""

from __future__ import annotations

import sys

USAGE = """usage: trl-costaware {train,compare} ...

commands:
  train     train with CostAwareGRPOTrainer (trl-costaware train --help)
  compare   compare runs by reward against tokens; tokens saved to reach the baseline's peak, when the
            baseline improved beyond noise (trl-costaware compare --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if argv[0] in ("-V", "--version"):
        from .._version import __version__

        print(f"trl-costaware {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "compare":
        from ..tracking.compare import main as compare_main

        return compare_main(rest)
    if command == "train":
        try:
            from .train import main as train_main
        except ImportError as err:
            if err.name == f"{__package__}.train":
                print("error: the train command is not available in this installation", file=sys.stderr)
                return 2
            raise
        result = train_main(rest, prog="trl-costaware train")
        return result if isinstance(result, int) else 0
    print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
