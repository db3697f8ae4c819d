"""Live migration of a sandbox to another daemon through an OCI registry.

Part of `crabd.remote`; runs on the source daemon's event loop (the API's
POST /v1/sandboxes/{sid}/migrate), its blocking steps in worker threads,
and drives the target daemon through its API socket (`crabd.client`).

    pre-copy   push the newest committed checkpoint while the sandbox runs
               (its file-system chain and CRIU chunks reach the registry),
               and the target imports it (a pull with `prefetch`: no sandbox)
    writeback  the snapshot store's writeback (syncfs), still running, so the
               capture's own flushes only what was written meanwhile
    freeze     the sandbox's cgroup, under its turn lock (no exec meanwhile)
    capture    a checkpoint with files and processes, taken frozen: the
               freezer stays frozen through the CRIU dump (deltacr keeps a
               cgroup frozen that it found frozen)
    push       the delta only: the pre-copy's blobs are skipped, and the new
               layer is diffed from what the store names as changed
               (`transfer.layer_diff`), not from a scan of the whole tree
    pull       the target creates the sandbox from the pinned reference and
               restores its processes; it answers once they run
    stop       only then is the source destroyed (killed while still frozen)

On any failure before the stop the source is thawed and keeps running, and
what the target may have made of it is removed when the target answers. A
source daemon killed mid-migration finds the sandbox frozen at its next
start and thaws it (`daemon/startup.py`); a target killed mid-pull leaves
nothing half-imported (`transfer.gc_imported` at its next start). The
downtime is the time from the freeze to the target's answer; the reply
breaks it down (`phases_ms`, and the capture's, push's and pull's own steps).

Memory is not pre-copied: CRIU's pre-dump (`--track-mem`) needs the
kernel's soft-dirty page tracking, which this host's kernel lacks (`criu
check --feature mem_dirty_track`: "Dirty tracking is OFF"), so the frozen
dump writes every page; deltacr's store then keeps only chunks it lacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from deltafs.snapshotter import chaos_point

from ..errors import CrabdError, FailedPrecondition, NotFound
from ..runtime import Freezer
from .transfer import push_checkpoint, snapshot_tree

log = logging.getLogger("crabd")

__all__ = ["migrate_sandbox"]

#: The reason recorded on the checkpoint a migration takes.
MIGRATION_REASON = "migration: files and processes at the freeze"


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _target_client(socket: str) -> Any:
    from ..client import Client
    if not Path(socket).exists():
        raise FailedPrecondition(f"no target daemon socket at {socket}",
                                 fix="give the target crabd's --socket path (crabd serve --socket)")
    return Client(socket, timeout=600.0)


async def migrate_sandbox(daemon: Any, ref: str, reference: str, target_socket: str, *, owner: str | None = None,
                          auth: str | None = None, insecure: bool = False) -> dict[str, Any]:
    """Move sandbox `ref` to the daemon at `target_socket` through `reference`."""
    from ..daemon.base import Turns
    t0 = time.monotonic()
    row = daemon._own(await asyncio.to_thread(daemon.store.get_sandbox, ref), owner)
    sid = row.id
    target = _target_client(target_socket)
    try:
        await asyncio.to_thread(target.health)  # unreachable: refused before anything happens
        t = daemon.turns.setdefault(sid, Turns())
        # Pre-copy, the sandbox running: the newest durable checkpoint.
        await daemon._wait_capture(t)
        pre_ck, _ = await asyncio.to_thread(daemon._durable_parent, row.head)
        pre: dict[str, Any] | None = None
        prefetched: dict[str, Any] | None = None
        if pre_ck is not None:
            pre = await asyncio.to_thread(push_checkpoint, daemon, pre_ck.id, reference, auth=auth,
                                          insecure=insecure)
            # ... and the target imports it now: after the freeze it fetches
            # only the delta (the chain's layers it has are reused).
            prefetched = await asyncio.to_thread(target.pull_sandbox, pre["pinned"], registry_auth=auth,
                                                 insecure=insecure, prefetch=True)
            if pre_ck.fs_snapshot:  # the tree the frozen push diffs against, scanned now
                await asyncio.to_thread(snapshot_tree, daemon.fs, pre_ck.fs_snapshot)
        async with t.lock:
            await daemon._wait_capture(t)
            row = await asyncio.to_thread(daemon.store.get_sandbox, sid)
            daemon._refuse_if_dead(row, t)
            out = await _frozen_move(daemon, row, t, reference, target, auth, insecure)
    finally:
        target.close()
    out.update(sandbox=sid, precopy=_summary(pre), prefetch=prefetched, duration_ms=_ms(time.monotonic() - t0))
    return out


def _summary(p: dict[str, Any] | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {k: p[k] for k in ("checkpoint", "blobs_pushed", "blobs_skipped", "bytes_pushed", "duration_ms")}


async def _frozen_move(daemon: Any, row: Any, t: Any, reference: str, target: Any, auth: str | None,
                       insecure: bool) -> dict[str, Any]:
    """Freeze, capture, push, pull on the target, stop the source (the turn lock held)."""
    sid = row.id
    sb = await asyncio.to_thread(daemon.runtime.get, sid)
    freezer = Freezer(daemon.runtime.layout, sb.cgroup_rel)
    effects = await asyncio.to_thread(daemon.inspector.end_turn, sid)
    daemon.inspector.begin_turn(sid)
    phases: dict[str, float] = {}
    # Writeback while it still runs: the capture's own writeback, frozen,
    # then flushes only what was written meanwhile.
    tp = time.monotonic()
    await asyncio.to_thread(daemon.fs.prepare_checkpoint, row.fs_key)
    writeback_running = time.monotonic() - tp
    t_freeze = time.monotonic()
    await asyncio.to_thread(freezer.freeze)
    phases["freeze"] = time.monotonic() - t_freeze
    try:
        tp = time.monotonic()
        ck = await asyncio.to_thread(daemon._open_checkpoint, row, row.turn, effects, manual=True, blind=t.blind)
        # Whatever the inspector saw: the target needs the processes too.
        ck.plan, ck.reasons = "FS_PROC", [MIGRATION_REASON] + [r for r in ck.reasons if r != MIGRATION_REASON]
        t.capture = asyncio.ensure_future(daemon._run_capture(sid, ck))
        await daemon._wait_capture(t)
        done = await asyncio.to_thread(daemon.store.get_checkpoint, ck.id)
        if done.state != "committed" or done.proc_image != ck.id:
            why = done.error or next((r for r in done.reasons if "process image not captured" in r), done.state)
            raise FailedPrecondition(f"the migration's checkpoint {ck.id} holds no process image: {why}",
                                     fix="see the checkpoint's reasons; the sandbox keeps running here")
        phases["capture"] = time.monotonic() - tp
        chaos_point("migrate_frozen")  # CRABD_CHAOS: a source killed frozen, its checkpoint taken
        tp = time.monotonic()
        pushed = await asyncio.to_thread(push_checkpoint, daemon, ck.id, reference, auth=auth, insecure=insecure)
        phases["push"] = time.monotonic() - tp
        tp = time.monotonic()
        try:
            pulled: dict[str, Any] = await asyncio.to_thread(target.pull_sandbox, pushed["pinned"], name=row.name,
                                             registry_auth=auth, insecure=insecure)
        except BaseException:
            await asyncio.to_thread(_undo_on_target, target, row.name, pushed["pinned"])
            raise
        phases["pull"] = time.monotonic() - tp
        if pulled.get("status") != "running" or pulled.get("restored") != "fs+proc":
            await asyncio.to_thread(_undo_on_target, target, row.name, pushed["pinned"])
            raise FailedPrecondition(f"the target created {pulled.get('sandbox')} but it is "
                                     f"{pulled.get('status')} with {pulled.get('restored')} restored",
                                     fix="see the target daemon's log; the sandbox keeps running here")
        downtime = time.monotonic() - t_freeze
    except BaseException:
        try:
            await asyncio.to_thread(freezer.thaw)
        except CrabdError as e:  # gone meanwhile: the death watch handles it
            log.warning("thawing %s after a failed migration: %s", sid, e)
        raise
    # The target runs it: only now does the source go (killed still frozen,
    # so the two never run at once).
    tp = time.monotonic()
    await asyncio.to_thread(_stop_frozen, daemon, sid, freezer)
    phases["stop_source"] = time.monotonic() - tp
    return {"checkpoint": ck.id, "reference": pushed["pinned"], "target_sandbox": pulled["sandbox"],
            "status": pulled["status"], "restored": pulled["restored"],
            "push": {k: pushed[k] for k in ("blobs_pushed", "blobs_skipped", "bytes_pushed", "bytes_total")},
            "downtime_ms": _ms(downtime), "phases_ms": {k: _ms(v) for k, v in phases.items()},
            "pull": {k: pulled.get(k) for k in ("fs_layers_imported", "fs_layers_reused", "packs_pulled")},
            "writeback_running_ms": _ms(writeback_running),
            "capture_timing_ms": {k: _ms(v) for k, v in (done.durations or {}).items()},
            "push_timing_ms": pushed.get("timing_ms", {}), "pull_timing_ms": pulled.get("timing_ms", {})}


def _stop_frozen(daemon: Any, sid: str, freezer: Freezer) -> None:
    """Destroy the source. Its processes are killed while frozen first
    (cgroup v2's cgroup.kill reaches frozen tasks): the runtime's stop thaws
    before its SIGKILL, which would let the source run a moment next to the
    target. The turn lock, held, keeps the death watch away meanwhile."""
    kill = freezer.dir / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    daemon.destroy_sandbox(sid)


def _undo_on_target(target: Any, name: str, pinned: str) -> None:
    """Remove what a failed or refused pull made on the target (when it answers)."""
    try:
        for sb in target.sandboxes():
            if sb.get("name") == name and sb.get("forked_from") == pinned:
                target.delete_sandbox(sb["id"])
    except (CrabdError, NotFound, OSError) as e:
        log.warning("the target did not answer after a failed migration (%s): it may hold a copy of %s", e, name)
