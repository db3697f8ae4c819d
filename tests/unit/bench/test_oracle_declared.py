"""Losses crabd declares in a checkpoint's reasons are not false negatives of
the oracle (bench/oracle.py): the events waiting in an inotify instance,
which CRIU does not restore. Only that difference is taken out, only where
the checkpoint whose process image is restored declares it."""

from __future__ import annotations

from bench.oracle import Outcome, _undeclared_inotify, inotify_declared
from crabd.oracle import Difference

WAITING = "not restored: inotify events waiting for 2023 'ow-w11': a restore gives back the instance and its watches"
T = {"3": "file pos=0 flags=02100002", "13": "anon_inode:inotify pos=0 flags=04000 queued=64"}
R = {"3": "file pos=0 flags=02100002", "13": "anon_inode:inotify pos=0 flags=04000 queued=0"}


def test_declared_on_the_dump_and_the_checkpoints_sharing_its_image():
    cks = [{"id": "a", "parent": None, "proc_image": "i1", "reasons": []},
           {"id": "b", "parent": "a", "proc_image": "i2", "reasons": ["x", WAITING]},
           {"id": "c", "parent": "b", "proc_image": "i2", "reasons": ["no recovery-relevant OS effect seen"]},
           {"id": "d", "parent": "c", "proc_image": "i3", "reasons": ["a later dump, nothing declared"]},
           {"id": "e", "parent": "b", "proc_image": None, "reasons": []}]
    assert inotify_declared(cks) == {"b", "c"}


def test_only_the_inotify_queue_is_taken_out():
    out = Outcome()
    lost = Difference("process", "15", "fds", T, R)
    assert _undeclared_inotify([lost], out) == []
    assert out.not_compared == {"inotify_events_declared_lost": 1}
    # anything else in the same table, or elsewhere, is still a difference
    other_fd = Difference("process", "15", "fds", T, {**R, "3": "file pos=7 flags=02100002"})
    grew = Difference("process", "15", "fds", T, {**R, "13": "anon_inode:inotify pos=0 flags=04000 queued=8"})
    gone = Difference("process", "15", "fds", T, {"3": T["3"]})
    file = Difference("file", "/:work/f0", "content", "a", "b")
    assert _undeclared_inotify([other_fd, grew, gone, file], Outcome()) == [other_fd, grew, gone, file]
