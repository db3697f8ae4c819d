"""The overlay driver: committed snapshots are overlayfs layers; works on any file system.

An active snapshot is an overlay mount: lowerdir = the layer chain of its
parent (top-most first), upperdir/workdir of its own. A checkpoint captures,
while the sandbox is frozen, the delta of the upper dir since the previous
checkpoint of the same active (tracked by a manifest of (inode, ctime) per
path), into a new layer in overlay's own format: changed entries are copied
(reflink where the file system supports it), deleted ones become whiteouts
(0/0 char devices), replaced directories become opaque
(``trusted.overlay.opaque=y``). The mount stays live: the upper dir keeps
everything, only the capture is incremental. A rollback or fork is a new
overlay mount of the chain. `compact` merges runs of layers (logic in
`layers.merge_plan`) so chains stay <= `max_depth` (16) deep.

Layout under the state dir::

    l/<id>            layer of committed snapshot <id>
    m/<id>            merged layer <id> (compaction), shared by later chains
    a/<id>/u, a/<id>/w upper and work dir of active snapshot <id>
    a/<id>/manifest.<cid>  upper-dir manifest as of checkpoint <cid>
    a/<id>/stage/     pre-copies made by prepare_checkpoint()
    tmp/<...>         being created; renamed into place inside the metadata tx
    v/<n>             short-lived read-only mounts used by diff/usage/tree
    trash/            removed snapshots, deleted by a background thread and gc()
    empty/            the empty bottom layer (an overlay needs one lower dir)

Paths inside mount options are absolute; with depth <= 16 they fit easily in
the one page mount(2) accepts (`layers.overlay_options` checks).

Size (~630 lines): one driver of the Snapshotter interface. Its pure logic
is already apart (layers.py: options, merge plans; tree.py: scanning and
copying hostile trees); what is left is the sequence of each operation's
I/O inside the metadata transaction (create in tmp/, rename into place,
remove to trash/), which reads best in one class.
"""

from __future__ import annotations

import marshal
import os
import stat
from contextlib import contextmanager
from typing import Any, Iterator

from .errors import FailedPrecondition
from .layers import LayerEntry, check_layer_path, merge_plan, overlay_mount
from .metadata import Row
from .mount import Mount, mount_all, mountinfo, unmount
from .snapshotter import Kind, Snapshotter, Usage, _failpoint, chaos_point
from .tree import O_DIR, Copier, copy_root_meta, remove_tree, walk_fd

__all__ = ["OverlaySnapshotter", "plan_capture", "Node", "DEFAULT_MAX_DEPTH"]

DEFAULT_MAX_DEPTH = 16
OPAQUE = "trusted.overlay.opaque"
_OPAQUE_X = ((OPAQUE, b"y"),)


def _keep_xattr(name: str) -> bool:
    # trusted.overlay.* in an upper dir is overlay's bookkeeping (origin,
    # impure, opaque); the sandbox cannot set it through the mount. Opacity is
    # decided by plan_capture, the rest means nothing in a layer.
    return not name.startswith("trusted.overlay.")


# Manifest node: [ino, ctime_ns, ifmt, opaque, children | None]. Lists so
# that marshal stores them compactly.
Node = list


def _node(st: os.stat_result, opaque: bool = False, children: dict | None = None) -> Node:
    return [st.st_ino, st.st_ctime_ns, stat.S_IFMT(st.st_mode), opaque, children]


def _join(rel: str, name: str) -> str:
    return rel + "/" + name if rel else name


def plan_capture(prev: dict[str, Node] | None, cur: dict[str, Node], rel: str = "",
                 full: bool = False) -> list[tuple[str, str, bool]]:
    """Actions that turn the layer chain as of manifest `prev` into the upper dir's state `cur`. Pure.

    `prev`/`cur` are the children of one directory (name -> Node; names are
    str, non-UTF-8 bytes carried as surrogate escapes like os.fsdecode). Returns
    ("dir", path, opaque) / ("copy", path, False) / ("whiteout", path, False),
    parents before children. Rules:

    * a path new since `prev`: copied (dirs keep the upper dir's opacity: a
      non-opaque new dir is a copy-up merging with the lower chain);
    * a path whose inode or type changed: replaced; a replaced dir is opaque
      (it hides what earlier captures put below it) and all its content is new;
    * same inode, ctime moved: copied (ctime moves on every write, chmod,
      chown, xattr and link-count change);
    * a dir with changed descendants is created (not opaque) to hold them;
    * a path in `prev` gone from `cur`: whiteout (an earlier layer has it).
    """
    out: list[tuple[str, str, bool]] = []
    prev = {} if prev is None or full else prev
    if prev == cur:  # deep comparison in C: the common case of an untouched subtree is cheap
        return out
    for name in sorted(cur):
        node = cur[name]
        old = prev.get(name)
        if old == node:
            continue
        p = _join(rel, name)
        is_dir = node[2] == stat.S_IFDIR
        if old is None:
            if is_dir:
                out.append(("dir", p, bool(node[3])))
                out.extend(plan_capture(None, node[4] or {}, p, full=True))
            else:
                out.append(("copy", p, False))
        elif old[0] != node[0] or old[2] != node[2]:
            if is_dir:
                out.append(("dir", p, True))
                out.extend(plan_capture(None, node[4] or {}, p, full=True))
            else:
                out.append(("copy", p, False))
        elif is_dir:
            sub = plan_capture(old[4] or {}, node[4] or {}, p)
            if sub or old[1] != node[1]:
                out.append(("dir", p, False))
                out.extend(sub)
        elif old[1] != node[1]:
            out.append(("copy", p, False))
    if not full:
        for name in sorted(set(prev) - set(cur)):
            out.append(("whiteout", _join(rel, name), False))
    return out


def _is_opaque(dir_fd: int, name: str | bytes) -> bool:
    # bytes names (walk_fd) are joined as bytes: an f-string would read "b'd'"
    path = os.fsencode(f"/proc/self/fd/{dir_fd}/") + os.fsencode(name)
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def scan_manifest(root_fd: int) -> Node:
    """Manifest of a whole upper dir: lstat of every entry plus the opaque flag of dirs.

    This walk is most of a frozen overlay capture (it is O(entries in the
    upper dir), ~3 us each), so it is written for speed: unsorted scandir,
    str names, the DirEntry's fstatat.
    """
    root = _node(os.fstat(root_fd), False, {})
    stack: list[tuple[int, dict]] = [(os.dup(root_fd), root[4])]
    try:
        while stack:
            fd, children = stack.pop()
            try:
                with os.scandir(fd) as it:
                    for e in it:
                        st = e.stat(follow_symlinks=False)
                        fmt = stat.S_IFMT(st.st_mode)
                        if fmt == stat.S_IFDIR:
                            kids: dict = {}
                            children[e.name] = [st.st_ino, st.st_ctime_ns, fmt, _is_opaque(fd, e.name), kids]
                            stack.append((os.open(e.name, O_DIR, dir_fd=fd), kids))
                        else:
                            children[e.name] = [st.st_ino, st.st_ctime_ns, fmt, False, None]
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return root


class _FdCache:
    """Dir fds of a tree by relative path, opened with O_NOFOLLOW one level at a time."""

    def __init__(self, root_fd: int) -> None:
        self.fds = {b"": root_fd}
        self.owned: list[int] = []

    def parent(self, path: bytes) -> tuple[int, bytes]:
        i = path.rfind(b"/")
        if i < 0:
            return self.fds[b""], path
        return self.dir(path[:i]), path[i + 1:]

    def dir(self, rel: bytes) -> int:
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        # From the deepest cached ancestor down, one level at a time (a loop:
        # a sandbox's chain may be thousands of levels deep).
        parts = rel.split(b"/")
        i = len(parts) - 1
        while i > 0 and b"/".join(parts[:i]) not in self.fds:
            i -= 1
        fd = self.fds[b"/".join(parts[:i])]
        for j in range(i, len(parts)):
            fd = os.open(parts[j], O_DIR, dir_fd=fd)
            self.fds[b"/".join(parts[:j + 1])] = fd
            self.owned.append(fd)
        return fd

    def close(self) -> None:
        for fd in self.owned:
            os.close(fd)
        self.owned.clear()


class OverlaySnapshotter(Snapshotter):
    driver = "overlay"

    def __init__(self, state_dir: str, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        super().__init__(state_dir)
        check_layer_path(self.state_dir)
        if max_depth < 2:
            raise ValueError("max_depth must be >= 2")
        self.max_depth = max_depth
        for d in ("l", "m", "a", "tmp", "v", "trash", "empty"):
            os.makedirs(os.path.join(self.state_dir, d), mode=0o700, exist_ok=True)
        self._staged: dict[int, dict[str, tuple[int, int, str]]] = {}
        # Last manifest per active id, so a checkpoint does not re-read it.
        self._manifests: dict[int, tuple[int, Node]] = {}
        self._vseq = 0
        self._check_overlay()
        with self._lock:  # finish commits a crash interrupted between metadata and rename
            for r in self.meta.all():
                if r.extra.get("pending_from"):
                    self._roll_forward(r)

    def _check_overlay(self) -> None:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1] == "overlay" for line in f if line.strip()):
                if not os.path.exists(f"/lib/modules/{os.uname().release}/kernel/fs/overlayfs"):
                    raise FailedPrecondition("the kernel has no overlayfs: modprobe overlay, or use driver='btrfs'")

    # ---- paths --------------------------------------------------------------------------
    def _abs(self, rel: str) -> str:
        return os.path.join(self.state_dir, rel)

    def _active_dir(self, id: int) -> str:
        return self._abs(f"a/{id}")

    def _chain(self, row: Row | None) -> list[str]:
        return list(row.extra["chain"]) if row else []

    def _lowers(self, chain: list[str]) -> list[str]:
        return [self._abs(c) for c in chain] + [self._abs("empty")]

    # ---- hooks --------------------------------------------------------------------------
    def _create_active(self, row: Row, parent: Row | None) -> dict[str, Any]:
        if parent is not None and len(self._chain(parent)) > self.max_depth:
            self._compact_row(parent)
        tmp = self._abs(f"tmp/a{row.id}")
        remove_tree(tmp)
        remove_tree(self._active_dir(row.id))  # leftover of a crash that reused this id
        os.makedirs(os.path.join(tmp, "u"), mode=0o755)
        os.mkdir(os.path.join(tmp, "w"), 0o700)
        os.rename(tmp, self._active_dir(row.id))
        return {"lowers": self._chain(parent), "manifest": None}

    def _create_view(self, row: Row, parent: Row) -> dict[str, Any]:
        if len(self._chain(parent)) > self.max_depth:
            self._compact_row(parent)
        return {}

    def _mounts(self, row: Row) -> list[Mount]:
        if row.kind == Kind.VIEW:
            assert row.parent is not None
            return [overlay_mount(self._lowers(self._chain(self.meta.by_id(row.parent))))]
        d = self._active_dir(row.id)
        return [overlay_mount(self._lowers(row.extra["lowers"]), os.path.join(d, "u"), os.path.join(d, "w"))]

    def _mounted_at(self, row: Row) -> list[str]:
        upper = "upperdir=" + os.path.join(self._active_dir(row.id), "u")
        return [m.target for m in mountinfo() if m.fstype == "overlay"
                and any(o == upper for o in m.super_options.split(","))]

    def _load_manifest(self, row: Row) -> Node | None:
        m = row.extra.get("manifest")
        if m is None:
            return None
        cached = self._manifests.get(row.id)
        if cached is not None and cached[0] == m:
            return cached[1]
        try:
            with open(os.path.join(self._active_dir(row.id), f"manifest.{m}"), "rb") as f:
                node = marshal.load(f)
        except (OSError, EOFError, ValueError):
            return None  # lost in a crash: the caller captures the whole upper dir
        self._manifests[row.id] = (m, node)
        return node

    def _capture(self, active: Row, new: Row, consume: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        parent = self.meta.by_id(active.parent) if active.parent else None
        chain = [f"l/{new.id}"] + self._chain(parent)
        if consume and active.extra.get("manifest") is None:
            # commit() of an active never checkpointed (an image import): its
            # upper dir *is* the delta over its parent, in overlay's format.
            # It is moved, not copied, after this transaction commits; the
            # row records the move so open()/gc() can finish it after a crash.
            return {"chain": chain, "pending_from": f"a/{active.id}/u"}, active.extra
        prev = self._load_manifest(active)
        if prev is None:
            # A full capture of the upper dir is the delta over the layers it
            # is mounted on, whatever checkpoints were taken in between.
            chain = [f"l/{new.id}"] + list(active.extra["lowers"])
        adir = self._active_dir(active.id)
        layer = self._abs(f"l/{new.id}")
        tmp = self._abs(f"tmp/l{new.id}")
        remove_tree(tmp)
        remove_tree(layer)
        os.mkdir(tmp, 0o755)
        ufd = os.open(os.path.join(adir, "u"), O_DIR)
        lfd = os.open(tmp, O_DIR)
        staged = self._staged.pop(active.id, {})
        try:
            cur = scan_manifest(ufd)
            actions = plan_capture(prev[4] if prev else {}, cur[4] or {})
            self._apply(ufd, lfd, actions, staged, os.path.join(adir, "stage"))
        finally:
            os.close(ufd)
            os.close(lfd)
        _failpoint("overlay-after-copy")
        os.rename(tmp, layer)
        _failpoint("overlay-after-rename")
        # The manifest is needed only by the next capture of this active,
        # which normally finds it in memory; its file (named after the new
        # snapshot, so a transaction that does not commit leaves the old one
        # in force) is written by the reaper thread, outside the pause. A
        # restart that finds no file falls back to a full capture.
        self._manifests[active.id] = (new.id, cur)
        self._reaper.put(("manifest", os.path.join(adir, f"manifest.{new.id}"), cur))
        extra = dict(active.extra)
        extra["manifest"] = new.id
        return {"chain": chain}, extra

    def _finish_commit(self, active: Row, new: Row) -> None:
        self._roll_forward(new)
        self._discard(active)

    def _roll_forward(self, row: Row) -> None:
        """Finish a commit that moves an upper dir into place as the layer (see _capture)."""
        src = row.extra.get("pending_from")
        if not src:
            return
        layer = self._abs(f"l/{row.id}")
        if not os.path.exists(layer):
            os.rename(self._abs(src), layer)
        _failpoint("overlay-after-move")
        extra = dict(row.extra)
        del extra["pending_from"]
        with self.meta.tx():
            self.meta.update(row.id, extra=extra)
        row.extra = extra

    def _apply(self, ufd: int, lfd: int, actions: list[tuple[str, str, bool]],
               staged: dict[str, tuple[int, int, str]], stage_dir: str) -> Copier:
        copier = Copier(lfd, _keep_xattr)
        copy_root_meta(ufd, lfd, _keep_xattr)
        src = _FdCache(ufd)
        dirs: list[tuple[bytes, os.stat_result]] = []
        try:
            for act, spath, opaque in actions:
                path = os.fsencode(spath)
                if act == "whiteout":
                    copier.whiteout(path)
                    continue
                pfd, name = src.parent(path)
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                s = staged.get(spath)
                if act == "copy" and s and s[0] == st.st_ino and s[1] == st.st_ctime_ns and st.st_nlink == 1:
                    os.rename(os.path.join(stage_dir, s[2]), path, dst_dir_fd=lfd)
                    copier.entries += 1
                    continue
                copier.copy(pfd, name, st, path, _OPAQUE_X if opaque else ())
                if act == "dir":
                    dirs.append((path, st))
            for path, st in reversed(dirs):
                copier.finish_dir(path, st)
            copier.finish_dir(b"", os.fstat(ufd))
        finally:
            src.close()
        return copier

    def _prepare_checkpoint(self, row: Row) -> None:
        # Pre-copy the regular files the next capture would copy, while the
        # sandbox runs; the frozen capture re-checks (ino, ctime) and renames
        # the pre-copy into the layer when the file did not change since.
        prev = self._load_manifest(row)
        adir = self._active_dir(row.id)
        stage = os.path.join(adir, "stage")
        remove_tree(stage)
        os.mkdir(stage, 0o700)
        ufd = os.open(os.path.join(adir, "u"), O_DIR)
        sfd = os.open(stage, O_DIR)
        staged: dict[str, tuple[int, int, str]] = {}
        try:
            cur = scan_manifest(ufd)
            copier = Copier(sfd, _keep_xattr)
            src = _FdCache(ufd)
            try:
                for act, spath, _ in plan_capture(prev[4] if prev else {}, cur[4] or {}):
                    if act != "copy":
                        continue
                    pfd, name = src.parent(os.fsencode(spath))
                    try:
                        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                            continue
                        sname = str(len(staged))
                        copier.copy(pfd, name, st, sname.encode())
                    except OSError:
                        continue  # changed under us: the capture copies it
                    staged[spath] = (st.st_ino, st.st_ctime_ns, sname)
            finally:
                src.close()
        finally:
            os.close(ufd)
            os.close(sfd)
        self._staged[row.id] = staged

    def _discard(self, row: Row) -> None:
        # Move into the trash (O(1)); the reaper thread deletes it.
        if row.kind == Kind.COMMITTED:
            layer = f"l/{row.id}"
            # remove(reparent=True): children still stack this layer; it
            # stays until compaction merges it away and gc() finds it unused.
            for r in self.meta.all():
                if layer in r.extra.get("chain", []) or layer in r.extra.get("lowers", []):
                    return
            src = self._abs(layer)
        elif row.kind == Kind.ACTIVE:
            self._staged.pop(row.id, None)
            self._manifests.pop(row.id, None)
            src = self._active_dir(row.id)
        else:
            return
        dst = self._abs(f"trash/{row.kind[0]}{row.id}")
        try:
            os.rename(src, dst)
        except OSError:
            return  # gone already, or gc() retries
        self._reaper.put(dst)

    def _reap(self, item: object) -> None:
        if isinstance(item, tuple):  # ("manifest", path, node): see _capture
            _, path, node = item
            with open(path + ".tmp", "wb") as f:
                marshal.dump(node, f)
            os.rename(path + ".tmp", path)
            return
        remove_tree(str(item))

    def _gc_disk(self, rows: list[Row]) -> list[str]:
        for r in rows:
            if r.extra.get("pending_from"):
                self._roll_forward(r)
        removed: list[str] = []
        committed = {str(r.id) for r in rows if r.kind == Kind.COMMITTED}
        active = {str(r.id): r for r in rows if r.kind == Kind.ACTIVE}
        referenced = set()
        for r in rows:
            referenced.update(r.extra.get("chain", []))
            referenced.update(r.extra.get("lowers", []))

        def rm(p: str) -> None:
            try:
                remove_tree(p)
                removed.append(p)
            except OSError:
                pass

        for d in ("tmp", "trash"):
            for name in os.listdir(self._abs(d)):
                rm(self._abs(f"{d}/{name}"))
        for name in os.listdir(self._abs("v")):
            unmount(self._abs(f"v/{name}"), detach=True)
            rm(self._abs(f"v/{name}"))
        for name in os.listdir(self._abs("l")):
            if name not in committed and f"l/{name}" not in referenced:
                rm(self._abs(f"l/{name}"))
        live_merges = set()
        for name in os.listdir(self._abs("m")):
            if f"m/{name}" in referenced:
                live_merges.add(name)
            else:
                rm(self._abs(f"m/{name}"))
        with self.meta.tx():
            for mid in self.meta.merge_ids():
                if str(mid) not in live_merges:
                    self.meta.delete_merge(mid)
        for name in os.listdir(self._abs("a")):
            act = active.get(name)
            if act is None:
                rm(self._abs(f"a/{name}"))
                continue
            keep = f"manifest.{act.extra.get('manifest')}"
            for f in os.listdir(self._abs(f"a/{name}")):
                if f.startswith("manifest.") and f != keep:
                    rm(self._abs(f"a/{name}/{f}"))
        return removed

    @contextmanager
    def _readable(self, row: Row) -> Iterator[str]:
        if row.kind == Kind.ACTIVE:
            # The upper dir as the top lower layer of a read-only overlay:
            # overlayfs warns that the dir is in use as an upper elsewhere;
            # reading while the sandbox runs gives a fuzzy (not torn-file-safe)
            # picture, so freeze the sandbox for an exact one.
            lowers = [os.path.join(self._active_dir(row.id), "u")] + self._lowers(row.extra["lowers"])
        elif row.kind == Kind.VIEW:
            assert row.parent is not None
            lowers = self._lowers(self._chain(self.meta.by_id(row.parent)))
        else:
            if len(self._chain(row)) > self.max_depth:
                with self.meta.tx():
                    self._compact_row(row)
            lowers = self._lowers(self._chain(row))
        self._vseq += 1
        target = self._abs(f"v/{os.getpid()}.{self._vseq}")
        os.makedirs(target, exist_ok=True)
        mount_all([overlay_mount(lowers)], target)
        try:
            yield target
        finally:
            unmount(target, detach=True)
            os.rmdir(target)

    def _usage(self, row: Row, parent: Row | None) -> Usage:
        if row.kind == Kind.VIEW:
            return Usage(0, 0)
        path = self._abs(f"l/{row.id}") if row.kind == Kind.COMMITTED else os.path.join(self._active_dir(row.id), "u")
        fd = os.open(path, O_DIR)
        size = inodes = 0
        seen: set[int] = set()
        try:
            for _, _, _, st in walk_fd(fd):
                inodes += 1
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    size += st.st_blocks * 512
        finally:
            os.close(fd)
        return Usage(size=size, inodes=inodes)

    # ---- compaction ---------------------------------------------------------------------
    def depth(self, name: str) -> int:
        """Number of layers (without the empty bottom) a mount of committed `name` stacks."""
        with self._lock:
            row = self.meta.get(name)
            if row.kind == Kind.COMMITTED:
                return len(self._chain(row))
            if row.kind == Kind.ACTIVE:
                return len(row.extra["lowers"])
            return len(self._chain(self.meta.by_id(row.parent))) if row.parent else 0

    def compact(self, name: str | None = None) -> int:
        """Merge layers of committed snapshots deeper than max_depth (all, or `name`); returns merges done.

        Meant for idle time (crabd's scheduler); prepare() also compacts a
        too-deep parent before mounting it. Existing mounts are unaffected:
        they keep the layers they were mounted with.
        """
        with self._lock:
            rows = [self.meta.get(name)] if name else [r for r in self.meta.all() if r.kind == Kind.COMMITTED]
            n = 0
            for row in rows:
                if row.kind == Kind.COMMITTED and len(self._chain(row)) > self.max_depth:
                    with self.meta.tx():
                        self._compact_row(row)
                    n += 1
            return n

    def _compact_row(self, row: Row) -> None:
        """Replace the top of `row`'s chain by one merged layer so the chain is max_depth // 2 long."""
        chain = self._chain(row)
        # Never merge the bottom layer (the image: large, shared by every sandbox).
        k = min(len(chain) - self.max_depth // 2 + 1, len(chain) - 1)
        if k < 2:
            return
        run = chain[:k]
        chaos_point("compaction")
        mid = self.meta.new_merge_id()
        tmp = self._abs(f"tmp/m{mid}")
        remove_tree(tmp)
        os.mkdir(tmp, 0o755)
        fds = [os.open(self._abs(c), O_DIR) for c in run]
        lfd = os.open(tmp, O_DIR)
        caches = [_FdCache(fd) for fd in fds]
        try:
            listings = [self._layer_listing(fd) for fd in fds]
            plan = merge_plan(listings)
            # A whiteout whose path no layer below the run has hides nothing,
            # and must go: overlayfs filters whiteouts only in dirs merged
            # from several layers, so in a dir the merged layer alone has it
            # would show as a 0/0 character device (a deleted file back).
            below = [os.fsencode(self._abs(c)) for c in chain[k:]]
            plan = {p: v for p, v in plan.items() if listings[v[0]][p].kind != "whiteout"
                    or any(os.path.lexists(os.path.join(d, p)) for d in below)}
            copier = Copier(lfd)
            copy_root_meta(fds[0], lfd)
            dirs = []
            for path in sorted(plan):
                if not path:
                    continue
                i, opaque = plan[path]
                pfd, name = caches[i].parent(path)
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                # copy() carries the source's xattrs, opacity included; a dir
                # that became opaque by merging gets it added here.
                extra = _OPAQUE_X if opaque and not listings[i][path].opaque else ()
                copier.copy(pfd, name, st, path, extra)
                if stat.S_ISDIR(st.st_mode):
                    dirs.append((path, st))
            for path, st in reversed(dirs):
                copier.finish_dir(path, st)
            copier.finish_dir(b"", os.fstat(fds[0]))
        finally:
            for c in caches:
                c.close()
            for fd in fds + [lfd]:
                os.close(fd)
        os.rename(tmp, self._abs(f"m/{mid}"))
        row.extra = dict(row.extra)
        row.extra["chain"] = [f"m/{mid}"] + chain[k:]
        self.meta.update(row.id, extra=row.extra)

    @staticmethod
    def _layer_listing(fd: int) -> dict[bytes, LayerEntry]:
        out = {b"": LayerEntry("dir", False)}
        for path, pfd, name, st in walk_fd(fd):
            if stat.S_ISDIR(st.st_mode):
                out[path] = LayerEntry("dir", _is_opaque(pfd, name))
            elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                out[path] = LayerEntry("whiteout")
            else:
                out[path] = LayerEntry("other")
        return out
