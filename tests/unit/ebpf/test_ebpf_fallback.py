"""The /proc fallback builds the same Effects record from snapshots and the change probe."""

from ebpf import PlanKind, ProcInspector, classify
from ebpf.testing import FakeClock, FakeProcessTable

CG = "/sys/fs/cgroup/unified/sb"


def make(changes):
    procs = FakeProcessTable()
    procs.start(CG, 1, ("crabd-init",))
    insp = ProcInspector(lambda sid: changes.pop(0) if changes else [], processes=procs, clock=FakeClock())
    insp.watch("sb", CG)
    return insp, procs


def test_no_change_is_skip_but_external_unknown():
    insp, procs = make([[], []])
    e = insp.end_turn("sb")
    assert e.source == "proc" and e.external_unknown and e.notes
    assert classify(e).kind is PlanKind.SKIP


def test_probe_paths_make_fs():
    insp, procs = make([[], ["/app/a", "/app/b"]])
    e = insp.end_turn("sb")
    assert e.files["changed"].sample == ["/app/a", "/app/b"]
    assert classify(e).kind is PlanKind.FS


def test_probe_unknown_assumes_changed():
    procs = FakeProcessTable()
    insp = ProcInspector(lambda sid: None, processes=procs, clock=FakeClock())
    insp.watch("sb", CG)
    assert classify(insp.end_turn("sb")).kind is PlanKind.FS


def test_processes_and_listening_sockets():
    insp, procs = make([[], []])
    procs.start(CG, 50, ("python3", "-m", "http.server"), start=9)
    procs.sockets[50] = ["0.0.0.0:8000"]
    procs.start(CG, 51, ("curl", "http://x"), start=9)
    e = insp.end_turn("sb")
    assert {p.pid for p in e.new_processes} == {50, 51}
    assert [(s.pid, s.address, s.alive) for s in e.listening] == [(50, "0.0.0.0:8000", True)]
    assert e.external and "curl" in e.external_reasons[0]
    assert classify(e).kind is PlanKind.FS_PROC


def test_package_manager_alive_at_end():
    insp, procs = make([[], []])
    procs.start(CG, 60, ("/usr/bin/python3", "-m", "pip", "install", "x"), start=9)
    assert insp.end_turn("sb").package_managers == ["pip"]
