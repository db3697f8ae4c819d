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

Size (~670 lines): one file by necessity: it is copied into the sandbox
and runs there alone (stdlib only), one handler per effect kind.
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


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_NOATIME_FL = 0x80086601, 0x40086602, 0x80


def op_chattr(p, how):
    """chattr +A / -A: the inode's no-atime flag by FS_IOC_SETFLAGS, on a
    file opened read-only (no traced call names a change)."""
    import fcntl
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        flags = struct.unpack("<i", buf)[0]
        flags = flags | FS_NOATIME_FL if how == "+A" else flags & ~FS_NOATIME_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("<i", flags))
    finally:
        os.close(fd)


# --- io_uring (raw system calls: the stdlib has no binding) ------------------------------------
SYS_IO_URING_SETUP, SYS_IO_URING_ENTER = 425, 426  # x86_64
IORING_SETUP_SQPOLL = 1 << 1
IORING_ENTER_GETEVENTS, IORING_ENTER_SQ_WAKEUP = 1, 2
IORING_SQ_NEED_WAKEUP = 1
IORING_OFF_SQ_RING, IORING_OFF_CQ_RING, IORING_OFF_SQES = 0, 0x8000000, 0x10000000
IOSQE_IO_LINK = 1 << 2
IORING_TIMEOUT_ETIME_SUCCESS = 1 << 5  # a timeout that expires does not break its link
OP_TIMEOUT, OP_OPENAT, OP_WRITE, OP_RENAMEAT, OP_UNLINKAT = 11, 18, 23, 35, 36


class Ring:
    """One io_uring, set up and driven through raw system calls and its
    shared rings. With sqpoll the kernel's iou-sqp thread takes the
    submissions: after setup, the process makes no system call at all."""

    def __init__(self, entries=32, sqpoll=False):
        p = ctypes.create_string_buffer(120)  # struct io_uring_params
        if sqpoll:
            struct.pack_into("<III", p, 8, IORING_SETUP_SQPOLL, 0, 50)  # flags, sq_thread_cpu, sq_thread_idle ms
        fd = libc.syscall(SYS_IO_URING_SETUP, entries, p)
        if fd < 0:
            _err("io_uring_setup")
        self.fd, self.sqpoll = fd, sqpoll
        sq_n, cq_n = struct.unpack_from("<II", p, 0)
        sq = struct.unpack_from("<8I", p, 40)  # head tail mask entries flags dropped array resv
        cq = struct.unpack_from("<8I", p, 80)  # head tail mask entries overflow cqes flags resv
        self.sq = mmap.mmap(fd, sq[6] + 4 * sq_n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                            offset=IORING_OFF_SQ_RING)
        self.cq = mmap.mmap(fd, cq[5] + 16 * cq_n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                            offset=IORING_OFF_CQ_RING)
        self.sqes = mmap.mmap(fd, 64 * sq_n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=IORING_OFF_SQES)
        self.off = {"tail": sq[1], "mask": sq[2], "flags": sq[4], "array": sq[6]}
        self.off_cq = {"tail": cq[1], "mask": cq[2], "cqes": cq[5]}
        self.keep = []  # buffers the kernel reads at submission (sqpoll: later)
        self.queued = 0

    def _u32(self, m, off, v=None):
        if v is None:
            return struct.unpack_from("<I", m, off)[0]
        struct.pack_into("<I", m, off, v)

    def put(self, op, fd=-1, addr=0, length=0, off=0, op_flags=0, link=False):
        tail = self._u32(self.sq, self.off["tail"])
        i = tail & self._u32(self.sq, self.off["mask"])
        sqe = struct.pack("<BBHiQQIIQHHiQQ", op, IOSQE_IO_LINK if link else 0, 0, fd, off, addr,
                          length & 0xFFFFFFFF, op_flags, tail, 0, 0, 0, 0, 0)
        self.sqes[64 * i:64 * i + 64] = sqe
        self._u32(self.sq, self.off["array"] + 4 * i, i)
        self._u32(self.sq, self.off["tail"], tail + 1)  # mmap stores are ordered on x86
        self.queued += 1

    def buf(self, b):
        c = ctypes.create_string_buffer(b, len(b))
        self.keep.append(c)
        return ctypes.addressof(c)

    def timeout(self, ms):
        ts = struct.pack("<qq", ms // 1000, (ms % 1000) * 1000000)
        self.put(OP_TIMEOUT, addr=self.buf(ts), length=1, op_flags=IORING_TIMEOUT_ETIME_SUCCESS, link=True)

    def submit(self):
        """Hand the queued entries to the kernel (sqpoll: only wakes its
        thread when it went idle)."""
        n, self.queued = self.queued, 0
        if self.sqpoll:
            if self._u32(self.sq, self.off["flags"]) & IORING_SQ_NEED_WAKEUP:
                libc.syscall(SYS_IO_URING_ENTER, self.fd, 0, 0, IORING_ENTER_SQ_WAKEUP, None, 0)
            return
        if libc.syscall(SYS_IO_URING_ENTER, self.fd, n, 0, 0, None, 0) < 0:
            _err("io_uring_enter")

    def wait(self, n):
        """Block (in the kernel) until n completions were posted since the
        ring was made; their results, in order."""
        tail = self.off_cq["tail"]
        while self._u32(self.cq, tail) < n:
            libc.syscall(SYS_IO_URING_ENTER, self.fd, 0, n - self._u32(self.cq, tail), IORING_ENTER_GETEVENTS,
                         None, 0)
        mask = self._u32(self.cq, self.off_cq["mask"])
        return [struct.unpack_from("<i", self.cq, self.off_cq["cqes"] + 16 * (i & mask) + 8)[0] for i in range(n)]

    def close(self):
        for m in (self.sq, self.cq, self.sqes):
            m.close()
        os.close(self.fd)


def op_uring(op, p, arg="", sqpoll="0"):
    """One file change submitted through io_uring by a new process: write
    (arg: hex data, appended), openat (create), unlinkat, renameat (arg:
    the new path)."""
    ring = Ring(sqpoll=sqpoll == "1")
    fd = -1
    path = ring.buf(p.encode() + b"\0")
    if op == "write":
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        b = bytes.fromhex(arg)
        ring.put(OP_WRITE, fd=fd, addr=ring.buf(b), length=len(b), off=(1 << 64) - 1)
    elif op == "openat":
        ring.put(OP_OPENAT, fd=AT_FDCWD, addr=path, length=0o644, op_flags=os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    elif op == "unlinkat":
        ring.put(OP_UNLINKAT, fd=AT_FDCWD, addr=path)
    elif op == "renameat":
        ring.put(OP_RENAMEAT, fd=AT_FDCWD, addr=path, length=AT_FDCWD, off=ring.buf(arg.encode() + b"\0"))
    else:
        raise ValueError(f"uring: unknown op {op}")
    ring.submit()
    res = ring.wait(1)[0]
    ring.close()
    if fd >= 0:
        os.close(fd)
    if res < 0:
        raise OSError(-res, f"uring {op} {p}: {os.strerror(-res)}")
    if op == "openat":
        os.close(res)


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


# --- a new process changes what an older one owns, the older one not running -------------------
HOLD_FD, PIPE_FD, FIFO_FD, SOCK_FD, INOTIFY_FD = 9, 10, 11, 12, 13
SYS_PIDFD_OPEN, SYS_PIDFD_GETFD = 434, 438
IPC_RMID, SETVAL = 0, 16
PRIO_PROCESS, RLIMIT_NOFILE = 0, 7
SCHED = {"other": 0, "batch": 3, "idle": 5}


def op_getfd(name, data):
    """pidfd_getfd(2): take the worker's held file description and write through it."""
    for pid in _workers(name):
        pidfd = libc.syscall(SYS_PIDFD_OPEN, pid, 0)
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, HOLD_FD, 0) if pidfd >= 0 else -1
        if fd < 0:
            _err("pidfd_getfd")
        os.write(fd, bytes.fromhex(data))
        os.close(fd)
        os.close(pidfd)


def op_heldfd(name, how, data):
    """Write the deleted file an older worker holds (kind `holddel`) through
    /proc/PID/fd/N: append to it, or truncate it to a length."""
    for pid in _workers(name):
        p = f"/proc/{pid}/fd/{HOLD_FD}"
        if how == "append":
            fd = os.open(p, os.O_WRONLY | os.O_APPEND)
            os.write(fd, bytes.fromhex(data))
            os.close(fd)
        elif how == "truncate":
            os.truncate(p, int(data[:4], 16) % 300)
        else:
            raise ValueError(f"heldfd: unknown {how}")


def op_ipc(name, what, data="00"):
    """Change or remove the worker's SysV IPC objects by id (no msgget/semget/shmget)."""
    with open(f"/work/oracle-ipc-{name}") as f:
        msq, sem, shm = (int(x) for x in f.read().split())
    if what == "msgsnd":
        b = bytes.fromhex(data)[:200]
        buf = struct.pack("<q", 1) + b
        if libc.msgsnd(msq, buf, len(b), 0o4000) < 0:  # IPC_NOWAIT
            _err("msgsnd")
    elif what == "msgrm":
        if libc.msgctl(msq, IPC_RMID, None) < 0:
            _err("msgctl")
    elif what == "semset":
        if libc.semctl(sem, int(data, 16) % 2, SETVAL, ctypes.c_int(int(data[:4], 16) % 1000)) < 0:
            _err("semctl SETVAL")
    elif what == "semrm":
        if libc.semctl(sem, 0, IPC_RMID, 0) < 0:
            _err("semctl")
    elif what == "shmw":
        a = libc.shmat(shm, None, 0)
        if a in (None, ctypes.c_void_p(-1).value):
            _err("shmat")
        b = bytes.fromhex(data)[:4096]
        ctypes.memmove(a, b, len(b))
        libc.shmdt(ctypes.c_void_p(a))
    elif what == "shmrm":
        if libc.shmctl(shm, IPC_RMID, None) < 0:
            _err("shmctl")
    else:
        raise ValueError(f"ipc: unknown {what}")


def op_prio(name, what, value):
    """Renice the worker, change one of its rlimits (prlimit), or its scheduling policy."""
    for pid in _workers(name):
        if what == "nice":
            os.setpriority(os.PRIO_PROCESS, pid, int(value))
        elif what == "rlimit":
            lim = (ctypes.c_uint64 * 2)(int(value), 4096)
            if libc.prlimit(pid, RLIMIT_NOFILE, lim, None) < 0:
                _err("prlimit")
        elif what == "sched":
            os.sched_setscheduler(pid, SCHED[value], os.sched_param(0))
        else:
            raise ValueError(f"prio: unknown {what}")


def op_feed(name, what, data):
    """Leave bytes queued in a queue the worker holds and does not read."""
    import socket
    b = bytes.fromhex(data)[:512]
    for pid in _workers(name):
        if what == "pipe":
            fd = os.open(f"/proc/{pid}/fd/{PIPE_FD}", os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b)
            os.close(fd)
        elif what == "fifo":
            fd = os.open(f"/tmp/oracle-fifo-{name}", os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b)
            os.close(fd)
        elif what == "unix":
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as u:
                u.sendto(b, f"/tmp/oracle-sock-{name}")
        elif what == "inotify":
            op_append(f"/work/d/oracle-ino-{name}", data)  # a file change, and an event queued for it
        else:
            raise ValueError(f"feed: unknown {what}")


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
        if kind == "hold":
            # a file description later turns take with pidfd_getfd and write through
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, HOLD_FD)
            os.close(fd)
        elif kind == "holddel":
            # a file it holds and then unlinks: only its fd names it (a
            # later turn writes it through /proc/PID/fd/N)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, os.urandom(64).hex().encode())
            os.dup2(fd, HOLD_FD)
            os.close(fd)
            os.unlink(path)
        elif kind == "ipc":
            self._ipc_objects()
        elif kind == "queue":
            self._queues()
        if kind.startswith("uring"):
            self._uring_chain()

    def _ipc_objects(self):
        """A message queue, a semaphore set and an (unattached) shared memory
        segment, made and never touched again: later turns change or remove
        them by their ids alone (ids in /work/oracle-ipc-<name>)."""
        ids = [libc.msgget(0, 0o1600), libc.semget(0, 2, 0o1600), libc.shmget(0, 4096, 0o1600)]
        if min(ids) < 0:
            _err("ipc objects")
        with open(f"/work/oracle-ipc-{self.name}", "w") as f:
            f.write(" ".join(map(str, ids)))

    def _queues(self):
        """Queues only this process holds and never reads: a pipe's read end
        (fd PIPE_FD), a FIFO opened read-write (FIFO_FD, /tmp/oracle-fifo-<name>),
        a bound unix datagram socket (SOCK_FD, /tmp/oracle-sock-<name>) and an
        inotify instance watching /work/d (INOTIFY_FD)."""
        import socket
        r, w = os.pipe()
        os.dup2(r, PIPE_FD)
        os.close(r)
        os.close(w)  # writers open /proc/<pid>/fd/PIPE_FD
        fifo = f"/tmp/oracle-fifo-{self.name}"
        if os.path.lexists(fifo):
            os.unlink(fifo)
        os.mkfifo(fifo, 0o600)
        fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
        os.dup2(fd, FIFO_FD)
        os.close(fd)
        sock = f"/tmp/oracle-sock-{self.name}"
        if os.path.lexists(sock):
            os.unlink(sock)
        u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        u.bind(sock)
        os.dup2(u.fileno(), SOCK_FD)
        u.close()
        os.makedirs("/work/d", exist_ok=True)
        fd = libc.inotify_init1(os.O_NONBLOCK)
        if fd < 0 or libc.inotify_add_watch(fd, b"/work/d", 0x2 | 0x100 | 0x200) < 0:  # MODIFY CREATE DELETE
            _err("inotify")
        os.dup2(fd, INOTIFY_FD)
        os.close(fd)

    def _uring_chain(self):
        """Every write of this worker, handed to io_uring now as one linked
        chain (timeout, write, timeout, write, ...): the kernel does each at
        its offset while the process sleeps in one system call (uring: in
        task work that interrupts the sleep, which then resumes) or with no
        system call at all (uringsq: the ring's iou-sqp thread). Kinds
        ending in -keep keep the ring for good; the others wake once the
        chain is done and close it (CRIU refuses to dump a process holding
        a ring: until then, checkpoints have no process image)."""
        self.ring = Ring(entries=2 * max(1, self.count), sqpoll=self.kind.startswith("uringsq"))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        ms = [int(self.delay * 1000)] + [int(self.period * 1000)] * (max(1, self.count) - 1)
        for i, wait in enumerate(ms):
            token = os.urandom(8).hex().encode()
            self.ring.timeout(wait)
            self.ring.put(OP_WRITE, fd=fd, addr=self.ring.buf(token + b"\n"), length=len(token) + 1,
                          off=(1 << 64) - 1, link=i < len(ms) - 1)
            self.advance(token)
        self.ring.submit()

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
        if self.kind.startswith("uring"):
            if not self.kind.endswith("-keep"):
                self.ring.wait(2 * max(1, self.count))  # the kernel does the writes
                self.ring.close()
            while True:
                time.sleep(3600)
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
