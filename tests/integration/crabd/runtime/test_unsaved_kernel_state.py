"""State a sandbox could change that no checkpoint holds.

Kernel keyrings are not namespaced: a sandbox runs as the host's uid 0, so
`add_key` into its user or session keyring changes the host's root keyring,
outlives every rollback and is shared by every sandbox. CRIU does not save
POSIX message queues. Both are refused inside a sandbox (a seccomp rule:
EPERM for the keyring calls, as Docker's default profile does; ENOSYS for
`mq_open`, so programs take their fallback), instead of being lost silently
on the next rollback. crabd's exec plumbing, a host directory bound at
/dev/.crabd, is read-only inside (its status fifos still take writes): a
file written there landed in the host's state directory, outside every
snapshot and disk limit, and survived rollbacks. New user namespaces are
refused (EPERM; clone3 ENOSYS, so glibc falls back to clone): in one a
process held every capability and mounted file systems, and CRIU could not
dump it, so it was lost on the next rollback (`proc_failed`). Threads,
forks and subprocesses still work. Everything else a sandbox does still works, a
checkpoint with processes still dumps and restores under the filter, and a
restored process keeps it."""

from __future__ import annotations

import pytest

from crabd.testing import settled_checkpoints

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "debian-py")

KEYRING = r'''
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
for name, args in (("add_key", (248, b"user", b"crabd-probe", b"v", 1, -4)),      # KEY_SPEC_USER_KEYRING
                   ("request_key", (249, b"user", b"crabd-probe", None, 0)),
                   ("keyctl", (250, 0, -3, 0))):                                    # GET_KEYRING_ID @s
    r = libc.syscall(*args)
    print(name, r, ctypes.get_errno() if r < 0 else 0)
'''

MQUEUE = r'''
import ctypes
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.restype = ctypes.c_int
r = rt.mq_open(b"/crabd-probe", 0o102, 0o600, None)   # O_CREAT|O_RDWR
print("mq_open", r, ctypes.get_errno() if r < 0 else 0)
'''


@pytest.fixture(scope="module")
def daemon(module_daemon):
    return module_daemon(images=("debian-py",))


@pytest.fixture
def sandbox(daemon):
    """A debian-py sandbox of the module's daemon: (client, sandbox id)."""
    c = daemon.client()
    sid = c.create_sandbox("debian-py")["id"]
    yield c, sid
    c.delete_sandbox(sid)


def _run(c, sid, script):
    assert c.exec(sid, ["sh", "-c", "cat > /opt/probe.py"], stdin=script)["exit_code"] == 0
    r = c.exec(sid, ["python3", "/opt/probe.py"])
    assert r["exit_code"] == 0, r
    return {line.split()[0]: (int(line.split()[1]), int(line.split()[2])) for line in r["stdout"].splitlines()}


def test_kernel_keyrings_and_posix_mqueues_are_refused(sandbox):
    c, sid = sandbox
    keys = _run(c, sid, KEYRING)
    assert keys == {"add_key": (-1, 1), "request_key": (-1, 1), "keyctl": (-1, 1)}, keys
    assert _run(c, sid, MQUEUE) == {"mq_open": (-1, 38)}   # ENOSYS
    made = c.exec(sid, "echo > /dev/mqueue/q")   # a queue made through the file system
    assert made["exit_code"] != 0 and "Read-only" in made["stderr"], made


USERNS = r'''
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
for name, flags in (("unshare-user", 0x10000000), ("unshare-user-mount", 0x10000000 | 0x00020000)):  # NEWUSER, NEWNS
    r = libc.unshare(flags)
    print(name, r, ctypes.get_errno() if r < 0 else 0)
t = threading.Thread(target=lambda: None); t.start(); t.join()   # pthread_create: clone3, then clone
print("thread", 0, 0)
print("subprocess", subprocess.run(["true"]).returncode, 0)
pid = os.fork()
if pid == 0:
    os._exit(0)
print("fork", os.waitpid(pid, 0)[1], 0)
'''


def test_user_namespaces_are_refused_threads_and_forks_work(sandbox):
    c, sid = sandbox
    got = _run(c, sid, USERNS)
    assert got == {"unshare-user": (-1, 1), "unshare-user-mount": (-1, 1), "thread": (0, 0),
                   "subprocess": (0, 0), "fork": (0, 0)}, got
    r = c.exec(sid, "unshare -Urm true")   # util-linux's unshare(1): clone/unshare with CLONE_NEWUSER
    assert r["exit_code"] != 0 and "Operation not permitted" in r["stderr"], r


def test_processes_under_the_filter_dump_and_restore(sandbox):
    c, sid = sandbox
    r = c.exec(sid, "mkdir -p /work; (setsid sh -c 'echo $$ > /work/pid; exec sleep 3600' </dev/null >/dev/null 2>&1 &); sleep 0.2")
    assert r["plan"] == "FS_PROC", r
    ck = settled_checkpoints(c, sid, 240)[-1]
    assert ck["proc_image"], ck
    pid = c.exec(sid, "cat /work/pid")["stdout"].strip()
    c.exec(sid, f"kill {pid}")
    c.rollback(sid, r["checkpoint"])
    assert c.exec(sid, f"grep -E '^(State|Seccomp):' /proc/{pid}/status")["stdout"].split() == \
        ["State:", "S", "(sleeping)", "Seccomp:", "2"]
    assert _run(c, sid, KEYRING)["add_key"] == (-1, 1)


def test_crabds_plumbing_directory_takes_no_files(sandbox):
    c, sid = sandbox
    r = c.exec(sid, "echo leak > /dev/.crabd/leak; mkdir /dev/.crabd/d")
    assert r["exit_code"] != 0 and "Read-only" in r["stderr"], r
    left = c.exec(sid, "ls -A /dev/.crabd")["stdout"].split()
    assert all(n.startswith("exec-") and n.endswith(".fifo") for n in left), left  # (this exec's own fifo)
    assert c.exec(sid, "echo still works")["stdout"] == "still works\n"
