"""The oracle's workload program, run INSIDE the sandbox (python3, stdlib only).

bench/oracle.py writes this file into the sandbox as /opt/oracle/agent.py in
turn 0; every later turn runs `python3 /opt/oracle/agent.py OP ARG... -- OP
ARG...`, one action of the effect catalogue per OP. Data arguments are hex.
A failing action (a file that a rollback took away) prints its error and the
next one runs: what matters is the state, compared by the oracle.

Background workers (`spawn`) double-fork away from the turn and keep their
state in a page mapped at crabd.oracle.STATE_PAGE_ADDR (magic, step, hash
chain of every token they drew, name, spin counter, a ring of the last 16
(step, hash) pairs, the CLOCK_MONOTONIC time of each), so the oracle reads it from the host with the sandbox
frozen. Their timers fire at the offsets they are given (around the turn's
end, or during the agent's LLM wait); their log files are named
`oracle-bg-<name>.log` (append-only: see crabd/oracle.py).
"""

import ctypes
import ctypes.util
import hashlib
import mmap
import os
import signal
import struct
import sys
import time

ADDR = 0x6F7261000000
MAGIC = b"CRABORCL"
RING = 16
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
SYS_RENAMEAT2 = 316  # x86_64
AT_FDCWD = -100
RENAME_EXCHANGE = 2
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def _err(msg):
    raise OSError(ctypes.get_errno(), f"{msg}: {os.strerror(ctypes.get_errno())}")


def _open_w(p, flags=os.O_WRONLY | os.O_CREAT, dir_fd=None):
    return os.open(p, flags, 0o644, dir_fd=dir_fd)


# --- foreground actions: one file-changing syscall family each --------------------------------------
def op_write(p, data):
    fd = _open_w(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, bytes.fromhex(data))
    os.close(fd)


def op_append(p, data):
    fd = _open_w(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, bytes.fromhex(data))
    os.close(fd)


def op_pwrite(p, off, data):
    fd = _open_w(p)
    os.pwrite(fd, bytes.fromhex(data), int(off))
    os.close(fd)


def op_writev(p, a, b):
    fd = _open_w(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.writev(fd, [bytes.fromhex(a), bytes.fromhex(b)])
    os.close(fd)


def op_at(d, name, data):
    """openat(2) with a directory fd, then write."""
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    fd = _open_w(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=dfd)
    os.write(fd, bytes.fromhex(data))
    os.close(fd)
    os.close(dfd)


def op_cdwrite(d, rel, data):
    """A relative path from the process's cwd."""
    os.chdir(d)
    op_write(rel, data)


def op_rename(a, b):
    os.rename(a, b)


def op_exchange(a, b):
    if libc.syscall(SYS_RENAMEAT2, AT_FDCWD, a.encode(), AT_FDCWD, b.encode(), RENAME_EXCHANGE) != 0:
        _err("renameat2")


def op_link(a, b):
    os.link(a, b)


def op_symlink(t, p):
    os.symlink(t, p)


def op_unlink(p):
    os.unlink(p)


def op_mkdir(p):
    os.makedirs(p, exist_ok=True)


def op_rmdir(p):
    os.rmdir(p)


def op_truncate(p, n):
    os.truncate(p, int(n))


def op_fallocate(p, off, n):
    fd = _open_w(p)
    os.posix_fallocate(fd, int(off), int(n))
    os.close(fd)


def op_punch(p, off, n):
    fd = _open_w(p)
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_long(int(off)), ctypes.c_long(int(n))):
        _err("fallocate")
    os.close(fd)


def op_cfr(a, b):
    src, dst = os.open(a, os.O_RDONLY), _open_w(b, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    n = os.fstat(src).st_size
    while n > 0:
        k = os.copy_file_range(src, dst, n)
        if k == 0:
            break
        n -= k
    os.close(src)
    os.close(dst)


def op_splice(a, b):
    src, dst = os.open(a, os.O_RDONLY), _open_w(b, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    r, w = os.pipe()
    while True:
        k = os.splice(src, w, 65536)
        if k == 0:
            break
        while k:
            k -= os.splice(r, dst, k)
    for fd in (src, dst, r, w):
        os.close(fd)


def op_sendfile(a, b):
    src, dst = os.open(a, os.O_RDONLY), _open_w(b, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    off, n = 0, os.fstat(src).st_size
    while off < n:
        k = os.sendfile(dst, src, off, n - off)
        if k == 0:
            break
        off += k
    os.close(src)
    os.close(dst)


def op_mmapw(p, off, data):
    """A MAP_SHARED store: no write(2), no msync; the page stays dirty."""
    b = bytes.fromhex(data)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    end = int(off) + len(b)
    if os.fstat(fd).st_size < end:
        os.ftruncate(fd, end)
    m = mmap.mmap(fd, end, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[int(off):end] = b
    del m
    os.close(fd)


def op_xattr(p, name, data):
    os.setxattr(p, "user." + name, bytes.fromhex(data), follow_symlinks=False)


def op_rmxattr(p, name):
    os.removexattr(p, "user." + name, follow_symlinks=False)


def op_mkfifo(p):
    os.mkfifo(p, 0o600)


def op_chmod(p, mode):
    os.chmod(p, int(mode, 8), follow_symlinks=False)


# --- processes ------------------------------------------------------------------------------------
def _workers(name):
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[2] == b"spawn" and argv[3] == name.encode():
            yield int(d)


def op_kill(name, sig="KILL"):
    for pid in _workers(name):
        os.kill(pid, getattr(signal, "SIG" + sig))


def op_comm(name, comm):
    """prctl(PR_SET_NAME) from outside: the task's comm, written through /proc."""
    for pid in _workers(name):
        with open(f"/proc/{pid}/comm", "w") as f:
            f.write(comm)


def op_oom(name, value, how="relative"):
    """Set a worker's oom_score_adj through /proc by a path that does not
    name /proc: relative to a cwd in /proc/PID, or through a symlink."""
    for pid in _workers(name):
        if how == "symlink":
            link = f"/work/oracle-proc-{pid}"
            if os.path.lexists(link):
                os.unlink(link)
            os.symlink(f"/proc/{pid}", link)
            with open(f"{link}/oom_score_adj", "w") as f:
                f.write(value)
        else:
            here = os.getcwd()
            os.chdir(f"/proc/{pid}")
            try:
                with open("oom_score_adj", "w") as f:
                    f.write(value)
            finally:
                os.chdir(here)


def op_spawn(name, kind, delay_ms, period_ms, count, path="-"):
    """Double-fork a background worker; returns once it is set up (its
    start-up belongs to this turn; only its timers come later)."""
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        os.wait()
        os.read(r, 1)
        os.close(r)
        return
    os.close(r)
    os.setsid()
    if os.fork():
        os._exit(0)
    nul = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(nul, fd)
    try:
        wk = Worker(name, kind, int(delay_ms), int(period_ms), int(count), path)
        os.write(w, b"1")
        os.close(w)
        wk.run()
    finally:
        os._exit(0)


class Worker:
    def __init__(self, name, kind, delay_ms, period_ms, count, path):
        self.name, self.kind, self.path = name, kind, path
        self.delay, self.period, self.count = delay_ms / 1000, period_ms / 1000, count
        PROT_RW, MAP_PRIVATE_ANON, MAP_FIXED_NOREPLACE = 3, 0x22, 0x100000
        a = libc.mmap(ADDR, 4096, PROT_RW, MAP_PRIVATE_ANON | MAP_FIXED_NOREPLACE, -1, 0)
        if a != ADDR:
            _err("mmap state page")
        self.page = (ctypes.c_char * 4096).from_address(ADDR)
        self.spin = ctypes.c_uint64.from_address(ADDR + 64)
        ctypes.memmove(ADDR, MAGIC, 8)
        ctypes.memmove(ADDR + 48, name.encode()[:16], min(16, len(name)))
        self.hash = b"\0" * 32
        self.step = 0
        libc.prctl(15, ("ow-" + name).encode()[:15])  # PR_SET_NAME
        self.shared = None
        if kind == "sysv":
            # IPC_PRIVATE, IPC_CREAT|0600; kept (no IPC_RMID): CRIU dumps the namespace's segments
            shmid = libc.shmget(0, 4096, 0o1600)
            if shmid < 0:
                _err("shmget")
            self.shared = libc.shmat(shmid, None, 0)
        elif kind == "shanon":
            self.shared_map = mmap.mmap(-1, 4096, mmap.MAP_SHARED)
        if kind == "sig":
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])

    def advance(self, token):
        self.step += 1
        self.hash = hashlib.sha256(self.hash + token).digest()
        struct.pack_into("<Q", self.page, 8, self.step)
        ctypes.memmove(ADDR + 16, self.hash, 32)
        i = self.step % RING
        struct.pack_into("<Q", self.page, 80 + 24 * i, self.step)
        ctypes.memmove(ADDR + 88 + 24 * i, self.hash[:16], 16)
        struct.pack_into("<Q", self.page, 80 + 24 * RING + 8 * i, time.monotonic_ns())

    def act(self):
        token = os.urandom(8).hex().encode()
        if self.kind == "file":
            # the log through whatever path form it was given (absolute,
            # relative to a cwd, through a symlink): "cwd:DIR:REL" or a path
            if self.path.startswith("cwd:"):
                _, d, rel = self.path.split(":", 2)
                os.chdir(d)
                p = rel
            else:
                p = self.path
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.write(fd, token + b"\n")
            os.close(fd)
        elif self.kind == "spin":
            # memory changed with no system call at all
            end = time.monotonic() + 0.15
            while True:
                for _ in range(20000):
                    self.spin.value += 1
                if time.monotonic() > end:
                    break
        elif self.kind == "sysv":
            ctypes.memmove(self.shared, token, len(token))
        elif self.kind == "shanon":
            # a child writes the shared region: the parent's memory changes
            # without the parent doing anything
            pid = os.fork()
            if pid == 0:
                self.shared_map[:len(token)] = token
                os._exit(0)
            os.waitpid(pid, 0)
        self.advance(token)

    def run(self):
        time.sleep(self.delay)
        for i in range(max(1, self.count)):
            if i:
                time.sleep(self.period)
            self.act()
        while True:
            time.sleep(3600)


OPS = {k[3:]: v for k, v in globals().items() if k.startswith("op_")}


def main(argv):
    rc = 0
    cmd: list = []
    for a in argv + ["--"]:
        if a != "--":
            cmd.append(a)
            continue
        if not cmd:
            continue
        try:
            OPS[cmd[0]](*cmd[1:])
        except Exception as e:  # the state decides; an action on a missing file is still a turn
            print(f"{cmd[0]}: {e}", file=sys.stderr)
            rc = 1
        cmd = []
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
