"""The host-scoped scheduler: the pure policy with a simulated clock, and the
asyncio executor with an injected one. No root, no real time."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crabd.metrics import Metrics
from crabd.scheduler import (
    DEFAULT_LLM_WAIT,
    Job,
    JobCancelled,
    JobKind,
    Scheduler,
    SchedulerPolicy,
)

MiB = 1 << 20


def ckpt(sid: str, *, deadline: float, size: int = MiB, created: float = 0.0) -> Job:
    return Job(sandbox_id=sid, kind=JobKind.CHECKPOINT, size_bytes=size, created_at=created, deadline=deadline)


def bg(kind: JobKind = JobKind.GC, *, size: int = MiB, created: float = 0.0, sid: str | None = None) -> Job:
    return Job(sandbox_id=sid, kind=kind, size_bytes=size, created_at=created)


# -- learned LLM waits ---------------------------------------------------------


def test_expected_wait_defaults_then_follows_an_exponential_moving_average():
    p = SchedulerPolicy(smoothing=0.5)
    assert p.expected_wait("a") == DEFAULT_LLM_WAIT
    p.observe_gap("a", 10.0)
    assert p.expected_wait("a") == 10.0  # the first gap replaces the guess
    p.observe_gap("a", 20.0)
    assert p.expected_wait("a") == 15.0
    p.observe_gap("a", 5.0)
    assert p.expected_wait("a") == 10.0
    assert p.expected_wait("b") == DEFAULT_LLM_WAIT  # per sandbox


def test_bogus_gaps_are_ignored_and_extremes_clamped():
    p = SchedulerPolicy()
    for bad in (-1.0, math.nan, math.inf):
        p.observe_gap("a", bad)
    assert p.expected_wait("a") == DEFAULT_LLM_WAIT
    p.observe_gap("b", 86400.0)
    assert p.expected_wait("b") == 600.0
    p.observe_gap("c", 0.0)
    assert p.expected_wait("c") > 0


def test_checkpoint_job_deadline_is_turn_end_plus_expected_wait():
    p = SchedulerPolicy()
    p.observe_gap("a", 7.0)
    j = p.checkpoint_job("a", MiB, turn_ended_at=100.0)
    assert (j.kind, j.created_at, j.deadline) == (JobKind.CHECKPOINT, 100.0, 107.0)
    assert p.checkpoint_job("new", MiB, 100.0).deadline == 100.0 + DEFAULT_LLM_WAIT
    assert p.background_job(JobKind.GC, 0, now=5.0).deadline == math.inf
    with pytest.raises(ValueError):
        p.background_job(JobKind.CHECKPOINT, 0, now=5.0)


def test_forget_drops_the_learned_wait_and_queued_jobs():
    p = SchedulerPolicy()
    p.observe_gap("a", 9.0)
    p.submit(ckpt("a", deadline=1))
    p.forget("a")
    assert p.expected_wait("a") == DEFAULT_LLM_WAIT and p.depth == 0


# -- ordering ------------------------------------------------------------------


def test_checkpoints_run_earliest_deadline_first():
    p = SchedulerPolicy(max_concurrency=1)
    late, early, mid = ckpt("a", deadline=30), ckpt("b", deadline=10), ckpt("c", deadline=20)
    for j in (late, early, mid):
        p.submit(j)
    order = []
    for _ in range(3):
        (j,) = p.next_jobs(0.0, running=[])
        order.append(j)
    assert order == [early, mid, late]


def test_equal_deadlines_run_smaller_first():
    p = SchedulerPolicy(max_concurrency=1)
    big, small = ckpt("a", deadline=5, size=100 * MiB), ckpt("b", deadline=5, size=MiB)
    p.submit(big)
    p.submit(small)
    assert p.next_jobs(0.0, []) == [small]
    assert p.next_jobs(0.0, []) == [big]


def test_learned_waits_decide_the_order():
    """Sandbox b's agent comes back sooner, so b's checkpoint goes first."""
    p = SchedulerPolicy(max_concurrency=1)
    p.observe_gap("a", 30.0)
    p.observe_gap("b", 1.0)
    ja = p.checkpoint_job("a", MiB, turn_ended_at=0.0)
    jb = p.checkpoint_job("b", MiB, turn_ended_at=0.5)
    p.submit(ja)
    p.submit(jb)
    assert p.next_jobs(1.0, []) == [jb]


# -- bounds --------------------------------------------------------------------


def test_concurrency_bound():
    p = SchedulerPolicy(max_concurrency=2)
    jobs = [ckpt(f"s{i}", deadline=i) for i in range(5)]
    for j in jobs:
        p.submit(j)
    first = p.next_jobs(0.0, [])
    assert first == jobs[:2]
    assert p.next_jobs(0.0, first) == []
    assert p.next_jobs(0.0, first[1:]) == [jobs[2]]
    assert p.depth == 2


def test_byte_budget_bound_and_no_backfill_past_the_head():
    p = SchedulerPolicy(max_concurrency=4, io_budget_bytes=10 * MiB)
    a = ckpt("a", deadline=1, size=6 * MiB)
    b = ckpt("b", deadline=2, size=6 * MiB)  # does not fit next to a
    c = ckpt("c", deadline=3, size=1 * MiB)  # would fit, but must not overtake b
    for j in (a, b, c):
        p.submit(j)
    assert p.next_jobs(0.0, []) == [a]
    assert p.next_jobs(0.0, [a]) == []
    assert p.next_jobs(0.0, []) == [b, c]


def test_a_job_bigger_than_the_budget_runs_alone():
    p = SchedulerPolicy(max_concurrency=4, io_budget_bytes=10 * MiB)
    small = ckpt("a", deadline=1, size=MiB)
    huge = ckpt("b", deadline=2, size=50 * MiB)
    after = ckpt("c", deadline=3, size=MiB)
    for j in (small, huge, after):
        p.submit(j)
    assert p.next_jobs(0.0, []) == [small]
    assert p.next_jobs(0.0, [small]) == []  # huge waits for the disk to drain
    assert p.next_jobs(0.0, []) == [huge]
    assert p.next_jobs(0.0, [huge]) == []  # and nothing joins it
    assert p.next_jobs(0.0, []) == [after]


# -- background work -----------------------------------------------------------


def test_background_work_waits_for_idle():
    p = SchedulerPolicy(max_concurrency=2)
    gc, c = bg(JobKind.GC), ckpt("a", deadline=1)
    p.submit(gc)
    p.submit(c)
    assert p.next_jobs(0.0, []) == [c]  # a checkpoint is queued: no GC beside it
    assert p.next_jobs(0.0, [c]) == []  # a checkpoint runs: still not idle
    assert p.next_jobs(0.0, []) == [gc]


def test_background_takes_at_most_max_background_slots_in_fifo_order():
    p = SchedulerPolicy(max_concurrency=2, max_background=5)  # capped to 1 of 2
    first, second = bg(JobKind.COMPACTION, created=1.0), bg(JobKind.COMPRESSION, created=2.0)
    p.submit(second)
    p.submit(first)
    assert p.next_jobs(3.0, []) == [first]
    assert p.next_jobs(3.0, [first]) == []  # the other slot stays free for checkpoints
    c = ckpt("a", deadline=4)
    p.submit(c)
    assert p.next_jobs(3.0, [first]) == [c]


def test_all_background_kinds_are_idle_only():
    for kind in (JobKind.COMPACTION, JobKind.COMPRESSION, JobKind.GC, JobKind.STANDBY_REFRESH):
        p = SchedulerPolicy()
        p.submit(bg(kind))
        running = [ckpt("a", deadline=1)]
        assert p.next_jobs(0.0, running) == [], kind


def test_background_max_delay_lets_old_background_work_through_a_busy_host():
    p = SchedulerPolicy(max_concurrency=2, background_max_delay=60.0)
    gc = bg(created=0.0)
    p.submit(gc)
    busy = [ckpt("a", deadline=1)]
    assert p.next_jobs(59.0, busy) == []
    assert p.next_wakeup(59.0) == 60.0
    assert p.next_jobs(60.0, busy) == [gc]
    assert p.next_wakeup(60.0) is None


# -- cancel and disabled mode --------------------------------------------------


def test_cancel_removes_only_that_sandboxes_queued_jobs():
    p = SchedulerPolicy(max_concurrency=1)
    a1, a2, b1 = ckpt("a", deadline=1), ckpt("a", deadline=2), ckpt("b", deadline=3)
    a_gc = bg(JobKind.COMPACTION, sid="a")
    for j in (a1, a2, b1, a_gc):
        p.submit(j)
    (running,) = p.next_jobs(0.0, [])
    assert running == a1
    assert set(p.cancel("a")) == {a2, a_gc}
    assert p.queued() == [b1]
    assert p.cancel("a") == []


def test_cancel_can_be_limited_to_some_kinds():
    p = SchedulerPolicy()
    c, gc = ckpt("a", deadline=1), bg(JobKind.COMPACTION, sid="a")
    p.submit(c)
    p.submit(gc)
    assert p.cancel("a", kinds=[JobKind.CHECKPOINT]) == [c]
    assert p.queued() == [gc]


def test_disabled_mode_starts_everything_at_once():
    p = SchedulerPolicy(max_concurrency=1, io_budget_bytes=1, enabled=False)
    jobs = [ckpt(f"s{i}", deadline=10 - i, size=100 * MiB, created=float(i)) for i in range(8)] + [bg(created=9.0)]
    for j in jobs:
        p.submit(j)
    running = [ckpt("x", deadline=0)]
    assert p.next_jobs(0.0, running) == jobs  # in submission order, bounds ignored
    assert p.depth == 0


def test_bad_parameters_are_refused():
    for kw in ({"max_concurrency": 0}, {"io_budget_bytes": 0}, {"smoothing": 0.0}, {"default_wait": 0.0}):
        with pytest.raises(ValueError):
            SchedulerPolicy(**kw)
    with pytest.raises(ValueError):
        Job(sandbox_id="a", kind=JobKind.GC, size_bytes=-1, created_at=0.0)
    p = SchedulerPolicy()
    j = ckpt("a", deadline=1)
    p.submit(j)
    with pytest.raises(ValueError):
        p.submit(j)


# -- property: bounds always hold, nothing starves -------------------------------

# Mostly checkpoints (as on a real host), with every background kind in the mix.
_kinds = st.one_of(st.just(JobKind.CHECKPOINT), st.just(JobKind.CHECKPOINT), st.sampled_from(list(JobKind)))
# Sizes around the budgets below, so "does not fit" happens often; submits
# are drawn most often so queues actually build up.
_sizes = st.sampled_from([0, 1, 3, 6, 10, 20, 40])
_submit = st.tuples(st.just("submit"), st.integers(0, 3), _kinds, _sizes)  # sandbox, kind, MiB
_op = st.one_of(
    _submit,
    _submit,
    _submit,
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("finish"), st.integers(0, 10)),
    st.tuples(st.just("cancel"), st.integers(0, 3)),
    st.tuples(st.just("gap"), st.integers(0, 3), st.floats(0.0, 30.0)),
)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(_op, max_size=60),
    max_concurrency=st.integers(1, 4),
    budget_mib=st.sampled_from([4, 8, 16, 32]),
)
def test_policy_never_exceeds_its_bounds_and_never_starves(ops, max_concurrency, budget_mib):
    budget = budget_mib * MiB
    p = SchedulerPolicy(max_concurrency=max_concurrency, io_budget_bytes=budget)
    now = 0.0
    running: list[Job] = []
    submitted: set[int] = set()
    cancelled: set[int] = set()
    ran: set[int] = set()

    def step() -> None:
        queued_before = p.queued()
        started = p.next_jobs(now, list(running))
        for j in started:
            assert j.id not in ran, "a job started twice"
            ran.add(j.id)
        running.extend(started)
        # Concurrency bound.
        assert len(running) <= max_concurrency
        # Byte bound: within budget, or one oversize job carries all bytes in flight.
        heavy = [j for j in running if j.size_bytes > 0]
        assert sum(j.size_bytes for j in running) <= budget or len(heavy) == 1
        # Background only when idle.
        if any(j.kind.background for j in started):
            assert not any(not j.kind.background for j in running)
            assert not any(not j.kind.background for j in p.queued())
        assert sum(1 for j in running if j.kind.background) <= p.max_background
        # EDF: nothing left queued precedes a checkpoint started now.
        started_ckpts = [j for j in started if not j.kind.background]
        left = [j for j in queued_before if not j.kind.background and j not in started]
        if started_ckpts and left:
            assert max(j.edf_key() for j in started_ckpts) < min(j.edf_key() for j in left)

    for op in ops:
        if op[0] == "submit":
            _, sb, kind, mib = op
            sid = f"s{sb}"
            if kind is JobKind.CHECKPOINT:
                j = p.checkpoint_job(sid, mib * MiB, turn_ended_at=now)
            else:
                j = p.background_job(kind, mib * MiB, now, sandbox_id=sid)
            p.submit(j)
            submitted.add(j.id)
        elif op[0] == "advance":
            now += op[1]
        elif op[0] == "finish":
            if running:
                running.pop(op[1] % len(running))
        elif op[0] == "cancel":
            cancelled |= {j.id for j in p.cancel(f"s{op[1]}")}
        elif op[0] == "gap":
            p.observe_gap(f"s{op[1]}", op[2])
        step()

    # Drain: time advances, jobs complete; everything not cancelled must run.
    for _ in range(10 * (len(submitted) + 1)):
        if p.depth == 0:
            break
        if running:
            running.pop(0)
        now += 1.0
        step()
    assert p.depth == 0, f"starved: {p.queued()}"
    assert ran == submitted - cancelled


# -- the asyncio executor --------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def test_executor_runs_jobs_within_bounds_and_measures_queue_wait():
    async def main():
        clock = FakeClock()
        metrics = Metrics()
        s = Scheduler(SchedulerPolicy(max_concurrency=2), clock=clock, metrics=metrics)
        gates = {i: asyncio.Event() for i in range(3)}
        live: list[int] = []
        peak = 0

        def work(i):
            async def go():
                nonlocal peak
                live.append(i)
                peak = max(peak, len(live))
                await gates[i].wait()
                live.remove(i)
                return i * 10
            return go

        jobs = [ckpt(f"s{i}", deadline=clock.t + i) for i in range(3)]
        futs = [s.submit(j, work(i)) for i, j in enumerate(jobs)]
        await asyncio.sleep(0)
        assert sorted(live) == [0, 1] and [j.id for j in s.queued()] == [jobs[2].id]
        assert metrics.scheduler_queue_depth._value.get() == 1
        clock.t += 3.0  # job 2 waits 3 s on the fake clock
        gates[0].set()
        assert await futs[0] == 0
        await asyncio.sleep(0)
        assert s.queue_wait(jobs[2].id) == 3.0
        gates[1].set()
        gates[2].set()
        assert [await f for f in futs] == [0, 10, 20]
        assert peak == 2
        waits = {o.job.id: o.queue_wait for o in s.outcomes}
        assert waits == {jobs[0].id: 0.0, jobs[1].id: 0.0, jobs[2].id: 3.0}
        assert all(o.result == "ok" for o in s.outcomes)
        text = metrics.render().decode()
        assert 'crabd_checkpoint_duration_seconds_count{phase="queue"} 3.0' in text
        assert "crabd_scheduler_queue_depth 0.0" in text

    run(main())


def test_executor_factory_is_not_called_before_admission():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=1), clock=FakeClock())
        called: list[str] = []
        gate = asyncio.Event()

        def factory(name):
            called.append(name)

            async def go():
                await gate.wait()
            return go()

        f1 = s.submit(ckpt("a", deadline=1), lambda: factory("a"))
        f2 = s.submit(ckpt("b", deadline=2), lambda: factory("b"))
        await asyncio.sleep(0)
        assert called == ["a"]
        gate.set()
        await f1
        await f2
        assert called == ["a", "b"]

    run(main())


def test_executor_cancel_fails_queued_futures_and_leaves_running_ones():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=1), clock=FakeClock())
        gate = asyncio.Event()

        async def slow():
            await gate.wait()
            return "done"

        running = s.submit(ckpt("a", deadline=1), slow)
        queued = s.submit(ckpt("a", deadline=2), slow)
        other = s.submit(ckpt("b", deadline=3), slow)
        await asyncio.sleep(0)
        gone = s.cancel("a")
        assert len(gone) == 1
        with pytest.raises(JobCancelled):
            await queued
        assert s.running_for("a") == [running]
        gate.set()
        assert await running == "done"
        assert await other == "done"
        assert [o.result for o in s.outcomes].count("cancelled") == 1

    run(main())


def test_executor_propagates_job_errors_and_keeps_going():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=1), clock=FakeClock())

        async def boom():
            raise RuntimeError("fs commit failed")

        async def ok():
            return 1

        f1 = s.submit(ckpt("a", deadline=1), boom)
        f2 = s.submit(ckpt("b", deadline=2), ok)
        with pytest.raises(RuntimeError, match="fs commit failed"):
            await f1
        assert await f2 == 1
        assert [o.result for o in s.outcomes] == ["error", "ok"]

    run(main())


def test_executor_waiter_cancelling_its_future_dequeues_or_stops_the_job():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=1), clock=FakeClock())
        stopped = asyncio.Event()

        async def forever():
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()

        running = s.submit(ckpt("a", deadline=1), forever)
        queued = s.submit(ckpt("b", deadline=2), forever)
        await asyncio.sleep(0)
        queued.cancel()
        await asyncio.sleep(0)
        assert s.queued() == []
        running.cancel()
        await asyncio.wait_for(stopped.wait(), 1)
        await asyncio.sleep(0)
        assert s.running() == []

    run(main())


def test_executor_idle_background_work_and_close():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=2), clock=FakeClock())
        order: list[str] = []
        ckpt_gate, gc_gate = asyncio.Event(), asyncio.Event()

        def job(name, gate=None):
            async def go():
                order.append(name)
                if gate is not None:
                    await gate.wait()
            return go

        c = s.submit(ckpt("a", deadline=1), job("ckpt", ckpt_gate))
        g = s.submit(bg(JobKind.GC), job("gc", gc_gate))
        late = s.submit(bg(JobKind.COMPACTION, created=5.0), job("compact"))
        await asyncio.sleep(0)
        assert order == ["ckpt"]  # background queued while a checkpoint runs
        ckpt_gate.set()
        await c
        await asyncio.sleep(0)
        assert order == ["ckpt", "gc"]  # idle now; one background slot only
        closing = asyncio.ensure_future(s.close())
        with pytest.raises(JobCancelled):
            await late  # close() cancels what is still queued
        assert not closing.done()  # and waits for what runs
        gc_gate.set()
        await closing
        await g
        assert order == ["ckpt", "gc"]
        with pytest.raises(Exception, match="shut down"):
            s.submit(ckpt("a", deadline=2), job("x"))

    run(main())


def test_disabled_executor_starts_all_checkpoints_at_once():
    async def main():
        s = Scheduler(SchedulerPolicy(max_concurrency=1, enabled=False), clock=FakeClock())
        live = 0
        peak = 0
        gate = asyncio.Event()

        async def go():
            nonlocal live, peak
            live += 1
            peak = max(peak, live)
            await gate.wait()
            live -= 1

        futs = [s.submit(ckpt(f"s{i}", deadline=i), go) for i in range(6)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*futs)
        assert peak == 6

    run(main())
