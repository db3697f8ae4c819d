"""Unit tests (no root) for the overlay capture plan (deltafs.overlay.plan_capture) on in-memory manifests."""

from __future__ import annotations

import stat

from deltafs.overlay import plan_capture

F, DIR, CHR = stat.S_IFREG, stat.S_IFDIR, stat.S_IFCHR


def f(ino, ctime=1):
    return [ino, ctime, F, False, None]


def d(ino, children, ctime=1, opaque=False):
    return [ino, ctime, DIR, opaque, children]


def test_nothing_changed_means_no_actions():
    tree = {"a": f(1), "d": d(2, {"x": f(3)})}
    assert plan_capture(tree, tree) == []


def test_new_modified_deleted():
    prev = {"a": f(1), "b": f(2), "gone": f(3)}
    cur = {"a": f(1), "b": f(2, ctime=9), "new": f(4)}
    assert plan_capture(prev, cur) == [("copy", "b", False), ("copy", "new", False), ("whiteout", "gone", False)]


def test_changed_child_pulls_in_its_dir_not_opaque():
    prev = {"d": d(2, {"x": f(3), "y": f(4)})}
    cur = {"d": d(2, {"x": f(3, ctime=5), "y": f(4)})}
    assert plan_capture(prev, cur) == [("dir", "d", False), ("copy", "d/x", False)]


def test_deleted_child_becomes_whiteout_inside_its_dir():
    prev = {"d": d(2, {"x": f(3)})}
    cur = {"d": d(2, {}, ctime=2)}
    assert plan_capture(prev, cur) == [("dir", "d", False), ("whiteout", "d/x", False)]


def test_replaced_dir_is_opaque_and_copied_whole():
    # rm -rf d; mkdir d; touch d/x  -> new inode, same name
    prev = {"d": d(2, {"old": f(3)})}
    cur = {"d": d(7, {"x": f(8), "sub": d(9, {"y": f(10)})})}
    assert plan_capture(prev, cur) == [
        ("dir", "d", True), ("dir", "d/sub", False), ("copy", "d/sub/y", False), ("copy", "d/x", False)]


def test_new_dir_keeps_upper_opacity():
    # A copy-up of a lower dir (not opaque) must keep merging with the chain below.
    cur = {"up": d(5, {"f": f(6)}), "fresh": d(7, {}, opaque=True)}
    assert plan_capture({}, cur) == [("dir", "fresh", True), ("dir", "up", False), ("copy", "up/f", False)]


def test_type_change_file_to_dir_and_whiteout_in_upper():
    prev = {"p": f(1), "q": f(2)}
    cur = {"p": d(1, {"z": f(3)}), "q": [4, 1, CHR, False, None]}  # q deleted over a lower file: whiteout
    assert plan_capture(prev, cur) == [("dir", "p", True), ("copy", "p/z", False), ("copy", "q", False)]


def test_hard_link_creation_touches_both_names():
    # link(2) changes the target inode's ctime, so both names are recaptured as one group.
    prev = {"a": f(1)}
    cur = {"a": f(1, ctime=2), "b": f(1, ctime=2)}
    assert plan_capture(prev, cur) == [("copy", "a", False), ("copy", "b", False)]
