"""The capture pipeline: a turn's checkpoint job, from the scheduler's
admission to a committed, durable row.

Part of `crabd.daemon`. The job (`_capture`) runs in a worker thread while
the agent waits on its LLM: writeback, freeze, deltafs checkpoint, (FS_PROC)
CRIU dump, thaw, commit the row, events. A SKIP turn gets a committed row
that shares its parent's snapshot and process image. Counting a checkpoint's
bytes (a walk of its snapshot) is queued afterwards as idle work (sizing).
A failed capture is recorded on its row and never takes the daemon down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Iterator

import deltafs
from deltafs.snapshotter import chaos_point  # CRABD_CHAOS: bench/chaos.py's kill points

from ..capture import apply_mode, processes_skipped
from ..errors import CrabdError, NotFound
from ..metrics import PHASES
from ..runtime import Freezer
from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase
from .events import EventKind
from .plans import save_everything
from .space import is_disk_full

log = logging.getLogger("crabd")

__all__ = ["CapturePipeline"]


class CapturePipeline(DaemonBase):
    async def _run_capture(self, sid: str, ck: CheckpointRow) -> None:
        """The turn's capture job; done (and the next turn free to run) once the
        checkpoint is committed and durable. Counting its bytes (a walk of the
        snapshot's tree) is queued after that as idle work (`_size_checkpoint`)."""
        from ..scheduler import JobCancelled
        turns = self.turns.get(sid)
        blind_at_open = turns.blind if turns is not None else None
        # Size estimate for the I/O budget: a SKIP writes nothing.
        est = 0 if ck.plan == "SKIP" else 1 << 20
        job = self.scheduler.policy.checkpoint_job(sid, est, time.monotonic())

        async def run() -> Any:
            # (the scheduler records the queue phase in its metrics itself)
            return await asyncio.to_thread(self._capture, ck, self.scheduler.queue_wait(job.id) or 0.0)

        try:
            extra = await self.scheduler.submit(job, run)
        except (asyncio.CancelledError, JobCancelled):
            await asyncio.to_thread(self.store.fail_checkpoint, ck.id, "cancelled by a rollback")
        except Exception as e:  # recorded; never take the daemon down
            log.exception("checkpoint %s failed", ck.id)
            code, msg = "checkpoint_failed", str(e)
            if is_disk_full(e):
                code = "disk_full"
                msg = (f"disk_full: the state file system is full; checkpoint {ck.id} was not taken and the "
                       f"sandbox's previous checkpoints are intact: {e} (fix: free space in the state directory "
                       f"{self.state_dir}: delete files inside the sandbox and old checkpoints or sandboxes; "
                       "checkpoints resume at the next turn)")
            await asyncio.to_thread(self._record_failure, ck.id, msg)
            try:  # a snapshot or process image it made before failing goes too
                await asyncio.to_thread(self._drop_capture_leftovers, ck)
            except Exception as e2:
                log.warning("cleaning up after checkpoint %s: %s", ck.id, e2)
            try:
                self.events.emit(EventKind.CHECKPOINT_FAILED, sid, checkpoint=ck.id, error=msg, code=code)
            except sqlite3.Error as e3:
                log.warning("recording the failure of checkpoint %s: %s", ck.id, e3)
            if code == "disk_full":
                await asyncio.to_thread(self.space.release_quietly)  # room to clean up (see _open_checkpoint)
        else:
            if turns is not None and blind_at_open is not None and turns.blind is blind_at_open:
                turns.blind = None  # this checkpoint saved everything: the record is whole again
            if ck.plan != "SKIP":
                await asyncio.to_thread(self.space.restore_if_room)
            if extra is not None:
                self._schedule_sizing(sid, ck.id, extra)
            if ck.plan != "SKIP":
                self._schedule_standby_refresh(sid)
                self._schedule_maintenance()

    def _record_failure(self, cid: str, msg: str) -> None:
        """Mark a checkpoint failed; on a full state file system, free the
        space reserve first so that SQLite has room to record it."""
        self.space.retry_when_full(lambda: self.store.fail_checkpoint(cid, msg))

    def _capture(self, ck: CheckpointRow, queue: float = 0.0) -> int | None:
        """Capture one checkpoint (worker thread): the scheduler admitted it
        after `queue` seconds. Returns once the checkpoint is committed and
        durable: None if its `bytes` are final, else the bytes to add to its
        snapshot's usage when `_size_checkpoint` measures it later."""
        t_start = time.monotonic()
        if self.options.oracle_dir:  # ground truth at this capture's frozen instant (crabd/oracle.py)
            from ..oracle import record_at_capture
            record_at_capture(self, ck)
        parent = self.store.get_checkpoint(ck.parent) if ck.parent else None
        if parent is not None and parent.state == "committed":
            # What this checkpoint inherits (snapshot, process image, seals) is
            # signed again by its commit: never launder a tampered parent.
            self.store.verify(parent)
        if ck.plan != "FS_PROC" and (parent is None or parent.state != "committed" or not parent.fs_snapshot):
            # SKIP and FS share state with their parent; one that is not
            # durable (failed, discarded) shares nothing: save everything.
            why = f"parent {ck.parent} is not a durable checkpoint" if ck.parent else "no durable parent"
            ck.plan, ck.reasons = apply_mode(*save_everything(why, ck.reasons), self.options.capture)
        if ck.plan == "SKIP" and parent is not None:
            self.store.commit_checkpoint(ck.id, fs_snapshot=parent.fs_snapshot, proc_image=parent.proc_image,
                                         bytes=0, durations={"queue": queue, "total": time.monotonic() - t_start,
                                                             "size": 0.0})
            self.events.emit(EventKind.CHECKPOINT_COMMITTED, ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=0)
            self.events.emit(EventKind.CHECKPOINT_SIZED, ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=0,
                             size_ms=0.0)
            return None
        row = self.store.get_sandbox(ck.sandbox_id)
        d: dict[str, float] = {"queue": queue}
        t = time.monotonic()
        self.fs.prepare_checkpoint(row.fs_key)  # writeback while the sandbox still runs
        d["writeback"] = time.monotonic() - t
        name = ck.id  # a checkpoint's snapshot is named after it (names.py)
        if ck.plan == "FS_PROC":
            return self._capture_proc(ck, row, d, t_start)
        self._frozen_fs_checkpoint(ck.sandbox_id, row.fs_key, name, d)
        t = time.monotonic()
        self.fs.sync()
        d["sync"] = time.monotonic() - t
        d["total"] = time.monotonic() - t_start
        # An FS turn did not run the sandbox's older processes (the classifier
        # would have said FS_PROC), so their memory is still the parent's
        # image: this checkpoint = the parent's processes on the new files.
        # (fs-only mode downgraded an FS_PROC turn: its processes did run.)
        inherited = parent.proc_image if parent is not None and not processes_skipped(ck.reasons) else None
        self.store.commit_checkpoint(ck.id, fs_snapshot=name, proc_image=inherited, durations=d, plan=ck.plan,
                                     reasons=list(ck.reasons))
        self.metrics.observe_checkpoint({k: v for k, v in d.items() if k in PHASES and k != "queue"})
        self.events.emit(EventKind.CHECKPOINT_COMMITTED, ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=None,
                         pause_ms=round(d["pause"] * 1000, 3))
        return 0

    def _frozen_fs_checkpoint(self, sid: str, key: str, name: str, d: dict[str, float]) -> None:
        """Commit `key` as snapshot `name` with the sandbox frozen; records the
        freeze, fs_commit, thaw and pause phases in `d`. A sandbox whose
        processes are gone has nothing to freeze: its files are committed as
        they are."""
        # The freezer file directly: no runc process on the pause's path.
        freezer = Freezer(self.runtime.layout, f"/crabd/{sid}")
        with self._inspector_pause(sid, d):
            t_freeze = time.monotonic()
            try:
                freezer.freeze()
                frozen = True
            except CrabdError:
                frozen = False
            d["freeze"] = time.monotonic() - t_freeze
            try:
                chaos_point("fs_commit")
                t = time.monotonic()
                self.fs.checkpoint(key, name=name)
                d["fs_commit"] = time.monotonic() - t
            finally:
                if frozen:
                    t = time.monotonic()
                    freezer.thaw()
                    d["thaw"] = time.monotonic() - t
                d["pause"] = time.monotonic() - t_freeze

    def _drop_commit(self, name: str) -> str | None:
        """Remove committed snapshot `name` (the sandbox's active key, its
        child, takes its parent); None once gone, `name` if it stays."""
        try:
            self.fs.remove(name, reparent=True)
            return None
        except Exception:
            log.warning("could not drop snapshot %s (it keeps crabd's link-remap links)", name, exc_info=True)
            return name

    @contextlib.contextmanager
    def _inspector_pause(self, sid: str, d: dict[str, float]) -> Iterator[None]:
        """Tell the inspector about crabd's own pause of the sandbox (freeze,
        CRIU dump, thaw), so the wake-ups it causes are not taken for the
        next turn's process activity (which would make every later turn
        FS_PROC). Records the `rebaseline` phase: the wait for the thawed
        tasks to go quiet (at most the inspector's settle time)."""
        try:
            self.inspector.before_pause(sid)
            told = True
        except Exception:  # not watched (a dead sandbox), or an old inspector
            told = False
        try:
            yield
        finally:
            if told:
                t = time.monotonic()
                try:
                    self.inspector.after_pause(sid)
                except Exception:
                    log.warning("inspector rebaseline of %s failed", sid, exc_info=True)
                d["rebaseline"] = time.monotonic() - t

    def _capture_proc(self, ck: CheckpointRow, row: SandboxRow, d: dict[str, float], t_start: float) -> int | None:
        """FS and processes at one instant: frozen from the FS commit to the
        end of the CRIU dump. A refused dump still leaves a file-system
        checkpoint (committed, without a process image, with the reason)."""
        from deltacr import DeltacrError

        from ..runtime.criu import checkpoint_processes
        # Capture mode `full` comes here at every turn and is captured and
        # counted exactly like crabd's own FS_PROC turns (crabd/capture.py).
        proc_image: str | None = None
        error: str | None = None
        notes: tuple[str, ...] = ()

        def fs_commit() -> Any:
            out = self.fs.checkpoint(row.fs_key, name=ck.id)
            chaos_point("criu_dump")  # frozen, files committed, the dump next
            return out

        try:
            with self._inspector_pause(ck.sandbox_id, d):
                info = checkpoint_processes(self.runtime, ck.sandbox_id, self.images, ck.id, fs_commit=fs_commit)
            proc_image, notes = ck.id, info.notes
            d.update(pause=info.pause_ms / 1000, fs_commit=info.fs_ms / 1000, proc_dump=info.dump_ms / 1000,
                     store=info.store_ms / 1000)
            # Bytes written: crabd's store de-duplicates and compresses, so a
            # dump of a process whose memory barely changed costs little.
            proc_bytes = info.written_bytes
        except (DeltacrError, CrabdError) as e:
            error = str(e)
            proc_bytes = 0
            fs_done = getattr(e, "fs_result", None)
            if fs_done is not None and getattr(e, "committed_links", None):
                # The commit holds crabd's links for a dump that failed
                # (runtime/linkremap.py), gone from the live sandbox since:
                # commit its files again without them.
                fs_done = self._drop_commit(ck.id)
            if fs_done is None:
                # The dump was refused before the file system was committed
                # (or the commit itself failed): take the FS checkpoint now.
                self._frozen_fs_checkpoint(ck.sandbox_id, row.fs_key, ck.id, d)
        t = time.monotonic()
        self.fs.sync()
        d["sync"] = time.monotonic() - t
        d["total"] = time.monotonic() - t_start
        reasons = list(ck.reasons) + list(notes)
        if error:
            reasons.append(f"process image not captured: {error}")
        # The snapshot's usage is counted later, off the next turn's path.
        self.store.commit_checkpoint(ck.id, fs_snapshot=ck.id, proc_image=proc_image, bytes=0, durations=d,
                                     reasons=reasons, plan=ck.plan)
        self.metrics.observe_checkpoint({k: v for k, v in d.items() if k in PHASES and k != "queue"}, 0)
        if error:
            self.events.emit(EventKind.CHECKPOINT_PROC_FAILED, ck.sandbox_id, checkpoint=ck.id, error=error)
        self.events.emit(EventKind.CHECKPOINT_COMMITTED, ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=None,
                         proc=proc_image is not None, pause_ms=round(d.get("pause", 0) * 1000, 3))
        return proc_bytes

    # --- sizing: a committed checkpoint's bytes, counted as idle work ------------------------
    def _schedule_sizing(self, sid: str, cid: str, extra: int) -> None:
        """Queue the byte count of committed checkpoint `cid` as idle work (event loop)."""
        from ..scheduler import JobKind
        job = self.scheduler.policy.background_job(JobKind.SIZING, 0, time.monotonic(), sandbox_id=sid)
        self._sizing_queued[cid] = (sid, extra)

        async def run() -> None:
            self._sizing_queued.pop(cid, None)
            await asyncio.to_thread(self._size_checkpoint, cid, extra)

        self._report_failure(self.scheduler.submit(job, run),
                             lambda e: log.warning("sizing checkpoint %s failed: %s", cid, e))

    def _size_checkpoint(self, cid: str, extra: int) -> None:
        """Fill in a committed checkpoint's `bytes`: what its snapshot adds over
        its parent, plus `extra` (its process image's raw bytes). Worker thread,
        at the lowest CPU priority: the walk must not slow the sandboxes' turns."""
        t = time.monotonic()
        tid = threading.get_native_id()
        try:
            old_nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            old_nice = None
        try:
            ck = self.store.get_checkpoint(cid)
            if ck.state != "committed" or not ck.fs_snapshot:
                return
            size = self.fs.usage(ck.fs_snapshot).size + extra
            ck = self.store.set_checkpoint_bytes(cid, size, {"size": time.monotonic() - t})
        except (NotFound, deltafs.NotFound):
            return  # retired or destroyed meanwhile: nothing to size
        except OSError:
            try:
                self.store.get_checkpoint(cid)
            except NotFound:
                return  # its snapshot went with it while we walked it
            raise
        finally:
            if old_nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, old_nice)  # the pool thread serves others next
        self.metrics.observe_checkpoint({}, size)
        self.events.emit(EventKind.CHECKPOINT_SIZED, ck.sandbox_id, checkpoint=cid, plan=ck.plan, bytes=size,
                         size_ms=round((time.monotonic() - t) * 1000, 3))

    def _resize_unsized(self) -> None:
        """Checkpoints committed before a restart whose sizing never ran: queue it (event loop)."""
        for ck in self.store.iter_all_checkpoints():
            if ck.state != "committed" or ck.seq == 0 or ck.plan == "SKIP" or "size" in (ck.durations or {}):
                continue
            extra = 0
            if ck.proc_image == ck.id:
                try:
                    # what the store wrote for it, as the capture counts it; the
                    # raw image size only for a manifest written without that figure
                    m = self.images.manifest(ck.proc_image)
                    extra = m.written or m.raw_bytes
                except Exception:
                    extra = 0
            self._schedule_sizing(ck.sandbox_id, ck.id, extra)
