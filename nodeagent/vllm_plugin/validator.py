"""Rejects a malformed chunk schedule (or TPOT SLO) in vLLM's API server, as an HTTP 400.

vLLM calls every installed logits processor's ``validate_params`` on each request before it
reaches the engine (entry point group ``vllm.logits_processors``); a ``ValueError`` there becomes
vLLM's ``VLLMValidationError`` and an HTTP 400 with its OpenAI error body, the message being the
ValueError's: ``{"error": {"message", "type": "BadRequestError", "param": null, "code": 400}}``
(on a streamed request, a 200 whose one event is that error). The emulated node answers the same
(``tests/component/test_schedule_parity.py``). The processor itself changes no logits.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kairos.common.contracts import parse_schedule_xargs, parse_tpot_xarg


class KairosScheduleValidator(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_schedule_xargs(sampling_params.extra_args)
        parse_tpot_xarg(sampling_params.extra_args)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Nothing to hold: validation runs on each request in the API server; logits stay as they are."""

    def is_argmax_invariant(self) -> bool:
        return True  # never touches logits, so greedy sampling may skip it

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
