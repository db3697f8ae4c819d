"""File trees inside snapshots: scanning, diffing and copying hostile content.

Everything below a snapshot root is written by the sandbox and therefore
hostile: a symlink may point at /etc/shadow, a fifo would block an open(),
a "file" may be a 10 GiB sparse file. So this module

* never follows a symlink: directories are opened with O_NOFOLLOW relative to
  their parent's fd (dir_fd), entries are lstat'ed, symlinks are re-created
  from their target text;
* never opens anything but regular files and directories: fifos, sockets and
  device nodes are re-created with mknod(2);
* copies regular files by reflink (FICLONE) when the file system supports it,
  otherwise data segment by data segment (SEEK_DATA/SEEK_HOLE), so holes stay
  holes;
* keeps hard-link groups (by (st_dev, st_ino)) and xattrs.

The pure half (`Entry`, `Change`, `diff_entries`) works on in-memory models
and is what `Snapshotter.diff` returns; the I/O half (`scan`, `Copier`) is
used by both drivers.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field
from typing import Iterable, Iterator

__all__ = ["Entry", "Change", "scan", "diff_entries", "diff_paths", "Copier", "kind_of", "remove_tree", "open_dir", "copy_tree"]

# linux/fs.h: FICLONE = _IOW(0x94, 9, int) (verified against the C header here).
FICLONE = 0x40049409
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_KINDS = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "char",
    stat.S_IFBLK: "block",
}
_IFMT = {v: k for k, v in _KINDS.items()}


def kind_of(mode: int) -> str:
    return _KINDS[stat.S_IFMT(mode)]


@dataclass(frozen=True)
class Entry:
    """One path in a tree, as compared by `diff_entries`.

    `path` is relative to the snapshot root, b"" for the root itself, with
    b"/" separators; names are bytes because sandbox names need not be UTF-8.
    `ino`/`nlink` are kept to find hard-link groups, not compared.
    """

    path: bytes
    kind: str
    mode: int  # permission bits incl. suid/sgid/sticky (stat.S_IMODE)
    uid: int
    gid: int
    size: int
    mtime_ns: int
    rdev: int = 0
    target: bytes | None = None  # symlink text
    xattrs: tuple[tuple[str, bytes], ...] = ()
    allocated: int = 0  # bytes actually allocated (st_blocks * 512)
    ino: int = field(default=0, compare=False)
    nlink: int = field(default=1, compare=False)

    def same_content_as(self, other: "Entry") -> bool:
        """Metadata quick check (like rsync's): equal type, perms, owner, size, mtime, target, xattrs."""
        return (
            self.kind == other.kind
            and self.mode == other.mode
            and self.uid == other.uid
            and self.gid == other.gid
            and (self.kind == "dir" or self.size == other.size)
            and (self.kind == "dir" or self.mtime_ns == other.mtime_ns)
            and self.rdev == other.rdev
            and self.target == other.target
            and self.xattrs == other.xattrs
        )


@dataclass(frozen=True)
class Change:
    """One difference between two trees: `kind` is added, modified or deleted.

    `type` and `size` describe the entry in the newer tree (the older one for
    deletions).
    """

    kind: str
    path: bytes
    type: str
    size: int


def diff_entries(a: dict[bytes, Entry], b: dict[bytes, Entry]) -> list[Change]:
    """Changes that turn tree `a` into tree `b`. Pure.

    A directory whose own metadata is unchanged is not reported even when its
    mtime moved because children changed (the children are). A type change
    is a deletion plus an addition, as in containerd's continuity diff.
    """
    out: list[Change] = []
    for path, eb in b.items():
        ea = a.get(path)
        if ea is None:
            if path == b"":  # the root always exists; diff(None, b) does not "add" it
                continue
            out.append(Change("added", path, eb.kind, eb.size))
        elif ea.kind != eb.kind:
            out.append(Change("deleted", path, ea.kind, ea.size))
            out.append(Change("added", path, eb.kind, eb.size))
        elif not ea.same_content_as(eb):
            out.append(Change("modified", path, eb.kind, eb.size))
    for path, ea in a.items():
        if path not in b and path != b"":
            out.append(Change("deleted", path, ea.kind, ea.size))
    out.sort(key=lambda c: (c.path, c.kind != "deleted"))
    return out


def open_dir(path: str | bytes) -> int:
    """Open a trusted directory (a snapshot root we created) for fd-relative walking."""
    return os.open(path, O_DIR)


def _xattrs(dir_fd: int, name: bytes, kind: str, skip_prefix: str | None = None) -> tuple[tuple[str, bytes], ...]:
    # listxattr has no *at() form; /proc/self/fd/N/<name> resolves the trusted
    # dir fd and then `name` without following it (follow_symlinks=False).
    p = b"/proc/self/fd/%d/%s" % (dir_fd, name) if name else b"/proc/self/fd/%d" % dir_fd
    try:
        names = os.listxattr(p, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EPERM):
            return ()
        raise
    out = []
    for n in sorted(names):
        if skip_prefix and n.startswith(skip_prefix):
            continue
        try:
            out.append((n, os.getxattr(p, n, follow_symlinks=False)))
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
    return tuple(out)


def _entry(path: bytes, st: os.stat_result, dir_fd: int, name: bytes, xattrs: bool,
           skip_xattr_prefix: str | None) -> Entry:
    kind = kind_of(st.st_mode)
    target = os.readlink(name, dir_fd=dir_fd) if kind == "symlink" else None
    return Entry(
        path=path,
        kind=kind,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size if kind in ("file", "symlink") else 0,
        mtime_ns=st.st_mtime_ns,
        rdev=st.st_rdev if kind in ("char", "block") else 0,
        target=os.fsencode(target) if target is not None else None,
        xattrs=_xattrs(dir_fd, name, kind, skip_xattr_prefix) if xattrs else (),
        allocated=st.st_blocks * 512,
        ino=st.st_ino,
        nlink=st.st_nlink,
    )


def open_rel(root_fd: int, rel: bytes) -> int:
    """Open directory `rel` below `root_fd` one component at a time, never
    following a symlink (O_NOFOLLOW on every step)."""
    fd = os.dup(root_fd)
    for part in rel.split(b"/") if rel else ():
        try:
            nfd = os.open(part, O_DIR, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nfd
    return fd


def walk_fd(root_fd: int) -> Iterator[tuple[bytes, int, bytes, os.stat_result]]:
    """Yield (relative path, parent dir fd, name, lstat) for every entry below `root_fd`, parents first.

    The parent fd is valid only until the generator advances past that dir.
    One directory fd is open at a time (plus `root_fd`): pending directories
    are kept as paths and reopened component by component, so neither a
    directory with 100k subdirectories nor a chain 100k levels deep runs
    out of file descriptors (or of recursion depth).
    """
    stack: list[bytes] = [b""]
    while stack:
        rel = stack.pop()
        fd = open_rel(root_fd, rel)
        try:
            with os.scandir(fd) as it:
                names = sorted(os.fsencode(e.name) for e in it)
            for name in names:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                path = rel + b"/" + name if rel else name
                yield path, fd, name, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)
        finally:
            os.close(fd)


def scan(root: str | bytes, *, xattrs: bool = True, skip_xattr_prefix: str | None = None) -> dict[bytes, Entry]:
    """Every entry of the tree at `root` (root itself at b""), never following symlinks."""
    fd = open_dir(root)
    try:
        out = {b"": _entry(b"", os.fstat(fd), fd, b"", xattrs, skip_xattr_prefix)}
        for path, pfd, name, st in walk_fd(fd):
            out[path] = _entry(path, st, pfd, name, xattrs, skip_xattr_prefix)
        return out
    finally:
        os.close(fd)



def _lookup(root_fd: int, path: bytes, xattrs: bool) -> Entry | None:
    """The Entry at `path` below `root_fd`, or None when it (or a directory on
    the way) is not there; never follows a symlink, the last component's
    included."""
    if not path:
        return _entry(b"", os.fstat(root_fd), root_fd, b"", xattrs, None)
    parent, _, name = path.rpartition(b"/")
    try:
        fd = open_rel(root_fd, parent)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink on the way: nothing of the path is below it
            return None
        raise
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    else:
        return _entry(path, st, fd, name, xattrs, None)
    finally:
        os.close(fd)


def diff_paths(old: dict[bytes, Entry], root: str | bytes, candidates: Iterable[bytes], *,
               xattrs: bool = True) -> tuple[list[Change], dict[bytes, Entry]]:
    """`diff_entries(old, scan(root))` and that new tree, looking at the tree
    at `root` only where it may differ from `old`: the `candidates` (every
    path at which an entry was created, changed, removed or renamed to or
    from, e.g. what a btrfs send stream names). A directory that is new at
    its path (created, or renamed there: its inode is not the one `old` had
    there) brings its whole subtree in; one gone from its path takes its old
    subtree with it. Correct when the candidates are complete in that sense;
    paths that exist on neither side change nothing."""
    root_fd = open_dir(root)
    try:
        old_keys = sorted(old)
        old_part: dict[bytes, Entry] = {}
        new_part: dict[bytes, Entry] = {}
        seen: set[bytes] = set()

        def old_below(p: bytes) -> list[bytes]:
            lo = p + b"/" if p else b""
            i = bisect.bisect_left(old_keys, lo)
            out = []
            while i < len(old_keys) and old_keys[i].startswith(lo):
                if old_keys[i]:
                    out.append(old_keys[i])
                i += 1
            return out

        # A change to an inode shows at every name it has; send names one of
        # them: the other links of a hard-link group are looked at too.
        links: dict[int, list[bytes]] = {}
        for path, e in old.items():
            if e.kind != "dir" and e.nlink > 1:
                links.setdefault(e.ino, []).append(path)
        stack = list(candidates)
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            eo = old.get(p)
            en = new_part.get(p) or _lookup(root_fd, p, xattrs)
            if eo is not None:
                old_part[p] = eo
            if en is not None:
                new_part[p] = en
            for side in (eo, en):
                if side is not None and side.kind != "dir" and side.nlink > 1:
                    stack.extend(links.get(side.ino, ()))
            if en is not None and en.kind == "dir" and (eo is None or eo.kind != "dir" or eo.ino != en.ino):
                fd = open_rel(root_fd, p)
                try:
                    for rel, pfd, name, st in walk_fd(fd):
                        q = p + b"/" + rel if p else rel
                        new_part[q] = _entry(q, st, pfd, name, xattrs, None)
                        stack.append(q)
                finally:
                    os.close(fd)
            if eo is not None and eo.kind == "dir" and (en is None or en.kind != "dir" or eo.ino != en.ino):
                stack.extend(old_below(p))
        new = dict(old)
        for p in old_part:
            if p not in new_part:
                del new[p]
        new.update(new_part)
        return diff_entries(old_part, new_part), new
    finally:
        os.close(root_fd)


def _copy_data(src: int, dst: int, size: int) -> str:
    """Copy a regular file's bytes; returns "reflink" or "copy". Holes stay holes."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return "reflink"
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EBADF):
            raise
    off = 0
    while off < size:
        try:
            data = os.lseek(src, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole remains
                break
            raise
        hole = os.lseek(src, data, os.SEEK_HOLE)
        pos = data
        while pos < hole:
            n = os.copy_file_range(src, dst, hole - pos, pos, pos)
            if n == 0:
                break
            pos += n
        off = hole
    os.ftruncate(dst, size)
    return "copy"


def _set_xattrs_path(p: bytes, xattrs: tuple[tuple[str, bytes], ...]) -> None:
    for n, v in xattrs:
        try:
            os.setxattr(p, n, v, follow_symlinks=False)
        except OSError as e:
            # user.* xattrs cannot exist on symlinks/devices; the source could not have had them.
            if e.errno not in (errno.EPERM, errno.ENOTSUP):
                raise


class Copier:
    """Copies entries from a source tree into a destination tree, both open as dir fds.

    Keeps hard-link groups within one copier's lifetime (a layer capture is
    one copier). `xattr_filter(name) -> bool` decides which xattrs to carry
    (overlay strips its own trusted.overlay.* bookkeeping).
    """

    def __init__(self, dst_root_fd: int, xattr_filter=None) -> None:
        self.dst_root_fd = dst_root_fd
        self.links: dict[tuple[int, int], bytes] = {}
        self.xattr_filter = xattr_filter
        self.bytes_copied = 0
        self.reflinks = 0
        self.entries = 0

    def _dst_path(self, rel: bytes) -> bytes:
        return b"/proc/self/fd/%d/%s" % (self.dst_root_fd, rel)

    def copy(self, src_dir_fd: int, name: bytes, st: os.stat_result, dst_rel: bytes,
             extra_xattrs: tuple[tuple[str, bytes], ...] = ()) -> None:
        """Create `dst_rel` (relative to the destination root) as a copy of `name` in `src_dir_fd`.

        Directories are created empty (children are the caller's business);
        call `finish_dir` after the children to restore the dir's mtime.
        """
        self.entries += 1
        kind = kind_of(st.st_mode)
        d = self.dst_root_fd
        key = (st.st_dev, st.st_ino)
        if kind != "dir" and st.st_nlink > 1 and key in self.links:
            os.link(self.links[key], dst_rel, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
            return
        xattrs = _xattrs(src_dir_fd, name, kind)
        if self.xattr_filter is not None:
            xattrs = tuple(x for x in xattrs if self.xattr_filter(x[0]))
        xattrs = xattrs + extra_xattrs
        if kind == "file":
            sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_dir_fd)
            try:
                fst = os.fstat(sfd)
                if not stat.S_ISREG(fst.st_mode) or fst.st_ino != st.st_ino:
                    raise OSError(errno.ESTALE, f"{name!r} changed while copying (tree not frozen?)")
                dfd = os.open(dst_rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=d)
                try:
                    if _copy_data(sfd, dfd, fst.st_size) == "reflink":
                        self.reflinks += 1
                    else:
                        self.bytes_copied += fst.st_blocks * 512
                    os.fchown(dfd, st.st_uid, st.st_gid)
                    os.fchmod(dfd, stat.S_IMODE(st.st_mode))  # after chown: chown clears suid
                    for n, v in xattrs:
                        os.setxattr(dfd, n, v)
                    os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
                finally:
                    os.close(dfd)
            finally:
                os.close(sfd)
        elif kind == "dir":
            os.mkdir(dst_rel, 0o700, dir_fd=d)
            os.chown(dst_rel, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
            os.chmod(dst_rel, stat.S_IMODE(st.st_mode), dir_fd=d)
            _set_xattrs_path(self._dst_path(dst_rel), xattrs)
        elif kind == "symlink":
            os.symlink(os.readlink(name, dir_fd=src_dir_fd), dst_rel, dir_fd=d)
            os.chown(dst_rel, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
            _set_xattrs_path(self._dst_path(dst_rel), xattrs)
            os.utime(dst_rel, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
        else:
            # fifo, socket, char, block: never opened, re-created.
            os.mknod(dst_rel, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev, dir_fd=d)
            os.chown(dst_rel, st.st_uid, st.st_gid, dir_fd=d, follow_symlinks=False)
            os.chmod(dst_rel, stat.S_IMODE(st.st_mode), dir_fd=d)
            _set_xattrs_path(self._dst_path(dst_rel), xattrs)
            os.utime(dst_rel, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d, follow_symlinks=False)
        if kind != "dir" and st.st_nlink > 1:
            self.links[key] = dst_rel

    def finish_dir(self, dst_rel: bytes, st: os.stat_result) -> None:
        """Restore a copied directory's times after its children were created."""
        if dst_rel:
            os.utime(dst_rel, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=self.dst_root_fd, follow_symlinks=False)
        else:
            os.utime(self.dst_root_fd, ns=(st.st_atime_ns, st.st_mtime_ns))

    def whiteout(self, dst_rel: bytes) -> None:
        """An overlay whiteout: a 0/0 character device."""
        self.entries += 1
        os.mknod(dst_rel, stat.S_IFCHR | 0o000, 0, dir_fd=self.dst_root_fd)


def copy_root_meta(src_fd: int, dst_fd: int, xattr_filter=None) -> None:
    """Give a destination root dir the owner, mode and xattrs of a source root dir."""
    st = os.fstat(src_fd)
    os.fchown(dst_fd, st.st_uid, st.st_gid)
    os.fchmod(dst_fd, stat.S_IMODE(st.st_mode))
    for n, v in _xattrs(src_fd, b"", "dir"):
        if xattr_filter is None or xattr_filter(n):
            os.setxattr(dst_fd, n, v)


def copy_tree(src: str | bytes, dst: str | bytes) -> Copier:
    """Copy everything below directory `src` into the existing empty directory `dst`."""
    sfd, dfd = open_dir(src), open_dir(dst)
    try:
        copier = Copier(dfd)
        copy_root_meta(sfd, dfd)
        dirs = []
        for path, pfd, name, st in walk_fd(sfd):
            copier.copy(pfd, name, st, path)
            if stat.S_ISDIR(st.st_mode):
                dirs.append((path, st))
        for path, st in reversed(dirs):
            copier.finish_dir(path, st)
        copier.finish_dir(b"", os.fstat(sfd))
        return copier
    finally:
        os.close(sfd)
        os.close(dfd)


def remove_tree(path: str | bytes) -> None:
    """rm -rf without following symlinks; a missing path is fine."""
    try:
        fd = os.open(path, O_DIR)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            os.unlink(path)
            return
        raise
    try:
        _empty_dir(fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _empty_dir(fd: int) -> None:
    """Delete everything below `fd`, without recursion and with one extra fd
    open at a time (a hostile tree may be 100k levels deep or wide)."""
    stack: list[bytes] = [b""]
    while stack:
        rel = stack[-1]
        dfd = open_rel(fd, rel)
        try:
            with os.scandir(dfd) as it:
                names = [os.fsencode(e.name) for e in it]
            subdirs = []
            for name in names:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append(rel + b"/" + name if rel else name)
                else:
                    os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        if subdirs:
            stack.extend(subdirs)  # emptied first; this dir is listed again after them
            continue
        stack.pop()
        if rel:
            parent, _, base = rel.rpartition(b"/")
            pfd = open_rel(fd, parent)
            try:
                os.rmdir(base, dir_fd=pfd)
            finally:
                os.close(pfd)
