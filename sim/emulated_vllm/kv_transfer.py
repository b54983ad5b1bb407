"""KV hold and pull: the node's part of the P/D two-hop protocol of vLLM's NixlConnector, both sides."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kairos.api.openai_request import NotFoundError, RequestError
from kairos.common import contracts as c
from kairos.common.errors import NoHealthyNodeError
from kairos.common.http_errors import UpstreamError, UpstreamTimeoutError
from kairos.core.latency import LatencyModels
from kairos.sim.emulated_vllm.config import EmulatedNodeConfig
from kairos.sim.emulated_vllm.responses import Output
from kairos.sim.emulated_vllm.validation import is_int
from kairos.sim.engine import Sequence as EngineSeq
from kairos.sim.realtime import RealtimeEngine, TokenStream

log = logging.getLogger(__package__)

KV_PULL_PATH = "/kairos/kv/pull"


@dataclass(slots=True, eq=False)
class PendingPull:
    """A decode hop from its arrival until its KV transfer ends (waiting for KV room, for the link,
    or transferring), as a decode node's state reports it."""

    tokens: int  # the prompt tokens whose KV it pulls: the whole prompt, or a split's first k
    rest: int  # a split's: the prompt tokens it prefills here once they land (l - k); 0 for a keep
    scheduled: bool  # the rest has a chunk schedule (a scheduled prefill, else a queued one)
    tpot_slo_s: float | None  # its TPOT SLO (None: the cluster's)


@dataclass(slots=True)
class HeldKV:
    """A prefill hop's KV, kept until the decode node pulls it or the hold times out."""

    seq: EngineSeq
    block_ids: list[int]
    expiry: asyncio.TimerHandle | None = None


class KvTransfer:
    """:class:`~kairos.sim.emulated_vllm.node.EmulatedNode`'s part of the P/D two-hop protocol
    (vLLM's NixlConnector): a prefill node holds a finished prefill hop's KV until a decode node
    pulls it (``POST /kairos/kv/pull``) or the hold times out; a decode node reserves room,
    claims the KV and waits its modelled transfer on its one inbound link."""

    # The node's, set by EmulatedNode (engine: its property, the running engine or a 503).
    config: EmulatedNodeConfig
    models: LatencyModels
    engine_id: str
    rt: RealtimeEngine | None
    http: aiohttp.ClientSession | None
    engine: RealtimeEngine
    _held: dict[int, HeldKV]
    _block_ids: Iterator[int]
    _transferring: int
    _pulls: list[PendingPull]
    _pull_started: float | None
    _link: asyncio.Lock

    # -- P/D: prefill side -------------------------------------------------------------------
    def _hold(self, out: Output, request: web.Request) -> dict[str, Any]:
        """Keep a finished prefill hop's KV for the decode node and say where it is. With n > 1
        each of vLLM's child requests holds its own and the answer names the one that finished
        last: the others' KV waits, unread, for the hold to time out (vLLM's lease)."""
        held = {choice: self._hold_kv(seq, request) for choice, seq in enumerate(out.seqs)}
        return held[out.finished[-1] if out.finished else len(out.seqs) - 1]

    def _hold_kv(self, seq: EngineSeq, request: web.Request) -> dict[str, Any]:
        n_blocks = max(1, -(-seq.prompt_tokens // self.config.block_size))
        block_ids = [next(self._block_ids) for _ in range(n_blocks)]
        held = HeldKV(seq, block_ids)
        held.expiry = asyncio.get_running_loop().call_later(self.config.kv_hold_timeout_s, self._expire, block_ids[0])
        self._held[block_ids[0]] = held
        # Where the decode side reaches us: the address this request came in on (right for
        # port 0 and for 0.0.0.0 binds alike).
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        host, port = (sock[0], sock[1]) if sock else (self.config.host, self.config.port)
        # vLLM 0.32's NixlConnector reply (pull_scheduler.request_finished), in its order: the
        # block ids per KV cache group (one here), and remote_num_tokens, the prompt tokens it
        # computed (num_computed_tokens: a split's k, where its prompt was the first k tokens).
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": seq.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": seq.prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            # vLLM 0.32's scheduler adds the prefill side's hit, for the decode side's usage
            # (prompt_tokens_details)
            "remote_prefill_cached_tokens": seq.cached_hit,
        }

    def _expire(self, key: int) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        log.warning(
            "node %s: KV of request %s (%d tokens) not pulled within %gs: released",
            self.config.node_id,
            held.seq.request_id,
            held.seq.prompt_tokens,
            self.config.kv_hold_timeout_s,
        )
        if self.rt is not None:
            self.rt.release(held.seq)

    async def kv_pull(self, request: web.Request) -> web.Response:
        """A decode node takes a held KV: validate, then free it when the modelled transfer ends."""
        rt = self.engine
        try:
            data = json.loads(await request.read())
        except ValueError:
            raise RequestError("the KV pull body is not valid JSON") from None
        if not isinstance(data, dict):
            raise RequestError("the KV pull body must be a JSON object")
        engine_id, groups, rid = data.get("remote_engine_id"), data.get("remote_block_ids"), data.get("request_id")
        held = None
        block_ids = groups[0] if isinstance(groups, list) and len(groups) == 1 else None  # one KV cache group
        if engine_id == self.engine_id and isinstance(block_ids, list) and block_ids:
            candidate = self._held.get(block_ids[0]) if isinstance(block_ids[0], int) else None
            if candidate is not None and candidate.block_ids == block_ids and rid in (None, candidate.seq.request_id):
                held = candidate
        if held is None:
            reason = (
                f"this node's engine id is {self.engine_id}, not {engine_id}"
                if engine_id != self.engine_id
                else "no KV is held for these block ids (never prefilled here, already pulled, or expired)"
            )
            log.info("node %s: KV pull for request %s refused: %s", self.config.node_id, rid or "-", reason)
            raise NotFoundError(f"node {self.config.node_id}: unknown KV transfer: {reason}")
        tokens = held.seq.prompt_tokens
        read = data.get("read_tokens", tokens)  # the decode side reads only the blocks it lacks
        if not is_int(read) or not 0 <= read <= tokens:
            raise RequestError(f"read_tokens must be an integer in 0..{tokens}", "read_tokens")
        del self._held[held.block_ids[0]]
        if held.expiry is not None:
            held.expiry.cancel()
        # The prefill node keeps the KV until the transfer has been read, as in the simulator.
        asyncio.get_running_loop().call_later(rt.wall_delay(self.models.kv_transfer_s(read)), rt.release, held.seq)
        log.debug(
            "node %s: KV of request %s (%d of %d tokens) pulled",
            self.config.node_id,
            held.seq.request_id,
            read,
            tokens,
        )
        return web.json_response({"prompt_tokens": tokens, "request_id": held.seq.request_id})

    # -- P/D: decode side --------------------------------------------------------------------
    async def _pull_kv(
        self, seq: EngineSeq, params: dict[str, Any], pull_tokens: int, rid: str, claim: bool = True
    ) -> TokenStream:
        """Reserve room, claim the KV of the prompt's first ``pull_tokens`` from the prefill node,
        wait the transfer, join the batch. The prompt's prefix this node caches is taken from its
        cache (vLLM's NixlConnector asks the connector only for the tokens past the local hit):
        only the rest crosses the link. A split (``pull_tokens`` short of the prompt: the prefill
        node computed only its first k tokens) then prefills the prompt's rest here, under the
        sequence's schedule, before it decodes. ``claim`` False: read KV another sequence of the
        request claimed (n > 1)."""
        rt = self.engine
        tokens = seq.prompt_tokens
        split = pull_tokens < tokens
        host = params["remote_host"]
        prefill = f"[{host}]:{params['remote_port']}" if ":" in host else f"{host}:{params['remote_port']}"
        wait_s = self.config.kv_hold_timeout_s  # as long as the prefill node holds the KV for us
        # Until its KV lands, a split shows as the vLLM plugin reports it: a pull of its k tokens and
        # a prefill of the rest with k computed (kairos.nodeagent.vllm_plugin.scheduler).
        pull = PendingPull(pull_tokens, tokens - pull_tokens, bool(seq.schedule), seq.tpot_slo_s)
        self._pulls.append(pull)
        try:
            try:
                missing = await asyncio.wait_for(rt.reserve_transfer(seq, pull_tokens if split else None), wait_s)
            except TimeoutError:
                raise NoHealthyNodeError(
                    f"node {self.config.node_id}: no KV room for {tokens} tokens within "
                    f"{self.config.kv_hold_timeout_s:g}s"
                ) from None
            self._transferring += 1
            try:
                async with self._link:
                    self._pull_started = rt.now()  # the state says how long the transfer has run
                    try:
                        if claim:
                            await self._claim(prefill, params, pull_tokens, missing, rid)
                        await asyncio.sleep(rt.wall_delay(self.models.kv_transfer_s(missing)))
                    finally:
                        self._pull_started = None
            except BaseException:
                rt.unreserve_transfer(seq)
                raise
            finally:
                self._transferring -= 1
        finally:
            self._pulls.remove(pull)
        return rt.accept_partial(seq, pull_tokens) if split else rt.accept_transferred(seq, missing)

    async def _claim(self, prefill: str, params: dict[str, Any], tokens: int, read: int, rid: str) -> None:
        """Claim the held KV of ``tokens`` prompt tokens, of which this node reads the last ``read``."""
        assert self.http is not None
        payload = {
            "remote_engine_id": params["remote_engine_id"],
            "remote_block_ids": params["remote_block_ids"],
            "request_id": params.get("remote_request_id"),
            "read_tokens": read,
        }
        url = f"http://{prefill}{KV_PULL_PATH}"
        try:
            async with self.http.post(url, json=payload, headers={c.H_REQUEST_ID: rid}) as resp:
                status, raw = resp.status, await resp.read()
        except TimeoutError:
            raise UpstreamTimeoutError(f"prefill node {prefill} did not answer the KV pull in time") from None
        except (aiohttp.ClientError, OSError) as exc:
            reason = exc.os_error if isinstance(exc, aiohttp.ClientConnectorError) else repr(exc)
            log.warning("request %s: KV pull from prefill node %s failed: %s", rid, prefill, reason)
            raise UpstreamError(f"cannot pull KV from prefill node {prefill}: {type(exc).__name__}") from None
        if status == 404:
            detail = _error_message(raw)
            log.info("request %s: prefill node %s does not hold the KV: %s", rid, prefill, detail)
            raise RequestError(
                f"{c.KV_TRANSFER_PARAMS} refer to KV that prefill node {prefill} does not hold ({detail})",
                c.KV_TRANSFER_PARAMS,
            )
        if status != 200:
            raise UpstreamError(f"prefill node {prefill} answered the KV pull with {status}: {_error_message(raw)}")
        try:
            pulled = json.loads(raw)["prompt_tokens"]
        except (ValueError, KeyError, TypeError):
            raise UpstreamError(f"prefill node {prefill} sent a malformed KV pull reply") from None
        if pulled != tokens:
            # The KV is claimed and will be freed on the prefill side; this request cannot use it.
            raise RequestError(
                f"the transferred KV holds {pulled} prompt tokens but {c.KV_TRANSFER_PARAMS} said {tokens}",
                c.KV_TRANSFER_PARAMS,
            )


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode("utf-8", "replace")
