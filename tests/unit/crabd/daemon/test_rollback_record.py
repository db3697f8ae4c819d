"""A rollback's record (crabd/daemon/rollback.py `_finish_rollback`): the new
head and its `sandbox.rolled_back` event are one commit (one fsync on the
rollback's reply path, issue 16); the order changed from row, watch, event
to row + event, watch. No root: a temp store, the daemon's other parts
replaced."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from crabd.daemon import Daemon
from crabd.daemon.events import EventBus
from crabd.store import CheckpointRow, SandboxRow, Store


@pytest.fixture
def daemon(tmp_path: Any) -> Any:
    st = Store(tmp_path)
    st.add_sandbox(SandboxRow(id="sb-1", name="one", image="img", fs_key="root-old", lineage="sb-1", head="sb-1-2"))
    for seq, parent in ((1, None), (2, "sb-1-1")):
        st.add_checkpoint(CheckpointRow(id=f"sb-1-{seq}", sandbox_id="sb-1", seq=seq, parent=parent, branch=0,
                                        turn=seq, plan="FS", fs_snapshot=f"snap-{seq}", state="committed"))
    d = Daemon.__new__(Daemon)   # the record's parts only
    d.store, d.events, d._loop = st, EventBus(st), None
    d._ledger_report = lambda sid, row, path: {"committed_after": [], "unknown": []}
    d.watched = []
    d._watch = lambda sid, sb=None: d.watched.append(sid)
    yield d
    st.close()


def finish(d: Any) -> dict[str, Any]:
    row, ck = d.store.get_sandbox("sb-1"), d.store.get_checkpoint("sb-1-1")
    return d._finish_rollback("sb-1", row, ck, "root-new", "fs", {}, "requested")


def rolled_back(d: Any) -> list[Any]:
    return [e for e in d.store.events_since(0) if e.kind == "sandbox.rolled_back"]


def test_head_and_event_land_together(daemon: Any) -> None:
    out = finish(daemon)
    row = daemon.store.get_sandbox("sb-1")
    assert (row.head, row.fs_key, row.branch) == ("sb-1-1", "root-new", 1)
    assert [e.data["checkpoint"] for e in rolled_back(daemon)] == ["sb-1-1"]
    assert daemon.watched == ["sb-1"]
    assert {"ledger", "record", "watch"} <= set(out["timing_ms"])


def test_an_event_that_cannot_be_written_leaves_the_head_as_it_was(daemon: Any, monkeypatch: Any) -> None:
    # A crash (or a failed write) between the two can no longer keep the row without its event.
    def broken(*a: Any, **kw: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")
    monkeypatch.setattr(daemon.store, "add_event", broken)
    with pytest.raises(sqlite3.OperationalError):
        finish(daemon)
    row = daemon.store.get_sandbox("sb-1")
    assert (row.head, row.fs_key, row.branch) == ("sb-1-2", "root-old", 0)
    assert daemon.watched == []


def test_a_failed_watch_keeps_the_recorded_rollback(daemon: Any) -> None:
    # The sandbox runs the checkpoint's state once promoted or restored:
    # the record says so even if watching it fails (the rollback's reply is
    # an error; the death watch then takes the sandbox from its pid).
    def broken(sid: str, sb: Any = None) -> None:
        raise OSError("no cgroup")
    daemon._watch = broken
    with pytest.raises(OSError):
        finish(daemon)
    assert daemon.store.get_sandbox("sb-1").head == "sb-1-1"
    assert len(rolled_back(daemon)) == 1
