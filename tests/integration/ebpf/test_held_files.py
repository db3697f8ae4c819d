"""A later turn deletes or renames a file an older process holds.

The older process does not run, and the turn's own change is a plain file
change, so it looked like an FS turn: the checkpoint paired the new snapshot
with the older process image, which names the held file by its old path.
Restoring that image on that snapshot failed ("restored: fs"), and the
processes were lost on every rollback to it. The held paths are part of the
process comparison now (`ebpf._proc.held_files`): such a turn is FS_PROC,
and its rollback brings the process back holding what it held. A write to a
held file stays an FS turn (the snapshot has the content)."""

from __future__ import annotations

import time

import pytest

from crabd.testing import settled_checkpoints

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "debian-py")

# An older process: fd 3 holds /work/d/f, its cwd is /work/d, and it maps /work/d/m.
HOLDER = ("mkdir -p /work/d; cd /work/d; echo first > f; head -c 8192 /dev/zero > m; "
          "(setsid python3 -c 'import mmap,time,os; f=open(\"m\",\"r+b\"); mm=mmap.mmap(f.fileno(),0); f.close(); "
          "print(os.getpid(), file=open(\"/work/pid\", \"w\"), flush=True); time.sleep(3600)' 3>>f </dev/null >/dev/null 2>&1 &); "
          "while [ ! -s /work/pid ]; do sleep 0.05; done")


@pytest.fixture(scope="module")
def daemon(module_daemon):
    return module_daemon(images=("debian-py",))


def _holder(c):
    sid = c.create_sandbox("debian-py")["id"]
    assert c.exec(sid, HOLDER)["exit_code"] == 0
    pid = c.exec(sid, "cat /work/pid")["stdout"].split()[0]
    settled_checkpoints(c, sid, 240)
    time.sleep(1.0)
    assert c.exec(sid, "true")["plan"] == "SKIP"  # the holder is in the baseline, quiet
    settled_checkpoints(c, sid, 240)
    return sid, pid


def _held(c, sid, pid):
    return c.exec(sid, f"readlink /proc/{pid}/fd/3 /proc/{pid}/cwd; grep -c /work/ /proc/{pid}/maps")["stdout"].split()


@pytest.mark.parametrize("change", ["rm /work/d/f", "mv /work/d/f /work/g", "mv /work/d /work/e", "rm /work/d/m"])
def test_a_held_file_deleted_or_renamed_saves_the_holder(daemon, change):
    c = daemon.client()
    sid, pid = _holder(c)
    try:
        r = c.exec(sid, change)
        assert r["exit_code"] == 0 and r["plan"] == "FS_PROC", r
        assert any("older process" in x for x in r["reasons"]), r
        want = _held(c, sid, pid)
        settled_checkpoints(c, sid, 240)
        c.exec(sid, f"kill {pid}")
        rb = c.rollback(sid, r["checkpoint"])
        assert rb["restored"].startswith("fs+proc"), rb  # (a promotion says "(hot standby)")
        assert _held(c, sid, pid) == want
    finally:
        c.delete_sandbox(sid)


def test_a_write_to_a_held_file_stays_a_file_turn(daemon):
    c = daemon.client()
    sid, pid = _holder(c)
    try:
        r = c.exec(sid, "echo more >> /work/d/f")
        assert r["plan"] == "FS", r
        settled_checkpoints(c, sid, 240)
        c.exec(sid, "echo later >> /work/d/f")
        rb = c.rollback(sid, r["checkpoint"])
        assert rb["restored"].startswith("fs+proc"), rb  # (a promotion says "(hot standby)")
        assert c.exec(sid, "cat /work/d/f")["stdout"] == "first\nmore\n"
        assert c.exec(sid, f"readlink /proc/{pid}/fd/3")["stdout"] == "/work/d/f\n"
    finally:
        c.delete_sandbox(sid)
