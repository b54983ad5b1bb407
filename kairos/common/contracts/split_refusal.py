"""Whether a vLLM node can take a split's decode hop, and the 400 it answers when it cannot: the
validator plugin (kairos.nodeagent.vllm_plugin.validator) answers it, the emulated node answers it
as that plugin does, the sidecar recognises it.

Only Kairos's connector (kairos.nodeagent.vllm_plugin.split_connector, loaded by
``kv_connector_module_path``) pulls the k tokens a split's prefill node computed; stock vLLM
0.32's NixlConnector takes the whole prompt as remote and fails its engine core (an HTTP 500, the
server gone: docs/design/split-on-vllm.md).
Every node Kairos starts loads the connector; an operator's own node may not. On such a node the
validator plugin refuses a split's decode hop with a 400 whose message starts with
:data:`SPLIT_REFUSED`, and the sidecar serves the request as a keep instead.

vLLM hands a logits processor's ``validate_params`` the request's sampling parameters alone (its
``extra_args``: ``vllm_xargs`` and ``kv_transfer_params``), not its prompt, so the validator cannot
compare ``remote_num_tokens`` with the prompt's length (``split_prefix_tokens``, which the
connector and the scheduler apply). A split's decode hop is told apart by its chunk schedule
instead: the sidecar sends the schedule of the prompt's rest (l - k tokens past the k it pulls)
with every split's hop 2, and a keep's hop 2 (the whole prompt pulled) never carries one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kairos.common.contracts.schedule import KV_TRANSFER_PARAMS, XARG_CHUNK_SCHEDULE

# What --kv-transfer-config names on a node that takes splits (kairos.launcher.vllm_node's
# KV_TRANSFER_CONFIG): vLLM's connector name, Kairos's module.
SPLIT_CONNECTOR = "NixlConnector"
SPLIT_CONNECTOR_MODULE = "kairos.nodeagent.vllm_plugin.split_connector"
# The start of the refusal's message: what the sidecar recognises it by.
SPLIT_REFUSED = "kairos: this node cannot take a split's decode hop"


def takes_split_hops(kv_connector: str | None, kv_connector_module_path: str | None) -> bool:
    """Whether an engine with this KV connector pulls a split's prefix (Kairos's connector)."""
    return kv_connector == SPLIT_CONNECTOR and kv_connector_module_path == SPLIT_CONNECTOR_MODULE


def is_split_decode_hop(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether a request's ``extra_args`` (as vLLM hands them to ``validate_params``) are a split's
    decode hop: a pull (``do_remote_prefill``) of a prefix the prefill node counted
    (``remote_num_tokens`` > 0) with the schedule of the prompt's rest."""
    if not extra_args or XARG_CHUNK_SCHEDULE not in extra_args:
        return False
    params = extra_args.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
        return False
    k = params.get("remote_num_tokens")  # NixlConnector's: the prompt tokens the prefill node computed
    return isinstance(k, int) and not isinstance(k, bool) and k > 0


def describe_connector(kv_connector: str | None, kv_connector_module_path: str | None) -> str:
    """The KV connector an engine runs, for :func:`split_refusal`."""
    if kv_connector is None:
        return "it runs no KV connector"
    if kv_connector_module_path:
        return f"its KV connector is {kv_connector} from {kv_connector_module_path}"
    return f"its KV connector is vLLM's own {kv_connector}"


def split_refusal(connector: str) -> str:
    """The 400's message on a node whose KV connector (``connector``: :func:`describe_connector`)
    is not Kairos's, with the fix. (No file paths in it: vLLM's error sanitiser rewrites them.)"""
    return (
        f"{SPLIT_REFUSED}: {connector}, not Kairos's split connector. Start vLLM with --kv-transfer-config "
        f'naming "kv_connector": "{SPLIT_CONNECTOR}" and "kv_connector_module_path": "{SPLIT_CONNECTOR_MODULE}" '
        "(kairos.launcher.vllm_node.KV_TRANSFER_CONFIG)"
    )


def is_split_refusal(message: object) -> bool:
    """Whether an error message is :func:`split_refusal`'s."""
    return isinstance(message, str) and message.startswith(SPLIT_REFUSED)
