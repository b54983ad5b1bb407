"""Turns off NIXL's UCX progress thread on CPU test rigs (a ``vllm.general_plugins`` entry point).

NIXL's UCX backend runs a progress thread that polls with a zero timeout: an idle vLLM worker
with NixlConnector keeps one core at 100%. On a GPU node with dozens of cores that buys transfer
latency; on a 2-core CI machine running a prefill and a decode node, the two idle workers take
both cores and starve everything else (steps slow down several times, heartbeats miss their TTL).
Without the thread, transfers still progress: vLLM polls each transfer's state every engine step.

Active only when ``KAIROS_VLLM_NIXL_PROGRESS_THREAD=0`` (``kairos.vllm_node`` sets it for CPU
nodes); vLLM calls this in every process, before the KV connector is built.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

ENV = "KAIROS_VLLM_NIXL_PROGRESS_THREAD"
_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"

log = logging.getLogger("vllm.kairos")


def apply() -> None:
    if os.environ.get(ENV, "1") != "0":
        return
    import vllm.distributed.nixl_utils as nixl_utils

    original = getattr(nixl_utils, "nixl_agent_config", None)
    if original is None or getattr(original, "_kairos_no_progress_thread", False):
        return  # NIXL not installed, or already applied in this process

    def agent_config(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return original(*args, **kwargs)

    agent_config._kairos_no_progress_thread = True  # type: ignore[attr-defined]
    nixl_utils.nixl_agent_config = agent_config
    worker = sys.modules.get(_WORKER_MODULE)
    if worker is not None:  # imported before us: it holds its own reference
        worker.nixl_agent_config = agent_config
    log.info("kairos: NIXL progress thread off (%s=0)", ENV)
