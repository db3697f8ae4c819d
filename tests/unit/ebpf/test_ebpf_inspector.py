"""The Inspector's aggregation, driven through FakeLoader and FakeProcessTable."""

import json

import pytest

from ebpf import AlreadyWatched, Effects, Inspector, NotWatched, PlanKind, classify
from ebpf._events import (AF_INET, AF_UNIX, O_CREAT, O_TRUNC, O_WRONLY, OPAQUE_URING_WORK, URING_OPS, Event,
                          EventKind as K)
from ebpf.testing import FakeClock, FakeLoader, FakeProcessTable

CG = "/sys/fs/cgroup/unified/sb"


@pytest.fixture
def env():
    loader, procs, clock = FakeLoader(), FakeProcessTable(), FakeClock()
    procs.start(CG, 1, ("/dev/crabd-init",), start=1)
    procs.procs[1] = procs.procs[1].__class__(1, 1, 0, 0, False, "crabd-init", ("/dev/crabd-init",))
    insp = Inspector(loader, processes=procs, clock=clock, poll_interval=None)
    insp.watch("sb", CG, init_pid=1)
    tag = loader.tag_of(1)
    return insp, loader, procs, tag


def ev(kind, tag, pid=100, **kw):
    return Event(kind=kind, tag=tag, pid=pid, ts=kw.pop("ts", 0), **kw)


def test_empty_turn_is_skip(env):
    insp, loader, procs, tag = env
    insp.begin_turn("sb")
    e = insp.end_turn("sb")
    assert (e.turn, e.source, e.file_changes) == (1, "bpf-pids", 0)
    assert e.started_ns and e.ended_ns > e.started_ns
    assert classify(e).kind is PlanKind.SKIP


def test_file_events_are_counted_sampled_and_scoped(env):
    insp, loader, procs, tag = env
    loader.emit(
        ev(K.OPEN_WRITE, tag, path="out.txt", arg=O_WRONLY | O_CREAT | O_TRUNC),
        ev(K.OPEN_WRITE, tag, path="/dev/null", arg=O_WRONLY),
        ev(K.OPEN_WRITE, tag, path="/dev/pts/0", arg=O_WRONLY),
        ev(K.OPEN_WRITE, tag, path="/proc/self/oom_score_adj", arg=O_WRONLY),
        ev(K.RENAME, tag, path="a", path2="/app/b"),
        ev(K.UNLINK, tag, path="x", dfd=4),
        ev(K.CHMOD, tag, path="", dfd=3),
        ev(K.SYMLINK, tag, path="/app/l", path2="target"),
        ev(K.XATTR, tag, path="/app/f", path2="user.k"),
    )
    loader.count_writes(tag, 12)
    e = insp.end_turn("sb")
    assert e.files["write"].sample == ["out.txt"]
    assert e.files["rename"].sample == ["a -> /app/b"]
    assert e.files["delete"].sample == ["fd4:x"]
    assert e.files["chmod"].sample == ["fd3"]
    assert e.files["symlink"].sample == ["/app/l -> target"]
    assert e.files["xattr"].sample == ["/app/f [user.k]"]
    assert e.special_writes["device"].count == 2
    assert e.special_writes["process"].count == 1
    assert e.write_syscalls == 12
    assert classify(e).kind is PlanKind.FS


def test_only_device_writes_is_skip(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.OPEN_WRITE, tag, path="/dev/null", arg=O_WRONLY))
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP


def test_samples_are_bounded_counts_are_not(env):
    insp, loader, procs, tag = env
    loader.emit(*[ev(K.OPEN_WRITE, tag, path=f"/app/f{i}", arg=O_WRONLY) for i in range(100)])
    e = insp.end_turn("sb")
    assert e.files["write"].count == 100 and len(e.files["write"].sample) == 16


def test_process_alive_at_end_is_fs_proc_and_short_lived_is_not(env):
    insp, loader, procs, tag = env
    # started and finished inside the turn
    loader.emit(ev(K.FORK, tag, arg=200), ev(K.EXIT, tag, pid=200))
    e = insp.end_turn("sb")
    assert e.processes_started == 1 and not e.new_processes
    assert classify(e).kind is PlanKind.SKIP
    # started and still alive
    procs.start(CG, 300, ("sleep", "1000"), start=50)
    loader.emit(ev(K.FORK, tag, arg=300))
    e = insp.end_turn("sb")
    assert [(p.pid, p.cmdline) for p in e.new_processes] == [(300, ["sleep", "1000"])]
    assert classify(e).kind is PlanKind.FS_PROC
    # idle next turn: SKIP; it runs: FS_PROC; it exits: FS_PROC
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP
    procs.run(300)
    e = insp.end_turn("sb")
    assert [p.pid for p in e.active_processes] == [300]
    procs.stop(300)
    e = insp.end_turn("sb")
    assert [p.pid for p in e.exited_processes] == [300]


def test_pid_reuse_is_a_new_process(env):
    insp, loader, procs, tag = env
    procs.start(CG, 300, ("sleep", "1"), start=50)
    insp.end_turn("sb")
    procs.stop(300)
    procs.start(CG, 300, ("python3", "-m", "http.server"), start=90)
    e = insp.end_turn("sb")
    assert [p.cmdline for p in e.new_processes] == [["python3", "-m", "http.server"]]
    assert [p.pid for p in e.exited_processes] == [300]


def test_stateless_init_waking_is_not_activity(env):
    insp, loader, procs, tag = env
    procs.run(1, 5)
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP


def test_events_of_an_older_process_mark_it_active(env):
    insp, loader, procs, tag = env
    procs.start(CG, 300, ("python3", "srv.py"), start=50)
    insp.end_turn("sb")
    loader.emit(ev(K.CONNECT, tag, pid=300, family=AF_INET, addr="127.0.0.1", port=5432))
    e = insp.end_turn("sb")
    assert [p.pid for p in e.active_processes] == [300]


def test_exec_argv_package_manager_and_external(env):
    insp, loader, procs, tag = env
    loader.emit(
        ev(K.EXEC_ARGS, tag, pid=100, tid=100, path="/usr/bin/pip", argv=("pip", "install", "w.whl")),
        ev(K.EXEC, tag, pid=100, arg=100, comm="pip"),
        ev(K.EXEC_ARGS, tag, pid=101, path="/usr/bin/nope", argv=("nope",)),  # failed attempt
        ev(K.EXEC_ARGS, tag, pid=102, path="/usr/bin/git", argv=("git", "push", "origin")),
        ev(K.EXEC, tag, pid=102, arg=102, comm="git"),
    )
    e = insp.end_turn("sb")
    assert e.exec_count == 2
    assert e.package_managers == ["pip"]
    assert e.external and "git push" in e.external_reasons[0]
    assert [x.filename for x in e.execs] == ["/usr/bin/pip", "/usr/bin/git"]
    assert classify(e).kind is PlanKind.FS


def test_exec_confirmed_after_the_cut_keeps_its_argv(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.EXEC_ARGS, tag, pid=100, path="/usr/bin/curl", argv=("curl", "x")))
    insp.end_turn("sb")
    loader.emit(ev(K.EXEC, tag, pid=100, arg=100, comm="curl"))
    e = insp.end_turn("sb")
    assert e.execs[0].argv == ["curl", "x"] and e.external


def test_connections_split_loopback_external_unix(env):
    insp, loader, procs, tag = env
    loader.emit(
        ev(K.CONNECT, tag, family=AF_INET, addr="127.0.0.1", port=8000),
        ev(K.CONNECT, tag, family=10, addr="::1", port=80),
        ev(K.CONNECT, tag, family=10, addr="::ffff:127.0.0.1", port=80),
        ev(K.CONNECT, tag, family=AF_INET, addr="10.251.0.2", port=9),
        ev(K.SEND, tag, family=AF_INET, addr="8.8.8.8", port=53),
        ev(K.CONNECT, tag, family=AF_UNIX, path="/run/x.sock"),
        ev(K.CONNECT, tag, family=0),
        ev(K.SEND, tag, family=16),
    )
    e = insp.end_turn("sb")
    assert e.connections.loopback.count == 3
    assert e.connections.external.sample == ["10.251.0.2:9", "8.8.8.8:53"]
    assert e.connections.unix.sample == ["/run/x.sock"]
    assert e.external and len(e.external_reasons) == 2
    assert classify(e).kind is PlanKind.SKIP  # external effects do not need a checkpoint


def test_listening_socket_and_unix_socket_file(env):
    insp, loader, procs, tag = env
    procs.start(CG, 400, ("python3", "-m", "http.server"), start=70)
    loader.emit(
        ev(K.BIND, tag, pid=400, arg=3, family=AF_INET, addr="0.0.0.0", port=8000),
        ev(K.LISTEN, tag, pid=400, arg=3),
        ev(K.BIND, tag, pid=401, arg=4, family=AF_UNIX, path="/app/s.sock"),
        ev(K.LISTEN, tag, pid=401, arg=9),
    )
    e = insp.end_turn("sb")
    assert [(s.pid, s.address, s.alive) for s in e.listening] == [(400, "0.0.0.0:8000", True), (401, "?", False)]
    assert e.files["socket"].sample == ["/app/s.sock"]
    assert classify(e).kind is PlanKind.FS_PROC


def test_mount_kernel_objects_blind_spots(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.MOUNT, tag, path="/mnt", path2="tmpfs"), ev(K.KERNEL_OBJECT, tag, arg=1),
                ev(K.OPAQUE, tag, arg=1), ev(K.OPAQUE, tag, arg=1))
    e = insp.end_turn("sb")
    assert e.mounts.sample == ["mount /mnt (tmpfs)"]
    assert e.kernel_objects.count == 1
    assert e.blind_spots == ["io_uring"]
    assert classify(e).kind is PlanKind.FS_PROC


def test_io_uring_work_of_an_older_ring_saves_everything(env):
    """A ring set up earlier: its submissions, and requests the kernel runs
    later (task work, iou-sqp, iou-wrk threads), are opaque file changes."""
    insp, loader, procs, tag = env
    loader.emit(ev(K.OPAQUE, tag, arg=OPAQUE_URING_WORK, ret=URING_OPS.index("WRITE"), comm="iou-sqp-100"),
                ev(K.OPAQUE, tag, pid=101, arg=OPAQUE_URING_WORK, ret=-1, comm="ow-u"))
    e = insp.end_turn("sb")
    assert e.blind_spots == ["io_uring work of 100 'iou-sqp-100' (WRITE)",
                             "io_uring work of 101 'ow-u' (a request submitted earlier)"]
    assert classify(e).kind is PlanKind.FS_PROC


def test_dropped_events_force_worst_case(env):
    insp, loader, procs, tag = env
    loader.drop(tag, 3)
    e = insp.end_turn("sb")
    assert e.dropped_events == 3 and e.external_unknown
    assert classify(e).kind is PlanKind.FS_PROC
    assert insp.end_turn("sb").dropped_events == 0  # per turn, not cumulative


def test_events_after_the_cut_go_to_the_next_turn(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.UNLINK, tag, path="late"), ts=10**18)
    e1 = insp.end_turn("sb")
    e2 = insp.end_turn("sb")
    assert e1.file_changes == 0 and e2.files["delete"].sample == ["late"]


def test_events_between_turns_count_in_next_turn(env):
    insp, loader, procs, tag = env
    insp.end_turn("sb")
    loader.emit(ev(K.UNLINK, tag, path="bg.log"))  # a background process, no turn open
    insp.begin_turn("sb")
    assert insp.end_turn("sb").files["delete"].count == 1


def test_other_tags_are_ignored_and_sandboxes_are_separate(env):
    insp, loader, procs, tag = env
    procs.start("/sys/fs/cgroup/unified/other", 500)
    insp.watch("other", "/sys/fs/cgroup/unified/other", init_pid=500)
    t2 = loader.tag_of(500)
    assert t2 != tag
    loader.emit(ev(K.UNLINK, t2, path="x"), ev(K.UNLINK, 999, path="y"))
    assert insp.end_turn("sb").file_changes == 0
    assert insp.end_turn("other").file_changes == 1


def test_watch_unwatch_errors(env):
    insp, loader, procs, tag = env
    with pytest.raises(AlreadyWatched):
        insp.watch("sb", CG, init_pid=1)
    insp.unwatch("sb")
    assert 1 not in loader.pids
    with pytest.raises(NotWatched):
        insp.end_turn("sb")
    with pytest.raises(NotWatched):
        insp.unwatch("sb")


def test_effects_json_round_trip_and_schema(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.OPEN_WRITE, tag, path="f", arg=O_WRONLY))
    e = insp.end_turn("sb")
    back = Effects.model_validate_json(e.model_dump_json())
    assert back == e
    schema = Effects.model_json_schema()
    assert "files" in schema["properties"] and "description" in schema["properties"]["dropped_events"]
    json.dumps(schema)


def test_cgroup_mode_uses_inode_and_level(tmp_path, monkeypatch):
    import ebpf._inspector as mod
    loader = FakeLoader(mode="bpf-cgroup")
    procs = FakeProcessTable()
    cg = tmp_path / "crabd" / "sb1"
    cg.mkdir(parents=True)
    monkeypatch.setattr(mod, "cgroup2_mounts", lambda: [tmp_path])
    insp = Inspector(loader, processes=procs, clock=FakeClock(), poll_interval=None)
    insp.watch("sb1", cg)
    assert loader.cgroups == {cg.stat().st_ino: (2, 1)}
    insp.unwatch("sb1")
    assert loader.cgroups == {}
    insp.close()
    assert loader.closed


def test_exclusive_create_then_delete_by_same_process_cancels(env):
    insp, loader, procs, tag = env
    excl = O_WRONLY | O_CREAT | 0o200
    loader.emit(
        ev(K.OPEN_WRITE, tag, pid=10, path="/app/.git/index.lock", arg=excl),
        ev(K.UNLINK, tag, pid=10, path="/app/.git/index.lock"),
        ev(K.MKDIR, tag, pid=10, path="/tmp/tmpd"),
        ev(K.RMDIR, tag, pid=10, path="/tmp/./tmpd", dfd=7),
    )
    e = insp.end_turn("sb")
    assert e.file_changes == 0 and e.transient_files == 2
    assert classify(e).kind is PlanKind.SKIP


def test_cancellation_is_conservative(env):
    insp, loader, procs, tag = env
    excl = O_WRONLY | O_CREAT | 0o200
    loader.emit(
        # not exclusive: the file may have existed, its deletion is a change
        ev(K.OPEN_WRITE, tag, pid=10, path="/app/a", arg=O_WRONLY | O_CREAT),
        ev(K.UNLINK, tag, pid=10, path="/app/a"),
        # a relative path may resolve elsewhere after a chdir: never cancelled
        ev(K.OPEN_WRITE, tag, pid=10, path="b", arg=excl),
        ev(K.UNLINK, tag, pid=10, path="b"),
        # deleted by another process: not cancelled either
        ev(K.OPEN_WRITE, tag, pid=10, path="/app/d", arg=excl),
        ev(K.UNLINK, tag, pid=11, path="/app/d"),
        # renamed away before the delete: the rename stays a change
        ev(K.OPEN_WRITE, tag, pid=10, path="/app/c.lock", arg=excl),
        ev(K.RENAME, tag, pid=10, path="/app/c.lock", path2="/app/c"),
    )
    e = insp.end_turn("sb")
    assert e.files["write"].count == 4 and e.files["delete"].count == 3 and e.files["rename"].count == 1
    assert classify(e).kind is PlanKind.FS


def test_exclusive_create_kept_across_the_cut_is_a_change(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.OPEN_WRITE, tag, pid=10, path="/app/x", arg=O_WRONLY | O_CREAT | 0o200))
    assert insp.end_turn("sb").files["write"].count == 1
    loader.emit(ev(K.UNLINK, tag, pid=10, path="/app/x"))
    assert insp.end_turn("sb").files["delete"].count == 1


def test_o_tmpfile_is_transient_but_linking_it_is_a_change(env):
    insp, loader, procs, tag = env
    from ebpf._events import O_TMPFILE
    loader.emit(ev(K.OPEN_WRITE, tag, path="/tmp", arg=O_TMPFILE | 0o2))
    e = insp.end_turn("sb")
    assert e.file_changes == 0 and e.transient_files == 1
    loader.emit(ev(K.OPEN_WRITE, tag, path="/tmp", arg=O_TMPFILE | 0o2),
                ev(K.LINK, tag, path="/proc/self/fd/3", path2="/tmp/named"))
    e = insp.end_turn("sb")
    assert e.files["link"].count == 1 and classify(e).kind is PlanKind.FS


def test_inode_flags_set_by_ioctl_are_a_file_change(env):
    insp, loader, procs, tag = env
    from ebpf._events import FS_IOC_SETFLAGS, program_text
    assert "FS_IOC_SETFLAGS_" in program_text() and "sys_enter_ioctl" in program_text()
    loader.emit(ev(K.ATTR, tag, path="", dfd=3, arg=FS_IOC_SETFLAGS))
    e = insp.end_turn("sb")
    assert e.files["attr"].sample == ["fd3"] and classify(e).kind is PlanKind.FS
    # on a memory file system: process state, and CRIU's tmpfs copy keeps no flags: said
    loader.emit(ev(K.ATTR, tag, path="", dfd=4, arg=FS_IOC_SETFLAGS, fsmagic=0x01021994, fsmode=0o100644))
    plan = classify(insp.end_turn("sb"))
    assert plan.kind is PlanKind.FS_PROC
    assert any(r.startswith("not restored: inode flags set on a memory file system (fd4)") for r in plan.reasons), plan


def test_a_file_only_a_process_holds_is_process_state(env):
    # a deleted file (or memfd) reached through /proc/PID/fd/N: the kernel
    # side marks an open of a file with no links; other calls through the
    # alias are taken as such a file
    insp, loader, procs, tag = env
    from ebpf._events import FS_UNLINKED
    loader.emit(ev(K.OPEN_WRITE, tag, path="/proc/9/fd/3", arg=O_WRONLY, fsmagic=0x9123683E, fsmode=0o100644 | FS_UNLINKED))
    e = insp.end_turn("sb")
    assert e.special_writes["held"].count == 1 and e.file_changes == 0
    assert classify(e).kind is PlanKind.FS_PROC
    loader.emit(ev(K.TRUNCATE, tag, path="/proc/9/fd/3"))
    assert classify(insp.end_turn("sb")).kind is PlanKind.FS_PROC
    loader.emit(ev(K.OPEN_WRITE, tag, path="/proc/9/fd/3", arg=O_WRONLY))  # not resolved in the kernel
    assert classify(insp.end_turn("sb")).kind is PlanKind.FS_PROC
    # a named file through the alias, resolved in the kernel (btrfs): a plain file change
    loader.emit(ev(K.OPEN_WRITE, tag, path="/proc/9/fd/5", arg=O_WRONLY, fsmagic=0x9123683E, fsmode=0o100644))
    e = insp.end_turn("sb")
    assert e.file_changes == 1 and classify(e).kind is PlanKind.FS


def test_outside_paths_do_not_count(env):
    insp, loader, procs, tag = env
    procs.start("/cg/x", 900)
    insp.watch("x", "/cg/x", init_pid=900, outside_paths=("/dev/.crabd",))
    t = loader.tag_of(900)
    loader.emit(ev(K.OPEN_WRITE, t, path="/dev/.crabd/exec-1.fifo", arg=O_WRONLY),
                ev(K.OPEN_WRITE, t, path="/dev/.crabdX", arg=O_WRONLY))
    e = insp.end_turn("x")
    assert e.special_writes["outside"].count == 1
    assert e.special_writes["tmpfs"].sample == ["/dev/.crabdX"]


def test_kernel_counted_events_add_to_counts_per_turn(env):
    insp, loader, procs, tag = env
    loader.emit(ev(K.OPEN_WRITE, tag, path="/app/a", arg=O_WRONLY))
    loader.suppress(tag, int(K.OPEN_WRITE), 5000)
    loader.suppress(tag, int(K.UTIMES), 10)
    e = insp.end_turn("sb")
    assert e.files["write"].count == 5001 and e.files["write"].sample == ["/app/a"]
    assert e.files["utimes"].count == 10 and e.files["utimes"].sample == []
    assert any("5010 file events" in n for n in e.notes)
    assert classify(e).kind is PlanKind.FS
    assert insp.end_turn("sb").file_changes == 0  # deltas, not totals


def test_epoch_moves_at_every_turn_end(env):
    insp, loader, procs, tag = env
    insp.end_turn("sb")
    insp.end_turn("sb")
    assert loader.epochs[tag] == 3  # watch, then two turn ends


def test_cgroup_outside_a_v2_hierarchy_is_invalid(tmp_path, monkeypatch):
    import ebpf._inspector as mod
    from ebpf import InvalidArgument
    monkeypatch.setattr(mod, "cgroup2_mounts", lambda: [tmp_path / "cg2"])
    insp = Inspector(FakeLoader(mode="bpf-cgroup"), processes=FakeProcessTable(), poll_interval=None)
    with pytest.raises(InvalidArgument, match="not in a cgroup v2 hierarchy"):
        insp.watch("x", tmp_path / "elsewhere")
    with pytest.raises(InvalidArgument, match="No such file"):
        insp.watch("x", tmp_path / "cg2" / "missing")


def test_end_turn_waits_for_new_processes_to_settle():
    from ebpf._proc import settled_snapshot

    class Starting(FakeProcessTable):
        """pid 300 forks as 'sh' and execs 'sleep' two samples later."""
        calls = 0

        def info(self, pid):
            i = super().info(pid)
            if pid == 300:
                self.calls += 1
                if self.calls <= 2:
                    return i.__class__(300, 50, 0, self.calls, True, "sh", ("sh",))
            return i

    procs = Starting()
    procs.start(CG, 300, ("sleep", "1000"), start=50)
    after = settled_snapshot(procs, CG, {}, max_wait=1.0, step=0.001)
    assert after[300].cmdline == ("sleep", "1000")
    # a process that never settles is given up on at the deadline
    class Busy(FakeProcessTable):
        def info(self, pid):
            i = super().info(pid)
            return i.__class__(i.pid, i.start, i.cpu, i.switches, True, i.comm, i.cmdline)
    busy = Busy()
    busy.start(CG, 5, ("yes",))
    snap = settled_snapshot(busy, CG, {}, max_wait=0.05, step=0.005)  # returns: it gave up
    assert 5 in snap


# --- crabd's own pause (issue 14 B) ------------------------------------------------


@pytest.fixture
def paused(env):
    """A sandbox with an older background process (pid 100) and a first turn
    done; returns (insp, loader, procs, tag) with the pause begun."""
    insp, loader, procs, tag = env
    procs.start(CG, 100, ("python3", "child.py"), start=10)
    insp.end_turn("sb")
    insp.end_turn("sb")  # 100 is now an older process
    insp.before_pause("sb")
    assert loader.pauses == {tag}
    return insp, loader, procs, tag


def test_work_right_after_the_thaw_is_the_next_turns(paused):
    """The kernel drops what CRIU's parasite does; what the sandbox does
    during and after the pause is recorded, and the process that did it is
    active (the kernel saw it do more than restart its sleep)."""
    insp, loader, procs, tag = paused
    loader.emit(ev(K.OPEN_WRITE, tag, path="/work/late.txt", arg=O_WRONLY | O_CREAT, ts=10**9))
    insp._drain()  # the poll thread, during the pause
    procs.run(100, 2)
    loader.woke(tag, 100)
    insp.after_pause("sb")
    e = insp.end_turn("sb")
    assert e.files["write"].sample == ["/work/late.txt"]
    assert [p.pid for p in e.active_processes] == [100]
    assert classify(e).kind is PlanKind.FS_PROC
    assert loader.ended == [tag], "disarmed once quiet"


def test_a_wake_up_that_only_restarts_its_call_is_absorbed(paused):
    insp, loader, procs, tag = paused
    procs.run(100, 3)  # the freeze woke it; the kernel saw nothing more
    insp.after_pause("sb")
    e = insp.end_turn("sb")
    assert e.active_processes == []
    assert classify(e).kind is PlanKind.SKIP


def test_a_process_that_woke_counts_even_without_a_traced_event(paused):
    """A write through an fd opened earlier is only counted in the kernel;
    its thread's calls in the pause still make it active."""
    insp, loader, procs, tag = paused
    procs.run(100, 3)
    loader.woke(tag, 100)
    insp.after_pause("sb")
    e = insp.end_turn("sb")
    assert [p.pid for p in e.active_processes] == [100]


def test_unwatch_in_a_pause_disarms_it(paused):
    insp, loader, procs, tag = paused
    insp.unwatch("sb")
    assert loader.ended == [tag] and not loader.pauses
