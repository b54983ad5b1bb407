"""Argument types shared by the command lines (``kairos`` and ``kairos profile``)."""

from __future__ import annotations

import argparse


def floats(text: str) -> tuple[float, ...]:
    """``"6,7,8"`` -> ``(6.0, 7.0, 8.0)``."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def ints(text: str) -> tuple[int, ...]:
    """``"2048,1024"`` -> ``(2048, 1024)``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
