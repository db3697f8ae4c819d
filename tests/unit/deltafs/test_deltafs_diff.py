"""Unit tests (no root) for tree diffs on in-memory models (deltafs.tree.diff_entries)."""

from __future__ import annotations

from deltafs.tree import Change, Entry, diff_entries


def e(path, kind="file", **kw):
    base = dict(mode=0o644, uid=0, gid=0, size=1, mtime_ns=1)
    base.update(kw)
    return Entry(path=path, kind=kind, **base)


def test_added_modified_deleted_sorted():
    a = {b"": e(b"", "dir"), b"x": e(b"x"), b"y": e(b"y")}
    b = {b"": e(b"", "dir"), b"x": e(b"x", size=5), b"z": e(b"z", size=7)}
    assert diff_entries(a, b) == [
        Change("modified", b"x", "file", 5), Change("deleted", b"y", "file", 1), Change("added", b"z", "file", 7)]


def test_each_attribute_counts():
    base = e(b"f")
    for kw in (dict(mode=0o600), dict(uid=1), dict(gid=2), dict(mtime_ns=2), dict(xattrs=(("user.a", b"1"),))):
        assert diff_entries({b"f": base}, {b"f": e(b"f", **kw)})[0].kind == "modified", kw


def test_symlink_target_and_device_numbers():
    assert diff_entries({b"l": e(b"l", "symlink", target=b"/a")}, {b"l": e(b"l", "symlink", target=b"/b")})
    assert diff_entries({b"c": e(b"c", "char", rdev=1)}, {b"c": e(b"c", "char", rdev=2)})


def test_type_change_is_delete_then_add():
    out = diff_entries({b"p": e(b"p")}, {b"p": e(b"p", "dir", size=0)})
    assert [(c.kind, c.type) for c in out] == [("deleted", "file"), ("added", "dir")]


def test_dir_mtime_alone_is_not_a_change_and_inode_is_ignored():
    a = {b"d": e(b"d", "dir", mtime_ns=1, ino=5)}
    b = {b"d": e(b"d", "dir", mtime_ns=9, ino=6)}
    assert diff_entries(a, b) == []


def test_non_utf8_names_pass_through():
    n = b"bad\xff\nname"
    assert diff_entries({}, {n: e(n)}) == [Change("added", n, "file", 1)]


def test_diff_paths_looks_only_at_candidates_and_what_they_bring(tmp_path):
    """diff_paths (deltafs.tree): a renamed directory brings its subtree in
    and takes its old one out, the other names of a hard-link group come
    along, names on neither side change nothing; the same as a full scan."""
    import os

    from deltafs.tree import diff_paths, scan

    root = tmp_path / "t"
    (root / "dd" / "ee").mkdir(parents=True)
    (root / "dd" / "ee" / "h").write_text("h")
    (root / "a").write_text("a")
    os.link(root / "a", root / "b")
    (root / "untouched").write_text("u")
    old = scan(str(root))
    os.rename(root / "dd", root / "zz")
    with open(root / "a", "a") as f:
        f.write("more")  # b, the other name, changes too
    (root / "untouched").write_text("x")  # not a candidate: not looked at
    changes, new = diff_paths(old, str(root), [b"dd", b"zz", b"a", b"o264-8-0", b""])
    full = diff_entries(old, scan(str(root)))
    assert changes == [c for c in full if c.path != b"untouched"]
    assert {c.path for c in changes} >= {b"dd/ee/h", b"zz/ee/h", b"a", b"b"}
    assert new[b"untouched"] == old[b"untouched"] and b"dd" not in new and b"zz/ee/h" in new
