"""The node-side contracts of kairos.common.contracts: every encoder's output decodes back to what
it encoded, and every decoder refuses what breaks the contract with a message that names it. (The
heartbeat's codec: tests/unit/test_heartbeat_contract.py; the emulated node against the vLLM
plugin's parser: tests/component/test_schedule_parity.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kairos.common import contracts as c
from kairos.common.contracts import (
    ChunkPlan,
    EngineState,
    EngineStateError,
    EngineStep,
    MalformedSchedule,
    MalformedStepRecord,
    Role,
    StepChunk,
)


# -- chunk schedule and step budget: dispatcher headers -> sidecar xargs -> plugin ---------------
@pytest.mark.parametrize("sizes", [(1,), (1020, 508, 508, 252), (2048,) * c.MAX_SCHEDULE_CHUNKS])
def test_chunk_schedule_header_round_trip(sizes: tuple[int, ...]) -> None:
    assert c.parse_chunk_schedule_header(c.encode_chunk_schedule(sizes)) == sizes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "x-kairos-chunk-schedule='' is not a list of positive integers"),
        ("1020,abc", "is not a list of positive integers"),
        ("512,0", "is not a list of positive integers"),
        ("-5", "is not a list of positive integers"),
        ("1.5", "is not a list of positive integers"),
        (",".join(["1"] * (c.MAX_SCHEDULE_CHUNKS + 1)), "x-kairos-chunk-schedule has 4097 chunks, more than 4096"),
    ],
)
def test_chunk_schedule_header_rejects(value: str, message: str) -> None:
    with pytest.raises(MalformedSchedule, match=message):
        c.parse_chunk_schedule_header(value)


@pytest.mark.parametrize("budget_ms", [70.0, 62.5, 0.001, 1234.5678])
def test_step_budget_header_round_trip(budget_ms: float) -> None:
    assert c.parse_step_budget_ms(c.encode_step_budget_ms(budget_ms)) == pytest.approx(budget_ms, abs=5e-4)


@pytest.mark.parametrize("value", ["", "abc", "0", "-1", "nan", "inf", "0.000"])
def test_step_budget_header_rejects(value: str) -> None:
    with pytest.raises(MalformedSchedule, match=f"x-kairos-step-budget-ms={value!r} is not a positive number"):
        c.parse_step_budget_ms(value)


@pytest.mark.parametrize(("sizes", "budget_ms"), [((512,), None), ((1020, 508, 252), 70.0), ((8,), 62.5)])
def test_schedule_xargs_round_trip(sizes: tuple[int, ...], budget_ms: float | None) -> None:
    plan = c.parse_schedule_xargs(c.schedule_xargs(sizes, budget_ms))
    assert plan == ChunkPlan(sizes, None if budget_ms is None else budget_ms / 1e3)


def test_the_dispatchers_headers_reach_the_plugin_unchanged() -> None:
    """The whole chain as the three parts call it: encode the headers, decode them into xargs,
    send those as JSON, parse them as the plugin does."""
    headers = (c.encode_chunk_schedule((1020, 508, 252)), c.encode_step_budget_ms(0.07 * 1e3))
    xargs = c.schedule_xargs(c.parse_chunk_schedule_header(headers[0]), c.parse_step_budget_ms(headers[1]))
    plan = c.parse_schedule_xargs(json.loads(json.dumps({c.VLLM_XARGS: xargs}))[c.VLLM_XARGS])
    assert plan == ChunkPlan((1020, 508, 252), 0.07)
    assert [plan.cap(i) for i in range(5)] == [1020, 508, 252, 252, 252]  # the last size repeats


@pytest.mark.parametrize(
    ("xargs", "plan"),
    [
        (None, None),
        ({}, None),
        ({"other": 1}, None),
        ({"kairos_chunk_schedule": [512]}, ChunkPlan((512,))),
        ({"kairos_chunk_schedule": (1020, 508, 252)}, ChunkPlan((1020, 508, 252))),
        ({"kairos_chunk_schedule": [10**30]}, ChunkPlan((10**30,))),  # over any node's budget: the engine caps it
        ({"kairos_chunk_schedule": [1] * c.MAX_SCHEDULE_CHUNKS}, ChunkPlan((1,) * c.MAX_SCHEDULE_CHUNKS)),
        ({"kairos_chunk_schedule": [256], "kairos_step_budget_ms": 63}, ChunkPlan((256,), 0.063)),
        ({"kairos_chunk_schedule": [256], "kairos_step_budget_ms": 62.5}, ChunkPlan((256,), 0.0625)),
    ],
)
def test_parse_schedule_xargs_accepts(xargs: dict[str, Any] | None, plan: ChunkPlan | None) -> None:
    assert c.parse_schedule_xargs(xargs) == plan


@pytest.mark.parametrize(
    ("xargs", "message"),
    [
        (
            {"kairos_chunk_schedule": []},
            "vllm_xargs.kairos_chunk_schedule must be a non-empty array of positive integers, got \\[\\]",
        ),
        ({"kairos_chunk_schedule": [0]}, "non-empty array of positive integers, got \\[0\\]"),
        ({"kairos_chunk_schedule": [-5, 10]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [1.5]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [1.0]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": [True]}, "non-empty array of positive integers"),
        ({"kairos_chunk_schedule": "512,256"}, "non-empty array of positive integers, got '512,256'"),
        ({"kairos_chunk_schedule": 512}, "non-empty array of positive integers, got 512"),
        ({"kairos_chunk_schedule": [1] * 5000}, "vllm_xargs.kairos_chunk_schedule has 5000 chunks, more than 4096"),
        ({"kairos_step_budget_ms": 60}, "vllm_xargs.kairos_step_budget_ms needs vllm_xargs.kairos_chunk_schedule"),
        ({"kairos_chunk_schedule": [8], "kairos_step_budget_ms": 0}, "positive number of milliseconds, got 0"),
        ({"kairos_chunk_schedule": [8], "kairos_step_budget_ms": "60"}, "positive number of milliseconds"),
        ({"kairos_chunk_schedule": [8], "kairos_step_budget_ms": True}, "positive number of milliseconds"),
        ({"kairos_chunk_schedule": [8], "kairos_step_budget_ms": float("inf")}, "positive number of milliseconds"),
    ],
)
def test_parse_schedule_xargs_rejects(xargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MalformedSchedule, match=message):
        c.parse_schedule_xargs(xargs)
    assert issubclass(MalformedSchedule, ValueError)  # what vLLM turns into an HTTP 400


# -- engine state: vLLM plugin and emulated node -> heartbeat publisher ---------------------------
FULL_STATE = EngineState(
    decode_tokens=3,
    kv_tokens=4100,
    kv_capacity_tokens=131_072,
    queued_prefill_tokens=(500, 7),
    scheduled_prefill_tokens=(900,),
    max_step_tokens=2048,
    model="tiny",
    running_requests=4,
    waiting_requests=2,
    kv_usage=0.0312,
    pending_kv_pull_tokens=(3000, 0),
    as_of=1_700_000_000.5,
)
BARE_STATE = EngineState(0, 0, 100, (), (), 1, "m")  # what the emulated node serves: no optional fields


@pytest.mark.parametrize("state", [FULL_STATE, BARE_STATE])
def test_engine_state_round_trip(state: EngineState) -> None:
    raw = c.encode_engine_state(state)
    assert c.parse_engine_state(raw) == state
    assert c.parse_engine_state(raw.encode()) == state
    data = json.loads(raw)
    assert (
        set(c.EngineStateField.REQUIRED) <= set(data) <= set(c.EngineStateField.REQUIRED + c.EngineStateField.OPTIONAL)
    )


def test_engine_state_fields_are_the_heartbeats() -> None:
    """The publisher copies the state into the heartbeat field by field: the names must agree
    (the KV event sockets come from the publisher's own config)."""
    f, h = c.EngineStateField, c.HeartbeatField
    assert set(f.REQUIRED) <= set(h.REQUIRED)
    assert set(f.OPTIONAL) - {f.AS_OF} == set(h.OPTIONAL) - set(h.KV_EVENTS)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("not json", "engine state: not JSON (JSONDecodeError"),
        (b"\xff", "engine state: not JSON"),
        ("[1, 2]", "engine state: expected a JSON object, got list"),
        ('{"decode_tokens": 1}', "engine state: missing fields ['kv_tokens',"),
        (
            c.encode_engine_state(BARE_STATE).replace("[]", "5", 1),
            "queued_prefill_tokens must be a list of ints >= 0, got 5",
        ),
        (c.encode_engine_state(BARE_STATE).replace('"kv_tokens":0', '"kv_tokens":-1'), "kv_tokens must be an int >= 0"),
        (
            c.encode_engine_state(BARE_STATE).replace('"max_step_tokens":1', '"max_step_tokens":0'),
            "engine state: max_step_tokens must be an int >= 1, got 0",
        ),
        (c.encode_engine_state(FULL_STATE).replace("0.0312", "1.5"), "kv_usage must be a number in [0, 1]"),
        (
            c.encode_engine_state(FULL_STATE).replace("[3000,0]", "3000"),
            "pending_kv_pull_tokens must be a list of ints >= 0, got 3000",
        ),
        (
            c.encode_engine_state(FULL_STATE).replace("[3000,0]", "[3000,-1]"),
            "pending_kv_pull_tokens must be a list of ints >= 0, got [3000, -1]",
        ),
        (
            c.encode_engine_state(FULL_STATE).replace('"running_requests":4', '"running_requests":true'),
            "running_requests",
        ),
    ],
)
def test_engine_state_rejects(raw: str | bytes, message: str) -> None:
    with pytest.raises(EngineStateError) as err:
        c.parse_engine_state(raw)
    assert message in err.value.message
    assert err.value.code == "engine_state_unavailable"


def test_the_engine_state_is_the_heartbeats_load_declared_once() -> None:
    """The engine state's fields are the heartbeat's less the publisher's own, in the heartbeat's
    order, then as_of: a load field added to the heartbeat is in the engine state, its names, its
    encoder and its decoder (and the publisher's copy, heartbeat_load) with no other edit."""
    from kairos.common.contracts.engine_state import PUBLISHER_FIELDS, engine_state_fields, heartbeat_load

    class Extended(c.Heartbeat, frozen=True, gc=False, omit_defaults=True):
        rejected_requests: int | None = None

    names = [field[0] for field in engine_state_fields(Extended)]
    assert names == [n for n in Extended.__struct_fields__ if n not in PUBLISHER_FIELDS] + ["as_of"]
    assert names[-2:] == ["rejected_requests", "as_of"]
    assert (*c.EngineStateField.REQUIRED, *c.EngineStateField.OPTIONAL) == EngineState.__struct_fields__
    publisher = {"node_id": "d0", "role": Role.DECODE, "url": "h:1", "sidecar": "h:2", "seq": 0, "sent_at": 0.0}
    beat = c.Heartbeat(**publisher, **heartbeat_load(FULL_STATE))
    assert {n: getattr(beat, n) for n in heartbeat_load(FULL_STATE)} == heartbeat_load(FULL_STATE)
    assert c.EngineStateField.AS_OF not in heartbeat_load(FULL_STATE)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_usage": 1.5}, "engine state: kv_usage must be a number in [0, 1], got 1.5"),
        ({"queued_prefill_tokens": [1]}, "engine state: queued_prefill_tokens must be a list of ints >= 0, got [1]"),
        ({"tpot_slo_ms": 0.0}, "engine state: tpot_slo_ms must be a number of milliseconds > 0, got 0.0"),
        ({"model": None}, "engine state: model must be a string, got None"),
        ({"scheduled_prefill_computed_tokens": (1, 2)}, "scheduled_prefill_computed_tokens has 2 entries for 1"),
    ],
)
def test_an_engine_state_built_in_python_is_checked_as_one_read_off_the_wire(
    changes: dict[str, Any], message: str
) -> None:
    """The vLLM plugin and the emulated node build the state in Python, where msgspec checks
    nothing: building it checks it against the same declaration, in the same words."""
    fields = {n: getattr(FULL_STATE, n) for n in EngineState.__struct_fields__}
    with pytest.raises(EngineStateError) as err:
        EngineState(**(fields | changes))
    assert message in err.value.message


def test_engine_state_ignores_unknown_fields_and_null_optionals() -> None:
    data = json.loads(c.encode_engine_state(BARE_STATE)) | {"future_field": 1, "kv_usage": None}
    assert c.parse_engine_state(json.dumps(data)) == BARE_STATE


# -- step records: vLLM recorder, emulated node, virtual engine -> profiler ------------------------
STEP = EngineStep(17, 12.031, 0.0521, 16, 57_104, (StepChunk("r3", 512, 1024), StepChunk("r4", 1, 0)))


@pytest.mark.parametrize(
    "step",
    [STEP, EngineStep(0, 0.0, 1e-6, 0, 0, ()), EngineStep(3, 1.5, 0.05, 2, 900, (), node="d0", role=Role.DECODE)],
)
def test_step_record_round_trip(step: EngineStep) -> None:
    assert c.parse_step_record(json.loads(json.dumps(c.encode_step_record(step)))) == step


def test_step_record_schema_on_the_wire() -> None:
    assert c.encode_step_record(STEP) == {
        "index": 17,
        "start": 12.031,
        "duration": 0.0521,
        "decode_tokens": 16,
        "kv_tokens": 57_104,
        "chunks": [{"request_id": "r3", "tokens": 512, "cached": 1024}, {"request_id": "r4", "tokens": 1, "cached": 0}],
    }
    tagged = c.encode_step_record(EngineStep(0, 0.0, 0.1, 0, 0, (), node="p0", role=Role.PREFILL))
    assert (tagged["node"], tagged["role"]) == ("p0", "prefill") and type(tagged["role"]) is str


GOOD = c.encode_step_record(STEP)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1], "a step record is a JSON object, got list"),
        ({k: v for k, v in GOOD.items() if k != "start"}, "missing fields ['start']"),
        ({**GOOD, "index": -1}, "index must be an int >= 0, got -1"),
        ({**GOOD, "duration": 0}, "duration must be a number of seconds > 0, got 0"),
        ({**GOOD, "start": True}, "start must be a number of seconds, got True"),
        ({**GOOD, "kv_tokens": 1.5}, "kv_tokens must be an int >= 0, got 1.5"),
        ({**GOOD, "chunks": None}, "chunks must be a list of objects, got None"),
        ({**GOOD, "chunks": [7]}, "chunks[0] must be an object, got 7"),
        ({**GOOD, "chunks": [{"tokens": 1, "cached": 0}]}, "chunks[0]: missing fields ['request_id']"),
        ({**GOOD, "chunks": [{"request_id": "a", "cached": 0}]}, "chunks[0]: missing fields ['tokens']"),
        (
            {**GOOD, "chunks": [{"request_id": "a", "tokens": 1, "cached": -1}]},
            "chunks[0]: cached must be an int >= 0, got -1",
        ),
        ({**GOOD, "role": "router"}, "role must be 'prefill' or 'decode', got 'router'"),
        ({**GOOD, "chunks": [{**GOOD["chunks"][0], "tokens": 0}]}, "chunks[0]: tokens must be an int >= 1, got 0"),
        ({**GOOD, "chunks": [{**GOOD["chunks"][0], "request_id": 3}]}, "chunks[0]: request_id must be a string, got 3"),
        ({**GOOD, "node": 5}, "node must be a string, got 5"),
        # Python's JSON reader makes NaN and infinities, which msgspec's check lets through
        ({**GOOD, "start": float("nan")}, "start must be a number of seconds, got nan"),
        ({**GOOD, "duration": float("inf")}, "duration must be a number of seconds > 0, got inf"),
    ],
)
def test_step_record_rejects(obj: Any, message: str) -> None:
    with pytest.raises(MalformedStepRecord) as err:
        c.parse_step_record(obj)
    assert str(err.value) == message


def test_a_step_index_beyond_64_bits_is_taken_as_json_allows() -> None:
    """msgspec refuses it; the checked decoder, which gives the verdict then, takes it."""
    assert c.parse_step_record({**GOOD, "index": 2**64}).index == 2**64


def test_a_field_added_to_the_step_record_is_named_and_encoded_with_no_other_edit() -> None:
    from kairos.common.contracts._schema import FieldNames

    class Extended(EngineStep, frozen=True, omit_defaults=True):
        preempted: int | None = None

    class ExtendedField(FieldNames, struct=Extended):
        """Its names, derived from Extended alone."""

    assert ExtendedField.PREEMPTED == "preempted" and ExtendedField.REQUIRED == c.StepField.REQUIRED
    fields = {n: getattr(STEP, n) for n in EngineStep.__struct_fields__}
    assert c.encode_step_record(Extended(**fields, preempted=2)) == {**GOOD, "preempted": 2}
    assert c.encode_step_record(Extended(**fields)) == GOOD
    assert list(GOOD) == list(c.StepField.REQUIRED)


def test_steps_page_round_trip() -> None:
    records = [c.encode_step_record(STEP)]
    page = c.parse_steps_page(c.encode_steps_page("d0", 18, records))
    assert (page.node_id, page.next_index, page.steps) == ("d0", 18, tuple(records))
    assert [c.parse_step_record(s) for s in page.steps] == [STEP]


@pytest.mark.parametrize(
    "raw", ["nope", "[]", '{"steps": []}', '{"steps": {}, "next_index": 0}', '{"steps": [1], "next_index": 0}']
)
def test_steps_page_rejects(raw: str) -> None:
    with pytest.raises(MalformedStepRecord):
        c.parse_steps_page(raw)


def test_steps_since() -> None:
    assert (c.parse_steps_since("0"), c.parse_steps_since("42")) == (0, 42)
    for bad in ("-1", "x", ""):
        with pytest.raises(ValueError, match=f"since must be a non-negative integer, got {bad!r}"):
            c.parse_steps_since(bad)


def test_a_step_overruns_its_budget_only_over_the_tightest_budget_with_decodes_running() -> None:
    assert c.overran_step_budget(3, [0.07, None], 0.08)
    assert c.overran_step_budget(3, [0.2, 0.07], 0.08)  # the tightest chunk budget counts
    assert not c.overran_step_budget(3, [0.07], 0.07)  # on the budget is within it
    assert not c.overran_step_budget(0, [0.07], 0.5)  # no decode ran: the budget protected nobody
    assert not c.overran_step_budget(3, [None], 0.5)  # no chunk carried a budget
    assert not c.overran_step_budget(3, [], 0.5)
    # A node calibrated at 1.25 was planned to 0.056 for a tau of 0.070: 0.065 is within tau.
    assert not c.overran_step_budget(3, [0.056], 0.065, 1.25)
    assert c.overran_step_budget(3, [0.056], 0.071, 1.25)


def test_routing_headers_name_every_header_the_dispatcher_sets_under_the_prefix() -> None:
    """Envoy's one-message route is for requests with none of them (a client's would reach the
    sidecar unremoved otherwise), and its routes add each from the answer's metadata: a new
    x-kairos-* header must be listed."""
    prefixed = {v for k, v in vars(c).items() if k.startswith("H_") and v.startswith(c.HEADER_PREFIX)}
    assert set(c.ROUTING_HEADERS) == prefixed
    assert len(c.ROUTING_HEADERS) == len(prefixed)


def test_the_one_message_route_matches_what_the_dispatcher_reads(tmp_path: Any) -> None:
    """The rendered route: an inference POST with a Content-Length up to the dispatcher's body
    limit, no Content-Encoding and no routing header; ext_proc sends its body alone; the head's
    attributes are the ones the server reads; every route adds the routing headers from metadata."""
    import yaml

    from kairos.common import defaults
    from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config

    config = yaml.safe_load(render_envoy_config(EnvoySettings(sidecars=("127.0.0.1:8201",))))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    one, public, rest = manager["route_config"]["virtual_hosts"][0]["routes"]
    matchers = {m["name"]: m for m in one["match"]["headers"]}
    assert matchers[":method"]["string_match"] == {"exact": "POST"}
    assert matchers["content-length"]["range_match"] == {"start": 1, "end": defaults.MAX_REQUEST_BODY_BYTES + 1}
    for name in ("content-encoding", *c.ROUTING_HEADERS):
        assert matchers[name] == {"name": name, "present_match": True, "invert_match": True}
    mode = one["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "BUFFERED")
    names = [f["name"] for f in manager["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.buffer", "envoy.filters.http.router"]
    assert manager["http_filters"][0]["typed_config"]["request_attributes"] == list(c.HEAD_ATTRIBUTES)
    for route in (one, public):
        added = {h["header"]["key"]: h["header"]["value"] for h in route["request_headers_to_add"]}
        assert added == {
            name: f"%DYNAMIC_METADATA({c.ROUTING_METADATA_NAMESPACE}:{name})%"
            for name in (c.H_REQUEST_ID, *c.ROUTING_HEADERS)
        }
    assert "request_headers_to_add" not in rest  # the catch-all 404


# -- route names and the public API's paths: spelled once, in the contracts -------------------------
_PRODUCT = ("kairos", "extproc", "nodeagent", "sim", "profiling")
# A string equal to one of these in product code outside the contracts is a second declaration.
_SPELLED_ONCE = {str(route) for route in c.Route} | {c.ROUTE_FANOUT, *c.INFERENCE_PATHS, c.MODELS_PATH}
# The same words that mean something else.
_OTHER_MEANINGS = {
    ("kairos/core/policies/kairos.py", "keep"),  # the policy spec's keep-estimate parameter
    ("kairos/core/policies/kairos.py", "split"),  # the policy spec's split-rule parameter
    ("sim/emulated_vllm/node.py", "deflect"),  # the emulated node's plan mode for a scheduled prefill
    ("profiling/fit.py", "split"),  # a profile fit's train/test split in its report
}


def test_route_names_and_api_paths_are_imported_never_spelled_again() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spelled = {
        (str(path.relative_to(root)), node.value)
        for folder in _PRODUCT
        for path in (root / folder).rglob("*.py")
        if "contracts" not in path.relative_to(root).parts
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in _SPELLED_ONCE
    }
    assert spelled - _OTHER_MEANINGS == set()
    assert [str(route) for route in c.Route] == ["keep", "deflect", "split"]  # the x-kairos-route values on the wire
    assert c.INFERENCE_PATHS == ("/v1/completions", "/v1/chat/completions")
