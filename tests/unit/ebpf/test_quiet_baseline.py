"""quiet_baseline: after crabd's own freeze/dump/thaw, the next turn is
compared with the quiet state, but real activity is never forgotten."""

from __future__ import annotations

from pathlib import Path

from ebpf._events import RESTART_SYSCALL_NR
from ebpf._proc import RUNNING, quiet_baseline, restarted_only, snapshot
from ebpf.testing import FakeProcessTable

CG = Path("/cg")


def _table() -> FakeProcessTable:
    t = FakeProcessTable()
    t.start(CG, 10, ("server",), start=5)
    t.start(CG, 11, ("sleep",), start=6)
    return t


def test_the_pause_s_own_wakeups_are_absorbed():
    t = _table()
    base = snapshot(t, CG)
    pre = snapshot(t, CG)  # nothing ran between the turn end and the pause
    t.run(10, 3)  # the freezer and CRIU's parasite woke both
    t.run(11, 2)
    # the kernel saw each thread only restart its call after the thaw
    new_base, ran = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001, worked=lambda post: set())
    assert ran == set()
    assert new_base[10] == t.info(10) and new_base[11] == t.info(11)
    assert not t.info(10).ran_since(new_base[10])


def test_activity_before_the_pause_is_still_reported():
    t = _table()
    base = snapshot(t, CG)
    t.run(10)  # the server handled something after the turn ended
    pre = snapshot(t, CG)
    t.run(10)
    _, ran = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001)
    assert ran == {10}


def test_new_and_exited_processes_stay_visible():
    t = _table()
    base = snapshot(t, CG)
    t.start(CG, 12, ("worker",), start=9)  # forked by a background process
    t.stop(11)
    pre = snapshot(t, CG)
    new_base, _ = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001)
    assert 12 not in new_base, "a process new since the turn end must still look new"
    assert new_base[11] == base[11], "an exited process must still look exited"


def test_a_process_that_never_goes_quiet_counts_as_ran():
    class Busy(FakeProcessTable):
        def info(self, pid):  # every sample sees it scheduled again
            self.run(pid)
            return super().info(pid)

    t = Busy()
    t.start(CG, 10, ("spinner",), start=5)
    base = snapshot(t, CG)
    pre = dict(base)
    _, ran = quiet_baseline(t, CG, base, pre, max_wait=0.02, step=0.001)
    assert ran == {10}


def test_work_after_the_thaw_is_not_folded_into_the_baseline():
    """Issue 14 B: a child that wrote a file right after the thaw and went
    quiet within the settle time; the kernel counted its calls."""
    t = _table()
    base = snapshot(t, CG)
    pre = snapshot(t, CG)
    t.run(10, 3)
    t.run(11, 4)  # woke from its sleep, wrote, slept again
    new_base, ran = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001, worked=lambda post: {11})
    assert ran == {11}
    assert new_base[11] == base[11], "its work must still show against the baseline"
    assert new_base[10] == t.info(10)


def test_when_the_kernel_cannot_tell_every_process_that_moved_ran():
    t = _table()
    base = snapshot(t, CG)
    pre = snapshot(t, CG)
    t.run(10)
    for worked in (None, lambda post: None):
        _, ran = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001, worked=worked)
        assert ran == {10}, "11 did not run at all; 10 may have worked"


def test_from_proc_only_a_resumed_sleep_is_idle():
    t = _table()
    t.start(CG, 12, ("server",), start=7)
    t.blocked[12] = {12: 232, 13: RESTART_SYSCALL_NR}  # epoll_wait and a sleeping thread
    t.blocked[10] = {10: RESTART_SYSCALL_NR, 14: RESTART_SYSCALL_NR}
    t.blocked[11] = {11: RUNNING}
    pre = snapshot(t, CG)
    for p in (10, 11, 12):
        t.run(p)
    t.start(CG, 15, ("new",), start=20)
    t.blocked[15] = {15: 1}
    worked = restarted_only(t, pre)
    assert worked(snapshot(t, CG)) == {11, 12}, "10 only resumed its sleeps; 15 is new (reported as new)"
    t.procs[10] = pre[10]
    assert worked(snapshot(t, CG)) == {11, 12}
