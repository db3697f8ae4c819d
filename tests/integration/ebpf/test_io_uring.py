"""io_uring on the real daemon: every submission, and every write the kernel
does for a ring, belongs to a turn.

A process that set up a ring in an earlier turn can have the kernel write
for it later with no system call of its own: a linked chain (timeout, then
write) submitted once runs its write in task work that interrupts the
process's sleep (which then resumes, like after crabd's own freeze), or in
the ring's iou-sqp thread (SQPOLL), which makes no system call at all. A
turn starts such a worker (bench/oracle_agent.py, kinds `uring-keep` and
`uringsq-keep`) whose write lands D seconds later, around the start turn's
capture (freeze, dump, thaw, re-baseline); one second later the turn `true`
runs. Rolling back to `true`'s checkpoint must give the file as it was live
at that turn's end. Before io_uring activity was traced, the write in the
window after the thaw went unseen and `true` was planned SKIP.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from crabd.client import Client
from crabd.testing import wait_until

AGENT = (Path(__file__).parents[3] / "bench" / "oracle_agent.py").read_text()

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")
LOG = "/work/oracle-bg-u.log"
IMAGE = "debian-py"  # conftest.DEBIAN_IMAGE


def captured(c: Client, sid: str) -> list[dict]:
    def done() -> list[dict] | None:
        cks = c.checkpoints(sid)
        return cks if all(k["state"] in ("committed", "failed") for k in cks) else None
    return wait_until(done, f"settled checkpoints of {sid}", 120, interval=0.05)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def daemon(module_daemon, debian_image):
    return module_daemon(images=(debian_image,))


@pytest.fixture(scope="module")
def proc_daemon(module_daemon, debian_image):
    return module_daemon(images=(debian_image,), env={"CRABD_INSPECTOR": "proc"})


def sandbox(c: Client) -> str:
    sid = c.create_sandbox(IMAGE)["id"]
    r = c.exec(sid, "mkdir -p /work /opt/oracle && cat > /opt/oracle/agent.py", stdin=AGENT)
    assert r["exit_code"] == 0, r["stderr"]
    return sid


def replay(c: Client, kind: str, delay: float) -> None:
    sid = sandbox(c)
    try:
        start = c.exec(sid, ["python3", "/opt/oracle/agent.py", "spawn", "u", kind, str(int(delay * 1000)),
                             "100", "1", LOG])
        t_start = time.monotonic()
        assert start["exit_code"] == 0, start["stderr"]
        assert start["plan"] == "FS_PROC", start["reasons"]
        captured(c, sid)
        time.sleep(max(0.0, t_start + 1 - time.monotonic()))
        turn = c.exec(sid, "true")
        cks = captured(c, sid)
        ck = next(k for k in cks if k["id"] == turn["checkpoint"])
        live = c.exec(sid, f"cat {LOG}")["stdout"]
        assert len(live) == 17, live  # the write was done by now
        c.rollback(sid, ck["id"])
        back = c.exec(sid, f"cat {LOG}")["stdout"]
        assert back == live, (kind, delay, ck["plan"], ck["reasons"], back, live)
    finally:
        c.delete_sandbox(sid)


@pytest.mark.parametrize("kind", ["uring-keep", "uringsq-keep"])
@pytest.mark.parametrize("delay", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_a_write_io_uring_does_after_the_capture_belongs_to_the_next_turn(daemon, kind, delay):
    c = daemon.client()
    assert c.health()["inspector"] == "bpf-cgroup"
    replay(c, kind, delay)


@pytest.mark.parametrize("kind", ["uring-keep", "uringsq-keep"])
def test_the_proc_fallback_sees_it_too(proc_daemon, kind):
    c = proc_daemon.client()
    assert c.health()["inspector"] == "proc"
    replay(c, kind, 0.15)


@pytest.mark.parametrize("op", ["write", "openat", "renameat", "unlinkat"])
def test_a_file_change_through_io_uring_is_not_skipped(daemon, op):
    """A new process's io_uring file op in the turn: the turn saves files."""
    c = daemon.client()
    sid = sandbox(c)
    try:
        assert c.exec(sid, "echo a > /work/f")["exit_code"] == 0
        arg = {"write": "6869", "renameat": "/work/g"}.get(op, "")
        path = "/work/new" if op == "openat" else "/work/f"
        r = c.exec(sid, ["python3", "/opt/oracle/agent.py", "uring", op, path, arg])
        assert r["exit_code"] == 0, r["stderr"]
        assert r["plan"] in ("FS", "FS_PROC"), r["reasons"]
        live = c.exec(sid, "ls /work; cat /work/f 2>/dev/null")["stdout"]
        c.rollback(sid, r["checkpoint"])
        assert c.exec(sid, "ls /work; cat /work/f 2>/dev/null")["stdout"] == live
    finally:
        c.delete_sandbox(sid)
