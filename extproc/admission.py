"""The dispatcher's admission gate: the budget of :mod:`kairos.core.admission` applied to
requests as they come, with a bounded line for those that find the cluster full.

A request that fits goes on at once (and counts as in flight until its decision is in the view:
:meth:`AdmissionGate.slot`). One that does not joins a line if it has room, and is let in as
seats free up: the line is checked every ``poll_s`` (half a heartbeat: seats free only when a
heartbeat says so). Past ``max_wait_s`` in line, or with the line full, it is refused with
:class:`~kairos.common.errors.OverloadedError` (a 429 with Retry-After), counted in
``kairos_dispatcher_shed_total`` by reason.

The line is ordered by the requests' own SLOs (kairos.core.slo), tightest TTFT first, then vLLM's
priority, then arrival: the loosest class waits longest. With the line full, a request tighter
than its loosest waiter takes that waiter's place, and the loosest is refused instead (reason
queue_full): under overload the loosest class is shed first. Requests with no SLOs of their own
all hold the cluster's: among them the line is FIFO, as before.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

from kairos.common.contracts import HEARTBEAT_PERIOD_S
from kairos.common.errors import OverloadedError
from kairos.core.admission import AdmissionLimits, Verdict, admission, in_flight, max_waiting, request_budget
from kairos.core.slo import DEFAULT_SLO, RequestSLO
from kairos.core.state import ClusterView
from kairos.extproc.metrics import DispatcherMetrics


class AdmissionGate:
    def __init__(
        self,
        view: Callable[[], ClusterView],
        metrics: DispatcherMetrics,
        limits: AdmissionLimits | None = None,
        poll_s: float = HEARTBEAT_PERIOD_S / 2,
    ) -> None:
        self._view = view
        self._metrics = metrics
        self.limits = limits or AdmissionLimits()
        self._poll_s = poll_s
        # Waiters, tightest first: (TTFT SLO, priority, arrival number, prompt tokens, future).
        self._line: list[tuple[float, int, int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._unseen = 0  # admitted, their decision not yet in the view
        self._pump: asyncio.Task[None] | None = None
        # Read at each scrape (the metrics server runs on this event loop): after a burst the
        # cluster drains with no request arriving, and the gauges must show that.
        metrics.admission_in_flight.set_function(lambda: in_flight(self._view()) + self._unseen)
        metrics.admission_budget.set_function(lambda: request_budget(self._view(), self.limits))

    @property
    def waiting(self) -> int:
        return sum(1 for *_, fut in self._line if not fut.done())

    @contextlib.asynccontextmanager
    async def slot(self, prompt_tokens: int, slo: RequestSLO | None = None) -> AsyncIterator[None]:
        """Hold a seat while the request is decided (the decision puts it in the view). ``slo``:
        the request's own SLOs, its place in line (None: the cluster's)."""
        await self._admit(prompt_tokens, slo or DEFAULT_SLO)
        try:
            yield
        finally:
            self._unseen -= 1

    async def _admit(self, prompt_tokens: int, slo: RequestSLO) -> None:
        view = self._view()
        verdict = self._check(view, prompt_tokens)
        if verdict is Verdict.ADMIT and not self._line:  # nobody ahead in line
            self._unseen += 1
            return
        entry_key = (slo.ttft_s, slo.priority, next(self._arrivals))
        if self.limits.max_wait_s <= 0:
            self._shed("queue_full", verdict)
        if self.waiting >= max_waiting(view, self.limits) and not self._displace(entry_key, verdict):
            self._shed("queue_full", verdict)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        bisect.insort(self._line, (*entry_key, prompt_tokens, fut), key=lambda e: e[:3])
        self._metrics.admission_waiting.set(self.waiting)
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._let_in())
        try:
            await asyncio.wait_for(fut, self.limits.max_wait_s)
        except TimeoutError:
            if not fut.done() or fut.cancelled():  # else let in as the time ran out: its seat is counted
                self._shed("wait_timeout", verdict)
        except asyncio.CancelledError:  # its client left (Envoy closed the stream)
            if fut.done() and not fut.cancelled():
                self._unseen -= 1  # let in just before: give the seat back
            raise
        finally:
            self._metrics.admission_waiting.set(self.waiting)
        self._metrics.admission_waited.inc()  # its seat was counted by _let_in

    def _check(self, view: ClusterView, prompt_tokens: int) -> Verdict:
        return admission(view, prompt_tokens, self.limits, self._unseen)

    async def _let_in(self) -> None:
        """Let waiters in, first come first, while the budget has room; until the line is empty."""
        while self._line:
            await asyncio.sleep(self._poll_s)
            view = self._view()
            while self._line:
                *_, prompt_tokens, fut = self._line[0]
                if fut.done():  # timed out, refused, or its client left
                    self._line.pop(0)
                    continue
                if self._check(view, prompt_tokens) is not Verdict.ADMIT:
                    break
                self._line.pop(0)
                self._unseen += 1
                fut.set_result(None)
            self._metrics.admission_waiting.set(self.waiting)

    def _displace(self, key: tuple[float, int, int], verdict: Verdict) -> bool:
        """With the line full: refuse its loosest waiter in favour of a request of ``key``, if that
        waiter is looser (its TTFT SLO, then priority; arrival never displaces). True: done."""
        for i in range(len(self._line) - 1, -1, -1):
            *loosest, _, fut = self._line[i]
            if fut.done():
                continue
            if tuple(loosest[:2]) <= key[:2]:
                return False
            del self._line[i]
            try:
                self._shed("queue_full", verdict)
            except OverloadedError as refused:
                fut.set_exception(refused)
            return True
        return False

    def _shed(self, reason: str, verdict: Verdict) -> None:
        self._metrics.shed.labels(reason=reason).inc()
        over = "KV tokens in flight" if verdict is Verdict.OVER_KV else "requests in flight"
        raise OverloadedError(
            f"the gateway is at capacity ({over}); retry after {self.limits.retry_after_s} s",
            self.limits.retry_after_s,
        )

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
