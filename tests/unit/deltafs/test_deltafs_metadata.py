"""Unit tests (no root) for the SQLite metadata store and name rules."""

from __future__ import annotations

import pytest

from deltafs.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from deltafs.metadata import Metadata
from deltafs.snapshotter import _check_name


def test_insert_get_children_and_unique_names(tmp_path):
    m = Metadata(str(tmp_path / "m.db"))
    with m.tx():
        a = m.insert("img", "committed", None)
        b = m.insert("sb", "active", a.id, {"turn": "1"}, {"lowers": ["l/1"]})
    assert m.get("sb").extra == {"lowers": ["l/1"]} and m.get("sb").labels == {"turn": "1"}
    assert [r.name for r in m.children(a.id)] == ["sb"]
    with pytest.raises(AlreadyExists):
        with m.tx():
            m.insert("sb", "active", None)
    with pytest.raises(NotFound):
        m.get("nope")
    assert b.id > a.id


def test_failed_transaction_leaves_no_row(tmp_path):
    m = Metadata(str(tmp_path / "m.db"))
    with pytest.raises(RuntimeError):
        with m.tx():
            m.insert("x", "active", None)
            raise RuntimeError("disk step failed")
    assert m.find("x") is None


def test_schema_version_mismatch_fails_fast(tmp_path):
    p = str(tmp_path / "m.db")
    m = Metadata(p)
    with m.tx():
        m.set_meta("schema_version", "99")
    m.close()
    with pytest.raises(FailedPrecondition, match="schema version 99"):
        Metadata(p)


@pytest.mark.parametrize("bad", ["", "-x", "a/b", "a b", "x" * 300, "é"])
def test_bad_names(bad):
    with pytest.raises(InvalidArgument):
        _check_name(bad)


def test_good_names():
    for n in ("sb1", "sb1@12", "debian-12", "img:latest", "a.b_c+d=e"):
        _check_name(n)
