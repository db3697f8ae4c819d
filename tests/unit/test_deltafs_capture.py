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
    tree = {b"a": f(1), b"d": d(2, {b"x": f(3)})}
    assert plan_capture(tree, tree) == []


def test_new_modified_deleted():
    prev = {b"a": f(1), b"b": f(2), b"gone": f(3)}
    cur = {b"a": f(1), b"b": f(2, ctime=9), b"new": f(4)}
    assert plan_capture(prev, cur) == [("copy", b"b", False), ("copy", b"new", False), ("whiteout", b"gone", False)]


def test_changed_child_pulls_in_its_dir_not_opaque():
    prev = {b"d": d(2, {b"x": f(3), b"y": f(4)})}
    cur = {b"d": d(2, {b"x": f(3, ctime=5), b"y": f(4)})}
    assert plan_capture(prev, cur) == [("dir", b"d", False), ("copy", b"d/x", False)]


def test_deleted_child_becomes_whiteout_inside_its_dir():
    prev = {b"d": d(2, {b"x": f(3)})}
    cur = {b"d": d(2, {}, ctime=2)}
    assert plan_capture(prev, cur) == [("dir", b"d", False), ("whiteout", b"d/x", False)]


def test_replaced_dir_is_opaque_and_copied_whole():
    # rm -rf d; mkdir d; touch d/x  -> new inode, same name
    prev = {b"d": d(2, {b"old": f(3)})}
    cur = {b"d": d(7, {b"x": f(8), b"sub": d(9, {b"y": f(10)})})}
    assert plan_capture(prev, cur) == [
        ("dir", b"d", True), ("dir", b"d/sub", False), ("copy", b"d/sub/y", False), ("copy", b"d/x", False)]


def test_new_dir_keeps_upper_opacity():
    # A copy-up of a lower dir (not opaque) must keep merging with the chain below.
    cur = {b"up": d(5, {b"f": f(6)}), b"fresh": d(7, {}, opaque=True)}
    assert plan_capture({}, cur) == [("dir", b"fresh", True), ("dir", b"up", False), ("copy", b"up/f", False)]


def test_type_change_file_to_dir_and_whiteout_in_upper():
    prev = {b"p": f(1), b"q": f(2)}
    cur = {b"p": d(1, {b"z": f(3)}), b"q": [4, 1, CHR, False, None]}  # q deleted over a lower file: whiteout
    assert plan_capture(prev, cur) == [("dir", b"p", True), ("copy", b"p/z", False), ("copy", b"q", False)]


def test_hard_link_creation_touches_both_names():
    # link(2) changes the target inode's ctime, so both names are recaptured as one group.
    prev = {b"a": f(1)}
    cur = {b"a": f(1, ctime=2), b"b": f(1, ctime=2)}
    assert plan_capture(prev, cur) == [("copy", b"a", False), ("copy", b"b", False)]
