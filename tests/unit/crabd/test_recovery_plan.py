"""crabd.recovery: which automatic recovery comes next for a sandbox that
keeps dying -- bounded, with fallbacks, never an endless loop."""

from __future__ import annotations

from crabd.recovery import Attempt, Option, RecoveryPlan


def run(plan: RecoveryPlan, target: str = "t", older: str | None = "o", now: float = 100.0,
        target_has_processes: bool = True) -> list[Option]:
    """Every option the plan hands out while each attempt dies at once."""
    tried: list[Attempt] = []
    out: list[Option] = []
    while (opt := plan.next(tried, target=target, older=older, now=now,
                            target_has_processes=target_has_processes)) is not None:
        out.append(opt)
        tried.append(Attempt(now, opt.checkpoint, opt.processes))
        assert len(out) < 100, "the plan never ends"
    return out


def test_the_target_then_an_older_checkpoint_then_a_fresh_init_then_nothing():
    got = run(RecoveryPlan(tries=2))
    assert got == [Option("t", True, False)] * 2 + [Option("o", True, True)] * 2 + [Option("t", False, True)] * 2


def test_without_an_older_checkpoint_the_fresh_init_comes_next():
    assert run(RecoveryPlan(tries=1), older=None) == [Option("t", True, False), Option("t", False, True)]


def test_a_target_without_processes_is_tried_once_as_what_it_is():
    assert run(RecoveryPlan(tries=1), older=None, target_has_processes=False) == [Option("t", False, False)]


def test_attempts_older_than_the_window_are_forgotten():
    plan = RecoveryPlan(tries=1, window_s=60)
    old = [Attempt(0.0, "t", True), Attempt(1.0, "o", True), Attempt(2.0, "t", False)]
    assert plan.next(old, target="t", older="o", now=30.0) is None
    assert plan.next(old, target="t", older="o", now=70.0) == Option("t", True, False)
    assert plan.recent(old, 61.5) == [Attempt(2.0, "t", False)]


def test_an_older_checkpoint_equal_to_the_target_is_not_a_second_option():
    assert run(RecoveryPlan(tries=1), older="t") == [Option("t", True, False), Option("t", False, True)]
