"""Issue 14, bug B, replayed on the real daemon: work a sandbox process does
right after crabd's own pause (freeze, CRIU dump, thaw) of the previous
turn's capture belongs to the next turn.

A turn starts a double-forked child that sleeps D seconds, draws a random
token, keeps it in memory (it writes it to /work/mem.txt only on SIGUSR1)
and writes it to /work/late.txt, then sleeps for an hour. One second later
the turn `true` runs. For D around the capture's freeze and re-baseline,
the child's write lands after the thaw; the `true` turn must then capture
it: not SKIP, and rolling back to its checkpoint gives back the file and a
child that holds the same token in memory. (A child restored from before
the write has no SIGUSR1 handler yet and dies of the signal, or writes a
new token: either way the check fails.)
"""

from __future__ import annotations

import time

import pytest

from crabd.client import Client
from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

CHILD = r"""
import os, secrets, signal, sys, time
delay = float(sys.argv[1])
if os.fork() == 0:
    os.setsid()
    pid = os.fork()
    if pid:
        with open("/work/child.pid", "w") as f:
            f.write(str(pid))
        os._exit(0)
    fd = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    time.sleep(delay)
    token = secrets.token_hex(16)
    def show(*_):
        with open("/work/mem.txt", "w") as f:
            f.write(token)
    signal.signal(signal.SIGUSR1, show)
    with open("/work/late.txt", "w") as f:
        f.write(token)
    while True:
        time.sleep(3600)
os.wait()
"""


def captured(c: Client, sid: str) -> list[dict]:
    def done() -> list[dict] | None:
        cks = c.checkpoints(sid)
        return cks if all(k["state"] == "committed" for k in cks) else None
    return wait_until(done, f"committed checkpoints of {sid}", 120, interval=0.05)  # type: ignore[return-value]


def _daemon(runtime, debian_image, env=None):
    import tempfile
    from pathlib import Path

    from crabd.runtime import Runtime
    from crabd.testing import DaemonHandle, cleanup_state_dir

    state = Path(tempfile.mkdtemp(prefix="crabd-pause-", dir="/var/tmp"))
    Runtime(state).images.import_path(runtime.images.get(debian_image).path, "debian-py")
    d = DaemonHandle(state, env=env)
    d.start()
    yield d
    try:
        d.shutdown()
    finally:
        cleanup_state_dir(state)


@pytest.fixture(scope="module")
def daemon(runtime, debian_image):
    yield from _daemon(runtime, debian_image)


@pytest.fixture(scope="module")
def proc_daemon(runtime, debian_image):
    yield from _daemon(runtime, debian_image, env={"CRABD_INSPECTOR": "proc"})


def replay(c: Client, delay: float) -> None:
    sid = c.create_sandbox("debian-py")["id"]
    try:
        assert c.exec(sid, "mkdir -p /work && cat > /work/child.py", stdin=CHILD)["exit_code"] == 0
        start = c.exec(sid, ["python3", "/work/child.py", str(delay)])
        t_start = time.monotonic()
        assert start["exit_code"] == 0, start["stderr"]
        # the next turn one second later, its parent committed by then (a
        # pending parent would make it save everything, hiding the plan)
        captured(c, sid)
        time.sleep(max(0.0, t_start + 1 - time.monotonic()))
        turn = c.exec(sid, "true")
        cks = captured(c, sid)
        ck = next(k for k in cks if k["id"] == turn["checkpoint"])
        token = c.exec(sid, "cat /work/late.txt")["stdout"]
        assert len(token) == 32, token
        # SKIP is right only when the write came before the start turn's
        # freeze (its checkpoint then holds it): the rollback decides
        why = (delay, ck["plan"], ck["reasons"])

        c.rollback(sid, ck["id"])
        r = c.exec(sid, "cat /work/late.txt; echo; kill -USR1 $(cat /work/child.pid) && "
                        "for i in $(seq 100); do [ -s /work/mem.txt ] && break; sleep 0.05; done; cat /work/mem.txt")
        late, _, mem = r["stdout"].partition("\n")
        assert late == token, (*why, late, token, r["stderr"])
        assert mem == token, (*why, mem, token, r["stderr"])
    finally:
        c.delete_sandbox(sid)


@pytest.mark.parametrize("delay", [0.02, 0.05, 0.1, 0.15, 0.25, 0.4])
def test_a_write_right_after_the_capture_belongs_to_the_next_turn(daemon, delay):
    c = daemon.client()
    assert c.health()["inspector"] == "bpf-cgroup"
    replay(c, delay)


@pytest.mark.parametrize("delay", [0.15, 0.25])
def test_the_proc_fallback_is_as_conservative(proc_daemon, delay):
    """Without BPF, a process that ran after the thaw is active unless /proc
    shows it only resumed an interrupted sleep."""
    c = proc_daemon.client()
    assert c.health()["inspector"] == "proc"
    replay(c, delay)


IDLE_SERVER = r"""
import asyncio, os
async def main():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 8000)
    await server.serve_forever()
if os.fork() == 0:
    os.setsid()
    fd = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    asyncio.run(main())
"""


def test_an_idle_event_loop_server_is_not_dumped_every_turn(daemon):
    """The cost side: an asyncio server blocked in epoll_wait is woken by
    every pause (EINTR, then the same call again), which is no work."""
    c = daemon.client()
    sid = c.create_sandbox("debian-py")["id"]
    try:
        assert c.exec(sid, "mkdir -p /work && cat > /work/server.py", stdin=IDLE_SERVER)["exit_code"] == 0
        first = c.exec(sid, "python3 /work/server.py")
        assert first["plan"] == "FS_PROC", first["reasons"]
        plans = []
        for _ in range(3):
            captured(c, sid)
            plans.append(c.exec(sid, "cat /etc/hostname")["plan"])
        assert "FS_PROC" not in plans, [k["reasons"] for k in c.checkpoints(sid)[-3:]]
    finally:
        c.delete_sandbox(sid)
