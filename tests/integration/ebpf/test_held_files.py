"""A later turn deletes or renames a file an older process holds.

The older process does not run, and the turn's own change is a plain file
change, so it looked like an FS turn: the checkpoint paired the new snapshot
with the older process image, which names the held file by its old path.
Restoring that image on that snapshot failed ("restored: fs"), and the
processes were lost on every rollback to it. The held paths are part of the
process comparison now (`ebpf._proc.held_files`): such a turn is FS_PROC,
and its rollback brings the process back holding what it held. A write to a
held file stays an FS turn (the snapshot has the content).

A file deleted while a process holds it open has no name left: its content
is only in that process's image. A later turn that writes it again through
/proc/PID/fd/N was planned FS (the path looked like the root file system),
so its rollback brought back the old content. The kernel side now says such
an open landed on a file with no links (inspector.c, fd_fs), and any other
change through /proc/PID/fd/N counts the same: FS_PROC."""

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


# An older process: fd 3 a file deleted while it holds it, fd 4 a memfd, fd 5 a named file.
GHOST_HOLDER = ("mkdir -p /work/g; cd /work/g; echo first > gone; echo named > kept; "
                "(setsid python3 -c 'import os,time; m=os.memfd_create(\"m\"); os.write(m,b\"mem\\n\"); os.dup2(m,4); "
                "os.unlink(\"/work/g/gone\"); print(os.getpid(), file=open(\"/work/gpid\", \"w\"), flush=True); "
                "time.sleep(3600)' 3>>gone 5>>kept </dev/null >/dev/null 2>&1 &); "
                "while [ ! -s /work/gpid ]; do sleep 0.05; done")


def test_a_deleted_file_an_older_process_holds_written_through_proc_fd(daemon):
    c = daemon.client()
    sid = c.create_sandbox("debian-py")["id"]
    try:
        assert c.exec(sid, GHOST_HOLDER)["exit_code"] == 0
        pid = c.exec(sid, "cat /work/gpid")["stdout"].split()[0]
        settled_checkpoints(c, sid, 240)
        time.sleep(1.0)
        assert c.exec(sid, "true")["plan"] == "SKIP"
        ghost = f"/proc/{pid}/fd/3"

        def content(fd: int) -> str:
            return c.exec(sid, f"cat /proc/{pid}/fd/{fd}")["stdout"]

        appended = c.exec(sid, f"echo more >> {ghost}")  # an open through the alias: resolved in the kernel
        assert appended["plan"] == "FS_PROC" and any("held state" in r for r in appended["reasons"]), appended
        truncated = c.exec(sid, f"truncate -s 3 {ghost}")  # a path call through the alias
        assert truncated["plan"] == "FS_PROC", truncated
        assert c.exec(sid, f"echo mem2 >> /proc/{pid}/fd/4")["plan"] == "FS_PROC"  # a memfd: tmpfs
        # no false positive: a named file through the alias, and an unnamed
        # temporary file (O_TMPFILE) of a process that exits, are plain
        named = c.exec(sid, f"echo again >> /proc/{pid}/fd/5")
        assert named["plan"] == "FS", named
        tmp = c.exec(sid, "python3 -c 'import tempfile; f=tempfile.TemporaryFile(dir=\"/work\"); f.write(b\"x\"); f.close()'")
        assert tmp["plan"] == "SKIP", tmp
        settled_checkpoints(c, sid, 240)

        assert c.rollback(sid, appended["checkpoint"])["restored"].startswith("fs+proc")
        assert content(3) == "first\nmore\n"
        assert c.rollback(sid, truncated["checkpoint"])["restored"].startswith("fs+proc")
        assert content(3) == "fir"
        assert content(5) == "named\n"
    finally:
        c.delete_sandbox(sid)
