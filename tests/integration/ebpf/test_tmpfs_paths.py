"""Issue 14, bug C: a write to a sandbox's tmpfs (/dev/shm, /dev) lives only
in memory, so only a process checkpoint keeps it: the turn must be FS_PROC
and a rollback to its checkpoint must bring the file back, whatever path the
write went through (relative to the cwd, through a symlink, through an fd,
relative to a directory fd, through a shared mapping of a process that has
exited). A plain relative
write to the root file system stays FS.

Each case: one sandbox; a setup turn (if any); the turn under test, whose
plan is checked; a turn that removes the file; then a rollback to the
checkpoint of the turn under test must show the file with its content.
"""

from __future__ import annotations

from crabd.client import Client
from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

MMAP_WRITE = (
    "import mmap, os; fd = os.open('m', os.O_RDWR); m = mmap.mmap(fd, 4096, mmap.MAP_SHARED); "
    "m[:5] = b'mmap!'; m.close(); os.close(fd)"
)

AT_WRITE = (
    "import os; d = os.open('/dev/shm', os.O_RDONLY | os.O_DIRECTORY); "
    "f = os.open('at.txt', os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=d); os.write(f, b'at!'); os.close(f)"
)

# id: (image, setup commands, command under test, expected plan, file, its content)
CASES = {
    "relative": ("busybox", [], "cd /dev/shm && echo hello > rel.txt", "FS_PROC", "/dev/shm/rel.txt", "hello\n"),
    "relative-subdir": ("busybox", [], "cd /dev && echo hi > shm/dd.txt", "FS_PROC", "/dev/shm/dd.txt", "hi\n"),
    "symlink": ("busybox", [], "mkdir -p /work && ln -s /dev/shm /work/shm; echo x > /work/shm/via-link.txt",
                "FS_PROC", "/dev/shm/via-link.txt", "x\n"),
    "fd": ("busybox", [], "cd /dev/shm && exec 3<>fd.txt && echo viafd >&3", "FS_PROC", "/dev/shm/fd.txt", "viafd\n"),
    "dev-tmpfs": ("busybox", [], "cd / && echo indev > dev/mine.txt", "FS_PROC", "/dev/mine.txt", "indev\n"),
    "mmap": ("debian-py", ["head -c 4096 /dev/zero > /dev/shm/m"], f'cd /dev/shm && python3 -c "{MMAP_WRITE}"',
             "FS_PROC", "/dev/shm/m", "mmap!"),
    "dirfd": ("debian-py", [], f'python3 -c "{AT_WRITE}"', "FS_PROC", "/dev/shm/at.txt", "at!"),
    "rootfs-relative": ("busybox", [], "mkdir -p /work && cd /work && echo x > rel.txt", "FS", "/work/rel.txt", "x\n"),
}


def _captured(c: Client, sid: str) -> None:
    wait_until(lambda: all(k["state"] == "committed" for k in c.checkpoints(sid)) or None,
               f"committed checkpoints of {sid}", 120, interval=0.05)


def _check(c: Client, image: str, setup: list[str], cmd: str, plan: str, path: str, content: str) -> list[str]:
    """What went wrong with one case (nothing when it holds)."""
    wrong = []
    sid = c.create_sandbox(image)["id"]
    try:
        for s in setup:
            assert c.exec(sid, s)["exit_code"] == 0
        r = c.exec(sid, cmd)
        assert r["exit_code"] == 0, r["stderr"]
        if r["plan"] != plan:
            wrong.append(f"planned {r['plan']}, expected {plan}: {r['reasons']}")
        c.exec(sid, f"rm -f {path}")
        _captured(c, sid)
        c.rollback(sid, r["checkpoint"])
        back = c.exec(sid, f"head -c {len(content)} {path}")
        if (back["exit_code"], back["stdout"]) != (0, content):
            wrong.append(f"after a rollback to its checkpoint: {back['stdout']!r} {back['stderr']!r}")
        return wrong
    finally:
        c.delete_sandbox(sid)


def test_tmpfs_writes_are_planned_and_rolled_back(start_daemon):
    c = start_daemon(images=("busybox", "debian-py")).client()
    failed = {case: why for case, args in CASES.items() if (why := _check(c, *args))}
    assert not failed, "\n".join(f"{case}: {'; '.join(why)}" for case, why in failed.items())


def test_crabds_own_paths_and_reads_leave_a_turn_skip(start_daemon):
    """The exec status fifos under /dev/.crabd, the bind-mounted init, and
    reading /dev and /dev/shm do not count as tmpfs changes."""
    c = start_daemon().client()
    sid = c.create_sandbox("busybox")["id"]
    try:
        c.exec(sid, "echo keep > /dev/shm/k")
        plans = [c.exec(sid, cmd)["plan"] for cmd in ("ls -la /dev /dev/shm", "cat /dev/shm/k", "true")]
        assert plans == ["SKIP"] * 3, [k["reasons"] for k in c.checkpoints(sid)[-3:]]
    finally:
        c.delete_sandbox(sid)


XATTRS = (
    "import os; p = '/dev/shm/x.txt'; open(p, 'w').write('x'); "
    "os.setxattr(p, 'user.small', b'1'); os.setxattr(p, 'user.big', b'b' * 3000); "
    "os.setxattr('/dev/shm', 'user.dir', b'd')"
)
READ_XATTRS = (
    "import os, json; print(json.dumps({p: {k: os.getxattr(p, k).decode() for k in sorted(os.listxattr(p))} "
    "for p in ('/dev/shm/x.txt', '/dev/shm')}, sort_keys=True))"
)


def test_tmpfs_xattrs_come_back(start_daemon):
    """Extended attributes of files on a tmpfs are kept by a process
    checkpoint (CRIU's tmpfs dump is a tar without --xattrs; deltacr's
    wrapper adds them). Found by the ground-truth oracle."""
    c = start_daemon(images=("debian-py",)).client()
    sid = c.create_sandbox("debian-py")["id"]
    try:
        r = c.exec(sid, ["python3", "-c", XATTRS])
        assert r["exit_code"] == 0 and r["plan"] == "FS_PROC", r
        want = c.exec(sid, ["python3", "-c", READ_XATTRS])["stdout"]
        assert "user.big" in want and "user.dir" in want, want
        c.exec(sid, "rm -f /dev/shm/x.txt")
        _captured(c, sid)
        c.rollback(sid, r["checkpoint"])
        assert c.exec(sid, ["python3", "-c", READ_XATTRS])["stdout"] == want
    finally:
        c.delete_sandbox(sid)
