"""``KairosScheduler``: vLLM's scheduler, plus the three things a Kairos node needs.

Start vLLM with ``--scheduler-cls kairos.nodeagent.vllm_plugin.scheduler.KairosScheduler``.

1. **Chunk schedules.** A request whose ``vllm_xargs`` carry ``kairos_chunk_schedule`` (a
   deflected prefill) gets at most the schedule's i-th size of prompt tokens in its i-th prefill
   step, the last size repeating. With ``kairos_step_budget_ms`` and a latency profile
   configured, a chunk is shrunk (or deferred a step) when the node's own model predicts its
   step over the budget for the batch the node has now: the dispatcher planned on a heartbeat
   up to 100 ms old, and decodes may have joined since. The step is costed with every token it
   carries (its decodes and every prefill chunk in it, scheduled or not), and a prefill after a
   budgeted chunk is held to that budget too (:class:`~kairos.core.latency.StepGuard`, the
   engine model's guard); a profile file is re-read when it changes, like the dispatcher's. The
   budget protects decodes' TBT, so it does not apply while no decode runs. At most one
   scheduled prefill advances per step, and a waiting one is skipped (not blocking the queue)
   while another is in progress: the dispatcher's decode-path TTFT assumes they run one after
   another. Requests without a schedule, and all decode work, are scheduled as vLLM does.
   A request's ``kairos_tpot_slo_ms`` (any request; none: the cluster's default TPOT) holds a
   chunk's budget to the tightest TPOT of the decodes running beside it
   (:func:`~kairos.core.slo.tau_scaled_budget_s`, as the engine model), and a decode node's
   state reports the tightest TPOT among its requests (``tpot_slo_ms``).

   With prefix caching (vLLM's default) the schedule covers the request's uncached tokens: its
   first size is the first step vLLM computes, from ``num_computed_tokens`` after the prefix
   hit (vLLM's hit is whole blocks and never the prompt's last token). The dispatcher plans the
   sizes to sum to the prompt less the hit it predicts from the node's KV events; the node
   takes whatever hit vLLM finds when it admits the request. A larger hit (blocks cached since
   the prediction) leaves fewer tokens: the schedule ends early, its last chunk holding what is
   left. A smaller hit (blocks evicted since) leaves more: the last size repeats. No chunk is
   ever larger than its planned size, and with a step budget each is held to the budget for
   the context it really runs over (a larger hit makes every chunk's attention costlier, which
   the guard prices; a smaller one only cheaper). The engine model runs the same rule.

   A split's hop 2 (the route's decode side: ``kv_transfer_params`` of a prefill node that
   computed the prompt's first k tokens, and the schedule of the rest) is the same: the node's
   connector (:mod:`.split_connector`) pulls the k tokens' KV, after which vLLM's
   ``num_computed_tokens`` is k and the schedule covers the tail from there. The pull computes
   nothing, so it starts on arrival even while another scheduled prefill is in progress; only
   the tail waits its turn. The state reports its k as a pending KV pull and its tail as a
   scheduled prefill.
2. **State reporter.** After each step (at most every ``state_refresh_s`` while busy, and at
   once when the request counts change) the engine state is snapshotted for the heartbeat
   publisher, served on loopback (:mod:`.state_server`).
3. **Step recorder** (off by default): wall time and composition of every step (:mod:`.recorder`).
4. **Step calibration.** With a profile, on a decode node, every step's wall time is compared
   with the profile's prediction for it (:class:`~kairos.core.calibration.StepCalibration`, the
   one the emulated node and the simulator run), and the engine state reports the upper quantile
   of actual / predicted; the dispatcher plans this node's steps to ``beta x tau`` divided by it.

The hook is ``Scheduler._reserve_prefill_lookahead``, which vLLM calls for every running and
waiting request after all its own token-budget clamping, so the cap composes with vLLM's
budget instead of replacing it. Step wall time is measured from the end of ``schedule()`` to
the start of ``update_from_output()``: the model forward in vLLM's synchronous engine loop
(this class is synchronous: vLLM turns async scheduling off for a custom scheduler class).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kairos.common.contracts import (
    ChunkPlan,
    EngineState,
    EngineStateError,
    EngineStep,
    MalformedSchedule,
    Role,
    StepChunk,
    encode_engine_state,
    overran_step_budget,
    parse_schedule_xargs,
    parse_tpot_xarg,
)
from kairos.common.errors import KairosError
from kairos.core.calibration import StepCalibration, predicted_step_s, prior_from_mape
from kairos.core.latency import LatencyModels, StepGuard, load_profile, profile_path
from kairos.nodeagent.vllm_plugin.config import PluginConfig
from kairos.nodeagent.vllm_plugin.engine_state import PendingPrefill, RequestTpots, build_state
from kairos.nodeagent.vllm_plugin.recorder import StepRecorder
from kairos.nodeagent.vllm_plugin.remote_prefix import split_prefix_tokens
from kairos.nodeagent.vllm_plugin.state_server import StateServer

log = logging.getLogger("vllm.kairos")  # under vLLM's logger, so it shows in its log

PROFILE_CHECK_S = 1.0


class KairosScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kairos = PluginConfig.from_env()
        self._plans: dict[str, ChunkPlan] = {}  # request id -> its chunk schedule
        self._chunk_steps: dict[str, int] = {}  # request id -> prefill steps it has had
        self._tpots = RequestTpots()  # request id -> its TPOT SLO
        self._running_tpot_s: float | None = None  # this step's decodes' tightest TPOT
        self._max_step_tokens = self.scheduler_config.max_num_batched_tokens
        self._model_name = self.vllm_config.model_config.served_model_name
        self._kv_capacity = int(self.cache_config.num_gpu_blocks or 0) * self.block_size
        # Per step, set at the start of schedule(): the guard over the step's tokens (None: no
        # profile, or no decode to protect).
        self._step_guard: StepGuard | None = None
        self._step_owner: str | None = None  # the scheduled prefill that advances this step
        self._scheduled_in_progress = False  # a scheduled prefill is running, mid-prompt
        self._guard: LatencyModels | None = load_profile(self.kairos.profile) if self.kairos.profile else None
        # A profile file is re-read when it changes (as the dispatcher does), checked at most
        # once a second from the scheduling loop: one stat() call.
        self._profile_file = profile_path(self.kairos.profile) if self.kairos.profile else None
        self._profile_stamp = _stamp(self._profile_file)
        self._profile_checked_at = time.monotonic()
        self._warned_no_guard = False
        self._calibration = (
            StepCalibration(prior=prior_from_mape(self._guard.mixed.mape))
            if self._guard is not None and self.kairos.role != Role.PREFILL
            else None
        )
        self._calibrating_step: tuple[float, int, int, tuple[StepChunk, ...]] | None = None
        self._recorder = (
            StepRecorder(self.kairos.step_ring, self.kairos.step_log or None, self.kairos.node_id)
            if self.kairos.recorder_on
            else None
        )
        self._step_index = 0
        self._pending_step: tuple[int, float, int, int, tuple[StepChunk, ...]] | None = None
        # A step that carries a budgeted chunk while decodes run: (start, decodes, budget s).
        self._budgeted_step: tuple[float, int, float] | None = None
        self._server = (
            StateServer(self.kairos.state_host, self.kairos.state_port, self._recorder)
            if self.kairos.state_port
            else None
        )
        self._last_state_at = 0.0
        self._last_counts: tuple[int, int] = (-1, -1)
        self._waiting_hits: dict[str, int] = {}  # request id -> its prefix hit, while it waits
        self._publish_state(force=True)
        log.info(
            "kairos scheduler: state %s, step recorder %s, step-budget profile %s",
            f"{self.kairos.state_host}:{self.kairos.state_port}" if self._server else "off",
            (self.kairos.step_log or "ring only") if self._recorder else "off",
            self.kairos.profile or "none (budgets not enforced)",
        )

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        extra = request.sampling_params.extra_args if request.sampling_params else None
        try:
            plan = parse_schedule_xargs(extra)
            tpot_s = parse_tpot_xarg(extra)
        except MalformedSchedule as exc:
            # The validator plugin answers this with a 400 in the API server; reaching here means
            # it is not installed. Running another schedule silently would be worse than failing.
            log.error("kairos: request %s aborted: %s", request.request_id, exc)
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            return
        if plan is not None:
            if max(plan.sizes) > self._max_step_tokens:
                log.warning(
                    "kairos: request %s: chunks over max_num_batched_tokens=%d run capped at it",
                    request.request_id,
                    self._max_step_tokens,
                )
            if plan.step_budget_s is not None and self._guard is None and not self._warned_no_guard:
                self._warned_no_guard = True
                log.warning("kairos: step budgets arrive but no profile is set (KAIROS_VLLM_PROFILE): not enforced")
            self._plans[request.request_id] = plan
            self._chunk_steps[request.request_id] = 0
        self._tpots.add(request.request_id, tpot_s)
        self._publish_state()

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._maybe_reload_profile()
        decodes = kv = 0
        in_progress = False
        decoding: list[str] = []
        for r in self.running:
            kv += r.num_computed_tokens
            if r.num_computed_tokens >= r.num_prompt_tokens:
                decodes += 1
                decoding.append(r.request_id)
            elif r.request_id in self._plans:
                in_progress = True
        self._running_tpot_s = self._tpots.tightest_s(decoding)
        self._step_guard = StepGuard(self._guard, decodes, kv) if self._guard is not None and decodes > 0 else None
        self._step_owner, self._scheduled_in_progress = None, in_progress

        output = super().schedule(*args, **kwargs)

        chunks: list[StepChunk] = []
        step_decodes = 0
        for rid, n in output.num_scheduled_tokens.items():
            request = self.requests[rid]
            cached = request.num_computed_tokens - n  # super() already advanced it by n
            if cached >= request.num_prompt_tokens:
                step_decodes += 1
                continue
            chunks.append(StepChunk(rid, n, cached))
            if rid in self._chunk_steps:
                self._chunk_steps[rid] += 1
        started = time.time()
        if self._recorder is not None and output.total_num_scheduled_tokens > 0:
            self._pending_step = (self._step_index, started, step_decodes, kv, tuple(chunks))
            self._step_index += 1
        if self._calibration is not None and output.total_num_scheduled_tokens > 0:
            self._calibrating_step = (started, step_decodes, kv, tuple(chunks))
        owner = self._plans.get(self._step_owner) if self._step_owner is not None else None
        self._budgeted_step = None
        if owner is not None and owner.step_budget_s is not None and step_decodes > 0:
            self._budgeted_step = (started, step_decodes, owner.step_budget_s)  # as carried: the plan's line
        return output

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if n == 0 or num_computed_tokens >= request.num_prompt_tokens:
            return n
        plan = self._plans.get(request.request_id)
        if plan is not None:
            if self._step_owner is not None and self._step_owner != request.request_id:
                return 0  # one scheduled prefill per step
            n = min(n, plan.cap(self._chunk_steps.get(request.request_id, 0)))
        if self._step_guard is not None:  # every prefill, scheduled or not, within the step's budgets
            n = self._step_guard.take(n, num_computed_tokens, self._chunk_budget_s(request.request_id, plan))
        if plan is not None and n > 0:
            self._step_owner = request.request_id
        return n

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        if not super()._handle_blocked_waiting_request(request):
            return False
        plan = self._plans.get(request.request_id)
        if plan is None or self._split_pull_starts(request):
            return True  # a split's pull computes nothing: it overlaps the prefill in progress
        if self._step_owner is not None or self._scheduled_in_progress:
            return False  # skipped this step: the queue behind it moves on
        # Deferring it here rather than in the hook keeps vLLM from stopping the waiting queue;
        # the first chunk runs over the prefix hit vLLM is about to find, so it is costed there.
        guard = self._step_guard
        budget_s = self._chunk_budget_s(request.request_id, plan)
        return guard is None or guard.room(1, self._computed_on_admission(request), budget_s) > 0

    def _chunk_budget_s(self, request_id: str, plan: ChunkPlan | None) -> float | None:
        """The step budget a request's chunk holds this step: its plan's, at its decodes' TPOT."""
        if plan is None:
            return None
        return self._tpots.chunk_budget_s(request_id, plan.step_budget_s, self._running_tpot_s)

    def _split_pull_starts(self, request: Request) -> bool:
        """A split's hop 2 whose admission starts the pull of its prefix (vLLM loads it between
        steps): the connector pulls split prefixes, and k goes past the node's own prefix hit."""
        params = request.kv_transfer_params
        if request.status != RequestStatus.WAITING or not params or not params.get("do_remote_prefill"):
            return False
        k = split_prefix_tokens(params, request.num_prompt_tokens)
        if k is None or not getattr(self.connector, "pulls_split_prefixes", False):
            return False
        return not request.skip_reading_prefix_cache and k > self.kv_cache_manager.get_computed_blocks(request)[1]

    def _computed_on_admission(self, request: Request) -> int:
        """The prompt tokens a waiting request starts from: its prefix hit, if vLLM has not looked
        it up yet (the same lookup as vLLM's admission, which has no side effects until then)."""
        if request.num_computed_tokens > 0 or _kv_arrives_by_transfer(request):
            return request.num_computed_tokens
        return self.kv_cache_manager.get_computed_blocks(request)[1]

    def _maybe_reload_profile(self) -> None:
        now = time.monotonic()
        if self._profile_file is None or now - self._profile_checked_at < PROFILE_CHECK_S:
            return
        self._profile_checked_at = now
        stamp = _stamp(self._profile_file)
        if stamp == self._profile_stamp:
            return
        self._profile_stamp = stamp
        try:
            self._guard = load_profile(self._profile_file)
        except KairosError as exc:  # a half-written file: keep the models we have
            kept = self._guard.name if self._guard else "none"
            log.error("kairos: profile reload rejected, keeping %s: %s", kept, exc)
            return
        if self._calibration is not None:  # measured against the old model: start again from the new one's prior
            self._calibration = StepCalibration(prior=prior_from_mape(self._guard.mixed.mape))
        log.info("kairos: step budgets now enforced with profile %s (%s)", self._guard.name, self._profile_file)

    # -- after each step ----------------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        ended = time.time()
        if self._pending_step is not None and self._recorder is not None:
            index, start, decodes, kv, chunks = self._pending_step
            self._pending_step = None
            self._recorder.record(EngineStep(index, start, ended - start, decodes, kv, chunks))
        if self._calibrating_step is not None and self._calibration is not None and self._guard is not None:
            start, decodes, kv, chunks = self._calibrating_step
            self._calibrating_step = None
            predicted = predicted_step_s(self._guard, Role.DECODE, decodes, kv, chunks)
            self._calibration.observe(predicted, ended - start)
        if self._budgeted_step is not None and self._server is not None:
            start, decodes, budget_s = self._budgeted_step
            self._budgeted_step = None
            calibration = 1.0 if self._calibration is None else self._calibration.value
            if overran_step_budget(decodes, (budget_s,), ended - start, calibration):
                self._server.count_step_budget_overrun()
        result = super().update_from_output(scheduler_output, model_runner_output)
        if len(self._plans) > len(self.requests) or any(rid not in self.requests for rid in self._plans):
            for rid in [r for r in self._plans if r not in self.requests]:
                del self._plans[rid]
                self._chunk_steps.pop(rid, None)
        self._tpots.keep_only(self.requests)
        self._publish_state()
        return result

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> Any:
        result = super().finish_requests(request_ids, finished_status)
        self._publish_state()
        return result

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._recorder is not None:
            self._recorder.close()
        super().shutdown()

    # -- state reporter -----------------------------------------------------------------------
    def _publish_state(self, force: bool = False) -> None:
        if self._server is None:
            return
        now = time.monotonic()
        counts = self._request_counts()
        if not force and counts == self._last_counts and now - self._last_state_at < self.kairos.state_refresh_s:
            return
        self._last_state_at, self._last_counts = now, counts
        try:
            state = self._snapshot(counts)
        except EngineStateError as exc:  # our bug must not stop the engine: the node leaves the cluster
            log.error("kairos: engine state withdrawn: %s", exc.message)
            self._server.publish(None)
            return
        self._server.publish(encode_engine_state(state).encode())

    def _request_counts(self) -> tuple[int, int]:
        running, waiting = self.get_request_counts()
        return running, waiting - len(self.deferred_waiting)  # as vLLM's num_requests_waiting

    def _snapshot(self, counts: tuple[int, int]) -> EngineState:
        decodes = kv = 0
        prefills: list[PendingPrefill] = []
        for r in self.running:
            kv += r.num_computed_tokens
            if r.num_computed_tokens >= r.num_prompt_tokens:
                decodes += 1
            else:
                prefills.append(self._pending(r))
        hits: dict[str, int] = {}
        # KV on its way from a prefill node: loading, then queued to load. No running_kv_pull_elapsed_s:
        # vLLM's connector reads the KV of every request waiting for it at once, not one transfer
        # after another on a FIFO link, so there is no one pull in flight to time (the dispatcher
        # takes the first as half done).
        pulls: list[int] = []
        for queue in (self.kv_holding_waiting, self.waiting):
            for r in queue:
                if _kv_arrives_by_transfer(r):
                    # A split pulls its first k tokens, then prefills the rest here.
                    k = split_prefix_tokens(r.kv_transfer_params, r.num_prompt_tokens)
                    pulls.append(r.num_prompt_tokens if k is None else k)
                    if k is not None:
                        prefills.append(PendingPrefill(r.num_prompt_tokens - k, r.request_id in self._plans, k))
                else:
                    # Its uncached work, as the dispatcher plans it: the hit looked up once,
                    # when the snapshot first sees it waiting (vLLM takes the hit on admission).
                    hit = self._waiting_hits.get(r.request_id)
                    hits[r.request_id] = hit if hit is not None else self._computed_on_admission(r)
                    prefills.append(self._pending(r, hits[r.request_id]))
        self._waiting_hits = hits
        return build_state(
            decode_tokens=decodes,
            kv_tokens=kv,
            kv_capacity_tokens=self._kv_capacity,
            prefills=prefills,
            max_step_tokens=self._max_step_tokens,
            model=self._model_name,
            running_requests=counts[0],
            waiting_requests=counts[1],
            kv_usage=self.kv_cache_manager.usage,
            step_calibration=None if self._calibration is None else self._calibration.value,
            kv_pulls=None if self.kairos.role == Role.PREFILL else pulls,
            tpot_slo_s=None if self.kairos.role == Role.PREFILL else self._tpots.tightest_s(self.requests),
            running_step_elapsed_s=self._next_step_elapsed_s(),
        )

    def _next_step_elapsed_s(self) -> float | None:
        """How long the step in flight has run at this snapshot, as far as the scheduler can see:
        approximate. vLLM's engine loop calls the scheduler only between steps (this class runs
        synchronously), so a snapshot never sees a step in flight; with requests running, the next
        one starts once this call returns (after schedule() and the inputs' preparation, a
        millisecond or so, which this leaves out), and the snapshot's queues still count its
        tokens: 0. None with none running (idle, or only waiting for KV room or a KV transfer):
        no step follows at once. The heartbeat publisher adds the time since the snapshot (as_of)."""
        return 0.0 if self.running else None

    def _pending(self, r: Request, computed: int | None = None) -> PendingPrefill:
        done = r.num_computed_tokens if computed is None else computed
        return PendingPrefill(r.num_prompt_tokens - done, r.request_id in self._plans, done)


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None


def _kv_arrives_by_transfer(r: Request) -> bool:
    """A decode hop of the keep or split path still waiting for its KV from the prefill node (a
    keep's whole prompt, no prefill here; a split's first k tokens, then the rest prefilled here)."""
    params = r.kv_transfer_params
    return r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or bool(params and params.get("do_remote_prefill"))
