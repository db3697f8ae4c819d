"""The death watch notices a dead init at once (a pidfd in the event loop,
issue 16), not at its next poll: the safety-net poll is set to 10 minutes
here, so every recovery below can only have been started by the pidfd.
Kinds of death: SIGKILL, an init that exits normally (SIGTERM: crabd-init
exits 0), and an OOM kill, which is also reported (`sandbox.oom_kill`)."""

from __future__ import annotations

import os
import signal

from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")


def _recovered_after(c, sid, since):
    wait_until(lambda: any(e["kind"] == "sandbox.rolled_back" for e in c.events(since=since, sandbox=sid)),
               "automatic recovery (the poll is 10 minutes: only the pidfd can have started it)", 120)
    died = [e for e in c.events(since=since, sandbox=sid) if e["kind"] == "sandbox.died"]
    assert died, "recovered without a sandbox.died event"
    return died[0]


def _last_seq(c, sid):
    return max((e["seq"] for e in c.events(sandbox=sid)), default=0)


def test_deaths_are_noticed_without_the_poll(start_daemon):
    c = start_daemon(env={"CRABD_DEATH_POLL_S": "600"}).client()
    sid = c.create_sandbox("busybox")["id"]
    assert c.exec(sid, "echo kept > /kept")["exit_code"] == 0

    since = _last_seq(c, sid)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    _recovered_after(c, sid, since)
    assert c.exec(sid, "cat /kept")["stdout"] == "kept\n"

    # the recovered sandbox's new init is watched too (armed when it started)
    since = _last_seq(c, sid)
    os.kill(c.sandbox(sid)["pid"], signal.SIGTERM)  # crabd-init exits 0 on SIGTERM
    died = _recovered_after(c, sid, since)
    assert "exited" in died["data"]["reason"], died
    assert c.exec(sid, "cat /kept")["stdout"] == "kept\n"


def test_an_oom_kill_is_reported(start_daemon):
    c = start_daemon(images=("debian-py",)).client()
    sid = c.create_sandbox("debian-py", limits={"memory_bytes": 64 * 2**20})["id"]
    since = _last_seq(c, sid)
    r = c.exec(sid, ["python3", "-c", "x = bytearray(256 * 2**20); print(len(x))"])
    assert r["exit_code"] == 137, r
    wait_until(lambda: any(e["kind"] == "sandbox.oom_kill" for e in c.events(since=since, sandbox=sid)),
               "a sandbox.oom_kill event", 30)
    ev = next(e for e in c.events(since=since, sandbox=sid) if e["kind"] == "sandbox.oom_kill")
    assert ev["data"]["kills"] >= 1 and "memory limit" in ev["data"]["fix"], ev
    assert c.exec(sid, "true")["exit_code"] == 0  # the init was not the one killed: the sandbox goes on


def test_a_death_during_a_capture_is_handled_when_the_capture_ends(start_daemon):
    """The init dies while the turn's capture holds the sandbox (the capture
    is held 3 s in its file-system commit by CRABD_CHAOS=fs_commit): the watch
    must come back to it when the capture ends, not at the 10-minute poll."""
    c = start_daemon(env={"CRABD_DEATH_POLL_S": "600", "CRABD_CHAOS": "fs_commit",
                          "CRABD_CHAOS_SLEEP": "3"}).client()
    sid = c.create_sandbox("busybox")["id"]
    since = _last_seq(c, sid)
    r = c.exec(sid, "echo kept > /kept")  # FS: its capture starts now and is held 3 s
    assert r["plan"] == "FS", r
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    _recovered_after(c, sid, since)
    assert c.exec(sid, "cat /kept")["stdout"] == "kept\n"


def test_a_dead_sandbox_runs_no_turn(start_daemon):
    """With automatic recovery off, an exec into a sandbox whose init died is
    refused before a turn is counted: no turn, no checkpoint of a dead
    sandbox, and the error says how to bring it back."""
    from crabd.errors import SandboxNotRunning
    c = start_daemon(env={"CRABD_AUTO_ROLLBACK": "false"}).client()
    sid = c.create_sandbox("busybox")["id"]
    first = c.exec(sid, "echo kept > /kept")
    since = _last_seq(c, sid)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
    wait_until(lambda: any(e["kind"] == "sandbox.died" for e in c.events(since=since, sandbox=sid)),
               "sandbox.died", 30)
    before = c.sandbox(sid)
    try:
        c.exec(sid, "echo lost > /lost")
    except SandboxNotRunning as e:
        assert "no command ran" in str(e) and "crabd rollback" in str(e.fix), (str(e), e.fix)
    else:
        raise AssertionError("an exec into a dead sandbox ran")
    after = c.sandbox(sid)
    assert after["turn"] == before["turn"] and after["head"] == before["head"] == first["checkpoint"], (before, after)
    c.rollback(sid, first["checkpoint"])
    assert c.exec(sid, "cat /kept")["stdout"] == "kept\n"
