"""Idle maintenance: retention of old checkpoints and the snapshot store's
compaction and garbage collection.

Part of `crabd.daemon`. Queued as one background job after every capture
that wrote something, run by the scheduler when the host is idle; a sandbox
with a turn, rollback or capture in flight is left for the next round. The
retention policy itself is pure (`crabd/retention.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import deltafs

from ..errors import NotFound
from .base import DaemonBase
from .events import EventKind
from .names import is_image_snapshot

log = logging.getLogger("crabd")

__all__ = ["Maintenance"]


class Maintenance(DaemonBase):
    def _schedule_maintenance(self) -> None:
        """Queue one snapshot-store maintenance job (compaction of overlay
        layer chains, removal of crash leftovers) as idle work (event loop)."""
        if self._maintenance_queued:
            return
        from ..scheduler import JobKind
        self._maintenance_queued = True
        job = self.scheduler.policy.background_job(JobKind.COMPACTION, 0, time.monotonic())

        async def run() -> None:
            self._maintenance_queued = False
            dropped = 0
            for sid, t in list(self.turns.items()):
                # A sandbox with a turn, rollback or capture in flight is left
                # for the next round (one is queued after every capture): idle
                # work never makes a turn wait for the sandbox's lock.
                if t.lock.locked() or (t.capture is not None and not t.capture.done()):
                    continue
                async with t.lock:  # no exec, rollback or capture of this sandbox meanwhile
                    dropped += await asyncio.to_thread(self._apply_retention, sid)
            merged, gone = await asyncio.to_thread(lambda: (self.fs.compact(), self.fs.gc()))
            if merged or gone or dropped:
                self.events.emit(EventKind.MAINTENANCE_DONE, None, dropped_checkpoints=dropped, merged_layers=merged,
                                 removed=len(gone))

        def done(f: asyncio.Future[Any]) -> None:
            self._maintenance_queued = False

        fut = self.scheduler.submit(job, run)
        fut.add_done_callback(done)
        self._report_failure(fut, lambda e: log.warning("snapshot maintenance failed: %s", e))

    def _retention(self) -> Any:
        from ..retention import Retention
        return Retention(self.options.keep_last, self.options.keep_every)

    def _protected(self, sid: str) -> set[str]:
        prot = set(self.store.fork_bases())
        e = self.standbys.get(sid)
        if e is not None:
            prot.add(e.checkpoint)
        return prot

    def _full_copy_path(self, sid: str, cid: str) -> Path:
        """The tar a crabd before the fair `full` mode wrote per checkpoint
        (capture mode full no longer writes one): still removed with its
        checkpoint or sandbox, so an upgraded state dir does not keep them."""
        return self.state_dir / "full" / sid / f"{cid}.tar"

    def _apply_retention(self, sid: str) -> int:
        """Drop the sandbox's checkpoints the retention policy lets go, with
        their snapshots and process images once nothing shares them."""
        from ..retention import victims
        try:
            row = self.store.get_sandbox(sid)
        except NotFound:
            return 0
        cks = self.store.list_checkpoints(sid)
        gone = victims([(c.id, c.seq) for c in cks], self._retention(), head=row.head,
                       protected=self._protected(sid))
        for cid in gone:
            ck = self.store.drop_checkpoint(cid)
            self._full_copy_path(sid, cid).unlink(missing_ok=True)
            if ck.fs_snapshot and not is_image_snapshot(ck.fs_snapshot) and \
                    self.store.fs_snapshot_refs(ck.fs_snapshot) == 0:
                # reparent: a parent goes too, its children take its parent as theirs
                try:
                    self.fs.remove(ck.fs_snapshot, reparent=True)
                except deltafs.NotFound:
                    pass
            if ck.proc_image:
                self._drop_image_if_unused(ck.proc_image)
        if gone:
            self.events.emit(EventKind.CHECKPOINTS_RETIRED, sid, checkpoints=gone)
        return len(gone)
