"""Step-record loading: the schema, errors that name file:line, run ids, step classification."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kairos.profiling.records import (
    MANIFEST_FILE,
    RecordsError,
    StepKind,
    classify,
    load_run,
    load_runs,
    load_transfers,
    record_files,
)

GOOD = {
    "index": 3,
    "start": 1.5,
    "duration": 0.05,
    "decode_tokens": 2,
    "kv_tokens": 900,
    "chunks": [{"request_id": "a", "tokens": 100, "cached": 300}, {"request_id": "b", "tokens": 300, "cached": 0}],
}


def write(path: Path, *rows: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_good_record_loads_with_derived_fields(tmp_path: Path) -> None:
    # Extra keys the vLLM recorder adds are tolerated; blank lines are skipped.
    extra = {**GOOD, "node": "d0", "role": "decode", "wall_start": 1700000000.0}
    run = load_run(write(tmp_path / "r.jsonl", extra, "", {**GOOD, "index": 4}))
    assert run.run == str(tmp_path / "r.jsonl")
    assert len(run.records) == 2 and len(run.sha256) == 64
    r = run.records[0]
    assert (r.node, r.role, r.prefill_tokens, r.step_tokens) == ("d0", "decode", 400, 402)
    assert r.cached == (100 * 300 + 300 * 0) / 400  # token-weighted mean, as model_step_time costs it
    assert r.kind is StepKind.MIXED
    assert run.records[1].role is None  # no role anywhere


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "r.jsonl:2: not valid JSON"),
        ([1, 2], "r.jsonl:2: a step record is a JSON object, got list"),
        ({k: v for k, v in GOOD.items() if k != "kv_tokens"}, "r.jsonl:2: missing fields ['kv_tokens']"),
        ({**GOOD, "duration": 0}, "r.jsonl:2: duration must be a number of seconds > 0, got 0"),
        ({**GOOD, "start": "soon"}, "r.jsonl:2: start must be a number of seconds"),
        ({**GOOD, "index": True}, "r.jsonl:2: index must be an int >= 0, got True"),
        ({**GOOD, "decode_tokens": -1}, "r.jsonl:2: decode_tokens must be an int >= 0, got -1"),
        ({**GOOD, "chunks": {}}, "r.jsonl:2: chunks must be a list"),
        ({**GOOD, "chunks": [{"request_id": 7, "tokens": 1, "cached": 0}]}, "r.jsonl:2: chunks[0]: request_id must be"),
        ({**GOOD, "chunks": [{"request_id": "a", "tokens": 0, "cached": 0}]}, "r.jsonl:2: chunks[0]: tokens must be"),
        ({**GOOD, "role": "router"}, "r.jsonl:2: role must be 'prefill' or 'decode', got 'router'"),
        (GOOD, "r.jsonl:2: step index 3 repeats line 1"),
    ],
)
def test_bad_rows_are_named_by_file_and_line(tmp_path: Path, row: object, message: str) -> None:
    path = write(tmp_path / "r.jsonl", GOOD, row)
    with pytest.raises(RecordsError) as err:
        load_run(path)
    assert message in err.value.message
    assert err.value.code == "invalid_records"


def test_same_index_on_two_nodes_is_two_steps(tmp_path: Path) -> None:
    run = load_run(write(tmp_path / "r.jsonl", {**GOOD, "node": "d0"}, {**GOOD, "node": "d1"}))
    assert [r.node for r in run.records] == ["d0", "d1"]


def test_directories_are_runs_per_file_with_the_manifest_role(tmp_path: Path) -> None:
    write(tmp_path / "c" / "trace-r1.jsonl", {**GOOD, "decode_tokens": 0})
    write(tmp_path / "c" / "trace-r2.jsonl", {**GOOD, "decode_tokens": 0, "role": "prefill"})
    write(tmp_path / "c" / "transfers.jsonl", {"tokens": 10, "seconds": 0.1})  # not a step run
    (tmp_path / "c" / MANIFEST_FILE).write_text(json.dumps({"role": "decode"}))
    runs = load_runs([tmp_path / "c"])
    assert [Path(r.run).name for r in runs] == ["trace-r1.jsonl", "trace-r2.jsonl"]
    # B = 0 with chunks: a decode node costs it as a mixed step, a prefill node as a prefill step.
    assert runs[0].records[0].kind is StepKind.MIXED
    assert runs[1].records[0].kind is StepKind.PREFILL  # the record's own role wins
    assert [f.name for f, _ in record_files([tmp_path / "c"])] == ["trace-r1.jsonl", "trace-r2.jsonl"]


def test_missing_and_empty_inputs_are_errors(tmp_path: Path) -> None:
    with pytest.raises(RecordsError, match="does not exist"):
        load_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecordsError, match="no step records"):
        load_runs([tmp_path / "empty"])


@pytest.mark.parametrize(
    ("b", "p", "role", "kind"),
    [
        (4, 0, None, StepKind.DECODE),
        (0, 0, "decode", StepKind.EMPTY),
        (0, 512, "prefill", StepKind.PREFILL),
        (0, 512, None, StepKind.PREFILL),
        (0, 512, "decode", StepKind.MIXED),
        (3, 512, "prefill", StepKind.MIXED),
        (3, 512, "decode", StepKind.MIXED),
    ],
)
def test_classification_follows_the_engine_model(b: int, p: int, role: str | None, kind: StepKind) -> None:
    assert classify(b, p, role) is kind


def test_transfer_records(tmp_path: Path) -> None:
    write(
        tmp_path / "transfers.jsonl", {"tokens": 100, "seconds": 0.01}, {"tokens": 200, "seconds": 0.02, "bytes": 4e5}
    )
    got = load_transfers([tmp_path, tmp_path / "x.jsonl"])  # one directory named twice: read once
    assert [(t.tokens, t.seconds, t.bytes) for t in got] == [(100, 0.01, None), (200, 0.02, 4e5)]
    write(tmp_path / "transfers.jsonl", {"tokens": 100, "seconds": -1})
    with pytest.raises(RecordsError, match=r"transfers.jsonl:1: seconds must be a number > 0"):
        load_transfers([tmp_path])
