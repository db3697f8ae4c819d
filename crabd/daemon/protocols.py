"""What the daemon needs of its inspector and its scheduler, and its options.

Part of `crabd.daemon`. The daemon is handed an inspector (the BPF one,
`ebpf.Inspector`; the /proc fallback, `ebpf.ProcInspector`; a fake in tests)
and drives a scheduler (`crabd.scheduler.Scheduler` over a `SchedulerPolicy`);
these Protocols name the calls it makes, so either side can change without
reading the daemon through.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Protocol, TypeVar

if TYPE_CHECKING:
    from deltacr import StandbyPolicy
    from ebpf import Effects

    from ..scheduler import Job, JobKind, SchedulerPolicy

__all__ = ["DaemonOptions", "TurnInspector", "JobScheduler"]

T = TypeVar("T")


@dataclass
class DaemonOptions:
    auto_rollback: bool = True
    snapshot_driver: str = "auto"
    use_bpf: bool = True
    # Load the BPF inspector in the background and serve meanwhile (turns
    # ended before it is ready are blind: FS_PROC; ebpf/_loading.py). `crabd
    # serve` turns it on; a Daemon built in-process loads before it returns.
    inspector_async: bool = False
    scheduler: SchedulerPolicy | None = None      # default: SchedulerPolicy()
    standby_policy: StandbyPolicy | None = None   # default: one per sandbox, 2 GiB host-wide
    keep_last: int = 50           # retention: newest N checkpoints per sandbox ...
    keep_every: int = 10          # ... plus every Mth (0 = none)
    capture: str = "auto"         # crabd.capture mode: auto | fs-only | full
    pool_size: int | None = None  # bytes of a new btrfs loop pool (None: deltafs's default, 20 GiB)
    oracle_dir: str | None = None  # ground truth of every checkpoint written here (crabd/oracle.py; None: off)


class TurnInspector(Protocol):
    """Turns a sandbox's OS activity into one `Effects` record per turn."""

    def watch(self, sandbox_id: str, cgroup_path: str | os.PathLike[str], *, init_pid: int | None = None,
              outside_paths: tuple[str, ...] = ()) -> None: ...
    def unwatch(self, sandbox_id: str) -> None: ...
    def begin_turn(self, sandbox_id: str) -> None: ...
    def end_turn(self, sandbox_id: str) -> Effects: ...
    # crabd's own pause of the sandbox (freeze, CRIU dump, thaw): not the turn's activity
    def before_pause(self, sandbox_id: str) -> None: ...
    def after_pause(self, sandbox_id: str) -> None: ...
    def close(self) -> None: ...


class JobScheduler(Protocol):
    """Runs the daemon's jobs (captures, sizing, maintenance, standbys) in the
    order and at the concurrency its policy decides."""

    policy: SchedulerPolicy

    def submit(self, job: Job, coro_factory: Callable[[], Awaitable[T]]) -> asyncio.Future[T]: ...
    def cancel(self, sandbox_id: str, kinds: Iterable[JobKind] | None = None) -> list[Job]: ...
    def queue_wait(self, job_id: int) -> float | None: ...
    def queued(self) -> list[Job]: ...    # what waits, in start order (the operator view shows it)
    def running(self) -> list[Job]: ...
    async def close(self) -> None: ...


