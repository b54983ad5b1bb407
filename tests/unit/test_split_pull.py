"""The split route's decode side without vLLM: which hop-2 params are a split's (k below the
prompt) and which keep vLLM's own path, and the kv-transfer config every node gets naming the
connector module that reads them (the real pull: tests/integration/test_vllm_split.py)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from kairos.launcher.vllm_node import KV_TRANSFER_CONFIG
from kairos.nodeagent.vllm_plugin.remote_prefix import REMOTE_NUM_TOKENS, split_prefix_tokens


@pytest.mark.parametrize(
    ("params", "prompt", "k"),
    [
        ({REMOTE_NUM_TOKENS: 128}, 320, 128),  # a split
        ({REMOTE_NUM_TOKENS: 319}, 320, 319),
        ({REMOTE_NUM_TOKENS: 1}, 320, 1),
        ({REMOTE_NUM_TOKENS: 320}, 320, None),  # a keep: the whole prompt computed
        ({REMOTE_NUM_TOKENS: 400}, 320, None),  # more than the prompt: vLLM's own min() applies
        ({REMOTE_NUM_TOKENS: 0}, 320, None),  # nothing computed
        ({REMOTE_NUM_TOKENS: -5}, 320, None),
        ({REMOTE_NUM_TOKENS: None}, 320, None),
        ({REMOTE_NUM_TOKENS: True}, 320, None),  # JSON true is no count
        ({REMOTE_NUM_TOKENS: 128.0}, 320, None),
        ({REMOTE_NUM_TOKENS: "128"}, 320, None),
        ({"do_remote_prefill": True}, 320, None),  # an older prefiller: no count
        ({}, 320, None),
        (None, 320, None),
    ],
)
def test_only_a_count_below_the_prompt_is_a_split(params: dict[str, Any] | None, prompt: int, k: int | None) -> None:
    assert split_prefix_tokens(params, prompt) == k


def test_every_node_loads_the_split_connector_under_vllms_connector_name() -> None:
    # vLLM takes the class named kv_connector from kv_connector_module_path, and checks for NIXL
    # by that name: the module must define a class of that name.
    assert KV_TRANSFER_CONFIG["kv_connector"] == "NixlConnector"
    spec = importlib.util.find_spec(KV_TRANSFER_CONFIG["kv_connector_module_path"])  # no vLLM import
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert KV_TRANSFER_CONFIG["kv_connector"] in classes
    assert KV_TRANSFER_CONFIG["kv_load_failure_policy"] == "recompute"
