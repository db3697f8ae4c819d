"""A turn's new process can change what older processes own without any of
them running, and without an open in the turn (found by probing the
inspector like an adversary, issue 14): it takes a file description out of
an older process (pidfd_getfd) and writes through it; it removes or uses a
System V IPC object by its id alone (`ipcrm -q ID`: msgctl, no msgget); it
renices an older process (`renice -p`). Each turn must save the processes
(FS_PROC, the reason named), and a rollback to it must give back the state
the turn left. Before the fix each turn was planned SKIP and its rollback
brought back the state of the turn before."""

from __future__ import annotations

import time

from crabd.testing import settled_checkpoints

# Takes fd 3 out of process argv[1] and appends a line through it.
GETFD = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(438, os.pidfd_open(int(sys.argv[1])), 3, 0)  # pidfd_getfd
if fd < 0:
    sys.exit(f"pidfd_getfd: errno {ctypes.get_errno()}")
os.write(fd, b"stolen\n")
'''
HOLDER = "mkdir -p /work; echo first > /work/f; (setsid sleep 3600 3>>/work/f </dev/null >/dev/null 2>&1 &); sleep 0.2"


def _quiet(c, sid):
    """A turn with nothing in it once the last one settled: the older
    processes are in the inspector's baseline."""
    settled_checkpoints(c, sid, 240)
    time.sleep(1.0)
    r = c.exec(sid, "true")
    assert r["plan"] == "SKIP", r  # the sessions below start from a quiet sandbox
    settled_checkpoints(c, sid, 240)


def test_a_file_description_taken_from_an_older_process(start_daemon):
    c = start_daemon(images=("busybox", "debian-py")).client()
    sid = c.create_sandbox("debian-py")["id"]
    assert c.exec(sid, HOLDER)["exit_code"] == 0
    pid = c.exec(sid, "pidof sleep")["stdout"].split()[0]
    assert c.exec(sid, ["sh", "-c", "cat > /opt/getfd.py"], stdin=GETFD)["exit_code"] == 0
    _quiet(c, sid)
    r = c.exec(sid, ["python3", "/opt/getfd.py", pid])
    assert r["exit_code"] == 0, r
    assert r["plan"] == "FS_PROC" and any("pidfd_getfd" in x for x in r["reasons"]), r
    settled_checkpoints(c, sid, 240)
    c.exec(sid, "echo later >> /work/f")
    c.rollback(sid, r["checkpoint"])
    assert c.exec(sid, "cat /work/f")["stdout"] == "first\nstolen\n"


def test_an_ipc_object_removed_by_its_id(start_daemon):
    c = start_daemon(images=("busybox", "debian-py")).client()
    sid = c.create_sandbox("debian-py")["id"]
    made = c.exec(sid, "ipcmk -Q")
    assert made["exit_code"] == 0 and made["plan"] == "FS_PROC", made
    qid = c.exec(sid, "ipcs -q | awk '$2 ~ /^[0-9]+$/ {print $2}'")["stdout"].split()[0]
    _quiet(c, sid)
    r = c.exec(sid, f"ipcrm -q {qid}")
    assert r["exit_code"] == 0, r
    assert r["plan"] == "FS_PROC" and any("IPC" in x for x in r["reasons"]), r
    settled_checkpoints(c, sid, 240)
    c.exec(sid, "ipcmk -Q")
    c.rollback(sid, r["checkpoint"])
    assert c.exec(sid, "ipcs -q | awk '$2 ~ /^[0-9]+$/' | wc -l")["stdout"].strip() == "0"


def test_an_older_process_reniced(start_daemon):
    c = start_daemon(images=("busybox", "debian-py")).client()
    sid = c.create_sandbox("debian-py")["id"]
    assert c.exec(sid, "(setsid sleep 3600 </dev/null >/dev/null 2>&1 &); sleep 0.2")["exit_code"] == 0
    pid = c.exec(sid, "pidof sleep")["stdout"].split()[0]
    _quiet(c, sid)
    r = c.exec(sid, f"renice -n 7 -p {pid}")
    assert r["exit_code"] == 0, r
    assert r["plan"] == "FS_PROC" and any("priority" in x for x in r["reasons"]), r
    settled_checkpoints(c, sid, 240)
    c.exec(sid, f"renice -n 3 -p {pid}")
    c.rollback(sid, r["checkpoint"])
    assert c.exec(sid, "cut -d' ' -f19 /proc/$(pidof sleep)/stat")["stdout"].split() == ["7"]  # nice
