"""The state the parts of the daemon share, and the few helpers they all use.

Part of `crabd.daemon`. `Daemon` (the package's facade) is one object made
of one class per concern (`startup.py`, `sandboxes.py`, `turns.py`,
`pipeline.py`, `queries.py`, `rollback.py`, `ledger.py`, `maintenance.py`,
`standbys.py`, `deathwatch.py`), each a `DaemonBase`: the attributes below are
what they share (set by `Daemon.__init__`), and the clean seams are
collaborator objects (`events.EventBus`, `space.SpaceReserve`,
`integrity.Integrity`, `images.ImageSnapshots`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import deltafs

from ..errors import NotFound
from ..store import CheckpointRow, SandboxRow, Store
from .names import is_image_snapshot

if TYPE_CHECKING:
    from deltacr import ImageStore, StandbyPolicy

    from ..effects import Ledger
    from ..metrics import Metrics
    from ..runtime import AdoptedReaper, Limits, Runtime
    from ..runtime.standby import Standby
    from .events import EventBus
    from .images import ImageSnapshots
    from .integrity import Integrity
    from .protocols import DaemonOptions, JobScheduler, TurnInspector
    from .space import SpaceReserve

log = logging.getLogger("crabd")

__all__ = ["DaemonBase", "Turns", "StandbyEntry"]


@dataclass
class StandbyEntry:
    checkpoint: str   # the daemon checkpoint it holds (files + processes)
    standby: Standby  # crabd.runtime.standby.Standby
    fs_key: str       # its deltafs active snapshot (a fork of the checkpoint's files)


@dataclass
class Turns:
    """Per-sandbox turn state, owned by the event loop."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    capture: asyncio.Future[Any] | None = None
    last_end: float | None = None
    init_pid: int | None = None
    recovering: bool = False
    # Set when the inspector's record since the last durable checkpoint is
    # broken (plans.BLIND_*): the next checkpoint saves everything. Cleared
    # when a checkpoint opened under that reason commits.
    blind: str | None = None
    # Why the sandbox is dead, when the death watch cannot see it from a pid:
    # a rollback ended with it not running (its restored processes died
    # during the restore or the promotion, before their pid was recorded),
    # or an automatic recovery failed. The watch takes it as a death.
    died: str | None = None
    recoveries: list[Any] = field(default_factory=list)  # crabd.recovery.Attempt, newest last
    gave_up: bool = False  # automatic recovery exhausted its options: no more until a manual rollback
    oom_kills: int | None = None  # memory.events oom_kill last seen (None: not read yet)
    oom_file: str | None = None  # its cgroup's memory.events / memory.oom_control (set when watched)


class DaemonBase:
    state_dir: Path
    options: DaemonOptions
    store: Store
    ledger: Ledger
    runtime: Runtime
    images: ImageStore            # CRIU process images (deltacr)
    fs: Any                       # the deltafs snapshotter
    inspector: TurnInspector
    metrics: Metrics
    scheduler: JobScheduler
    events: EventBus
    space: SpaceReserve
    integrity: Integrity
    image_snapshots: ImageSnapshots
    turns: dict[str, Turns]
    standby_policy: StandbyPolicy
    standbys: dict[str, StandbyEntry]
    _standby_locks: dict[str, threading.Lock]
    _maintenance_queued: bool
    # Checkpoints whose sizing is queued: id -> (sandbox, extra bytes). A
    # rollback cancels the sandbox's queued work; these are queued again.
    _sizing_queued: dict[str, tuple[str, int]]
    _guard: threading.Lock
    _reaper: AdoptedReaper
    _loop: asyncio.AbstractEventLoop | None
    _adoption: asyncio.Task[None] | None
    _adopting: set[str]
    started_at: float

    if TYPE_CHECKING:
        # What the parts call of one another (for the type checker only; the
        # definitions are in the modules named).
        # sandboxes.py
        def _new_sandbox(self, *, image: str, name: str | None, limits: Limits, owner: str,
                         parent_snapshot: str, base_checkpoint: CheckpointRow | None,
                         lineage: str | None) -> SandboxRow: ...
        def _watch(self, sid: str, sb: Any = None) -> None: ...
        # turns.py
        async def _wait_capture(self, t: Turns) -> float: ...
        # pipeline.py
        async def _run_capture(self, sid: str, ck: CheckpointRow) -> None: ...
        def _schedule_sizing(self, sid: str, cid: str, extra: int) -> None: ...
        def _resize_unsized(self) -> None: ...
        # queries.py
        def checkpoint_info(self, cid: str, owner: str | None = None) -> dict[str, Any]: ...
        def resolve_checkpoint(self, sid: str, ref: str | int) -> CheckpointRow: ...
        # rollback.py
        async def rollback(self, ref: str, checkpoint: str | int | None, owner: str | None = None,
                           reason: str = "requested", processes: bool = True,
                           only_if_dead: bool = False) -> dict[str, Any] | None: ...
        def _latest_committed(self, row: SandboxRow) -> CheckpointRow: ...
        @staticmethod
        def _require_files(ck: CheckpointRow) -> None: ...
        def _start_from(self, sid: str, ck: CheckpointRow, processes: bool = True) -> str: ...
        def _end_processes(self, sid: str, timeout: float = 5.0) -> None: ...
        # ledger.py
        def _ledger_after_turn(self, row: SandboxRow, turn: int, ck: CheckpointRow, effects: Any,
                               wall_s: float) -> None: ...
        def _ledger_report(self, sid: str, row: SandboxRow, path: Sequence[tuple[str, int]]) -> dict[str, Any]: ...
        # maintenance.py
        def _schedule_maintenance(self) -> None: ...
        def _retention(self) -> Any: ...
        def _protected(self, sid: str) -> set[str]: ...
        # standbys.py
        def _schedule_standby_refresh(self, sid: str) -> None: ...
        def _promote_standby(self, sid: str, ck: CheckpointRow, row: SandboxRow,
                             timing: dict[str, float], processes: bool = True) -> tuple[str, Any] | None: ...
        def _discard_standby(self, sid: str) -> None: ...
        def _discard_leftover_standbys(self) -> None: ...
        # startup.py
        def _drop_capture_leftovers(self, ck: CheckpointRow) -> None: ...
        # deathwatch.py
        async def _auto_recover(self, sid: str) -> None: ...
        def wake_death_watch(self) -> None: ...
        async def _after_rollback(self, t: Turns, sid: str) -> None: ...
        def _live_init(self, sid: str) -> int | None: ...

    @staticmethod
    def _own(row: SandboxRow, owner: str | None) -> SandboxRow:
        if owner is not None and row.owner != owner:
            raise NotFound(f"no sandbox {row.id!r}")
        return row

    def _checkpoint_or_none(self, cid: str) -> CheckpointRow | None:
        """A checkpoint row, None when it is gone (crabd.effects.abandoned_line's `get`)."""
        try:
            return self.store.get_checkpoint(cid)
        except NotFound:
            return None

    def _remove_snapshot(self, name: str) -> None:
        try:
            self.fs.remove(name)
        except deltafs.NotFound:
            pass
        except deltafs.FailedPrecondition as e:
            # Still a parent of a fork's snapshot: it goes when they do.
            log.info("keeping snapshot %s: %s", name, e)

    def _drop_snapshot_if_unused(self, name: str | None) -> None:
        """Remove a checkpoint's snapshot once no checkpoint row names it
        (an image's snapshot is never a checkpoint's own)."""
        if name and not is_image_snapshot(name) and self.store.fs_snapshot_refs(name) == 0:
            self._remove_snapshot(name)

    def _drop_image_if_unused(self, image: str) -> None:
        """Remove a process image once no checkpoint row names it."""
        if self.store.proc_image_refs(image) != 0:
            return
        try:
            self.images.remove(image)
        except Exception as e:
            log.info("keeping process image %s: %s", image, e)

    @staticmethod
    def _report_failure(fut: asyncio.Future[Any], report: Callable[[BaseException], None]) -> None:
        """Call `report(error)` when a background job fails (not when it is
        cancelled, by a rollback or a destroy: that is no failure)."""
        from ..scheduler import JobCancelled

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                return
            e = f.exception()
            if e is not None and not isinstance(e, JobCancelled):
                report(e)

        fut.add_done_callback(done)
