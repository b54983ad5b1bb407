"""The engine model: batching, chunk schedules, KV admission, and the node-side step guard."""

from __future__ import annotations

import pytest

from kairos.common.contracts import Role
from kairos.core.latency import load_profile
from kairos.core.state import PrefillNodeState
from kairos.sim.engine import Engine, EngineConfig, Sequence, StepPlan, model_step_time

MODELS = load_profile()


def fixed_timer(role: Role, plan: StepPlan) -> float:
    return 0.05


def run_steps(engine: Engine, n: int, start: float = 0.0) -> list[StepPlan]:
    plans, t = [], start
    for _ in range(n):
        plan = engine.plan_step(t)
        if plan is None:
            break
        t += 0.05
        engine.finish_step(plan, t, 0.05)
        plans.append(plan)
    return plans


def make(role: Role = Role.PREFILL, budget: int = 2048, kv: int = 100_000, guard: bool = False) -> Engine:
    return Engine(EngineConfig("n0", role, budget, kv), fixed_timer, MODELS if guard else None)


def test_prefill_chunks_fill_the_budget_in_fifo_order() -> None:
    engine = make()
    a, b = Sequence("a", 3000, 1, hold_kv=True), Sequence("b", 1000, 1, hold_kv=True)
    engine.submit(a)
    engine.submit(b)
    plans = run_steps(engine, 5)
    assert [[(c.seq.request_id, c.tokens, c.cached) for c in p.chunks] for p in plans] == [
        [("a", 2048, 0)],
        [("a", 952, 2048), ("b", 1000, 0)],
    ]
    assert a.first_token_at == pytest.approx(0.10) and b.first_token_at == pytest.approx(0.10)
    # Prefill hops keep their KV until the transfer is done, then release it.
    assert engine.kv_used == 3001 + 1001
    engine.release(a)
    engine.release(b)
    assert engine.kv_used == 0


def test_transferred_request_decodes_its_tokens_then_frees_kv() -> None:
    engine = make(Role.DECODE)
    assert engine.reserve_kv(500)
    seq = Sequence("r", 500, 3)
    engine.accept_transferred(seq, reserved_tokens=500)
    plans = run_steps(engine, 10)
    assert [p.decode_tokens for p in plans] == [1, 1, 1]
    assert [p.new_decoders for p in plans] == [1, 0, 0]
    assert seq.first_decode_step == 0 and seq.generated == 3 and seq.finished_at == pytest.approx(0.15)
    assert engine.kv_used == 0 and engine.kv_reserved == 0


def test_a_split_request_takes_its_prefix_by_transfer_and_prefills_the_rest_by_its_schedule() -> None:
    engine = make(Role.DECODE, budget=4096)
    engine.accept_transferred(Sequence("dec", 1000, 100), 0)
    waiting = Sequence("waiting", 300, 2, schedule=(100,))  # a deflection the KV cannot hold yet
    split = Sequence("split", 1000, 3, schedule=(256, 128))
    assert engine.reserve_transfer(split, transfer_tokens=512) == 512  # only the prefix is pulled
    assert engine.kv_reserved == 1000  # room for the whole prompt: the rest is prefilled here
    engine.submit(waiting)
    engine.accept_partial(split, 512)
    assert engine.kv_reserved == 0 and engine.kv_used == 1000 + 512 and split.computed == 512
    # Admitted at once, ahead of the scheduled prefill still waiting (the queue the heartbeat reports).
    assert engine.snapshot().scheduled_prefill_tokens == (488, 300)
    plans = run_steps(engine, 6)
    chunks = [[(c.seq.request_id, c.tokens, c.cached) for c in p.chunks] for p in plans]
    assert [c for c in chunks if c and c[0][0] == "split"] == [
        [("split", 256, 512)],
        [("split", 128, 768)],
        [("split", 104, 896)],
    ]
    assert split.first_token_at is not None and split.generated >= 1


def test_a_failed_pull_gives_back_the_whole_reservation_of_a_keep_or_a_split() -> None:
    engine = make(Role.DECODE)
    keep, split = Sequence("keep", 700, 2), Sequence("split", 1000, 2, schedule=(256,))
    assert engine.reserve_transfer(keep) == 700
    assert engine.reserve_transfer(split, transfer_tokens=512) == 512  # pulls 512, holds room for 1000
    assert engine.kv_reserved == 1700
    engine.unreserve_transfer(split)
    assert engine.kv_reserved == 700  # none of the split's rest left reserved
    engine.unreserve_transfer(keep)
    assert engine.kv_reserved == 0 and engine.free_kv_tokens == engine.config.kv_capacity_tokens


def test_request_joining_while_a_step_runs_is_not_part_of_it() -> None:
    engine = make(Role.DECODE)
    first = Sequence("first", 100, 2)
    engine.accept_transferred(first, 0)
    plan = engine.plan_step(0.0)
    assert plan is not None
    engine.accept_transferred(Sequence("late", 100, 2), 0)
    out = engine.finish_step(plan, 0.05, 0.05)
    assert [s.request_id for s in out.first_tokens] == ["first"]
    nxt = engine.plan_step(0.05)
    assert nxt is not None and nxt.decode_tokens == 2 and nxt.new_decoders == 1


def test_deflected_prefill_follows_its_schedule_and_repeats_the_last_size() -> None:
    engine = make(Role.DECODE, budget=4096)
    engine.accept_transferred(Sequence("dec", 1000, 100), 0)
    deflected = Sequence("x", 1100, 2, schedule=(500, 300))
    engine.submit(deflected)
    plans = run_steps(engine, 5)
    sizes = [[c.tokens for c in p.chunks] for p in plans]
    assert sizes[:4] == [[500], [300], [300], []]
    # The step that finishes the prompt emits the first token; the request then decodes.
    assert deflected.first_decode_step == 2 and plans[3].decode_tokens == 2


def test_only_one_deflected_prefill_advances_per_step() -> None:
    engine = make(Role.DECODE, budget=4096)
    engine.submit(Sequence("x", 400, 2, schedule=(200,)))
    engine.submit(Sequence("y", 400, 2, schedule=(200,)))
    plans = run_steps(engine, 4)
    assert [[c.seq.request_id for c in p.chunks] for p in plans][:3] == [["x"], ["x"], ["y"]]


def test_admission_waits_for_kv_capacity() -> None:
    engine = make(kv=3000)
    engine.submit(Sequence("a", 2000, 1, hold_kv=True))
    engine.submit(Sequence("b", 1500, 1, hold_kv=True))
    plans = run_steps(engine, 3)
    assert [[c.seq.request_id for c in p.chunks] for p in plans] == [["a"]]  # b does not fit
    engine.release(engine_seq := plans[0].chunks[0].seq)
    assert engine_seq.request_id == "a"
    assert [[c.seq.request_id for c in p.chunks] for p in run_steps(engine, 3)] == [["b"]]


def test_snapshot_reports_queues_batch_and_kv() -> None:
    engine = make(Role.DECODE, budget=4096)
    engine.accept_transferred(Sequence("d", 700, 5), 0)
    engine.submit(Sequence("x", 900, 2, schedule=(400,)))
    run_steps(engine, 1)
    snap = engine.snapshot()
    assert snap.decode_tokens == 1
    assert snap.scheduled_prefill_tokens == (500,)
    assert snap.queued_prefill_tokens == ()
    assert snap.kv_tokens == 700 + 1 + 400


def test_snapshot_of_a_mixed_queue_keeps_each_kind_in_fifo_order_as_it_drains() -> None:
    """Unscheduled and scheduled prefills, admitted (some part-way) and waiting, on one node:
    after every step the snapshot lists each kind's remaining tokens as the sequences hold them,
    and their computed prefixes, and the queue's load (count, total, squares, attention) is theirs:
    the attention kept as the queue changes is what a dispatcher works out from the lists."""
    engine = make(Role.DECODE, budget=700, kv=9_000)
    for i, (tokens, schedule) in enumerate(
        [(900, ()), (500, (300,)), (1200, ()), (4000, ()), (800, (250,)), (3000, ()), (600, (200, 100))]
    ):
        engine.submit(Sequence(f"r{i}", tokens, 2, schedule=schedule))
    saw_both = False
    for _ in range(40):
        snap = engine.snapshot()
        saw_both |= bool(engine.waiting and engine.prefilling)
        pending = [*engine.prefilling, *engine.waiting]
        assert snap.queued_prefill_tokens == tuple(s.prefill_remaining for s in pending if not s.schedule)
        assert snap.scheduled_prefill_tokens == tuple(s.prefill_remaining for s in pending if s.schedule)
        queued = snap.queued_prefill_tokens
        computed = tuple(s.computed for s in pending if not s.schedule)
        assert snap.queued_prefill_computed_tokens == computed
        assert snap.scheduled_prefill_computed_tokens == tuple(s.computed for s in pending if s.schedule)
        count, total, squared, attention = engine.queue_load()
        assert (count, total, squared) == (len(queued), sum(queued), sum(n * n for n in queued))
        chunk = engine.config.max_step_tokens
        assert attention == pytest.approx(
            PrefillNodeState.from_queue("d", queued, chunk, 0.0, computed).attention_tokens
        )
        if not run_steps(engine, 1):
            break
    assert saw_both  # the KV limit held some back while others were part-way
    assert snap.queued_prefill_tokens == snap.scheduled_prefill_tokens == ()  # it drained


def test_step_guard_shrinks_a_chunk_that_the_grown_batch_would_push_over_budget() -> None:
    engine = make(Role.DECODE, budget=4096, kv=2_000_000, guard=True)
    for i in range(30):
        engine.accept_transferred(Sequence(f"d{i}", 3569, 50), 0)
    budget = 0.070
    seq = Sequence("x", 3000, 2, schedule=(1000,), step_budget_s=budget)
    engine.submit(seq)
    plan = engine.plan_step(0.0)
    assert plan is not None
    (chunk,) = plan.chunks
    k = engine.kv_used

    def step(n: int) -> float:
        return MODELS.mixed_step_s(30 + n, 0, 30, k)

    assert step(1000) > budget  # unguarded, the schedule's chunk would overrun the budget
    assert 0 < chunk.tokens < 1000
    assert step(chunk.tokens) <= budget < step(chunk.tokens + 1)  # the largest chunk that fits


def test_step_guard_defers_the_chunk_when_not_one_token_fits() -> None:
    engine = make(Role.DECODE, budget=4096, kv=2_000_000, guard=True)
    engine.accept_transferred(Sequence("d", 1000, 5), 0)
    engine.submit(Sequence("x", 100, 2, schedule=(50,), step_budget_s=0.010))
    plan = engine.plan_step(0.0)
    assert plan is not None and plan.chunks == () and plan.decode_tokens == 1


def test_the_step_budget_does_not_apply_while_no_decode_runs() -> None:
    # As the vLLM plugin: the budget protects decodes' TBT; an idle node runs the chunk whole.
    engine = make(Role.DECODE, budget=4096, kv=2_000_000, guard=True)
    engine.submit(Sequence("x", 100, 2, schedule=(50,), step_budget_s=0.001))
    plan = engine.plan_step(0.0)
    assert plan is not None and [c.tokens for c in plan.chunks] == [50] and plan.decode_tokens == 0


def test_model_timer_uses_the_prefill_model_on_prefill_nodes_and_eq4_elsewhere() -> None:
    timer = model_step_time(MODELS)
    engine = make()
    engine.submit(Sequence("a", 1000, 1, hold_kv=True))
    plan = engine.plan_step(0.0)
    assert plan is not None
    assert timer(Role.PREFILL, plan) == pytest.approx(MODELS.prefill_step_s(1000, 0))
    assert timer(Role.DECODE, plan) == pytest.approx(MODELS.mixed_step_s(1000, 0, 0, 0))


def test_the_calibration_learns_the_measured_step_when_one_is_given() -> None:
    """A node in real time passes each step as its readers saw it (``measured_s``): steps that
    ran 30% long (late wakes on a busy host) raise the calibration though the model's own
    duration was exact; the simulator passes none and calibrates on the duration."""
    from kairos.core.calibration import StepCalibration, predicted_step_s

    def run(measured_factor: float | None) -> float:
        calibration = StepCalibration()
        engine = Engine(
            EngineConfig("d0", Role.DECODE, 4096, 100_000), model_step_time(MODELS), MODELS, calibration=calibration
        )
        engine.submit(Sequence("a", 100, 2000))
        t = 0.0
        for _ in range(600):
            plan = engine.plan_step(t)
            if plan is None:
                break
            duration = engine.step_duration(plan)
            predicted = predicted_step_s(MODELS, Role.DECODE, plan.decode_tokens, plan.kv_tokens, plan.chunks)
            assert duration == pytest.approx(predicted)
            t += duration
            engine.finish_step(plan, t, duration, None if measured_factor is None else duration * measured_factor)
        return calibration.value

    assert run(None) == pytest.approx(1.0, abs=0.01)
    assert run(1.3) == pytest.approx(1.3, rel=0.02)
