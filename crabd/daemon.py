"""The daemon's core: one object wiring runtime, deltafs, the inspector, the
store and the scheduler into sandboxes with turns, checkpoints, rollback and
fork.

Concurrency model: the asyncio loop owns the coordinator (`Turns`, one per
sandbox: a lock that serialises that sandbox's execs and rollbacks, and the
future of its pending capture); everything that blocks (runc, mounts,
snapshots, SQLite) runs in worker threads through `asyncio.to_thread`.

One turn, as data (shared/DESIGN.md): exec -> inspector marks the turn ->
`runc exec` -> inspector closes the turn -> Effects -> classify -> Plan ->
pending checkpoint row + scheduler job -> reply to the agent. The job
(`_capture`) runs while the agent waits on its LLM: writeback, freeze,
deltafs checkpoint, thaw, commit the row. The next exec of that sandbox waits
for the capture if it is not done yet: that wait is the *stall*.

A SKIP turn gets a committed checkpoint row that shares its parent's
file-system snapshot (and process image): rolling back to it is rolling back
to the same state.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import sqlite3
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import deltafs
from deltafs import mount_all, unmount
from deltafs.snapshotter import chaos_point  # CRABD_CHAOS: bench/chaos.py's kill points

from . import config
from .errors import CrabdError, FailedPrecondition, InvalidArgument, NotFound
from .runtime import AdoptedReaper, Freezer, Limits, Runtime, pid_alive, reap
from .metrics import PHASES
from .store import SCHEMA_VERSION, CheckpointRow, SandboxRow, Store

log = logging.getLogger("crabd")

__all__ = ["Daemon", "DaemonOptions"]

# Paths inside a sandbox that belong to crabd, not to the sandbox's state
# (the exec status fifos): writes there never make a turn FS.
_CRABD_PATHS = ("/dev/.crabd",)

# In the reasons of a checkpoint of a turn during which the sandbox died: its
# files are the command's half-done work, so it is no recovery target (the
# agent retries the turn from the checkpoint before).
DIED_REASON = "the sandbox died during this turn: not a recovery target"

# Why a checkpoint saves everything (FS_PROC) whatever the inspector saw: a
# plan that saves less claims that nothing else changed since the checkpoint
# it shares state with, and that claim needs an unbroken record back to a
# durable checkpoint. Three things break the record: a restart of crabd (what
# the sandbox did while no inspector watched is unknown), a capture that did
# not commit (its turn's changes were never saved: the next plan must cover
# them too), and processes restored by a rollback or fork that ran before the
# inspector watched them again.
BLIND_RESTART = "crabd restarted: what the sandbox did while crabd was down was not seen"
BLIND_RESTORED = "processes were restored and ran before the inspector watched them"


def _blind_reason(why: str) -> str:
    return f"saving everything: {why}"


@dataclass
class DaemonOptions:
    auto_rollback: bool = True
    snapshot_driver: str = "auto"
    use_bpf: bool = True
    scheduler: Any = None         # a SchedulerPolicy; default: SchedulerPolicy()
    standby_policy: Any = None    # a deltacr.StandbyPolicy; default: one per sandbox, 2 GiB host-wide
    keep_last: int = 50           # retention: newest N checkpoints per sandbox ...
    keep_every: int = 10          # ... plus every Mth (0 = none)
    capture: str = "auto"         # crabd.capture mode: auto | fs-only | full
    pool_size: int | None = None  # bytes of a new btrfs loop pool (None: deltafs's default, 20 GiB)
    oracle_dir: str | None = None  # ground truth of every checkpoint written here (crabd/oracle.py; None: off)


@dataclass
class _StandbyEntry:
    checkpoint: str   # the daemon checkpoint it holds (files + processes)
    standby: Any      # crabd.runtime.process.Standby
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
    # broken (BLIND_*): the next checkpoint saves everything. Cleared when a
    # checkpoint opened under that reason commits.
    blind: str | None = None
    # Why the sandbox is dead, when the death watch cannot see it from a pid:
    # a rollback ended with it not running (its restored processes died
    # during the restore or the promotion, before their pid was recorded),
    # or an automatic recovery failed. The watch takes it as a death.
    died: str | None = None
    recoveries: list[Any] = field(default_factory=list)  # crabd.recovery.Attempt, newest last
    gave_up: bool = False  # automatic recovery exhausted its options: no more until a manual rollback


class Daemon:
    def __init__(self, state_dir: Path | str | None = None, *, options: DaemonOptions | None = None,
                 inspector: Any = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else config.state_dir_from_env()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.options = options or DaemonOptions()
        self._ensure_reserve()
        self.store = Store(self.state_dir)
        self.store.before_write = self._make_room
        from .effects import Ledger
        self.ledger = Ledger(self.store)  # effects ledger and budgets (crabd/effects.py)
        from deltacr import ImageStore
        from .runtime.process import CheckpointableRunner
        # The init's output on a pipe (not a host file): CRIU can dump that.
        self.runtime = Runtime(self.state_dir, runner=CheckpointableRunner())
        self.images = ImageStore(self.state_dir / "cr")
        self.fs = self._open_fs()
        self._img_seals: dict[str, dict[str, Any]] = {}  # image snapshot -> its seal, made once per daemon
        self._img_verified: set[str] = set()  # overlay image snapshots whose seal was checked
        self.store.sealer = self._seal_row
        self.inspector = inspector if inspector is not None else self._open_inspector()
        from .metrics import Metrics
        from .scheduler import Scheduler, SchedulerPolicy
        self.metrics = Metrics()
        self.scheduler = Scheduler(self.options.scheduler or SchedulerPolicy(), metrics=self.metrics)
        self.turns: dict[str, Turns] = {}
        # Hot standbys: per sandbox at most one, of its recovery target (the
        # newest complete checkpoint with a process image), prepared as idle
        # work; a rollback to that checkpoint is then a promotion (a SIGCONT)
        # instead of a CRIU restore.
        from deltacr import StandbyPolicy
        self.standby_policy = self.options.standby_policy or StandbyPolicy()
        self.standbys: dict[str, _StandbyEntry] = {}
        self._standby_locks: dict[str, threading.Lock] = {}
        self._image_locks: dict[str, threading.Lock] = {}
        self._maintenance_queued = False
        # Checkpoints whose sizing is queued: id -> (sandbox, extra bytes). A
        # rollback cancels the sandbox's queued work; these are queued again.
        self._sizing_queued: dict[str, tuple[str, int]] = {}
        self._guard = threading.Lock()
        self._event_waiters: set[asyncio.Event] = set()
        self._reaper = AdoptedReaper()  # zombies crabd (a child subreaper) adopted: see watch_deaths
        self._loop: asyncio.AbstractEventLoop | None = None
        self.started_at = time.time()

    def _open_fs(self) -> Any:
        # A daemon killed with SIGKILL a moment ago may still hold the
        # snapshot store's lock while the kernel tears it down: wait a little.
        deadline = time.monotonic() + 15
        while True:
            try:
                fs = deltafs.open(str(self.state_dir / "fs"), driver=self.options.snapshot_driver,
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
        return ebpf.open_inspector(None)

    # --- lifecycle of the daemon ---------------------------------------------------
    async def start(self) -> None:
        """Reload the store, settle what a crash left half-done, re-adopt sandboxes."""
        self._loop = asyncio.get_running_loop()
        # Every exec holds a worker thread for its command's whole run; with
        # asyncio's default pool (cores + 4 threads) 16 sandboxes' execs and
        # captures would queue for threads, which shows up as stall.
        from concurrent.futures import ThreadPoolExecutor
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=256, thread_name_prefix="crabd"))
        await asyncio.to_thread(self._recover_pending)
        for eid, sid in await asyncio.to_thread(self.ledger.mark_in_flight_unknown):
            self._event("effect.unknown", sid, effect=eid, reason="crabd restarted while it was in flight")
        for row in self.store.list_sandboxes():
            self.turns[row.id] = Turns()
            try:
                sb = await asyncio.to_thread(self.runtime.get, row.id)
            except NotFound:
                self._event("sandbox.lost", row.id, reason="its runtime state is gone")
                self.store.update_sandbox(row.id, state="dead")
                continue
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
                sb = await asyncio.to_thread(self.runtime.get, row.id)
                self._event("sandbox.thawed", row.id, reason="found frozen at daemon start")
            if sb.status == "running":
                await asyncio.to_thread(self._watch, row.id)
                self.turns[row.id].blind = BLIND_RESTART
                self.store.update_sandbox(row.id, state="running")
                self._event("sandbox.adopted", row.id)
            else:
                self.store.update_sandbox(row.id, state="dead")
                self._event("sandbox.died", row.id, reason=f"found {sb.status} at daemon start")
                if self.options.auto_rollback:
                    await self._auto_recover(row.id)
        self._resize_unsized()
        self.metrics.sandboxes.set(len(self.turns))

    async def close(self) -> None:
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
        self._discard_leftover_standbys()
        for ck in self.store.pending_checkpoints():
            self.store.fail_checkpoint(ck.id, "discarded: crabd stopped before this checkpoint was durable")
            self._drop_capture_leftovers(ck)
            self._event("checkpoint.discarded", ck.sandbox_id, checkpoint=ck.id)
        self._reconcile_runtime()
        self.fs.gc()

    def _record_failure(self, cid: str, msg: str) -> None:
        """Mark a checkpoint failed; on a full state file system, free the
        space reserve first so that SQLite has room to record it."""
        try:
            self.store.fail_checkpoint(cid, msg)
        except sqlite3.OperationalError as e:
            if not _disk_full(e) or not self._release_reserve():
                raise
            self.store.fail_checkpoint(cid, msg)

    def _drop_capture_leftovers(self, ck: CheckpointRow) -> None:
        """Remove what a capture of `ck` that never committed made: its
        snapshot (named after it; a pending row does not name it yet) and its
        process image, unless a committed row shares them."""
        for snap in dict.fromkeys([ck.fs_snapshot, ck.id]):
            if snap and not snap.startswith("img-") and self.store.fs_snapshot_refs(snap) == 0:
                self._remove_snapshot(snap)
        try:
            if self.store.proc_image_refs(ck.id) == 0 and self.images.exists(ck.id):
                self.images.remove(ck.id)
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
                    self._event("sandbox.orphan_removed", sb.id, reason="not in the store (crabd stopped mid-create)")
                except CrabdError as e:
                    log.warning("removing orphan sandbox %s: %s", sb.id, e)
        # Temporary mounts of an image import or a full-mode copy cut short.
        for tmp in list(self.state_dir.glob("crabd-import-*")) + list(self.state_dir.glob("crabd-full-*")):
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
            if info.name.startswith(("root-", "import-", "fullview-")) and info.name not in used:
                self._remove_snapshot(info.name)
        # Checkpoint snapshots no row names any more (a destroy that could not
        # remove one while a standby still stacked on it): newest first, so
        # children go before their parents.
        for info in reversed(list(self.fs.walk())):
            if getattr(info.kind, "value", info.kind) == "committed" and not info.name.startswith("img-") \
                    and self.store.fs_snapshot_refs(info.name) == 0:
                self._remove_snapshot(info.name)

    # --- events -------------------------------------------------------------------------
    def _event(self, kind: str, sandbox_id: str | None = None, **data: Any) -> None:
        self.store.add_event(kind, sandbox_id, **data)
        if self._loop is not None:
            def wake() -> None:
                for ev in list(self._event_waiters):
                    ev.set()
            try:
                self._loop.call_soon_threadsafe(wake)
            except RuntimeError:
                pass

    async def wait_event(self, timeout: float) -> None:
        ev = asyncio.Event()
        self._event_waiters.add(ev)
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self._event_waiters.discard(ev)

    # --- images as snapshots -----------------------------------------------------------
    def _image_snapshot(self, image: str) -> str:
        """The committed deltafs snapshot holding image `image` (made once)."""
        name = f"img-{image}"
        with self._guard:
            lock = self._image_locks.setdefault(image, threading.Lock())
        with lock:
            try:
                self.fs.stat(name)
                return name
            except deltafs.NotFound:
                pass
            img = self.runtime.images.get(image)
            key = f"import-{image}-{secrets.token_hex(4)}"
            mounts = self.fs.prepare(key)
            tmp = tempfile.mkdtemp(prefix="crabd-import-", dir=self.state_dir)
            try:
                mount_all(mounts, tmp)
                try:
                    r = subprocess.run(["cp", "-a", "--reflink=auto", f"{img.path}/.", tmp],
                                       capture_output=True, text=True, timeout=3600)
                    if r.returncode != 0:
                        raise FailedPrecondition(f"copying image {image} into a snapshot failed: {r.stderr.strip()[-300:]}",
                                                 fix="check free space in the state directory")
                finally:
                    unmount(tmp)
                self.fs.commit(name, key)
            except BaseException:
                try:
                    self.fs.remove(key)
                except Exception:
                    pass
                raise
            finally:
                os.rmdir(tmp)
            return name

    # --- sandboxes -----------------------------------------------------------------------
    def create_sandbox(self, image: str, *, name: str | None = None, limits: Limits | None = None,
                       owner: str = "") -> SandboxRow:
        base = self._image_snapshot(image)
        return self._new_sandbox(image=image, name=name, limits=limits or Limits(), owner=owner,
                                 parent_snapshot=base, base_checkpoint=None, lineage=None)

    def _new_sandbox(self, *, image: str, name: str | None, limits: Limits, owner: str, parent_snapshot: str,
                     base_checkpoint: CheckpointRow | None, lineage: str | None) -> SandboxRow:
        key = f"root-{secrets.token_hex(6)}"
        mounts = self.fs.prepare(key, parent=parent_snapshot)
        try:
            sb = self.runtime.create(image, name=name, limits=limits, root=mounts, start=False)
            restored = "fs"
            if base_checkpoint is not None:
                chaos_point("fork")
                restored = self._start_from(sb.id, base_checkpoint)
            else:
                self.runtime.start(sb.id)
        except BaseException:
            try:
                self.runtime.destroy(sb.id)  # type: ignore[possibly-undefined]
            except Exception:
                pass
            self.fs.remove(key)
            raise
        try:
            row = SandboxRow(id=sb.id, name=sb.name, image=image, fs_key=key, lineage=lineage or sb.id,
                             owner=owner, head=f"{sb.id}-0", next_seq=1, limits=limits.to_dict(),
                             forked_from=base_checkpoint.id if base_checkpoint else None)
            if base_checkpoint is None and parent_snapshot.startswith("img-"):
                self._image_seal(parent_snapshot)  # hashed now, not inside the write transaction
            with self.store.transaction():
                self.store.add_sandbox(row)
                self.store.add_checkpoint(CheckpointRow(
                    id=f"{sb.id}-0", sandbox_id=sb.id, seq=0, parent=base_checkpoint.id if base_checkpoint else None,
                    branch=0, turn=0, plan="FS",
                    reasons=["the sandbox's initial state" + (f" (fork of {base_checkpoint.id})" if base_checkpoint else
                                                              f" (image {image})")],
                    fs_snapshot=parent_snapshot,
                    proc_image=base_checkpoint.proc_image if base_checkpoint else None, state="committed"))
            self._watch(sb.id)
        except BaseException:
            self.runtime.destroy(sb.id)
            self.fs.remove(key)
            self.store.delete_sandbox(sb.id)
            raise
        t = self.turns.setdefault(sb.id, Turns())
        if "proc" in restored:
            t.blind = BLIND_RESTORED
        self.metrics.sandboxes.set(len(self.turns))
        self._event("sandbox.created", sb.id, image=image, name=row.name, forked_from=row.forked_from)
        return row

    def _watch(self, sid: str) -> None:
        sb = self.runtime.get(sid)
        try:
            self.inspector.unwatch(sid)
        except Exception:
            pass
        self.inspector.watch(sid, self.runtime.cgroup_v2_dir(sid), init_pid=sb.pid, outside_paths=_CRABD_PATHS)
        t = self.turns.setdefault(sid, Turns())
        t.init_pid = sb.pid

    def sandbox_info(self, ref: str, owner: str | None = None) -> dict[str, Any]:
        row = self._own(self.store.get_sandbox(ref), owner)
        out = row.to_dict()
        try:
            sb = self.runtime.get(row.id)
            out["status"] = sb.status
            out["pid"] = sb.pid
        except NotFound:
            out["status"] = "absent"
        return out

    async def destroy(self, ref: str, owner: str | None = None) -> None:
        """Destroy a sandbox once no exec, rollback (an automatic recovery
        included) or capture of it is in flight."""
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.get(row.id)
        if t is None:
            await asyncio.to_thread(self.destroy_sandbox, row.id, owner)
            return
        async with t.lock:
            await self._wait_capture(t)
            await asyncio.to_thread(self.destroy_sandbox, row.id, owner)

    def destroy_sandbox(self, ref: str, owner: str | None = None) -> None:
        row = self._own(self.store.get_sandbox(ref), owner)
        # Out of `turns` first: a standby refresh that starts from now on sees
        # the sandbox as gone and prepares nothing.
        self.turns.pop(row.id, None)
        self.scheduler.cancel(row.id)
        for cid, (sid, _) in list(self._sizing_queued.items()):
            if sid == row.id:
                self._sizing_queued.pop(cid, None)
        self._discard_standby(row.id)
        from .runtime.process import sweep_standby_cgroups
        sweep_standby_cgroups(self.runtime, row.id)
        try:
            self.inspector.unwatch(row.id)
        except Exception:
            pass
        try:
            self.runtime.destroy(row.id)
        except NotFound:
            pass
        snaps = [c.fs_snapshot for c in reversed(self.store.list_checkpoints(row.id, states=("committed", "pending",
                                                                                            "failed")))]
        images = [c.proc_image for c in self.store.list_checkpoints(row.id, states=("committed", "pending", "failed"))
                  if c.proc_image]
        try:
            self.store.delete_sandbox(row.id)
        except sqlite3.OperationalError as e:
            if "full" not in str(e) or not self._release_reserve():
                raise
            # The state file system was full (no per-sandbox quota: a sandbox
            # filled it); the released reserve leaves room to record this.
            self.store.delete_sandbox(row.id)
        self._remove_snapshot(row.fs_key)
        for img in dict.fromkeys(images):
            if self.store.proc_image_refs(img) == 0:
                try:
                    self.images.remove(img)
                except Exception as e:
                    log.info("keeping process image %s: %s", img, e)
        for s in dict.fromkeys(snaps):
            if s and not s.startswith("img-") and self.store.fs_snapshot_refs(s) == 0:
                self._remove_snapshot(s)
        self.turns.pop(row.id, None)
        shutil.rmtree(self.state_dir / "full" / row.id, ignore_errors=True)  # capture mode full's copies
        self.metrics.sandboxes.set(len(self.turns))
        self._event("sandbox.destroyed", row.id)
        self._ensure_reserve()

    # Space kept back on the state file system so that destroying a sandbox
    # still works after one filled it: SQLite needs room to record a delete.
    RESERVE_BYTES = 32 << 20

    def _ensure_reserve(self) -> None:
        path = self.state_dir / "space.reserve"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < self.RESERVE_BYTES:
                os.posix_fallocate(fd, 0, self.RESERVE_BYTES)
        except OSError:
            pass  # no room now: made again after the next destroy
        finally:
            os.close(fd)

    def _make_room(self) -> None:
        """Before a database write: when the state file system has less free
        space than the reserve (a sandbox filled it), release the reserve.
        SQLite writes its WAL index through a shared mapping, and a write
        fault there on a full btrfs is a SIGBUS that kills crabd; with room
        it is an ordinary write. The reserve comes back after the next
        checkpoint that commits with room to spare."""
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            return
        if st.f_bavail * st.f_frsize < self.RESERVE_BYTES // 2 and (self.state_dir / "space.reserve").exists():
            log.warning("state file system %s is nearly full: releasing crabd's space reserve", self.state_dir)
            try:
                self._release_reserve()
            except OSError as e:
                log.warning("releasing the space reserve: %s", e)

    def _release_reserve(self) -> bool:
        try:
            os.unlink(self.state_dir / "space.reserve")
        except FileNotFoundError:
            return False
        self.fs.sync()  # btrfs returns the blocks at the next transaction commit
        return True

    def _remove_snapshot(self, name: str) -> None:
        try:
            self.fs.remove(name)
        except deltafs.NotFound:
            pass
        except deltafs.FailedPrecondition as e:
            # Still a parent of a fork's snapshot: it goes when they do.
            log.info("keeping snapshot %s: %s", name, e)

    # --- integrity: seals of layers and process images ------------------------------------
    def _seal_row(self, row: CheckpointRow) -> dict[str, Any] | None:
        """Seals of a checkpoint being committed (the store calls this): its
        snapshot's (deltafs.seal) and its process image's manifest digest.
        What it shares with its parent (a SKIP turn, an FS turn's inherited
        image, a fork's initial state) keeps the parent's seal: sealed once,
        when first committed."""
        from deltafs.seal import seal
        parent = None
        if row.parent:
            try:
                parent = self.store.get_checkpoint(row.parent)
            except NotFound:
                parent = None
        ps = (parent.seals or {}) if parent is not None else {}
        out: dict[str, Any] = {}
        if row.fs_snapshot:
            if parent is not None and parent.fs_snapshot == row.fs_snapshot and "fs" in ps:
                out["fs"] = ps["fs"]
            elif row.fs_snapshot.startswith("img-"):
                out["fs"] = self._image_seal(row.fs_snapshot)
            else:
                out["fs"] = seal(self.fs, row.fs_snapshot)
        if row.proc_image:
            if parent is not None and parent.proc_image == row.proc_image and "proc" in ps:
                out["proc"] = ps["proc"]
            else:
                out["proc"] = self.images.manifest(row.proc_image).digest
        return out or None

    def _image_seal(self, name: str) -> dict[str, Any]:
        """The seal of an image snapshot: made once per daemon (an overlay
        image layer is the whole image: hashing it takes a while)."""
        from deltafs.seal import seal
        with self._guard:
            cached = self._img_seals.get(name)
        if cached is None:
            cached = seal(self.fs, name)
            with self._guard:
                cached = self._img_seals.setdefault(name, cached)
        return cached

    def _verify_checkpoint(self, ck: CheckpointRow, processes: bool = True) -> None:
        """Refuse a checkpoint whose row, layer(s) or process image changed
        since its commit (IntegrityError naming it). The row's keyed digest
        first (it covers the seals); then its snapshot's seal -- on overlay,
        every ancestor's too, as their layers are the lower layers of its
        mount; then (`processes`) its process image: the manifest digest
        against the seal and every chunk against its content key. Nothing
        of an image is deserialized before this passed. Checkpoints from
        before seals existed (no `seals`) are checked by digest only."""
        from deltacr.errors import DeltacrError
        from deltafs.seal import SealBroken, check_seal
        from .store import IntegrityError
        fix = (f"the checkpoint's stored state was modified outside crabd: roll back to or fork another "
               f"checkpoint (GET /v1/sandboxes/{ck.sandbox_id}/checkpoints), and delete {ck.id}")
        self.store.verify(ck)
        line = [ck]
        if self.fs.driver == "overlay":
            cid, seen = ck.parent, {ck.id}
            while cid and cid not in seen:
                seen.add(cid)
                try:
                    c = self.store.get_checkpoint(cid)
                except NotFound:
                    break  # retired: its layer is covered no more (README)
                if c.state == "committed":
                    try:
                        self.store.verify(c)
                    except IntegrityError as e:
                        raise IntegrityError(f"checkpoint {ck.id}: its ancestor {c.id} is tampered: {e.message}",
                                             fix=fix) from None
                    line.append(c)
                cid = c.parent
        checked: set[str] = set()
        for c in line:
            seal = (c.seals or {}).get("fs")
            if not c.fs_snapshot or seal is None or c.fs_snapshot in checked:
                continue
            checked.add(c.fs_snapshot)
            img = self.fs.driver == "overlay" and c.fs_snapshot.startswith("img-")
            if img and c.fs_snapshot in self._img_verified:
                continue  # a whole image layer: hashed once per daemon (README)
            try:
                res = check_seal(self.fs, c.fs_snapshot, seal)
            except SealBroken as e:
                raise IntegrityError(f"checkpoint {ck.id}: its files are not what was committed: {e}",
                                     fix=fix) from None
            if res != "ok":
                log.info("checkpoint %s: %s", ck.id, res)
            elif img:
                self._img_verified.add(c.fs_snapshot)
        seal = (ck.seals or {}).get("proc")
        if processes and ck.proc_image and seal is not None:
            try:
                m = self.images.manifest(ck.proc_image)
                if m.digest != seal:
                    raise IntegrityError(f"checkpoint {ck.id}: its process image {ck.proc_image} is not the one "
                                         f"committed (manifest digest differs)", fix=fix)
                self.images.verify(ck.proc_image)
            except DeltacrError as e:
                raise IntegrityError(f"checkpoint {ck.id}: its process image is damaged: {e}", fix=fix) from None

    @staticmethod
    def _own(row: SandboxRow, owner: str | None) -> SandboxRow:
        if owner is not None and row.owner != owner:
            raise NotFound(f"no sandbox {row.id!r}")
        return row

    # --- turns -----------------------------------------------------------------------------
    async def exec(self, ref: str, cmd: Sequence[str] | str, *, timeout: float | None = 600.0,
                   env: dict[str, str] | None = None, cwd: str | None = None, stdin: str | None = None,
                   owner: str | None = None) -> dict[str, Any]:
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            t0 = time.monotonic()
            stall = await self._wait_capture(t)
            if t.last_end is not None:
                self.scheduler.policy.observe_gap(row.id, t0 - t.last_end)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            turn = row.turn + 1
            # Budget: refused when used up, else this turn is counted now.
            await asyncio.to_thread(self.ledger.begin_turn, row.lineage, row.id)
            t_exec = time.monotonic()
            self.inspector.begin_turn(row.id)
            error: CrabdError | None = None
            res: Any = None
            try:
                res = await asyncio.to_thread(self.runtime.exec, row.id, cmd, env=env, cwd=cwd, stdin=stdin,
                                              timeout=timeout)
            except CrabdError as e:
                error = e
            # The turn ends whatever happened: a timed-out command may have
            # changed files before it was killed.
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            t.last_end = time.monotonic()
            died = t.init_pid is not None and not pid_alive(t.init_pid)
            ck = await asyncio.to_thread(self._open_checkpoint, row, turn, effects, died=died, blind=t.blind)
            await asyncio.to_thread(self._ledger_after_turn, row, turn, ck, effects, time.monotonic() - t_exec)
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            self.metrics.stall.observe(stall)
            self.metrics.turns.labels(plan=ck.plan).inc()
            if error is not None:
                raise error
            self.metrics.exec_seconds.observe(res.duration)
            return {**res.to_dict(), "turn": turn, "checkpoint": ck.id, "plan": ck.plan,
                    "reasons": ck.reasons, "stall_ms": round(stall * 1000, 3),
                    "external": bool(effects.external), "branch": row.branch}

    async def end_turn(self, ref: str, owner: str | None = None) -> dict[str, Any]:
        """An explicit turn boundary for agents that run commands some other way."""
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            stall = await self._wait_capture(t)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            t.last_end = time.monotonic()
            ck = await asyncio.to_thread(self._open_checkpoint, row, row.turn + 1, effects, blind=t.blind)
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            self.inspector.begin_turn(row.id)
            return {"turn": row.turn + 1, "checkpoint": ck.id, "plan": ck.plan, "reasons": ck.reasons,
                    "stall_ms": round(stall * 1000, 3)}

    async def checkpoint_now(self, ref: str, owner: str | None = None, wait: bool = True) -> dict[str, Any]:
        """A manual checkpoint: the file system is captured whatever the inspector saw."""
        row = self._own(await asyncio.to_thread(self.store.get_sandbox, ref), owner)
        t = self.turns.setdefault(row.id, Turns())
        async with t.lock:
            await self._wait_capture(t)
            row = await asyncio.to_thread(self.store.get_sandbox, row.id)
            effects = await asyncio.to_thread(self.inspector.end_turn, row.id)  # settles, scans memory file systems
            self.inspector.begin_turn(row.id)
            ck = await asyncio.to_thread(self._open_checkpoint, row, row.turn, effects, manual=True, blind=t.blind)
            t.capture = asyncio.ensure_future(self._run_capture(row.id, ck))
            if wait:
                await self._wait_capture(t)
        return self.checkpoint_info(ck.id)

    async def _wait_capture(self, t: Turns) -> float:
        if t.capture is None or t.capture.done():
            return 0.0
        t0 = time.monotonic()
        try:
            await asyncio.shield(t.capture)
        except Exception:
            pass  # a failed capture is recorded on its checkpoint; the turn goes on
        return time.monotonic() - t0

    def _open_checkpoint(self, row: SandboxRow, turn: int, effects: Any, manual: bool = False,
                         died: bool = False, blind: str | None = None) -> CheckpointRow:
        try:
            return self._open_checkpoint_row(row, turn, effects, manual, died, blind)
        except sqlite3.OperationalError as e:
            if _disk_full(e):
                # No room for the turn's checkpoint row (the API answers 507
                # disk_full): free the space reserve so that the sandbox and
                # crabd have room to clean up (a rm inside the sandbox needs
                # some to delete on btrfs); made again once there is space.
                try:
                    self._release_reserve()
                except OSError as e2:
                    log.warning("releasing the space reserve: %s", e2)
            raise

    def _durable_parent(self, head: str | None) -> tuple[CheckpointRow | None, list[CheckpointRow]]:
        """The nearest checkpoint at or above `head` that a new checkpoint may
        share state with (committed, with a file-system snapshot), and the
        rows passed over on the way (failed, cancelled or discarded captures,
        or rows without files): their turns' changes were never saved."""
        passed: list[CheckpointRow] = []
        cid, seen = head, set()
        while cid and cid not in seen:
            seen.add(cid)
            try:
                c = self.store.get_checkpoint(cid)
            except NotFound:
                break
            if c.state == "committed" and c.fs_snapshot:
                return c, passed
            passed.append(c)
            cid = c.parent
        return None, passed

    def _open_checkpoint_row(self, row: SandboxRow, turn: int, effects: Any, manual: bool,
                             died: bool = False, blind: str | None = None) -> CheckpointRow:
        import ebpf
        from .capture import apply_mode
        plan = ebpf.classify(effects)
        kind = plan.kind.value
        reasons = list(plan.reasons)
        if manual and kind == "SKIP":
            kind, reasons = "FS", ["manual checkpoint"] + reasons
        parent, passed = self._durable_parent(row.head)
        if passed:
            blind = blind or (f"checkpoint(s) {', '.join(c.id for c in passed[:3])} did not commit "
                              f"({passed[0].state}): their turns' changes were never saved")
        if blind and kind != "FS_PROC":
            kind = "FS_PROC"
            reasons = [_blind_reason(blind)] + reasons
        kind, reasons = apply_mode(kind, reasons, self.options.capture)
        if died:
            reasons.append(DIED_REASON)
        seq = self.store.allocate_seq(row.id)
        ck = CheckpointRow(id=f"{row.id}-{seq}", sandbox_id=row.id, seq=seq,
                           parent=parent.id if parent is not None else None, branch=row.branch,
                           turn=turn, plan=kind, reasons=reasons, effects=effects.model_dump(mode="json"))
        with self.store.transaction():
            self.store.add_checkpoint(ck)
            self.store.update_sandbox(row.id, head=ck.id, turn=turn)
        return ck

    async def _run_capture(self, sid: str, ck: CheckpointRow) -> None:
        """The turn's capture job; done (and the next turn free to run) once the
        checkpoint is committed and durable. Counting its bytes (a walk of the
        snapshot's tree) is queued after that as idle work (`_size_checkpoint`)."""
        from .scheduler import JobCancelled
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
            if _disk_full(e):
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
                self._event("checkpoint.failed", sid, checkpoint=ck.id, error=msg, code=code)
            except sqlite3.Error as e3:
                log.warning("recording the failure of checkpoint %s: %s", ck.id, e3)
            if code == "disk_full":
                try:
                    await asyncio.to_thread(self._release_reserve)  # room to clean up (see _open_checkpoint)
                except OSError as e4:
                    log.warning("releasing the space reserve: %s", e4)
        else:
            if turns is not None and blind_at_open is not None and turns.blind is blind_at_open:
                turns.blind = None  # this checkpoint saved everything: the record is whole again
            if ck.plan != "SKIP" and not (self.state_dir / "space.reserve").exists():
                # Space is back (a reserve released on a full disk): keep one
                # again, when that does not fill the file system right away.
                st = os.statvfs(self.state_dir)
                if st.f_bavail * st.f_frsize > 4 * self.RESERVE_BYTES:
                    await asyncio.to_thread(self._ensure_reserve)
            if extra is not None:
                self._schedule_sizing(sid, ck.id, extra)
            if ck.plan != "SKIP":
                self._schedule_standby_refresh(sid)
                self._schedule_maintenance()

    def _capture(self, ck: CheckpointRow, queue: float = 0.0) -> int | None:
        """Capture one checkpoint (worker thread): the scheduler admitted it
        after `queue` seconds. Returns once the checkpoint is committed and
        durable: None if its `bytes` are final, else the bytes to add to its
        snapshot's usage when `_size_checkpoint` measures it later."""
        t_start = time.monotonic()
        if self.options.oracle_dir:  # ground truth at this capture's frozen instant (crabd/oracle.py)
            from .oracle import record_at_capture
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
            ck.plan, ck.reasons = "FS_PROC", [_blind_reason(why)] + list(ck.reasons)
            from .capture import apply_mode
            ck.plan, ck.reasons = apply_mode(ck.plan, ck.reasons, self.options.capture)
        if ck.plan == "SKIP" and parent is not None:
            self.store.commit_checkpoint(ck.id, fs_snapshot=parent.fs_snapshot, proc_image=parent.proc_image,
                                         bytes=0, durations={"queue": queue, "total": time.monotonic() - t_start,
                                                             "size": 0.0})
            self._event("checkpoint.committed", ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=0)
            self._event("checkpoint.sized", ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=0, size_ms=0.0)
            return None
        row = self.store.get_sandbox(ck.sandbox_id)
        d: dict[str, float] = {"queue": queue}
        t = time.monotonic()
        self.fs.prepare_checkpoint(row.fs_key)  # writeback while the sandbox still runs
        d["writeback"] = time.monotonic() - t
        name = f"{ck.id}"
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
        from .capture import FS_ONLY_REASON
        inherited = parent.proc_image if parent is not None and FS_ONLY_REASON not in ck.reasons else None
        self.store.commit_checkpoint(ck.id, fs_snapshot=name, proc_image=inherited, durations=d, plan=ck.plan,
                                     reasons=list(ck.reasons))
        self.metrics.observe_checkpoint({k: v for k, v in d.items() if k in PHASES and k != "queue"})
        self._event("checkpoint.committed", ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=None,
                    pause_ms=round(d["pause"] * 1000, 3))
        return 0

    def _schedule_sizing(self, sid: str, cid: str, extra: int) -> None:
        """Queue the byte count of committed checkpoint `cid` as idle work (event loop)."""
        from .scheduler import JobCancelled, JobKind
        job = self.scheduler.policy.background_job(JobKind.SIZING, 0, time.monotonic(), sandbox_id=sid)
        self._sizing_queued[cid] = (sid, extra)

        async def run() -> None:
            self._sizing_queued.pop(cid, None)
            await asyncio.to_thread(self._size_checkpoint, cid, extra)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                return
            e = f.exception()
            if e is not None and not isinstance(e, JobCancelled):
                log.warning("sizing checkpoint %s failed: %s", cid, e)

        self.scheduler.submit(job, run).add_done_callback(done)

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
        self._event("checkpoint.sized", ck.sandbox_id, checkpoint=cid, plan=ck.plan, bytes=size,
                    size_ms=round((time.monotonic() - t) * 1000, 3))

    def _resize_unsized(self) -> None:
        """Checkpoints committed before a restart whose sizing never ran: queue it (event loop)."""
        for ck in self.store.iter_all_checkpoints():
            if ck.state != "committed" or ck.seq == 0 or ck.plan == "SKIP" or "size" in (ck.durations or {}):
                continue
            extra = 0
            if ck.proc_image == ck.id:
                try:
                    extra = sum(f.size for f in self.images.manifest(ck.proc_image).files)
                except Exception:
                    extra = 0
            self._schedule_sizing(ck.sandbox_id, ck.id, extra)

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
        from .runtime.process import checkpoint_processes
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
            self._event("checkpoint.proc_failed", ck.sandbox_id, checkpoint=ck.id, error=error)
        self._event("checkpoint.committed", ck.sandbox_id, checkpoint=ck.id, plan=ck.plan, bytes=None,
                    proc=proc_image is not None, pause_ms=round(d.get("pause", 0) * 1000, 3))
        return proc_bytes

    def _full_copy_path(self, sid: str, cid: str) -> Path:
        """The tar a crabd before the fair `full` mode wrote per checkpoint
        (capture mode full no longer writes one): still removed with its
        checkpoint or sandbox, so an upgraded state dir does not keep them."""
        return self.state_dir / "full" / sid / f"{cid}.tar"

    # --- checkpoints -----------------------------------------------------------------------
    def list_checkpoints(self, ref: str, owner: str | None = None, all_states: bool = False) -> list[dict[str, Any]]:
        from .retention import keep_reasons
        row = self._own(self.store.get_sandbox(ref), owner)
        states = ("committed", "pending", "failed") if all_states else ("committed", "pending")
        cks = self.store.list_checkpoints(row.id, states=states)
        why = keep_reasons([(c.id, c.seq) for c in cks if c.state == "committed"], self._retention(),
                           head=row.head, protected=self._protected(row.id))
        out = []
        for c in cks:
            d = self._ck_summary(c, row)
            # Why retention keeps it; empty = the next idle maintenance retires it.
            d["kept"] = why.get(c.id, []) if c.state == "committed" else []
            out.append(d)
        return out

    def _ck_summary(self, c: CheckpointRow, row: SandboxRow | None = None) -> dict[str, Any]:
        out = {k: v for k, v in c.to_dict().items() if k not in ("effects",)}
        if row is not None:
            out["head"] = c.id == row.head
        return out

    def checkpoint_info(self, cid: str, owner: str | None = None) -> dict[str, Any]:
        c = self.store.get_checkpoint(cid)
        self._own(self.store.get_sandbox(c.sandbox_id), owner)
        return c.to_dict()

    def resolve_checkpoint(self, sid: str, ref: str | int) -> CheckpointRow:
        """A checkpoint of sandbox `sid` by id or sequence number; 409 when it
        belongs to another sandbox."""
        if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
            return self.store.get_checkpoint(f"{sid}-{int(ref)}")
        c = self.store.get_checkpoint(str(ref))
        if c.sandbox_id != sid:
            try:
                other = self.store.get_sandbox(c.sandbox_id).owner
            except NotFound:
                other = None
            if other != self.store.get_sandbox(sid).owner:
                # Another owner's checkpoint: as unknown as it is to them (no id leaks).
                raise NotFound(f"no checkpoint {str(ref)!r}", fix="GET /v1/sandboxes/{id}/checkpoints lists them")
            raise FailedPrecondition(f"checkpoint {c.id} belongs to sandbox {c.sandbox_id}, not {sid}",
                                     fix=f"fork it instead: POST /v1/checkpoints/{c.id}/fork")
        return c

    def delete_checkpoint(self, cid: str, owner: str | None = None) -> None:
        c = self.store.get_checkpoint(cid)
        row = self._own(self.store.get_sandbox(c.sandbox_id), owner)
        if c.id == row.head:
            raise FailedPrecondition(f"checkpoint {cid} is the sandbox's current head")
        if c.seq == 0:
            raise FailedPrecondition(f"checkpoint {cid} is the sandbox's initial state")
        kids = self.store.children(cid)
        if kids:
            raise FailedPrecondition(f"checkpoint {cid} is the parent of {', '.join(kids[:5])}",
                                     fix="delete those first, or keep it")
        self.store.delete_checkpoint(cid)
        if c.fs_snapshot and not c.fs_snapshot.startswith("img-") and self.store.fs_snapshot_refs(c.fs_snapshot) == 0:
            self._remove_snapshot(c.fs_snapshot)
        self._event("checkpoint.deleted", c.sandbox_id, checkpoint=cid)

    def diff(self, a: str, b: str, owner: str | None = None, limit: int = 10_000) -> dict[str, Any]:
        """The changes from checkpoint `a` to `b`, the first `limit` of them
        (a sandbox can make a million: the reply stays bounded; `total` and
        `truncated` say how many there were)."""
        ca, cb = self.store.get_checkpoint(a), self.store.get_checkpoint(b)
        for c in (ca, cb):
            self._own(self.store.get_sandbox(c.sandbox_id), owner)
            self._require_files(c)
        for c in (ca, cb):  # a diff reads both snapshots: both must be what was committed
            self._verify_checkpoint(c, processes=False)
        changes = self.fs.diff(ca.fs_snapshot, cb.fs_snapshot) if ca.fs_snapshot != cb.fs_snapshot else []
        return {"from": a, "to": b, "changes": [_change_dict(ch) for ch in changes[:limit]],
                "total": len(changes), "truncated": len(changes) > limit}

    # --- rollback and fork -------------------------------------------------------------------
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

    def _latest_committed(self, row: SandboxRow) -> CheckpointRow:
        """The newest complete checkpoint on the sandbox's current line.

        Complete = committed, and holding everything its plan asked for: an
        FS_PROC checkpoint whose CRIU dump failed has the files but not the
        processes, so recovery prefers an older complete one (an explicit
        rollback to it is still allowed: files plus a fresh init). Nor is the
        checkpoint of a turn the sandbox died in (DIED_REASON)."""
        cid: str | None = row.head
        fallback: CheckpointRow | None = None
        while cid:
            c = self.store.get_checkpoint(cid)
            if c.state == "committed" and c.fs_snapshot:
                if not (c.plan == "FS_PROC" and not c.proc_image) and DIED_REASON not in (c.reasons or []):
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
        self._verify_checkpoint(ck)  # before anything of the sandbox is stopped or replaced
        timing: dict[str, float] = {}
        try:
            self.inspector.unwatch(sid)
        except Exception:
            pass
        promoted = self._promote_standby(sid, ck, row, timing) if processes else None
        if promoted is not None:
            return self._finish_rollback(sid, row, ck, promoted, "fs+proc (hot standby)", timing, reason)
        t = time.monotonic()
        self.runtime.stop(sid)
        timing["stop"] = time.monotonic() - t
        chaos_point("rollback")
        t = time.monotonic()
        self.runtime.unmount_root(sid)
        new_key = f"root-{secrets.token_hex(6)}"
        mounts = self.fs.prepare(new_key, parent=ck.fs_snapshot)
        # The store names the new root before the runtime mounts it: a crash
        # from here on leaves the old key unnamed (removed at restart), never
        # a mounted root the store does not know.
        self.store.update_sandbox(sid, fs_key=new_key)
        self.runtime.set_root(sid, mounts)
        self._remove_snapshot(row.fs_key)
        timing["fs"] = time.monotonic() - t
        t = time.monotonic()
        restored = self._start_from(sid, ck, processes)
        timing["start"] = time.monotonic() - t
        return self._finish_rollback(sid, row, ck, new_key, restored, timing, reason)

    def _finish_rollback(self, sid: str, row: SandboxRow, ck: CheckpointRow, new_key: str, restored: str,
                         timing: dict[str, float], reason: str) -> dict[str, Any]:
        not_undone = self._effects_after(row.head, ck.id)
        ledger = self._ledger_report(sid, row, ck)
        with self.store.transaction():
            self.store.update_sandbox(sid, fs_key=new_key, head=ck.id, branch=row.branch + 1, state="running")
        self._watch(sid)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._schedule_standby_refresh, sid)
        self._event("sandbox.rolled_back", sid, checkpoint=ck.id, reason=reason, branch=row.branch + 1,
                    restored=restored, effects_not_undone=not_undone)
        if ledger["committed_after"] or ledger["unknown"]:
            self._event("effects.not_undone", sid, checkpoint=ck.id, **ledger)
        return {"sandbox": sid, "checkpoint": ck.id, "seq": ck.seq, "turn": ck.turn, "branch": row.branch + 1,
                "restored": restored, "effects_not_undone": not_undone, "ledger": ledger,
                "timing_ms": {k: round(v * 1000, 3) for k, v in timing.items()}}

    def _start_from(self, sid: str, ck: CheckpointRow, processes: bool = True) -> str:
        """Start a sandbox whose root is already `ck`'s files: restore `ck`'s
        processes when it has an image (and `processes`), else a fresh init.
        A failed restore falls back to a fresh init, with an event that says so."""
        if ck.proc_image and processes:
            from deltacr import DeltacrError
            from .runtime.process import restore_processes
            try:
                restore_processes(self.runtime, sid, self.images, ck.proc_image)
                return "fs+proc"
            except (DeltacrError, CrabdError) as e:
                log.warning("restoring processes of %s into %s failed: %s", ck.id, sid, e)
                self._event("sandbox.restore_failed", sid, checkpoint=ck.id, error=str(e),
                            fallback="fresh init on the checkpoint's files")
                # not runtime.stop: runc may be left waiting on a killed CRIU
                self.runtime.reset(sid)
        self.runtime.start(sid)
        return "fs"

    def _effects_after(self, head: str | None, target: str) -> list[dict[str, Any]]:
        """External effects recorded on the abandoned line, after `target`."""
        out = []
        cid = head
        while cid and cid != target:
            try:
                c = self.store.get_checkpoint(cid)
            except NotFound:
                break
            eff = c.effects or {}
            if eff.get("external") or eff.get("external_unknown"):
                out.append({"checkpoint": c.id, "turn": c.turn, "reasons": eff.get("external_reasons", []),
                            "unknown": bool(eff.get("external_unknown"))})
            cid = c.parent
        return list(reversed(out))

    # --- effects ledger and budgets (crabd/effects.py) ---------------------------------------
    def _ledger_after_turn(self, row: SandboxRow, turn: int, ck: CheckpointRow, effects: Any, wall_s: float) -> None:
        """Count the turn's wall time; record what the inspector saw leave
        the sandbox as unmanaged effects of the turn (made from its parent)."""
        try:
            self.ledger.add_wall(row.lineage, wall_s)
            # Without BPF every turn is external_unknown (short-lived
            # connections are invisible to /proc): an `unseen` row per turn
            # would say nothing new, so only BPF's lost events write one.
            unseen = bool(effects.external_unknown) and getattr(effects, "source", "proc") != "proc"
            if effects.external or unseen:
                ids = self.ledger.record_unmanaged(row, turn=turn, checkpoint=ck.parent,
                                                   reasons=list(effects.external_reasons), unknown=unseen)
                self._event("effects.unmanaged", row.id, turn=turn, checkpoint=ck.id, effects=ids,
                            reasons=list(effects.external_reasons))
        except Exception as e:  # the turn happened (its capture is next): bookkeeping must not fail it
            log.warning("ledger bookkeeping of %s turn %d failed: %s", row.id, turn, e)
            self._event("ledger.failed", row.id, turn=turn, error=str(e))

    def _ledger_report(self, sid: str, row: SandboxRow, ck: CheckpointRow) -> dict[str, Any]:
        """Rollback of `sid` from its head to `ck`: the ledger's effects it
        does not undo. The stretch abandoned runs from the head back to `ck`,
        or to the head's last common ancestor with `ck` when `ck` is on
        another line."""
        if not self.ledger.has_effects(sid):  # the common case: no walk on the rollback's path
            return {"committed_after": [], "unknown": []}
        keep: set[str] = set()
        cid: str | None = ck.id
        while cid:
            keep.add(cid)
            try:
                cid = self.store.get_checkpoint(cid).parent
            except NotFound:
                break
        path: list[tuple[str | None, int]] = []
        cid, branch = row.head, row.branch
        while cid:
            path.append((cid, branch))
            if cid in keep:
                break
            try:
                c = self.store.get_checkpoint(cid)
            except NotFound:
                break
            cid, branch = c.parent, c.branch
        return self.ledger.rollback_report(sid, row.lineage, path)

    def effect_intent(self, ref: str, op: str, *, key: str | None, args: Any, postcondition: str | None = None,
                      volatile: Sequence[str] = (), force: bool = False, owner: str | None = None) -> dict[str, Any]:
        row = self._own(self.store.get_sandbox(ref), owner)
        out = self.ledger.intent(row, op, key=key, args=args, postcondition=postcondition, volatile=volatile,
                                 force=force)
        if out["decision"] == "execute":
            self._event("effect.intent", row.id, effect=out["effect"]["id"], op=op, key=key, retry=out["retry"])
        else:
            self._event(f"effect.{out['decision']}", row.id, effect=out["matched"], op=op, key=key,
                        matched_by=out["matched_by"])
        return out

    def effect_finish(self, eid: str, state: str, *, receipt: Any = None, result_digest: str | None = None,
                      error: str | None = None, reconciled: bool = False) -> dict[str, Any]:
        e = self.ledger.finish(eid, state, receipt=receipt, result_digest=result_digest, error=error,
                               reconciled=reconciled)
        self._event(f"effect.{'reconciled' if reconciled else state}", e["sandbox_id"], effect=eid, op=e["op"],
                    key=e["key"], state=e["state"])
        return e

    async def fork(self, cid: str, count: int = 1, owner: str | None = None) -> dict[str, Any]:
        if not 1 <= count <= 64:
            raise InvalidArgument("count must be between 1 and 64")
        ck = await asyncio.to_thread(self.store.get_checkpoint, cid)
        src = self._own(await asyncio.to_thread(self.store.get_sandbox, ck.sandbox_id), owner)
        self._require_files(ck)
        await asyncio.to_thread(self._verify_checkpoint, ck)
        t0 = time.monotonic()
        made = []
        for _ in range(count):
            row = await asyncio.to_thread(self._new_sandbox, image=src.image, name=None,
                                          limits=Limits.from_dict(src.limits), owner=src.owner,
                                          parent_snapshot=ck.fs_snapshot, base_checkpoint=ck, lineage=src.lineage)
            made.append(row.id)
        return {"checkpoint": ck.id, "sandboxes": made, "duration_ms": round((time.monotonic() - t0) * 1000, 3)}

    # --- idle maintenance -----------------------------------------------------------------------
    def _schedule_maintenance(self) -> None:
        """Queue one snapshot-store maintenance job (compaction of overlay
        layer chains, removal of crash leftovers) as idle work (event loop)."""
        if self._maintenance_queued:
            return
        from .scheduler import JobCancelled, JobKind
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
                self._event("maintenance.done", None, dropped_checkpoints=dropped, merged_layers=merged,
                            removed=len(gone))

        def done(f: asyncio.Future[Any]) -> None:
            self._maintenance_queued = False
            if not f.cancelled() and f.exception() is not None and not isinstance(f.exception(), JobCancelled):
                log.warning("snapshot maintenance failed: %s", f.exception())

        self.scheduler.submit(job, run).add_done_callback(done)

    def _retention(self) -> Any:
        from .retention import Retention
        return Retention(self.options.keep_last, self.options.keep_every)

    def _protected(self, sid: str) -> set[str]:
        prot = set(self.store.fork_bases())
        e = self.standbys.get(sid)
        if e is not None:
            prot.add(e.checkpoint)
        return prot

    def _apply_retention(self, sid: str) -> int:
        """Drop the sandbox's checkpoints the retention policy lets go, with
        their snapshots and process images once nothing shares them."""
        from .retention import victims
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
            if ck.fs_snapshot and not ck.fs_snapshot.startswith("img-") and \
                    self.store.fs_snapshot_refs(ck.fs_snapshot) == 0:
                try:
                    self.fs.remove(ck.fs_snapshot, reparent=True)
                except deltafs.NotFound:
                    pass
            if ck.proc_image and self.store.proc_image_refs(ck.proc_image) == 0:
                try:
                    self.images.remove(ck.proc_image)
                except Exception as e:
                    log.info("keeping process image %s: %s", ck.proc_image, e)
        if gone:
            self._event("checkpoints.retired", sid, checkpoints=gone)
        return len(gone)

    # --- hot standbys --------------------------------------------------------------------------
    def _standby_lock(self, sid: str) -> threading.Lock:
        with self._guard:
            return self._standby_locks.setdefault(sid, threading.Lock())

    def _schedule_standby_refresh(self, sid: str) -> None:
        """Queue a refresh of the sandbox's standby as idle work (event loop)."""
        if self.standby_policy.per_sandbox == 0 or sid not in self.turns:
            return
        from .scheduler import JobCancelled, JobKind
        job = self.scheduler.policy.background_job(JobKind.STANDBY_REFRESH, 0, time.monotonic(), sandbox_id=sid)
        self.scheduler.cancel(sid, kinds=[JobKind.STANDBY_REFRESH])  # only the newest matters

        async def run() -> None:
            await asyncio.to_thread(self._refresh_standby, sid)

        fut = self.scheduler.submit(job, run)

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                return
            e = f.exception()
            if e is not None and not isinstance(e, JobCancelled):
                log.warning("standby refresh of %s failed: %s", sid, e)
                self._event("standby.failed", sid, error=str(e))

        fut.add_done_callback(done)

    def _refresh_standby(self, sid: str) -> None:
        """Make the sandbox's standby hold its recovery target (worker thread)."""
        from deltacr import StandbyRecord
        from .runtime.process import prepare_standby
        with self._standby_lock(sid):
            if sid not in self.turns:
                return  # being destroyed
            try:
                row = self.store.get_sandbox(sid)
                target = self._latest_committed(row)
            except NotFound:
                return
            cur = self.standbys.get(sid)
            if cur is not None and cur.checkpoint == target.id:
                return
            self._discard_standby_locked(sid)
            if not target.proc_image or not target.fs_snapshot:
                return  # no processes to keep warm: a rollback starts a fresh init anyway
            from .store import IntegrityError
            try:  # CRIU never parses an image whose seal does not hold, not even into a standby
                self._verify_checkpoint(target)
            except IntegrityError as e:
                self._event("standby.skipped", sid, checkpoint=target.id, reason=e.message)
                return
            m = self.images.manifest(target.proc_image)
            new = StandbyRecord(sid, target.id, sum(f.size for f in m.files if f.name.startswith("pages-")),
                                time.time())
            current = [StandbyRecord(k, e.checkpoint, e.standby.memory_bytes, e.standby.created)
                       for k, e in self.standbys.items()]
            adm = self.standby_policy.admit(new, current)
            if not adm.admit:
                self._event("standby.skipped", sid, checkpoint=target.id, reason=adm.reason)
                return
            for ev in adm.evict:
                if ev.sandbox_id != sid:
                    with self._standby_lock(ev.sandbox_id):
                        self._discard_standby_locked(ev.sandbox_id)
            key = f"standby-{secrets.token_hex(6)}"
            mounts = self.fs.prepare(key, parent=target.fs_snapshot)
            try:
                st = prepare_standby(self.runtime, sid, self.images, target.proc_image, root=mounts)
            except BaseException:
                self._remove_snapshot(key)
                raise
            self.standbys[sid] = _StandbyEntry(target.id, st, key)
            self._event("standby.ready", sid, checkpoint=target.id, prepare_ms=round(st.prepare_ms, 1),
                        memory_bytes=st.memory_bytes)

    def _promote_standby(self, sid: str, ck: CheckpointRow, row: SandboxRow,
                         timing: dict[str, float]) -> str | None:
        """Roll back by promoting the standby of `ck`, if there is one. Returns
        the new root's deltafs key, or None (then the cold path runs)."""
        from .runtime.process import promote_standby
        with self._standby_lock(sid):
            e = self.standbys.get(sid)
            if e is None or e.checkpoint != ck.id:
                return None
            self.standbys.pop(sid)
            t = time.monotonic()
            try:
                promote_standby(self.runtime, e.standby)
            except Exception as err:  # stale or broken standby: the cold path is still correct
                log.warning("promoting the standby of %s for %s failed: %s", sid, ck.id, err)
                self._event("standby.failed", sid, checkpoint=ck.id, error=str(err))
                try:
                    from .runtime.process import discard_standby
                    discard_standby(self.runtime, e.standby)
                finally:
                    self._remove_snapshot(e.fs_key)
                return None
            timing["promote"] = time.monotonic() - t
            if getattr(e.standby, "promote_ms", None) is not None:
                timing["resume"] = e.standby.promote_ms / 1000
        self._remove_snapshot(row.fs_key)
        return e.fs_key

    def _discard_standby(self, sid: str) -> None:
        with self._standby_lock(sid):
            self._discard_standby_locked(sid)

    def _discard_standby_locked(self, sid: str) -> None:
        from .runtime.process import discard_standby
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
        from .runtime.process import discard_standby, list_standbys, remove_standby_leftovers
        for st in list_standbys(self.runtime):
            try:
                discard_standby(self.runtime, st)
            except Exception as err:
                log.warning("discarding leftover standby %s: %s", st.token, err)
        # ... and what a prepare killed midway left (no standby.json yet)
        for d in remove_standby_leftovers(self.runtime):
            log.info("removed a half-made standby %s", d)
        from .runtime.process import sweep_standby_cgroups
        for row in self.store.list_sandboxes():
            sweep_standby_cgroups(self.runtime, row.id)
        for info in list(self.fs.walk()):
            if info.name.startswith("standby-"):
                self._remove_snapshot(info.name)

    # --- death watch ---------------------------------------------------------------------------
    async def watch_deaths(self, interval: float = 0.5) -> None:
        """Notice sandboxes whose init died (OOM kill, crash) and, per policy,
        roll them back to their last committed checkpoint; reap what crabd
        (a child subreaper) adopted meanwhile."""
        while True:
            await asyncio.sleep(interval)
            self._reap_adopted()
            for sid, t in list(self.turns.items()):
                if t.recovering or t.gave_up or t.lock.locked():
                    continue
                why = t.died
                if why is None:
                    if t.init_pid is None or pid_alive(t.init_pid):
                        continue
                    reap(t.init_pid)
                    try:
                        sb = await asyncio.to_thread(self.runtime.get, sid)
                    except NotFound:
                        continue
                    if sb.status == "running":
                        t.init_pid = sb.pid
                        continue
                    why = f"init exited ({sb.status})"
                t.died = None
                await self._sandbox_died(sid, t, why)

    def _reap_adopted(self) -> None:
        """Reap the zombies crabd adopted (sandbox inits, CRIU's restored
        trees, runc stages) -- all but the inits the watch itself reaps."""
        try:
            reaped = self._reaper.reap(skip={t.init_pid for t in self.turns.values() if t.init_pid})
        except OSError as e:
            log.warning("reaping adopted processes: %s", e)
            return
        if reaped:
            log.info("reaped %d adopted process(es): %s", len(reaped), reaped)

    async def _sandbox_died(self, sid: str, t: Turns, why: str) -> None:
        data: dict[str, Any] = {"reason": why}
        if t.recoveries:  # dying again soon after a recovery: say after which
            last = t.recoveries[-1]
            data.update(after_recovery_to=last.checkpoint,
                        after_recovery_s=round(time.monotonic() - last.at, 3))
        t.init_pid = None  # reaped, and nothing to watch until a rollback starts it again
        self.store.update_sandbox(sid, state="dead")
        self._event("sandbox.died", sid, **data)
        if self.options.auto_rollback:
            await self._auto_recover(sid)

    async def _after_rollback(self, t: Turns, sid: str) -> None:
        """Record the rolled-back sandbox's init for the death watch. A
        sandbox already not running (its restored processes were killed as
        they appeared) is marked dead for the watch, not left unwatched."""
        sb = await asyncio.to_thread(self.runtime.get, sid)
        t.init_pid = sb.pid
        t.died = None
        if sb.status != "running" or (sb.pid is not None and not pid_alive(sb.pid)):
            t.died = f"its restored processes died during the rollback (runc: {sb.status})"
        if not t.recovering:  # a rollback asked for by hand starts automatic recovery over
            t.recoveries.clear()
            t.gave_up = False

    async def _auto_recover(self, sid: str) -> None:
        """Roll a dead sandbox back, trying the options of crabd.recovery's
        plan in turn: bounded, never a loop of restores of a target that
        keeps dying."""
        from .recovery import Attempt, RecoveryPlan
        t = self.turns.get(sid)
        if t is None:
            return  # destroyed meanwhile
        t.recovering = True
        try:
            try:
                target, older = await asyncio.to_thread(self._recovery_targets, sid)
            except NotFound:
                return  # destroyed, or nothing committed to go back to
            plan, now = RecoveryPlan(), time.monotonic()
            t.recoveries = plan.recent(t.recoveries, now)
            opt = plan.next(t.recoveries, target=target.id, older=older, now=now,
                            target_has_processes=bool(target.proc_image))
            if opt is None:
                t.gave_up = True
                self._event("sandbox.recovery_gave_up", sid, attempts=[
                    {"checkpoint": a.checkpoint, "processes": a.processes} for a in t.recoveries],
                    fix=f"crabd rollback {sid} [checkpoint] once the cause is found (the sandbox stays dead)")
                return
            if opt.fallback:
                self._event("sandbox.recovery_fallback", sid, checkpoint=opt.checkpoint, processes=opt.processes,
                            instead_of=target.id, reason=f"recoveries to {target.id} kept dying")
            t.recoveries.append(Attempt(time.monotonic(), opt.checkpoint, opt.processes))
            try:
                await self.rollback(sid, opt.checkpoint, reason="automatic recovery after the sandbox died",
                                    processes=opt.processes, only_if_dead=True)
            except NotFound:
                pass  # destroyed while it waited: nothing to recover
            except Exception as e:
                log.exception("automatic rollback of %s failed", sid)
                self._event("sandbox.recovery_failed", sid, checkpoint=opt.checkpoint, error=str(e))
                if sid in self.turns:
                    pid = await asyncio.to_thread(self._live_init, sid)
                    if pid is None:  # still dead: the next option, on the watch's next round
                        t.died = f"its automatic recovery failed: {e}"
                    else:
                        t.init_pid = pid
        finally:
            t.recovering = False

    def _recovery_targets(self, sid: str) -> tuple[CheckpointRow, str | None]:
        """The recovery target, and the complete checkpoint before it if that
        one has processes to restore (a fallback of crabd.recovery's plan)."""
        row = self.store.get_sandbox(sid)
        target = self._latest_committed(row)
        older: str | None = None
        if target.parent:
            from dataclasses import replace
            try:
                prev = self._latest_committed(replace(row, head=target.parent))
                older = prev.id if prev.proc_image else None
            except NotFound:
                pass
        return target, older

    def _live_init(self, sid: str) -> int | None:
        """The sandbox's init pid if it runs (worker thread: asks runc)."""
        try:
            sb = self.runtime.get(sid)
        except NotFound:
            return None
        return sb.pid if sb.status == "running" and sb.pid and pid_alive(sb.pid) else None

    # --- health ----------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return {"ok": True, "sandboxes": len(self.turns), "uptime_s": round(time.time() - self.started_at, 1),
                "fs_driver": self.fs.driver, "inspector": getattr(self.inspector, "source", "proc"),
                "schema_version": SCHEMA_VERSION}


def _disk_full(e: BaseException | None) -> bool:
    """Is `e` (or what caused it) a full or over-quota file system?"""
    import errno
    seen = 0
    while e is not None and seen < 10:
        text = str(e)
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text \
                or "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _change_dict(ch: Any) -> dict[str, Any]:
    d = dict(ch.__dict__) if hasattr(ch, "__dict__") else dict(ch._asdict())
    for k, v in list(d.items()):
        if isinstance(v, bytes):
            # Sandbox names need not be UTF-8: the text form is for reading
            # (ambiguous: b"\xff" and a literal backslash-x-f-f look alike),
            # the exact bytes ride along in base64.
            try:
                d[k] = v.decode("utf-8")
            except UnicodeDecodeError:
                d[k] = v.decode("utf-8", "backslashreplace")
                d[f"{k}_b64"] = base64.b64encode(v).decode("ascii")
    return d

