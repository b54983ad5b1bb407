"""The engine model driven by wall time: the emulated vLLM node's step loop.

The :class:`~kairos.sim.engine.Engine` never reads a clock; the simulator advances it in virtual time,
and :class:`RealtimeEngine` advances the very same object in wall time (SimPy's
``RealtimeEnvironment`` idea): plan a step, sleep for its modelled duration divided by
``time_scale``, apply it, hand each sequence's tokens to whoever waits on them, plan the next.
With no work the loop parks on an event that ``submit`` sets.

Model time is ``(loop.time() - t0) * time_scale``. As in SimPy's non-strict realtime mode, a busy
engine's steps chain in model time: each ends at exactly ``start + duration`` and the next starts
there, while the loop sleeps until that end's wall deadline. Timer overshoot (epoll wakes on
whole milliseconds, which at 40x is 40 model ms) then costs nothing: the next, shorter sleep
catches up. Only when the loop falls further behind than ``MAX_LAG_S`` of wall time (the process is
starved) does the engine give up the lost time and resynchronise to the clock. An idle engine
starts its next step at the current model time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kairos.common.aio import cancel_and_wait
from kairos.common.contracts import StepField, encode_step_record, overran_step_budget
from kairos.common.kv_events import KvEventBatch
from kairos.sim.engine import Engine, Sequence, StepOutcome, StepPlan

log = logging.getLogger(__name__)

DEFAULT_STEP_LOG = 10_000  # steps kept for /kairos/steps (a few minutes of a busy node)
MAX_LAG_S = 0.05  # wall seconds the step chain may trail the clock before it resynchronises


class EngineStoppedError(RuntimeError):
    """The step loop is not running (stopped, or died on an internal error)."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One output token of one sequence, as the step that produced it ends."""

    index: int  # 1-based position of the token in this engine's output for the sequence
    at: float  # model time the step ended
    step: int  # engine step index that produced it
    last: bool  # the sequence finished on this engine with this token


class TokenStream:
    """The tokens of one sequence, in order; iteration ends after the last one."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._done = False

    def _put(self, item: TokenEvent | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.last:
            self._done = True
        return item


KvEventSink = Callable[[int, KvEventBatch], None]  # (sequence number, batch): a node's event publisher


class RealtimeEngine:
    """Runs one :class:`Engine` in wall time. Create and use it inside a running event loop.

    With ``kv_events``, the engine's prefix-cache changes are handed to it as vLLM's scheduler
    hands them to its publisher: one numbered batch per step that changed the cache (and one for
    a change between steps: a transfer's arrival, a released hold), stamped with unix time."""

    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        step_log_size: int = DEFAULT_STEP_LOG,
        kv_events: KvEventSink | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if not engine.track_tokens:
            raise ValueError("RealtimeEngine streams every token: build the Engine with track_tokens=True")
        self.engine = engine
        self.time_scale = time_scale
        self.steps: deque[dict[str, Any]] = deque(maxlen=step_log_size)
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = asyncio.Event()
        self._streams: dict[Sequence, TokenStream] = {}
        # Transfers waiting for KV room, FIFO like the simulator's link: each one's reservation
        # attempt (the tokens it reserved, or None while the node is too full) and its waiter.
        self._kv_waiters: deque[tuple[Callable[[], int | None], asyncio.Future[int]]] = deque()
        self._kv_events = kv_events
        if kv_events is not None:
            engine.record_kv_events()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self.resyncs = 0  # times the loop fell over MAX_LAG_S behind and dropped the lost time
        self.step_budget_overruns = 0  # steps over a deflected chunk's budget while decodes ran

    # -- clock -------------------------------------------------------------------------------
    def now(self) -> float:
        """Current model time (seconds since start, scaled)."""
        return (self._loop.time() - self._t0) * self.time_scale

    def wall_delay(self, model_seconds: float) -> float:
        """Wall seconds a model duration takes."""
        return model_seconds / self.time_scale

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.engine.config.node_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        self._fail_all(EngineStoppedError(f"engine {self.engine.config.node_id} stopped"))

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and self._failure is None

    def _check(self) -> None:
        if not self.running:
            raise EngineStoppedError(f"engine {self.engine.config.node_id} is not running ({self._failure!r})")

    # -- requests ----------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> TokenStream:
        """Queue a sequence for prefill (and decode) on this engine; returns its token stream."""
        self._check()
        stream = self._streams[seq] = TokenStream(seq)
        self.engine.submit(seq)
        self._wake.set()
        return stream

    async def reserve_kv(self, tokens: int) -> None:
        """Reserve KV room for an incoming transfer, waiting (FIFO) while the node is too full."""
        self._check()
        if tokens > self.engine.config.kv_capacity_tokens:
            raise ValueError(f"{tokens} tokens exceed the KV capacity of {self.engine.config.kv_capacity_tokens}")
        engine = self.engine

        def attempt() -> int | None:
            return tokens if engine.reserve_kv(tokens) else None

        await self._reserve(attempt, lambda _: self.unreserve_kv(tokens))

    async def reserve_transfer(self, seq: Sequence, transfer_tokens: int | None = None) -> int:
        """Reserve KV room for ``seq``'s prompt arriving by transfer, taking the prefix this node
        already caches (``Engine.reserve_transfer``; ``transfer_tokens``: a split's k, the
        leading tokens that come by transfer, the rest prefilled here), waiting (FIFO) while the
        node is too full: the tokens to transfer. Undo with ``unreserve_transfer``; then
        ``accept_transferred`` (the whole prompt) or ``accept_partial`` (a split)."""
        self._check()
        if seq.prompt_tokens > self.engine.config.kv_capacity_tokens:
            raise ValueError(
                f"{seq.prompt_tokens} tokens exceed the KV capacity of {self.engine.config.kv_capacity_tokens}"
            )
        engine = self.engine
        return await self._reserve(
            lambda: engine.reserve_transfer(seq, transfer_tokens), lambda _: self.unreserve_transfer(seq)
        )

    async def _reserve(self, attempt: Callable[[], int | None], undo: Callable[[int], None]) -> int:
        if not self._kv_waiters:
            reserved = attempt()
            if reserved is not None:
                self._publish_kv_events()  # the room may have evicted cached blocks
                return reserved
        fut: asyncio.Future[int] = self._loop.create_future()
        self._kv_waiters.append((attempt, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                undo(fut.result())  # granted just as the waiter went away
            else:
                self._kv_waiters = deque(w for w in self._kv_waiters if w[1] is not fut)
                self._pump_kv()  # a smaller request behind it may fit now
            raise

    def unreserve_kv(self, tokens: int) -> None:
        """Give back a reservation whose transfer will not happen (the pull failed)."""
        # The Engine has no call for this (the simulator's transfers never fail).
        self.engine.kv_reserved -= tokens
        self._pump_kv()
        self._wake.set()

    def unreserve_transfer(self, seq: Sequence) -> None:
        """Give back a ``reserve_transfer`` whose transfer will not happen (the pull failed)."""
        self.engine.unreserve_transfer(seq)
        self._pump_kv()
        self._wake.set()

    def accept_transferred(self, seq: Sequence, reserved_tokens: int) -> TokenStream:
        """A sequence whose prompt KV arrived: it decodes from the next step."""
        self._check()
        stream = self._streams[seq] = TokenStream(seq)
        self.engine.accept_transferred(seq, reserved_tokens)
        self._publish_kv_events()
        self._wake.set()
        return stream

    def accept_partial(self, seq: Sequence, transferred_tokens: int) -> TokenStream:
        """A split's sequence whose prompt's first ``transferred_tokens`` KV arrived: it prefills
        the rest here, under its schedule, then decodes (``Engine.accept_partial``)."""
        self._check()
        stream = self._streams[seq] = TokenStream(seq)
        self.engine.accept_partial(seq, transferred_tokens)
        self._publish_kv_events()
        self._wake.set()
        return stream

    def release(self, seq: Sequence) -> None:
        """Free the KV a finished hold_kv sequence kept (its transfer is done or abandoned)."""
        self.engine.release(seq)
        self._pump_kv()
        self._wake.set()  # freed KV may admit a waiting prompt

    def abort(self, seq: Sequence) -> None:
        """The client went away: stop generating for ``seq`` as soon as the engine allows.

        Removing a sequence from the engine's queues mid-step would break its KV bookkeeping,
        so instead its output is cut to the next token: a decoding sequence finishes (and frees
        its KV) at the end of the next step, a waiting or prefilling one right after its prefill.
        A finished hold_kv sequence's KV is the caller's to ``release``.
        """
        if seq.finished_at is None:
            seq.hold_kv = False  # nobody will pull a prefill hop's KV: free it when the prefill ends
            seq.output_tokens = max(1, min(seq.output_tokens, seq.generated + 1))
            self._wake.set()
        self._streams.pop(seq, None)

    # -- the step loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        last_end = 0.0
        try:
            while True:
                now = self.now()
                if last_end > 0 and now - last_end > MAX_LAG_S * self.time_scale:
                    self._note_resync(now - last_end)
                    last_end = now
                plan = self.engine.plan_step(last_end)
                if plan is None:
                    self._wake.clear()
                    await self._wake.wait()
                    last_end = max(last_end, self.now())  # idle time passed: start from the clock
                    continue
                duration = self.engine.step_duration(plan)
                end = last_end = plan.start + duration
                began = self._loop.time()
                delay = self._t0 + end / self.time_scale - began
                await asyncio.sleep(max(0.0, delay))
                # The step as its readers see it: from the previous step's tokens (or the wake) to
                # this one's, in model seconds. A loop that wakes late on a busy host stretches it
                # (and shortens the next, which catches up): the calibration learns that tail, as
                # a real node's measures its real steps.
                measured = (self._loop.time() - began) * self.time_scale
                outcome = self.engine.finish_step(plan, end, duration, measured)
                self._record(plan, duration)
                budgets = (c.seq.step_budget_s for c in plan.chunks)
                calibration = 1.0 if self.engine.calibration is None else self.engine.calibration.value
                if overran_step_budget(plan.decode_tokens, budgets, duration, calibration):
                    self.step_budget_overruns += 1
                self._dispatch(outcome)
                self._pump_kv()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine bug: fail the waiting requests loudly, do not hang them
            log.exception("engine %s: step loop died", self.engine.config.node_id)
            self._failure = exc
            self._fail_all(EngineStoppedError(f"engine {self.engine.config.node_id} failed: {exc!r}"))

    def _note_resync(self, lag: float) -> None:
        self.resyncs += 1
        if self.resyncs == 1 or self.resyncs % 100 == 0:
            log.warning(
                "engine %s: step loop fell %.0f ms (wall) behind the clock, model time resynchronised "
                "(%d times so far): the process is starved of CPU, step timing is not faithful",
                self.engine.config.node_id,
                lag / self.time_scale * 1e3,
                self.resyncs,
            )

    def _record(self, plan: StepPlan, duration: float) -> None:
        self.steps.append(encode_step_record(plan.record(duration)))

    def _dispatch(self, outcome: StepOutcome) -> None:
        end = outcome.plan.start + outcome.duration
        for seq in outcome.tokens_emitted:
            stream = self._streams.get(seq)
            if stream is None:
                continue  # aborted: nobody listens
            last = seq.finished_at is not None
            stream._put(TokenEvent(seq.generated, end, outcome.plan.index, last))
            if last:
                del self._streams[seq]

    def _pump_kv(self) -> None:
        """Grant the waiting transfers that fit now, in order; publish what the cache did."""
        while self._kv_waiters:
            attempt, fut = self._kv_waiters[0]
            if fut.done():
                self._kv_waiters.popleft()
                continue
            reserved = attempt()
            if reserved is None:
                break
            self._kv_waiters.popleft()
            fut.set_result(reserved)
        self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self._kv_events is not None:
            published = self.engine.publish_kv_events(time.time())  # vLLM stamps a batch with unix time
            if published is not None:
                self._kv_events(*published)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream._put(exc)
        self._streams.clear()
        for _, fut in self._kv_waiters:
            if not fut.done():
                fut.set_exception(exc)
        self._kv_waiters.clear()

    # -- reporting ---------------------------------------------------------------------------
    def steps_since(self, index: int) -> list[dict[str, Any]]:
        return [s for s in self.steps if s[StepField.INDEX] >= index]

    @property
    def pending_transfers(self) -> int:
        """Incoming KV transfers waiting for room on this node."""
        return len(self._kv_waiters)
