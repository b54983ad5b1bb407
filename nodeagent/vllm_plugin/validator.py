"""Rejects a malformed chunk schedule (or TPOT SLO), and a split's decode hop on a node without
Kairos's split connector, in vLLM's API server, as an HTTP 400.

vLLM calls every installed logits processor's ``validate_params`` on each request before it
reaches the engine (entry point group ``vllm.logits_processors``); a ``ValueError`` there becomes
vLLM's ``VLLMValidationError`` and an HTTP 400 with its OpenAI error body, the message being the
ValueError's: ``{"error": {"message", "type": "BadRequestError", "param": null, "code": 400}}``
(on a streamed request, a 200 whose one event is that error). The emulated node answers the same
(``tests/component/test_schedule_parity.py``). The processor itself changes no logits.

**A split on a node that cannot take it.** Stock NixlConnector fails its engine core on a split's
decode hop (:mod:`kairos.common.contracts.split_refusal`); an operator's node may run it, with this package installed
(the validator registers by entry point) but without ``kv_connector_module_path``. There such a
hop is refused here, a 400 naming the fix, and the sidecar serves the request as a keep. Which
connector the engine runs is read once, at the first split decode hop the API server validates,
from its own config: ``validate_params`` is given no config, so it is taken from vLLM's caller, the input
processor (``InputProcessor._validate_params``, whose ``vllm_config`` is the engine's). Where it
cannot be found (another vLLM's call path), split hops are refused: a refused split is served as
a keep, a split let through could take the node down.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, ClassVar

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kairos.common.contracts import parse_schedule_xargs, parse_tpot_xarg
from kairos.common.contracts.split_refusal import (
    describe_connector,
    is_split_decode_hop,
    split_refusal,
    takes_split_hops,
)

log = logging.getLogger("vllm.kairos")  # under vLLM's logger, so it shows in its log

CALLER_DEPTH = 8  # frames above validate_params searched for vLLM's input processor


class KairosScheduleValidator(LogitsProcessor):
    # Decided once per API server process, at the first split decode hop it validates: None = not
    # yet; "" = the engine's connector pulls split prefixes; else the refusal's message.
    _split_refusal: ClassVar[str | None] = None

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        extra_args = sampling_params.extra_args
        parse_schedule_xargs(extra_args)
        parse_tpot_xarg(extra_args)
        if is_split_decode_hop(extra_args):
            if cls._split_refusal is None:
                cls._split_refusal = _engine_split_refusal(sys._getframe(1))
            if cls._split_refusal:
                raise ValueError(cls._split_refusal)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Nothing to hold: validation runs on each request in the API server; logits stay as they are."""

    def is_argmax_invariant(self) -> bool:
        return True  # never touches logits, so greedy sampling may skip it

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _engine_split_refusal(caller: Any) -> str:
    """The empty string when the engine's KV connector is Kairos's split connector, else the
    refusal (logged once): the engine's kv-transfer config, from the first caller frame whose ``self`` holds a
    ``vllm_config`` (vLLM's input processor), searched from ``caller`` up."""
    frame, config = caller, None
    for _ in range(CALLER_DEPTH):
        if frame is None:
            break
        vllm_config = getattr(frame.f_locals.get("self"), "vllm_config", None)
        if vllm_config is not None and hasattr(vllm_config, "kv_transfer_config"):
            config = vllm_config
            break
        frame = frame.f_back
    if config is None:
        message = split_refusal("its KV connector could not be read from vLLM's config")
        log.warning("kairos: vLLM's config is not in reach of the validator: split decode hops are refused")
        return message
    transfer = config.kv_transfer_config
    connector = getattr(transfer, "kv_connector", None)
    module_path = getattr(transfer, "kv_connector_module_path", None)
    if takes_split_hops(connector, module_path):
        log.info("kairos: the KV connector pulls split prefixes: split decode hops are served")
        return ""
    message = split_refusal(describe_connector(connector, module_path))
    log.warning("%s; split decode hops are refused with a 400 (the sidecar serves them as keeps)", message)
    return message
