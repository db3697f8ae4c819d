"""ebpf.LoadingInspector: no turn is planned from a partial record while the
real inspector loads (a fake inner inspector: this is the stand-in's logic)."""

from __future__ import annotations

import threading

from ebpf import LoadingInspector, PlanKind, classify
from ebpf.effects import Effects


class FakeInner:
    source = "bpf-cgroup"

    def __init__(self, fail_watch: set[str] = frozenset()):
        self.calls: list[tuple] = []
        self.fail_watch = fail_watch

    def watch(self, sid, cgroup_path, **kw):
        if sid in self.fail_watch:
            raise RuntimeError("cgroup gone")
        self.calls.append(("watch", sid, cgroup_path))

    def unwatch(self, sid):
        self.calls.append(("unwatch", sid))

    def begin_turn(self, sid):
        self.calls.append(("begin", sid))

    def before_pause(self, sid):
        self.calls.append(("before_pause", sid))

    def after_pause(self, sid):
        self.calls.append(("after_pause", sid))

    def end_turn(self, sid):
        self.calls.append(("end", sid))
        return Effects(sandbox_id=sid, turn=1, source="bpf-cgroup")

    def close(self):
        self.calls.append(("close",))


def _gated(inner):
    gate = threading.Event()

    def load():
        gate.wait(10)
        return inner
    return gate, LoadingInspector(load)


def test_turns_before_the_load_are_blind_and_the_first_after_it_too():
    inner = FakeInner()
    gate, li = _gated(inner)
    assert li.source == "loading"
    li.watch("a", "/sys/fs/cgroup/a")
    li.begin_turn("a")
    e1 = li.end_turn("a")
    assert e1.source == "loading" and classify(e1).kind is PlanKind.FS_PROC
    assert "inspector's loading" in classify(e1).reasons[0]
    gate.set()
    assert li.wait(5) and li.source == "bpf-cgroup"
    assert inner.calls[0] == ("watch", "a", "/sys/fs/cgroup/a")   # replayed
    li.begin_turn("a")
    e2 = li.end_turn("a")                                          # began mid-turn: blind
    assert classify(e2).kind is PlanKind.FS_PROC
    e3 = li.end_turn("a")                                          # a whole turn observed
    assert classify(e3).kind is PlanKind.SKIP
    li.close()
    assert inner.calls[-1] == ("close",)


def test_a_watch_after_the_load_is_passed_on_and_not_blind():
    inner = FakeInner()
    gate, li = _gated(inner)
    gate.set()
    li.wait(5)
    li.watch("b", "/cg/b")
    assert classify(li.end_turn("b")).kind is PlanKind.SKIP


def test_a_replayed_watch_that_fails_keeps_the_sandbox_blind_with_the_reason():
    inner = FakeInner(fail_watch={"c"})
    gate, li = _gated(inner)
    li.watch("c", "/cg/c")
    gate.set()
    li.wait(5)
    li.begin_turn("c")  # not passed on: inner never watched it
    assert ("begin", "c") not in inner.calls
    p = classify(li.end_turn("c"))
    assert p.kind is PlanKind.FS_PROC and "failed watch" in p.reasons[0]


def test_a_failed_load_falls_back():
    fb = FakeInner()

    def load():
        raise RuntimeError("no BPF here")
    li = LoadingInspector(load, fallback=lambda: fb)
    assert li.wait(5) and li.load_error == "no BPF here" and li.inner is fb
