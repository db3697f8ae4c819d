"""Ground truth for checkpoints: the differential oracle (issue 14).

crabd's promise is that checkpoint k restores exactly the sandbox's state at
its capture instant. This module lets a benchmark check that promise:

* `record_at_capture` and `open_at_plan` are the daemon's hooks (`crabd serve
  --oracle DIR`, called from `Daemon._capture`, crabd/daemon/pipeline.py, and
  where a turn's plan is made, crabd/daemon/turns.py): while the sandbox's
  cgroup is frozen at the instant checkpoint k claims (inside crabd's own
  freeze for FS and FS_PROC; for SKIP, which takes no freeze, inside one the
  oracle takes right when its plan is made, with the inspector told as for
  crabd's own pause), they write DIR/<k>.json.zst: the record `read_state`
  makes of the live sandbox.
* `read_state` is that record: every entry of every mount the sandbox has
  that holds state (its root, /dev, /dev/shm, any other tmpfs or bind),
  read from the host through /proc/<init>/root one component at a time,
  never following the sandbox's symlinks; the processes of its cgroup (pid
  namespace numbers, parent, comm, cmdline, signal masks, nice, scheduling
  policy, rlimits); per process the application-level state instrumented
  workloads keep in memory (a state page at `STATE_PAGE_ADDR`, and every
  shared memory region: SysV, shared anonymous, memfd) read through
  /proc/<pid>/mem, and the file descriptions they hold (offsets, and what
  waits unread in their pipes, FIFOs, sockets and inotify queues); and the
  System V IPC objects of the sandbox's IPC namespace (messages, semaphore
  values, segment bytes).
* `compare` (pure: tested without root) tells what differs between the
  ground truth of k and the same record taken of a fork of checkpoint k.
  A fork runs from the moment it is restored until the benchmark freezes it,
  so work the original had still pending (a timer due after the capture)
  may have happened in the fork: `compare` accepts exactly that progress of
  instrumented workers (their step count only grows and the fork's history
  holds the original's step; their `APPEND_PREFIX` files only grew) and
  nothing else.

Process pids are those of the sandbox's pid namespace (CRIU restores them);
zombies are left out (an init reaps them at its own pace), and so are crabd's
own exec plumbing in /dev (`/dev/.crabd*`).

Size (~880 lines): the record (every mount, process and instrumented
worker) and its comparison belong together: `compare` reads exactly what
`read_state` writes, and splitting them would split one format.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import stat
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from deltafs.tree import open_rel

__all__ = ["STATE_PAGE_ADDR", "STATE_PAGE_MAGIC", "APPEND_PREFIX", "Difference", "read_state", "compare",
           "parse_state_page", "write_record", "load_record", "record_at_capture"]

# Instrumented workloads (bench/oracle_agent.py) keep their state in one page
# mapped at this fixed address, so the oracle finds it in any process.
STATE_PAGE_ADDR = 0x6F7261000000
STATE_PAGE_MAGIC = b"CRABORCL"
STATE_RING = 16
# Files whose name starts with this are append-only logs of an instrumented
# worker: their content is kept in the record (up to APPEND_KEEP bytes) so a
# fork that appended to them after its restore can be told from a lost write.
APPEND_PREFIX = "oracle-bg-"
APPEND_KEEP = 64 << 10

# Mounts that hold no sandbox state a checkpoint must restore (kernel views).
_NO_STATE_FS = {"proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2", "securityfs", "debugfs", "tracefs",
                "bpf", "pstore", "configfs", "fusectl", "binfmt_misc", "autofs", "hugetlbfs", "nsfs"}
_CRABD_DEV = (".crabd",)  # /dev/.crabd-init (bind of crabd's init), /dev/.crabd (exec plumbing)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KIND = {stat.S_IFREG: "f", stat.S_IFDIR: "d", stat.S_IFLNK: "l", stat.S_IFIFO: "p", stat.S_IFSOCK: "s",
         stat.S_IFCHR: "c", stat.S_IFBLK: "b"}


# --- reading the state (host side, root) ---------------------------------------------------------
class _HashCache:
    """What the reads of one oracle learnt about entries that did not change
    since `before_ns` (a whole second, taken before any session ran: the
    image's entries), so later reads need not read them again.

    The guarantee it rests on is the kernel's, not crabd's: every change to
    an inode (a write, an mmap write fault, truncate, chmod, chown, an
    xattr, a link count) sets its ctime to the current time, and no process
    can set a ctime back (utimensat sets atime and mtime only; moving the
    clock back needs CAP_SYS_TIME, which a sandbox lacks, and a time
    namespace moves only the monotonic and boot clocks). So an entry whose
    ctime is at or before `before_ns` is in the state it had then, in
    whatever copy of the tree (a btrfs snapshot keeps inodes and their
    ctimes; a copy, or a restore that rewrote a file, gets a new ctime and
    is read again). A directory whose ctime is that old has the same names,
    naming the same inodes (create, unlink, rename and link in a directory
    change its ctime and mtime).

    * `hashes`: an old entry's description, keyed by name, inode, size,
      mtime, ctime, mode and owner (read once per key);
    * `listings`: an old directory's names (keyed by path, inode, mtime and
      ctime) with the description of each entry that was old when listed
      (None for one that was not): a read takes these without a stat, and
      asks find(1) only for the directories and the entries changed since
      `before_ns` (`-newerct`), which override what the listing says."""

    def __init__(self, before_ns: int) -> None:
        self.before_ns = before_ns // 1_000_000_000 * 1_000_000_000  # find's -newerct takes seconds
        self.hashes: dict[tuple[Any, ...], str] = {}
        self.listings: dict[tuple[Any, ...], dict[str, str | None]] = {}
        self.hits = self.hashed = self.listed = 0  # counters, for the benchmark's profile


_CACHE = _HashCache(time.time_ns())


_FS_IOC_GETFLAGS = 0x80086601


def _inode_flags(fd: int) -> str:
    """The inode's flags (FS_IOC_GETFLAGS, what lsattr shows: +A, +i, ...) in
    hex, "" where the file system has none; a lost flag is a difference."""
    import fcntl
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf, True)
    except OSError:
        return ""
    return f"{int.from_bytes(buf, 'little'):x}"


def _dir_flags(dir_fd: int, name: bytes) -> str:
    try:
        fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    except OSError:
        return ""
    try:
        return _inode_flags(fd)
    finally:
        os.close(fd)


def _hash_file(dir_fd: int, name: bytes, flags: list[str] | None = None) -> tuple[str, bytes | None]:
    import blake3
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    h = blake3.blake3()
    head = bytearray()
    keep = name.startswith(APPEND_PREFIX.encode())
    try:
        if flags is not None:
            flags.append(_inode_flags(fd))
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
            if keep and len(head) < APPEND_KEEP:
                head += b[:APPEND_KEEP - len(head)]
    finally:
        os.close(fd)
    return h.hexdigest()[:32], bytes(head) if keep else None


def _xattrs(dir_fd: int, name: bytes) -> str:
    p = b"/proc/self/fd/%d/%s" % (dir_fd, name)
    try:
        names = sorted(os.listxattr(p, follow_symlinks=False))
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM, errno.ENOENT):
            return ""
        raise
    parts = []
    for n in names:
        try:
            v = os.getxattr(p, n, follow_symlinks=False)
        except OSError:
            continue
        parts.append(f"{n}={v.hex()}")
    return ",".join(parts)


def _describe(dir_fd: int, name: bytes, st: os.stat_result, cache: _HashCache) -> str:
    """One entry as `kind|mode|uid:gid|nlink|size|content|target|rdev|xattrs|data|flags` (mtimes left
    out: a restore need not keep them; content is what matters; flags: a file's or directory's
    inode flags, FS_IOC_GETFLAGS)."""
    kind = _KIND.get(stat.S_IFMT(st.st_mode), "?")
    old = st.st_ctime_ns <= cache.before_ns
    key = (name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid)
    if old and key in cache.hashes and not name.startswith(APPEND_PREFIX.encode()):
        cache.hits += 1
        return cache.hashes[key]
    content = target = data = flags = ""
    size = st.st_size if kind in ("f", "l") else 0
    if kind == "f":
        cache.hashed += 1
        got: list[str] = []
        content, head = _hash_file(dir_fd, name, got)
        data = base64.b64encode(head).decode() if head is not None else ""
        flags = got[0] if got else ""
    elif kind == "d":
        flags = _dir_flags(dir_fd, name)
    elif kind == "l":
        target = os.readlink(name, dir_fd=dir_fd).hex()  # type: ignore[arg-type]
    rdev = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" if kind in ("c", "b") else ""
    xa = _xattrs(dir_fd, name) if kind in ("f", "d") else ""
    nlink = st.st_nlink if kind != "d" else 0  # a dir's link count is the file system's business
    desc = "|".join((kind, f"{stat.S_IMODE(st.st_mode):o}", f"{st.st_uid}:{st.st_gid}", str(nlink), str(size),
                     content, target, rdev, xa, data, flags))
    if old:
        cache.hashes[key] = desc
    return desc


_FIND_FMT = "%P\\0%D %i %y %m %U %G %s %T@ %C@\\0"


def _ns(t: bytes) -> int:
    """find's `%T@` (seconds, a dot, the fraction) as integer nanoseconds, exactly."""
    sec, _, frac = t.partition(b".")
    return int(sec) * 1_000_000_000 + int((frac[:9] or b"0").ljust(9, b"0"))


def _walk_mount(top_fd: int, skip_top: tuple[str, ...], cache: _HashCache) -> dict[str, str]:
    """Every entry of the file system at `top_fd`, not crossing into other
    mounts (their points are recorded as `mount`), never following a symlink.

    find(1) walks (`-H`: only the starting point, our own fd, is followed;
    `-xdev`) and reports every directory, and every other entry changed
    since the cache's instant; the other entries of an old directory come
    from its listing in the cache (see `_HashCache` for why that is exact).
    A directory with no listing is listed here and each entry the find did
    not report is described, opened below its parent one component at a
    time, O_NOFOLLOW (the sandbox is frozen: it is the entry find saw).
    For debian-py's ~14,400 entries, warm: 0.11 s of CPU (find's
    included) against 0.2 s for the same walk in Python, 0.6-0.7 s against
    1.1-1.7 s of wall time at load 30 (CPU time is what a loaded host
    stretches); the ground truth is read inside crabd's freeze."""
    out: dict[str, str] = {"": _describe_dir(os.fstat(top_fd))}
    top_dev = os.fstat(top_fd).st_dev
    since = cache.before_ns // 1_000_000_000
    p = subprocess.run(["find", "-H", f"/proc/self/fd/{top_fd}/", "-mindepth", "1", "-xdev",
                        "(", "-type", "d", "-o", "-newerct", f"@{since}", ")", "-printf", _FIND_FMT],
                       pass_fds=(top_fd,), capture_output=True, timeout=600)
    for line in p.stderr.decode(errors="replace").splitlines()[:20]:
        out[f"?find: {line[:300]}"] = "error|find"
    parts = p.stdout.split(b"\0")
    new: dict[bytes, tuple[int, ...]] = {}   # changed entries (not dirs), by path
    dirs: list[tuple[bytes, tuple[int, ...]]] = [(b"", ())]
    for i in range(0, len(parts) - 1, 2):
        rel, f = parts[i], parts[i + 1].split(b" ")
        if skip_top and os.fsdecode(rel.split(b"/", 1)[0]).startswith(skip_top):
            continue
        # dev ino mode(kind|perm) uid gid size mtime ctime
        fields: tuple[int, ...] = (int(f[0]), int(f[1]), _FIND_KIND[f[2]] | int(f[3], 8), int(f[4]), int(f[5]), int(f[6]),
                  _ns(f[7]), _ns(f[8]))
        if f[2] == b"d":
            dirs.append((rel, fields))
        else:
            new[rel] = fields
    new_paths = {os.fsdecode(rel) for rel in new}
    fds: dict[bytes, int] = {}

    def dir_fd(rel: bytes) -> int:
        if rel not in fds:
            fds[rel] = open_rel(top_fd, rel)
        return fds[rel]

    def describe(rel: bytes) -> str:
        parent, _, name = rel.rpartition(b"/")
        try:
            pfd = dir_fd(parent)
            return _describe(pfd, name, os.stat(name, dir_fd=pfd, follow_symlinks=False), cache)
        except OSError as e:  # replaced under us (not frozen), or unreadable
            return f"error|{errno.errorcode.get(e.errno or 0, e.errno)}"

    try:
        for rel, fields in dirs:
            path = os.fsdecode(rel)
            if rel:
                if fields[0] != top_dev:
                    out[path] = "mount"
                    continue
                out[path] = _cached(cache, rel, fields) or describe(rel)
            prefix = path + "/" if path else ""
            key = (rel, fields[1], fields[6], fields[7]) if rel and fields[7] <= cache.before_ns else None
            listing = cache.listings.get(key) if key is not None else None
            if listing is None:
                try:
                    with os.scandir(dir_fd(rel)) as it:
                        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                except OSError as e:
                    out[prefix + "?"] = f"error|{errno.errorcode.get(e.errno or 0, e.errno)}"
                    continue
                listing = {}
                for name, is_dir in names:
                    if is_dir or (not rel and name.startswith(skip_top) and skip_top):
                        continue
                    child = os.fsencode(prefix + name)
                    desc = None if child in new else describe(child)
                    # (an unreadable entry, or one not old, is described again at each read)
                    listing[name] = desc if desc is not None and not desc.startswith("error|") else None
                if key is not None:
                    cache.listings[key] = listing
            else:
                cache.listed += 1
            for name, desc in listing.items():
                child_path = prefix + name
                if child_path in new_paths:
                    continue
                out[child_path] = desc if desc is not None else describe(os.fsencode(child_path))
        for rel in new:
            out[os.fsdecode(rel)] = describe(rel)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _cached(cache: _HashCache, rel: bytes, f: tuple[int, ...]) -> str | None:
    """An old entry's description from find's fields (dev ino mode uid gid
    size mtime ctime), with no stat: the key `_describe` files it under."""
    if f[7] > cache.before_ns:
        return None
    name = rel.rpartition(b"/")[2]
    d = cache.hashes.get((name, f[1], f[5], f[6], f[7], f[2], f[3], f[4]))
    if d is not None:
        cache.hits += 1
    return d


_FIND_KIND = {b"f": stat.S_IFREG, b"d": stat.S_IFDIR, b"l": stat.S_IFLNK, b"p": stat.S_IFIFO, b"s": stat.S_IFSOCK,
              b"c": stat.S_IFCHR, b"b": stat.S_IFBLK}


def _describe_dir(st: os.stat_result) -> str:
    return f"d|{stat.S_IMODE(st.st_mode):o}|{st.st_uid}:{st.st_gid}|0|0|||||"


def state_mounts(pid: int) -> list[tuple[str, str]]:
    """(mount point inside the sandbox, fs type) of every mount that holds state, from its mountinfo."""
    seen: dict[str, str] = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mp = left.split()[4].encode().decode("unicode_escape")
            fstype = right.split()[0]
            if fstype in _NO_STATE_FS or any(mp.startswith("/dev/" + p) for p in _CRABD_DEV) \
                    or mp.startswith(("/proc/", "/sys/")):  # runc's masks of kernel views
                seen.pop(mp, None)  # an over-mount hides what was below
                continue
            seen[mp] = fstype
    return sorted(seen.items())


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _regions(pid: int) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The state page (parsed) and a hash of each shared memory region of `pid`."""
    import blake3
    page = None
    shared: dict[str, str] = {}
    with open(f"/proc/{pid}/maps") as f:
        maps = f.read().splitlines()
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5] if len(parts) > 5 else ""
            if lo == STATE_PAGE_ADDR:
                mem.seek(lo)
                page = parse_state_page(mem.read(4096))
            elif parts[1][3] == "s" and (path.startswith("/SYSV") or path.startswith("/dev/zero")
                                         or path.startswith("/memfd:")):
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except OSError:
                    continue
                # CRIU restores a shared anonymous region as a memfd ("/memfd:/dev/zero
                # (deleted)"): the same memory, so named by its kind and address only
                kind = "sysv" if path.startswith("/SYSV") else "shmem"
                shared[f"{kind}@{lo:x}"] = blake3.blake3(data).hexdigest()[:32]
    return page, shared


_TIMES = 80 + 24 * STATE_RING


def parse_state_page(b: bytes) -> dict[str, Any] | None:
    """The state page of an instrumented worker (layout: bench/oracle_agent.py):
    magic, step, chain hash, name, spin counter, a ring of (step, hash), then
    the CLOCK_MONOTONIC ns at which each step of the ring ran."""
    if len(b) < _TIMES + 8 * STATE_RING or b[:8] != STATE_PAGE_MAGIC:
        return None
    step, = struct.unpack_from("<Q", b, 8)
    chain = b[16:48].hex()
    name = b[48:64].rstrip(b"\0").decode(errors="replace")
    spin, = struct.unpack_from("<Q", b, 64)
    ring = []
    for i in range(STATE_RING):
        s, = struct.unpack_from("<Q", b, 80 + 24 * i)
        h = b[88 + 24 * i:104 + 24 * i].hex()
        t, = struct.unpack_from("<Q", b, _TIMES + 8 * i)
        if s:
            ring.append([s, h, t])
    return {"name": name, "step": step, "hash": chain, "spin": spin, "ring": sorted(ring)}


def _sched(hp: int) -> str:
    """nice, real-time priority and scheduling policy, from /proc/<pid>/stat."""
    with open(f"/proc/{hp}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    return f"nice={int(rest[16])} rt={int(rest[37])} policy={int(rest[38])}"


def _limits(hp: int) -> str:
    with open(f"/proc/{hp}/limits") as f:
        return ";".join(" ".join(line.split()) for line in f.read().splitlines()[1:])


_SYS_PIDFD_OPEN, _SYS_PIDFD_GETFD = 434, 438
_SPLICE_F_NONBLOCK = 2
_MSG_PEEK_DONTWAIT = 0x2 | 0x40


def _libc() -> Any:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    return libc


def _fds(hp: int) -> dict[str, str]:
    """The file descriptions an instrumented worker holds (fds >= 3): what
    each is, its offset and flags, and what waits in it unread (FIONREAD,
    and the waiting bytes themselves for pipes, FIFOs and the first
    datagram of a socket), read without consuming anything on a copy taken
    with pidfd_getfd(2). A later turn's process may write through a
    description it took (pidfd_getfd) or queue bytes in one, while the
    worker sleeps: process state only a process image holds."""
    import ctypes
    import fcntl
    import termios

    import blake3
    libc = _libc()
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(f"/proc/{hp}/fd"), key=int)
    except OSError:
        return out
    pidfd = libc.syscall(_SYS_PIDFD_OPEN, hp, 0)
    try:
        for n in names:
            if int(n) < 3:
                continue
            try:
                link = os.readlink(f"/proc/{hp}/fd/{n}")
                with open(f"/proc/{hp}/fdinfo/{n}") as f:
                    info = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            except OSError:
                continue
            kind = link.split(":", 1)[0] if link.startswith(("pipe:", "socket:", "anon_inode:")) else "file"
            if kind == "anon_inode":
                kind = link  # anon_inode:inotify, anon_inode:[io_uring], ...
            desc = f"{kind} pos={info.get('pos', '').strip()} flags={info.get('flags', '').strip()}"
            if kind == "file" and link.endswith(" (deleted)"):
                desc += _held_deleted(hp, n)
            if kind in ("pipe", "socket", "anon_inode:inotify") or (kind == "file" and os.path.exists(
                    f"/proc/{hp}/fd/{n}") and stat.S_ISFIFO(os.stat(f"/proc/{hp}/fd/{n}").st_mode)):
                copy = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(n), 0) if pidfd >= 0 else -1
                if copy < 0:
                    desc += " queued=?"
                else:
                    try:
                        buf = bytearray(4)
                        try:
                            fcntl.ioctl(copy, termios.FIONREAD, buf)
                            desc += f" queued={int.from_bytes(buf, 'little')}"
                        except OSError as e:
                            desc += f" queued=E{e.errno}"
                        data = b""
                        if kind == "socket":
                            b = ctypes.create_string_buffer(65536)
                            k = libc.recv(copy, b, 65536, _MSG_PEEK_DONTWAIT)
                            data = b.raw[:k] if k > 0 else b""
                        elif kind != "anon_inode:inotify":  # a pipe or FIFO: tee(2) copies, consumes nothing
                            r, w = os.pipe()
                            try:
                                fcntl.fcntl(r, 1031, 1 << 20)  # F_SETPIPE_SZ
                                k = libc.tee(copy, w, 1 << 20, _SPLICE_F_NONBLOCK)
                                data = os.read(r, k) if k > 0 else b""
                            except OSError:
                                pass
                            finally:
                                os.close(r)
                                os.close(w)
                        if data:
                            desc += f" data={blake3.blake3(data).hexdigest()[:32]}"
                    finally:
                        os.close(copy)
            out[n] = desc
    finally:
        if pidfd >= 0:
            os.close(pidfd)
    return out


def _held_deleted(hp: int, n: str) -> str:
    """A deleted regular file a worker holds: its size, content digest and
    inode flags, read through the worker's fd (/proc/PID/fd/N opens the
    inode itself). Only its fds name it: a later turn's process may write
    it through /proc/PID/fd/N, and only the process image keeps it."""
    import blake3
    try:
        fd = os.open(f"/proc/{hp}/fd/{n}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f" deleted=E{e.errno}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        h = blake3.blake3()
        while b := os.read(fd, 1 << 20):
            h.update(b)
        return f" deleted size={st.st_size} content={h.hexdigest()[:32]} iflags={_inode_flags(fd)}"
    finally:
        os.close(fd)


def read_ipc(init_pid: int) -> dict[str, str] | None:
    """The System V IPC objects of the sandbox's IPC namespace (CRIU saves
    them with the processes): per message queue its messages (copied with
    MSG_COPY, nothing received), per semaphore set its values, per shared
    memory segment its bytes (attached read-only for the read). Read in a
    thread of our own that joins the namespace (setns(2) moves only the
    calling thread; it ends after the read). None when the sandbox shares
    the host's namespace."""
    import threading
    try:
        if os.stat(f"/proc/{init_pid}/ns/ipc").st_ino == os.stat("/proc/self/ns/ipc").st_ino:
            return None
        ns = os.open(f"/proc/{init_pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    res: dict[str, Any] = {}

    def run() -> None:
        try:
            res["objects"] = _ipc_objects(ns)
        except Exception as e:  # reported as a record error: the comparison then shows it
            res["error"] = f"ipc: {e!r}"

    th = threading.Thread(target=run, name="oracle-ipc")
    th.start()
    th.join()
    os.close(ns)
    if "error" in res:
        return {"error": res["error"]}
    return res["objects"]


def _ipc_objects(ns: int) -> dict[str, str]:
    import ctypes

    import blake3
    libc = _libc()
    if libc.setns(ns, 0x08000000) != 0:  # CLONE_NEWIPC, this thread only
        raise OSError(ctypes.get_errno(), "setns")
    out: dict[str, str] = {}

    def rows(kind: str) -> list[list[str]]:
        with open(f"/proc/sysvipc/{kind}") as f:
            return [line.split() for line in f.read().splitlines()[1:] if line.strip()]

    for r in rows("msg"):  # key msqid perms cbytes qnum lspid lrpid uid gid cuid cgid stime rtime ctime
        qid, qnum = int(r[1]), int(r[4])
        h = blake3.blake3()
        buf = ctypes.create_string_buffer(8 + 65536)
        for i in range(qnum):
            k = libc.msgrcv(qid, buf, 65536, i, 0o4000 | 0o40000)  # IPC_NOWAIT | MSG_COPY
            h.update(buf.raw[:8 + max(k, 0)] if k >= 0 else b"E")
        out[f"msg:{qid}"] = f"key={r[0]} perms={r[2]} cbytes={r[3]} qnum={qnum} uid={r[7]}:{r[8]} " \
                            f"data={h.hexdigest()[:32]}"
    for r in rows("sem"):  # key semid perms nsems uid gid cuid cgid otime ctime
        sid, nsems = int(r[1]), int(r[3])
        vals = (ctypes.c_ushort * max(nsems, 1))()
        got = libc.semctl(sid, 0, 13, vals)  # GETALL
        out[f"sem:{sid}"] = f"key={r[0]} perms={r[2]} nsems={nsems} uid={r[4]}:{r[5]} " \
                            f"values={list(vals)[:nsems] if got >= 0 else 'E'}"
    for r in rows("shm"):  # key shmid perms size cpid lpid nattch uid gid cuid cgid atime dtime ctime rss swap
        mid, size = int(r[1]), int(r[3])
        a = libc.shmat(mid, None, 0o10000)  # SHM_RDONLY
        if a in (None, ctypes.c_void_p(-1).value):
            data = f"E{ctypes.get_errno()}"
        else:
            try:
                data = blake3.blake3(ctypes.string_at(a, size)).hexdigest()[:32]
            finally:
                libc.shmdt(a)
        out[f"shm:{mid}"] = f"key={r[0]} perms={r[2]} size={size} uid={r[7]}:{r[8]} data={data}"
    return out


def read_processes(procs_file: Path) -> dict[str, dict[str, Any]]:
    """The live processes of a cgroup, keyed by their pid in the sandbox's pid namespace."""
    try:
        host_pids = [int(x) for x in procs_file.read_text().split()]
    except FileNotFoundError:
        return {}
    host_to_ns: dict[int, int] = {}
    out: dict[str, dict[str, Any]] = {}
    raw: dict[int, dict[str, str]] = {}
    for hp in host_pids:
        try:
            st = _status(hp)
        except OSError:
            continue
        if st.get("State", "").startswith(("Z", "X")):
            continue
        raw[hp] = st
        host_to_ns[hp] = int(st["NSpid"].split()[-1])
    for hp, st in raw.items():
        try:
            with open(f"/proc/{hp}/cmdline", "rb") as f:
                cmdline = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
            page, shared = _regions(hp)
            with open(f"/proc/{hp}/oom_score_adj") as f:
                oom = f.read().strip()
            sched, limits = _sched(hp), _limits(hp)
            fds = _fds(hp) if page is not None else None  # an instrumented worker's
        except OSError:
            continue
        ppid = int(st["PPid"])
        out[str(host_to_ns[hp])] = {
            "ppid": host_to_ns.get(ppid, 0), "comm": st["Name"], "cmdline": cmdline, "oom_score_adj": oom,
            "signals": {k: st.get(k, "") for k in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn")},
            "page": page, "shared": shared, "sched": sched, "limits": limits, "fds": fds}
    return out


def read_state(init_pid: int | None, procs_file: Path, *, cache: _HashCache | None = None) -> dict[str, Any]:
    """The state record of a sandbox (call with it frozen): mounts, then processes."""
    cache = cache or _CACHE
    rec: dict[str, Any] = {"mounts": {}, "processes": {}, "errors": []}
    hits, hashed = cache.hits, cache.hashed
    if init_pid is None:
        rec["errors"].append("no init process: the sandbox is not running")
        return rec
    try:
        root_fd = os.open(f"/proc/{init_pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        rec["errors"].append(f"/proc/{init_pid}/root: {e}")
        return rec
    try:
        for mp, fstype in state_mounts(init_pid):
            try:
                fd = open_rel(root_fd, mp.strip("/").encode())  # O_NOFOLLOW at each step
            except NotADirectoryError:
                continue  # a file bind-mounted over another (runc's /dev/null masks)
            except OSError as e:
                rec["errors"].append(f"mount {mp}: {e}")
                continue
            try:
                skip = _CRABD_DEV if mp == "/dev" else ()
                rec["mounts"][mp] = {"fstype": fstype, "entries": _walk_mount(fd, skip, cache)}
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    rec["processes"] = read_processes(procs_file)
    rec["cache"] = {"hits": cache.hits - hits, "hashed": cache.hashed - hashed}
    ipc = read_ipc(init_pid)
    if ipc is not None and "error" in ipc:
        rec["errors"].append(ipc["error"])
    elif ipc is not None:
        rec["ipc"] = ipc
    return rec


def write_record(path: Path, rec: dict[str, Any]) -> None:
    import zstandard
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(zstandard.ZstdCompressor(level=3).compress(json.dumps(rec, separators=(",", ":")).encode()))
    os.replace(tmp, path)


def load_record(path: Path) -> dict[str, Any]:
    import zstandard
    return json.loads(zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes()))


# --- the daemon's hook -----------------------------------------------------------------------------
def record_at_capture(daemon: Any, ck: Any) -> None:
    """Arrange for the ground truth of checkpoint `ck` to be recorded at its
    capture instant (oracle mode only; called by `Daemon._capture` before it
    decides anything, so whatever plan the capture ends with is covered):

    * FS and FS_PROC: inside crabd's own freeze, just before its snapshot
      (`fs.checkpoint(key, name=<checkpoint id>)` runs with the sandbox frozen);
    * a checkpoint committed without a snapshot of its own (SKIP): just before
      its commit, in a freeze the oracle takes, told to the inspector like
      crabd's own pause (so its wake-ups are not the next turn's activity).

    Both are instance attributes over the daemon's snapshotter and store,
    set once: no other code path changes."""
    armed = getattr(daemon, "_oracle_armed", None)
    if armed is None:
        armed = daemon._oracle_armed = {}
        fs_checkpoint, commit = daemon.fs.checkpoint, daemon.store.commit_checkpoint

        def checkpoint(key: str, *args: Any, **kw: Any) -> Any:
            c = armed.pop(kw.get("name") or "", None)
            if c is not None:  # (a SKIP made FS by its capture: its truth is this instant's)
                _record(daemon, c, frozen_by="crabd")
            return fs_checkpoint(key, *args, **kw)

        def commit_checkpoint(cid: str, **fields: Any) -> Any:
            c = armed.pop(cid, None)
            if c is not None and cid not in _at_plan(daemon):
                _record_frozen(daemon, c)  # (a SKIP's truth was taken when its plan was made: open_at_plan)
            _at_plan(daemon).discard(cid)
            return commit(cid, **fields)

        daemon.fs.checkpoint, daemon.store.commit_checkpoint = checkpoint, commit_checkpoint
    armed[ck.id] = ck


def _at_plan(daemon: Any) -> set[str]:
    """The checkpoints whose truth `open_at_plan` recorded (SKIP at their plan)."""
    got = getattr(daemon, "_oracle_at_plan", None)
    if got is None:
        got = daemon._oracle_at_plan = set()
    return got


def open_at_plan(daemon: Any, sid: str, effects: Any, open_checkpoint: Any) -> Any:
    """Open a turn's checkpoint row (`open_checkpoint()`, where its plan is
    made, right after the inspector closed the turn) and, when that plan is
    SKIP, record its ground truth at that instant (oracle mode only; worker
    thread): a SKIP claims the state the turn left, and whatever a
    background worker does after the turn's end belongs to the next turn in
    crabd's model; read later (in the capture job, after the scheduler's
    queue) the truth would hold that work and the comparison with the
    parent's restore would report the oracle's own read instant.

    Only a turn the classifier calls SKIP can end with a SKIP plan (a
    manual checkpoint, a blind record and the capture modes only raise it),
    so only those are frozen: from before the row is opened to after the
    read, told to the inspector as crabd's own pause is (its wake-ups are
    not the next turn's activity). What it costs that turn, in oracle mode
    only: a freeze, the read (0.5-1.5 s on debian-py at load 2-25) and the
    inspector's re-baseline (up to its settle time), before the reply.
    A SKIP that its capture turns into FS (its parent not durable) is
    recorded again in crabd's freeze (`record_at_capture`)."""
    import ebpf

    from .runtime.cgroups import Freezer
    if ebpf.classify(effects).kind.value != "SKIP":
        return open_checkpoint()
    try:
        sb = daemon.runtime.get(sid)
        freezer: Any = Freezer(daemon.runtime.layout, sb.cgroup_rel)
        freezer.freeze()
    except Exception:
        freezer = None  # not running: nothing moves
    d: dict[str, float] = {}
    ck = None
    try:
        with daemon._inspector_pause(sid, d) if freezer is not None else _nothing():
            try:
                ck = open_checkpoint()
                if ck.plan == "SKIP":
                    try:
                        _record(daemon, ck, frozen_by="oracle-plan" if freezer is not None else None)
                        _at_plan(daemon).add(ck.id)
                    except Exception:
                        import logging
                        logging.getLogger(__name__).warning("oracle: recording %s failed", ck.id, exc_info=True)
            finally:
                if freezer is not None:
                    freezer.thaw()
    except Exception:
        if ck is None:
            raise
        import logging
        logging.getLogger(__name__).warning("oracle: the pause for %s failed", ck.id, exc_info=True)
    return ck


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _record_frozen(daemon: Any, ck: Any) -> None:
    from .runtime.cgroups import Freezer
    try:
        sb = daemon.runtime.get(ck.sandbox_id)
        freezer = Freezer(daemon.runtime.layout, sb.cgroup_rel)
        freezer.freeze()
    except Exception:
        _record(daemon, ck, frozen_by=None)  # not running: nothing moves
        return
    d: dict[str, float] = {}
    try:
        with daemon._inspector_pause(ck.sandbox_id, d):
            try:
                _record(daemon, ck, frozen_by="oracle")
            finally:
                freezer.thaw()
    except Exception:
        import logging
        logging.getLogger(__name__).warning("oracle: recording %s failed", ck.id, exc_info=True)


def _record(daemon: Any, ck: Any, frozen_by: str | None) -> None:
    from .runtime.cgroups import Freezer
    t = time.monotonic()
    try:
        sb = daemon.runtime.get(ck.sandbox_id)
        pid = sb.pid if sb.status in ("running", "paused") else None  # runc says paused while frozen
        procs = Freezer(daemon.runtime.layout, sb.cgroup_rel).dir / "cgroup.procs"
    except Exception:
        pid, procs = None, Path("/nonexistent")
    rec = read_state(pid, procs)
    rec.update(checkpoint=ck.id, sandbox=ck.sandbox_id, turn=ck.turn, plan=ck.plan, frozen_by=frozen_by,
               wall=time.time(), mono_ns=time.monotonic_ns() - int((time.monotonic() - t) * 1e9), read_ms=round((time.monotonic() - t) * 1000, 1))
    d = Path(daemon.options.oracle_dir)
    d.mkdir(parents=True, exist_ok=True)
    write_record(d / f"{ck.id}.json.zst", rec)


# --- comparison (pure) -----------------------------------------------------------------------------
_FIELDS = ("kind", "mode", "owner", "nlink", "size", "content", "target", "rdev", "xattrs", "data", "flags")


@dataclass
class Difference:
    """One way the restored checkpoint differs from the ground truth."""
    where: str            # "file" | "process" | "app" | "ipc" | "record"
    path: str             # mount:path, or the process's pid in the sandbox
    what: str             # e.g. "missing in checkpoint", "content", "step 3 < 4"
    truth: Any = None
    restored: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"where": self.where, "path": self.path, "what": self.what, "truth": self.truth,
                "restored": self.restored}


@dataclass
class Progress:
    """What a fork's workers did after the restore, as `compare` found it."""
    advanced: set[str] = field(default_factory=set)    # worker names whose step grew


def _fields(desc: str) -> dict[str, str]:
    return dict(zip(_FIELDS, desc.split("|")))


def _worker_of(path: str) -> str | None:
    base = path.rsplit("/", 1)[-1]
    if not base.startswith(APPEND_PREFIX):
        return None
    return base[len(APPEND_PREFIX):].split(".", 1)[0]


def _grew(truth: str, restored: str) -> bool:
    t, r = _fields(truth), _fields(restored)
    same = all(t.get(k) == r.get(k) for k in ("kind", "mode", "owner", "target", "rdev", "xattrs", "flags"))
    if not same or t.get("kind") != "f":
        return False
    tb, rb = base64.b64decode(t.get("data", "")), base64.b64decode(r.get("data", ""))
    return len(rb) >= len(tb) and rb.startswith(tb)


def _compare_pages(pid: str, t: dict[str, Any] | None, r: dict[str, Any] | None,
                   out: list[Difference], prog: Progress) -> bool:
    """True when the fork's worker ran on after the restore (its page says so)."""
    if t is None and r is None:
        return False
    if t is None or r is None:
        out.append(Difference("app", pid, "state page " + ("missing in checkpoint" if r is None else "not in truth"),
                              t, r))
        return False
    if r["step"] < t["step"] or r["spin"] < t["spin"]:
        out.append(Difference("app", pid, f"worker {t['name']} went back: step {r['step']} < {t['step']} "
                              f"or spin {r['spin']} < {t['spin']}", t, r))
        return False
    if r["step"] == t["step"]:
        if r["hash"] != t["hash"]:
            out.append(Difference("app", pid, f"worker {t['name']}: other state at step {t['step']}", t, r))
        return False
    # Ran on after the restore: its history must hold the truth's step (step 0
    # is the start; a ring that moved past it cannot tell, and is accepted).
    ring = {s: h[:32] for s, h, *_ in r["ring"]}
    if t["step"] and t["step"] >= min(ring, default=0) and ring.get(t["step"]) != t["hash"][:32]:
        out.append(Difference("app", pid, f"worker {t['name']}: its history at step {t['step']} differs", t, r))
        return False
    prog.advanced.add(t["name"])
    return True


def _held(p: dict[str, Any]) -> dict[str, str]:
    """The deleted files a process holds, by fd (`_held_deleted`'s part of its fds)."""
    return {n: d.split(" deleted", 1)[1] for n, d in (p.get("fds") or {}).items() if " deleted" in d}


_SIGCHLD_BIT = 1 << (17 - 1)


def _signals(p: dict[str, Any]) -> dict[str, str]:
    """A process's signal masks as compared. A SIGCHLD pending on crabd's own
    init (crabd/runtime/init.c) is left out: the init blocks every signal and
    reads them from a signalfd, and all it does on SIGCHLD is `reap_all()`
    (waitpid(-1, WNOHANG) until none), which it also runs after every wake-up
    of its loop; so the pending bit changes nothing it will do (a zombie whose
    SIGCHLD was lost is reaped at its next wake-up, the next exec at the
    latest, and zombies are not in the record). It is set for a moment after
    each of its children exits (a turn's command, the parent of a double
    fork), so whether a record holds it is the read instant's artefact: seen
    in a SKIP's truth, not in its parent's image, which did not have that
    child at all. CRIU keeps pending signals of the processes it dumps."""
    sig = dict(p.get("signals") or {})
    if ".crabd-init" in (p.get("cmdline") or ""):
        for k in ("SigPnd", "ShdPnd"):
            try:
                sig[k] = f"{int(sig.get(k) or '0', 16) & ~_SIGCHLD_BIT:016x}"
            except ValueError:
                pass
    return sig


def compare(truth: dict[str, Any], restored: dict[str, Any]) -> list[Difference]:
    """What differs between the ground truth of a checkpoint and the state of
    its restored fork; empty when the restore is exact (up to the fork's own
    progress since its restore: see the module docstring)."""
    out: list[Difference] = []
    prog = Progress()
    tp, rp = truth.get("processes", {}), restored.get("processes", {})
    for pid in sorted(set(tp) | set(rp), key=lambda p: int(p)):
        t, r = tp.get(pid), rp.get(pid)
        if r is None:
            out.append(Difference("process", pid, "missing in checkpoint", _proc_view(t), None))
            continue
        if t is None:
            out.append(Difference("process", pid, "not in truth (extra in checkpoint)", None, _proc_view(r)))
            continue
        for k in ("ppid", "comm", "cmdline", "oom_score_adj", "sched", "limits"):
            if t.get(k) != r.get(k):
                out.append(Difference("process", pid, k, t.get(k), r.get(k)))
        ran = _compare_pages(pid, t.get("page"), r.get("page"), out, prog)
        if _signals(t) != _signals(r) and not ran:
            out.append(Difference("process", pid, "signals", t["signals"], r["signals"]))
        if t.get("shared", {}) != r.get("shared", {}) and not ran:
            out.append(Difference("app", pid, "shared memory", t.get("shared"), r.get("shared")))
        if t.get("fds") != r.get("fds") and not ran:
            out.append(Difference("process", pid, "fds", t.get("fds"), r.get("fds")))
        elif _held(t) != _held(r):  # no worker writes the deleted file it holds: its progress excuses nothing
            out.append(Difference("process", pid, "held deleted file", _held(t), _held(r)))
    # A SysV segment a worker that ran on after the restore has attached
    # (its `shared` region holds the same bytes) changed with its progress
    ran_sysv = {h for pid, p in rp.items() if p.get("page") and p["page"]["name"] in prog.advanced
                for k, h in (p.get("shared") or {}).items() if k.startswith("sysv@")}
    ti, ri = truth.get("ipc", {}), restored.get("ipc", {})
    for obj in sorted(set(ti) | set(ri)):
        a, b = ti.get(obj), ri.get(obj)
        if a is not None and b is not None and obj.startswith("shm:") and \
                a.rsplit(" data=", 1)[0] == b.rsplit(" data=", 1)[0] and b.rsplit(" data=", 1)[1] in ran_sysv:
            continue
        if a != b:
            what = "missing in checkpoint" if obj not in ri else "not in truth (extra in checkpoint)" \
                if obj not in ti else "changed"
            out.append(Difference("ipc", obj, what, ti.get(obj), ri.get(obj)))
    tm, rm = truth.get("mounts", {}), restored.get("mounts", {})
    for mp in sorted(set(tm) | set(rm)):
        if mp not in rm:
            out.append(Difference("file", mp + ":", "mount missing in checkpoint", tm[mp]["fstype"], None))
            continue
        if mp not in tm:
            out.append(Difference("file", mp + ":", "mount not in truth", None, rm[mp]["fstype"]))
            continue
        te, re_ = tm[mp]["entries"], rm[mp]["entries"]
        if te == re_:
            continue
        for path in sorted(set(te) | set(re_)):
            a, b = te.get(path), re_.get(path)
            if a == b:
                continue
            w = _worker_of(path)
            if w is not None and w in prog.advanced and (a is None or (b is not None and _grew(a, b))):
                continue  # the fork's worker appended after its restore
            where = f"{mp}:{path}" if mp != "/" else f"/{path}"
            if b is None:
                out.append(Difference("file", where, "missing in checkpoint", _short(a), None))
            elif a is None:
                out.append(Difference("file", where, "not in truth (extra in checkpoint)", None, _short(b)))
            else:
                fa, fb = _fields(a), _fields(b)
                diff = [k for k in _FIELDS if fa.get(k) != fb.get(k) and k != "data"] or ["data"]
                out.append(Difference("file", where, ",".join(diff), _short(a), _short(b)))
    for e in truth.get("errors", []):
        out.append(Difference("record", "truth", e))
    for e in restored.get("errors", []):
        out.append(Difference("record", "checkpoint", e))
    return out


def _short(desc: str | None) -> Any:
    if desc is None:
        return None
    f = _fields(desc)
    f.pop("data", None)
    return {k: v for k, v in f.items() if v}


def _proc_view(p: dict[str, Any] | None) -> Any:
    if p is None:
        return None
    return {"comm": p["comm"], "cmdline": p["cmdline"][:120], "ppid": p["ppid"]}


def iter_records(directory: Path) -> Iterator[tuple[str, Path]]:
    for p in sorted(directory.glob("*.json.zst")):
        yield p.name[:-len(".json.zst")], p
