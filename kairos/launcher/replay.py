"""``kairos replay``: replay a workload or a trace through a gateway, open loop, and measure it.

Every request is sent at its own arrival time (asyncio, one aiohttp session, no connection limit,
bodies built before the clock starts), so a slow server never delays later arrivals: the
offered load is the trace's. Each request is a streaming ``/v1/completions`` call whose
``max_tokens`` is the trace's output length and whose prompt has exactly the trace's prompt
length: token ids (vLLM, the emulated nodes and the dispatcher take a token-id prompt as given,
so the counts are exact and cost nothing to build), or text for a conversation. Its token blocks
repeat exactly as the workload's block hashes say, and a request without them shares no block
with another (:mod:`kairos.launcher.replay_prompts`).

Conversations (the ``multiturn`` workload, a JSONL trace with session and turn ids) are replayed
as conversations: each session's first turn at its arrival time, each later turn once the
previous answer has ended (plus the think time when the trace names the turn it waits for), its
prompt the previous prompt's text + the answer the server returned + a new message, so a prefix
cache sees each turn resend the conversation. Conversations need the model's tokenizer
(``--model-dir``): the answer comes back as text.

Per request the replay records the gateway's decision headers (``x-kairos-route``,
``x-kairos-decode-node``, ``x-kairos-reason``), TTFT (send to first content token), every
inter-token gap (TBT), the status, the usage and, where the server reports it,
``usage.prompt_tokens_details.cached_tokens``. The report gives the Kairos figures (P50/P95/P99
TTFT and TBT, SLO attainment per route, P95 TTFT of first and later turns, prefix hit rates per
route) and, per route, the figures of ``vllm bench serve`` and inference-perf with their own
definitions (TTFT, TPOT, ITL, E2EL, NTPOT, ``--goodput``; see
:mod:`kairos.launcher.serving_metrics`); ``--plots DIR`` draws them
(:mod:`kairos.launcher.replay_plots`).

Per-request SLOs: a request that carries its own (the ``interactive_batch`` workload's classes,
:data:`kairos.traffic.workloads.SLO_CLASS_MIXES`) is sent with them as ``x-slo-ttft-ms`` /
``x-slo-tpot-ms`` and judged by them (any other by ``--ttft-slo-s`` / ``--tbt-slo-ms``); the
report then gives attainment and goodput per SLO class, the simulator's definition
(:func:`kairos.sim.metrics.per_class_figures`), and records the class the gateway counted each in.

Time scale: emulated nodes started with ``--time-scale S`` run S times faster than real time.
Replay with the same ``--time-scale S``: arrivals are compressed by S (the trace's model time
``t`` is sent at wall time ``t / S``) and every reported time (TTFT, TBT, durations) is the
measured wall time multiplied by S, i.e. model time. The gateway's own overhead (Envoy, the
dispatcher, the sidecar, loopback HTTP) is scaled up by S too, so keep S modest when that
overhead matters. Timeouts (``--request-timeout``, ``--deadline``) are wall seconds.

Settings: defaults < ``--config`` YAML (section ``replay``) < ``KAIROS_REPLAY_*`` environment <
flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import numpy as np

from kairos.common import contracts as c
from kairos.common import defaults
from kairos.common.config import load_config
from kairos.common.contracts.api import COMPLETIONS_PATH
from kairos.common.contracts.routes import Route
from kairos.common.errors import ConfigError
from kairos.core.slo import DEFAULT_CLASSES, classify, meets_slo
from kairos.launcher.replay_prompts import PromptBuilder, Turn, chain_deadline, shared_prefix, turn_chains
from kairos.launcher.serving_metrics import Goodput, duration_s, field_metrics, format_field_metrics
from kairos.sim.metrics import per_class_figures
from kairos.traffic.requests import BLOCK_TOKENS, RequestSpec

ROUTES = tuple(route.value for route in Route)


@dataclass(frozen=True)
class ReplayConfig:
    """Everything ``kairos replay`` needs; YAML section ``replay``, env ``KAIROS_REPLAY_*``, flags."""

    url: str = "http://127.0.0.1:8000"  # the gateway
    model: str = "kairos-tiny-llama"
    model_dir: str = ""  # the served model's tokenizer dir (prompt tokens; "" = fixed ids, no conversations)
    workload: str = "bursty"  # synthetic workload, ignored when ``trace`` is set
    trace: str | None = None  # trace file (own JSONL, Azure CSV, Mooncake JSONL)
    rps: float | None = None  # workload rate, or the rate a trace is rescaled to (None = as is)
    duration_s: float | None = None  # model seconds of arrivals (workload default 60; trace: truncate)
    num_requests: int | None = None  # size by count instead (workload), or keep the first N (trace)
    seed: int = 1
    cv: float | None = None  # inter-arrival CV of the workload (None = its default)
    time_scale: float = 1.0  # the emulated nodes' time scale: arrivals / S, reported times x S
    ttft_slo_s: float = defaults.TTFT_SLO_S
    tbt_slo_ms: float = defaults.TBT_SLO_S * 1e3  # the flag's unit
    request_timeout_s: float = 300.0  # wall seconds per request
    deadline_s: float = 0.0  # wall seconds for the whole replay; 0 = last arrival + request_timeout_s
    goodput: tuple[str, ...] = ()  # vLLM's --goodput limits, e.g. ("ttft:4000", "tpot:70")

    def __post_init__(self) -> None:
        Goodput.parse(self.goodput)  # refuses what vllm bench serve would refuse
        for name in ("time_scale", "ttft_slo_s", "tbt_slo_ms", "request_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"replay {name} must be a positive number, got {value!r}")
        if self.deadline_s < 0:
            raise ConfigError(f"replay deadline_s must be >= 0, got {self.deadline_s}")
        if self.rps is not None and not self.rps > 0:
            raise ConfigError(f"replay rps must be > 0, got {self.rps}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ConfigError(f"replay duration_s must be > 0, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ConfigError(f"replay num_requests must be >= 1, got {self.num_requests}")
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"replay url must start with http:// or https://, got {self.url!r}")


@dataclass
class RequestResult:
    """What one replayed request saw; times are model seconds (wall x time_scale)."""

    request_id: str
    arrival_s: float  # when it was sent for (model time): the trace's arrival, or a later turn's release
    prompt_tokens: int  # the prompt's tokens as sent (the trace's; a later turn's, counted)
    output_tokens: int  # the trace's
    status: int = 0  # HTTP status, 0 = no response
    route: str = ""  # x-kairos-route ("" when absent)
    decode_node: str = ""
    reason: str = ""
    send_lag_ms: float = 0.0  # how late the request left versus its scheduled arrival (model ms)
    ttft_s: float | None = None
    e2e_s: float | None = None
    tbt_ms: list[float] = field(default_factory=list)  # every gap between consecutive content tokens
    tokens: int = 0  # content chunks received
    usage: dict[str, Any] | None = None
    error: str = ""
    # Its own SLOs as the workload gives them (sent as x-slo-ttft-ms / x-slo-tpot-ms; None: not
    # sent, judged by the replay's) and the class the gateway said it counted it in (x-kairos-slo-class).
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    slo_class: str = ""
    session_id: str | None = None  # its conversation, if any
    turn: int = 0  # its turn there, from 1 (0 outside any)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where reported
    # A later turn: how many leading tokens of the previous turn's prompt its own prompt kept
    # (all of them unless the answer merged into the previous prompt's last word).
    prefix_tokens: int | None = None
    previous_prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return (
            self.status == 200
            and not self.error
            and self.ttft_s is not None
            and self.usage is not None
            and self.usage.get("completion_tokens") == self.output_tokens
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tbt_ms"] = [round(x, 3) for x in self.tbt_ms]
        out["ok"] = self.ok
        return out


# ---------------------------------------------------------------------------------------------
# Traffic
# ---------------------------------------------------------------------------------------------
def requests_for(config: ReplayConfig) -> list[RequestSpec]:
    """The requests ``config`` describes, in arrival order."""
    from kairos.traffic.traces import load_trace, rescale_to_rate, truncate
    from kairos.traffic.workloads import SLO_CLASS_MIXES, make_workload

    if config.trace:
        reqs = load_trace(config.trace)
        if config.rps is not None:
            reqs = rescale_to_rate(reqs, config.rps)
        if config.duration_s is not None:
            reqs = truncate(reqs, config.duration_s)
        reqs = sorted(reqs, key=lambda r: r.arrival_s)
        return reqs[: config.num_requests] if config.num_requests else reqs
    if config.workload in SLO_CLASS_MIXES:
        return _class_mix(config)
    if config.num_requests is not None and config.duration_s is None:
        return make_workload(
            config.workload, rps=config.rps, num_requests=config.num_requests, seed=config.seed, cv=config.cv
        )
    reqs = make_workload(
        config.workload, rps=config.rps, duration_s=config.duration_s or 60.0, seed=config.seed, cv=config.cv
    )
    return reqs[: config.num_requests] if config.num_requests else reqs


def _class_mix(config: ReplayConfig) -> list[RequestSpec]:
    """A mixed-class workload (``SLO_CLASS_MIXES``): each class's stream at its share of
    ``--rps``; sized by duration (default 60 s), or its first ``num_requests`` arrivals."""
    from kairos.traffic.workloads import make_class_mix

    if config.rps is None:
        raise ConfigError(f"the {config.workload} workload needs --rps (the total rate of its classes)")
    if config.cv is not None:
        raise ConfigError(f"the {config.workload} workload takes no --cv: each class keeps its own workload's")
    duration = config.duration_s or 60.0
    while True:
        reqs = make_class_mix(config.workload, rps=config.rps, duration_s=duration, seed=config.seed)
        if config.num_requests is None:
            return reqs
        if len(reqs) >= config.num_requests or config.duration_s is not None:
            return reqs[: config.num_requests]
        duration = max(2 * duration, 1.5 * config.num_requests / config.rps)  # sized by count: long enough


def slo_headers(ttft_slo_s: float | None, tpot_slo_s: float | None) -> dict[str, str]:
    """The SLO headers of a request that carries its own SLOs (milliseconds; none for None)."""

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}".rstrip("0").rstrip(".")

    out: dict[str, str] = {}
    if ttft_slo_s is not None:
        out[c.H_SLO_TTFT_MS] = ms(ttft_slo_s)
    if tpot_slo_s is not None:
        out[c.H_SLO_TPOT_MS] = ms(tpot_slo_s)
    return out


# ---------------------------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------------------------
class _Progress:
    """One status line on stderr: redrawn in place on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.stream = stream
        self.sent = self.done = self.errors = 0
        self.deflections = 0
        self._tty = bool(stream is not None and stream.isatty())
        self._last = 0.0

    def show(self, elapsed_s: float, final: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if not final and not self._tty and now - self._last < 10.0:
            return
        self._last = now
        width = 24
        filled = int(width * self.done / max(self.total, 1))
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] sent {self.sent}/{self.total} done {self.done} "
            f"in-flight {self.sent - self.done} deflect {self.deflections} errors {self.errors} "
            f"{elapsed_s:6.1f} s"
        )
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _result(spec: RequestSpec) -> RequestResult:
    return RequestResult(
        spec.request_id, spec.arrival_s, spec.prompt_tokens, spec.output_tokens, session_id=spec.session_id,
        turn=spec.turn, ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s,
    )  # fmt: skip


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    res: RequestResult,
    body: bytes,
    scale: float,
    scheduled: float,
    timeout_s: float,
    progress: _Progress,
    answer: list[str] | None = None,
) -> RequestResult:
    """Send one request and fill ``res`` in; the streamed text goes to ``answer`` when given."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    res.send_lag_ms = max(0.0, sent - scheduled) * scale * 1e3
    progress.sent += 1
    last: float | None = None
    try:
        async with session.post(
            url,
            data=body,
            headers={
                "Content-Type": "application/json",
                c.H_REQUEST_ID: res.request_id,
                **slo_headers(res.ttft_slo_s, res.tpot_slo_s),
            },
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            res.route = resp.headers.get(c.H_ROUTE, "")
            res.decode_node = resp.headers.get(c.H_DECODE_NODE, "")
            res.reason = resp.headers.get(c.H_REASON, "")
            res.slo_class = resp.headers.get(c.H_SLO_CLASS, "")
            if res.route == Route.DEFLECT:
                progress.deflections += 1
            if resp.status != 200:
                raw = await resp.read()
                res.error = f"HTTP {resp.status}: {raw[:300].decode('utf-8', 'replace')}"
                return res
            async for raw_line in resp.content:
                line = raw_line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    break
                texts = [ch.get("text") or ch.get("delta", {}).get("content") for ch in event.get("choices") or []]
                if any(texts):
                    now = loop.time()
                    if last is None:
                        res.ttft_s = (now - sent) * scale
                    else:
                        res.tbt_ms.append((now - last) * scale * 1e3)
                    last = now
                    res.tokens += 1
                    if answer is not None:
                        answer.extend(t for t in texts if t)
                if event.get("usage"):
                    res.usage = event["usage"]
                    res.cached_tokens = _cached_tokens(event["usage"])
            res.e2e_s = (loop.time() - sent) * scale
            if res.usage is None and not res.error:
                res.error = "the stream ended without a usage chunk"
    except TimeoutError:
        res.error = f"timed out after {timeout_s:g} s (wall)"
    except (aiohttp.ClientError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        progress.done += 1
        if not res.ok:
            progress.errors += 1
    return res


async def replay_async(
    requests: Sequence[RequestSpec],
    config: ReplayConfig,
    stream: TextIO | None = sys.stderr,
) -> list[RequestResult]:
    """Send ``requests`` through ``config.url``: every chain of turns (a request outside any
    conversation is one) from its head's arrival time, open loop; one result per request, in
    arrival order."""
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    if not reqs:
        return []
    builder = PromptBuilder.from_model_dir(config.model_dir)
    chains = turn_chains(reqs)
    conversation = [len(chain) > 1 or chain[0].spec.session_id is not None for chain in chains]
    # Built before the clock starts: every head's prompt (text where a conversation continues it).
    heads: list[tuple[str | list[int], bytes]] = []
    for chain, is_conversation in zip(chains, conversation, strict=True):
        spec = chain[0].spec
        prompt: str | list[int] = builder.text(spec) if is_conversation else builder.ids(spec)
        heads.append((prompt, PromptBuilder.body(config.model, prompt, spec.output_tokens)))
    url = config.url.rstrip("/") + COMPLETIONS_PATH
    scale = config.time_scale
    first = reqs[0].arrival_s
    progress = _Progress(len(reqs), stream)
    loop = asyncio.get_running_loop()
    results: dict[str, RequestResult] = {}
    tasks: list[asyncio.Task[None]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        t0 = loop.time() + 0.05

        def wall(spec: RequestSpec) -> float:
            return t0 + (spec.arrival_s - first) / scale

        # Default: until every chain could have ended with each turn taking the request timeout.
        ends = (
            chain_deadline(chain, wall(chain[0].spec), [wall(t.spec) for t in chain], scale, config.request_timeout_s)
            for chain in chains
        )
        deadline = config.deadline_s or max(ends) - t0 + 5.0

        async def run_chain(chain: list[Turn], prompt: str | list[int], body: bytes, at: float) -> None:
            """Send the chain's turns one after the other; a turn whose predecessor failed is not
            sent (it would quote an answer that never came)."""
            answer: list[str] = []
            res = await _one(
                session, url, _result(chain[0].spec), body, scale, at, config.request_timeout_s, progress,
                answer if len(chain) > 1 else None,
            )  # fmt: skip
            results[res.request_id] = res
            ids = builder.ids(chain[0].spec) if len(chain) > 1 else []  # the head text's ids, by construction
            for k, turn in enumerate(chain[1:], start=1):
                if not res.ok:
                    for later in chain[k:]:
                        skipped = _result(later.spec)
                        skipped.error = f"not sent: the turn before it ({res.request_id}) failed"
                        results[skipped.request_id] = skipped
                        progress.done += 1
                        progress.errors += 1
                    return
                at = turn.release(loop.time(), wall(turn.spec), scale)
                # Built while the user thinks: the previous prompt, the answer, a new message.
                assert isinstance(prompt, str)
                prompt = builder.continuation(prompt, "".join(answer), turn)
                new_ids = builder.prompt_ids(prompt)
                nxt = _result(turn.spec)
                nxt.arrival_s = first + (at - t0) * scale
                nxt.prompt_tokens = len(new_ids)
                nxt.previous_prompt_tokens = len(ids)
                nxt.prefix_tokens = shared_prefix(ids, new_ids)
                body = PromptBuilder.body(config.model, prompt, turn.spec.output_tokens)
                ids, answer = new_ids, []
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                res = await _one(
                    session, url, nxt, body, scale, at, config.request_timeout_s, progress,
                    answer if k + 1 < len(chain) else None,
                )  # fmt: skip
                results[res.request_id] = res

        async def schedule() -> None:
            for chain, (prompt, body) in zip(chains, heads, strict=True):
                at = wall(chain[0].spec)
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_chain(chain, prompt, body, at)))

        async def ticker() -> None:
            while True:
                progress.show(loop.time() - t0)
                await asyncio.sleep(0.5)

        tick = asyncio.create_task(ticker())
        try:
            async with asyncio.timeout(deadline):
                await schedule()
                await asyncio.gather(*tasks, return_exceptions=True)
        except TimeoutError:
            pass  # the replay's deadline: requests still running are reported as not finished
        finally:
            tick.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(tick, *tasks, return_exceptions=True)
            progress.show(loop.time() - t0, final=True)
    for t in tasks:
        if not t.cancelled() and (exc := t.exception()) is not None:
            raise exc  # a bug, not a server's failure (those are results)
    out: list[RequestResult] = []
    for spec in reqs:
        res = results.get(spec.request_id)
        if res is None:
            res = _result(spec)
            res.error = f"not finished within the {deadline:g} s (wall) deadline"
        out.append(res)
    return out


def replay(
    requests: Sequence[RequestSpec], config: ReplayConfig, stream: TextIO | None = sys.stderr
) -> list[RequestResult]:
    """Blocking :func:`replay_async`."""
    return asyncio.run(replay_async(requests, config, stream))


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def _pcts(values: Sequence[float] | np.ndarray, prefix: str, unit: str) -> dict[str, float | None]:
    a = np.asarray(values, dtype=float)
    return {f"p{q}_{prefix}_{unit}": (float(np.percentile(a, q)) if a.size else None) for q in (50, 95, 99)}


def _own_slos(r: RequestResult, config: ReplayConfig) -> tuple[float, float]:
    """(TTFT SLO s, TPOT SLO ms) a request is judged by: its own where it carries them, else the replay's."""
    ttft = config.ttft_slo_s if r.ttft_slo_s is None else r.ttft_slo_s
    tpot_ms = config.tbt_slo_ms if r.tpot_slo_s is None else r.tpot_slo_s * 1e3
    return ttft, tpot_ms


def _meets_slo(r: RequestResult, config: ReplayConfig) -> bool:
    """TTFT within its SLO and the request's own P95 TBT within its tau (``kairos.core.slo.meets_slo``,
    the simulator's definition), by its own SLOs where it carries them; a failed request misses."""
    ttft_slo_s, tbt_slo_ms = _own_slos(r, config)
    return r.ok and meets_slo(r.ttft_s, ttft_slo_s, sum(1 for g in r.tbt_ms if g > tbt_slo_ms), len(r.tbt_ms))


def per_class(results: Sequence[RequestResult], config: ReplayConfig, span_s: float) -> dict[str, dict[str, Any]]:
    """Attainment and goodput by SLO class (the simulator's definition,
    :func:`kairos.sim.metrics.per_class_figures`) when any request carries SLOs of its own, else
    ``{}``. A request's class is read off the SLO pair it is judged by (``kairos.core.slo.classify``
    over the gateway's default classes); failed requests count in their class as missed."""
    if not any(r.ttft_slo_s is not None or r.tpot_slo_s is not None for r in results):
        return {}
    pairs = [_own_slos(r, config) for r in results]
    names = np.array([classify(ttft, tpot_ms / 1e3, DEFAULT_CLASSES) for ttft, tpot_ms in pairs])
    figures = per_class_figures(
        names,
        np.array([_meets_slo(r, config) for r in results], dtype=bool),
        np.array([r.output_tokens for r in results], dtype=np.int64),
        np.array([r.route == Route.DEFLECT for r in results], dtype=bool),
        np.array([math.nan if not r.ok or r.ttft_s is None else r.ttft_s for r in results], dtype=float),
        span_s,
        DEFAULT_CLASSES,
    )
    bounds = {k.name: k for k in DEFAULT_CLASSES}
    for name, group in figures.items():
        mine = [r for r, n in zip(results, names, strict=True) if n == name]
        group["errors"] = sum(not r.ok for r in mine)
        group["class_ttft_slo_s"] = bounds[name].ttft_s
        group["class_tpot_slo_ms"] = bounds[name].tpot_s * 1e3
    return figures


def _p95(values: Sequence[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def _group(results: Sequence[RequestResult], config: ReplayConfig) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.tbt_ms]
    # The prefix hit rate: cached prompt tokens over the prompt tokens of the requests whose
    # server reported them (None when none did).
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in reported)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        **_pcts(ttft, "ttft", "s"),
        **_pcts(gaps, "tbt", "ms"),
        "slo_attainment": (sum(_meets_slo(r, config) for r in results) / len(results) if results else None),
        # Conversations: first turns apart from later ones, which resend the conversation so far
        # (None where there are none).
        "p95_ttft_turn1_s": _p95([r.ttft_s for r in ok if r.turn == 1 and r.ttft_s is not None]),
        "p95_ttft_turn2plus_s": _p95([r.ttft_s for r in ok if r.turn >= 2 and r.ttft_s is not None]),
        "cached_tokens_reported": len(reported),
        "prefix_hit_rate": sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None,
    }


def summarize(results: Sequence[RequestResult], config: ReplayConfig) -> dict[str, Any]:
    """Overall and per-route figures (model time). Failed requests count against SLO attainment
    and are left out of the latency percentiles.

    The route says which node's cache a prefix hit is: on ``deflect`` the decode node prefilled
    the prompt, so its ``prefix_hit_rate`` is that decode node's own; on ``keep`` the answering
    decode node reports the prefill node's hit, which the prefill hop passes on in its
    ``kv_transfer_params`` (vLLM >= 0.31 and the emulated node; an older vLLM counts the KV it
    pulled as cached, near 100%)."""
    overall = _group(results, config)
    routes = sorted(
        {r.route for r in results} | set(ROUTES), key=lambda x: (ROUTES.index(x) if x in ROUTES else len(ROUTES), x)
    )
    by_route = {(name or "none"): [r for r in results if r.route == name] for name in routes}
    if not by_route.get("none"):
        by_route.pop("none", None)
    per_route = {name: _group(group, config) for name, group in by_route.items()}
    goodput = Goodput.parse(config.goodput)
    duration = duration_s(results)  # one benchmark duration: per-route rates share it
    field = {name: field_metrics(group, goodput, duration) for name, group in [("all", results), *by_route.items()]}
    ok = [r for r in results if r.ok]
    start = min((r.arrival_s for r in results), default=0.0)
    end = max(((r.arrival_s + (r.e2e_s or 0.0)) for r in ok), default=start)
    span = max(end - start, 1e-9)
    lags = [r.send_lag_ms for r in results]
    gaps = [g for r in ok for g in r.tbt_ms]
    # Later turns whose prompt kept the previous prompt's every full block as its token prefix.
    later = [r for r in results if r.prefix_tokens is not None and r.previous_prompt_tokens is not None]
    full_blocks = [(r.previous_prompt_tokens or 0) // BLOCK_TOKENS * BLOCK_TOKENS for r in later]
    broken = sum((r.prefix_tokens or 0) < blocks for r, blocks in zip(later, full_blocks, strict=True))
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0] if r.error else f"HTTP {r.status}"
            errors[key] = errors.get(key, 0) + 1
    return {
        **overall,
        "deflections": sum(r.route == Route.DEFLECT for r in results),
        "splits": sum(r.route == Route.SPLIT for r in results),
        "keeps": sum(r.route == Route.KEEP for r in results),
        "tbt_violation_rate": (sum(g > config.tbt_slo_ms for g in gaps) / len(gaps)) if gaps else None,
        "ttft_slo_s": config.ttft_slo_s,
        "tbt_slo_ms": config.tbt_slo_ms,
        "time_scale": config.time_scale,
        "span_s": span,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / span,
        "total_tokens_per_s": sum(r.output_tokens + r.prompt_tokens for r in ok) / span,
        "later_turns_sent": len(later),
        "later_turns_prefix_broken": broken,
        "max_send_lag_ms": max(lags, default=0.0),
        "error_kinds": errors,
        "per_route": per_route,
        **({"per_class": classes} if (classes := per_class(results, config, span)) else {}),
        "field": field,
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(summary: dict[str, Any]) -> str:
    """A small table: overall and per route."""
    head = f"{'':10}{'n':>6}{'err':>5}{'TTFT p50':>10}{'p95':>8}{'p99':>8}{'TBT p50':>10}{'p95':>8}{'p99':>8}{'SLO':>7}"
    lines = [head + "   (TTFT s, TBT ms, model time)"]
    rows = [("all", summary), *summary["per_route"].items()]
    for name, g in rows:
        slo = g["slo_attainment"]
        lines.append(
            f"{name:10}{g['requests']:>6}{g['errors']:>5}{_fmt(g['p50_ttft_s']):>10}{_fmt(g['p95_ttft_s']):>8}"
            f"{_fmt(g['p99_ttft_s']):>8}{_fmt(g['p50_tbt_ms'], 1):>10}{_fmt(g['p95_tbt_ms'], 1):>8}"
            f"{_fmt(g['p99_tbt_ms'], 1):>8}{('-' if slo is None else f'{slo:.1%}'):>7}"
        )
    lines.append(
        f"deflections {summary['deflections']}, splits {summary['splits']}, keeps {summary['keeps']}, "
        f"errors {summary['errors']}"
        + (f" {summary['error_kinds']}" if summary["error_kinds"] else "")
        + f"; SLO: TTFT <= {summary['ttft_slo_s']:g} s and own P95 TBT <= {summary['tbt_slo_ms']:g} ms"
        + (" (a request's own SLOs where it sends them)" if "per_class" in summary else "")
        + f"; max send lag {summary['max_send_lag_ms']:.1f} ms"
    )
    if "per_class" in summary:
        head = f"{'class':12}{'SLO s/ms':>10}{'n':>6}{'err':>5}{'SLO':>8}{'good/s':>8}{'tok/s':>9}"
        head += f"{'TTFT p95':>10}{'defl':>6}"
        lines.append(head + "   (per SLO class: attainment by its own SLOs; goodput: met requests/s, their tokens/s)")
        for name, g in summary["per_class"].items():
            bounds = f"{g['class_ttft_slo_s']:g}/{g['class_tpot_slo_ms']:g}"
            lines.append(
                f"{name:12}{bounds:>10}{g['requests']:>6}{g['errors']:>5}{g['slo_attainment']:>8.1%}"
                f"{g['goodput_rps']:>8.2f}{g['goodput_tokens_per_s']:>9.1f}{_fmt(g['p95_ttft_s']):>10}"
                f"{g['deflections']:>6}"
            )
    turns = summary["p95_ttft_turn1_s"] is not None or summary["p95_ttft_turn2plus_s"] is not None
    if turns or summary["cached_tokens_reported"]:
        head = f"{'':10}{'T1 P95':>10}{'T2+ P95':>9}{'hit %':>7}{'of n':>6}"
        lines.append(head + "   (TTFT s of turn 1 and turns >= 2; prefix hits where the server reports them)")
        for name, g in rows:
            hit = g["prefix_hit_rate"]
            lines.append(
                f"{name:10}{_fmt(g['p95_ttft_turn1_s']):>10}{_fmt(g['p95_ttft_turn2plus_s']):>9}"
                f"{('-' if hit is None else f'{100 * hit:.1f}'):>7}{g['cached_tokens_reported']:>6}"
            )
    if summary["later_turns_sent"]:
        kept = summary["later_turns_sent"] - summary["later_turns_prefix_broken"]
        lines.append(
            f"later turns sent {summary['later_turns_sent']}: {kept} kept the previous prompt's full blocks as their "
            "token prefix"
        )
    lines.append(format_field_metrics(summary["field"]))
    return "\n".join(lines)


def run(config: ReplayConfig, stream: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Replay what ``config`` describes; returns the JSON document (config, summary, requests)."""
    reqs = requests_for(config)
    if not reqs:
        raise ConfigError("the workload or trace holds no requests")
    started = time.time()
    results = replay(reqs, config, stream)
    return {
        "config": asdict(config),
        "started_unix": started,
        "wall_s": time.time() - started,
        "summary": summarize(results, config),
        "requests": [r.to_json() for r in results],
    }


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="replay a workload or trace through a gateway (open loop) and report TTFT/TBT per route",
        description="Send a workload or trace through a Kairos gateway at its arrival times and report TTFT, "
        "TBT and SLO attainment overall and per route. With --time-scale S (the emulated nodes' scale), "
        "arrivals are compressed by S and reported times are multiplied by S (model time). Settings: "
        "defaults < --config YAML (section 'replay') < KAIROS_REPLAY_* environment < flags.",
    )
    p.add_argument("--config", type=Path, help="YAML file with a 'replay' section")
    p.add_argument("--url", help="gateway base URL (default http://127.0.0.1:8000)")
    p.add_argument("--model", help="model name sent in each request")
    p.add_argument("--model-dir", help="the served model's tokenizer dir (builds the prompts; conversations need it)")
    p.add_argument(
        "--workload",
        help="bursty, lpld, lphd, hpld, hphd, azure_conv, multiturn (conversations) or interactive_batch "
        "(SLO classes: each request sends its class's x-slo-ttft-ms / x-slo-tpot-ms; needs --rps); default bursty",
    )
    p.add_argument(
        "--trace",
        help="trace file: own JSONL (session and turn ids replay as conversations), Azure CSV or Mooncake JSONL",
    )
    p.add_argument("--rps", type=float, help="workload rate, or the rate a trace is rescaled to")
    p.add_argument("--duration", dest="duration_s", type=float, help="model seconds of arrivals (workload: 60)")
    p.add_argument("--num-requests", type=int, help="size by count (workload) or keep the first N (trace)")
    p.add_argument("--seed", type=int)
    p.add_argument("--cv", type=float, help="inter-arrival coefficient of variation")
    p.add_argument("--time-scale", type=float, help="the emulated nodes' time scale (arrivals / S, times x S)")
    p.add_argument("--ttft-slo-s", type=float, help="TTFT SLO in seconds (default 4)")
    p.add_argument("--tbt-slo-ms", type=float, help="TBT SLO tau in ms (default 70)")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, help="wall seconds per request")
    p.add_argument("--deadline", dest="deadline_s", type=float, help="wall seconds for the whole replay")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="request goodput limits as vllm bench serve takes them: ttft:MS tpot:MS e2el:MS",
    )
    p.add_argument(
        "--plots", type=Path, metavar="DIR", help="write a TTFT CDF per route, TTFT over time and per-node load"
    )
    p.add_argument("--json", type=Path, help="write config, summary and per-request records here")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "url",
            "model",
            "model_dir",
            "workload",
            "trace",
            "rps",
            "duration_s",
            "num_requests",
            "seed",
            "cv",
            "time_scale",
            "ttft_slo_s",
            "tbt_slo_ms",
            "request_timeout_s",
            "deadline_s",
            "goodput",
        )
    }
    config = load_config(ReplayConfig, args.config, section="replay", env_prefix="KAIROS_REPLAY_", overrides=overrides)
    doc = run(config, None if args.quiet else sys.stderr)
    print(format_summary(doc["summary"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plots:
        from kairos.launcher.replay_plots import write_replay_plots

        for path in write_replay_plots(doc["requests"], args.plots, config.ttft_slo_s):
            print(f"wrote {path}")
    return 0 if doc["summary"]["errors"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kairos")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["replay", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
