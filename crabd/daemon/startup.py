"""Start-up and stop of the daemon, and the reconciliation after a crash.

Part of `crabd.daemon`. At start the store is the truth: pending checkpoints
(not durable when the last daemon died) are discarded with what their capture
made; runtime sandboxes, snapshots, mounts and standbys no row names are
removed; sandboxes found running are watched again (their next checkpoint
saves everything: `plans.BLIND_RESTART`), found frozen are thawed, found dead
are recovered per policy (`deathwatch.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import deltafs
from deltafs import unmount

from ..errors import CrabdError, FailedPrecondition, NotFound
from ..runtime import Freezer
from ..store import CheckpointRow
from .base import DaemonBase, Turns
from .events import EventKind
from .names import FULL_MOUNT, IMPORT_MOUNT, REMOTE_LAYER, is_sandbox_root
from .plans import BLIND_RESTART
from .rollback import ROLLING_BACK

log = logging.getLogger("crabd")

__all__ = ["Startup"]


class Startup(DaemonBase):
    def _open_fs(self) -> Any:
        # A daemon killed with SIGKILL a moment ago may still hold the
        # snapshot store's lock while the kernel tears it down: wait a little.
        deadline = time.monotonic() + 15
        while True:
            try:
                fs: Any = deltafs.open(str(self.state_dir / "fs"), driver=self.options.snapshot_driver,
                                  pool_size=self.options.pool_size)
                # Test knob (bench/chaos.py): shallow overlay chains, so compaction runs often.
                if fs.driver == "overlay" and os.environ.get("CRABD_OVERLAY_MAX_DEPTH"):
                    fs.max_depth = max(2, int(os.environ["CRABD_OVERLAY_MAX_DEPTH"]))
                return fs
            except deltafs.FailedPrecondition as e:
                if "in use" not in str(e) or time.monotonic() > deadline:
                    raise FailedPrecondition(str(e), fix="stop the other crabd using this --state-dir") from e
                time.sleep(0.2)

    def _open_inspector(self) -> Any:
        import ebpf
        if not self.options.use_bpf:
            return ebpf.ProcInspector(None)
        if self.options.inspector_async:
            from deltafs.snapshotter import chaos_point  # CRABD_CHAOS=inspector_load: a slow load, for tests
            return ebpf.open_inspector_async(None, before_load=lambda: chaos_point("inspector_load"))
        return ebpf.open_inspector(None)

    async def start(self, *, adopt_in_background: bool = False) -> None:
        """Reload the store, settle what a crash left half-done, re-adopt
        sandboxes. `adopt_in_background` (`crabd serve`): return once the
        state is settled, the adoptions still running; each sandbox's turn
        lock is held until its own adoption ends, so its turns and rollbacks
        wait for it (health's `adopting` counts them)."""
        self._loop = asyncio.get_running_loop()
        self.events.bind(self._loop)
        # Every exec holds a worker thread for its command's whole run; with
        # asyncio's default pool (cores + 4 threads) 16 sandboxes' execs and
        # captures would queue for threads, which shows up as stall.
        from concurrent.futures import ThreadPoolExecutor
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=256, thread_name_prefix="crabd"))
        await asyncio.to_thread(self._recover_pending)
        for eid, sid in await asyncio.to_thread(self.ledger.mark_in_flight_unknown):
            self.events.emit(EventKind.EFFECT_UNKNOWN, sid, effect=eid,
                             reason="crabd restarted while it was in flight")
        rows = self.store.list_sandboxes()
        for row in rows:
            self.turns[row.id] = Turns()
        self._adopting = {row.id for row in rows}
        if not adopt_in_background:
            await self._adopt_all([row.id for row in rows], held=False)
            return
        for row in rows:  # uncontended: taken at once, before any request can ask for it
            await self.turns[row.id].lock.acquire()
        self._adoption = asyncio.create_task(self._adopt_all([row.id for row in rows], held=True))

    async def _adopt_all(self, sids: list[str], held: bool) -> None:
        # One after another, each sandbox cost a `runc state` spawn and its
        # watch (and a dead one its whole recovery) before the next: in
        # parallel, a restart serves and re-adopts in the time of the slowest.
        results = await asyncio.gather(*(self._adopt(sid, held) for sid in sids), return_exceptions=held)
        for sid, r in zip(sids, results):
            if isinstance(r, BaseException):  # only in the background: there is no caller to raise to
                log.error("re-adopting sandbox %s after the start failed: %s", sid, r, exc_info=r)
        self._resize_unsized()
        self.metrics.sandboxes.set(len(self.turns))

    async def _adopt(self, sid: str, held: bool = False) -> None:
        """A sandbox of the store after a (re)start: watched again if it
        runs (thawed first if a crash left it frozen), else recovered per
        policy. `held`: its turn lock is held for this adoption; released
        before a recovery (which takes it itself)."""
        t = self.turns[sid]
        try:
            dead = await self._adopt_one(sid)
        finally:
            self._adopting.discard(sid)
            if held:
                t.lock.release()
        if dead and self.options.auto_rollback:
            await self._auto_recover(sid)

    async def _adopt_one(self, sid: str) -> bool:
        """Watch `sid` again; True if it is dead (the store says so now)."""
        from deltafs.snapshotter import chaos_point  # CRABD_CHAOS=adopt: a slow adoption, for tests
        await asyncio.to_thread(chaos_point, "adopt")
        try:
            sb = await asyncio.to_thread(self.runtime.get, sid)
        except NotFound:
            self.events.emit(EventKind.SANDBOX_LOST, sid, reason="its runtime state is gone")
            self.store.update_sandbox(sid, state="dead")
            return False
        # Frozen by a checkpoint whose daemon was killed mid-commit (the
        # freezer file is written directly: runc may still say running):
        # crabd never leaves a sandbox frozen on purpose.
        fr = Freezer(self.runtime.layout, sb.cgroup_rel)
        try:
            frozen = sb.status in ("running", "paused") and fr.state() != "THAWED"
        except OSError:
            frozen = False
        if frozen:
            await asyncio.to_thread(fr.thaw)
            sb = await asyncio.to_thread(self.runtime.get, sid)
            self.events.emit(EventKind.SANDBOX_THAWED, sid, reason="found frozen at daemon start")
        if self.store.get_sandbox(sid).state == ROLLING_BACK:
            # crabd stopped mid-rollback: what runs may be the target's state,
            # the head's or a mix, and the store names the head. Never
            # adopted: ended, and recovered to the head's line like a death.
            await asyncio.to_thread(self._end_processes, sid)
            self.store.update_sandbox(sid, state="dead")
            self.events.emit(EventKind.SANDBOX_DIED, sid, reason="crabd stopped during a rollback of it: "
                             "its files and processes were not known to be any checkpoint's")
            return True  # recovered by _adopt, once the turn lock is released
        if sb.status == "running":
            await asyncio.to_thread(self._watch, sid, sb)  # `sb`: no second `runc state` spawn
            self.turns[sid].blind = BLIND_RESTART
            self.store.update_sandbox(sid, state="running")
            self.events.emit(EventKind.SANDBOX_ADOPTED, sid)
            return False
        self.store.update_sandbox(sid, state="dead")
        self.events.emit(EventKind.SANDBOX_DIED, sid, reason=f"found {sb.status} at daemon start")
        return True

    async def close(self) -> None:
        if self._adoption is not None and not self._adoption.done():
            try:  # its worker threads would outlive a cancel
                await asyncio.wait_for(asyncio.shield(self._adoption), 60)
            except Exception:
                pass
        for t in self.turns.values():
            if t.capture is not None and not t.capture.done():
                try:
                    await asyncio.wait_for(asyncio.shield(t.capture), 30)
                except Exception:
                    pass
        await self.scheduler.close()
        try:
            self.inspector.close()
        except Exception:
            pass
        self.fs.close()
        try:
            self.ledger.flush()  # exec wall time not yet written (crabd/effects.py)
        except CrabdError as e:
            log.warning("writing the budgets' wall time at stop failed: %s", e)
        self.store.close()

    def _recover_pending(self) -> None:
        """Pending checkpoints were not durable when the daemon died: discard
        them (their snapshot, if any, goes too). Committed ones are intact."""
        from ..runtime.linkremap import recover as recover_links
        n = recover_links(self.runtime.state_dir)  # before the thaw: the sandbox never sees them
        if n:
            log.info("removed %d link-remap link(s) a dump or restore cut short left in sandboxes", n)
        self._discard_leftover_standbys()
        for ck in self.store.pending_checkpoints():
            self.store.fail_checkpoint(ck.id, "discarded: crabd stopped before this checkpoint was durable")
            self._drop_capture_leftovers(ck)
            self.events.emit(EventKind.CHECKPOINT_DISCARDED, ck.sandbox_id, checkpoint=ck.id)
        self._reconcile_runtime()
        # Layers a pull killed half-way imported, its downloads. The registry
        # code (httpx) is imported only when there is one: it was a third of
        # a start's imports (measured), and a start serves no sooner than this.
        if (self.state_dir / "remote" / "tmp").exists() or any(
                info.name.startswith(REMOTE_LAYER) for info in self.fs.walk()):
            from ..remote.transfer import gc_imported
            gc_imported(self, at_start=True)
        self.fs.gc()
        from ..runtime.criu import gc_scratch
        n = gc_scratch()  # CRIU's staging dirs a crashed crabd left on the tmpfs (an hour old at least)
        if n:
            log.info("removed %d leftover CRIU scratch dir(s)", n)

    def _drop_capture_leftovers(self, ck: CheckpointRow) -> None:
        """Remove what a capture of `ck` that never committed made: its
        snapshot (named after it; a pending row does not name it yet) and its
        process image, unless a committed row shares them."""
        for snap in dict.fromkeys([ck.fs_snapshot, ck.id]):
            self._drop_snapshot_if_unused(snap)
        try:
            if self.images.exists(ck.id):
                self._drop_image_if_unused(ck.id)
        except Exception as e:
            log.info("keeping process image %s: %s", ck.id, e)

    def _reconcile_runtime(self) -> None:
        """After a crash: destroy runtime sandboxes the store does not know (a
        create or fork killed before its row was written), then remove the
        sandbox-root and import snapshots no sandbox row names."""
        rows = self.store.list_sandboxes()
        known = {r.id for r in rows}
        for sb in self.runtime.list():
            if sb.id not in known:
                try:
                    self.runtime.destroy(sb.id)
                    self.events.emit(EventKind.SANDBOX_ORPHAN_REMOVED, sb.id,
                                     reason="not in the store (crabd stopped mid-create)")
                except CrabdError as e:
                    log.warning("removing orphan sandbox %s: %s", sb.id, e)
        # Temporary mounts of an image import or a full-mode copy cut short.
        for tmp in list(self.state_dir.glob(f"{IMPORT_MOUNT}*")) + list(self.state_dir.glob(f"{FULL_MOUNT}*")):
            try:
                unmount(str(tmp), detach=True)
            except OSError:
                pass
            try:
                os.rmdir(tmp)
            except OSError as e:
                log.warning("leftover %s: %s", tmp, e)
        used = {r.fs_key for r in rows}
        for info in list(self.fs.walk()):
            if is_sandbox_root(info.name) and info.name not in used:
                self._remove_snapshot(info.name)
        # Checkpoint snapshots no row names any more (a destroy that could not
        # remove one while a standby still stacked on it): newest first, so
        # children go before their parents.
        for info in reversed(list(self.fs.walk())):
            if getattr(info.kind, "value", info.kind) == "committed":
                self._drop_snapshot_if_unused(info.name)
