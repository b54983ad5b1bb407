"""Trace I/O in the real file formats, with hand-computed arrival times."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kairos.sim.prefix_cache import PrefixCache
from kairos.traffic.requests import RequestSpec
from kairos.traffic.traces import (
    TraceError,
    load_trace,
    mooncake_block_hashes,
    read_azure_csv,
    read_jsonl,
    read_mooncake_jsonl,
    rescale_to_rate,
    truncate,
    write_jsonl,
)
from kairos.traffic.workloads import make_workload

AZURE_CSV = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:58.6805900,374,44
2023-11-17T00:00:00.5,879,34
2023-11-16 23:59:59.9951690,396,109
2023-11-17 00:00:01,120,7
"""
# Seconds after 23:59:58.6805900, crossing midnight; row 3 is out of order and gets sorted.
AZURE_EXPECTED = [
    RequestSpec("azure-000000", 0.0, 374, 44),
    RequestSpec("azure-000001", 1.314579, 396, 109),
    RequestSpec("azure-000002", 1.81941, 879, 34),
    RequestSpec("azure-000003", 2.31941, 120, 7),
]

MOONCAKE_JSONL = """\
{"timestamp": 1000, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}
{"timestamp": 28482, "input_length": 6472, "output_length": 26, "hash_ids": [46, 49]}

{"timestamp": 31535, "input_length": 12, "output_length": 1, "hash_ids": []}
"""
MOONCAKE_EXPECTED = [
    RequestSpec("mooncake-000000", 0.0, 6955, 52, mooncake_block_hashes([46, 47, 48], 6955)),
    RequestSpec("mooncake-000001", 27.482, 6472, 26, mooncake_block_hashes([46, 49], 6472)),
    RequestSpec("mooncake-000002", 30.535, 12, 1),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_round_trip_is_identity(tmp_path: Path) -> None:
    requests = make_workload("bursty", rps=None, num_requests=500, seed=9)
    requests.append(RequestSpec("odd-float", 0.1 + 0.2 + requests[-1].arrival_s, 1, 1))
    path = tmp_path / "trace.jsonl"
    write_jsonl(path, requests)
    assert read_jsonl(path) == requests
    assert load_trace(path) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["request_id", "arrival_s", "prompt_tokens", "output_tokens"]


def test_jsonl_round_trip_keeps_conversations_and_hashes(tmp_path: Path) -> None:
    requests = [
        RequestSpec("s0-t1", 0.0, 40, 9, (1, -2), "s0", 1),
        RequestSpec("s0-t2", 12.5, 70, 3, (1, -2, 3, 4), "s0", 2, after="s0-t1", think_s=10.25),
    ]
    path = tmp_path / "conv.jsonl"
    write_jsonl(path, requests)
    assert read_jsonl(path) == requests
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"request_id": "a", "arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "block_hashes": [1.5]}\n'
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: block_hashes must be a list of integers"):
        read_jsonl(bad)
    bad.write_text('{"request_id": "a", "arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "after": "a"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: a: a request cannot wait for itself"):
        read_jsonl(bad)


def test_empty_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    write_jsonl(path, [])
    assert read_jsonl(path) == []
    assert load_trace(path) == []


def test_own_jsonl_sorts_unsorted_rows(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        '{"request_id": "b", "arrival_s": 2.5, "prompt_tokens": 3, "output_tokens": 4}\n'
        '{"request_id": "a", "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 6}\n',
    )
    assert read_jsonl(path) == [RequestSpec("a", 1.0, 5, 6), RequestSpec("b", 2.5, 3, 4)]


def test_azure_csv_loads_expected_requests(tmp_path: Path) -> None:
    path = _write(tmp_path / "AzureLLMInferenceTrace_conv.csv", AZURE_CSV)
    assert read_azure_csv(path) == AZURE_EXPECTED
    assert load_trace(path) == AZURE_EXPECTED


def test_azure_detected_by_header_and_fmt_alias(tmp_path: Path) -> None:
    path = _write(tmp_path / "azure_trace.txt", AZURE_CSV)
    assert load_trace(path) == AZURE_EXPECTED
    assert load_trace(path, fmt="csv") == AZURE_EXPECTED


def test_azure_extra_columns_and_timezones(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "a.csv",
        "Model,TIMESTAMP,GeneratedTokens,ContextTokens\n"
        "x,2024-05-10T10:00:00.25+02:00,5,100\n"
        "y,2024-05-10T08:00:01.0000001Z,6,200\n",
    )
    assert read_azure_csv(path) == [
        RequestSpec("azure-000000", 0.0, 100, 5),
        RequestSpec("azure-000001", 0.7500001, 200, 6),
    ]


def test_mooncake_loads_expected_requests(tmp_path: Path) -> None:
    path = _write(tmp_path / "conversation_trace.jsonl", MOONCAKE_JSONL)
    assert read_mooncake_jsonl(path) == MOONCAKE_EXPECTED
    assert load_trace(path) == MOONCAKE_EXPECTED
    assert load_trace(path, fmt="mooncake") == MOONCAKE_EXPECTED


def test_mooncake_hash_ids_become_engine_block_hashes() -> None:
    first, second, third = MOONCAKE_EXPECTED
    # Each 512-token id covers 32 engine blocks; the hashes run as far as the ids (or the input) go.
    assert len(first.block_hashes) == 96 and len(second.block_hashes) == 64 and third.block_hashes == ()
    # The two share id 46, hence exactly its 32 blocks: a cache holding the first hits 32 of the second.
    cache = PrefixCache()
    cache.insert(first.block_hashes)
    assert cache.match(second.block_hashes) == 32
    assert len(mooncake_block_hashes([1, 2], 520)) == 32  # 520 tokens fill 32 engine blocks, not 64
    assert mooncake_block_hashes([1, 2], 1024)[:32] == mooncake_block_hashes([1, 3], 1024)[:32]


def test_rescale_to_rate_hits_target_and_keeps_shape() -> None:
    requests = make_workload("bursty", rps=None, num_requests=2_000, seed=4)
    rescaled = rescale_to_rate(requests, 12.5)
    arrivals = np.array([r.arrival_s for r in rescaled])
    assert (len(rescaled) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(12.5, rel=1e-12)
    assert [(r.request_id, r.prompt_tokens, r.output_tokens) for r in rescaled] == [
        (r.request_id, r.prompt_tokens, r.output_tokens) for r in requests
    ]
    old_gaps = np.diff([r.arrival_s for r in requests])
    new_gaps = np.diff(arrivals)
    factor = new_gaps.sum() / old_gaps.sum()
    np.testing.assert_allclose(new_gaps, old_gaps * factor, rtol=1e-9, atol=1e-12)
    assert np.all(new_gaps >= 0)


def test_rescale_keeps_start_offset() -> None:
    requests = [RequestSpec("a", 10.0, 1, 1), RequestSpec("b", 11.0, 1, 1), RequestSpec("c", 14.0, 1, 1)]
    assert [r.arrival_s for r in rescale_to_rate(requests, 1.0)] == [10.0, 10.5, 12.0]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_rescale_rejects_bad_rate(bad: float) -> None:
    with pytest.raises(ValueError, match="target_rps must be a finite number > 0"):
        rescale_to_rate(MOONCAKE_EXPECTED, bad)


def test_rescale_rejects_degenerate_traces() -> None:
    with pytest.raises(ValueError, match="at least 2 requests, got 1"):
        rescale_to_rate(MOONCAKE_EXPECTED[:1], 1.0)
    same_time = [RequestSpec("a", 3.0, 1, 1), RequestSpec("b", 3.0, 1, 1)]
    with pytest.raises(ValueError, match=r"all 2 are at 3\.0"):
        rescale_to_rate(same_time, 1.0)


def test_truncate() -> None:
    assert truncate(MOONCAKE_EXPECTED, 30.535) == MOONCAKE_EXPECTED[:2]
    assert truncate(MOONCAKE_EXPECTED, 100.0) == MOONCAKE_EXPECTED
    with pytest.raises(ValueError, match="duration_s must be > 0, got 0"):
        truncate(MOONCAKE_EXPECTED, 0)


_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
_ROW = "2023-11-16 18:15:46.6805900,10,5\n"
_OWN = '{"request_id": "r1", "arrival_s": 0.0, "prompt_tokens": 3, "output_tokens": 4}\n'
_MC = '{"timestamp": 0, "input_length": 3, "output_length": 4}\n'


@pytest.mark.parametrize(
    ("filename", "fmt", "text", "line", "fragment"),
    [
        ("a.csv", None, "TIMESTAMP,ContextTokens\n" + _ROW, 1, "lacks column(s) ['GeneratedTokens']"),
        ("a.csv", None, "", 1, "empty file"),
        ("a.csv", None, _HEADER + _ROW + "2023-11-16 18:15:47,ten,5\n", 3, "ContextTokens must be an integer"),
        ("a.csv", None, _HEADER + "2023-11-16 18:15:47,10,0\n", 2, "GeneratedTokens must be >= 1, got 0"),
        ("a.csv", None, _HEADER + _ROW + "2023-11-16 18:15:47,-3,5\n", 3, "ContextTokens must be >= 1, got -3"),
        ("a.csv", None, _HEADER + _ROW + "16/11/2023 18:15,10,5\n", 3, "TIMESTAMP '16/11/2023 18:15'"),
        ("a.csv", None, _HEADER + "2023-13-16 18:15:47,10,5\n", 2, "month must be in 1..12"),
        ("a.csv", None, _HEADER + _ROW + _ROW + "2023-11-16 18:15:47,10\n", 4, "at least 3 fields"),
        ("m.jsonl", None, _MC + '{"timestamp": 5, "input_length": 3}\n', 2, "missing key(s) ['output_length']"),
        ("m.jsonl", None, _MC + '{"timestamp": "5", "input_length": 3, "output_length": 4}\n', 2, "finite number"),
        ("m.jsonl", None, _MC + _MC + '{"timestamp": 5,\n', 3, "invalid JSON"),
        ("m.jsonl", "mooncake", _MC + "[1, 2]\n", 2, "expected a JSON object, got list"),
        ("m.jsonl", None, _MC + '{"timestamp": 5, "input_length": 2.5, "output_length": 4}\n', 2, "integer"),
        ("o.jsonl", None, _OWN + _OWN, 2, "duplicate request_id 'r1' (first on line 1)"),
        ("o.jsonl", None, _OWN.replace('"output_tokens": 4', '"output_tokens": 0'), 1, "output_tokens must be >= 1"),
        ("o.jsonl", None, _OWN.replace('"prompt_tokens": 3', '"prompt_tokens": true'), 1, "must be an integer"),
        ("o.jsonl", None, _OWN.replace("0.0", "-1.0"), 1, "arrival_s must be >= 0, got -1.0"),
        ("o.jsonl", None, _OWN.replace('"r1"', "7"), 1, "request_id must be a non-empty string"),
        ("x.jsonl", None, '{"foo": 1}\n', 1, "cannot tell the JSONL flavour from keys ['foo']"),
        ("x.trace", None, "hello\n", 1, "unrecognised trace format"),
    ],
)
def test_bad_files_raise_trace_error_with_line(
    tmp_path: Path, filename: str, fmt: str | None, text: str, line: int, fragment: str
) -> None:
    path = _write(tmp_path / filename, text)
    with pytest.raises(TraceError) as info:
        load_trace(path, fmt)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message
    assert info.value.line == line
    assert isinstance(info.value, ValueError)


def test_empty_file_of_unknown_type_and_unknown_fmt(tmp_path: Path) -> None:
    path = _write(tmp_path / "empty.trace", "\n")
    with pytest.raises(TraceError, match="empty file, cannot detect its format"):
        load_trace(path)
    with pytest.raises(ValueError, match="unknown trace format 'parquet'; known formats: jsonl, azure, mooncake"):
        load_trace(path, fmt="parquet")


def test_trace_error_pickles() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(TraceError("t.csv", 3, "bad")))
    assert (str(error), error.path, error.line) == ("t.csv:3: bad", "t.csv", 3)
