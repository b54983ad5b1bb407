"""One node's KV event stream kept in step with its prefix index: sequence numbers, gaps,
replays, restarts. Pure: the consumer (:mod:`extproc.kv_events`) feeds it what its sockets
receive and sends the replay requests it returns.

The rules, each keeping the index a subset of what the node holds (a missed ``BlockStored``
only under-counts; a missed ``BlockRemoved`` would over-count, so every hole resets):

- in step, batch ``last + 1`` is applied;
- a batch past ``last + 1`` is a gap: the node reads out of step (hits zero), live batches wait
  (at most ``max_pending``), and a replay from ``last + 1`` is asked for;
- the replay's batches and the waiting ones are applied in sequence order; a hole among them
  (batches the publisher no longer buffers, or waiting ones dropped) clears the index first;
- a batch at or below ``last`` comes from a restarted publisher (sequence numbers start at 0 in
  each process): the index is cleared and the stream starts over;
- a lost connection clears the index (a restart may hide behind it); a new connection asks for
  a replay from 0, which rebuilds what the publisher still buffers (all of it if it holds its
  first batch);
- a replay that fails (no replay socket, no answer in time) counts as one with nothing in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kairos.common import defaults
from kairos.common.kv_events import KvEventBatch
from kairos.core.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    start_seq: int  # the first sequence number wanted


class EventStreamSync:
    """Applies one node's batches to ``index`` in sequence order."""

    def __init__(
        self, index: PrefixIndex, node_id: str, max_pending: int = defaults.KV_EVENTS_MAX_PENDING_BATCHES
    ) -> None:
        self.index = index
        self.node_id = node_id
        self.max_pending = max_pending
        self.last_seq: int | None = None  # the last batch applied; None: nothing since a reset
        self.replaying: ReplayRequest | None = None
        self._pending: dict[int, KvEventBatch] = {}
        self.gaps = 0  # gaps and restarts seen, for metrics

    def on_connect(self, now: float) -> ReplayRequest | None:
        """A (re)connection: rebuild from the publisher's buffer unless already in step."""
        if self.last_seq is not None or self.replaying is not None:
            return None
        return self._ask(ReplayRequest(0))

    def on_disconnect(self, now: float) -> None:
        self.index.clear(self.node_id)
        self.last_seq = None
        self.replaying = None
        self._pending.clear()
        self.index.set_synced(self.node_id, True)  # empty is in step: it holds nothing wrong

    def on_live(self, seq: int, batch: KvEventBatch, now: float) -> ReplayRequest | None:
        """A batch from the PUB socket; returns the replay to ask for, if one is now needed."""
        if self.replaying is not None:
            self._hold(seq, batch)
            return None
        if self.last_seq is not None and seq <= self.last_seq:  # a restarted publisher
            self.gaps += 1
            self.index.clear(self.node_id)
            self.last_seq = None
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq == expected:
            self._apply(seq, batch, now)
            return None
        self.gaps += 1
        self._hold(seq, batch)
        return self._ask(ReplayRequest(expected))

    def on_replay(self, replies: Iterable[tuple[int, KvEventBatch]], now: float) -> None:
        """The replay's batches (all of them, up to its end marker), then the waiting ones."""
        if self.replaying is None:
            return
        expected = self.replaying.start_seq
        batches = {seq: b for seq, b in replies if seq >= expected}
        batches.update((seq, b) for seq, b in self._pending.items() if seq >= expected)
        self._pending.clear()
        self.replaying = None
        for seq in sorted(batches):
            if seq != expected:  # batches lost for good: what they removed is unknown
                self.index.clear(self.node_id)
            self._apply(seq, batches[seq], now)
            expected = seq + 1
        self.index.set_synced(self.node_id, True)

    def on_replay_failed(self, now: float) -> None:
        self.on_replay((), now)

    def _ask(self, request: ReplayRequest) -> ReplayRequest:
        self.replaying = request
        self.index.set_synced(self.node_id, False)
        return request

    def _hold(self, seq: int, batch: KvEventBatch) -> None:
        self._pending[seq] = batch
        if len(self._pending) > self.max_pending:
            del self._pending[min(self._pending)]

    def _apply(self, seq: int, batch: KvEventBatch, now: float) -> None:
        self.index.apply(self.node_id, batch.events, now)
        self.last_seq = seq
