"""The daemon leaves no zombie children behind, however many sandboxes come
and go.

crabd is a child subreaper (crabd/runtime/sandbox.py): the init of every
sandbox (runc create's child), CRIU's restored trees and runc's stages are
re-parented to it, and each must be reaped by crabd or it stays a zombie
until crabd exits. One scenario: a real daemon creates and destroys many
busybox sandboxes, some with a checkpoint of their processes and a rollback
(CRIU restores), then the daemon's zombie children are counted from /proc.
"""

from __future__ import annotations

import time
from pathlib import Path

from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

SANDBOXES = 80     # plain create + exec + destroy (~1 s each on this loaded 2-core host)
WITH_CRIU = 12     # ... plus these with a process checkpoint and a rollback (a CRIU restore)


def zombie_children(pid: int) -> list[tuple[int, str]]:
    """(pid, comm) of the zombie children of `pid`, every thread's."""
    kids: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids.update(int(x) for x in (task / "children").read_text().split())
        except OSError:
            pass
    out = []
    for k in sorted(kids):
        try:
            stat = Path(f"/proc/{k}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:][:1] == "Z":
            out.append((k, stat[stat.find("(") + 1:stat.rfind(")")]))
    return out


def test_no_zombie_children_after_many_sandboxes(start_daemon):
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    c = d.client()
    assert d.proc is not None
    t0 = time.monotonic()
    for i in range(WITH_CRIU):
        sid = c.create_sandbox("busybox")["id"]
        r = c.exec(sid, "(sleep 1000 >/dev/null 2>&1 &); echo x > /tmp/a")
        assert r["plan"] == "FS_PROC", r
        c.exec(sid, "echo y > /tmp/b")
        back = c.rollback(sid, r["checkpoint"])
        assert back["restored"].startswith("fs+proc"), back
        assert c.exec(sid, "cat /tmp/a")["stdout"] == "x\n"
        c.delete_sandbox(sid)
    for i in range(SANDBOXES):
        sid = c.create_sandbox("busybox")["id"]
        assert c.exec(sid, "echo hi")["stdout"] == "hi\n"
        c.delete_sandbox(sid)
    made = time.monotonic() - t0
    # Reaping is the death watch's periodic work: give it a few rounds.
    try:
        wait_until(lambda: not zombie_children(d.proc.pid), "no zombie children of crabd", 10, interval=0.5)
    except AssertionError:
        z = zombie_children(d.proc.pid)
        names: dict[str, int] = {}
        for _, comm in z:
            names[comm] = names.get(comm, 0) + 1
        raise AssertionError(f"{len(z)} zombie children of crabd after {WITH_CRIU + SANDBOXES} sandboxes "
                             f"({made:.0f} s): {names}") from None
