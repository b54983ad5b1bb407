"""The validator plugin on real vLLM's own call path (no server: vLLM 0.32's input processor, as the
API server runs it for each request): a split's decode hop is refused with the 400's message on an
engine whose kv-transfer config is stock NixlConnector, or none; served with Kairos's connector;
a keep's decode hop served on all three. The validator reads the engine's config from that call
path, which only real vLLM has (the decision's cases without vLLM: tests/unit/test_split_refusal.py)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from kairos.common.contracts.split_refusal import (
    SPLIT_CONNECTOR,
    describe_connector,
    split_refusal,
)
from kairos.launcher.tinymodel import build_tiny_model
from kairos.launcher.vllm_node import KV_TRANSFER_CONFIG
from tests.integration.conftest import _vllm_python

MARK = "kairos-outcome "  # vLLM logs to stdout too
# Runs under vLLM's interpreter; prints one line per (engine, request): MARK and its outcome as JSON.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor
    from kairos.nodeagent.vllm_plugin.validator import KairosScheduleValidator

    model, engines = sys.argv[1], json.loads(sys.argv[2])
    pull = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0", "remote_block_ids": [[0]],
            "remote_host": "127.0.0.1", "remote_port": 5600}
    requests = {
        "split": {"kairos_chunk_schedule": [32], "kv_transfer_params": {**pull, "remote_num_tokens": 32}},
        "keep": {"kv_transfer_params": {**pull, "remote_num_tokens": 64}},
    }
    for name, kv_transfer_config in engines.items():
        args = EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=256,
                          kv_transfer_config=kv_transfer_config)
        processor = InputProcessor(args.create_engine_config())
        KairosScheduleValidator._split_refusal = None  # one engine per API server process: read afresh
        for kind, extra_args in requests.items():
            params = SamplingParams(max_tokens=2, extra_args=extra_args)
            try:
                processor.process_inputs(f"{name}-{kind}", {"prompt_token_ids": list(range(3, 67))}, params,
                                         ("generate",))
                outcome = None
            except Exception as exc:
                outcome = [type(exc).__name__, str(exc)]
            print("kairos-outcome", json.dumps({"engine": name, "request": kind, "refused": outcome}), flush=True)
    """
)


def test_the_validator_refuses_a_split_exactly_where_the_engine_lacks_the_split_connector(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    python = _vllm_python()
    model = build_tiny_model(tmp_path_factory.mktemp("split-refusal") / "model")
    stock = {"kv_connector": SPLIT_CONNECTOR, "kv_role": "kv_both"}
    engines = {"kairos": dict(KV_TRANSFER_CONFIG), "stock": stock, "none": None}
    run = subprocess.run(
        [python, "-c", SCRIPT, str(model), json.dumps(engines)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line.removeprefix(MARK) for line in run.stdout.splitlines() if line.startswith(MARK)]
    outcomes = {(o["engine"], o["request"]): o["refused"] for o in map(json.loads, lines)}
    refusal = "VLLMValidationError"  # vLLM's own: its API server answers it with a 400
    assert outcomes == {
        ("kairos", "split"): None,
        ("kairos", "keep"): None,
        ("stock", "split"): [refusal, split_refusal(describe_connector(SPLIT_CONNECTOR, None))],
        ("stock", "keep"): None,
        ("none", "split"): [refusal, split_refusal(describe_connector(None, None))],
        ("none", "keep"): None,
    }
