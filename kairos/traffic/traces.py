"""Read, write and reshape request traces as ``list[RequestSpec]``.

Formats:

* ``jsonl`` (our own): one ``{"request_id", "arrival_s", "prompt_tokens", "output_tokens"}`` object per
  line, and where set, a conversation's ``session_id``, ``turn``, ``after`` and ``think_s`` and the
  prefix cache's ``block_hashes`` (see :class:`RequestSpec`). Arrival times are kept as written, so
  ``read_jsonl(write_jsonl(x)) == x``.
* ``azure``: the Azure LLM inference trace CSV (header ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  extra columns ignored) with timestamps like ``2023-11-16 18:15:46.6805900``.
* ``mooncake``: JSONL objects with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  optionally ``hash_ids`` (one id per 512-token block of the input, equal ids for equal prefixes),
  which become the engine's block hashes (:func:`mooncake_block_hashes`); other keys are ignored.

External traces are rebased so the earliest request arrives at 0 s and get ids ``f"{fmt}-{i:06d}"``
numbered in arrival order. In every format rows whose timestamps are out of order are *sorted*
(stably), not rejected: real traces are logged by several frontends and interleave slightly. Malformed
rows (missing field, non-numeric or non-integer value, token count < 1, bad timestamp, duplicate id)
raise :class:`TraceError` naming the file and line.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kairos.traffic.requests import BLOCK_TOKENS, RequestSpec, chain_hashes

__all__ = [
    "TRACE_FORMATS",
    "TraceError",
    "load_trace",
    "mooncake_block_hashes",
    "read_azure_csv",
    "read_jsonl",
    "read_mooncake_jsonl",
    "rescale_to_rate",
    "truncate",
    "write_jsonl",
]

PathLike = str | os.PathLike[str]

TRACE_FORMATS: tuple[str, ...] = ("jsonl", "azure", "mooncake")
_FORMAT_ALIASES = {"csv": "azure", "own": "jsonl"}

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_OWN_KEYS = ("request_id", "arrival_s", "prompt_tokens", "output_tokens")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_ids entry in Mooncake's traces
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")

# Date, time, optional fraction of 1-9 digits, optional zone (naive stamps are taken as UTC).
_TIMESTAMP_RE = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})[ T](?P<time>\d{2}:\d{2}:\d{2})"
    r"(?:\.(?P<frac>\d{1,9}))?(?P<tz>Z|[+-]\d{2}:?\d{2})?$"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class TraceError(ValueError):
    """A trace file that cannot be read; the message starts with ``path:line:``."""

    def __init__(self, path: PathLike, line: int | None, message: str) -> None:
        where = f"{os.fspath(path)}:{line}" if line is not None else os.fspath(path)
        super().__init__(f"{where}: {message}")
        self.path = os.fspath(path)
        self.line = line
        self.reason = message

    def __reduce__(self) -> tuple[type[TraceError], tuple[str, int | None, str]]:
        # Rebuild from the parts, not from ``args``, so the error survives multiprocessing pickling.
        return (TraceError, (self.path, self.line, self.reason))


# ---------------------------------------------------------------------------------------------------
# Own JSONL


def write_jsonl(path: PathLike, requests: Iterable[RequestSpec]) -> None:
    """Write one JSON object per request; floats use ``repr`` so they read back bit-identical."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            record: dict[str, Any] = {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
            }
            if r.session_id is not None:
                record.update(session_id=r.session_id, turn=r.turn)
            if r.after is not None:
                record.update(after=r.after, think_s=r.think_s)
            if r.block_hashes:
                record["block_hashes"] = list(r.block_hashes)
            f.write(json.dumps(record, allow_nan=False) + "\n")


def read_jsonl(path: PathLike) -> list[RequestSpec]:
    """Read our own JSONL trace, sorted by arrival (stable); ids must be unique."""
    rows: list[tuple[float, RequestSpec]] = []
    first_line: dict[str, int] = {}
    for lineno, obj in _json_objects(path):
        _require_keys(path, lineno, obj, _OWN_KEYS)
        request_id = obj["request_id"]
        if not isinstance(request_id, str) or not request_id:
            raise TraceError(path, lineno, f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in first_line:
            raise TraceError(
                path, lineno, f"duplicate request_id {request_id!r} (first on line {first_line[request_id]})"
            )
        first_line[request_id] = lineno
        arrival = float(_number(path, lineno, "arrival_s", obj["arrival_s"]))
        if arrival < 0:
            raise TraceError(path, lineno, f"arrival_s must be >= 0, got {arrival!r}")
        try:
            spec = RequestSpec(
                request_id=request_id,
                arrival_s=arrival,
                prompt_tokens=_token_count(path, lineno, "prompt_tokens", obj["prompt_tokens"]),
                output_tokens=_token_count(path, lineno, "output_tokens", obj["output_tokens"]),
                **_own_optional(path, lineno, obj),
            )
        except ValueError as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(path, lineno, str(exc)) from None
        rows.append((arrival, spec))
    return [spec for _, spec in sorted(rows, key=lambda row: row[0])]


def _own_optional(path: PathLike, lineno: int, obj: dict[str, Any]) -> dict[str, Any]:
    """The optional keys of our own JSONL, checked."""
    out: dict[str, Any] = {}
    for key in ("session_id", "after"):
        if key in obj:
            if not isinstance(obj[key], str) or not obj[key]:
                raise TraceError(path, lineno, f"{key} must be a non-empty string, got {obj[key]!r}")
            out[key] = obj[key]
    if "turn" in obj:
        out["turn"] = _token_count(path, lineno, "turn", obj["turn"])
    if "think_s" in obj:
        out["think_s"] = float(_number(path, lineno, "think_s", obj["think_s"]))
    if "block_hashes" in obj:
        hashes = obj["block_hashes"]
        if not isinstance(hashes, list) or not all(type(h) is int for h in hashes):
            raise TraceError(path, lineno, "block_hashes must be a list of integers")
        out["block_hashes"] = tuple(hashes)
    return out


# ---------------------------------------------------------------------------------------------------
# Mooncake JSONL


def mooncake_block_hashes(
    hash_ids: Sequence[int], input_tokens: int, block_tokens: int = BLOCK_TOKENS
) -> tuple[int, ...]:
    """The engine's block hashes for a Mooncake request: each 512-token block id stands for the
    ``512 / block_tokens`` engine blocks it covers (sub-block j of id h keyed ``(h, j)``, chained),
    as far as the input fills whole engine blocks. Equal id prefixes give equal hash prefixes."""
    per = MOONCAKE_BLOCK_TOKENS // block_tokens
    n = min(input_tokens // block_tokens, len(hash_ids) * per)
    return chain_hashes((hash_ids[i // per], i % per) for i in range(n))


def read_mooncake_jsonl(path: PathLike) -> list[RequestSpec]:
    """Read a Mooncake trace (``timestamp`` in ms); arrivals are rebased to the earliest request."""
    rows: list[tuple[int | float, int, int, tuple[int, ...]]] = []
    for lineno, obj in _json_objects(path):
        _require_keys(path, lineno, obj, _MOONCAKE_KEYS)
        timestamp_ms = _number(path, lineno, "timestamp", obj["timestamp"])
        input_tokens = _token_count(path, lineno, "input_length", obj["input_length"])
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or not all(type(h) is int for h in ids):
            raise TraceError(path, lineno, f"hash_ids must be a list of integers, got {ids!r}")
        rows.append(
            (
                timestamp_ms,
                input_tokens,
                _token_count(path, lineno, "output_length", obj["output_length"]),
                mooncake_block_hashes(ids, input_tokens),
            )
        )
    return _rebased(rows, units_per_s=1000, prefix="mooncake")


# ---------------------------------------------------------------------------------------------------
# Azure CSV


def read_azure_csv(path: PathLike) -> list[RequestSpec]:
    """Read an Azure LLM inference trace CSV; arrivals are seconds since the earliest row.

    Timestamps are parsed to integer nanoseconds before differencing, because float seconds since
    the epoch (~1.7e9) would round away the 100 ns resolution of the 7-digit fraction.
    """
    rows: list[tuple[int, int, int]] = []
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: tolerate an Excel BOM
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, 1, f"empty file, expected header {','.join(_AZURE_COLUMNS)}")
        names = [h.strip() for h in header]
        missing = [c for c in _AZURE_COLUMNS if c not in names]
        if missing:
            raise TraceError(path, 1, f"header {names} lacks column(s) {missing}")
        ts_col, ctx_col, gen_col = (names.index(c) for c in _AZURE_COLUMNS)
        width = max(ts_col, ctx_col, gen_col) + 1
        for row in reader:
            lineno = reader.line_num
            if not any(cell.strip() for cell in row):
                continue  # blank line, e.g. a trailing newline pair
            if len(row) < width:
                raise TraceError(path, lineno, f"expected at least {width} fields, got {len(row)}: {row}")
            rows.append(
                (
                    _parse_timestamp_ns(path, lineno, row[ts_col].strip()),
                    _csv_token_count(path, lineno, "ContextTokens", row[ctx_col]),
                    _csv_token_count(path, lineno, "GeneratedTokens", row[gen_col]),
                )
            )
    return _rebased(rows, units_per_s=1_000_000_000, prefix="azure")


def _parse_timestamp_ns(path: PathLike, lineno: int, text: str) -> int:
    match = _TIMESTAMP_RE.match(text)
    if match is None:
        raise TraceError(path, lineno, f"TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'")
    tz = match["tz"]
    try:
        moment = datetime.fromisoformat(f"{match['date']}T{match['time']}")
        if tz is None or tz == "Z":
            moment = moment.replace(tzinfo=UTC)
        else:
            sign = 1 if tz[0] == "+" else -1
            digits = tz[1:].replace(":", "")
            offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            moment = (moment - sign * offset).replace(tzinfo=UTC)
    except ValueError as exc:  # e.g. month 13
        raise TraceError(path, lineno, f"TIMESTAMP {text!r}: {exc}") from None
    delta = moment - _EPOCH
    whole_s = delta.days * 86_400 + delta.seconds
    frac_ns = int((match["frac"] or "0").ljust(9, "0"))
    return whole_s * 1_000_000_000 + frac_ns


def _csv_token_count(path: PathLike, lineno: int, field: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(path, lineno, f"{field} must be an integer, got {text!r}") from None
    return _token_count(path, lineno, field, value)


# ---------------------------------------------------------------------------------------------------
# Shared parsing helpers


def _json_objects(path: PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) per non-blank line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(path, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _require_keys(path: PathLike, lineno: int, obj: dict[str, Any], keys: Sequence[str]) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise TraceError(path, lineno, f"missing key(s) {missing}; expected {list(keys)}")


def _number(path: PathLike, lineno: int, field: str, value: object) -> int | float:
    """The JSON number as parsed; ints stay ints so millisecond differences are exact."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(path, lineno, f"{field} must be a finite number, got {value!r}")
    return value


def _token_count(path: PathLike, lineno: int, field: str, value: object) -> int:
    # Integral floats (e.g. 12.0 from a pandas export) are accepted; 12.5 is not.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, lineno, f"{field} must be an integer, got {value!r}")
    if value < 1:
        raise TraceError(path, lineno, f"{field} must be >= 1, got {value}")
    return value


def _rebased(rows: Sequence[tuple[Any, ...]], *, units_per_s: int, prefix: str) -> list[RequestSpec]:
    """Sort (stably) by raw timestamp, subtract the earliest, convert to seconds, number the ids.

    Differencing the raw integers first and dividing once gives the correctly rounded seconds.
    """
    if not rows:
        return []
    rows = sorted(rows, key=lambda row: row[0])
    start = rows[0][0]
    return [
        RequestSpec(
            request_id=f"{prefix}-{i:06d}",
            arrival_s=(row[0] - start) / units_per_s,
            prompt_tokens=row[1],
            output_tokens=row[2],
            block_hashes=row[3] if len(row) > 3 else (),
        )
        for i, row in enumerate(rows)
    ]


# ---------------------------------------------------------------------------------------------------
# Format detection and loading


def _detect_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            text = line.strip()
            if not text:
                continue
            if text.startswith("{"):
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(path, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})") from None
                if isinstance(obj, dict) and "request_id" in obj and "arrival_s" in obj:
                    return "jsonl"
                if isinstance(obj, dict) and "timestamp" in obj and "input_length" in obj:
                    return "mooncake"
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise TraceError(
                    path, lineno, f"cannot tell the JSONL flavour from keys {keys}; pass fmt='jsonl' or 'mooncake'"
                )
            if text.split(",")[0].strip() == "TIMESTAMP":
                return "azure"
            raise TraceError(path, lineno, "unrecognised trace format; pass fmt explicitly")
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"  # an empty JSONL trace is empty in either flavour
    raise TraceError(path, None, f"empty file, cannot detect its format; pass fmt (one of {TRACE_FORMATS})")


def load_trace(path: PathLike, fmt: str | None = None) -> list[RequestSpec]:
    """Load a trace in any supported format, sorted by arrival.

    ``fmt`` is one of ``TRACE_FORMATS`` (``"csv"`` is accepted for ``"azure"``); ``None`` detects it:
    ``.csv`` means Azure, otherwise the first non-blank line decides (own JSONL has ``request_id`` and
    ``arrival_s``, Mooncake has ``timestamp`` and ``input_length``, a ``TIMESTAMP,...`` header is Azure).
    """
    path = Path(path)
    if fmt is None:
        fmt = _detect_format(path)
    fmt = _FORMAT_ALIASES.get(fmt.lower(), fmt.lower())
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "mooncake":
        return read_mooncake_jsonl(path)
    if fmt == "azure":
        return read_azure_csv(path)
    raise ValueError(f"unknown trace format {fmt!r}; known formats: {', '.join(TRACE_FORMATS)}")


# ---------------------------------------------------------------------------------------------------
# Reshaping


def rescale_to_rate(requests: Sequence[RequestSpec], target_rps: float) -> list[RequestSpec]:
    """Stretch or compress time about the first arrival so that ``(count - 1) / span == target_rps``.

    A single factor multiplies every inter-arrival gap, so burstiness (the CV of the gaps) and the
    order are preserved; ids and token counts are untouched. The result is in arrival order. Needs
    >= 2 requests over a span > 0.
    """
    if isinstance(target_rps, bool) or not (isinstance(target_rps, int | float) and math.isfinite(target_rps)):
        raise ValueError(f"target_rps must be a finite number > 0, got {target_rps!r}")
    if target_rps <= 0:
        raise ValueError(f"target_rps must be a finite number > 0, got {target_rps!r}")
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if len(ordered) < 2:
        raise ValueError(f"rescale_to_rate needs at least 2 requests, got {len(ordered)}")
    start, end = ordered[0].arrival_s, ordered[-1].arrival_s
    span = end - start
    if span <= 0:
        raise ValueError(f"rescale_to_rate needs arrivals spread over time, all {len(ordered)} are at {start}")
    factor = (len(ordered) - 1) / (target_rps * span)
    # Multiplying by a positive constant is monotone in floating point, so the order survives.
    return [dataclasses.replace(r, arrival_s=start + (r.arrival_s - start) * factor) for r in ordered]


def truncate(requests: Sequence[RequestSpec], duration_s: float) -> list[RequestSpec]:
    """Requests arriving in ``[0, duration_s)`` (absolute arrival time), in arrival order."""
    if isinstance(duration_s, bool) or not isinstance(duration_s, int | float) or not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    return [r for r in sorted(requests, key=lambda r: r.arrival_s) if r.arrival_s < duration_s]
