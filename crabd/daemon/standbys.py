"""Hot standbys: per sandbox at most one, of its recovery target.

Part of `crabd.daemon`. A standby is the recovery target's processes
restored by CRIU into a spare container and kept stopped
(`crabd.runtime.standby`), on its own active snapshot of the target's files
(`names.new_standby_key`); for a target without processes (FS-only), a fresh
crabd-init started on that snapshot and stopped, so that every automatic
recovery is a promotion. It is prepared as idle work after each capture
that wrote something (admitted by the host-wide `deltacr.StandbyPolicy`), and
a rollback to that checkpoint is then a promotion (a SIGCONT) instead of a
CRIU restore. Standbys are caches: a restart drops them all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from ..errors import NotFound
from ..runtime import Sandbox
from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase, StandbyEntry
from .events import EventKind
from .names import is_standby_key, new_standby_key

log = logging.getLogger("crabd")

__all__ = ["Standbys"]


class Standbys(DaemonBase):
    def _standby_lock(self, sid: str) -> threading.Lock:
        with self._guard:
            return self._standby_locks.setdefault(sid, threading.Lock())

    def _schedule_standby_refresh(self, sid: str) -> None:
        """Queue a refresh of the sandbox's standby as idle work (event loop)."""
        if self.standby_policy.per_sandbox == 0 or sid not in self.turns:
            return
        from ..scheduler import JobKind
        job = self.scheduler.policy.background_job(JobKind.STANDBY_REFRESH, 0, time.monotonic(), sandbox_id=sid)
        self.scheduler.cancel(sid, kinds=[JobKind.STANDBY_REFRESH])  # only the newest matters

        async def run() -> None:
            held = self.standbys.get(sid)
            await asyncio.to_thread(self._refresh_standby, sid)
            now = self.standbys.get(sid)
            if held is not None and (now is None or now.checkpoint != held.checkpoint):
                # Retention spares the checkpoint a standby holds; a round that
                # ran while this refresh was queued (refreshes coalesce under
                # load) kept the old one, and nothing else would retry it.
                self._schedule_maintenance()

        def failed(e: BaseException) -> None:
            log.warning("standby refresh of %s failed: %s", sid, e)
            self.events.emit(EventKind.STANDBY_FAILED, sid, error=str(e))

        self._report_failure(self.scheduler.submit(job, run), failed)

    def _refresh_standby(self, sid: str) -> None:
        """Make the sandbox's standby hold its recovery target (worker thread)."""
        from deltacr import StandbyRecord

        from ..runtime.standby import (FRESH_STANDBY_MEMORY, admit_standby, prepare_fresh_standby, prepare_standby,
                                       standby_memory)
        from ..store import IntegrityError
        with self._standby_lock(sid):
            if sid not in self.turns:
                return  # being destroyed
            try:
                row = self.store.get_sandbox(sid)
                target = self._latest_committed(row)
            except NotFound:
                return
            cur = self.standbys.get(sid)
            if cur is not None and self._holds(cur, target, processes=True):
                return  # e.g. a SKIP turn's checkpoint: the same files and processes
            self._discard_standby_locked(sid)
            if not target.fs_snapshot:
                return
            try:  # CRIU never parses an image whose seal does not hold, not even into a standby
                self.integrity.verify(target)
            except IntegrityError as e:
                self.events.emit(EventKind.STANDBY_SKIPPED, sid, checkpoint=target.id, reason=e.message)
                return
            # The policy weighs the standbys this daemon holds (its own
            # checkpoint ids; the sandbox's own one was discarded above).
            memory = standby_memory(self.images, target.proc_image) if target.proc_image else FRESH_STANDBY_MEMORY
            new = StandbyRecord(sid, target.id, memory, time.time())
            current = [StandbyRecord(k, e.checkpoint, e.standby.memory_bytes, e.standby.created)
                       for k, e in self.standbys.items()]

            def evict(ev: StandbyRecord) -> None:
                if ev.sandbox_id != sid:
                    with self._standby_lock(ev.sandbox_id):
                        self._discard_standby_locked(ev.sandbox_id)

            adm = admit_standby(self.standby_policy, new, current, evict)
            if not adm.admit:
                self.events.emit(EventKind.STANDBY_SKIPPED, sid, checkpoint=target.id, reason=adm.reason)
                return
            key = new_standby_key()
            mounts = self.fs.prepare(key, parent=target.fs_snapshot)
            try:
                if target.proc_image:
                    st = prepare_standby(self.runtime, sid, self.images, target.proc_image, root=mounts)
                else:
                    st = prepare_fresh_standby(self.runtime, sid, target.id, root=mounts)
            except BaseException:
                self._remove_snapshot(key)
                raise
            self.standbys[sid] = StandbyEntry(target.id, st, key)
            self.events.emit(EventKind.STANDBY_READY, sid, checkpoint=target.id, prepare_ms=round(st.prepare_ms, 1),
                             memory_bytes=st.memory_bytes, processes=not st.fresh)

    def _promote_standby(self, sid: str, ck: CheckpointRow, row: SandboxRow,
                         timing: dict[str, float], processes: bool = True) -> tuple[str, Sandbox] | None:
        """Roll back by promoting the standby of `ck`, if there is one of the
        kind asked for (its processes restored, or a fresh init: `processes`
        and whether `ck` has an image decide). Returns the new root's deltafs
        key and the promoted sandbox, or None (then the cold path runs). The
        sandbox's old root (`row.fs_key`) is left to the caller to remove."""
        from ..runtime.standby import discard_standby, promote_standby
        # Without a standby that holds `ck` there is nothing to wait for: a
        # refresh making one of another checkpoint holds the lock for its
        # whole prepare (seen as slower rollbacks to older checkpoints).
        # The check that decides is repeated under the lock.
        e = self.standbys.get(sid)
        if e is None or not self._holds(e, ck, processes):
            return None
        with self._standby_lock(sid):
            e = self.standbys.get(sid)
            if e is None or not self._holds(e, ck, processes):
                return None
            self.standbys.pop(sid)
            t = time.monotonic()
            try:
                sb = promote_standby(self.runtime, e.standby)
            except Exception as err:  # stale or broken standby: the cold path is still correct
                log.warning("promoting the standby of %s for %s failed: %s", sid, ck.id, err)
                self.events.emit(EventKind.STANDBY_FAILED, sid, checkpoint=ck.id, error=str(err))
                try:
                    discard_standby(self.runtime, e.standby)
                finally:
                    self._remove_snapshot(e.fs_key)
                return None
            timing["promote"] = time.monotonic() - t
            for key, attr in (("resume", "promote_ms"), ("swap", "swap_ms")):
                ms = getattr(e.standby, attr, None)
                if ms is not None:
                    timing[key] = ms / 1000
        return e.fs_key, sb

    def _holds(self, e: StandbyEntry, ck: CheckpointRow, processes: bool) -> bool:
        """Whether standby `e` is exactly `ck`'s state (with its processes, or
        a fresh init when `processes` is False or `ck` has none). Judged by
        content, not by checkpoint id: a SKIP turn's checkpoint shares its
        parent's snapshot and image, so the parent's standby is its state
        too; a standby of any other snapshot (stale: a newer checkpoint was
        captured since; or newer than a rollback's target) is never used."""
        if e.checkpoint == ck.id:
            held = ck
        else:
            try:
                held = self.store.get_checkpoint(e.checkpoint)
            except NotFound:
                return False
        fresh = not (processes and ck.proc_image)
        return (e.standby.fresh == fresh and bool(held.fs_snapshot) and held.fs_snapshot == ck.fs_snapshot
                and (fresh or held.proc_image == ck.proc_image))

    def _discard_standby(self, sid: str) -> None:
        with self._standby_lock(sid):
            self._discard_standby_locked(sid)

    def _discard_standby_locked(self, sid: str) -> None:
        from ..runtime.standby import discard_standby
        e = self.standbys.pop(sid, None)
        if e is None:
            return
        try:
            discard_standby(self.runtime, e.standby)
        except Exception as err:
            log.warning("discarding the standby of %s: %s", sid, err)
        self._remove_snapshot(e.fs_key)

    def _discard_leftover_standbys(self) -> None:
        """Standbys are caches: after a restart, drop what an earlier daemon left."""
        from ..runtime.cgroups import sweep_standby_cgroups
        from ..runtime.standby import discard_standby, list_standbys, remove_standby_leftovers
        for st in list_standbys(self.runtime):
            try:
                discard_standby(self.runtime, st)
            except Exception as err:
                log.warning("discarding leftover standby %s: %s", st.token, err)
        # ... and what a prepare killed midway left (no standby.json yet)
        for d in remove_standby_leftovers(self.runtime):
            log.info("removed a half-made standby %s", d)
        rows = self.store.list_sandboxes()
        for row in rows:
            sweep_standby_cgroups(row.id)
        # A promoted standby's snapshot is its sandbox's root from then on
        # (named standby-...): never removed as a leftover, mounted or not.
        roots = {row.fs_key for row in rows}
        for info in list(self.fs.walk()):
            if is_standby_key(info.name) and info.name not in roots:
                self._remove_snapshot(info.name)
