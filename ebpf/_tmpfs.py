"""The tmpfs check: did a memory-backed file system of the sandbox change
since the last turn end?

A sandbox's /dev, /dev/shm (tmpfs) and /dev/mqueue (mqueue) live in memory:
the deltafs snapshot does not hold them, only the CRIU process image does.
So a turn that changed one must be FS_PROC. Both inspectors take a
*manifest* of every such mount at each turn end (and at `watch`), and any
difference with the previous one is reported as a tmpfs write
(`Effects.special_writes["tmpfs"]`, one sample per changed path), which the
classifier turns into FS_PROC.

Why a scan of the state, not a better reading of the syscalls (issue 14, C):
the BPF program records each path as the syscall passed it, so a write to
`rel.txt` after `cd /dev/shm`, to `shm/x` after `cd /dev`, through a
symlink `/work/shm -> /dev/shm`, through an `openat` dirfd, or through a
shared mapping (no syscall at all), does not name the tmpfs. The choices:
- Reading the mount a path landed on in the kernel: done for opens (the
  new fd's file, at the open's exit; ebpf/_btf.py takes the struct offsets
  from the running kernel's BTF, since bcc compiles against Debian's 6.12
  headers on a 6.18 kernel and those offsets differ). It covers writes
  through an fd that was opened for writing, not a shared mapping that
  outlives its fd or a file opened in an earlier turn, and it is off
  without BTF: the scan below stays the rule for tmpfs.
- Resolving relative, dirfd and symlink paths from user space
  (/proc/PID/cwd, /proc/PID/fd/N at event time) is racy: the shell of
  `cd /dev/shm && echo x > f` has exited before the event is read.
- Comparing the state itself is sound by construction: whatever path,
  fd, mapping or helper process changed a file, the file differs. It is
  cheap because these mounts are small (a busybox sandbox's /dev has ~20
  entries, /dev/shm is usually empty); see README "tmpfs check" for the
  measured cost. The event rule (`path_scope`: an absolute /dev path is
  tmpfs) stays as a second, independent reason.

What a manifest holds, per mount (keyed by mount namespace and mount point,
from /proc/PID/mountinfo, fstype in `MEMORY_FS`): per entry its type, inode,
mode, owner, link count, size, mtime and ctime (ctime moves on every write,
chmod, chown, xattr change and rename through a syscall), a symlink's
target, the xattr names of files and directories, and a digest of every
regular file's content: a store into a shmem page already mapped writable
(MAP_SHARED) moves neither mtime nor ctime (checked on this kernel: only
the first store after the mapping does). Device nodes keep no times: a tty
write bumps its node's mtime (tty_update_time), which is not state a
rollback has to restore. atime is left out (reads move it); the scan opens
with O_NOATIME so it does not move it itself.

How it reads: through /proc/PID/root of a sandbox process (one per mount
namespace), walking from directory fds with O_NOFOLLOW, so a symlink the
sandbox planted is never followed on the host side; only regular files are
opened (a fifo or device node opened by the host could have effects), and
a file that changed type between the stat and the open is "unknown".
Entries on another device are nested mount points: only their name is kept
(a memory one is scanned as its own mount). Mounts under the watcher's
`outside` paths (crabd's exec fifos in /dev/.crabd) are skipped.

Why not deltafs.tree.walk_fd, which also walks from directory fds with
O_NOFOLLOW: that one reads a frozen snapshot and fails on a race, while
this one reads live mounts of a running sandbox, so every step here is
different on purpose: a vanished entry or an unopenable directory becomes
an unknown entry instead of an error, a directory is described from its
opened fd (what was actually walked), the walk stops at another device,
opens with O_NOATIME (the sandbox's files must not change by being read),
and is held to budgets of entries, bytes and depth.

When the scan cannot tell (a budget of entries or bytes exceeded, a mount
or directory that cannot be opened, a race), the entry is *unknown*: an
unknown entry never equals another one, so the turn is FS_PROC.
"""

from __future__ import annotations

import itertools
import os
import posixpath
import stat
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import blake3

# File systems whose content lives only in memory (a process checkpoint
# holds it, a deltafs snapshot does not).
MEMORY_FS = frozenset({"tmpfs", "ramfs", "mqueue"})
MAX_ENTRIES = 20_000  # per sandbox and scan, all mounts together
MAX_BYTES = 64 << 20  # of regular-file content digested per sandbox and scan
MAX_DEPTH = 64

Entry = tuple[object, ...]
# (mount namespace inode, mount point) -> relative path ("" = the mount's root) -> entry
Manifest = dict[tuple[int, str], dict[str, Entry]]

_unknown_serial = itertools.count()


def unknown(why: str) -> Entry:
    """An entry that equals no other: the scan could not tell, so it counts as changed."""
    return ("unknown", why, next(_unknown_serial))


def is_unknown(entry: Entry | None) -> bool:
    return entry is not None and entry[0] == "unknown"


# -- pure logic: mountinfo, and the comparison of two manifests

@dataclass(frozen=True)
class Mount:
    mount_id: int
    dev: tuple[int, int]  # major, minor
    mount_point: str  # as the reading process sees it
    fstype: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of /proc/PID/mountinfo, in its order (a later mount on the
    same point is on top of an earlier one)."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f = left.split(" ")
        if len(f) < 5:
            continue
        major, _, minor = f[2].partition(":")
        out.append(Mount(int(f[0]), (int(major), int(minor)), _unescape(f[4]), right.split(" ", 1)[0]))
    return out


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def memory_mounts(mounts: list[Mount], outside: Iterable[str] = ()) -> list[Mount]:
    """The memory-backed mounts to scan: those not under an `outside` prefix.

    A mount hidden by a later one on the same point (or on a parent) is
    still listed: `scan_mount` finds another device at its path and keeps a
    constant marker for it. It can only change through a descriptor or a
    cwd a process already holds there; such a process is alive, so the
    classifier's process rules cover it."""
    outside = tuple(posixpath.normpath(p) for p in outside)
    return [m for m in mounts if m.fstype in MEMORY_FS and not _under(m.mount_point, outside)]


def changed_paths(old: Manifest, new: Manifest) -> list[str]:
    """Paths (mount point joined with the entry's path) whose entry differs
    between two manifests, sorted; a mount present in only one of them
    counts as changed as a whole. Unknown entries always differ."""
    out: set[str] = set()
    for key in old.keys() | new.keys():
        mount_point = key[1] or "?"
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            out.add(mount_point)
            continue
        for rel in a.keys() | b.keys():
            ea, eb = a.get(rel), b.get(rel)
            if ea != eb or is_unknown(eb):
                out.add(posixpath.join(mount_point, rel) if rel else mount_point)
    return sorted(out)


# -- what touches /proc

class MemoryFs(Protocol):
    """The seam between the inspectors and the sandbox's memory file systems."""

    def manifest(self, pids: Iterable[int], outside: tuple[str, ...] = ()) -> Manifest: ...


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOATIME
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOATIME


class _Budget:
    def __init__(self, entries: int, content: int) -> None:
        self.entries, self.bytes = entries, content


class _OverBudget(Exception):
    pass


def _xattrs(fd: int) -> tuple[str, ...]:
    try:
        return tuple(sorted(os.listxattr(fd)))
    except OSError:
        return ("?",)


def _digest(fd: int, size: int, budget: _Budget) -> str:
    if size > budget.bytes:
        raise _OverBudget(f"more than {MAX_BYTES} bytes of file content")
    h = blake3.blake3()
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        budget.bytes -= len(chunk)
        if budget.bytes < 0:
            raise _OverBudget(f"more than {MAX_BYTES} bytes of file content")
        h.update(chunk)
    return h.hexdigest()


def _entry(dir_fd: int, name: str, st: os.stat_result, budget: _Budget) -> Entry:
    fmt = stat.S_IFMT(st.st_mode)
    base = (fmt, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_nlink)
    if fmt == stat.S_IFLNK:
        return base + (st.st_mtime_ns, st.st_ctime_ns, os.readlink(name, dir_fd=dir_fd))
    if fmt in (stat.S_IFCHR, stat.S_IFBLK):
        return base + (st.st_rdev,)
    if fmt != stat.S_IFREG:  # fifo, socket (directories are handled by the walk)
        return base + (st.st_mtime_ns, st.st_ctime_ns)
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # O_NOATIME needs ownership or CAP_FOWNER
        fd = os.open(name, _FILE_FLAGS & ~os.O_NOATIME, dir_fd=dir_fd)
    try:
        fst = os.fstat(fd)
        if fst.st_ino != st.st_ino or not stat.S_ISREG(fst.st_mode):
            return unknown("replaced while read")
        digest = _digest(fd, fst.st_size, budget)
        # a write(2) during the read moves ctime past the fstat above: the
        # next scan differs
        return base + (fst.st_size, fst.st_mtime_ns, fst.st_ctime_ns, digest, _xattrs(fd))
    finally:
        os.close(fd)


def _walk(dir_fd: int, rel: str, dev: int, out: dict[str, Entry], budget: _Budget, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _OverBudget(f"deeper than {MAX_DEPTH} directories")
    for name in sorted(os.listdir(dir_fd)):
        budget.entries -= 1
        if budget.entries < 0:
            raise _OverBudget(f"more than {MAX_ENTRIES} entries")
        path = posixpath.join(rel, name) if rel else name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            out[path] = unknown("removed while read")
            continue
        if st.st_dev != dev:
            out[path] = ("mount",)  # a nested mount point: scanned on its own if in memory
            continue
        if not stat.S_ISDIR(st.st_mode):
            try:
                out[path] = _entry(dir_fd, name, st, budget)
            except OSError as e:
                out[path] = unknown(e.strerror or "error")
            continue
        try:
            sub = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except OSError as e:
            out[path] = unknown(e.strerror or "error")
            continue
        try:
            dst = os.fstat(sub)
            out[path] = (stat.S_IFDIR, dst.st_ino, dst.st_mode, dst.st_uid, dst.st_gid, dst.st_nlink,
                         dst.st_mtime_ns, dst.st_ctime_ns, _xattrs(sub))
            _walk(sub, path, dev, out, budget, depth + 1)
        finally:
            os.close(sub)


def _open_parent(root_fd: int, mount_point: str) -> tuple[int, str | None]:
    """(directory fd, name) of `mount_point`, walked from the sandbox's root
    one component at a time, never following a symlink; name None for "/"."""
    parts = [p for p in mount_point.split("/") if p]
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd, (parts[-1] if parts else None)
    except BaseException:
        os.close(fd)
        raise


def scan_mount(root_fd: int, mount: Mount, budget: _Budget) -> dict[str, Entry]:
    """The manifest of one mount, read through the sandbox's root fd."""
    try:
        parent, name = _open_parent(root_fd, mount.mount_point)
    except OSError as e:
        return {"": unknown(f"cannot open {mount.mount_point}: {e.strerror}")}
    try:
        st = os.stat(name or ".", dir_fd=parent, follow_symlinks=False)
        if (os.major(st.st_dev), os.minor(st.st_dev)) != mount.dev:
            return {"": ("hidden",)}  # mounted over: see memory_mounts
        if not stat.S_ISDIR(st.st_mode):
            # a file bind-mounted from a memory file system (runc masks
            # /proc/keys with /dev/null that way)
            return {"": _entry(parent, name or ".", st, budget)}
        fd = os.open(name or ".", _DIR_FLAGS, dir_fd=parent)
    except _OverBudget as e:
        return {"": unknown(str(e))}
    except OSError as e:
        return {"": unknown(f"cannot open {mount.mount_point}: {e.strerror}")}
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        out: dict[str, Entry] = {
            "": (stat.S_IFDIR, st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_nlink,
                 st.st_mtime_ns, st.st_ctime_ns, _xattrs(fd)),
        }
        try:
            _walk(fd, "", st.st_dev, out, budget, 0)
        except _OverBudget as e:
            return {"": unknown(str(e))}
        except OSError as e:
            out[""] = unknown(f"{mount.mount_point}: {e.strerror}")
        return out
    finally:
        os.close(fd)


class HostMemoryFs:
    """Reads the memory file systems of the sandbox's processes through /proc."""

    def __init__(self, proc: str = "/proc", max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        self._proc = proc
        self._max_entries, self._max_bytes = max_entries, max_bytes

    def _ns(self, pid: int | str) -> int | None:
        try:
            return os.stat(f"{self._proc}/{pid}/ns/mnt").st_ino
        except OSError:
            return None

    def _scan_ns(self, pid: int, ns: int, outside: tuple[str, ...], budget: _Budget) -> Manifest | None:
        """None when `pid` is gone (or no longer in `ns`): try another one."""
        try:
            with open(f"{self._proc}/{pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                mounts = parse_mountinfo(f.read())
            root = os.open(f"{self._proc}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if self._ns(pid) != ns:  # the pid was reused between the two reads
                return None
            return {(ns, m.mount_point): scan_mount(root, m, budget) for m in memory_mounts(mounts, outside)}
        finally:
            os.close(root)

    def manifest(self, pids: Iterable[int], outside: tuple[str, ...] = ()) -> Manifest:
        # A process in the watcher's own mount namespace (a test's host
        # shell, never a runc sandbox) sees the host's mounts: those are no
        # sandbox's state, no process checkpoint of it would hold them, and
        # the host's /run, /dev/shm and cgroup tmpfs are big and busy.
        host = self._ns("self")
        by_ns: dict[int, list[int]] = {}
        for pid in sorted(pids):
            ns = self._ns(pid)
            if ns is not None and ns != host:
                by_ns.setdefault(ns, []).append(pid)
        budget = _Budget(self._max_entries, self._max_bytes)
        out: Manifest = {}
        for ns, members in by_ns.items():
            for pid in members:
                got = self._scan_ns(pid, ns, outside, budget)
                if got is not None:
                    out.update(got)
                    break
            else:
                out[(ns, "")] = {"": unknown("no process of this mount namespace could be read")}
        return out


def rescan(memfs: MemoryFs | None, last: Manifest, pids: Iterable[int],
           outside: tuple[str, ...]) -> tuple[list[str] | None, Manifest]:
    """(paths changed since `last`, the new manifest), for an inspector's
    watch and end_turn; (None, last) when the check is off. A scan that
    fails outright counts as a change: the turn is then FS_PROC."""
    if memfs is None:
        return None, last
    try:
        now = memfs.manifest(pids, outside)
    except Exception as e:  # noqa: BLE001 - a bug here must not hide a change
        return [f"? (tmpfs check failed: {e!r:.80})"], {(0, ""): {"": unknown("scan failed")}}
    return changed_paths(last, now), now


def _main(argv: list[str]) -> int:
    """`python -m ebpf._tmpfs PID [REPEAT]`: print the manifest of PID's
    memory mounts and the time one scan takes (for the README's cost figure)."""
    pid, repeat = int(argv[0]), int(argv[1]) if len(argv) > 1 else 1
    fs = HostMemoryFs()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        m = fs.manifest([pid], ("/dev/.crabd",))
        times.append(time.perf_counter() - t)
    for (ns, mp), entries in sorted(m.items()):
        print(f"mnt:[{ns}] {mp}: {len(entries)} entries")
        for rel in sorted(entries):
            print(f"  {rel or '.'}: {entries[rel]}")
    times.sort()
    print(f"scans: {repeat}, median {times[len(times) // 2] * 1e3:.3f} ms, max {times[-1] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
