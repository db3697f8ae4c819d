"""crabd's SQLite store: no root, a temp dir."""

import os
import sqlite3
import stat

import pytest

from crabd.errors import AlreadyExists, FailedPrecondition, NotFound
from crabd.store import SCHEMA_VERSION, CheckpointRow, IntegrityError, SandboxRow, Store


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path)
    s.add_sandbox(SandboxRow(id="sb-1", name="one", image="img", fs_key="root-1", lineage="sb-1"))
    yield s
    s.close()


def ck(seq, parent=None, state="committed", **kw):
    return CheckpointRow(id=f"sb-1-{seq}", sandbox_id="sb-1", seq=seq, parent=parent, branch=0, turn=seq,
                         plan="FS", fs_snapshot=f"snap-{seq}", state=state, **kw)


def test_schema_wal_and_secret(tmp_path, store):
    db = sqlite3.connect(tmp_path / "crabd.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    Store(tmp_path).close()  # reopening migrates nothing and keeps the secret


def test_newer_schema_is_refused(tmp_path, store):
    store.close()
    db = sqlite3.connect(tmp_path / "crabd.db")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.commit()
    with pytest.raises(FailedPrecondition, match="newer than this crabd"):
        Store(tmp_path)


def test_sequences_are_monotonic(store):
    assert [store.allocate_seq("sb-1") for _ in range(3)] == [1, 2, 3]
    with pytest.raises(NotFound):
        store.allocate_seq("sb-2")


def test_names_are_unique(store):
    with pytest.raises(AlreadyExists):
        store.add_sandbox(SandboxRow(id="sb-2", name="one", image="img", fs_key="k", lineage="sb-2"))


def test_pending_becomes_committed_with_a_digest(store):
    store.add_checkpoint(ck(1, state="pending"))
    assert [c.id for c in store.pending_checkpoints()] == ["sb-1-1"]
    row = store.commit_checkpoint("sb-1-1", bytes=42)
    assert row.state == "committed" and row.digest
    store.verify(store.get_checkpoint("sb-1-1"))
    assert store.pending_checkpoints() == []


def test_tampered_rows_are_refused(tmp_path, store):
    store.add_checkpoint(ck(1))
    db = sqlite3.connect(tmp_path / "crabd.db")
    db.execute("UPDATE checkpoints SET fs_snapshot='evil' WHERE id='sb-1-1'")
    db.commit()
    with pytest.raises(IntegrityError, match="sb-1-1"):
        store.get_checkpoint("sb-1-1", verify=True)


def test_drop_checkpoint_reparents_and_resigns(store):
    for i, parent in ((0, None), (1, "sb-1-0"), (2, "sb-1-1"), (3, "sb-1-2")):
        store.add_checkpoint(ck(i, parent))
    store.drop_checkpoint("sb-1-1")
    store.drop_checkpoint("sb-1-2")
    c3 = store.get_checkpoint("sb-1-3", verify=True)  # re-signed: still verifies
    assert c3.parent == "sb-1-0"
    assert [c.seq for c in store.list_checkpoints("sb-1")] == [0, 3]


def test_events_in_order(store):
    a = store.add_event("one", "sb-1", x=1)
    store.add_event("two", None)
    assert [e.kind for e in store.events_since(0)] == ["one", "two"]
    assert [e.kind for e in store.events_since(a.seq)] == ["two"]
    assert [e.kind for e in store.events_since(0, "sb-1")] == ["one"]


def _seqs(page):
    return [e.seq for e in page[0]], page[1]


def test_events_page_forward_with_the_cursor(store):
    seqs = [store.add_event(f"k{i}", "sb-1").seq for i in range(7)]
    p1 = store.events_page(since=0, limit=3)
    assert _seqs(p1) == (seqs[:3], True)
    p2 = store.events_page(since=p1[0][-1].seq, limit=3)
    assert _seqs(p2) == (seqs[3:6], True)
    p3 = store.events_page(since=p2[0][-1].seq, limit=3)
    assert _seqs(p3) == (seqs[6:], False)
    assert store.events_page(since=seqs[-1], limit=3) == ([], False)
    assert store.last_event_seq() == seqs[-1]


def test_events_page_newest_first_and_backward(store):
    seqs = [store.add_event(f"k{i}", "sb-1").seq for i in range(5)]
    p1 = store.events_page(newest_first=True, limit=2)
    assert _seqs(p1) == ([seqs[4], seqs[3]], True)
    p2 = store.events_page(before=p1[0][-1].seq, newest_first=True, limit=2)
    assert _seqs(p2) == ([seqs[2], seqs[1]], True)
    p3 = store.events_page(before=p2[0][-1].seq, newest_first=True, limit=2)
    assert _seqs(p3) == ([seqs[0]], False)
    # since bounds a backward page too: the newest two after seqs[1]
    assert _seqs(store.events_page(since=seqs[1], newest_first=True, limit=9)) == ([seqs[4], seqs[3], seqs[2]], False)


def test_events_page_filters_by_sandbox_and_owner(store):
    store.add_sandbox(SandboxRow(id="sb-a", name="a", image="i", fs_key="k", lineage="sb-a", owner="alice"))
    store.add_sandbox(SandboxRow(id="sb-b", name="b", image="i", fs_key="k2", lineage="sb-b", owner="bob"))
    for i in range(4):
        store.add_event("x", "sb-a" if i % 2 else "sb-b")
    store.add_event("daemon", None)
    assert [e.sandbox_id for e in store.events_page(owner="alice")[0]] == ["sb-a", "sb-a"]
    assert [e.sandbox_id for e in store.events_page(sandbox_id="sb-b")[0]] == ["sb-b", "sb-b"]
    assert store.events_page(owner="alice", sandbox_id="sb-b") == ([], False)
    # a full page of the owner's events says whether more of *its* events follow
    evs, more = store.events_page(owner="alice", limit=1)
    assert len(evs) == 1 and more
    assert store.events_page(owner="alice", since=evs[0].seq, limit=1)[1] is False
    assert store.last_event_seq() == 5
    assert store.last_event_seq(owner="alice") == 4 and store.last_event_seq(sandbox_id="sb-b") == 3
