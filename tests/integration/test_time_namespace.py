"""Processes in two time namespaces: a dump crabd knows it cannot restore
is refused at capture time, with the reason (found by the ground-truth
oracle, issue 14).

CRIU restores processes in a time namespace of their own; runc 1.1 starts a
command exec'd later in the host's (it does not join time namespaces, and
running runc itself in the sandbox's time namespace makes it misread the
init's start time and call the container stopped). Before this check, CRIU
dumped such a tree, every later restore failed ("Can't restore sub-task in
NS") and crabd fell back to a fresh init: the loss showed only at restore
time. Now the checkpoint keeps its files and says why it has no process
image, and recovery prefers an older complete checkpoint."""

from __future__ import annotations

import os
import signal

from crabd.testing import settled_checkpoints, wait_until

def _settled(c, sid):
    return settled_checkpoints(c, sid, 240)

def test_processes_started_after_a_restore_come_back(start_daemon):
    c = start_daemon().client()
    sid = c.create_sandbox("busybox")["id"]
    r1 = c.exec(sid, "(sleep 1000 >/dev/null 2>&1 &)")
    assert r1["plan"] == "FS_PROC", r1
    _settled(c, sid)
    since = max((e["seq"] for e in c.events(sandbox=sid)), default=0)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)  # automatic recovery: a CRIU restore
    wait_until(lambda: any(e["kind"] == "sandbox.rolled_back" for e in c.events(since=since, sandbox=sid)),
               "automatic recovery", 120)
    pid = c.sandbox(sid)["pid"]
    assert os.stat(f"/proc/{pid}/ns/time").st_ino != os.stat("/proc/self/ns/time").st_ino, \
        "CRIU restored the init in the host's time namespace: this test no longer covers the bug"
    r2 = c.exec(sid, "(sleep 1001 >/dev/null 2>&1 &)")
    assert r2["exit_code"] == 0 and r2["plan"] == "FS_PROC", r2
    _settled(c, sid)
    ck = c.checkpoint(r2["checkpoint"])
    assert ck["state"] == "committed" and ck["fs_snapshot"], ck
    assert not ck["proc_image"], ck
    assert any("time namespaces" in x for x in ck["reasons"]), ck["reasons"]
    assert any(e["kind"] == "checkpoint.proc_failed" and "time namespaces" in e["data"]["error"]
               for e in c.events(since=since, sandbox=sid))
