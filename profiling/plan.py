"""What a profiling collection runs, as pure data: the phases, their requests, their lengths.

Two kinds of phase (paper §5.1 and §3.2):

- a *trace* phase: Bursty-like requests (``kairos.traffic.workloads``) arriving at one rate. On a prefill
  node every request is a prefill hop (``max_tokens`` = 1), so its steps are prefill-only; on a
  decode node requests decode too, giving decode-only and mixed steps.
- a *microbenchmark* phase (decode nodes only): a fixed decode batch of B requests with K
  prompt tokens each, started first; once all decode, one prefill per chunk size chi is
  injected with the chunk schedule ``[chi - B] * 5`` (paper §3.2: each step then carries chi
  tokens, B decodes plus chi - B prefill tokens, over five successive chunks whose cached
  prefill grows), one after another.

The HTTP collector (:mod:`kairos.profiling.collect`) and the virtual-time driver
(``tests/synthetic_runs.py``, the profiler's end-to-end test) run the very same plans. Lengths are
in tokens; arrival times in model seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kairos.common.contracts import Role
from kairos.common.errors import ConfigError
from kairos.traffic.workloads import DEFAULT_MAX_CONTEXT, WORKLOAD_NAMES, make_workload

DEFAULT_RATES = (1.0, 2.0, 4.0)
DEFAULT_BATCH_SIZES = (4, 8, 16, 32)  # paper §3.2
DEFAULT_CONTEXTS = (842, 3569, 14013)  # paper §3.2 medians (998 and 13968 are near-duplicates)
DEFAULT_CHUNKS = (128, 256, 512, 1024, 2048)  # chi: total tokens per step
CHUNKS_PER_PROBE = 5  # successive chunks of one injected prefill


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float  # model seconds after the phase starts
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class TracePhase:
    name: str  # also the run file's stem, e.g. "trace-r2"
    rate: float  # requests per model second
    requests: tuple[TraceRequest, ...]
    kind: str = field(default="trace", init=False)

    def params(self) -> dict[str, object]:
        return {"rate": self.rate, "requests": len(self.requests)}


@dataclass(frozen=True, slots=True)
class Probe:
    """One injected prefill of a microbenchmark: ``chunks`` steps of ``chunk`` prompt tokens."""

    chi: int  # total step tokens the probe aims for (B decodes + chunk)
    chunk: int  # prompt tokens per step: chi - B
    chunks: int  # successive chunks (5, fewer when the prompt cap does not allow)

    @property
    def prompt_tokens(self) -> int:
        return self.chunk * self.chunks

    @property
    def schedule(self) -> list[int]:
        return [self.chunk] * self.chunks


@dataclass(frozen=True, slots=True)
class MicroPhase:
    name: str  # e.g. "micro-b16-k3569"
    batch: int  # B decode requests
    context: int  # K prompt tokens of each decode request
    decode_max_tokens: int  # long enough to outlast every probe; the collector cancels them after
    probes: tuple[Probe, ...]
    kind: str = field(default="micro", init=False)

    def params(self) -> dict[str, object]:
        return {"batch": self.batch, "context": self.context, "chi": [p.chi for p in self.probes]}


Phase = TracePhase | MicroPhase


@dataclass(frozen=True)
class PlanConfig:
    """What to run on one node."""

    role: str  # "prefill" or "decode"
    rates: tuple[float, ...] = DEFAULT_RATES  # one trace phase per rate (requests per model second)
    duration_s: float = 60.0  # model seconds of arrivals per trace phase
    workload: str = "bursty"  # kairos.traffic.workloads name for trace lengths and arrivals
    seed: int = 0
    max_model_len: int = DEFAULT_MAX_CONTEXT  # the node's context (prompt + output)
    # Longest prompt sent. Below the workload's context, every prompt (trace and microbenchmark
    # contexts) is scaled by max_prompt_tokens / 32768 and clipped to it, so the distributions keep
    # their shape on a small CPU model.
    max_prompt_tokens: int | None = None
    max_output_tokens: int = 1024  # trace completions are clipped to this
    micro: bool = True  # run the microbenchmark (decode role only)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    chunks: tuple[int, ...] = DEFAULT_CHUNKS

    def __post_init__(self) -> None:
        if self.role not in tuple(Role):
            raise ConfigError(f"role must be prefill or decode, got {self.role!r}")
        if self.workload.lower() not in WORKLOAD_NAMES:
            raise ConfigError(f"unknown workload {self.workload!r}; known: {', '.join(WORKLOAD_NAMES)}")
        if not all(r > 0 and math.isfinite(r) for r in self.rates):
            raise ConfigError(f"rates must be positive numbers, got {list(self.rates)}")
        if not self.duration_s > 0:
            raise ConfigError(f"duration_s must be > 0, got {self.duration_s}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_prompt_tokens is not None and not 1 <= self.max_prompt_tokens < self.max_model_len:
            raise ConfigError(
                f"max_prompt_tokens={self.max_prompt_tokens} must be in 1..max_model_len-1={self.max_model_len - 1}"
            )
        for name in ("batch_sizes", "contexts", "chunks"):
            values = getattr(self, name)
            if not all(isinstance(v, int) and v >= 1 for v in values):
                raise ConfigError(f"{name} must be positive integers, got {list(values)}")
        if self.max_output_tokens < 1:
            raise ConfigError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")

    @property
    def prompt_cap(self) -> int:
        return self.max_prompt_tokens or self.max_model_len - 1

    @property
    def length_scale(self) -> float:
        return min(1.0, self.prompt_cap / DEFAULT_MAX_CONTEXT)

    def scaled(self, tokens: int) -> int:
        return max(1, min(self.prompt_cap, round(tokens * self.length_scale)))


def _rate_label(rate: float) -> str:
    return f"{rate:g}".replace(".", "p")


def trace_phase(cfg: PlanConfig, rate: float, seed: int) -> TracePhase:
    specs = make_workload(cfg.workload, rps=rate, duration_s=cfg.duration_s, seed=seed)
    requests = []
    for s in specs:
        prompt = cfg.scaled(s.prompt_tokens)
        out = 1 if cfg.role == Role.PREFILL else max(1, min(s.output_tokens, cfg.max_output_tokens))
        requests.append(TraceRequest(s.arrival_s, prompt, min(out, cfg.max_model_len - prompt)))
    return TracePhase(f"trace-r{_rate_label(rate)}", rate, tuple(requests))


def micro_phase(cfg: PlanConfig, batch: int, context: int) -> MicroPhase | None:
    k = cfg.scaled(context)
    probes = []
    for chi in cfg.chunks:
        chunk = chi - batch
        chunks = min(CHUNKS_PER_PROBE, cfg.prompt_cap // chunk) if chunk > 0 else 0
        if chunks >= 1:
            probes.append(Probe(chi, chunk, chunks))
    if not probes or k >= cfg.max_model_len:
        return None
    # The decodes must still run when the last probe ends. The collector cancels them once the
    # probes are done, so ask for as long as the context allows: a starved client (or an emulated
    # node far ahead of it in model time) must not see the batch finish before the probes arrive.
    return MicroPhase(f"micro-b{batch}-k{context}", batch, k, cfg.max_model_len - k, tuple(probes))


def plan_phases(cfg: PlanConfig) -> list[Phase]:
    """Every phase, in run order: the traces (by rate), then the microbenchmark (by B, K)."""
    phases: list[Phase] = [trace_phase(cfg, rate, cfg.seed + i) for i, rate in enumerate(cfg.rates)]
    if cfg.role == Role.DECODE and cfg.micro:
        for b in cfg.batch_sizes:
            for k in cfg.contexts:
                phase = micro_phase(cfg, b, k)
                if phase is not None:
                    phases.append(phase)
    names = [p.name for p in phases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"phases {dupes} appear twice: give distinct rates, batch sizes and contexts")
    return phases
