"""Sandboxes: create (from an image or, for a fork, from a checkpoint),
describe, destroy.

Part of `crabd.daemon`. A sandbox is a runc container (`crabd.runtime`)
whose root is a deltafs active snapshot (`names.new_root_key`) stacked on
its image's snapshot or on a checkpoint's; its row and its checkpoint 0 (the
initial state) are written in one transaction, and the inspector watches its
cgroup from then on.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any

from deltafs.snapshotter import chaos_point  # CRABD_CHAOS: bench/chaos.py's kill points

from ..errors import NotFound
from ..runtime import Limits, Sandbox
from ..runtime.cgroups import sweep_standby_cgroups
from ..store import CheckpointRow, SandboxRow
from .base import DaemonBase, Turns
from .events import EventKind
from .names import checkpoint_id, is_image_snapshot, new_root_key
from .plans import BLIND_RESTORED

log = logging.getLogger("crabd")

__all__ = ["Sandboxes"]

# Paths inside a sandbox that belong to crabd, not to the sandbox's state
# (the exec status fifos): writes there never make a turn FS.
_CRABD_PATHS = ("/dev/.crabd",)


class Sandboxes(DaemonBase):
    def create_sandbox(self, image: str, *, name: str | None = None, limits: Limits | None = None,
                       owner: str = "") -> SandboxRow:
        base = self.image_snapshots.snapshot(image)
        return self._new_sandbox(image=image, name=name, limits=limits or Limits(), owner=owner,
                                 parent_snapshot=base, base_checkpoint=None, lineage=None)

    def _new_sandbox(self, *, image: str, name: str | None, limits: Limits, owner: str, parent_snapshot: str,
                     base_checkpoint: CheckpointRow | None, lineage: str | None) -> SandboxRow:
        key = new_root_key()
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
                             owner=owner, head=checkpoint_id(sb.id, 0), next_seq=1, limits=limits.to_dict(),
                             forked_from=base_checkpoint.id if base_checkpoint else None)
            if base_checkpoint is None and is_image_snapshot(parent_snapshot):
                self.integrity.image_seal(parent_snapshot)  # hashed now, not inside the write transaction
            with self.store.transaction():
                self.store.add_sandbox(row)
                self.store.add_checkpoint(CheckpointRow(
                    id=checkpoint_id(sb.id, 0), sandbox_id=sb.id, seq=0,
                    parent=base_checkpoint.id if base_checkpoint else None,
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
        self.events.emit(EventKind.SANDBOX_CREATED, sb.id, image=image, name=row.name, forked_from=row.forked_from)
        return row

    def _watch(self, sid: str, sb: Sandbox | None = None) -> None:
        """Watch the sandbox's cgroup and init; `sb`: already known (a runc
        spawn less on a rollback's critical path)."""
        sb = sb or self.runtime.get(sid)
        try:
            self.inspector.unwatch(sid)
        except Exception:
            pass
        cg = self.runtime.layout.v2_dir(sb.cgroup_rel)
        self.inspector.watch(sid, cg, init_pid=sb.pid, outside_paths=_CRABD_PATHS)
        t = self.turns.setdefault(sid, Turns())
        t.init_pid = sb.pid
        oom = self.runtime.layout.oom_events_file(sb.cgroup_rel)
        t.oom_file = str(oom) if oom is not None else None
        self.wake_death_watch()  # arm a pidfd for it now

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
        sweep_standby_cgroups(row.id)
        try:
            self.inspector.unwatch(row.id)
        except Exception:
            pass
        try:
            self.runtime.destroy(row.id)
        except NotFound:
            pass
        cks = self.store.list_checkpoints(row.id, states=("committed", "pending", "failed"))
        snaps = [c.fs_snapshot for c in reversed(cks)]
        images = [c.proc_image for c in cks if c.proc_image]
        # The state file system may be full (no per-sandbox quota: a sandbox
        # filled it); the released reserve leaves room to record this.
        self.space.retry_when_full(lambda: self.store.delete_sandbox(row.id))
        self._remove_snapshot(row.fs_key)
        for img in dict.fromkeys(images):
            self._drop_image_if_unused(img)
        for s in dict.fromkeys(snaps):
            self._drop_snapshot_if_unused(s)
        from ..remote.transfer import gc_imported
        gc_imported(self)  # a pulled sandbox's imported layers, once nothing stacks on them
        self.turns.pop(row.id, None)
        shutil.rmtree(self.state_dir / "full" / row.id, ignore_errors=True)  # capture mode full's copies
        self.metrics.sandboxes.set(len(self.turns))
        self.events.emit(EventKind.SANDBOX_DESTROYED, row.id)
        self.space.ensure()
