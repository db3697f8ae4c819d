"""Processes started after a restore come back too (found by the
ground-truth oracle, issue 14).

CRIU restores a sandbox's processes in a time namespace of their own (their
monotonic clocks go on from the dump). runc 1.1 knows nothing of time
namespaces and starts every later `runc exec` in the host's, and CRIU can
dump but never restore a tree that spans two ("Can't restore sub-task in
NS"). crabd's exec wrapper now joins the init's time namespace (init.c,
`--time-ns`, with CAP_SYS_ADMIN for setns only, dropped before the command
runs), so the tree stays one that CRIU restores. Before that, the second
checkpoint had no process image and the second server was lost on recovery.

The dump-time refusal (runtime/process.py, `_check_one_time_ns`) stays as
the net for a tree that still spans two namespaces (a process that entered
another time namespace by itself)."""

from __future__ import annotations

import os
import signal

from crabd.testing import settled_checkpoints, wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")


def _settled(c, sid):
    return settled_checkpoints(c, sid, 240)


def _recover(c, sid):
    since = max((e["seq"] for e in c.events(sandbox=sid)), default=0)
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)  # automatic recovery: a CRIU restore
    wait_until(lambda: any(e["kind"] == "sandbox.rolled_back" for e in c.events(since=since, sandbox=sid)),
               "automatic recovery", 120)
    return since


def _caps(c, sid):
    out = c.exec(sid, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status")["stdout"]
    return out


def test_processes_started_after_a_restore_come_back(start_daemon):
    c = start_daemon().client()
    sid = c.create_sandbox("busybox")["id"]
    caps_before = _caps(c, sid)
    r1 = c.exec(sid, "(sleep 1000 >/dev/null 2>&1 &)")
    assert r1["plan"] == "FS_PROC", r1
    _settled(c, sid)
    _recover(c, sid)
    pid = c.sandbox(sid)["pid"]
    init_ns = os.stat(f"/proc/{pid}/ns/time").st_ino
    assert init_ns != os.stat("/proc/self/ns/time").st_ino, \
        "CRIU restored the init in the host's time namespace: this test no longer covers the bug"

    # A command exec'd now runs in the init's time namespace, with exactly
    # the capabilities it had before the restore (no CAP_SYS_ADMIN left).
    assert _caps(c, sid) == caps_before
    r2 = c.exec(sid, "(sleep 1001 >/dev/null 2>&1 &)")
    assert r2["exit_code"] == 0 and r2["plan"] == "FS_PROC", r2
    _settled(c, sid)
    procs = _same_pid_ns(pid)
    assert len(procs) >= 3, procs  # init and both sleeps
    for p in procs:
        assert os.stat(f"/proc/{p}/ns/time").st_ino == init_ns, f"pid {p} is in another time namespace"
    ck = c.checkpoint(r2["checkpoint"])
    assert ck["state"] == "committed" and ck["fs_snapshot"] and ck["proc_image"], ck

    # Both servers come back from that checkpoint.
    since = _recover(c, sid)
    assert not any(e["kind"] == "checkpoint.proc_failed" for e in c.events(since=since, sandbox=sid))
    ps = c.exec(sid, "ps -o args")["stdout"]
    assert "sleep 1000" in ps and "sleep 1001" in ps, ps


def _same_pid_ns(pid: int) -> list[int]:
    """Host pids of every process in the sandbox's pid namespace."""
    ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}/ns/pid").st_ino == ns:
                    out.append(int(d))
            except OSError:
                pass
    return out
