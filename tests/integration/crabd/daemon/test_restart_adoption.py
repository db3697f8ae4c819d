"""A restart adopts every sandbox in parallel (crabd/daemon/startup.py,
issue 16 item 3): the ones found running are watched again, one found dead
(its init killed while crabd was down) is recovered by a cold FS-only
rollback, the path that drops runc's state with Runtime.reset instead of
Runtime.stop (crabd/daemon/rollback.py). What must hold: each sandbox ends
up running with its own files, and the dead one with its checkpoint's."""

from __future__ import annotations

import os
import signal

import pytest

from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")


def test_restart_adopts_the_live_and_recovers_the_dead(start_daemon):
    d = start_daemon()
    c = d.client()
    sids = [c.create_sandbox("busybox")["id"] for _ in range(3)]
    for i, sid in enumerate(sids):
        assert c.exec(sid, f"echo {i} > /n")["exit_code"] == 0
    wait_until(lambda: not any(x["state"] == "pending" for s in sids for x in c.checkpoints(s, all=True)),
               "durable checkpoints", 120)
    since = c.last_event_seq()
    dead = sids[0]
    pid = c.sandbox(dead)["pid"]
    c.close()
    d.stop()
    os.kill(pid, signal.SIGKILL)  # dies while no crabd watches
    d.start()
    c = d.client()

    def settled():
        evs = c.events(since=since)
        adopted = {e["sandbox_id"] for e in evs if e["kind"] == "sandbox.adopted"}
        rolled = {e["sandbox_id"] for e in evs if e["kind"] == "sandbox.rolled_back"}
        return adopted == set(sids[1:]) and dead in rolled
    wait_until(settled, "adoption of the live sandboxes and recovery of the dead one", 120)
    died = [e for e in c.events(since=since, sandbox=dead) if e["kind"] == "sandbox.died"]
    assert died and "at daemon start" in died[0]["data"]["reason"], died
    back = next(e for e in c.events(since=since, sandbox=dead) if e["kind"] == "sandbox.rolled_back")
    assert back["data"]["restored"] == "fs", back  # standbys do not survive a restart: the cold path
    for i, sid in enumerate(sids):
        assert c.sandbox(sid)["state"] == "running"
        assert c.exec(sid, "cat /n")["stdout"] == f"{i}\n"
