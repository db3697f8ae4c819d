"""Property test: random file operations interleaved with checkpoints; rolling back to any
checkpoint and forking from it reproduce that checkpoint's tree exactly, and forks are
independent. Runs against both drivers as root.

The operations run as root on the host against a sandbox tree that contains
symlinks pointing outside it, so the test itself must not follow them either:
every path is checked to have no symlink among its parents, and the final
component is never followed (O_NOFOLLOW, follow_symlinks=False).

DELTAFS_PROPERTY_EXAMPLES (default 100) sets hypothesis examples per driver.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltafs
from deltafs.testing import Mounter, fingerprint
from deltafs.tree import remove_tree

pytestmark = pytest.mark.needs("btrfs", "overlay")

NAMES = [b"a", b"b", b"\xff\xfe", b"new\nline"]
DIRS = [b"", b"d", b"e", b"d/sub", b"usr"]
PATHS = [d + b"/" + n if d else n for d in DIRS for n in NAMES] + [b"d", b"e", b"d/sub", b"usr", b"usr/share"]
TARGETS = [b"/etc/passwd", b"../../../../etc", b"/", b"a", b"nonexistent", b"d/sub"]

path = st.sampled_from(PATHS)
op = st.one_of(
    st.tuples(st.just("write"), path, st.binary(max_size=3000), st.sampled_from(["w", "a", "inplace"]),
              st.integers(0, 5000)),
    st.tuples(st.just("truncate"), path, st.integers(0, 20000)),
    st.tuples(st.just("sparse"), path, st.integers(1, 64) .map(lambda m: m << 20), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("chmod"), path, st.sampled_from([0o644, 0o600, 0o4755, 0o1777, 0o000])),
    st.tuples(st.just("chown"), path, st.integers(0, 70000), st.integers(0, 70000)),
    st.tuples(st.just("utime"), path, st.integers(0, 2**40)),
    st.tuples(st.just("symlink"), st.sampled_from(TARGETS), path),
    st.tuples(st.just("link"), path, path),
    st.tuples(st.just("rename"), path, path),
    st.tuples(st.just("unlink"), path),
    st.tuples(st.just("rmtree"), path),
    st.tuples(st.just("mkdir"), path),
    st.tuples(st.just("setxattr"), path, st.sampled_from(["user.a", "user.b", "trusted.t"]), st.binary(max_size=40)),
    st.tuples(st.just("mkfifo"), path),
    st.tuples(st.just("mknod"), path, st.sampled_from([(stat.S_IFCHR, 1, 3), (stat.S_IFCHR, 1, 5),
                                                       (stat.S_IFBLK, 7, 0)])),
)


def safe(root: bytes, rel: bytes) -> bytes | None:
    """root/rel when no parent component of rel is a symlink (or missing); else None."""
    parts = rel.split(b"/")
    cur = root
    for p in parts[:-1]:
        cur = cur + b"/" + p
        try:
            if not stat.S_ISDIR(os.lstat(cur).st_mode):
                return None
        except FileNotFoundError:
            return None
    return root + b"/" + rel


def is_link(p: bytes) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(p).st_mode)
    except FileNotFoundError:
        return False


def apply(root: bytes, o: tuple) -> None:
    kind = o[0]
    p = safe(root, o[1]) if len(o) > 1 and kind not in ("symlink",) else None
    try:
        if kind == "write":
            _, _, data, how, off = o
            if p is None:
                return
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            flags |= {"w": os.O_TRUNC, "a": os.O_APPEND, "inplace": 0}[how]
            fd = os.open(p, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                if how == "inplace":
                    os.pwrite(fd, data, off)
                else:
                    os.write(fd, data)
            finally:
                os.close(fd)
        elif kind in ("truncate", "sparse"):
            if p is None:
                return
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                if kind == "truncate":
                    os.ftruncate(fd, o[2])
                else:
                    os.pwrite(fd, o[3], o[2])
            finally:
                os.close(fd)
        elif kind == "chmod":
            if p is None or is_link(p):
                return
            os.chmod(p, o[2], follow_symlinks=False)
        elif kind == "chown":
            if p is not None:
                os.chown(p, o[2], o[3], follow_symlinks=False)
        elif kind == "utime":
            if p is not None:
                os.utime(p, ns=(o[2], o[2]), follow_symlinks=False)
        elif kind == "symlink":
            q = safe(root, o[2])
            if q is not None:
                os.symlink(o[1], q)
        elif kind in ("link", "rename"):
            q = safe(root, o[2])
            if p is None or q is None:
                return
            if kind == "link":
                os.link(p, q, follow_symlinks=False)
            else:
                os.rename(p, q)
        elif kind == "unlink":
            if p is not None:
                os.unlink(p)
        elif kind == "rmtree":
            if p is not None and stat.S_ISDIR(os.lstat(p).st_mode):
                remove_tree(p)
        elif kind == "mkdir":
            if p is not None:
                os.mkdir(p, 0o755)
        elif kind == "setxattr":
            if p is not None and not is_link(p):
                os.setxattr(p, o[2], o[3], follow_symlinks=False)
        elif kind == "mkfifo":
            if p is not None:
                os.mkfifo(p, 0o644)
        elif kind == "mknod":
            if p is not None:
                t, ma, mi = o[2]
                os.mknod(p, t | 0o600, os.makedev(ma, mi))
    except OSError as e:
        # Operations that the tree's state makes invalid are no-ops; EXDEV is
        # overlay refusing to rename a directory that lives in a lower layer
        # (redirect_dir=off), as programs see it in a sandbox.
        if e.errno not in (errno.ENOENT, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY,
                           errno.EINVAL, errno.EXDEV, errno.EPERM, errno.ELOOP, errno.EBUSY, errno.ENXIO,
                           errno.ETXTBSY, errno.EMLINK):
            raise


@pytest.fixture(scope="module", params=["btrfs", "overlay"])
def store(request):
    if os.geteuid() != 0:
        pytest.fail("deltafs property tests need root (mount, mknod, chown): run them as root")
    base = tempfile.mkdtemp(prefix=f"deltafs-prop-{request.param}-", dir="/var/tmp")
    # overlay with max_depth=3: prepares of deeper checkpoints compact their
    # chain first, so merged layers are exercised by every rollback below.
    opts = {"pool_size": 4 << 30} if request.param == "btrfs" else {"max_depth": 3}
    try:
        s = deltafs.open(os.path.join(base, "state"), driver=request.param, **opts)
    except deltafs.FailedPrecondition as e:
        pytest.fail(f"{request.param} driver unavailable: {e}")
    m = Mounter(base)
    # A base image with dirs, a hard-link pair and xattrs, so copy-up paths are exercised.
    t = m.mount(s.prepare("img-import"))
    os.makedirs(f"{t}/usr/share")
    os.makedirs(f"{t}/d/sub")
    with open(f"{t}/usr/a", "wb") as f:
        f.write(b"image file")
    os.link(f"{t}/usr/a", f"{t}/usr/b")
    os.setxattr(f"{t}/d", "user.img", b"1")
    m.unmount(t)
    s.commit("img", "img-import")
    yield s, m
    m.cleanup()
    if s.driver == "btrfs":
        s.unmount_pool()
    else:
        s.close()
    shutil.rmtree(base, ignore_errors=True)


_counter = [0]


@settings(max_examples=int(os.environ.get("DELTAFS_PROPERTY_EXAMPLES", "100")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(turns=st.lists(st.lists(op, min_size=1, max_size=10), min_size=2, max_size=5))
def test_rollback_and_fork_reproduce_every_checkpoint(store, turns):
    s, m = store
    _counter[0] += 1
    key = f"p{_counter[0]}"
    t = m.mount(s.prepare(key, parent="img"))
    created: list[str] = [key]
    try:
        root = os.fsencode(t)
        checkpoints: list[tuple[str, dict]] = []
        for ops in turns:  # each turn of file operations ends with a checkpoint
            for o in ops:
                apply(root, o)
            name = s.checkpoint(key)
            checkpoints.append((name, fingerprint(t)))
        for i, (name, fp) in enumerate(checkpoints):
            r = m.mount(s.prepare(f"{key}-r{i}", parent=name))
            created.append(f"{key}-r{i}")
            assert fingerprint(r) == fp, f"rollback to checkpoint {i} of {len(checkpoints)}"
            m.unmount(r)
        # Forks of the first checkpoint: independent of each other and of the source.
        name0, fp0 = checkpoints[0]
        a = m.mount(s.prepare(f"{key}-fa", parent=name0))
        b = m.mount(s.prepare(f"{key}-fb", parent=name0))
        created += [f"{key}-fa", f"{key}-fb"]
        with open(f"{a}/fork-only", "wb") as f:
            f.write(b"a")
        remove_tree(os.path.join(a, "usr"))
        assert fingerprint(b) == fp0
        assert s.diff(name0, checkpoints[-1][0]) == s.diff(name0, checkpoints[-1][0])
        v = m.mount(s.view(f"{key}-v", name0))
        created.append(f"{key}-v")
        assert fingerprint(v) == {**fp0, b"": fingerprint(v)[b""]}  # a view's root may be read-only-mounted
    finally:
        m.cleanup()
        for k in reversed(created):
            try:
                s.remove(k)
            except deltafs.NotFound:
                pass
        for name, _ in reversed(checkpoints if "checkpoints" in locals() else []):
            s.remove(name)


@settings(max_examples=max(1, int(os.environ.get("DELTAFS_PROPERTY_EXAMPLES", "100")) // 4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(turns=st.lists(st.lists(op, min_size=1, max_size=12), min_size=2, max_size=4))
def test_diff_from_a_scanned_tree_is_the_full_diff(store, turns):
    """diff_from (btrfs: only the paths `btrfs send --no-data` names are
    looked at) gives what a scan of both trees gives, and the new tree."""
    s, m = store
    _counter[0] += 1
    key = f"d{_counter[0]}"
    t = m.mount(s.prepare(key, parent="img"))
    names: list[str] = ["img"]
    try:
        root = os.fsencode(t)
        for ops in turns:
            for o in ops:
                apply(root, o)
            names.append(s.checkpoint(key))
        pairs = list(zip(names, names[1:])) + [(names[0], names[-1]), (names[1], names[-1])]
        for a, b in pairs:
            old = s.tree(a)
            changes, new = s.diff_from(a, old, b)
            assert changes == s.diff(a, b), (a, b)
            full = s.tree(b)
            assert set(new) == set(full) and all(new[p].same_content_as(full[p]) for p in full), (a, b)
    finally:
        m.cleanup()
        s.remove(key)
        for name in reversed(names[1:]):
            s.remove(name)
