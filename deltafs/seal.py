"""Seals of committed snapshots: a small record made at commit time that a
later check compares with what is on disk, to notice a committed snapshot
changed behind deltafs's back (bytes flipped in a file of a layer).

A seal is plain data (JSON-able); the caller stores it somewhere tamper-
evident (crabd: in the checkpoint row, under its keyed digest). deltafs
itself keys nothing.

btrfs: `{"driver": "btrfs", "uuid", "ctransid", "tree"}` of the snapshot's
  read-only subvolume (BTRFS_IOC_GET_SUBVOL_INFO). The kernel bumps a
  subvolume's ctransid on every change to its files or metadata (write,
  chmod, create, unlink, rename), which needs the read-only flag cleared
  first; snapshotting it or toggling the flag does not. The check wants the
  read-only flag set, the same uuid, and the same ctransid. Cost: two ioctls.
  Not covered: editing the file system image offline with btrfs debugging
  tools that rewrite the root item.

overlay: `{"driver": "overlay", "layer", "digest", "hashed_bytes",
  "stat_only"}`: blake3 over the snapshot's own (top) layer directory: for
  every entry in sorted order its relative path, type and mode, uid, gid,
  size, mtime (ns), device number, symlink target, extended attributes
  (overlay whiteouts and opaque markers included), and the blake3 of its
  content for regular files while the content budget lasts (default 64
  MiB and 20000 files per layer; files past it are covered by their stat
  only, counted in `stat_only`). The lower layers are the parent snapshots' top layers, each
  with its own seal: a caller checks the whole line by checking every
  ancestor's seal. Not covered: a layer merged by compaction (the chain's
  top is then a merged layer the seal does not name: the check reports it
  as not verifiable), content past the budget when size and mtime are
  restored too.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import uuid
from typing import Any

import blake3

from .errors import FailedPrecondition, NotFound
from .snapshotter import Kind, Snapshotter

__all__ = ["seal", "check_seal", "SealBroken", "subvol_info", "layer_digest", "CONTENT_BUDGET"]

CONTENT_BUDGET = 64 << 20
FILES_BUDGET = 20_000  # files whose content is hashed per layer (a million tiny files: stat only past this)
_GET_SUBVOL_INFO = (2 << 30) | (504 << 16) | (0x94 << 8) | 60   # _IOR(0x94, 60, 504 bytes)
_SUBVOL_GETFLAGS = (2 << 30) | (8 << 16) | (0x94 << 8) | 25     # _IOR(0x94, 25, u64)
_SUBVOL_RDONLY = 1 << 1


class SealBroken(FailedPrecondition):
    """A committed snapshot does not match the seal recorded at its commit."""


def subvol_info(path: str) -> dict[str, Any]:
    """uuid, ctransid, tree id and read-only flag of the btrfs subvolume at `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        buf = bytearray(504)
        fcntl.ioctl(fd, _GET_SUBVOL_INFO, buf)
        flags = bytearray(8)
        fcntl.ioctl(fd, _SUBVOL_GETFLAGS, flags)
    finally:
        os.close(fd)
    (tree,) = struct.unpack_from("<Q", buf, 0)
    (ctransid,) = struct.unpack_from("<Q", buf, 344)
    return {"uuid": str(uuid.UUID(bytes=bytes(buf[296:312]))), "ctransid": ctransid, "tree": tree,
            "readonly": bool(struct.unpack("<Q", flags)[0] & _SUBVOL_RDONLY)}


def layer_digest(root: str, budget: int = CONTENT_BUDGET, max_files: int = FILES_BUDGET) -> tuple[str, int, int]:
    """(blake3 hex, content bytes hashed, files covered by stat only) of a
    directory tree, never following symlinks (see the module doc)."""
    h = blake3.blake3()
    hashed = stat_only = nfiles = 0

    def entry(rel: bytes, st: os.stat_result, full: bytes) -> None:
        nonlocal hashed, stat_only, nfiles
        h.update(b"%s\0%o %d %d %d %d %d\0" % (rel, st.st_mode, st.st_uid, st.st_gid, st.st_size,
                                               st.st_mtime_ns, st.st_rdev))
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(full) + b"\0")
        try:
            names = sorted(os.listxattr(full, follow_symlinks=False))
        except OSError:
            names = []
        for n in names:
            try:
                h.update(n.encode() + b"=" + os.getxattr(full, n, follow_symlinks=False) + b"\0")
            except OSError:
                pass
        if stat.S_ISREG(st.st_mode):
            if hashed + st.st_size > budget or nfiles >= max_files:
                stat_only += 1
                return
            nfiles += 1
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fh = blake3.blake3()
                while True:
                    data = os.read(fd, 1 << 20)
                    if not data:
                        break
                    fh.update(data)
                    hashed += len(data)
            finally:
                os.close(fd)
            h.update(fh.digest())

    base = os.fsencode(root)
    entry(b"", os.lstat(base), base)
    stack = [b""]
    while stack:
        rel = stack.pop()
        d = os.path.join(base, rel) if rel else base
        with os.scandir(d) as it:
            kids = sorted(e.name for e in it)
        for name in kids:
            r = os.path.join(rel, name) if rel else name
            full = os.path.join(base, r)
            st = os.lstat(full)
            entry(r, st, full)
            if stat.S_ISDIR(st.st_mode):
                stack.append(r)
    return h.hexdigest(), hashed, stat_only


def _committed(fs: Snapshotter, name: str) -> Any:
    row = fs.meta.get(name)  # raises deltafs.NotFound
    if row.kind != Kind.COMMITTED:
        raise FailedPrecondition(f"snapshot {name} is {row.kind}, not committed: only committed snapshots are sealed")
    return row


def seal(fs: Snapshotter, name: str, budget: int = CONTENT_BUDGET) -> dict[str, Any]:
    """The seal of committed snapshot `name` as it is now (at its commit)."""
    with fs._lock:
        row = _committed(fs, name)
        if fs.driver == "btrfs":
            info = subvol_info(fs._path(row.id))  # type: ignore[attr-defined]
            if not info["readonly"]:
                raise SealBroken(f"snapshot {name}: its subvolume is not read-only")
            return {"driver": "btrfs", "uuid": info["uuid"], "ctransid": info["ctransid"], "tree": info["tree"]}
        if fs.driver != "overlay":
            raise FailedPrecondition(f"no seals for driver {fs.driver}")
        layer = fs._chain(row)[0]  # type: ignore[attr-defined]
        path = fs._abs(layer)  # type: ignore[attr-defined]
    # A committed layer never changes: hash it without holding the store's lock.
    digest, hashed, stat_only = layer_digest(path, budget)
    return {"driver": "overlay", "layer": layer, "digest": digest, "hashed_bytes": hashed,
            "stat_only": stat_only, "budget": budget, "max_files": FILES_BUDGET}


def check_seal(fs: Snapshotter, name: str, sealed: dict[str, Any]) -> str:
    """Compare committed snapshot `name` with its seal. Returns "ok", or
    "unverifiable: <why>" (an overlay layer merged by compaction); raises
    SealBroken when the snapshot changed."""
    with fs._lock:
        try:
            row = _committed(fs, name)
        except NotFound:
            raise SealBroken(f"snapshot {name} is gone") from None
        if sealed.get("driver") != fs.driver:
            raise SealBroken(f"snapshot {name} was sealed by driver {sealed.get('driver')}, the store is {fs.driver}")
        if fs.driver == "btrfs":
            path = fs._path(row.id)  # type: ignore[attr-defined]
            try:
                info = subvol_info(path)
            except OSError as e:
                raise SealBroken(f"snapshot {name}: {path} is not a readable subvolume: {e}") from None
            if not info["readonly"]:
                raise SealBroken(f"snapshot {name}: its subvolume {path} is no longer read-only")
            for k in ("uuid", "tree", "ctransid"):
                if info[k] != sealed.get(k):
                    raise SealBroken(f"snapshot {name}: subvolume {path} changed since its commit "
                                     f"({k} {sealed.get(k)} -> {info[k]})")
            return "ok"
        layer = sealed.get("layer")
        chain = fs._chain(row)  # type: ignore[attr-defined]
        if not chain or chain[0] != layer:
            return f"unverifiable: the layer {layer} of {name} was merged by compaction"
        path = fs._abs(layer)  # type: ignore[attr-defined]
    try:
        digest, _, _ = layer_digest(path, int(sealed.get("budget", CONTENT_BUDGET)),
                                    int(sealed.get("max_files", FILES_BUDGET)))
    except OSError as e:
        raise SealBroken(f"snapshot {name}: layer {path} is unreadable: {e}") from None
    if digest != sealed.get("digest"):
        raise SealBroken(f"snapshot {name}: the files of layer {path} changed since its commit")
    return "ok"
