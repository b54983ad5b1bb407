"""The fan-out at the decode sidecar: a batch's prompts and a request's ``n`` choices each back
through the gateway, one answer out.

vLLM runs a batch (several prompts in one ``/v1/completions`` body) as one engine request per
prompt, and ``n`` > 1 as ``n`` child requests per prompt. Each of those is a prefill the gateway
must place, but Envoy's ext_proc can only route a request or answer it whole: the dispatcher
validates the request as vLLM would and routes it here with ``x-kairos-route: fanout``; this sends
one request per prompt and choice (``n`` 1, a seeded one ``seed + j`` as vLLM seeds its children)
back through the gateway (``SidecarConfig.gateway``), where each gets a routing decision of its
own (keep on some prefill node, deflect to some decode node) exactly as if a client had sent it,
and merges the answers as vLLM answers the request (:mod:`kairos.api.batch`).

Why ``n`` > 1 too: on vLLM's P/D path (NixlConnector) the ``n`` child requests of a decode hop
all read the one prefill's KV blocks, and the prefill node frees them at the first reader's
notification: the others read blocks already freed (vLLM 0.32 logs "Potentially invalid KV
blocks for unrecognized request" on the prefill node for each). One request per choice gives
each its own prefill and transfer, and its own decision.

JSON: the parts are sent at once; the first that fails (its status >= 400, or a broken exchange)
is the answer and the others are abandoned (their connections closed, so their nodes abort them).
SSE: the stream opens once every part's head is in (a part that fails before its stream starts
is the answer, as above); then each part's chunks go out as they arrive, a part's error event
ends the stream (after ``[DONE]``, as vLLM's) and abandons the others.

Part ``i`` (prompt ``p``'s choice ``j`` at ``i = p * n + j``) carries ``x-request-id: <id>-i``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from kairos.api import batch
from kairos.api.openai_request import choices_per_prompt, completion_prompts, request_streams
from kairos.common import contracts as c
from kairos.common.contracts.api import CHAT_COMPLETIONS_PATH
from kairos.common.errors import KairosError
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError, error_body
from kairos.nodeagent.http1 import ConnectFailed, Http1Client, Http1Error, Response

log = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_ECHOED = (c.H_ROUTE, c.H_PROMPT_TOKENS)  # the dispatcher's headers on the request, for the client


class _PartFailed(Exception):
    """A part answered with an error status before its body: that answer is the request's."""

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        super().__init__(status)
        self.status, self.content_type, self.body = status, content_type, body


async def serve(
    request: web.Request,
    gateway: str,
    client: Http1Client,
    body: dict[str, Any],
    headers: CIMultiDict[str],
    rid: str,
    timeout_s: float,
) -> web.StreamResponse:
    """Answer ``body`` (a batch, or n > 1; validated by the dispatcher) by fanning it out through
    ``gateway`` (host:port); ``headers``: the client's, as the sidecar forwards them."""
    if not gateway:
        raise UpstreamError(
            "this sidecar cannot serve a batch or n > 1: it has no gateway address to send each prompt and "
            "choice through (start it with --gateway HOST:PORT, Envoy's listener)"
        )
    chat = request.path == CHAT_COMPLETIONS_PATH
    prompts = [] if chat else completion_prompts(body)
    per_prompt = batch.split(body, prompts) if len(prompts) > 1 else [body]
    n = choices_per_prompt(body)
    parts = [choice for each in per_prompt for choice in batch.split_choices(each, n)] if n > 1 else per_prompt
    target = request.raw_path if request.raw_path.startswith("/") else request.path
    fan = _FanOut(client, gateway, target, headers, rid, timeout_s, f"{'chatcmpl' if chat else 'cmpl'}-{rid}", n)
    echoed = {name: request.headers[name] for name in _ECHOED if name in request.headers}
    log.debug("request %s: %d prompts x %d choices, each through the gateway at %s", rid, len(per_prompt), n, gateway)
    try:
        if request_streams(body):
            return await fan.stream(request, parts, echoed)
        return await fan.whole(parts, echoed)
    except _PartFailed as failed:
        return web.Response(
            status=failed.status,
            body=failed.body,
            headers={"Content-Type": failed.content_type or "application/json", c.H_REQUEST_ID: rid, **echoed},
        )


class _FanOut:
    def __init__(
        self,
        client: Http1Client,
        gateway: str,
        target: str,
        headers: CIMultiDict[str],
        rid: str,
        timeout_s: float,
        response_id: str,
        parts_per_prompt: int,
    ) -> None:
        self.client, self.gateway, self.target = client, gateway, target
        self.rid, self.timeout_s = rid, timeout_s
        self.headers = CIMultiDict(headers)
        self.headers["Content-Type"] = "application/json"
        self.headers["Accept-Encoding"] = "identity"  # the parts' answers are parsed here
        self.response_id = response_id
        self.created = int(time.time())
        self.parts_per_prompt = parts_per_prompt  # the request's n: each part is one choice

    # -- one part ------------------------------------------------------------------------------
    async def _open(self, index: int, part: Mapping[str, Any]) -> Response:
        """Send part ``index``; its response once its head is in (a 2xx: a failure raises)."""
        headers = CIMultiDict(self.headers)
        headers[c.H_REQUEST_ID] = f"{self.rid}-{index}"
        data = orjson.dumps(part)
        try:
            async with asyncio.timeout(self.timeout_s):  # the gateway's answer to a part: its head
                resp = await self.client.open("POST", self.gateway, self.target, data, headers.items())
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"part {index} of the request: the gateway gave no answer within {self.timeout_s:g}s"
            ) from None
        except (Http1Error, OSError) as exc:
            what = f"cannot connect to the gateway at {self.gateway}" if isinstance(exc, ConnectFailed) else "failed"
            log.warning("request %s: part %d of the request: %s: %r", self.rid, index, what, exc)
            raise UpstreamError(f"part {index} of the request: {what} ({type(exc).__name__})") from None
        if resp.status >= 400:
            try:
                raw = await self._read_all(resp, index)
            finally:
                resp.close()
            log.info("request %s: part %d answered %d: the request's answer", self.rid, index, resp.status)
            raise _PartFailed(resp.status, resp.head.headers.get("content-type", ""), raw)
        return resp

    async def _read_all(self, resp: Response, index: int) -> bytes:
        chunks = []
        try:
            while chunk := await resp.read(self.timeout_s):
                chunks.append(chunk)
        except TimeoutError:
            raise UpstreamTimeoutError(f"part {index} of the request stalled for {self.timeout_s:g}s") from None
        except Http1Error as exc:
            raise UpstreamError(f"part {index} of the request broke off its answer ({type(exc).__name__})") from None
        return b"".join(chunks)

    async def _fetch(self, index: int, part: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        resp = await self._open(index, part)
        try:
            raw = await self._read_all(resp, index)
        finally:
            resp.close()
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamError(f"part {index} of the request: the answer is not JSON") from None
        if not isinstance(answer, dict) or not isinstance(answer.get(batch.CHOICES), list):
            raise UpstreamError(f"part {index} of the request: the answer is not a completion")
        return index, answer

    # -- JSON ----------------------------------------------------------------------------------
    async def whole(self, parts: list[dict[str, Any]], echoed: Mapping[str, str]) -> web.Response:
        tasks = [asyncio.create_task(self._fetch(i, part)) for i, part in enumerate(parts)]
        answers: list[dict[str, Any]] = [{}] * len(parts)
        try:
            for next_done in asyncio.as_completed(tasks):
                index, answer = await next_done  # the first failure raises: the request's answer
                answers[index] = answer
        finally:
            await _abandon(tasks)  # on a failure, the parts still running
        merged = batch.merge_responses(answers, self.response_id, self.created, self.parts_per_prompt)
        headers = {"Content-Type": "application/json", **self._headers(echoed)}
        return web.Response(body=orjson.dumps(merged), headers=headers)

    def _headers(self, echoed: Mapping[str, str]) -> dict[str, str]:
        """The answer's headers beside its content type: its id and the dispatcher's on it."""
        return {c.H_REQUEST_ID: self.rid, **echoed}

    # -- SSE -----------------------------------------------------------------------------------
    async def stream(
        self, request: web.Request, parts: list[dict[str, Any]], echoed: Mapping[str, str]
    ) -> web.StreamResponse:
        opening = [asyncio.create_task(self._open(i, part)) for i, part in enumerate(parts)]
        try:
            for next_open in asyncio.as_completed(opening):
                await next_open  # the first failure raises: the request's answer
        except BaseException:
            await _abandon(opening)
            raise
        responses = [task.result() for task in opening]
        readers: list[asyncio.Task[None]] = []
        try:
            out = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **self._headers(echoed)})
            await out.prepare(request)
            events: asyncio.Queue[tuple[int, bytes | BaseException | None]] = asyncio.Queue()
            readers = [asyncio.create_task(self._read_events(i, resp, events)) for i, resp in enumerate(responses)]
            merge = batch.StreamMerge(
                len(parts), self.response_id, self.created, parts_per_prompt=self.parts_per_prompt
            )
            with contextlib.suppress(ConnectionResetError):  # the client left: the finally abandons the parts
                await self._relay(out, events, merge, len(parts))
                await out.write_eof()
            return out
        finally:
            await _abandon(readers)
            for resp in responses:
                resp.close()  # before the end of its stream: the part's node aborts it

    async def _read_events(
        self, index: int, resp: Response, events: asyncio.Queue[tuple[int, bytes | BaseException | None]]
    ) -> None:
        """Put part ``index``'s SSE payloads on ``events`` as they come; then None (its end), or
        the error that broke it."""
        sse = batch.SseEvents()
        try:
            while chunk := await resp.read(self.timeout_s):
                for payload in sse.feed(chunk):
                    events.put_nowait((index, payload))
        except TimeoutError:
            events.put_nowait(
                (index, UpstreamTimeoutError(f"part {index} of the request stalled for {self.timeout_s:g}s"))
            )
            return
        except Http1Error as exc:
            events.put_nowait((index, UpstreamError(f"part {index} of the request broke off ({type(exc).__name__})")))
            return
        events.put_nowait((index, None))

    async def _relay(
        self,
        out: web.StreamResponse,
        events: asyncio.Queue[tuple[int, bytes | BaseException | None]],
        merge: batch.StreamMerge,
        parts: int,
    ) -> None:
        done = [False] * parts  # each part's [DONE] seen
        ended = 0
        while ended < parts:
            index, item = await events.get()
            if item is None:
                ended += 1
                if not done[index]:
                    await self._fail(out, UpstreamError(f"part {index} of the request ended before its [DONE]"))
                    return
                continue
            if isinstance(item, BaseException):
                await self._fail(out, item)
                return
            if item == b"[DONE]":
                done[index] = True
                continue
            try:
                payload = orjson.loads(item)
            except orjson.JSONDecodeError:
                await self._fail(out, UpstreamError(f"part {index} of the request sent an event that is not JSON"))
                return
            if batch.is_error_event(payload):
                log.info("request %s: part %d of the request failed mid-stream; ending its stream", self.rid, index)
                await out.write(b"data: " + item + b"\n\n" + batch.SSE_DONE)
                return
            merged = merge.chunk(index, payload)
            if merged is not None:
                await out.write(b"data: " + orjson.dumps(merged) + b"\n\n")
        usage = merge.usage_chunk()
        if usage is not None:
            await out.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await out.write(batch.SSE_DONE)

    async def _fail(self, out: web.StreamResponse, exc: BaseException) -> None:
        """End the stream with ``exc`` as vLLM ends one: an error event, then [DONE]."""
        message = exc.message if isinstance(exc, KairosError) else type(exc).__name__
        log.warning("request %s: %s; ending its stream", self.rid, message)
        await out.write(b"data: " + orjson.dumps(error_body(exc)) + b"\n\n" + batch.SSE_DONE)


async def _abandon(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the parts still running and wait for them; close the answers of those that got one
    (their nodes then abort them)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if task.cancelled() or task.exception() is not None:  # exception(): retrieved, not logged as lost
            continue
        if isinstance(result := task.result(), Response):
            result.close()
