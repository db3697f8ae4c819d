"""Issue 14, bug A: crabd killed while a turn's capture runs, then restarted.

The capture of turn 2 never commits (it is discarded at restart). Before the
fix, that failed row stayed the parent of later checkpoints: turn 3 (`ls`,
SKIP) was committed with no file-system snapshot, and a rollback to it, or an
automatic recovery, started the sandbox on an empty root. Now a checkpoint
after a restart saves everything (the inspector did not watch the sandbox
while crabd was down), a failed checkpoint is never a parent, and a rollback
target always holds files.

The kill is aimed with the daemon's chaos hook (CRABD_CHAOS=fs_commit: each
file-system capture announces itself in the log and sleeps there, frozen),
so it always lands inside turn 2's capture."""

from __future__ import annotations

import os
import signal

import pytest

from crabd.errors import FailedPrecondition
from crabd.testing import settled_checkpoints, wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

BIG = 8 * 1024 * 1024
CHECK = "cat /work/t1.txt /work/t2.txt 2>&1; wc -c < /work/big 2>&1"


def _chaos_hits(log, phase: str) -> int:
    try:
        return log.read_text(errors="replace").count(f"crabd-chaos: {phase}")
    except FileNotFoundError:
        return 0


def _settled(c, sid: str) -> list[dict]:
    return settled_checkpoints(c, sid, 240)


def test_rollback_after_a_restart_mid_capture_keeps_the_files(start_daemon):
    d = start_daemon(env={"CRABD_CHAOS": "fs_commit", "CRABD_CHAOS_SLEEP": "4"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    r1 = c.exec(sid, "mkdir -p /work && echo t1 > /work/t1.txt")
    assert r1["exit_code"] == 0 and r1["plan"] == "FS", r1
    r2 = c.exec(sid, f"head -c {BIG} /dev/urandom > /work/big && echo t2 > /work/t2.txt")
    assert r2["exit_code"] == 0, r2
    # turn 1's capture passed the hook once; turn 2's is there now, frozen
    wait_until(lambda: _chaos_hits(d.log, "fs_commit") >= 2, "turn 2's capture at the kill point", 120)
    d.kill9()
    c.close()
    d.env = None  # restart without the hook
    d.start()
    c = d.client()
    failed = next(k for k in c.checkpoints(sid, all=True) if k["id"] == r2["checkpoint"])
    assert failed["state"] == "failed", failed

    r3 = c.exec(sid, "ls /work")
    assert r3["exit_code"] == 0, r3
    # turn 2's files were never saved, and crabd did not watch the sandbox
    # while it was down: this turn's checkpoint saves everything
    assert r3["plan"] == "FS_PROC", r3
    assert any("saving everything" in x for x in r3["reasons"]), r3["reasons"]
    cks = {k["id"]: k for k in _settled(c, sid)}
    ck3 = cks[r3["checkpoint"]]
    assert ck3["state"] == "committed" and ck3["fs_snapshot"], ck3
    assert ck3["parent"] == r1["checkpoint"], ck3  # never the failed row
    for k in cks.values():  # no committed row anywhere names a failed parent or lacks files
        if k["state"] == "committed":
            assert k["fs_snapshot"], k
            if k["parent"]:
                assert cks[k["parent"]]["state"] == "committed", (k, cks[k["parent"]])

    # 1. an explicit rollback to turn 3's checkpoint
    rb = c.rollback(sid, r3["checkpoint"])
    assert rb["checkpoint"] == r3["checkpoint"], rb
    out = c.exec(sid, CHECK)
    assert out["exit_code"] == 0 and out["stdout"].split() == ["t1", "t2", str(BIG)], out

    # 2. automatic recovery after the sandbox's init is killed
    _settled(c, sid)
    before = max((e["seq"] for e in c.events(sandbox=sid)), default=0)
    pid = c.sandbox(sid)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: any(e["kind"] == "sandbox.rolled_back" for e in c.events(since=before, sandbox=sid)),
               "automatic recovery", 120)
    wait_until(lambda: c.sandbox(sid)["status"] == "running", "the recovered sandbox running", 60)
    out = c.exec(sid, CHECK)
    assert out["exit_code"] == 0 and out["stdout"].split() == ["t1", "t2", str(BIG)], out

    # 3. an older checkpoint: turn 1's files only
    c.rollback(sid, r1["checkpoint"])
    out = c.exec(sid, "ls /work")
    assert out["exit_code"] == 0 and out["stdout"].split() == ["t1.txt"], out

    # 4. the discarded checkpoint is no target, with the fix in the message
    with pytest.raises(FailedPrecondition) as e:
        c.rollback(sid, r2["checkpoint"])
    assert "failed" in str(e.value) and "committed" in str(e.value), e.value


def test_a_restart_mid_rollback_never_adopts_a_state_the_head_is_not(start_daemon):
    """crabd killed after a rollback restored its target's files and
    processes but before it recorded the new head: the restart adopted the
    running sandbox, which ran checkpoint 1's state while the store named
    checkpoint 3, and the next turn's SKIP checkpoint claimed 3's files
    (seen 2 of 5 times with the kill at a random moment). A rollback now
    marks the sandbox first, and a restart recovers a marked one to its
    head's line instead of adopting it."""
    d = start_daemon(env={"CRABD_CHAOS": "rollback_restored", "CRABD_CHAOS_SLEEP": "30"})
    c = d.client()
    sid = c.create_sandbox("busybox")["id"]
    r1 = c.exec(sid, "mkdir -p /w; echo one > /w/a; "
                     "(setsid sh -c 'echo $$ > /w/pid; exec sleep 3600' </dev/null >/dev/null 2>&1 &); sleep 0.2")
    c.exec(sid, "echo two > /w/b")
    r3 = c.exec(sid, "kill $(cat /w/pid); echo three > /w/c")
    assert (r1["plan"], r3["plan"]) == ("FS_PROC", "FS_PROC"), (r1, r3)
    _settled(c, sid)
    done: dict[str, object] = {}
    import threading
    t = threading.Thread(target=lambda: done.update(rb=_try(lambda: c.rollback(sid, r1["checkpoint"]))))
    t.start()
    wait_until(lambda: _chaos_hits(d.log, "rollback_restored") >= 1, "the rollback at the kill point", 120)
    d.kill9()
    t.join(30)
    d.env = None
    d.start()
    c = d.client()
    wait_until(lambda: c.sandbox(sid)["status"] == "running" or None, "the sandbox running again", 120)
    state = {r1["checkpoint"]: "one\nalive\n", r3["checkpoint"]: "one\ntwo\nthree\n"}
    check = "cat /w/a /w/b /w/c 2>/dev/null; kill -0 $(cat /w/pid) 2>/dev/null && echo alive"
    head = c.sandbox(sid)["head"]
    assert head == r3["checkpoint"], head  # recovered to its head's line (the rollback never replied)
    after = c.exec(sid, check)
    assert after["stdout"] == state[head], (head, after, [e["kind"] for e in c.events(sandbox=sid)][-8:])
    # ... and the checkpoint of that turn is the same state: roll back to it
    c.exec(sid, "echo four > /w/d")
    _settled(c, sid)
    c.rollback(sid, after["checkpoint"])
    assert c.exec(sid, check)["stdout"] == state[head]
    assert c.rollback(sid, r1["checkpoint"])["restored"].startswith("fs+proc")
    assert c.exec(sid, check)["stdout"] == state[r1["checkpoint"]]
    c.delete_sandbox(sid)


def _try(fn):
    try:
        return fn()
    except FailedPrecondition as e:  # the daemon was killed under the request
        return e
