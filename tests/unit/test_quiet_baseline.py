"""quiet_baseline: after crabd's own freeze/dump/thaw, the next turn is
compared with the quiet state, but real activity is never forgotten."""

from __future__ import annotations

from pathlib import Path

from ebpf._proc import quiet_baseline, snapshot
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
    new_base, ran = quiet_baseline(t, CG, base, pre, max_wait=0.05, step=0.001)
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
