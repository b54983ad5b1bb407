"""The benchmarks as the suite finds them: every module of the ``bench`` package, found by walking
it, and those that run as ``python -m bench.<kind>.<name>`` (a ``__main__`` block)."""

from __future__ import annotations

import importlib.util
import pkgutil
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parents[1]
_MAIN_BLOCK = 'if __name__ == "__main__":'


def bench_modules() -> dict[str, Path]:
    """Every module under bench/ reached by walking the package (a folder without an
    ``__init__.py`` is not reached), by dotted name, with its file."""
    found: dict[str, Path] = {}
    for info in pkgutil.walk_packages(bench.__path__, "bench."):
        spec = importlib.util.find_spec(info.name)
        if spec is not None and spec.origin is not None and not info.ispkg:
            found[info.name] = Path(spec.origin)
    return found


def runnable_bench_modules() -> list[str]:
    """The modules a user runs with ``python -m``: the benchmarks and the servers they start."""
    return sorted(name for name, path in bench_modules().items() if _MAIN_BLOCK in path.read_text())
