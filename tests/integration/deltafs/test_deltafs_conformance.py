"""One behaviour suite for every deltafs driver (as containerd's snapshotter testsuite).

Needs root, btrfs (loop pool) and overlayfs. A missing capability fails the
test with the reason; nothing is skipped silently.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import tempfile

import pytest

import deltafs
from deltafs.testing import Mounter, allocated, fingerprint

pytestmark = pytest.mark.needs("btrfs", "overlay")
DRIVERS = ["btrfs", "overlay"]


def open_store(state_dir: str, driver: str):
    if os.geteuid() != 0:
        pytest.fail("deltafs integration tests need root (mount, mknod, btrfs ioctls): run them as root")
    opts = {"pool_size": 4 << 30} if driver == "btrfs" else {}
    try:
        return deltafs.open(state_dir, driver=driver, **opts)
    except deltafs.FailedPrecondition as e:
        pytest.fail(f"{driver} driver unavailable on this host: {e}")


def shut(s) -> None:
    if s.driver == "btrfs":
        s.unmount_pool()
    else:
        s.close()


@pytest.fixture(params=DRIVERS)
def env(request):
    base = tempfile.mkdtemp(prefix=f"deltafs-{request.param}-", dir="/var/tmp")
    s = open_store(os.path.join(base, "state"), request.param)
    m = Mounter(base)
    try:
        yield s, m
    finally:
        m.cleanup()
        try:
            shut(s)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def write(path: str, data: bytes | str = b"x") -> None:
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def image(s, m, name="img"):
    """A small committed base image: /etc/hosts, /bin/sh, /usr/share/doc/x."""
    t = m.mount(s.prepare(name + "-import"))
    os.makedirs(f"{t}/etc")
    os.makedirs(f"{t}/usr/share/doc")
    os.makedirs(f"{t}/bin")
    write(f"{t}/etc/hosts", "127.0.0.1 localhost\n")
    write(f"{t}/bin/sh", b"\x7fELF" + bytes(1000))
    os.chmod(f"{t}/bin/sh", 0o755)
    write(f"{t}/usr/share/doc/x", "doc")
    m.unmount(t)
    s.commit(name, name + "-import")
    return name


# 1
def test_prepare_without_parent_is_empty_and_writable(env):
    s, m = env
    t = m.mount(s.prepare("a"))
    assert os.listdir(t) == []
    write(f"{t}/f", "hello")
    assert read(f"{t}/f") == b"hello"


# 2
def test_prepare_returns_the_same_mounts_as_mounts(env):
    s, m = env
    mounts = s.prepare("a")
    assert mounts == s.mounts("a")
    assert all(isinstance(x, deltafs.Mount) for x in mounts)


# 3
def test_commit_turns_active_into_committed(env):
    s, m = env
    image(s, m)
    assert s.stat("img").kind == "committed" and s.stat("img").parent is None
    with pytest.raises(deltafs.NotFound):
        s.stat("img-import")


# 4
def test_child_sees_parent_content(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    assert read(f"{t}/etc/hosts") == b"127.0.0.1 localhost\n"
    assert os.stat(f"{t}/bin/sh").st_mode & 0o777 == 0o755


# 5
def test_writes_do_not_leak_into_parent_or_view(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/etc/hosts", "changed")
    v = m.mount(s.view("v", "img"))
    assert read(f"{v}/etc/hosts") == b"127.0.0.1 localhost\n"


# 6
def test_checkpoint_keeps_the_mount_live_and_freezes_content(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/turn", "1")
    n1 = s.checkpoint("sb")
    write(f"{t}/turn", "2")  # same mount, still writable
    assert read(f"{t}/turn") == b"2"
    v = m.mount(s.view("v1", n1))
    assert read(f"{v}/turn") == b"1"


# 7
def test_checkpoint_moves_the_active_parent_forward(env):
    s, m = env
    image(s, m)
    m.mount(s.prepare("sb", parent="img"))
    n1 = s.checkpoint("sb")
    n2 = s.checkpoint("sb", name="sb-turn2")
    assert n2 == "sb-turn2"
    assert s.stat("sb").parent == n2 and s.stat(n2).parent == n1 and s.stat(n1).parent == "img"


# 8
def test_rollback_reproduces_the_checkpoint(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/work.py", "print(1)")
    n1 = s.checkpoint("sb")
    before = fingerprint(t)
    os.unlink(f"{t}/etc/hosts")
    shutil.rmtree(f"{t}/usr")
    write(f"{t}/work.py", "broken")
    s.checkpoint("sb")
    m.unmount(t)
    s.remove("sb")
    r = m.mount(s.prepare("sb", parent=n1))
    assert fingerprint(r) == before


# 9
def test_forks_are_independent(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/state", "base")
    n1 = s.checkpoint("sb")
    a = m.mount(s.prepare("fork-a", parent=n1))
    b = m.mount(s.prepare("fork-b", parent=n1))
    write(f"{a}/state", "a")
    os.unlink(f"{b}/etc/hosts")
    write(f"{t}/state", "source")
    assert read(f"{a}/state") == b"a" and os.path.exists(f"{a}/etc/hosts")
    assert read(f"{b}/state") == b"base" and not os.path.exists(f"{b}/etc/hosts")
    assert read(f"{t}/state") == b"source"


# 10
def test_view_is_read_only(env):
    s, m = env
    image(s, m)
    v = m.mount(s.view("v", "img"))
    with pytest.raises(OSError) as ei:
        write(f"{v}/new", "x")
    assert ei.value.errno == errno.EROFS
    assert s.stat("v").kind == "view"


# 11
def test_remove_refuses_while_children_use_it(env):
    s, m = env
    image(s, m)
    s.prepare("sb", parent="img")
    with pytest.raises(deltafs.FailedPrecondition, match="parent of sb"):
        s.remove("img")
    s.view("v", "img")
    s.remove("sb")
    with pytest.raises(deltafs.FailedPrecondition, match="v \\(view\\)"):
        s.remove("img")


# 11b
def test_remove_with_reparent_keeps_every_child_intact(env):
    """Retention: old checkpoints in the middle of a chain go; their children
    (a later checkpoint, the live active, a fork) read the same as before."""
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/a", "1")
    c1 = s.checkpoint("sb", name="c1")
    write(f"{t}/b", "2")
    os.unlink(f"{t}/a")
    c2 = s.checkpoint("sb", name="c2")
    write(f"{t}/c", "3")
    c3 = s.checkpoint("sb", name="c3")
    c3_before = fingerprint(m.mount(s.view("v1", c3)))
    fork = m.mount(s.prepare("fork", parent=c2))
    fork_before = fingerprint(fork)
    with pytest.raises(deltafs.FailedPrecondition, match="parent of"):
        s.remove(c2)
    s.remove(c2, reparent=True)
    s.remove(c1, reparent=True)
    assert s.stat(c3).parent == "img" and s.stat("fork").parent == "img"
    assert fingerprint(fork) == fork_before
    assert read(f"{t}/c") == b"3" and not os.path.exists(f"{t}/a")
    s.gc()
    assert fingerprint(m.mount(s.view("v2", c3))) == c3_before
    r = m.mount(s.prepare("rb", parent=c3))  # a rollback to the newest still works
    assert sorted(os.listdir(r)) == ["b", "bin", "c", "etc", "usr"]


# 12
def test_remove_leaf_then_not_found(env):
    s, m = env
    image(s, m)
    s.remove("img")
    with pytest.raises(deltafs.NotFound):
        s.stat("img")
    with pytest.raises(deltafs.NotFound):
        s.remove("img")
    assert s.gc() == []


# 13
def test_duplicate_key_already_exists(env):
    s, m = env
    image(s, m)
    s.prepare("sb", parent="img")
    with pytest.raises(deltafs.AlreadyExists):
        s.prepare("sb", parent="img")
    with pytest.raises(deltafs.AlreadyExists):
        s.checkpoint("sb", name="img")


# 14
def test_bad_parents(env):
    s, m = env
    with pytest.raises(deltafs.NotFound):
        s.prepare("sb", parent="nope")
    s.prepare("act")
    with pytest.raises(deltafs.InvalidArgument, match="must be committed"):
        s.prepare("sb", parent="act")
    assert [i.name for i in s.walk()] == ["act"]  # the failed prepares left nothing


# 15
def test_invalid_names(env):
    s, m = env
    for bad in ("", "../x", "a/b", "-x"):
        with pytest.raises(deltafs.InvalidArgument):
            s.prepare(bad)


# 16
def test_only_active_snapshots_can_be_committed(env):
    s, m = env
    image(s, m)
    with pytest.raises(deltafs.FailedPrecondition, match="not active"):
        s.commit("x", "img")
    with pytest.raises(deltafs.FailedPrecondition):
        s.checkpoint("img")
    with pytest.raises(deltafs.InvalidArgument, match="view"):
        s.mounts("img")


# 17
def test_walk_lists_every_snapshot_with_parents(env):
    s, m = env
    image(s, m)
    s.prepare("sb", parent="img", labels={"sandbox": "1"})
    n1 = s.checkpoint("sb")
    s.view("v", n1)
    infos = {i.name: i for i in s.walk()}
    assert {k: (v.kind, v.parent) for k, v in infos.items()} == {
        "img": ("committed", None), "sb": ("active", n1), n1: ("committed", "img"), "v": ("view", n1)}
    assert infos["sb"].labels == {"sandbox": "1"}


# 18
def test_diff_reports_types_and_sizes(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/new", b"12345")
    write(f"{t}/etc/hosts", "changed!")
    os.unlink(f"{t}/bin/sh")
    os.symlink("/etc/passwd", f"{t}/link")
    n1 = s.checkpoint("sb")
    got = {(c.kind, c.path, c.type, c.size) for c in s.diff("img", n1)}
    assert got == {("added", b"new", "file", 5), ("modified", b"etc/hosts", "file", 8),
                   ("deleted", b"bin/sh", "file", 1004), ("added", b"link", "symlink", 11)}
    assert {c.path for c in s.diff(None, "img")} >= {b"etc/hosts", b"bin/sh", b"usr/share/doc/x"}
    assert s.diff(n1, "sb") == []  # the active right after its checkpoint


# 19
def test_usage_counts_what_the_snapshot_adds(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/big", os.urandom(1 << 20))
    n1 = s.checkpoint("sb")
    n2 = s.checkpoint("sb")
    assert s.usage(n1).size >= 1 << 20
    assert s.usage(n2).size < 64 << 10  # nothing changed in between


# 20
def test_deleted_and_replaced_dirs_roll_back_exactly(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    os.makedirs(f"{t}/proj/src")
    write(f"{t}/proj/src/a.py", "a")
    n1 = s.checkpoint("sb")
    shutil.rmtree(f"{t}/usr/share")          # dir from the image
    shutil.rmtree(f"{t}/proj")                # dir from an earlier checkpoint
    os.makedirs(f"{t}/proj")
    write(f"{t}/proj/other", "b")             # replaced: old children must not come back
    n2 = s.checkpoint("sb")
    fp2 = fingerprint(t)
    r2 = m.mount(s.prepare("r2", parent=n2))
    assert fingerprint(r2) == fp2
    assert not os.path.exists(f"{r2}/proj/src") and not os.path.exists(f"{r2}/usr/share")
    r1 = m.mount(s.prepare("r1", parent=n1))
    assert read(f"{r1}/proj/src/a.py") == b"a" and os.path.exists(f"{r1}/usr/share/doc/x")


# 21
def test_metadata_kinds_and_links_survive(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/f", "data")
    os.chown(f"{t}/f", 1234, 5678)
    os.chmod(f"{t}/f", 0o4751)
    os.setxattr(f"{t}/f", "user.note", b"v")
    os.utime(f"{t}/f", ns=(1, 1_000_000_123))
    os.link(f"{t}/f", f"{t}/f-hard")
    os.symlink("../../../etc/shadow", f"{t}/escape")
    os.mkfifo(f"{t}/pipe", 0o640)
    os.mknod(f"{t}/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mknod(f"{t}/loop", 0o660 | stat.S_IFBLK, os.makedev(7, 99))
    os.mkdir(f"{t}/sticky", 0o1777)
    n1 = s.checkpoint("sb")
    fp = fingerprint(t)
    r = m.mount(s.prepare("r", parent=n1))
    assert fingerprint(r) == fp
    assert fp["hardlink-groups"] == [[b"f", b"f-hard"]]


# 22
def test_sparse_10g_file_costs_only_its_blocks(env):
    s, m = env
    t = m.mount(s.prepare("sb"))
    with open(f"{t}/sparse", "wb") as f:
        f.seek(10 << 30)
        f.write(b"end")
        f.seek(4096)
        f.write(b"start")
    n1 = s.checkpoint("sb")
    assert s.usage(n1).size < 1 << 20
    r = m.mount(s.prepare("r", parent=n1))
    assert os.stat(f"{r}/sparse").st_size == (10 << 30) + 3
    assert allocated(r) < 1 << 20
    with open(f"{r}/sparse", "rb") as f:
        f.seek(4096)
        assert f.read(5) == b"start"


# 23
def test_fifo_never_blocks_and_symlinks_are_not_followed(env):
    s, m = env
    outside = tempfile.mkdtemp(dir="/var/tmp")
    write(f"{outside}/secret", "host file")
    try:
        t = m.mount(s.prepare("sb"))
        os.mkfifo(f"{t}/fifo")
        os.symlink(outside, f"{t}/hostdir")
        os.symlink(f"{outside}/secret", f"{t}/hostfile")
        # The whole checkpoint must finish even though nobody writes the fifo.
        signal.alarm(20)
        try:
            n1 = s.checkpoint("sb")
            changes = s.diff(None, n1)
        finally:
            signal.alarm(0)
        assert {c.path for c in changes} == {b"fifo", b"hostdir", b"hostfile"}
        r = m.mount(s.prepare("r", parent=n1))
        assert os.readlink(f"{r}/hostdir") == outside and stat.S_ISFIFO(os.lstat(f"{r}/fifo").st_mode)
        assert read(f"{outside}/secret") == b"host file" and os.listdir(outside) == ["secret"]
    finally:
        shutil.rmtree(outside)


# 24
def test_many_checkpoints_stay_correct_and_bounded(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    names, fps = [], []
    for i in range(40):
        write(f"{t}/turn", str(i))
        write(f"{t}/log-{i}", str(i))
        if i % 7 == 3:
            os.unlink(f"{t}/log-{i - 1}")
        names.append(s.checkpoint("sb"))
        fps.append(fingerprint(t))
    if s.driver == "overlay":
        s.compact()
        assert max(s.depth(n) for n in names) <= 16
    for i in (0, 17, 39):
        r = m.mount(s.prepare(f"r{i}", parent=names[i]))
        assert fingerprint(r) == fps[i], f"checkpoint {i}"


# 25
def test_reopen_after_unmount_restores_everything(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/keep", "me")
    n1 = s.checkpoint("sb")
    m.cleanup()
    state, driver = s.state_dir, s.driver
    shut(s)  # btrfs: unmounts the pool file, as a reboot would
    s2 = open_store(state, "auto")
    try:
        assert s2.driver == driver
        assert {i.name for i in s2.walk()} == {"img", "sb", n1}
        r = m.mount(s2.prepare("r", parent=n1))
        assert read(f"{r}/keep") == b"me"
        m.cleanup()
    finally:
        shut(s2)


# 26
def test_second_open_of_a_state_dir_is_refused(env):
    s, m = env
    with pytest.raises(deltafs.FailedPrecondition, match="in use by another process"):
        deltafs.open(s.state_dir, driver=s.driver)


# 27
def test_prepare_checkpoint_then_checkpoint_equals_plain_checkpoint(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    for i in range(20):
        write(f"{t}/f{i}", os.urandom(5000))
    s.prepare_checkpoint("sb")
    write(f"{t}/f3", "changed after the pre-copy")  # must be re-copied
    os.unlink(f"{t}/f4")
    n1 = s.checkpoint("sb")
    fp = fingerprint(t)
    r = m.mount(s.prepare("r", parent=n1))
    assert fingerprint(r) == fp


# 28
def test_checkpoint_after_losing_the_manifest_is_still_exact(env):
    """overlay keeps a per-active manifest of the upper dir; after a crash it may be
    missing, and the next checkpoint must fall back to a full capture (btrfs: no-op)."""
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/a", "1")
    s.checkpoint("sb")
    os.unlink(f"{t}/a")
    write(f"{t}/b", "2")
    if s.driver == "overlay":
        s.gc()  # lets the reaper write the manifest, then we lose it
        adir = os.path.join(s.state_dir, "a", str(s.meta.get("sb").id))
        for f in os.listdir(adir):
            if f.startswith("manifest."):
                os.unlink(os.path.join(adir, f))
        s._manifests.clear()
    n2 = s.checkpoint("sb")
    fp = fingerprint(t)
    r = m.mount(s.prepare("r", parent=n2))
    assert fingerprint(r) == fp and not os.path.exists(f"{r}/a")


# 29
def test_remove_refuses_a_mounted_active_and_background_unmount_frees_it(env):
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    write(f"{t}/f", "x")
    with pytest.raises(deltafs.FailedPrecondition, match="mounted at"):
        s.remove("sb")
    deltafs.unmount(t, background=True)  # returns at once; teardown in a thread
    m.targets.remove(t)
    assert not deltafs.is_mountpoint(t)
    s.remove("sb")
    assert s.gc() == [] or all("trash" in p for p in s.gc())


# 27
def test_a_replaced_dir_stays_replaced_after_compaction(env):
    """A dir removed and made again: its new layer has the dir with a
    whiteout for each old child. Compaction merged that into a layer where
    the dir exists in no lower layer, so overlayfs did not merge it and
    showed the whiteout as a 0/0 character device: the deleted file back by
    name after a rollback (overlay, chains deeper than max_depth)."""
    s, m = env
    image(s, m)
    t = m.mount(s.prepare("sb", parent="img"))
    names = []
    for i in range(36):   # older layers: compaction merges the newest run of the chain
        write(f"{t}/turn", str(i))
        names.append(s.checkpoint("sb"))
    os.mkdir(f"{t}/d")
    write(f"{t}/d/old", "gone soon")
    names.append(s.checkpoint("sb"))
    shutil.rmtree(f"{t}/d")
    os.mkdir(f"{t}/d")
    write(f"{t}/d/new", "kept")
    names.append(s.checkpoint("sb"))
    for i in range(2):
        write(f"{t}/turn", f"after {i}")
        names.append(s.checkpoint("sb"))
    if s.driver == "overlay":
        assert s.compact() > 0
    for i in (37, 39):
        r = m.mount(s.prepare(f"r{i}", parent=names[i]))
        assert sorted(os.listdir(f"{r}/d")) == ["new"], f"checkpoint {i}"
    r = m.mount(s.prepare("r36", parent=names[36]))
    assert sorted(os.listdir(f"{r}/d")) == ["old"]


def test_overlay_layer_listing_sees_opaque_dirs(tmp_path):
    """Compaction's listing of a layer reads each dir's opaque xattr (a
    trusted.* xattr: root). It once joined the bytes name into an f-string
    ("b'd'"), so no dir was ever opaque to the merge (found by mypy)."""
    from deltafs.overlay import OPAQUE, OverlaySnapshotter
    (tmp_path / "d").mkdir()
    (tmp_path / "plain").mkdir()
    os.setxattr(tmp_path / "d", OPAQUE, b"y")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        listing = OverlaySnapshotter._layer_listing(fd)
    finally:
        os.close(fd)
    assert listing[b"d"].opaque and not listing[b"plain"].opaque
