"""The oracle benchmark's schedule (bench/oracle.py): a session's checkpoints
are compared beside the next session's turns, one session at a time; a crabd
kill waits for that comparison first (a restart would fail its forks);
`--serial` compares each session before the next starts. No daemon: the
sessions and comparisons are stand-ins that log when they run."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import bench.oracle as B


class _Fake:
    """Stands in for `Oracle`: plays a session (logs its start and end), compares it in ~50 ms."""

    log: list[tuple[str, str]] = []

    def __init__(self, a: Any) -> None:
        self.a, self.pending, self.inspector, self.plant_done = a, None, "fake", False
        self.running = 0
        self.lock = threading.Lock()
        self.max_running = 0

    def start(self) -> None: ...

    def close(self) -> None: ...

    def play_session(self, turns: list[B.Turn], out: B.Outcome, label: str) -> B.Session:
        self.log.append(("play", label))
        time.sleep(0.08)
        out.turns += len(turns)
        self.log.append(("played", label))
        return B.Session("sb-" + label, turns, out, label)

    def finish_session(self, sess: B.Session) -> list[dict[str, Any]]:
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self.log.append(("compare", sess.label))
        time.sleep(0.05)
        self.log.append(("compared", sess.label))
        with self.lock:
            self.running -= 1
        return []


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[_Fake]:
    _Fake.log = []
    made: list[_Fake] = []
    monkeypatch.setattr(B, "Oracle", lambda a: made.append(_Fake(a)) or made[-1])
    _Fake.made = made  # type: ignore[attr-defined]
    return _Fake


def test_compared_beside_the_next_session(fake: type[_Fake], tmp_path: Path) -> None:
    B.main(["--turns", "12", "--session", "4", "--no-faults", "--json", "--out", str(tmp_path / "r.json")])
    log = fake.log
    # s1 is compared while s2 plays: its comparison starts before s2's turns end
    assert log.index(("compare", "s1")) < log.index(("played", "s2")), log
    # every session compared, the last after the loop
    assert {lb for k, lb in log if k == "compared"} == {"s1", "s2", "s3"}
    # one comparison at a time, and a session's comparison never starts before it is played
    assert fake.made[0].max_running == 1  # type: ignore[attr-defined]
    for s in ("s1", "s2", "s3"):
        assert log.index(("played", s)) < log.index(("compare", s))


def test_serial_compares_before_the_next_session(fake: type[_Fake]) -> None:
    B.main(["--turns", "12", "--session", "4", "--no-faults", "--serial", "--json"])
    log = fake.log
    assert log.index(("compared", "s1")) < log.index(("play", "s2")), log
    assert log.index(("compared", "s2")) < log.index(("play", "s3")), log


class _Client:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def create_sandbox(self, image: str) -> dict[str, Any]:
        return {"id": "sb"}

    def exec(self, sid: str, argv: Any, **kw: Any) -> dict[str, Any]:
        self.events.append("exec")
        return {"checkpoint": f"ck{len(self.events)}"}

    def delete_sandbox(self, sid: str) -> None: ...


def test_crabd_kill_waits_for_the_comparison_beside(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison beside ends before the turn that is followed by a crabd kill runs."""
    o = B.Oracle.__new__(B.Oracle)
    events: list[str] = []
    o.a, o.cache, o._client, o.exec_ns, o.ck_info = B.parser().parse_args([]), object(), _Client(events), {}, {}
    monkeypatch.setattr(o, "restart", lambda: events.append("restart"))
    monkeypatch.setattr(o, "_wait_captured", lambda sid: [])
    from concurrent.futures import ThreadPoolExecutor

    def compare() -> list[Any]:
        time.sleep(0.3)
        events.append("compared")
        return []

    with ThreadPoolExecutor(1) as pool:
        o.pending = pool.submit(compare)
        turns = [B.Turn([], [], 0, shell="true"), B.Turn([], [], 0, shell="true", fault="daemon-kill")]
        o.play_session(turns, B.Outcome(), "s2")
    # setup exec, turn 0, then the wait, then the turn that the kill follows
    assert events == ["exec", "exec", "compared", "exec", "restart"], events
