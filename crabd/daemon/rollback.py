"""Rollback and fork: a sandbox back to an earlier checkpoint, or new
sandboxes from one.

Part of `crabd.daemon`. Rollback to n: verify n's seals -> stop -> a new
root snapshot on n's files -> restore n's processes (a promotion of the hot
standby when it holds n: `standbys.py`; else CRIU; else a fresh init) -> a
new branch recorded. The reply lists the external effects recorded after n,
which no rollback can undo (`ledger.py`). Fork makes new sandboxes the same
way (`sandboxes.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any, Callable

from deltafs.snapshotter import chaos_point  # CRABD_CHAOS: bench/chaos.py's kill points

from ..effects import abandoned_line, seen_not_undone
from ..errors import CrabdError, FailedPrecondition, InvalidArgument, NotFound
from ..runtime import Freezer, Limits, Sandbox, reap
from ..runtime.procfs import cgroup_procs
from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase, Turns
from .events import EventKind
from .names import new_root_key
from .plans import BLIND_RESTORED, is_complete

log = logging.getLogger("crabd")

__all__ = ["Rollback", "ROLLING_BACK"]

# The sandbox's state in the store while a rollback replaces its files and processes.
ROLLING_BACK = "rolling_back"

_OLD_ROOT = "_old_root"   # in _rollback_sync's result: a root snapshot to remove after the reply


class Rollback(DaemonBase):
    async def rollback(self, ref: str, checkpoint: str | int | None, owner: str | None = None,
                       reason: str = "requested", processes: bool = True,
                       only_if_dead: bool = False) -> dict[str, Any] | None:
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        t0 = time.monotonic()
        async with t.lock:
            if only_if_dead and await asyncio.to_thread(self._live_init, row.id) is not None:
                return None  # an automatic recovery that a rollback by hand made moot while it waited
            self.scheduler.cancel(row.id)
            await self._wait_capture(t)
            try:
                out = await asyncio.to_thread(self._rollback_sync, row.id, checkpoint, reason, processes)
                old_root = out.pop(_OLD_ROOT, None)
                if old_root:
                    self._later(self._remove_snapshot, old_root)
            except Exception:
                self.metrics.rollbacks.labels(result="failed").inc()
                raise
            finally:
                # The cancel above dropped the sandbox's queued sizing too: the
                # checkpoints still get their bytes counted.
                for cid, (sid, extra) in list(self._sizing_queued.items()):
                    if sid == row.id:
                        self._schedule_sizing(sid, cid, extra)
            t.last_end = None
            # The sandbox is the target's state now; restored processes ran
            # before the inspector watched them again (see BLIND_RESTORED).
            t.blind = BLIND_RESTORED if "proc" in out.get("restored", "") else None
            await self._after_rollback(t, row.id)
        self.metrics.rollbacks.labels(result="ok").inc()
        out["duration_ms"] = round((time.monotonic() - t0) * 1000, 3)
        return out

    def _later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` in a worker thread, off the caller's critical path
        (its failure is logged)."""
        def done(f: asyncio.Future[Any]) -> None:
            if not f.cancelled() and f.exception() is not None:
                log.warning("%s%s failed: %s", getattr(fn, "__name__", fn), args, f.exception())

        asyncio.get_running_loop().run_in_executor(None, fn, *args).add_done_callback(done)

    def _latest_committed(self, row: SandboxRow) -> CheckpointRow:
        """The newest complete checkpoint on the sandbox's current line.

        Complete = committed, and holding everything its plan asked for: an
        FS_PROC checkpoint whose CRIU dump failed has the files but not the
        processes, so recovery prefers an older complete one (an explicit
        rollback to it is still allowed: files plus a fresh init). Nor is the
        checkpoint of a turn the sandbox died in (plans.is_complete)."""
        cid: str | None = row.head
        fallback: CheckpointRow | None = None
        while cid:
            c = self.store.get_checkpoint(cid)
            if c.state == "committed" and c.fs_snapshot:
                if is_complete(c):
                    return c
                fallback = fallback or c
            cid = c.parent
        if fallback is not None:
            return fallback
        raise NotFound(f"sandbox {row.id} has no committed checkpoint")

    @staticmethod
    def _require_files(ck: CheckpointRow) -> None:
        """A rollback or fork target must hold files to start from: a failed
        or discarded checkpoint never does, nor a row an older crabd
        committed on top of one (it would start an empty root)."""
        if ck.state != "committed":
            raise FailedPrecondition(f"checkpoint {ck.id} is {ck.state}, not committed: it holds no state",
                                     fix=f"roll back to a committed checkpoint (GET /v1/sandboxes/{ck.sandbox_id}"
                                         "/checkpoints lists them)")
        if not ck.fs_snapshot:
            raise FailedPrecondition(f"checkpoint {ck.id} holds no file-system snapshot (its parent never became "
                                     "durable)", fix="roll back to an older committed checkpoint")

    def _rollback_sync(self, sid: str, ref: str | int | None, reason: str, processes: bool = True) -> dict[str, Any]:
        """Roll back to `ref` (None: the recovery target); processes=False
        starts a fresh init on its files (a recovery's fallback)."""
        row = self.store.get_sandbox(sid)
        ck = self._latest_committed(row) if ref is None else self.resolve_checkpoint(sid, ref)
        self._require_files(ck)
        timing: dict[str, float] = {}
        t = time.monotonic()
        # Before anything of the sandbox is stopped or replaced; on a promotion
        # too, though it reads nothing of the process image: a tampered image
        # is refused wherever it is named (tests/integration/crabd/test_tamper.py).
        self.integrity.verify(ck)
        timing["verify"] = time.monotonic() - t
        # A crash from here until _finish_rollback records the new head leaves
        # files and processes that may be the target's, the old head's or a
        # mix, while the store still names the old head: a restart that
        # adopted them ran the target's state as the head's. Marked, a
        # restart recovers the sandbox instead (startup._adopt).
        self.store.update_sandbox(sid, state=ROLLING_BACK)
        try:
            return self._rollback_steps(sid, row, ck, processes, reason, timing)
        except BaseException:
            self.store.update_sandbox(sid, state=row.state)
            raise

    def _rollback_steps(self, sid: str, row: SandboxRow, ck: CheckpointRow, processes: bool,
                        reason: str, timing: dict[str, float]) -> dict[str, Any]:
        try:
            self.inspector.unwatch(sid)
        except Exception:
            pass
        promoted = self._promote_standby(sid, ck, row, timing, processes)
        if promoted is not None:
            restored = "fs+proc (hot standby)" if processes and ck.proc_image else "fs (standby)"
            chaos_point("rollback_restored")
            out = self._finish_rollback(sid, row, ck, promoted[0], restored, timing, reason, sb=promoted[1])
            # The old root goes after the reply (a btrfs subvolume delete was
            # ~a tenth of a promotion's rollback, profiled); unnamed by the
            # store already, a restart removes it if this never runs.
            out[_OLD_ROOT] = row.fs_key
            return out
        t = time.monotonic()
        self._end_processes(sid)
        if ck.proc_image and processes:
            self.runtime.stop(sid)  # `runc restore` gets the container as runc left it
        else:
            # A fresh init: not runtime.stop, which with the tasks dead
            # still asks `runc state` four times and spawns `runc delete`
            # (~30 ms each under load: most of a cold FS-only rollback's
            # stop, profiled). reset drops runc's state of the dead
            # container without asking runc; `runc create` reuses its
            # cgroups, as after a failed restore (`_start_from`).
            self.runtime.reset(sid)
        timing["stop"] = time.monotonic() - t
        chaos_point("rollback")
        t = time.monotonic()
        self.runtime.unmount_root(sid)
        new_key = new_root_key()
        mounts = self.fs.prepare(new_key, parent=ck.fs_snapshot)
        # The store names the new root before the runtime mounts it: a crash
        # from here on leaves the old key unnamed (removed at restart), never
        # a mounted root the store does not know.
        self.store.update_sandbox(sid, fs_key=new_key)
        self.runtime.set_root(sid, mounts)
        timing["fs"] = time.monotonic() - t
        t = time.monotonic()
        try:
            restored = self._start_from(sid, ck, processes)
        except BaseException:
            self._remove_snapshot(row.fs_key)
            raise
        timing["start"] = time.monotonic() - t
        chaos_point("rollback_restored")  # the target runs; the store still names the old head
        out = self._finish_rollback(sid, row, ck, new_key, restored, timing, reason)
        out[_OLD_ROOT] = row.fs_key  # removed after the reply, as a promotion's (unnamed by the store already)
        return out

    def _end_processes(self, sid: str, timeout: float = 5.0) -> None:
        """SIGKILL every task of the sandbox's cgroup and wait until it is
        empty, watching the cgroup only: `runtime.reset`'s own kill loop asks
        runc for the sandbox on every round (a spawn each). Best effort:
        what is left after `timeout`, reset or stop kills."""
        fz = Freezer(self.runtime.layout, f"/crabd/{sid}")  # Sandbox.cgroup_rel
        procs = fz.dir / "cgroup.procs"
        try:
            if fz.state() != "THAWED":
                fz.thaw()  # a frozen task gets its SIGKILL only once thawed
        except (FailedPrecondition, OSError):
            pass
        deadline = time.monotonic() + timeout
        while pids := cgroup_procs(procs):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(pid)  # the init is crabd's (a child subreaper) to reap
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _finish_rollback(self, sid: str, row: SandboxRow, ck: CheckpointRow, new_key: str, restored: str,
                         timing: dict[str, float], reason: str, sb: Sandbox | None = None) -> dict[str, Any]:
        """Record the rollback; `sb`: the sandbox as the promotion left it
        (then nobody asks runc for it again)."""
        t = time.monotonic()
        # One walk: what the inspector saw and what the ledger holds, on the same stretch.
        line = abandoned_line(row.head, row.branch, ck.id, self._checkpoint_or_none)
        not_undone = seen_not_undone(line.lost)
        ledger = self._ledger_report(sid, row, line.path)
        timing["ledger"] = time.monotonic() - t
        t = time.monotonic()
        # The new head and its events in one commit: one WAL fsync
        # (synchronous=FULL) instead of one for the row and one per event
        # after it (each ~1-30 ms of the reply at this host's load, profiled).
        # The events were written after the watch below, now before it: no
        # reader acts on them sooner (a turn or rollback waits for the
        # sandbox's lock, which this rollback holds until the watch is set),
        # and a crash can no longer keep the row without its events.
        with self.store.transaction():
            self.store.update_sandbox(sid, fs_key=new_key, head=ck.id, branch=row.branch + 1, state="running")
            self.events.emit(EventKind.SANDBOX_ROLLED_BACK, sid, checkpoint=ck.id, reason=reason,
                             branch=row.branch + 1, restored=restored, effects_not_undone=not_undone)
            if ledger["committed_after"] or ledger["unknown"]:
                self.events.emit(EventKind.EFFECTS_NOT_UNDONE, sid, checkpoint=ck.id, **ledger)
        timing["record"] = time.monotonic() - t
        t = time.monotonic()
        self._watch(sid, sb)
        timing["watch"] = time.monotonic() - t
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._schedule_standby_refresh, sid)
        return {"sandbox": sid, "checkpoint": ck.id, "seq": ck.seq, "turn": ck.turn, "branch": row.branch + 1,
                "restored": restored, "effects_not_undone": not_undone, "ledger": ledger,
                "timing_ms": {k: round(v * 1000, 3) for k, v in timing.items()}}

    def _start_from(self, sid: str, ck: CheckpointRow, processes: bool = True) -> str:
        """Start a sandbox whose root is already `ck`'s files: restore `ck`'s
        processes when it has an image (and `processes`), else a fresh init.
        A failed restore falls back to a fresh init, with an event that says so."""
        if ck.proc_image and processes:
            from deltacr import DeltacrError

            from ..runtime.criu import restore_processes
            try:
                restore_processes(self.runtime, sid, self.images, ck.proc_image)
                return "fs+proc"
            except (DeltacrError, CrabdError) as e:
                log.warning("restoring processes of %s into %s failed: %s", ck.id, sid, e)
                self.events.emit(EventKind.SANDBOX_RESTORE_FAILED, sid, checkpoint=ck.id, error=str(e),
                                 fallback="fresh init on the checkpoint's files")
                # not runtime.stop: runc may be left waiting on a killed CRIU
                self.runtime.reset(sid)
        self.runtime.start(sid)
        return "fs"

    async def fork(self, cid: str, count: int = 1, owner: str | None = None,
                   name: str | None = None) -> dict[str, Any]:
        """`count` sandboxes from checkpoint `cid`; `name` names a single one
        (the Docker API's create with the crabd.fork-from label)."""
        if not 1 <= count <= 64:
            raise InvalidArgument("count must be between 1 and 64")
        if name is not None and count != 1:
            raise InvalidArgument("a name is given to one fork only", fix="fork with count 1, or without a name")
        ck = await asyncio.to_thread(self.store.get_checkpoint, cid)
        src = self._own(await asyncio.to_thread(self.store.get_sandbox, ck.sandbox_id), owner)
        self._require_files(ck)
        await asyncio.to_thread(self.integrity.verify, ck)
        t0 = time.monotonic()
        made = []
        for _ in range(count):
            row = await asyncio.to_thread(self._new_sandbox, image=src.image, name=name,
                                          limits=Limits.from_dict(src.limits), owner=src.owner,
                                          parent_snapshot=ck.fs_snapshot, base_checkpoint=ck, lineage=src.lineage)
            made.append(row.id)
        return {"checkpoint": ck.id, "sandboxes": made, "duration_ms": round((time.monotonic() - t0) * 1000, 3)}
