"""Writes whose path does not say where they land: the BPF inspector reads,
at the open's exit, the file system the new fd's file is on (kernel struct
offsets from the running kernel's BTF, ebpf/_btf.py), so a relative write
into /proc counts as kernel state (FS_PROC) like an absolute one.

`cd /proc/PID && echo 500 > oom_score_adj` was planned FS before (issue 14:
relative paths, dirfds and symlinks hide the mount a write landed on), and
a rollback gave the process back its old oom_score_adj. The second case is
the dedup key: the same relative name, first in a plain directory, then in
/proc, from one shell in one turn, was recorded once (as a rootfs write)."""

from __future__ import annotations

from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")


def _settled(c, sid):
    wait_until(lambda: all(k["state"] != "pending" for k in c.checkpoints(sid, all=True)) or None,
               f"settled checkpoints of {sid}", 180)


CASES = {
    "relative": "cd /proc/$(cat /work/pid) && echo {v} > oom_score_adj",
    "same-name-twice": "mkdir -p /work/d && cd /work/d && echo 0 > oom_score_adj && "
                       "cd /proc/$(cat /work/pid) && echo {v} > oom_score_adj",
    "symlink": "ln -sfn /proc/$(cat /work/pid) /work/p && echo {v} > /work/p/oom_score_adj",
}


def test_relative_writes_into_proc_are_process_state(start_daemon):
    c = start_daemon().client()
    health = c.health()
    assert str(health.get("inspector", "")).startswith("bpf"), health
    wrong = []
    for case, cmd in CASES.items():
        sid = c.create_sandbox("busybox")["id"]
        try:
            r0 = c.exec(sid, "mkdir -p /work && (sleep 1000 >/dev/null 2>&1 & echo $! > /work/pid)")
            assert r0["exit_code"] == 0, r0
            r = c.exec(sid, cmd.format(v=500))
            assert r["exit_code"] == 0, r
            if r["plan"] != "FS_PROC" or not any("kernel" in x for x in r["reasons"]):
                wrong.append(f"{case}: planned {r['plan']}: {r['reasons']}")
                continue
            c.exec(sid, cmd.format(v=0))
            _settled(c, sid)
            rb = c.rollback(sid, r["checkpoint"])
            back = c.exec(sid, "cat /proc/$(pidof sleep)/oom_score_adj")
            if back["stdout"].strip() != "500":
                kinds = [(e["kind"], e.get("data")) for e in c.events(sandbox=sid)[-6:]]
                wrong.append(f"{case}: after a rollback oom_score_adj is {back!r}, not 500; rollback: {rb}; "
                             f"events: {kinds}")
        finally:
            c.delete_sandbox(sid)
    assert not wrong, "\n".join(wrong)


def test_inode_flags_set_by_ioctl_are_a_file_change(start_daemon):
    """`chattr +A` opens the file read-only and sets its flags by ioctl
    (FS_IOC_SETFLAGS): no traced call named a change, the turn was SKIP, and
    a rollback to it gave the file its old flags. The ioctl is traced now."""
    c = start_daemon(images=("debian-py",)).client()
    sid = c.create_sandbox("debian-py")["id"]
    try:
        assert c.exec(sid, "mkdir -p /work && echo a > /work/a")["exit_code"] == 0
        _settled(c, sid)
        r = c.exec(sid, "chattr +A /work/a")
        assert r["exit_code"] == 0 and r["plan"] == "FS" and any("attr 1" in x for x in r["reasons"]), r
        c.exec(sid, "chattr -A /work/a && echo b > /work/b")
        _settled(c, sid)
        c.rollback(sid, r["checkpoint"])
        assert c.exec(sid, "lsattr /work/a")["stdout"].split()[0].count("A") == 1
        # on a tmpfs: process state, and a restore keeps the file, not its
        # flags (CRIU's tmpfs copy): said in the plan, not silent
        shm = c.exec(sid, "echo s > /dev/shm/s && chattr +A /dev/shm/s")
        assert shm["exit_code"] == 0 and shm["plan"] == "FS_PROC", shm
        assert any(x.startswith("not restored: inode flags set on a memory file system") for x in shm["reasons"]), shm
    finally:
        c.delete_sandbox(sid)
