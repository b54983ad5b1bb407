"""Every benchmark runs as ``python -m bench.<kind>.<name>`` from the repository root: its
imports resolve without a ``sys.path`` insertion and its command line parses (``--help`` exits
0), so a module broken by a move or a renamed import fails here rather than on the next run."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.bench_modules import ROOT, bench_modules, runnable_bench_modules

RUNNABLE = runnable_bench_modules()
HELP_TIMEOUT_S = 120  # an import of the whole stack on a starved machine; nothing is timed


def test_the_walk_reaches_every_file_under_bench() -> None:
    files = {p.resolve() for p in (ROOT / "bench").rglob("*.py") if p.name != "__init__.py"}
    reached = {p.resolve() for p in bench_modules().values()}
    assert files - reached == set(), "bench/ folders need an __init__.py to be run with python -m"
    assert len(RUNNABLE) >= 20


@pytest.mark.parametrize("module", RUNNABLE)
def test_a_benchmark_runs_as_a_module(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HELP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"python -m {module} --help exited {done.returncode}:\n{done.stderr[-2000:]}"
    assert done.stdout.startswith("usage:"), done.stdout[:500]
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    assert not re.search(r"sys\.path\.(?:insert|append)\(", source), f"{module} edits sys.path"
