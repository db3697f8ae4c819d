"""The oracle's comparison (crabd/oracle.py): pure, on hand-made records;
and its tree walk on a plain directory (no root)."""

from __future__ import annotations

import base64
import copy
import os
import struct
import time

from crabd.oracle import (APPEND_PREFIX, STATE_PAGE_MAGIC, STATE_RING, _HashCache, _walk_mount, compare,
                          parse_state_page)


def _file(content: str, data: bytes | None = None, mode: str = "644") -> str:
    d = base64.b64encode(data).decode() if data is not None else ""
    return f"f|{mode}|0:0|1|{len(content)}|{content}||||{d}"


def _page(name: str, step: int, h: str, ring: list[tuple[int, str]], spin: int = 0) -> dict:
    return {"name": name, "step": step, "hash": h, "spin": spin, "ring": [[s, x, 0] for s, x in ring]}


def _record(**kw) -> dict:
    rec = {"mounts": {"/": {"fstype": "btrfs", "entries": {"": "d|755|0:0|0|0|||||", "work/a": _file("aa")}},
                      "/dev/shm": {"fstype": "tmpfs", "entries": {"": "d|1777|0:0|0|0|||||"}}},
           "processes": {"1": {"ppid": 0, "comm": "init", "cmdline": "/dev/.crabd-init",
                               "signals": {"SigPnd": "0", "ShdPnd": "0", "SigBlk": "0", "SigIgn": "0"},
                               "page": None, "shared": {}}},
           "errors": []}
    rec.update(kw)
    return rec


def _with_worker(rec: dict, page: dict, log: bytes | None = None, shared: dict | None = None) -> dict:
    rec = copy.deepcopy(rec)
    rec["processes"]["7"] = {"ppid": 1, "comm": "ow-w1", "cmdline": "python3 agent.py spawn w1",
                             "signals": {"SigPnd": "0", "ShdPnd": "0", "SigBlk": "0", "SigIgn": "0"},
                             "page": page, "shared": shared or {}}
    if log is not None:
        rec["mounts"]["/dev/shm"]["entries"][f"{APPEND_PREFIX}w1.log"] = _file(log.hex(), log)
    return rec


def test_identical_records_have_no_difference():
    assert compare(_record(), _record()) == []


def test_a_lost_file_and_a_changed_one_are_reported_with_their_mount():
    truth = _record()
    truth["mounts"]["/dev/shm"]["entries"]["x"] = _file("xx")
    restored = _record()
    restored["mounts"]["/"]["entries"]["work/a"] = _file("bb")
    d = compare(truth, restored)
    assert [(x.where, x.path, x.what) for x in d] == [("file", "/work/a", "content"),
                                                       ("file", "/dev/shm:x", "missing in checkpoint")]


def test_a_missing_mount_and_a_missing_process_are_reported():
    restored = _record()
    del restored["mounts"]["/dev/shm"]
    restored["processes"] = {}
    whats = {(x.where, x.what) for x in compare(_record(), restored)}
    assert ("file", "mount missing in checkpoint") in whats
    assert ("process", "missing in checkpoint") in whats


def test_a_pending_signal_lost_is_a_difference():
    truth = _record()
    truth["processes"]["1"]["signals"]["SigPnd"] = "0000000000000800"
    assert [x.what for x in compare(truth, _record())] == ["signals"]


def test_a_worker_that_ran_on_after_the_restore_is_accepted():
    truth = _with_worker(_record(), _page("w1", 2, "b" * 64, [(1, "a" * 32), (2, "b" * 32)]), b"t1\nt2\n")
    restored = _with_worker(_record(), _page("w1", 3, "c" * 64, [(1, "a" * 32), (2, "b" * 32), (3, "c" * 32)]),
                            b"t1\nt2\nt3\n", shared={"sysv@1": "other"})
    assert compare(truth, restored) == []


def test_a_worker_restored_from_before_its_step_is_reported():
    truth = _with_worker(_record(), _page("w1", 2, "b" * 64, [(1, "a" * 32), (2, "b" * 32)]))
    went_back = _with_worker(_record(), _page("w1", 1, "a" * 64, [(1, "a" * 32)]))
    assert "went back" in compare(truth, went_back)[0].what
    # the step ran again after the restore, with another token: not the same history
    redone = _with_worker(_record(), _page("w1", 2, "d" * 64, [(1, "a" * 32), (2, "d" * 32)]))
    assert "other state at step 2" in compare(truth, redone)[0].what
    redone_on = _with_worker(_record(), _page("w1", 3, "e" * 64, [(1, "a" * 32), (2, "d" * 32), (3, "e" * 32)]))
    assert "history at step 2 differs" in compare(truth, redone_on)[0].what


def test_a_worker_log_that_lost_a_line_is_reported_even_when_the_worker_ran_on():
    truth = _with_worker(_record(), _page("w1", 2, "b" * 64, [(1, "a" * 32), (2, "b" * 32)]), b"t1\nt2\n")
    restored = _with_worker(_record(), _page("w1", 3, "c" * 64, [(1, "a" * 32), (2, "b" * 32), (3, "c" * 32)]),
                            b"t1\nt3\n")
    d = compare(truth, restored)
    assert [(x.path, x.what) for x in d] == [(f"/dev/shm:{APPEND_PREFIX}w1.log", "content")]


def test_shared_memory_differs_only_counts_when_the_worker_did_not_run():
    truth = _with_worker(_record(), _page("w1", 1, "a" * 64, [(1, "a" * 32)]), shared={"sysv@1": "x"})
    restored = _with_worker(_record(), _page("w1", 1, "a" * 64, [(1, "a" * 32)]), shared={"sysv@1": "y"})
    assert [x.what for x in compare(truth, restored)] == ["shared memory"]


def test_record_errors_are_differences():
    assert [x.where for x in compare(_record(errors=["no init"]), _record())] == ["record"]


def test_state_page_layout():
    page = bytearray(4096)
    page[:8] = STATE_PAGE_MAGIC
    struct.pack_into("<Q", page, 8, 5)
    page[16:48] = b"\x11" * 32
    page[48:50] = b"w9"
    struct.pack_into("<Q", page, 64, 1234)
    struct.pack_into("<Q", page, 80 + 24 * 5, 5)
    page[88 + 24 * 5:104 + 24 * 5] = b"\x22" * 16
    struct.pack_into("<Q", page, 80 + 24 * STATE_RING + 8 * 5, 99)
    p = parse_state_page(bytes(page))
    assert p == {"name": "w9", "step": 5, "hash": "11" * 32, "spin": 1234, "ring": [[5, "22" * 16, 99]]}
    assert parse_state_page(b"\0" * 4096) is None


def test_walk_never_follows_symlinks_nor_opens_fifos(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"hello")
    (tmp_path / "link").symlink_to("/etc")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / f"{APPEND_PREFIX}w.log").write_bytes(b"t1\n")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        e = _walk_mount(fd, (), _HashCache(0))
    finally:
        os.close(fd)
    assert set(e) == {"", "d", "d/f", "link", "fifo", f"{APPEND_PREFIX}w.log"}
    assert e["link"].split("|")[0] == "l" and bytes.fromhex(e["link"].split("|")[6]) == b"/etc"
    assert e["fifo"].split("|")[0] == "p"
    assert base64.b64decode(e[f"{APPEND_PREFIX}w.log"].split("|")[9]) == b"t1\n"
    # a changed file with the same name and size has another content hash
    before = e["d/f"]
    (tmp_path / "d" / "f").write_bytes(b"HELLO")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert _walk_mount(fd, (), _HashCache(0))["d/f"] != before
    finally:
        os.close(fd)


def _walk(root, cache):
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return _walk_mount(fd, (), cache)
    finally:
        os.close(fd)


def test_a_walk_that_takes_old_entries_from_the_cache_sees_every_change(tmp_path):
    """The cached walk (find reports only directories and entries changed
    since the cache's instant; the cache's listings and hashes give the
    rest) equals a full read of every entry, after each kind of change, in
    place or by rename."""
    (tmp_path / "d" / "e").mkdir(parents=True)
    for n in ("a", "b", "c"):
        (tmp_path / "d" / n).write_bytes(n.encode() * 10)
    (tmp_path / "d" / "e" / "x").write_bytes(b"x")
    (tmp_path / "top").write_bytes(b"t")
    time.sleep(1.05 - time.time() % 1)  # the cache's instant: a whole second after the tree was made
    cache = _HashCache(time.time_ns())
    time.sleep(0.02)
    full = lambda: _walk(tmp_path, _HashCache(0))  # noqa: E731 (nothing is old: every entry read)
    assert _walk(tmp_path, cache) == full() == _walk(tmp_path, cache)
    saved = _walk(tmp_path, cache)
    steps = [lambda: (tmp_path / "d" / "a").write_bytes(b"A" * 10),          # in place: only a's ctime moves
             lambda: os.chmod(tmp_path / "d" / "e" / "x", 0o600),
             lambda: os.setxattr(tmp_path / "top", "user.k", b"v"),
             lambda: os.rename(tmp_path / "d" / "b", tmp_path / "d" / "e" / "b"),
             lambda: os.unlink(tmp_path / "d" / "c"),
             lambda: os.link(tmp_path / "top", tmp_path / "d" / "e" / "top2"),
             lambda: os.symlink("/etc", tmp_path / "d" / "l")]
    for step in steps:
        step()
        got = _walk(tmp_path, cache)
        assert got == full(), step
        assert got != saved
    assert cache.hits and cache.listed  # the unchanged entries were taken from the cache


def test_the_daemon_hook_records_at_the_snapshot_or_at_a_snapshotless_commit(tmp_path):
    from types import SimpleNamespace

    from crabd.oracle import load_record, record_at_capture
    calls: list[str] = []

    class Runtime:
        def get(self, sid):
            raise LookupError(sid)  # not running: recorded without a freeze

    daemon = SimpleNamespace(
        options=SimpleNamespace(oracle_dir=str(tmp_path)), runtime=Runtime(),
        fs=SimpleNamespace(checkpoint=lambda key, name=None: calls.append(f"snapshot {name}")),
        store=SimpleNamespace(commit_checkpoint=lambda cid, **f: calls.append(f"commit {cid}")))
    fs_ck = SimpleNamespace(id="sb-1", sandbox_id="sb", turn=1, plan="FS")
    skip_ck = SimpleNamespace(id="sb-2", sandbox_id="sb", turn=2, plan="SKIP")
    record_at_capture(daemon, fs_ck)
    daemon.fs.checkpoint("key", name="sb-1")
    assert (tmp_path / "sb-1.json.zst").exists()
    daemon.store.commit_checkpoint("sb-1")
    record_at_capture(daemon, skip_ck)
    assert not (tmp_path / "sb-2.json.zst").exists()
    daemon.store.commit_checkpoint("sb-2")
    rec = load_record(tmp_path / "sb-2.json.zst")
    assert (rec["checkpoint"], rec["plan"], rec["frozen_by"]) == ("sb-2", "SKIP", None)
    assert calls == ["snapshot sb-1", "commit sb-1", "commit sb-2"]


def test_a_refused_dump_is_checked_on_its_rootfs_files_only():
    """CRIU refuses a process holding an io_uring: crabd commits the files
    and says so; that checkpoint and those sharing its missing image claim
    their rootfs files, not processes nor the tmpfs only an image holds."""
    from bench.oracle import declared, refused_dumps

    cks = [{"id": "a", "parent": None, "proc_image": "a", "reasons": []},
           {"id": "b", "parent": "a", "proc_image": None, "reasons": ["x", "process image not captured: dump ..."]},
           {"id": "c", "parent": "b", "proc_image": None, "reasons": ["no recovery-relevant OS effect seen"]},
           {"id": "d", "parent": "c", "proc_image": "d", "reasons": []},
           {"id": "e", "parent": "d", "proc_image": None, "reasons": []}]
    assert refused_dumps(cks) == {"b", "c"}
    truth = _record()
    truth["mounts"]["/dev/shm"]["entries"]["x"] = _file("xx")
    restored = _record(processes={})
    restored["mounts"]["/"]["entries"]["work/a"] = _file("bb")
    d = declared(compare(truth, restored), truth)
    assert [(x.where, x.path) for x in d] == [("file", "/work/a")]


def test_another_process_s_nice_rlimit_and_policy_are_compared():
    """A later turn renices a worker, lowers its rlimit or changes its
    policy (it does not run): the restore must keep each."""
    truth = _record()
    truth["processes"]["1"].update(sched="nice=7 rt=0 policy=3", limits="Max open files 64 4096 files")
    restored = copy.deepcopy(truth)
    assert compare(truth, restored) == []
    restored["processes"]["1"].update(sched="nice=0 rt=0 policy=0", limits="Max open files 1024 4096 files")
    assert [(x.where, x.what) for x in compare(truth, restored)] == [("process", "sched"), ("process", "limits")]


def test_bytes_queued_in_a_worker_s_fd_are_compared_unless_it_ran():
    page = _page("w1", 1, "aa" * 32, [(1, "aa" * 16)])
    truth = _with_worker(_record(), page)
    truth["processes"]["7"]["fds"] = {"10": "pipe pos=0 flags=00 queued=6 data=ab"}
    restored = copy.deepcopy(truth)
    restored["processes"]["7"]["fds"] = {"10": "pipe pos=0 flags=00 queued=0"}
    assert [(x.where, x.path, x.what) for x in compare(truth, restored)] == [("process", "7", "fds")]


def test_ipc_objects_changed_or_removed_are_differences():
    truth = _record(ipc={"msg:0": "key=0 perms=600 cbytes=5 qnum=1 uid=0:0 data=ab",
                         "sem:1": "key=0 perms=600 nsems=2 uid=0:0 values=[0, 7]"})
    restored = _record(ipc={"msg:0": "key=0 perms=600 cbytes=0 qnum=0 uid=0:0 data=00",
                            "shm:2": "key=0 perms=600 size=4096 uid=0:0 data=cd"})
    assert [(x.where, x.path, x.what) for x in compare(truth, restored)] == [
        ("ipc", "msg:0", "changed"), ("ipc", "sem:1", "missing in checkpoint"),
        ("ipc", "shm:2", "not in truth (extra in checkpoint)")]


def test_a_segment_a_worker_that_ran_on_wrote_is_accepted():
    """A sysv worker's timer fired in the fork after its restore: its
    attached segment's bytes moved on with it (and its state page says so)."""
    t_page = _page("w1", 1, "aa" * 32, [(1, "aa" * 16)])
    r_page = _page("w1", 2, "bb" * 32, [(1, "aa" * 16), (2, "bb" * 16)])
    truth = _with_worker(_record(ipc={"shm:0": "key=0 perms=600 size=4096 uid=0:0 data=11"}), t_page,
                         shared={"sysv@7f00": "11"})
    restored = _with_worker(_record(ipc={"shm:0": "key=0 perms=600 size=4096 uid=0:0 data=22"}), r_page,
                            shared={"sysv@7f00": "22"})
    assert compare(truth, restored) == []
    # the same bytes with the worker not run on: lost
    stuck = _with_worker(_record(ipc={"shm:0": "key=0 perms=600 size=4096 uid=0:0 data=22"}), t_page,
                         shared={"sysv@7f00": "22"})
    assert [(x.where, x.what) for x in compare(truth, stuck)] == [("app", "shared memory"), ("ipc", "changed")]


def test_a_sigchld_pending_on_crabd_s_init_is_not_a_difference_but_other_signals_are():
    """crabd-init reaps on every wake-up, SIGCHLD or not: a pending SIGCHLD
    (ShdPnd 0x10000, seen in a SKIP's truth right after the turn's command
    exited) changes nothing it does; on a worker it would be a loss."""
    truth = _record()
    truth["processes"]["1"]["signals"]["ShdPnd"] = "0000000000010000"
    assert compare(truth, _record()) == []
    truth["processes"]["1"]["signals"]["ShdPnd"] = "0000000000010800"  # and SIGUSR2 (bit 11): a difference
    assert [x.what for x in compare(truth, _record())] == ["signals"]
    page = _page("w1", 1, "a" * 64, [(1, "a" * 32)])
    t2, r2 = _with_worker(_record(), page), _with_worker(_record(), page)
    t2["processes"]["7"]["signals"]["ShdPnd"] = "0000000000010000"
    assert [(x.path, x.what) for x in compare(t2, r2)] == [("7", "signals")]


def test_a_skip_s_truth_is_recorded_when_its_plan_is_made_and_not_again_at_its_commit(tmp_path):
    """oracle.open_at_plan (crabd/daemon/turns.py): a turn the classifier
    calls SKIP is frozen from before its row is opened to after the read
    (told to the inspector); its commit records nothing more. A turn that
    is not SKIP is neither frozen nor read there."""
    import contextlib
    from types import SimpleNamespace

    from crabd.oracle import load_record, open_at_plan, record_at_capture
    from ebpf import Effects, Sample
    calls: list[str] = []

    class Freezer:
        def __init__(self, layout, rel):
            pass

        def freeze(self):
            calls.append("freeze")

        def thaw(self):
            calls.append("thaw")

    class Runtime:
        layout = None

        def get(self, sid):
            return SimpleNamespace(cgroup_rel="x", pid=None, status="stopped")

    @contextlib.contextmanager
    def pause(sid, d):
        calls.append("before_pause")
        yield
        calls.append("after_pause")

    daemon = SimpleNamespace(
        options=SimpleNamespace(oracle_dir=str(tmp_path)), runtime=Runtime(), _inspector_pause=pause,
        fs=SimpleNamespace(checkpoint=lambda key, name=None: calls.append(f"snapshot {name}")),
        store=SimpleNamespace(commit_checkpoint=lambda cid, **f: calls.append(f"commit {cid}")))
    import crabd.runtime.cgroups as cg
    real, cg.Freezer = cg.Freezer, Freezer
    try:
        skip = SimpleNamespace(id="sb-2", sandbox_id="sb", turn=2, plan="SKIP")
        quiet = Effects(sandbox_id="sb", turn=2, source="bpf-cgroup")
        got = open_at_plan(daemon, "sb", quiet, lambda: calls.append("open") and None or skip)
        assert got is skip
        assert calls == ["freeze", "before_pause", "open", "thaw", "after_pause"]
        rec = load_record(tmp_path / "sb-2.json.zst")
        assert (rec["checkpoint"], rec["plan"], rec["frozen_by"]) == ("sb-2", "SKIP", "oracle-plan")
        (tmp_path / "sb-2.json.zst").unlink()
        record_at_capture(daemon, skip)
        daemon.store.commit_checkpoint("sb-2")
        assert not (tmp_path / "sb-2.json.zst").exists()  # not read again at the commit
        calls.clear()
        fs = SimpleNamespace(id="sb-3", sandbox_id="sb", turn=3, plan="FS")
        wrote = Effects(sandbox_id="sb", turn=3, source="bpf-cgroup", files={"write": Sample(count=1, sample=["/a"])})
        assert open_at_plan(daemon, "sb", wrote, lambda: fs) is fs
        assert calls == [] and not (tmp_path / "sb-3.json.zst").exists()
    finally:
        cg.Freezer = real


def test_inode_flags_are_in_the_tree_record_and_a_lost_one_is_a_difference(tmp_path):
    """chattr +A (FS_IOC_SETFLAGS) changes no byte, mode nor xattr: the
    record keeps the inode's flags, so a restore that lost one differs."""
    import pytest

    from bench.oracle_agent import op_chattr
    (tmp_path / "f").write_bytes(b"x")
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = _walk_mount(top, (), _HashCache(0))
        try:
            op_chattr(str(tmp_path / "f"), "+A")
        except OSError as e:
            pytest.skip(f"{tmp_path}'s file system has no inode flags: {e}")
        after = _walk_mount(top, (), _HashCache(0))
    finally:
        os.close(top)
    assert before["f"] != after["f"]
    truth, restored = _record(), _record()
    truth["mounts"]["/"]["entries"]["work/a"] = after["f"]
    restored["mounts"]["/"]["entries"]["work/a"] = before["f"]
    assert [(x.path, x.what) for x in compare(truth, restored)] == [("/work/a", "flags")]


def test_a_held_deleted_file_s_content_is_recorded_through_the_holder_s_fd(tmp_path):
    """A deleted file only a worker's fd names: written through /proc/PID/fd/N
    by a later turn, its content is in the record of the worker's fds."""
    from crabd.oracle import _held_deleted
    p = tmp_path / "held"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"abc")
        os.unlink(p)
        a = _held_deleted(os.getpid(), str(fd))
        w = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        os.write(w, b"d")
        os.close(w)
        b = _held_deleted(os.getpid(), str(fd))
        os.truncate(f"/proc/self/fd/{fd}", 1)
        c = _held_deleted(os.getpid(), str(fd))
    finally:
        os.close(fd)
    assert "size=3" in a and "size=4" in b and "size=1" in c
    assert len({x.split("content=")[1] for x in (a, b, c)}) == 3


def test_a_held_deleted_file_that_differs_is_reported_even_when_its_worker_ran_on():
    truth = _with_worker(_record(), _page("w1", 1, "a" * 64, [(1, "a" * 32)]))
    truth["processes"]["7"]["fds"] = {"9": "file pos=0 flags=02 deleted size=4 content=aa iflags=0"}
    restored = _with_worker(_record(), _page("w1", 2, "b" * 64, [(1, "a" * 32), (2, "b" * 32)]))
    restored["processes"]["7"]["fds"] = {"9": "file pos=0 flags=02 deleted size=3 content=bb iflags=0"}
    assert [(x.path, x.what) for x in compare(truth, restored)] == [("7", "held deleted file")]
    restored["processes"]["7"]["fds"] = dict(truth["processes"]["7"]["fds"])
    assert compare(truth, restored) == []
