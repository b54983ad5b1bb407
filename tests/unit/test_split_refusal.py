"""A split's decode hop on a node without Kairos's split connector, without vLLM: which requests are
a split's decode hop, which connector takes them, the validator plugin's decision (read once from
the engine's config in its caller, vLLM's input processor), its 400's message, and the sidecar's
recognition of that 400 (a JSON body, or a stream's one error event). The validator against real
vLLM's call path: tests/integration/test_vllm_split_refusal.py."""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest

from kairos.common import contracts as c
from kairos.common.contracts.split_refusal import (
    SPLIT_CONNECTOR_MODULE,
    SPLIT_REFUSED,
    describe_connector,
    is_split_decode_hop,
    is_split_refusal,
    split_refusal,
    takes_split_hops,
)
from kairos.launcher.vllm_node import KV_TRANSFER_CONFIG
from kairos.nodeagent.sidecar.split import is_split_refused

PULL = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0-1", "remote_num_tokens": 128}
SPLIT = {c.XARG_CHUNK_SCHEDULE: [96, 96], c.XARG_STEP_BUDGET_MS: 70.0, c.KV_TRANSFER_PARAMS: PULL}
KEEP = {c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": 320}, c.XARG_TPOT_SLO_MS: 50.0}
DEFLECT = {c.XARG_CHUNK_SCHEDULE: [256, 64], c.XARG_STEP_BUDGET_MS: 70.0}
STOCK = ("NixlConnector", None)
KAIROS = (KV_TRANSFER_CONFIG["kv_connector"], KV_TRANSFER_CONFIG["kv_connector_module_path"])


def test_the_connector_every_kairos_node_loads_takes_splits_and_no_other() -> None:
    assert KV_TRANSFER_CONFIG["kv_connector_module_path"] == SPLIT_CONNECTOR_MODULE
    assert takes_split_hops(*KAIROS)
    assert not takes_split_hops(*STOCK)
    assert not takes_split_hops(None, None)
    assert not takes_split_hops("NixlConnector", "my.own.connector")
    assert not takes_split_hops("LMCacheConnectorV1", SPLIT_CONNECTOR_MODULE)


@pytest.mark.parametrize(
    ("extra_args", "split"),
    [
        (SPLIT, True),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": 1}}, True),
        (KEEP, False),  # the whole prompt pulled: no schedule
        (DEFLECT, False),  # prefilled here: no pull
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {"do_remote_decode": True}}, False),  # a prefill hop
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "do_remote_prefill": False}}, False),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "do_remote_prefill": "true"}}, False),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": 0}}, False),  # vLLM's "none said"
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": None}}, False),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": True}}, False),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: {**PULL, "remote_num_tokens": "128"}}, False),
        ({**SPLIT, c.KV_TRANSFER_PARAMS: "not an object"}, False),
        ({}, False),
        (None, False),
    ],
)
def test_a_splits_decode_hop_is_a_pull_of_a_counted_prefix_with_the_rests_schedule(
    extra_args: dict[str, Any] | None, split: bool
) -> None:
    assert is_split_decode_hop(extra_args) is split


@pytest.mark.parametrize(
    ("connector", "says"),
    [
        (STOCK, "its KV connector is vLLM's own NixlConnector"),
        (("NixlConnector", "my.own.connector"), "its KV connector is NixlConnector from my.own.connector"),
        ((None, None), "it runs no KV connector"),
    ],
)
def test_the_refusal_says_what_the_node_runs_and_names_the_fix(connector: tuple[Any, Any], says: str) -> None:
    message = split_refusal(describe_connector(*connector))
    assert message.startswith(f"{SPLIT_REFUSED}: {says}, not Kairos's split connector")
    assert f'"kv_connector_module_path": "{SPLIT_CONNECTOR_MODULE}"' in message
    assert "/" not in message  # vLLM's error sanitiser rewrites anything path-like
    assert is_split_refusal(message)
    assert not is_split_refusal("kv_transfer_params.remote_port must be a port number")
    assert not is_split_refusal(None)


# -- the validator plugin ---------------------------------------------------------------------------
@pytest.fixture
def validator() -> Iterator[Any]:
    """The validator plugin's module, imported afresh (its decision not yet taken) over stand-ins
    for the vLLM and torch names it imports, then forgotten."""
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = object  # type: ignore[attr-defined]
    logits = types.ModuleType("vllm.v1.sample.logits_processor")
    logits.BatchUpdate = object  # type: ignore[attr-defined]
    logits.LogitsProcessor = type("LogitsProcessor", (), {})  # type: ignore[attr-defined]
    stand_ins = {
        "torch": types.ModuleType("torch"),
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.sample": types.ModuleType("vllm.v1.sample"),
        "vllm.v1.sample.logits_processor": logits,
    }
    name = "kairos.nodeagent.vllm_plugin.validator"
    with mock.patch.dict(sys.modules, stand_ins):
        sys.modules.pop(name, None)
        yield importlib.import_module(name)
        sys.modules.pop(name, None)


class InputProcessor:
    """vLLM's call path to a logits processor's check, as vLLM 0.32 runs it in the API server:
    ``InputProcessor._validate_params`` (whose ``self.vllm_config`` is the engine's) calls
    ``validate_logits_processors_parameters``, which calls ``validate_params``."""

    def __init__(self, kv_transfer_config: Any, check: Callable[[Any], None]) -> None:
        self.vllm_config = types.SimpleNamespace(kv_transfer_config=kv_transfer_config)
        self.check = check

    def _validate_params(self, extra_args: dict[str, Any]) -> None:
        validate_logits_processors_parameters(self.check, types.SimpleNamespace(extra_args=extra_args))


def validate_logits_processors_parameters(check: Callable[[Any], None], sampling_params: Any) -> None:
    check(sampling_params)


def engine(connector: tuple[Any, Any] | None, validator: Any) -> InputProcessor:
    config = (
        None
        if connector is None
        else types.SimpleNamespace(kv_connector=connector[0], kv_connector_module_path=connector[1])
    )
    return InputProcessor(config, validator.KairosScheduleValidator.validate_params)


@pytest.mark.parametrize(
    ("connector", "says"),
    [(STOCK, "its KV connector is vLLM's own NixlConnector"), (None, "it runs no KV connector")],
)
def test_a_node_without_the_split_connector_refuses_a_splits_decode_hop_and_serves_the_rest(
    validator: Any, connector: tuple[Any, Any] | None, says: str
) -> None:
    node = engine(connector, validator)
    with pytest.raises(ValueError, match="not Kairos's split connector") as refused:
        node._validate_params(SPLIT)
    assert str(refused.value) == split_refusal(says)
    for served in (KEEP, DEFLECT, {}):
        node._validate_params(served)
    with pytest.raises(c.MalformedSchedule):  # a malformed schedule is still said as such
        node._validate_params({**SPLIT, c.XARG_CHUNK_SCHEDULE: [0]})


def test_a_node_with_the_split_connector_serves_every_hop(validator: Any) -> None:
    node = engine(KAIROS, validator)
    for served in (SPLIT, KEEP, DEFLECT, {}):
        node._validate_params(served)


def test_the_connector_is_read_once_at_the_first_split_hop(validator: Any) -> None:
    # Keeps and deflections do not look for it; the first split does, and its answer holds for
    # the process (one engine per API server).
    engine(None, validator)._validate_params(KEEP)
    assert validator.KairosScheduleValidator._split_refusal is None
    engine(KAIROS, validator)._validate_params(SPLIT)
    assert validator.KairosScheduleValidator._split_refusal == ""
    engine(STOCK, validator)._validate_params(SPLIT)  # not read again


def test_a_validator_that_cannot_find_the_engines_config_refuses_splits(validator: Any) -> None:
    check = validator.KairosScheduleValidator.validate_params
    with pytest.raises(ValueError, match="could not be read from vLLM's config"):
        check(types.SimpleNamespace(extra_args=SPLIT))
    check(types.SimpleNamespace(extra_args=KEEP))


# -- the sidecar's recognition ----------------------------------------------------------------------
def vllm_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


REFUSAL = vllm_error(split_refusal(describe_connector(*STOCK)))


@pytest.mark.parametrize(
    ("status", "raw", "refused"),
    [
        (400, json.dumps(REFUSAL, separators=(",", ":")).encode(), True),  # vLLM's JSONResponse
        (200, f"data: {json.dumps(REFUSAL)}\n\ndata: [DONE]\n\n".encode(), True),  # a stream's one event
        (200, f"data: {json.dumps(REFUSAL)}\n\n".encode(), True),
        (400, json.dumps(vllm_error("kv_transfer_params.remote_port must be a port number")).encode(), False),
        (200, f"data: {json.dumps(vllm_error('the engine died'))}\n\n".encode(), False),
        (200, b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n', False),
        (200, b'{"id":"cmpl-1","choices":[]}', False),  # an answer, not a stream
        (404, json.dumps(REFUSAL).encode(), False),
        (400, json.dumps({"error": {**REFUSAL["error"], "code": 500}}).encode(), False),
        (400, b"not json", False),
        (400, b"[]", False),
        (200, b"", False),
    ],
)
def test_the_sidecar_knows_the_refusal_by_its_400_or_its_streams_one_event(
    status: int, raw: bytes, refused: bool
) -> None:
    assert is_split_refused(status, raw) is refused
