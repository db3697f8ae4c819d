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
