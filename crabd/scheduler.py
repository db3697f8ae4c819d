"""The host-scoped checkpoint scheduler: which saved-state work runs, and when.

In the design (DESIGN.md, "crabd -> scheduler") every sandbox's coordinator
hands its turn-end checkpoint to one scheduler shared by the whole host. Run
naively, N sandboxes ending turns together start N freezes, N file-system
commits and N CRIU dumps at once and fight over the disk; the agents whose
LLM answers come back first then stall on captures that were slowed down by
captures nobody is waiting for yet. The scheduler spreads that I/O:

* **Deadlines.** A checkpoint must be done before the agent's next exec
  arrives, i.e. by `turn end + expected LLM wait` of that sandbox. The wait
  is learned per sandbox as an exponential moving average of observed gaps
  (turn end -> next exec). Checkpoints run earliest-deadline-first (EDF),
  smaller first on a tie (more captures finish before their deadlines).
* **Bounds.** At most `max_concurrency` jobs run at once (default 2 on a
  2-core host) and at most `io_budget_bytes` of estimated writes are in
  flight. A single job larger than the whole budget runs alone.
* **Idle-only background work.** Compaction, compression, GC and hot-standby
  refresh run only when no checkpoint is queued or running, and take at most
  `max_background` slots so a checkpoint arriving meanwhile finds a free one.
* **Cancel.** A rollback cancels the sandbox's queued work: it would capture
  a state that is being thrown away.
* **Disabled mode** starts every job at once: the benchmark's baseline
  ("all checkpoints start at once").

Two layers, as STYLE.md asks of pure logic:

    SchedulerPolicy   pure: no I/O, no clock, no asyncio; `now` is an argument.
                      Unit- and property-tested with a simulated clock.
    Scheduler         thin asyncio executor: asks the policy what to start
                      whenever a job is submitted or finishes, runs the
                      coroutines, measures queue wait with an injected clock.

No starvation: admission follows the priority order strictly (no backfill
past a job that does not fit), so the bytes in flight only drain while the
head waits, and the head then runs. New checkpoints get deadlines at or after
their submission time, so once time passes a queued job's deadline, nothing
new can overtake it. Background work waits for the host to be idle, which
happens once the (finite) checkpoint work is done; `background_max_delay`
optionally bounds that wait on a host that is never idle.

Example (policy alone, simulated time):

    policy = SchedulerPolicy(max_concurrency=2, io_budget_bytes=64 << 20)
    policy.observe_gap("sb1", 5.0)
    job = policy.checkpoint_job("sb1", size_bytes=1 << 20, turn_ended_at=100.0)
    policy.submit(job)                       # deadline 105.0
    started = policy.next_jobs(100.0, running=[])   # -> [job]
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Sequence, TypeVar

from .errors import FailedPrecondition, JobCancelled

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = [
    "JobKind",
    "Job",
    "JobCancelled",
    "JobOutcome",
    "SchedulerPolicy",
    "Scheduler",
    "DEFAULT_LLM_WAIT",
    "DEFAULT_IO_BUDGET",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Expected LLM wait before a sandbox has shown any gap: a typical
#: short completion. Only orders the first checkpoints of a sandbox.
DEFAULT_LLM_WAIT = 2.0
#: Estimated bytes of checkpoint writes allowed in flight at once. 256 MiB is
#: about one second of a commodity SSD: enough to keep it busy, small enough
#: that a capture is not queued behind seconds of someone else's writeback.
DEFAULT_IO_BUDGET = 256 << 20
#: Learned waits are clamped to this range: a sandbox left alone for an hour
#: must not push its next deadline an hour out (it would then lose every tie
#: for a long time), and a 0 s gap must not make a deadline already past.
_WAIT_MIN = 0.05
_WAIT_MAX = 600.0


class JobKind(str, enum.Enum):
    """What a job does. Only CHECKPOINT has a deadline; the rest wait for idle."""

    CHECKPOINT = "checkpoint"  # capture a turn's state (freeze, fs commit, CRIU dump)
    COMPACTION = "compaction"  # flatten a deep overlay layer chain
    COMPRESSION = "compression"  # zstd a CRIU image written uncompressed for speed
    GC = "gc"  # delete layers/images no checkpoint references
    STANDBY_REFRESH = "standby_refresh"  # re-make a hot standby from a newer checkpoint
    SIZING = "sizing"  # count the bytes a committed checkpoint added (a tree walk, off the turn's path)

    @property
    def background(self) -> bool:
        return self is not JobKind.CHECKPOINT


# Module-wide so ids stay unique across policies (tests make many); ids only
# break ties and key the executor's tables, they carry no meaning.
_job_ids = itertools.count(1)


@dataclass(frozen=True)
class Job:
    """One unit of scheduled work.

    `size_bytes` is the caller's estimate of the bytes the job writes (dirty
    bytes of the writable layer, expected image size); it is what the I/O
    budget counts. `deadline` is an absolute time on the scheduler's clock:
    `turn end + expected LLM wait` for checkpoints, +inf for background work.
    """

    sandbox_id: str | None
    kind: JobKind
    size_bytes: int
    created_at: float
    deadline: float = math.inf
    id: int = field(default_factory=lambda: next(_job_ids))

    def __post_init__(self) -> None:
        if self.size_bytes < 0:
            raise ValueError(f"job size must be >= 0 bytes, got {self.size_bytes}")
        if math.isnan(self.deadline) or math.isnan(self.created_at):
            raise ValueError("job times must not be NaN")

    def edf_key(self) -> tuple[float, int, int]:
        """Checkpoint order: earliest deadline, then smallest, then oldest."""
        return (self.deadline, self.size_bytes, self.id)

    def fifo_key(self) -> tuple[float, int, int]:
        """Background order: oldest first, then smallest."""
        return (self.created_at, self.size_bytes, self.id)


class SchedulerPolicy:
    """Pure admission policy: a queue, learned LLM waits, and `next_jobs`.

    The policy does not track running jobs itself; the caller passes them to
    `next_jobs` (the executor knows what runs, a simulation knows too), so the
    policy can never disagree with reality about what is in flight.
    """

    def __init__(
        self,
        *,
        max_concurrency: int = 2,
        io_budget_bytes: int = DEFAULT_IO_BUDGET,
        max_background: int = 1,
        default_wait: float = DEFAULT_LLM_WAIT,
        smoothing: float = 0.3,
        enabled: bool = True,
        background_max_delay: float | None = None,
    ) -> None:
        """
        max_concurrency: jobs running at once (checkpoints and background).
        io_budget_bytes: estimated bytes in flight at once.
        max_background: background jobs running at once; kept below
            max_concurrency so a checkpoint never waits for a slot.
        default_wait: expected LLM wait (s) of a sandbox with no observed gap.
        smoothing: EMA weight of a new gap observation (0 < a <= 1).
        enabled: False = disabled mode, every job starts at once, no bounds.
        background_max_delay: if set, background work older than this (s)
            runs even on a busy host (still within the bounds); None = only
            when idle.
        """
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if io_budget_bytes < 1:
            raise ValueError(f"io_budget_bytes must be >= 1, got {io_budget_bytes}")
        if max_background < 1:
            raise ValueError(f"max_background must be >= 1, got {max_background}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not default_wait > 0:
            raise ValueError(f"default_wait must be > 0 s, got {default_wait}")
        self.max_concurrency = max_concurrency
        self.io_budget_bytes = io_budget_bytes
        # One slot always stays free for checkpoints when there are 2 or more.
        self.max_background = min(max_background, max(1, max_concurrency - 1))
        self.default_wait = default_wait
        self.smoothing = smoothing
        self.enabled = enabled
        self.background_max_delay = background_max_delay
        self._queue: dict[int, Job] = {}
        self._waits: dict[str, float] = {}

    # -- learned LLM waits ---------------------------------------------------

    def observe_gap(self, sandbox_id: str, seconds: float) -> None:
        """Record one observed gap between a turn's end and the next exec."""
        if not math.isfinite(seconds) or seconds < 0:
            return  # a clock step or a bogus report must not poison the average
        seconds = min(max(seconds, _WAIT_MIN), _WAIT_MAX)
        old = self._waits.get(sandbox_id)
        # The first observation replaces the default outright: the default
        # is a guess about agents in general, the observation is about this one.
        self._waits[sandbox_id] = seconds if old is None else old + self.smoothing * (seconds - old)

    def expected_wait(self, sandbox_id: str | None) -> float:
        """This sandbox's expected LLM wait in seconds (the default before any gap)."""
        if sandbox_id is None:
            return self.default_wait
        return self._waits.get(sandbox_id, self.default_wait)

    def forget(self, sandbox_id: str) -> None:
        """Drop what was learned about a deleted sandbox (and its queued jobs)."""
        self._waits.pop(sandbox_id, None)
        self.cancel(sandbox_id)

    # -- job construction ----------------------------------------------------

    def checkpoint_job(self, sandbox_id: str, size_bytes: int, turn_ended_at: float) -> Job:
        """A checkpoint job due when this sandbox's agent is expected back."""
        return Job(
            sandbox_id=sandbox_id,
            kind=JobKind.CHECKPOINT,
            size_bytes=size_bytes,
            created_at=turn_ended_at,
            deadline=turn_ended_at + self.expected_wait(sandbox_id),
        )

    def background_job(self, kind: JobKind, size_bytes: int, now: float, sandbox_id: str | None = None) -> Job:
        """A background job (no deadline); `sandbox_id` None = host-wide."""
        if not kind.background:
            raise ValueError("use checkpoint_job() for checkpoints: they need a deadline")
        return Job(sandbox_id=sandbox_id, kind=kind, size_bytes=size_bytes, created_at=now)

    # -- queue ---------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if job.id in self._queue:
            raise ValueError(f"job {job.id} is already queued")
        self._queue[job.id] = job

    def remove(self, job_id: int) -> Job | None:
        """Remove one queued job (its waiter gave up); None if it is not queued."""
        return self._queue.pop(job_id, None)

    def cancel(self, sandbox_id: str, kinds: Iterable[JobKind] | None = None) -> list[Job]:
        """Remove the sandbox's queued jobs (all kinds, or only `kinds`); running ones are not touched."""
        wanted = set(kinds) if kinds is not None else None
        gone = [j for j in self._queue.values() if j.sandbox_id == sandbox_id and (wanted is None or j.kind in wanted)]
        for j in gone:
            del self._queue[j.id]
        return gone

    def queued(self) -> list[Job]:
        """Queued jobs in the order they would be considered."""
        ckpt = sorted((j for j in self._queue.values() if not j.kind.background), key=Job.edf_key)
        bg = sorted((j for j in self._queue.values() if j.kind.background), key=Job.fifo_key)
        return ckpt + bg

    @property
    def depth(self) -> int:
        return len(self._queue)

    # -- admission -----------------------------------------------------------

    def _fits(self, job: Job, in_flight: int) -> bool:
        # A job bigger than the whole budget would never fit: it runs alone
        # instead (nothing else's bytes in flight), which keeps it from
        # starving while still never running two big jobs side by side.
        return in_flight == 0 or in_flight + job.size_bytes <= self.io_budget_bytes

    def next_jobs(self, now: float, running: Sequence[Job]) -> list[Job]:
        """Jobs to start now, removed from the queue, in start order.

        `running` is every job started and not yet finished. Call again
        whenever a job is submitted or finishes (and at `next_wakeup`).
        """
        if not self.enabled:
            fifo = sorted(self._queue.values(), key=Job.fifo_key)
            self._queue.clear()
            return fifo

        started: list[Job] = []
        slots = self.max_concurrency - len(running)
        in_flight = sum(j.size_bytes for j in running)

        ckpts = sorted((j for j in self._queue.values() if not j.kind.background), key=Job.edf_key)
        for job in ckpts:
            # Strict order, no backfill past the head: that is what makes a
            # big or late job impossible to starve (see module docstring).
            if slots <= 0 or not self._fits(job, in_flight):
                break
            started.append(job)
            slots -= 1
            in_flight += job.size_bytes

        # "Idle" = no checkpoint queued (including those just started) or running.
        checkpoint_active = bool(ckpts) or any(not j.kind.background for j in running)
        bg_running = sum(1 for j in running if j.kind.background)
        bgs = sorted((j for j in self._queue.values() if j.kind.background), key=Job.fifo_key)
        for job in bgs:
            if checkpoint_active and not self._overdue(job, now):
                # FIFO: if the oldest background job may not run, no younger one may.
                break
            if slots <= 0 or bg_running >= self.max_background or not self._fits(job, in_flight):
                break
            started.append(job)
            slots -= 1
            bg_running += 1
            in_flight += job.size_bytes

        for job in started:
            del self._queue[job.id]
        return started

    def _overdue(self, job: Job, now: float) -> bool:
        return self.background_max_delay is not None and now - job.created_at >= self.background_max_delay

    def next_wakeup(self, now: float) -> float | None:
        """When admission can change by time alone (a background job turning
        overdue); None if only a submit or a finish can change it."""
        if not self.enabled or self.background_max_delay is None:
            return None
        times = [j.created_at + self.background_max_delay for j in self._queue.values() if j.kind.background]
        future = [t for t in times if t > now]
        return min(future) if future else None


@dataclass(frozen=True)
class JobOutcome:
    """What happened to a job, on the executor's clock (kept for benchmarks)."""

    job: Job
    queued_at: float
    started_at: float | None  # None: cancelled while queued
    finished_at: float
    result: str  # "ok" | "error" | "cancelled"

    @property
    def queue_wait(self) -> float:
        """Seconds between submission and start (until cancellation if it never started)."""
        end = self.started_at if self.started_at is not None else self.finished_at
        return end - self.queued_at

    @property
    def run_seconds(self) -> float:
        return 0.0 if self.started_at is None else self.finished_at - self.started_at


@dataclass
class _Entry:
    job: Job
    factory: Callable[[], Awaitable[Any]]
    future: asyncio.Future[Any]
    queued_at: float
    started_at: float | None = None
    task: asyncio.Task[Any] | None = None


class Scheduler:
    """Asyncio executor of a `SchedulerPolicy`, one per daemon.

    `submit(job, factory)` queues the job and returns a future for the result
    of `await factory()`; the factory is called only when the policy admits
    the job, so nothing of the job's work (not even the coroutine object)
    exists while it waits. Cancelling the returned future dequeues the job,
    or cancels its task if it already runs.

    The clock is injected (default `time.monotonic`) so tests can drive queue
    waits deterministically; job `created_at`/`deadline` must be on the same
    clock.
    """

    def __init__(
        self,
        policy: SchedulerPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: Metrics | None = None,
        history: int = 1024,
    ) -> None:
        self.policy = policy if policy is not None else SchedulerPolicy()
        self.clock = clock
        self.metrics = metrics
        #: Last `history` finished jobs (benchmarks read queue waits here).
        self.outcomes: collections.deque[JobOutcome] = collections.deque(maxlen=history)
        self._entries: dict[int, _Entry] = {}
        self._running: dict[int, _Entry] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    # -- public --------------------------------------------------------------

    def submit(self, job: Job, coro_factory: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """Queue `job`; the future resolves with `await coro_factory()`'s result
        (or its exception, or `JobCancelled` if the job is cancelled while queued)."""
        if self._closed:
            raise FailedPrecondition("the scheduler is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        entry = _Entry(job, coro_factory, fut, self.clock())
        self.policy.submit(job)
        self._entries[job.id] = entry
        fut.add_done_callback(functools.partial(self._on_future_done, job.id))
        self._pump()
        return fut

    def cancel(self, sandbox_id: str, kinds: Iterable[JobKind] | None = None) -> list[Job]:
        """Cancel the sandbox's queued jobs; their futures fail with `JobCancelled`.

        Running jobs are left to finish: interrupting a capture between
        freeze and thaw would leave the sandbox frozen. The caller awaits them
        (see `running_for`) before it rolls the sandbox back.
        """
        gone = self.policy.cancel(sandbox_id, kinds)
        for job in gone:
            self._finish_queued(job, JobCancelled(f"{job.kind.value} job {job.id} of sandbox {sandbox_id} cancelled"))
        self._update_depth()
        return gone

    def running_for(self, sandbox_id: str) -> list[asyncio.Future[Any]]:
        """Futures of the sandbox's running jobs (to await before a rollback)."""
        return [e.future for e in self._running.values() if e.job.sandbox_id == sandbox_id]

    def queue_wait(self, job_id: int) -> float | None:
        """Queue wait of a running job (for its own timings record), else None."""
        e = self._running.get(job_id)
        return None if e is None or e.started_at is None else e.started_at - e.queued_at

    def queued(self) -> list[Job]:
        """Queued jobs, in the order the policy would consider them."""
        return self.policy.queued()

    def running(self) -> list[Job]:
        """Jobs started and not yet finished."""
        return [e.job for e in self._running.values()]

    async def close(self) -> None:
        """Cancel queued jobs and wait for running ones to finish."""
        self._closed = True
        for job in self.policy.queued():
            self.policy.remove(job.id)
            self._finish_queued(job, JobCancelled(f"{job.kind.value} job {job.id}: crabd is shutting down"))
        if self._timer is not None:
            self._timer.cancel()
        pending = [e.future for e in self._running.values()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        self._update_depth()

    # -- internals -----------------------------------------------------------

    def _pump(self) -> None:
        """Start whatever the policy admits now; re-arm the time-based wakeup."""
        if self._closed:
            return
        now = self.clock()
        for job in self.policy.next_jobs(now, [e.job for e in self._running.values()]):
            self._start(self._entries[job.id], now)
        self._update_depth()
        self._arm_timer(now)

    def _start(self, entry: _Entry, now: float) -> None:
        entry.started_at = now
        self._running[entry.job.id] = entry
        if self.metrics is not None and entry.job.kind is JobKind.CHECKPOINT:
            self.metrics.checkpoint_duration.labels(phase="queue").observe(now - entry.queued_at)
        entry.task = asyncio.ensure_future(self._run(entry))

    async def _run(self, entry: _Entry) -> None:
        result = "ok"
        try:
            value = await entry.factory()
        except asyncio.CancelledError:
            result = "cancelled"
            if not entry.future.done():
                entry.future.cancel()
        except Exception as e:  # the job's own failure belongs to its waiter
            result = "error"
            if not entry.future.done():
                entry.future.set_exception(e)
        else:
            if not entry.future.done():
                entry.future.set_result(value)
        finally:
            self._running.pop(entry.job.id, None)
            self._entries.pop(entry.job.id, None)
            self.outcomes.append(JobOutcome(entry.job, entry.queued_at, entry.started_at, self.clock(), result))
            self._pump()

    def _finish_queued(self, job: Job, exc: BaseException) -> None:
        entry = self._entries.pop(job.id, None)
        if entry is None:
            return
        self.outcomes.append(JobOutcome(job, entry.queued_at, None, self.clock(), "cancelled"))
        if not entry.future.done():
            entry.future.set_exception(exc)
            # Nobody may be awaiting a cancelled checkpoint (the rollback made
            # it moot): mark the exception retrieved so asyncio does not log it.
            entry.future.exception()

    def _on_future_done(self, job_id: int, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled():
            return
        # The waiter gave up: dequeue the job, or stop it if it runs.
        entry = self._entries.get(job_id)
        if entry is None:
            return
        if entry.task is not None:
            entry.task.cancel()
        elif self.policy.remove(job_id) is not None:
            self._entries.pop(job_id, None)
            self.outcomes.append(JobOutcome(entry.job, entry.queued_at, None, self.clock(), "cancelled"))
            self._update_depth()

    def _arm_timer(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        at = self.policy.next_wakeup(now)
        if at is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, at - now), self._pump)

    def _update_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.scheduler_queue_depth.set(self.policy.depth)
