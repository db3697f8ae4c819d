"""Mount specs as data, and the one place that performs them.

deltafs operations return `Mount` records (like containerd's `mount.Mount`);
they never mount anything themselves. `mount_all` / `unmount` are the only
functions here that touch the kernel, through mount(2)/umount2(2) via libc so
the hot path (rollback, fork) spawns no process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import threading
from dataclasses import dataclass, field

__all__ = ["Mount", "mount_all", "unmount", "is_mountpoint", "MountError", "MountInfo", "mountinfo"]

# mount(2) flags used here (linux/mount.h).
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 0x2

_FLAG_OPTIONS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "bind": MS_BIND,
    "rbind": MS_BIND | MS_REC,
}


class MountError(OSError):
    """mount(2) or umount2(2) failed; carries the spec that failed."""


@dataclass(frozen=True)
class Mount:
    """One mount, as data: `mount -t type -o ",".join(options) source target`.

    `type` is a file-system type ("overlay", "btrfs", "bind" for a bind mount);
    `options` mixes flag words (ro, bind, rbind, nosuid, nodev) and data
    options passed to the file system (lowerdir=..., subvol=...).
    """

    type: str
    source: str
    options: tuple[str, ...] = field(default_factory=tuple)

    def split_options(self) -> tuple[int, str]:
        """(mount flags, data string) for mount(2). Pure."""
        flags = 0
        data: list[str] = []
        for opt in self.options:
            if opt in _FLAG_OPTIONS:
                flags |= _FLAG_OPTIONS[opt]
            elif opt == "rw":
                continue
            else:
                data.append(opt)
        if self.type == "bind":
            flags |= MS_BIND
        return flags, ",".join(data)

    def to_dict(self) -> dict[str, object]:
        return {"type": self.type, "source": self.source, "options": list(self.options)}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> "Mount":
        opts = d.get("options") or ()
        assert isinstance(opts, (list, tuple))
        return cls(type=str(d["type"]), source=str(d["source"]), options=tuple(str(o) for o in opts))


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount_one(m: Mount, target: str) -> None:
    flags, data = m.split_options()
    fstype = None if m.type == "bind" else m.type.encode()
    if _libc.mount(m.source.encode(), target.encode(), fstype, flags, data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise MountError(e, f"mount {m.type} {m.source} on {target} ({','.join(m.options)}): {os.strerror(e)}")
    if flags & MS_BIND and flags & MS_RDONLY:
        # A bind mount ignores MS_RDONLY on first mount; remount to apply it.
        MS_REMOUNT = 0x20
        if _libc.mount(None, target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) != 0:
            e = ctypes.get_errno()
            raise MountError(e, f"remount read-only {target}: {os.strerror(e)}")


def mount_all(mounts: list[Mount], target: str) -> None:
    """Mount every spec on `target`, in order (later ones stack on earlier)."""
    for m in mounts:
        _mount_one(m, target)


def unmount(target: str, detach: bool = False, background: bool = False) -> None:
    """Unmount `target`; a target that is not mounted is not an error.

    background=True (implies detach) returns as soon as `target` is free to
    mount on again and leaves the teardown of the old mount to a thread. The
    teardown is not free: an overlay syncs its upper file system and evicts
    every inode it cached (measured here: 57-79 ms after a 15k-entry,
    256 MiB sandbox, seconds when the fs is busy). The kernel runs it when
    the last reference is dropped, in the task that drops it, so we hold an
    O_PATH reference across the detach and drop it in a daemon thread.
    Rollback uses this: the sandbox root is free for the new mount at once.
    """
    ref = -1
    if background:
        detach = True
        try:
            ref = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            ref = -1
    if _libc.umount2(target.encode(), MNT_DETACH if detach else 0) != 0:
        e = ctypes.get_errno()
        if ref >= 0:
            os.close(ref)
        if e in (errno.EINVAL, errno.ENOENT):
            return
        raise MountError(e, f"umount {target}: {os.strerror(e)}")
    if ref >= 0:
        threading.Thread(target=os.close, args=(ref,), name="deltafs-unmount", daemon=True).start()


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/self/mountinfo (the fields deltafs needs)."""

    dev: str  # "major:minor" of the mounted file system
    root: str  # path inside that file system mounted here (a bind mount's source)
    target: str
    fstype: str
    source: str
    super_options: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mountinfo() -> list[MountInfo]:
    """This process's mount table."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            a, b = left.split(" "), right.split(" ")
            out.append(MountInfo(dev=a[2], root=_unescape(a[3]), target=_unescape(a[4]), fstype=b[0],
                                 source=_unescape(b[1]), super_options=b[2] if len(b) > 2 else ""))
    return out


def unmount_below(path: str) -> list[str]:
    """Detach every mount strictly below `path`, deepest first (a lazy
    unmount also takes the mounts stacked under each). Returns the targets
    still mounted there afterwards (none, normally)."""
    real = os.path.realpath(path) + "/"
    for _ in range(8):  # mounts stacked on one target come off one per round
        below = sorted({m.target for m in mountinfo() if m.target.startswith(real)}, key=len, reverse=True)
        if not below:
            return []
        for target in below:
            try:
                unmount(target, detach=True)
            except MountError:
                pass
    return sorted({m.target for m in mountinfo() if m.target.startswith(real)})


def is_mountpoint(path: str) -> bool:
    """True when `path` is listed as a mount point in /proc/self/mountinfo."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            mp = line.split(b" ")[4].decode("unicode_escape")
            if mp == real:
                return True
    return False
