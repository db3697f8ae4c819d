"""Capture modes: what a turn-end checkpoint saves, whatever the classifier planned.

* ``auto`` (default): the classifier's plan (SKIP / FS / FS_PROC).
* ``fs-only``: never dump processes: FS_PROC becomes FS (SKIP stays SKIP).
  Such a checkpoint holds no process image and does not inherit its
  parent's, since the turn ran the sandbox's processes.
* ``full``: every turn a CRIU dump of the processes AND a tar copy of every
  file that differs from the image: the baseline of what `docker commit` /
  `podman checkpoint --export` per turn amounts to. Its `bytes` count the raw
  bytes of both.

The mode is daemon-wide (`crabd serve --capture`, config key `capture`); the
mode a checkpoint was opened under is written into its reasons, so a capture
that runs after a restart in another mode still does what was planned.
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path
from typing import Iterable

__all__ = ["MODES", "FS_ONLY_REASON", "FULL_REASON", "apply_mode", "write_full_copy"]

MODES = ("auto", "fs-only", "full")
FS_ONLY_REASON = "capture mode fs-only: processes not dumped"
FULL_REASON = "capture mode full: processes dumped and changed files copied every turn"


def apply_mode(kind: str, reasons: Iterable[str], mode: str) -> tuple[str, list[str]]:
    """The plan a checkpoint gets under capture `mode`, from the classifier's `kind`. Pure."""
    reasons = list(reasons)
    if mode == "auto":
        return kind, reasons
    if mode == "fs-only":
        if kind == "FS_PROC":
            return "FS", reasons + [FS_ONLY_REASON]
        return kind, reasons
    if mode == "full":
        return "FS_PROC", reasons + [FULL_REASON]
    raise ValueError(f"unknown capture mode {mode!r}: one of {', '.join(MODES)}")


_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(root_fd: int, path: bytes) -> tuple[int, bytes]:
    """(fd of the directory holding `path`, its last name), walking each
    component with O_NOFOLLOW: a symlink anywhere on the way is an error,
    never followed out of the tree."""
    parts = [p for p in path.split(b"/") if p]
    if not parts or any(p in (b".", b"..") for p in parts):
        raise ValueError(f"bad path in a snapshot tree: {path!r}")
    fd = os.dup(root_fd)
    try:
        for comp in parts[:-1]:
            nfd = os.open(comp, _O_DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def write_full_copy(root: str | Path, paths: Iterable[bytes], deleted: Iterable[bytes], out: str | Path) -> int:
    """Tar the entries `paths` (relative, from a snapshot diff) of the read-only
    tree at `root` into `out`; never follows a symlink of the tree (a symlink is
    stored as a symlink). `deleted` paths are listed in a member
    ``.crabd-deleted`` (one per line). Returns the bytes written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    root_fd = os.open(str(root), _O_DIR)
    try:
        with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
            for rel in paths:
                try:
                    dfd, name = _open_parent(root_fd, rel)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # under a path the diff saw change kind: its own entry says so
                except OSError as e:
                    if e.errno == 40:  # ELOOP: a symlink on the way; never followed
                        continue
                    raise
                try:
                    _add(tar, dfd, name, rel)
                finally:
                    os.close(dfd)
            gone = b"\n".join(deleted)
            if gone:
                import io
                ti = tarfile.TarInfo(".crabd-deleted")
                ti.size = len(gone) + 1
                tar.addfile(ti, io.BytesIO(gone + b"\n"))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        os.close(root_fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return out.stat().st_size


def _add(tar: tarfile.TarFile, dfd: int, name: bytes, rel: bytes) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    ti = tarfile.TarInfo(os.fsdecode(rel))
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.mtime = st.st_mtime
    m = st.st_mode
    if stat.S_ISREG(m):
        ti.type = tarfile.REGTYPE
        ti.size = st.st_size
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            tar.addfile(ti, f)
        return
    if stat.S_ISDIR(m):
        ti.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(m):
        ti.type = tarfile.SYMTYPE
        ti.linkname = os.fsdecode(os.readlink(name, dir_fd=dfd))
    elif stat.S_ISFIFO(m):
        ti.type = tarfile.FIFOTYPE
    elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
        ti.type = tarfile.CHRTYPE if stat.S_ISCHR(m) else tarfile.BLKTYPE
        ti.devmajor, ti.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
    else:
        return  # sockets: nothing to copy
    tar.addfile(ti)
