"""``python -m kairos.profiling collect|fit|show|check ...``: the same subcommands as ``kairos profile``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kairos.profiling.cli import add_subcommands, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kairos.profiling", description="Kairos profiling: collect | fit | show | check"
    )
    add_subcommands(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return int(exc.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
