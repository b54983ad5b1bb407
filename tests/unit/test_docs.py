"""The documentation keeps its own rules, checked rather than trusted:

- every figure on a measurement page (docs/measurements/YYYY-MM-DD-*.md) is in a committed JSON
  the page names, to the digits the page shows; each page names its JSON and the command that
  reproduces it, and is dated by one of its runs;
- the README is a user's guide of at most 450 lines; the metric names it gives are the code's;
  the repository paths it gives exist;
- bench/README.md maps every benchmark module and every committed result file;
- every relative link of the README, bench/README.md and docs/ leads to a file.

Files only: nothing is run.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.bench_modules import runnable_bench_modules

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
MEASUREMENTS = ROOT / "docs" / "measurements"
RESULTS = ROOT / "bench" / "results"
README_MAX_LINES = 450

_DATED_PAGE = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$")
_RESULT_PATH = re.compile(r"bench/results/([A-Za-z0-9_.\-]+\.json)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
# Not figures: dates and clock times (a run's name), equation and section numbers (the paper's).
_NOT_FIGURES = re.compile(
    r"\d{4}-\d{2}-\d{2}(?:[ T]\d{2}:\d{2}(?::\d{2})?Z?)?"  # a date, with its time
    r"|\b\d{1,2}:\d{2}(?::\d{2})?\b"  # a clock time
    r"|Eqs?\.\s*\d+(?:\s*(?:-|and|,)\s*\d+)*"  # Eq. 7, Eqs. 4-6
    r"|§\s*\d+(?:\.\d+)*"  # §4.3
)
_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
# Units a figure may carry glued to it (1.44x, 95%); any other letter glued on makes a name (2P2D).
_GLUED_UNITS = ("x", "%")
# A figure may be shown in another unit than its JSON's: s as ms or µs, a fraction as a percent.
_SCALES = (1.0, 100.0, 1e3, 1e6, 1e-3, 1e-6)


def prose(markdown: str) -> str:
    """The text a reader takes figures from: no code blocks or spans, no link targets, no dates."""
    text = _FENCE.sub(" ", markdown)
    text = _CODE_SPAN.sub(" ", text)
    text = _LINK_TARGET.sub("]", text)
    return _NOT_FIGURES.sub(" ", text)


def figures(text: str) -> Iterator[tuple[str, float, int, bool]]:
    """Each figure of ``text`` (already ``prose``): (as written, value, decimals, signed). A sign
    counts only where it is not a range's dash (``0.66-0.74`` is two unsigned figures)."""
    for m in _NUMBER.finditer(text):
        start, end = m.span()
        before = text[start - 1] if start else " "
        if before.isalnum() or before in "._/\\":
            continue  # part of a name: p99, seed1, v0.32, a path
        after = text[end : end + 2]
        if after[:1].isalpha() and not (after[0] in _GLUED_UNITS and not after[1:2].isalpha()):
            continue  # 2P2D, 10K: a name or a label, not a figure
        written = m.group()
        value = float(written.replace(",", ""))
        decimals = len(written.split(".")[1]) if "." in written else 0
        signed = before in "-+−" and (start < 2 or not text[start - 2].isalnum())
        if signed and before in "-−":
            value = -value
        yield (before if signed else "") + written, value, decimals, signed


def _numbers_in(value: object) -> Iterator[float]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int | float):
        if math.isfinite(value):
            yield float(value)
    elif isinstance(value, str):
        for m in _NUMBER.finditer(value):
            yield float(m.group().replace(",", ""))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers_in(k)
            yield from _numbers_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers_in(v)


class JsonFigures:
    """Every number of some JSON documents, in every unit a page may show it in, searchable."""

    def __init__(self, documents: list[object]) -> None:
        raw = {x for doc in documents for x in _numbers_in(doc)}
        self.signed = sorted(x * f for x in raw for f in _SCALES)
        self.unsigned = sorted({abs(x) for x in self.signed})

    def holds(self, value: float, decimals: int, signed: bool) -> bool:
        """True when some number, rounded to ``decimals``, reads ``value``."""
        half = 0.5 * 10.0**-decimals
        tolerance = half * (1 + 1e-9) + 1e-12 * abs(value)
        values, target = (self.signed, value) if signed else (self.unsigned, abs(value))
        i = bisect.bisect_left(values, target - tolerance)
        return i < len(values) and values[i] <= target + tolerance


def unsupported_figures(markdown: str, documents: list[object]) -> list[str]:
    """The figures of ``markdown``'s prose that no number of ``documents`` reads as."""
    known = JsonFigures(documents)
    return [written for written, value, dec, signed in figures(prose(markdown)) if not known.holds(value, dec, signed)]


@cache
def _load(name: str) -> object:
    return json.loads((RESULTS / name).read_text())


def _measurement_pages() -> list[Path]:
    return sorted(p for p in MEASUREMENTS.glob("*.md") if _DATED_PAGE.match(p.name))


PAGES = _measurement_pages()


def test_there_are_measurement_pages() -> None:
    assert len(PAGES) >= 10, f"docs/measurements holds {len(PAGES)} dated pages"
    undated = sorted(p.name for p in MEASUREMENTS.glob("*.md") if not _DATED_PAGE.match(p.name))
    assert not undated, f"measurement pages are named YYYY-MM-DD-topic.md: {undated}"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_a_measurement_page_names_its_json_and_command(page: Path) -> None:
    text = page.read_text()
    names = sorted(set(_RESULT_PATH.findall(text)))
    assert names, f"{page.name} names no bench/results/*.json"
    missing = [n for n in names if not (RESULTS / n).is_file()]
    assert not missing, f"{page.name} names result files that are not committed: {missing}"
    commands = [
        line
        for block in _FENCE.findall(text)
        for line in block.splitlines()
        if re.match(r"^\s*(?:\.venv/bin/)?(?:python \S*bench/|python -m bench\.|kairos )", line)
    ]
    assert commands, f"{page.name} gives no command (python -m bench.<kind>.<name> or kairos ...) in a code block"
    dates = {str(doc["when"])[:10] for doc in map(_load, names) if isinstance(doc, dict) and "when" in doc}
    if dates:
        page_date = _DATED_PAGE.match(page.name).group(1)  # type: ignore[union-attr]
        assert page_date in dates, f"{page.name}: dated by none of its runs ({sorted(dates)})"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_figure_on_a_measurement_page_is_in_its_json(page: Path) -> None:
    text = page.read_text()
    documents = [_load(n) for n in sorted(set(_RESULT_PATH.findall(text))) if (RESULTS / n).is_file()]
    missing = unsupported_figures(text, documents)
    assert not missing, f"{page.name}: figures in no JSON it names: {missing}"


def test_the_figure_check_catches_a_figure_the_json_does_not_hold() -> None:
    doc = {"decode_nodes": 2, "p99_us": 73.324, "slo_attainment": 0.98143, "bias": -0.4385, "requests": 1382}
    good = "p99 73.3 µs (2 nodes, 2P2D), attainment 98.1% and 98.14%, bias -0.439, 1,382 requests, 0.98x"
    assert unsupported_figures(good, [doc]) == []
    assert unsupported_figures("p99 82.4 µs", [doc]) == ["82.4"]
    assert unsupported_figures("attainment 98.2%", [doc]) == ["98.2"]
    assert unsupported_figures("bias +0.439", [doc]) == ["+0.439"]
    assert unsupported_figures("1,383 requests", [doc]) == ["1,383"]
    # Code, dates, equation numbers and names are not figures.
    assert unsupported_figures("`--rps 6,7` on 2026-12-06 10:41, Eq. 7, §4.3, 1P1D, seed1", [doc]) == []
    # A range is two unsigned figures: its dash is no minus sign.
    assert unsupported_figures("73.3-98.1", [doc]) == []


# ---------------------------------------------------------------------------------------------
# The README
# ---------------------------------------------------------------------------------------------
_METRIC = re.compile(r"\bkairos_[a-z0-9_]*[a-z0-9]")
_METRIC_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
_CODE_DIRS = ("extproc", "nodeagent", "sim", "profiling", "kairos")
_REPO_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.*-]*)`")
# Paths the README names that are made at run time, not committed.
_RUNTIME_ROOTS = ("<workdir>", "WORKDIR", "/etc/", ".venv", "runs/", "plots/", "fresh-runs/")


@cache
def _source_text() -> str:
    return "\n".join(p.read_text() for d in _CODE_DIRS for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def test_the_readme_is_a_guide_of_at_most_450_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}: move detail to docs/)"


def test_every_metric_the_readme_names_is_defined_in_the_code() -> None:
    names = set(_METRIC.findall(README.read_text())) - {"kairos_step_budget_ms", "kairos_chunk_schedule"}
    assert len(names) >= 10, "the README lists the metrics an operator watches"
    source = _source_text()
    undefined = []
    for name in sorted(names):
        base = name
        for suffix in _METRIC_SUFFIXES:
            base = base.removesuffix(suffix)
        if f'"{base}"' not in source and f'"{base}_total"' not in source:
            undefined.append(name)
    assert not undefined, f"README.md names metrics no code defines: {undefined}"


def test_every_repository_path_the_readme_names_exists() -> None:
    paths = {m for m in _REPO_PATH.findall(README.read_text()) if not m.startswith(_RUNTIME_ROOTS)}
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not any(ROOT.glob(p.rstrip("/"))))
    assert not missing, f"README.md names paths that are not in the repository: {missing}"


# ---------------------------------------------------------------------------------------------
# bench/README.md and links
# ---------------------------------------------------------------------------------------------
def test_bench_readme_maps_every_benchmark_and_every_result_file() -> None:
    text = BENCH_README.read_text()
    modules = runnable_bench_modules()
    assert len(modules) >= 20, f"the walk of bench/ found only {modules}"
    unmapped = [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}(?![\w.])", text)]
    assert not unmapped, f"bench/README.md does not say what these modules answer: {unmapped}"
    results = sorted(p.name for p in RESULTS.rglob("*.json"))
    unlisted = [r for r in results if r not in text]
    assert not unlisted, f"bench/README.md lists neither a page nor an archive line for: {unlisted}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
DOCS = [README, BENCH_README, *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_relative_link_leads_to_a_file(doc: Path) -> None:
    targets = [t for t in _LINK.findall(doc.read_text()) if not re.match(r"^[a-z]+:", t)]
    broken = [t for t in targets if not (doc.parent / t).exists()]
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"
