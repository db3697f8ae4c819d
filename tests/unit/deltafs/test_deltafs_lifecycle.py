"""Unit tests (no root, no mounts) of the lifecycle rules every driver shares, on
deltafs.testing.FakeSnapshotter (plain directory copies)."""

from __future__ import annotations

import os

import pytest

from deltafs.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from deltafs.testing import FakeSnapshotter


@pytest.fixture
def s(tmp_path):
    snap = FakeSnapshotter(str(tmp_path / "state"))
    yield snap
    snap.close()


def root(s, key):
    return s.mounts(key)[0].source


def write(path, data):
    with open(path, "w") as f:
        f.write(data)


def test_checkpoint_rollback_fork(s):
    s.prepare("sb")
    write(f"{root(s, 'sb')}/f", "1")
    n1 = s.checkpoint("sb")
    write(f"{root(s, 'sb')}/f", "2")
    n2 = s.checkpoint("sb")
    assert s.stat("sb").parent == n2 and s.stat(n2).parent == n1
    s.prepare("fork", parent=n1)
    assert open(f"{root(s, 'fork')}/f").read() == "1"
    assert [(c.kind, c.path) for c in s.diff(n1, n2)] == [("modified", b"f")]


def test_errors_are_categorised(s):
    s.prepare("a")
    with pytest.raises(AlreadyExists):
        s.prepare("a")
    with pytest.raises(NotFound):
        s.prepare("b", parent="nope")
    with pytest.raises(InvalidArgument):
        s.prepare("b", parent="a")
    n = s.checkpoint("a")
    with pytest.raises(FailedPrecondition, match="parent of a"):
        s.remove(n)
    with pytest.raises(FailedPrecondition):
        s.commit("x", n)


def test_commit_consumes_the_active_and_gc_finds_nothing(s):
    s.prepare("imp")
    write(f"{root(s, 'imp')}/etc", "x")
    s.commit("img", "imp")
    assert [(i.name, i.kind) for i in s.walk()] == [("img", "committed")]
    assert s.gc() == []
    os.mkdir(os.path.join(s.state_dir, "d", "999"))  # a crash leftover
    assert s.gc() == ["999"]


def test_default_checkpoint_names_are_unique_and_ordered(s):
    s.prepare("sb")
    names = [s.checkpoint("sb") for _ in range(3)]
    assert len(set(names)) == 3 and all(n.startswith("sb@") for n in names)
    assert [i.name for i in s.walk() if i.kind == "committed"] == names


def test_driver_is_recorded(tmp_path):
    a = FakeSnapshotter(str(tmp_path / "st"))
    a.close()
    import deltafs
    with pytest.raises(FailedPrecondition, match="holds fake snapshots"):
        deltafs.open(str(tmp_path / "st"), driver="overlay")
