"""Seals without root: the overlay layer digest notices what it claims to
(content with size and mtime kept, mode, names, symlink targets, xattrs)
and documents its budget limit; the store seals a row at commit and its
digest covers the seals. (Live drivers: tests/integration/crabd/test_tamper.py.)"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from crabd.store import CheckpointRow, IntegrityError, SandboxRow, Store
from deltafs.seal import layer_digest


def tree(root: Path) -> Path:
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"hello world\n")
    (root / "big").write_bytes(bytes(range(256)) * 64)
    (root / "link").symlink_to("d/f")
    return root


def flip_keep_times(p: Path) -> None:
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[3] ^= 1
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_same_tree_same_digest_and_counts(tmp_path: Path) -> None:
    a = tree(tmp_path / "a")
    d1, hashed, stat_only = layer_digest(str(a))
    assert layer_digest(str(a))[0] == d1
    assert hashed == len(b"hello world\n") + 256 * 64 and stat_only == 0


@pytest.mark.parametrize("change", ["content", "mode", "new_file", "rename", "symlink", "xattr", "unlink"])
def test_every_kind_of_change_changes_the_digest(tmp_path: Path, change: str) -> None:
    a = tree(tmp_path / "a")
    before = layer_digest(str(a))[0]
    if change == "content":
        flip_keep_times(a / "big")  # same size, same mtime
    elif change == "mode":
        os.chmod(a / "d" / "f", 0o777)
    elif change == "new_file":
        (a / "d" / "e" / "g").write_bytes(b"")
    elif change == "rename":
        os.rename(a / "d" / "f", a / "d" / "g")
    elif change == "symlink":
        (a / "link").unlink()
        (a / "link").symlink_to("big")
    elif change == "xattr":
        os.setxattr(a / "d" / "f", "user.crabd-test", b"1")
    elif change == "unlink":
        (a / "big").unlink()
    assert layer_digest(str(a))[0] != before, change


def test_past_the_budget_files_are_covered_by_stat_only(tmp_path: Path) -> None:
    a = tree(tmp_path / "a")
    before, hashed, stat_only = layer_digest(str(a), budget=100)
    assert hashed == len(b"hello world\n") and stat_only == 1  # "big" is over the budget
    flip_keep_times(a / "big")
    assert layer_digest(str(a), budget=100)[0] == before  # the documented limit
    os.utime(a / "big")  # ... but not if its mtime moves
    assert layer_digest(str(a), budget=100)[0] != before


def test_layer_digest_never_follows_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    a = tmp_path / "a"
    a.mkdir()
    (a / "escape").symlink_to(outside)
    d1 = layer_digest(str(a))[0]
    (outside / "secret").write_bytes(b"y")
    assert layer_digest(str(a))[0] == d1


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path)
    s.add_sandbox(SandboxRow(id="sb-1", name="one", image="img", fs_key="root-1", lineage="sb-1"))
    yield s
    s.close()


def pending(seq: int) -> CheckpointRow:
    return CheckpointRow(id=f"sb-1-{seq}", sandbox_id="sb-1", seq=seq, parent=None, branch=0, turn=seq, plan="FS")


def test_store_seals_at_commit_and_the_digest_covers_them(tmp_path: Path, store: Store) -> None:
    seen = []
    store.sealer = lambda row: seen.append((row.id, row.fs_snapshot)) or {"fs": {"layer": row.fs_snapshot}}
    store.add_checkpoint(pending(1))
    row = store.commit_checkpoint("sb-1-1", fs_snapshot="snap-1")
    assert seen == [("sb-1-1", "snap-1")] and row.seals == {"fs": {"layer": "snap-1"}}
    store.verify(store.get_checkpoint("sb-1-1"))
    db = sqlite3.connect(tmp_path / "crabd.db")
    for value in ('{"fs": {"layer": "other"}}', None):
        db.execute("UPDATE checkpoints SET seals=? WHERE id='sb-1-1'", (value,))
        db.commit()
        with pytest.raises(IntegrityError, match="sb-1-1"):
            store.verify(store.get_checkpoint("sb-1-1"))
    db.close()


def test_rows_without_seals_keep_their_digest(store: Store) -> None:
    # A checkpoint committed before migration 3 (or with nothing to seal):
    # its digest is computed exactly as before seals existed.
    store.add_checkpoint(pending(1))
    row = store.commit_checkpoint("sb-1-1", fs_snapshot="snap-1")
    assert row.seals is None
    store.verify(store.get_checkpoint("sb-1-1"))


def test_crabds_own_re_signing_never_launders_a_tampered_row(tmp_path: Path, store: Store) -> None:
    # Idle work re-signs rows (sizing fills in `bytes`, retention re-parents
    # children): a row changed behind crabd's back must stay refused.
    for seq, parent in ((1, None), (2, "sb-1-1")):
        c = pending(seq)
        c.parent = parent
        store.add_checkpoint(c)
        store.commit_checkpoint(c.id, fs_snapshot=f"snap-{seq}")
    db = sqlite3.connect(tmp_path / "crabd.db")
    db.execute("UPDATE checkpoints SET turn=99 WHERE id='sb-1-2'")
    db.commit()
    db.close()
    store.set_checkpoint_bytes("sb-1-2", 4096, {"size": 0.1})
    with pytest.raises(IntegrityError):
        store.verify(store.get_checkpoint("sb-1-2"))
    store.drop_checkpoint("sb-1-1")  # re-parents sb-1-2
    with pytest.raises(IntegrityError):
        store.verify(store.get_checkpoint("sb-1-2"))
    # An intact row is re-signed as before.
    c = pending(3)
    store.add_checkpoint(c)
    store.commit_checkpoint(c.id, fs_snapshot="snap-3")
    store.set_checkpoint_bytes("sb-1-3", 8192)
    store.verify(store.get_checkpoint("sb-1-3"))


def test_past_the_file_budget_files_are_covered_by_stat_only(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    for i in range(5):
        (a / f"f{i}").write_bytes(b"x" * 10)
    _, hashed, stat_only = layer_digest(str(a), max_files=3)
    assert hashed == 30 and stat_only == 2
