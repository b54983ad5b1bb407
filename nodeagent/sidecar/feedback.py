"""The TTFT feedback publisher: each routed request's observed TTFT beside the dispatcher's prediction,
sent to the capped stream ``kairos:ttft-feedback`` without ever making a request wait."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kairos.common import contracts as c
from kairos.common.aio import cancel_and_wait
from kairos.common.redis_client import fail_fast_client, redact_url
from kairos.nodeagent.sidecar.metrics import SidecarMetrics

log = logging.getLogger(__package__)

# TTFT feedback: samples waiting for the writer (beyond this they are dropped, never waited for),
# the bound on one Redis round trip, and how long to drop samples after a failure before retrying.
FEEDBACK_QUEUE = 1000
FEEDBACK_TIMEOUT_S = 0.25
FEEDBACK_RETRY_S = 1.0
_FEEDBACK_BATCH = 100  # XADDs per pipelined round trip when samples queue up
# How long the writer lets samples gather after the first one before it sends them (unless a full
# batch is waiting): one round trip per 200 ms at most, not one per request. Each round trip is
# sidecar and Redis CPU beside the requests in flight (0.4 ms of a 2 KB keep request's p50 on a
# 2-core machine when sent per request; at one per 50 ms the feedback still cost 0.15 ms of
# sidecar CPU per request, a third of it less at 200 ms). The dispatchers' error metrics are
# rolling windows: a sample 200 ms late changes nothing there.
_FEEDBACK_LINGER_S = 0.2


class TtftFeedbackPublisher:
    """Sends TTFT samples to the feedback stream without ever making a request wait.

    :meth:`offer` only puts the sample on a bounded queue (full: dropped and counted); one writer
    task XADDs what is queued (``MAXLEN ~`` the contract's cap), pipelined, after letting samples
    gather for ``linger_s`` (one round trip per 200 ms at most rather than one per request).
    After a failed round trip the writer drops samples for ``retry_s`` before it tries again, so a
    dead Redis costs one failed attempt per second, not one per request. A failure is logged once
    per outage, and its end once.
    """

    def __init__(
        self,
        redis_url: str,
        metrics: SidecarMetrics,
        *,
        queue_size: int = FEEDBACK_QUEUE,
        timeout_s: float = FEEDBACK_TIMEOUT_S,
        retry_s: float = FEEDBACK_RETRY_S,
        linger_s: float = _FEEDBACK_LINGER_S,
    ) -> None:
        self.redis_url = redis_url
        self._linger_s = linger_s
        self._url = redact_url(redis_url)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._queue: asyncio.Queue[dict[str, str]] = asyncio.Queue(maxsize=queue_size)
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._down_since: float | None = None  # loop time of the first failure of this outage
        self._retry_at = 0.0
        self._lost = 0  # samples not sent during this outage

    def offer(self, rid: str, path: str, node: str, predicted_s: float, observed_s: float) -> None:
        """Queue one sample; never blocks, never raises."""
        f = c.TtftFeedbackField
        sample = {
            f.REQUEST_ID: rid,
            f.PATH: path,
            f.NODE: node,
            f.PREDICTED_MS: f"{predicted_s * 1e3:.3f}",
            f.OBSERVED_MS: f"{observed_s * 1e3:.3f}",
            f.MEASURED: c.TTFT_FEEDBACK_FIRST_TOKEN,
        }
        try:
            self._queue.put_nowait(sample)
        except asyncio.QueueFull:
            self._drop(1)

    async def start(self) -> None:
        # Fail fast, no hidden retries: a sample is worth less than the time a retry would take.
        self._client = fail_fast_client(self.redis_url, self._timeout_s)
        self._task = asyncio.create_task(self._run(), name="kairos-ttft-feedback")
        log.info(
            "TTFT feedback to %s stream %s (MAXLEN ~%d)",
            self._url,
            c.REDIS_TTFT_FEEDBACK_STREAM,
            c.TTFT_FEEDBACK_MAXLEN,
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            if self._linger_s > 0 and self._queue.qsize() < _FEEDBACK_BATCH - 1:
                await asyncio.sleep(self._linger_s)
            while len(batch) < _FEEDBACK_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            if loop.time() < self._retry_at:
                self._drop(len(batch))
                continue
            try:
                await self._send(batch)
            except (RedisError, OSError) as exc:  # OSError covers refused sockets and timeouts
                self._failed(exc, len(batch), loop.time())
            except Exception:  # a bug must not end the writer: the samples are lost, requests are not
                log.exception("TTFT feedback: sending %d samples failed unexpectedly", len(batch))
                self._metrics.ttft_feedback.labels("error").inc(len(batch))
            else:
                self._metrics.ttft_feedback.labels("sent").inc(len(batch))
                self._recovered(loop.time())

    async def _send(self, batch: list[dict[str, str]]) -> None:
        assert self._client is not None, "start() creates the client"
        async with self._client.pipeline(transaction=False) as pipe:
            for sample in batch:
                pipe.xadd(c.REDIS_TTFT_FEEDBACK_STREAM, sample, maxlen=c.TTFT_FEEDBACK_MAXLEN, approximate=True)
            await pipe.execute()

    def _drop(self, n: int) -> None:
        self._metrics.ttft_feedback.labels("dropped").inc(n)
        self._lost += n

    def _failed(self, exc: BaseException, n: int, now: float) -> None:
        self._metrics.ttft_feedback.labels("error").inc(n)
        self._lost += n
        self._retry_at = now + self._retry_s
        if self._down_since is None:
            self._down_since = now
            text = str(exc).strip()
            log.warning(
                "TTFT feedback: redis at %s failed (%s%s); dropping samples until it answers, retrying every "
                "%gs (requests are not affected; logged once per outage)",
                self._url,
                type(exc).__name__,
                f": {text}" if text else "",
                self._retry_s,
            )

    def _recovered(self, now: float) -> None:
        if self._down_since is not None:
            log.info(
                "TTFT feedback: redis at %s answers again after %.1fs; %d samples were lost",
                self._url,
                now - self._down_since,
                self._lost,
            )
            self._down_since = None
        self._lost = 0
