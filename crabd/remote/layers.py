"""File-system layers as registry blobs: a deltafs diff written as tar+zstd,
and applied back onto a snapshot.

Part of `crabd.remote`. A layer is what changed from one committed snapshot
to the next (`Snapshotter.diff`, the same diff crabd's checkpoint diff shows):
added and modified entries as tar members, deleted ones as OCI whiteouts
(an empty `.wh.<name>` beside where the entry was, as in OCI image layers).
GNU tar writes the members (`--xattrs --sparse --numeric-owner`, POSIX
format): hard links (every member of a link group goes in when one of them
changed, so the group stays one inode), symlinks, modes, owners, xattrs,
holes, fifos and device nodes come back as they were.

Reading a layer back treats it as hostile input, like any sandbox content:
before anything is written, every member name is checked (relative, no
`..`, no member below a symlink -- one in the archive or one already in the
target tree, since tar would follow it out of the root), and whiteouts are
applied with deltafs's own symlink-safe remove. Only then does GNU tar
extract, skipping the whiteout names.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Any, Iterable

import zstandard

from deltafs.tree import remove_tree

from ..errors import CommandFailed, IntegrityError

__all__ = ["LayerFile", "write_layer", "apply_layer", "layer_members", "WHITEOUT"]

WHITEOUT = b".wh."
TAR_TIMEOUT_S = 3600
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class LayerFile:
    path: str     # the .tar.zst on disk
    digest: str   # sha256:<hex> of that file (the blob's digest)
    size: int
    entries: int  # tar members (whiteouts included)


def _whiteout_name(path: bytes) -> bytes:
    parent, _, base = path.rpartition(b"/")
    return (parent + b"/" if parent else b"") + WHITEOUT + base


def member_paths(changes: Iterable[Any], tree: dict[bytes, Any]) -> tuple[list[bytes], list[bytes]]:
    """(paths to archive, whiteout paths) for a list of deltafs Changes. Pure.

    A deleted path whose parent is deleted too needs no whiteout of its own
    (the parent's covers it). A changed member of a hard-link group pulls in
    the whole group, so tar writes links, not copies."""
    deleted = sorted({c.path for c in changes if c.kind == "deleted"})
    gone: set[bytes] = set()
    whiteouts = []
    for p in deleted:
        if not any(a in gone for a in _ancestors(p)):
            whiteouts.append(_whiteout_name(p))
        gone.add(p)
    keep = {c.path for c in changes if c.kind != "deleted"}
    groups: dict[int, list[bytes]] = {}
    for path, e in tree.items():
        if e.kind != "dir" and e.nlink > 1:
            groups.setdefault(e.ino, []).append(path)
    for members in groups.values():
        if keep.intersection(members):
            keep.update(members)
    return sorted(keep), whiteouts


def _ancestors(path: bytes) -> list[bytes]:
    out = []
    p = path.rpartition(b"/")[0]
    while p:
        out.append(p)
        p = p.rpartition(b"/")[0]
    return out


def write_layer(root: str, paths: list[bytes], whiteouts: list[bytes], out_dir: str) -> LayerFile:
    """Archive `paths` (relative to `root`, a mounted read-only view) and the
    whiteouts into a .tar.zst under `out_dir`; returns it with its digest."""
    fd, plain = tempfile.mkstemp(prefix="layer-", suffix=".tar", dir=out_dir)
    os.close(fd)
    try:
        # GNU tar writes the real members; tarfile then appends the whiteouts
        # (they exist on no disk). Not the other way round: GNU tar appending
        # to an archive tarfile began loses its sparse members' holes.
        if paths:
            listing = b"".join((b"./" + p if p else b".") + b"\0" for p in paths)
            argv = ["tar", "--create", "--file", plain, "--directory", root, "--no-recursion", "--null",
                    "--files-from=-", "--format=posix", "--pax-option=delete=atime,delete=ctime",
                    "--xattrs", "--xattrs-include=*", "--xattrs-exclude=trusted.overlay.*", "--sparse",
                    "--numeric-owner", "--acls"]
            r = subprocess.run(argv, input=listing, capture_output=True, timeout=TAR_TIMEOUT_S)
            # 1 = "some files differ": only when a file changes while read; the
            # view is read-only, so anything but 0 is a failure.
            if r.returncode != 0:
                raise CommandFailed(argv, r.returncode, r.stderr.decode(errors="replace"),
                                    context="writing a file-system layer (tar)")
        with tarfile.open(plain, "a" if paths else "w", format=tarfile.PAX_FORMAT) as t:
            for w in whiteouts:
                ti = tarfile.TarInfo(os.fsdecode(b"./" + w))
                ti.mode = 0o600
                t.addfile(ti, io.BytesIO(b""))
        fd, packed = tempfile.mkstemp(prefix="layer-", suffix=".tar.zst", dir=out_dir)
        h = hashlib.sha256()
        size = 0
        with open(plain, "rb") as src, os.fdopen(fd, "wb") as dst:
            cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=-1)
            with cctx.stream_writer(_Hashing(dst, h), closefd=False) as zw:  # type: ignore[arg-type]
                while chunk := src.read(1 << 20):
                    zw.write(chunk)
        size = os.path.getsize(packed)
        return LayerFile(packed, "sha256:" + h.hexdigest(), size, len(paths) + len(whiteouts))
    finally:
        os.unlink(plain)


class _Hashing(io.RawIOBase):
    def __init__(self, f: Any, h: Any) -> None:
        self.f, self.h = f, h

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.h.update(b)
        self.f.write(b)
        return len(b)


def _norm(name: str) -> bytes:
    """A member name as a relative path without ./ (b"" for the root); raises on escapes."""
    raw = os.fsencode(name)
    while raw.startswith(b"./"):
        raw = raw[2:]
    if raw in (b".", b""):
        return b""
    raw = raw.rstrip(b"/")
    parts = raw.split(b"/")
    if raw.startswith(b"/") or any(p in (b"..", b".", b"") for p in parts):
        raise IntegrityError(f"layer member {name!r} is not a plain relative path: refused",
                             fix="the layer was not written by crabd; do not import it")
    return raw


def layer_members(path: str) -> tuple[list[bytes], list[bytes], set[bytes]]:
    """(member paths, whiteout targets, symlink members) of a .tar.zst; checks every name."""
    members: list[bytes] = []
    whiteouts: list[bytes] = []
    links: set[bytes] = set()
    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f)
        try:
            with tarfile.open(fileobj=reader, mode="r|") as t:
                for m in t:
                    p = _norm(m.name)
                    base = p.rpartition(b"/")[2]
                    if base.startswith(WHITEOUT):
                        whiteouts.append(p.rpartition(b"/")[0] + (b"/" if b"/" in p else b"") + base[len(WHITEOUT):])
                        continue
                    if m.islnk():
                        _norm(m.linkname)
                    if m.issym():
                        links.add(p)
                    members.append(p)
        except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
            raise IntegrityError(f"layer {os.path.basename(path)} does not read as tar+zstd: {e}") from None
    return members, whiteouts, links


def _below_symlink(root: str, p: bytes, links: set[bytes]) -> bytes | None:
    """The first proper ancestor of `p` that is a symlink (in the archive or under `root`)."""
    parts = p.split(b"/")[:-1]
    cur = b""
    for part in parts:
        cur = cur + b"/" + part if cur else part
        if cur in links:
            return cur
        try:
            st = os.lstat(os.path.join(os.fsencode(root), cur))
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            return cur
    return None


def apply_layer(path: str, root: str) -> int:
    """Apply the layer at `path` onto the tree at `root` (a mounted active
    snapshot nothing else uses); returns the number of members applied."""
    members, whiteouts, links = layer_members(path)
    for p in members + whiteouts:
        bad = _below_symlink(root, p, links)
        if bad is not None:
            raise IntegrityError(f"layer member {p!r} lies below symlink {bad!r}: refused (tar would follow it "
                                 "out of the sandbox's root)", fix="the layer was not written by crabd")
    broot = os.fsencode(root)
    for w in whiteouts:
        remove_tree(os.path.join(broot, w))
    if not members:
        return 0
    argv = ["tar", "--extract", "--file=-", "--directory", root, "--numeric-owner", "--same-owner",
            "--preserve-permissions", "--xattrs", "--xattrs-include=*", "--acls", "--wildcards",
            "--exclude=.wh.*", "--warning=no-timestamp"]
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f, tempfile.TemporaryFile() as errf:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errf)
        assert proc.stdin is not None
        try:
            try:
                dctx.copy_stream(f, proc.stdin)
            except BrokenPipeError:
                pass  # tar stopped early: its exit status and stderr say why
            finally:
                proc.stdin.close()
            proc.wait(timeout=TAR_TIMEOUT_S)
        finally:
            if proc.poll() is None:  # an error or a timeout here: tar must not outlive the mount
                proc.kill()
                proc.wait()
        errf.seek(0)
        err = errf.read()
    if proc.returncode != 0:
        raise CommandFailed(argv, proc.returncode, err.decode(errors="replace"),
                            context="applying a file-system layer (tar)")
    return len(members)
