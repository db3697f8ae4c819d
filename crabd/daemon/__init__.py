"""The daemon's core: one object wiring runtime, deltafs, the inspector, the
store and the scheduler into sandboxes with turns, checkpoints, rollback and
fork.

`Daemon` is a thin facade: its constructor opens the parts and the
collaborators, and its behaviour is the union of one class per concern,
each in its own module (read them in this order):

* `protocols.py`   its options, and what it needs of the inspector and the scheduler
* `base.py`        the state the parts share (`Turns` per sandbox) and common helpers
* `names.py`       snapshot names (the one place their prefixes are spelled)
* `events.py`      `EventKind` (every event kind) and the event bus
* `space.py`       the one disk-full check and the space reserve
* `plans.py`       what a checkpoint's reasons record, and decisions taken from them
* `startup.py`     start, stop, and the reconciliation after a crash
* `images.py`      an image's files as a committed snapshot (collaborator)
* `sandboxes.py`   create, describe, destroy
* `integrity.py`   seals made at commit and checked before use (collaborator)
* `turns.py`       exec and turn boundaries: Effects -> plan -> pending checkpoint
* `pipeline.py`    the capture job: freeze, snapshot, CRIU dump, commit; sizing
* `queries.py`     checkpoints listed, described, diffed, deleted; health
* `rollback.py`    rollback and fork
* `ledger.py`      the effects ledger's glue
* `maintenance.py` retention and the snapshot store's compaction, as idle work
* `standbys.py`    hot standbys of each sandbox's recovery target
* `deathwatch.py`  dead sandboxes noticed and recovered

Concurrency model: the asyncio loop owns the coordinator (`Turns`, one per
sandbox: a lock that serialises that sandbox's execs and rollbacks, and the
future of its pending capture); everything that blocks (runc, mounts,
snapshots, SQLite) runs in worker threads through `asyncio.to_thread`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from .. import config
from ..runtime import AdoptedReaper, Runtime
from ..store import CheckpointRow, Store
from .base import Turns
from .deathwatch import DeathWatch
from .events import EventBus, EventKind
from .images import ImageSnapshots
from .integrity import Integrity
from .ledger import LedgerGlue
from .maintenance import Maintenance
from .pipeline import CapturePipeline
from .plans import BLIND_RESTART, BLIND_RESTORED, DIED_REASON
from .protocols import DaemonOptions, JobScheduler, TurnInspector
from .queries import Queries
from .rollback import Rollback
from .sandboxes import Sandboxes
from .space import RESERVE_BYTES, SpaceReserve, is_disk_full
from .standbys import Standbys
from .startup import Startup
from .turns import TurnLoop

__all__ = ["Daemon", "DaemonOptions", "Turns", "EventKind", "TurnInspector", "JobScheduler", "is_disk_full",
           "DIED_REASON", "BLIND_RESTART", "BLIND_RESTORED"]


class Daemon(Startup, Sandboxes, TurnLoop, CapturePipeline, Queries, Rollback, LedgerGlue, Maintenance,
             Standbys, DeathWatch):
    RESERVE_BYTES = RESERVE_BYTES

    def __init__(self, state_dir: Path | str | None = None, *, options: DaemonOptions | None = None,
                 inspector: TurnInspector | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else config.state_dir_from_env()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.options = options or DaemonOptions()
        self.space = SpaceReserve(self.state_dir)
        self.space.ensure()
        self.store = Store(self.state_dir)
        self.store.before_write = self.space.make_room
        self.events = EventBus(self.store)
        from ..effects import Ledger
        self.ledger = Ledger(self.store)  # effects ledger and budgets (crabd/effects.py)
        from deltacr import ImageStore

        from ..runtime.criu import CheckpointableRunner
        # The init's output on a pipe (not a host file): CRIU can dump that.
        self.runtime = Runtime(self.state_dir, runner=CheckpointableRunner())
        self.images = ImageStore(self.state_dir / "cr")
        self.fs = self._open_fs()
        self.space.sync = self.fs.sync
        self.image_snapshots = ImageSnapshots(self.fs, self.runtime, self.state_dir)
        self.integrity = Integrity(self.fs, self.store, self.images)
        self.store.sealer = self.integrity.seal_row
        self.inspector = inspector if inspector is not None else self._open_inspector()
        from ..metrics import Metrics
        from ..scheduler import Scheduler, SchedulerPolicy
        self.metrics = Metrics()
        self.scheduler = Scheduler(self.options.scheduler or SchedulerPolicy(), metrics=self.metrics)
        self.turns = {}
        # Hot standbys: per sandbox at most one, of its recovery target (the
        # newest complete checkpoint with a process image), prepared as idle
        # work; a rollback to that checkpoint is then a promotion (a SIGCONT)
        # instead of a CRIU restore.
        from deltacr import StandbyPolicy
        self.standby_policy = self.options.standby_policy or StandbyPolicy()
        self.standbys = {}
        self._standby_locks = {}
        self._maintenance_queued = False
        self._sizing_queued = {}
        self._guard = threading.Lock()
        self._reaper = AdoptedReaper()  # zombies crabd (a child subreaper) adopted: see watch_deaths
        self._loop = None
        self._adoption = None     # Startup.start's re-adoptions, when they run in the background
        self._adopting = set()    # sandboxes not yet re-adopted since the start
        self.started_at = time.time()

    async def wait_event(self, timeout: float) -> None:
        """Return at the next event, or after `timeout` seconds (the API's long poll)."""
        await self.events.wait(timeout)

    # Seals, by the names bench/seals.py measures them under.
    def _seal_row(self, row: CheckpointRow) -> dict[str, Any] | None:
        return self.integrity.seal_row(row)

    def _verify_checkpoint(self, ck: CheckpointRow, processes: bool = True) -> None:
        self.integrity.verify(ck, processes)


