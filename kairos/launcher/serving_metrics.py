"""Replay results in the field's own terms: the figures ``vllm bench serve`` and inference-perf
print, computed with their definitions, so a number from ``kairos replay`` can sit beside theirs.

Per request, with ``n`` the server's ``usage.completion_tokens``, ``ttft`` the time from send to
the first content chunk, ``e2el`` from send to the end of the stream and ``gaps`` the times
between consecutive content chunks (the replay's TBT list):

- vLLM (``vllm/benchmarks/serve.py``, ``calculate_metrics``):
  TPOT = (e2el - ttft) / (n - 1), only for n > 1 in its percentiles; ITL = every gap, pooled over
  requests; E2EL = e2el. Goodput (``--goodput ttft:MS tpot:MS e2el:MS``) counts the successful
  requests whose ttft, tpot (0 when n <= 1) and e2el are each <= the limit given, per second of
  the benchmark's duration.
- inference-perf (``reportgen/base.py``, ``compute_request_latency_metrics``): request latency
  = e2el; NTPOT = e2el / n; TPOT = (last token - first token) / (n - 1), the time to the *last
  content token* rather than the stream's end; ITL = every gap, pooled.

Times are model seconds (the replay's wall time x its time scale). Failed requests are counted
and left out of every latency, as both tools do. The benchmark's duration is from the first
arrival to the last response's end.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kairos.common.errors import ConfigError

#: Percentiles reported for every latency (vLLM's ``--metric-percentiles`` takes any list; these
#: cover its default of 99 and inference-perf's usual ones).
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what vLLM's --goodput accepts


class ReplayedRequest(Protocol):
    """What these figures read of one replayed request (``kairos.launcher.replay.RequestResult``)."""

    arrival_s: float
    prompt_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    tbt_ms: list[float]
    usage: dict[str, Any] | None

    @property
    def ok(self) -> bool: ...


@dataclass(frozen=True)
class Goodput:
    """Per-request limits in milliseconds (None: not checked), as ``--goodput ttft:MS tpot:MS``."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: Iterable[str]) -> Goodput:
        """``["ttft:500", "tpot:70"]`` -> limits; unknown names and non-positive values are refused
        with vLLM's own rules (a name from ttft/tpot/e2el, a number >= 0)."""
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in GOODPUT_METRICS:
                raise ConfigError(f"goodput: expected NAME:MS with NAME one of {list(GOODPUT_METRICS)}, got {item!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ConfigError(f"goodput: {name} needs a number of milliseconds, got {value!r}") from None
            if not (math.isfinite(ms) and ms >= 0):
                raise ConfigError(f"goodput: {name} must be a finite number >= 0, got {value!r}")
            limits[f"{name}_ms"] = ms
        return cls(**limits)

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def to_cli(self) -> list[str]:
        """The same limits as vLLM's ``--goodput`` arguments."""
        pairs = (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms))
        return [f"{name}:{ms:g}" for name, ms in pairs if ms is not None]


@dataclass(frozen=True)
class RequestLatencies:
    """One successful request's latencies in model seconds, by both tools' definitions."""

    output_tokens: int
    ttft_s: float
    e2el_s: float
    gaps_s: tuple[float, ...]

    @property
    def vllm_tpot_s(self) -> float:
        """0 for n <= 1, as vLLM's goodput counts it (its percentiles leave those requests out)."""
        n = self.output_tokens
        return (self.e2el_s - self.ttft_s) / (n - 1) if n > 1 else 0.0

    @property
    def last_token_s(self) -> float:
        return self.ttft_s + sum(self.gaps_s)

    @property
    def inference_perf_tpot_s(self) -> float | None:
        n = self.output_tokens
        return (self.last_token_s - self.ttft_s) / (n - 1) if n > 1 and self.gaps_s else None

    @property
    def ntpot_s(self) -> float:
        return self.e2el_s / self.output_tokens if self.output_tokens > 0 else 0.0


def latencies(r: ReplayedRequest) -> RequestLatencies | None:
    """The request's latencies, or None when it failed or carries no first token."""
    if not r.ok or r.ttft_s is None or r.e2e_s is None or r.usage is None:
        return None
    return RequestLatencies(
        output_tokens=int(r.usage.get("completion_tokens", 0)),
        ttft_s=r.ttft_s,
        e2el_s=r.e2e_s,
        gaps_s=tuple(g / 1e3 for g in r.tbt_ms),
    )


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and PERCENTILES in ms; None each when there is no value."""
    a = np.asarray(values_s, dtype=float) * 1e3
    if not a.size:
        return {"mean": None, "median": None, "std": None, **{f"p{q:g}": None for q in PERCENTILES}}
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        **{f"p{q:g}": float(np.percentile(a, q)) for q in PERCENTILES},
    }


def _good(lat: RequestLatencies, goodput: Goodput) -> bool:
    checks = ((goodput.ttft_ms, lat.ttft_s), (goodput.tpot_ms, lat.vllm_tpot_s), (goodput.e2el_ms, lat.e2el_s))
    return all(limit is None or value * 1e3 <= limit for limit, value in checks)


def duration_s(results: Sequence[ReplayedRequest]) -> float:
    """From the first arrival to the end of the last response (model seconds)."""
    if not results:
        return 0.0
    start = min(r.arrival_s for r in results)
    end = max(r.arrival_s + (r.e2e_s or 0.0) for r in results)
    return max(end - start, 0.0)


def field_metrics(results: Sequence[ReplayedRequest], goodput: Goodput, duration: float) -> dict[str, Any]:
    """``vllm`` and ``inference_perf`` sections for ``results`` (latencies in ms, rates per second
    of ``duration``)."""
    done = [(r, lat) for r in results if (lat := latencies(r)) is not None]
    lats = [lat for _, lat in done]
    completed = len(lats)
    total_input = sum(r.prompt_tokens for r, _ in done)
    total_output = sum(lat.output_tokens for lat in lats)

    def per_s(count: float) -> float | None:
        return count / duration if duration > 0 else None

    gaps = [g for lat in lats for g in lat.gaps_s]
    vllm = {
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "duration_s": duration,
        "request_throughput": per_s(completed),
        "request_goodput": per_s(sum(_good(lat, goodput) for lat in lats)) if goodput else None,
        "goodput": goodput.to_cli(),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "ttft_ms": _stats_ms([lat.ttft_s for lat in lats]),
        "tpot_ms": _stats_ms([lat.vllm_tpot_s for lat in lats if lat.output_tokens > 1]),
        "itl_ms": _stats_ms(gaps),
        "e2el_ms": _stats_ms([lat.e2el_s for lat in lats]),
    }
    ip_tpot = [t for lat in lats if (t := lat.inference_perf_tpot_s) is not None]
    inference_perf = {
        "count": completed,
        "failures": len(results) - completed,
        "request_latency_ms": _stats_ms([lat.e2el_s for lat in lats]),
        "time_to_first_token_ms": _stats_ms([lat.ttft_s for lat in lats]),
        "time_per_output_token_ms": _stats_ms(ip_tpot),
        "normalized_time_per_output_token_ms": _stats_ms([lat.ntpot_s for lat in lats]),
        "inter_token_latency_ms": _stats_ms(gaps),
        "input_tokens_per_sec": per_s(total_input),
        "output_tokens_per_sec": per_s(total_output),
        "requests_per_sec": per_s(completed),
    }
    return {"vllm": vllm, "inference_perf": inference_perf}


def _cell(stats: dict[str, float | None], key: str) -> str:
    value = stats[key]
    return "-" if value is None else f"{value:.1f}"


def format_field_metrics(by_route: dict[str, dict[str, Any]]) -> str:
    """One row per route (vLLM's definitions; inference-perf's NTPOT beside them), in ms."""
    head = (
        f"{'':10}{'n':>6}{'TTFT mean':>11}{'med':>8}{'p99':>8}{'TPOT mean':>11}{'med':>8}{'p99':>8}"
        f"{'ITL mean':>10}{'p99':>8}{'E2EL med':>10}{'p99':>9}{'NTPOT med':>11}{'goodput/s':>11}"
    )
    lines = [head + "   (ms, model time; vllm bench serve / inference-perf definitions)"]
    for name, doc in by_route.items():
        v, ip = doc["vllm"], doc["inference_perf"]
        good = v["request_goodput"]
        lines.append(
            f"{name:10}{v['completed']:>6}{_cell(v['ttft_ms'], 'mean'):>11}{_cell(v['ttft_ms'], 'median'):>8}"
            f"{_cell(v['ttft_ms'], 'p99'):>8}{_cell(v['tpot_ms'], 'mean'):>11}{_cell(v['tpot_ms'], 'median'):>8}"
            f"{_cell(v['tpot_ms'], 'p99'):>8}{_cell(v['itl_ms'], 'mean'):>10}{_cell(v['itl_ms'], 'p99'):>8}"
            f"{_cell(v['e2el_ms'], 'median'):>10}{_cell(v['e2el_ms'], 'p99'):>9}"
            f"{_cell(ip['normalized_time_per_output_token_ms'], 'median'):>11}"
            f"{('-' if good is None else f'{good:.2f}'):>11}"
        )
    return "\n".join(lines)
