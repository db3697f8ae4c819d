"""The crabd.daemon package's pure parts, without root: event kinds and the
event bus, snapshot names, the disk-full check and the space reserve, the
decisions taken from a checkpoint's reasons, image import through the Runner
seam, and the facade's import surface."""

from __future__ import annotations

import asyncio
import errno
import re
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import deltafs
import pytest

from crabd.capture import FS_ONLY_REASON, FULL_REASON, CaptureMode, apply_mode, processes_skipped
from crabd.daemon import Daemon, DaemonOptions, Turns  # every importer's names still resolve
from crabd.daemon.events import EventBus, EventKind
from crabd.daemon.names import (checkpoint_id, image_snapshot, is_image_snapshot, is_sandbox_root,
                                is_standby_key, new_import_key, new_root_key, new_standby_key)
from crabd.daemon.plans import DIED_REASON, died_during_turn, is_complete
from crabd.daemon.space import SpaceReserve, is_disk_full
from crabd.errors import FailedPrecondition
from crabd.store import CheckpointRow, Store

PKG = Path(__file__).resolve().parents[4] / "crabd" / "daemon"

# Every event kind crabd/daemon.py spelled as a bare string before the split
# (the wire values clients filter on).
KINDS_BEFORE = {
    "checkpoint.committed", "checkpoint.deleted", "checkpoint.discarded", "checkpoint.failed",
    "checkpoint.proc_failed", "checkpoint.sized", "checkpoints.retired", "effect.intent", "effect.unknown",
    "effects.not_undone", "effects.unmanaged", "ledger.failed", "maintenance.done", "sandbox.adopted",
    "sandbox.created", "sandbox.destroyed", "sandbox.died", "sandbox.oom_kill", "sandbox.lost", "sandbox.orphan_removed",
    "sandbox.recovery_failed", "sandbox.recovery_fallback", "sandbox.recovery_gave_up", "sandbox.restore_failed",
    "sandbox.rolled_back", "sandbox.thawed", "standby.failed", "standby.ready", "standby.skipped",
    # made from the ledger's decision or outcome: f"effect.{decision}", f"effect.{state}"
    "effect.replay", "effect.ask", "effect.reconcile", "effect.committed", "effect.failed", "effect.reconciled",
    # added since: the operator view's time line (issue 20)
    "turn.ended",
}


def test_event_kinds_keep_their_wire_values():
    assert {k.value for k in EventKind} == KINDS_BEFORE
    # The kinds the ledger glue makes from a value (crabd/daemon/ledger.py) are members.
    from crabd.effects import STATES
    for decision in ("replay", "ask", "reconcile"):  # Decision.action, but execute (effect.intent)
        EventKind(f"effect.{decision}")
    for state in (*STATES, "reconciled"):
        EventKind(f"effect.{state}")
    with pytest.raises(ValueError):
        EventKind("effect.typo")


def test_no_bare_event_kind_or_snapshot_prefix_in_the_package():
    """Events are emitted by kind (a value-made kind only in ledger.py, checked
    against the enum), names made by names.py: no module spells them."""
    for p in PKG.glob("*.py"):
        src = p.read_text()
        assert not re.search(r"\.emit\(\s*[\"']", src), f"{p.name} emits an event by a string"
        if p.name != "ledger.py":
            assert not re.search(r"\.emit\(\s*f[\"']", src), f"{p.name} emits an event by an f-string"
        if p.name != "names.py":
            assert not re.search(r"[\"'](img|root|import|standby|fullview)-", src), f"{p.name} spells a prefix"


def test_no_module_over_600_lines():
    for p in PKG.glob("*.py"):
        assert len(p.read_text().splitlines()) <= 600, p.name


def test_event_bus_records_and_wakes(tmp_path):
    st = Store(tmp_path)
    try:
        bus = EventBus(st)

        async def go() -> bool:
            bus.bind(asyncio.get_running_loop())
            waiter = asyncio.ensure_future(bus.wait(30))
            await asyncio.sleep(0)
            bus.emit(EventKind.SANDBOX_CREATED, "sb1", image="busybox")
            await asyncio.wait_for(waiter, 5)  # woken, not timed out
            return True

        assert asyncio.run(go())
        ev = st.events_since(0)[-1]
        assert (ev.kind, ev.sandbox_id, ev.data) == ("sandbox.created", "sb1", {"image": "busybox"})
        assert type(ev.kind) is str
    finally:
        st.close()


def test_snapshot_names():
    assert image_snapshot("busybox") == "img-busybox" and is_image_snapshot("img-busybox")
    assert not is_image_snapshot(None) and not is_image_snapshot("") and not is_image_snapshot("sb-1")
    assert is_sandbox_root(new_root_key()) and is_sandbox_root(new_import_key("debian"))
    assert is_sandbox_root("fullview-x") and not is_sandbox_root("img-busybox") and not is_sandbox_root("sb-3")
    assert is_standby_key(new_standby_key()) and not is_sandbox_root(new_standby_key())
    assert new_root_key() != new_root_key()
    assert checkpoint_id("abc", 7) == "abc-7"


def test_one_disk_full_check():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise OSError(errno.ENOSPC, "x")
        except OSError as e:
            raise RuntimeError("commit failed") from e
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)  # the cause counts
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error")) and not is_disk_full(None)


def test_space_reserve(tmp_path):
    synced = []
    r = SpaceReserve(tmp_path, size=1 << 16)
    r.sync = lambda: synced.append(1)
    r.ensure()
    assert r.path.stat().st_size == 1 << 16
    r.make_room()  # plenty of room here: kept
    assert r.path.exists()
    assert r.release() and synced == [1] and not r.path.exists()
    assert not r.release()  # none left
    r.restore_if_room()
    assert r.path.exists()
    calls = []

    def write() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return "ok"

    assert r.retry_when_full(write) == "ok" and len(calls) == 2 and not r.path.exists()
    with pytest.raises(sqlite3.OperationalError):  # no reserve left to free: the error stands
        r.retry_when_full(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("database or disk is full")))
    with pytest.raises(sqlite3.OperationalError):  # not a full disk: never retried
        r.retry_when_full(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")))


def test_capture_modes_are_typed():
    assert [m.value for m in CaptureMode] == ["auto", "fs-only", "full"]
    kind, reasons = apply_mode("FS_PROC", ["r"], CaptureMode.FS_ONLY)
    assert (kind, reasons) == ("FS", ["r", FS_ONLY_REASON]) and processes_skipped(reasons)
    assert apply_mode("FS_PROC", [], "fs-only") == ("FS", [FS_ONLY_REASON])
    assert apply_mode("SKIP", [], CaptureMode.FULL) == ("FS_PROC", [FULL_REASON])
    assert not processes_skipped(apply_mode("FS_PROC", ["r"], "full")[1]) and not processes_skipped(None)
    with pytest.raises(ValueError):
        apply_mode("FS", [], "everything")


def test_recovery_targets_from_reasons():
    def ck(plan: str, proc: str | None, reasons: list[str]) -> CheckpointRow:
        return CheckpointRow(id="s-1", sandbox_id="s", seq=1, parent="s-0", branch=0, turn=1, plan=plan,
                             reasons=reasons, proc_image=proc, fs_snapshot="s-1", state="committed")

    assert is_complete(ck("FS_PROC", "s-1", [])) and is_complete(ck("FS", None, ["x"]))
    assert not is_complete(ck("FS_PROC", None, []))  # the dump failed: files only
    assert not is_complete(ck("FS", "s-0", [DIED_REASON])) and died_during_turn([DIED_REASON])
    assert not died_during_turn(None)


def test_image_import_goes_through_the_runner(tmp_path, monkeypatch):
    """The copy of an image into its snapshot is a Runner call (argument
    list, timeout); a failed copy is a FailedPrecondition and its active
    snapshot is removed."""
    from crabd.daemon import images
    from crabd.testing import FakeRunner

    monkeypatch.setattr(images, "mount_all", lambda mounts, target: None)
    monkeypatch.setattr(images, "unmount", lambda target: None)

    class FS:
        def __init__(self) -> None:
            self.committed: dict[str, str] = {}
            self.removed: list[str] = []

        def stat(self, name: str) -> None:
            if name not in self.committed.values():
                raise deltafs.NotFound(name)

        def prepare(self, key: str) -> list:
            return []

        def commit(self, name: str, key: str) -> None:
            self.committed[key] = name

        def remove(self, key: str) -> None:
            self.removed.append(key)

    runner, fs = FakeRunner(), FS()
    runtime = SimpleNamespace(runner=runner, images=SimpleNamespace(get=lambda name: SimpleNamespace(path="/img")))
    snaps = images.ImageSnapshots(fs, runtime, tmp_path)
    runner.on("cp", returncode=1, stderr=b"cp: No space left on device")
    with pytest.raises(FailedPrecondition, match="No space left"):
        snaps.snapshot("busybox")
    assert runner.calls[0][:3] == ["cp", "-a", "--reflink=auto"] and runner.calls[0][3] == "/img/."
    assert len(fs.removed) == 1 and is_sandbox_root(fs.removed[0]) and not fs.committed
    runner.rules.clear()
    assert snaps.snapshot("busybox") == "img-busybox" and list(fs.committed.values()) == ["img-busybox"]
    assert snaps.snapshot("busybox") == "img-busybox" and len(runner.calls) == 2  # made once
    assert not list(tmp_path.iterdir())  # the temporary mount point is gone


def test_facade_surface():
    assert DaemonOptions().capture == "auto" and Turns().blind is None
    for name in ("exec", "rollback", "fork", "destroy", "watch_deaths", "wait_event", "health", "effect_intent",
                 "_own", "_wait_capture", "_seal_row", "_verify_checkpoint", "_inspector_pause"):
        assert callable(getattr(Daemon, name)), name
