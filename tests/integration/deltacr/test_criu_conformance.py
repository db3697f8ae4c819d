"""Process state that CRIU's own zdtm tests set up, checkpointed and rolled
back through crabd: one scenario per test, each a small Python program run
in a `debian-py` sandbox (the zdtm suite itself is built elsewhere).

Each scenario: a turn starts the program (it daemonizes: fork, setsid,
output to the sandbox's /dev/null), a `true` turn is checkpointed with its
processes (capture mode full), a turn kills the program, a rollback to the
`true` turn's checkpoint restores it, and the restored program checks its
own state when /tmp/go appears and writes the verdict to /tmp/result.

What each test caught before its fix (issue 15):
- stdin: exec handed commands the host's /dev/null, which a daemonized
  child kept ("Can't lookup mount ... for fd=0 path=/dev/null");
- tcp: "Connected TCP socket, consider using --tcp-established";
- accept queue: "In-flight connection (l) ... can be ignored with the
  --skip-in-flight option": the whole dump was refused for one connection a
  server had not accept()ed yet; now that connection alone is left out
  (its client sees a reset, as after a server restart) and the checkpoint's
  reasons say so;
- udp: restored into a network namespace with `lo` down ("Can't connect
  inet socket back: Network is unreachable");
- locks, lease: "Some file locks are hold by dumping tasks!";
- other user: "Can't get rlimit 0: Operation not permitted" (no
  CAP_SYS_RESOURCE on these hosts);
- stopped: the dump hung 120 s and left the sandbox FROZEN. CRIU cannot
  seize a stopped task in a frozen v1 freezer cgroup (see
  crabd.runtime.criu.STOPPED_TASK_LIMIT); crabd now freezes such a sandbox
  through its cgroup in the unified (v2) hierarchy and has CRIU do the
  same, and the task round-trips stopped. The last test here checks the v2
  freezer with CRIU itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from crabd.testing import settled_checkpoint, wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

# Daemonize; stdin too goes to the sandbox's /dev/null unless KEEP_STDIN.
PROLOGUE = r'''
import fcntl, os, resource, socket, sys, time
if os.fork():
    os._exit(0)
os.setsid()
null = os.open("/dev/null", os.O_RDWR)
for fd in ((1, 2) if os.environ.get("KEEP_STDIN") else (0, 1, 2)):
    os.dup2(null, fd)
open("/tmp/pid", "w").write(str(os.getpid()))
'''

# Wait for /tmp/go, run check() (from the scenario), write its verdict.
EPILOGUE = r'''
open("/tmp/ready", "w").close()
while True:
    time.sleep(0.05)
    if os.path.exists("/tmp/go"):
        try:
            verdict = check()
        except Exception as e:
            verdict = f"FAIL {type(e).__name__}: {e}"
        open("/tmp/result", "w").write(verdict)
        os.unlink("/tmp/go")
'''

WAIT_READY = "for i in $(seq 200); do [ -e /tmp/ready ] && exit 0; sleep 0.05; done; exit 1"
ASK = "touch /tmp/go; for i in $(seq 200); do [ -e /tmp/result ] && break; sleep 0.05; done; cat /tmp/result"


@pytest.fixture(scope="module")
def daemon(runtime, debian_image, tmp_path_factory):
    """One daemon for the module (importing the Debian image takes a while);
    each test has a sandbox of its own."""
    import tempfile

    from crabd.runtime import Runtime
    from crabd.testing import DaemonHandle, cleanup_state_dir
    st = Path(tempfile.mkdtemp(prefix="crabd-test-", dir="/var/tmp"))
    Runtime(st).images.import_path(runtime.images.get(debian_image).path, debian_image)
    cfg = tmp_path_factory.mktemp("conformance") / "config.toml"
    cfg.write_text('capture = "full"\n')
    d = DaemonHandle(st, args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc"})
    d.start()
    try:
        yield d
    finally:
        d.shutdown()
        cleanup_state_dir(st)


@pytest.fixture
def crabd(daemon, debian_image):
    c = daemon.client()
    sid = c.create_sandbox(debian_image)["id"]
    yield c, sid
    c.delete_sandbox(sid)


def _settled(c, cid: str) -> dict:
    return settled_checkpoint(c, cid)


def _start(c, sid: str, body: str, env: dict | None = None) -> dict:
    """Start the scenario's program, then checkpoint a `true` turn."""
    r = c.exec(sid, ["python3", "-c", PROLOGUE + body + EPILOGUE], env=env)
    assert r["exit_code"] == 0, r
    assert c.exec(sid, WAIT_READY)["exit_code"] == 0, "the program did not get ready"
    return _settled(c, c.exec(sid, "true")["checkpoint"])


def _roundtrip(c, sid: str, body: str, env: dict | None = None) -> str:
    """Checkpoint with the program running, kill it, roll back: its verdict."""
    ck = _start(c, sid, body, env)
    assert ck["state"] == "committed" and ck["proc_image"], ck["reasons"]
    assert not [x for x in ck["reasons"] if "process image not captured" in x], ck["reasons"]
    assert c.exec(sid, "kill -9 $(cat /tmp/pid); rm /tmp/ready")["exit_code"] == 0
    out = c.rollback(sid, ck["id"])
    assert out["restored"] == "fs+proc", [e for e in c.events(sandbox=sid) if e["kind"] == "sandbox.restore_failed"]
    return c.exec(sid, ASK)["stdout"].strip()


def test_daemonized_child_keeps_its_stdin(crabd):
    c, sid = crabd
    body = r'''
def check():
    return "PASS " + os.readlink("/proc/self/fd/0")
'''
    assert _roundtrip(c, sid, body, env={"KEEP_STDIN": "1"}).startswith("PASS pipe:")


def test_tcp_connection_inside_the_sandbox(crabd):
    c, sid = crabd
    body = r'''
srv = socket.socket()
srv.bind(("127.0.0.1", 9000)); srv.listen(1)
cli = socket.create_connection(("127.0.0.1", 9000))
conn, _ = srv.accept()
cli.sendall(b"in flight at the dump")
def check():
    got = conn.recv(100)
    conn.sendall(got[::-1])
    back = cli.recv(100)
    return "PASS" if (got, back) == (b"in flight at the dump", b"pmud eht ta thgilf ni") else f"FAIL {got!r} {back!r}"
'''
    assert _roundtrip(c, sid, body) == "PASS"


def test_connection_not_yet_accepted_is_left_out_and_said(crabd):
    c, sid = crabd
    body = r'''
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 9003)); srv.listen(4)
waiting = socket.create_connection(("127.0.0.1", 9003))  # in srv's accept queue at the dump
def check():
    # the queued connection is gone with the restore; the server serves new ones
    srv.settimeout(5)
    new = socket.create_connection(("127.0.0.1", 9003))
    conn, _ = srv.accept()
    new.sendall(b"after")
    return "PASS" if conn.recv(10) == b"after" else "FAIL"
'''
    ck = _start(c, sid, body)
    assert ck["state"] == "committed" and ck["proc_image"], ck["reasons"]
    said = [x for x in ck["reasons"] if "not-yet-accepted TCP connections" in x]
    assert said and "1 listening socket" in said[0], ck["reasons"]
    assert c.exec(sid, "kill -9 $(cat /tmp/pid); rm /tmp/ready")["exit_code"] == 0
    assert c.rollback(sid, ck["id"])["restored"] == "fs+proc"
    assert c.exec(sid, ASK)["stdout"].strip() == "PASS"


def test_udp_socket_on_loopback(crabd):
    c, sid = crabd
    body = r'''
a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.bind(("127.0.0.1", 9001))
b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b.bind(("127.0.0.1", 9002)); b.connect(("127.0.0.1", 9001))
def check():
    b.send(b"ping")
    got = a.recv(100)
    a.sendto(b"pong", ("127.0.0.1", 9002))
    return "PASS" if (got, b.recv(100)) == (b"ping", b"pong") else "FAIL"
'''
    assert _roundtrip(c, sid, body) == "PASS"


def test_file_locks(crabd):
    c, sid = crabd
    body = r'''
f1 = open("/tmp/flocked", "w"); fcntl.flock(f1, fcntl.LOCK_EX)
f2 = open("/tmp/posix-locked", "w"); fcntl.lockf(f2, fcntl.LOCK_EX)
def check():
    if os.fork() == 0:  # another process: both locks must still be held
        for path, lock in (("/tmp/flocked", fcntl.flock), ("/tmp/posix-locked", fcntl.lockf)):
            try:
                lock(open(path, "w"), fcntl.LOCK_EX | fcntl.LOCK_NB)
                os._exit(1)
            except OSError:
                pass
        os._exit(0)
    return "PASS" if os.wait()[1] == 0 else "FAIL a lock was lost"
'''
    assert _roundtrip(c, sid, body) == "PASS"


def test_file_lease(crabd):
    c, sid = crabd
    body = r'''
open("/tmp/leased", "w").close()
fd = os.open("/tmp/leased", os.O_RDONLY)
F_SETLEASE, F_GETLEASE = 1024, 1025
fcntl.fcntl(fd, F_SETLEASE, fcntl.F_RDLCK)
def check():
    return "PASS" if fcntl.fcntl(fd, F_GETLEASE) == fcntl.F_RDLCK else "FAIL lease lost"
'''
    assert _roundtrip(c, sid, body) == "PASS"


def test_process_of_another_user(crabd):
    c, sid = crabd
    body = r'''
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 1000))
os.setgid(65534); os.setuid(65534)
def check():
    ok = (os.getuid(), resource.getrlimit(resource.RLIMIT_NOFILE)) == (65534, (100, 1000))
    return "PASS" if ok else f"FAIL {os.getuid()} {resource.getrlimit(resource.RLIMIT_NOFILE)}"
'''
    assert _roundtrip(c, sid, body) == "PASS"


def test_stopped_task_round_trips_stopped(crabd):
    # Refused (files only) while crabd froze through the v1 freezer; on this
    # hybrid host it now freezes through the unified hierarchy (criu.py).
    c, sid = crabd
    body = r'''
child = os.fork()
if child == 0:
    os.kill(os.getpid(), 19)  # SIGSTOP
    os._exit(0)
os.waitpid(child, os.WUNTRACED)
def check():
    with open(f"/proc/{child}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    return "PASS" if state == "T" else f"FAIL child state {state}"
'''
    assert _roundtrip(c, sid, body) == "PASS"
    freezer = Path(f"/sys/fs/cgroup/freezer/crabd/{sid}/freezer.state")
    assert freezer.read_text().strip() == "THAWED"


STOPPED_TREE = r'''
import os, signal, sys, time
child = os.fork()
if child == 0:
    os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(1)
os.waitpid(child, os.WUNTRACED)
print(child, flush=True)
while True:
    time.sleep(1)
'''


def _reaped(pid: int) -> bool:
    """Is `pid` gone, zombie included? The test process may be a child
    subreaper (the runtime fixture makes it one): an orphan comes to it, and
    its zombie would keep the pid the restore needs."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not Path(f"/proc/{pid}").exists()


def _state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rindex(b")") + 2:][:1].decode()


@pytest.mark.parametrize("frozen_first", [False, True], ids=["criu-freezes", "crabd-froze-first"])
def test_stopped_task_dumps_and_restores_with_a_cgroup_v2_freezer(frozen_first):
    """cgroup v2 + a stopped task: what a v2-only host would do, checked with
    CRIU 4.1.1 and the v2 freezer (cgroup.freeze) of this hybrid host's
    unified hierarchy (crabd's path for a sandbox with a stopped task on
    this hybrid host, runtime/criu.py); on v2 the dump must work, the
    stopped task stay stopped, and a restore bring it back stopped. The v1
    counterpart hangs in the kernel (CRIU in D state at the SEIZE until the
    cgroup is thawed: 664 s in a hand run), which is why crabd avoids it."""
    from crabd.runtime.cgroups import detect_layout
    unified = detect_layout().unified
    assert unified is not None, "no cgroup v2 hierarchy on this host"
    cg = unified / f"crabd-test-v2-stopped-{os.getpid()}"
    cg.mkdir()
    img = Path(tempfile.mkdtemp(prefix="crabd-v2-stopped-", dir="/var/tmp"))
    tree = subprocess.Popen([sys.executable, "-c", STOPPED_TREE], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    pids = [tree.pid]
    try:
        child = int(tree.stdout.readline())
        pids.append(child)
        for pid in pids:
            (cg / "cgroup.procs").write_text(str(pid))
        assert _state(child) == "T"
        if frozen_first:  # crabd's order: it freezes, commits the files, then CRIU dumps
            (cg / "cgroup.freeze").write_text("1")
            wait_until(lambda: "frozen 1" in (cg / "cgroup.events").read_text(), "cgroup v2 frozen", 10)
        dump = subprocess.run(["criu", "dump", "-t", str(tree.pid), "-D", str(img), "--leave-running",
                               "--freeze-cgroup", str(cg), "-v4", "-o", "dump.log"],
                              capture_output=True, text=True, timeout=60)
        log = (img / "dump.log").read_text(errors="replace")
        assert dump.returncode == 0, [x for x in log.splitlines() if "Error" in x][-5:]
        (cg / "cgroup.freeze").write_text("0")
        assert _state(child) == "T" and _state(tree.pid) != "T", "the dump changed which task is stopped"
        # the restore brings the stopped task back stopped
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        tree.wait(10)
        wait_until(lambda: _reaped(child), f"task {child} gone", 10)
        restore = subprocess.run(["criu", "restore", "-D", str(img), "--restore-detached", "-v4",
                                  "-o", "restore.log"], capture_output=True, text=True, timeout=60)
        rlog = (img / "restore.log").read_text(errors="replace")
        assert restore.returncode == 0, [x for x in rlog.splitlines() if "Error" in x][-5:]
        assert _state(child) == "T" and _state(tree.pid) in ("S", "R")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            (cg / "cgroup.freeze").write_text("0")
        except OSError:
            pass
        tree.poll()
        wait_until(lambda: all([_reaped(p) for p in pids]) and not (cg / "cgroup.procs").read_text().split(),
                   "test cgroup empty", 10)
        cg.rmdir()
        subprocess.run(["rm", "-rf", str(img)], timeout=60)
