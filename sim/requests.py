"""The unit of work every workload, trace and simulator run shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as a workload or trace describes it (no routing state)."""

    request_id: str  # unique within a run, e.g. "bursty-000042"
    arrival_s: float  # seconds since the start of the run, non-decreasing in a trace
    prompt_tokens: int  # >= 1
    output_tokens: int  # >= 1, the completion length including the first token

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"{self.request_id}: output_tokens must be >= 1, got {self.output_tokens}")
        if self.arrival_s < 0:
            raise ValueError(f"{self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")
