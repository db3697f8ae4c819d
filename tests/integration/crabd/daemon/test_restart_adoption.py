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


def test_serves_before_the_adoptions_end_and_turns_wait_for_them(start_daemon):
    """`crabd serve` answers a health probe once its state is settled, while
    the sandboxes are still being re-adopted (health's `adopting`), and a turn
    that arrives meanwhile waits for its sandbox's adoption: it runs on a
    watched sandbox, planned as the first turn after a restart is.
    CRABD_CHAOS=adopt holds each adoption for CRABD_CHAOS_SLEEP seconds."""
    from crabd.daemon.plans import BLIND_RESTART
    d = start_daemon(env={"CRABD_INSPECTOR": "proc", "CRABD_CHAOS": "adopt", "CRABD_CHAOS_SLEEP": "4"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    assert c.exec(sid, "echo 1 > /n")["exit_code"] == 0
    wait_until(lambda: not any(x["state"] == "pending" for x in c.checkpoints(sid, all=True)),
               "a durable checkpoint", 120)
    since = c.last_event_seq()
    c.close()
    d.stop()
    d.start(wait_inspector=False, wait_adopted=False)
    c = d.client()
    h = c.health()
    assert h["sandboxes"] == 1 and h["adopting"] == 1, h
    r = c.exec(sid, ["cat", "/n"])
    assert (r["exit_code"], r["stdout"]) == (0, "1\n"), r
    assert any(BLIND_RESTART in x for x in r["reasons"]), r
    kinds = [e["kind"] for e in c.events(since=since, sandbox=sid) if e["kind"] in ("sandbox.adopted", "turn.ended")]
    assert kinds == ["sandbox.adopted", "turn.ended"], kinds   # the turn ran once the adoption had ended
    assert c.health()["adopting"] == 0
