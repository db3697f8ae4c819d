"""The recovery benchmark's summary (bench/recovery_report.summarize): the
overhead of the fault-free runs from per-trace medians over --reps rounds,
one figure per round, where the time went, and bytes counted once per round."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))

from recovery import RunRecord  # noqa: E402
from recovery_report import report_md, summarize  # noqa: E402


def _args() -> argparse.Namespace:
    return argparse.Namespace(quick=False, time_scale=1.0, inspector="bpf")


def _run(trace: str, method: str, rep: int, seconds: float, commands: float = 1.0, stall_ms: float = 0.0,
         nbytes: int = 0) -> RunRecord:
    return RunRecord(trace, method, seconds=seconds, durations=[commands / 2, commands / 2],
                     stall_ms=[stall_ms, 0.0], rep=rep, bytes=nbytes, plans=["FS", "SKIP"], correct=True)


class _T:
    def __init__(self, name: str) -> None:
        self.name = name


def test_overhead_is_taken_from_per_trace_medians_and_reported_per_round() -> None:
    recs = [
        # trace a: bare 100, 100, 130 (a load spike in round 2) -> median 100
        _run("a", "reference", 0, 100), _run("a", "reference", 1, 100), _run("a", "reference", 2, 130),
        # crabd on a: 101, 102, 101 -> median 101
        _run("a", "crabd", 0, 101, commands=2, stall_ms=300, nbytes=1000),
        _run("a", "crabd", 1, 102, commands=3, stall_ms=500, nbytes=1000),
        _run("a", "crabd", 2, 101, commands=2, stall_ms=100, nbytes=1000),
        # trace b: bare 50 each round; crabd 50, 51, 52 -> median 51
        _run("b", "reference", 0, 50), _run("b", "reference", 1, 50), _run("b", "reference", 2, 50),
        _run("b", "crabd", 0, 50), _run("b", "crabd", 1, 51), _run("b", "crabd", 2, 52),
    ]
    out = summarize(recs, ["crabd"], [], [_T("a"), _T("b")], _args())
    c = out["methods"]["crabd"]
    assert out["reps"] == 3
    # (101 + 51 - 100 - 50) / 150
    assert c["overhead_pct"] == round(2 / 150 * 100, 2)
    assert c["overhead_by_trace"] == {"a": 1.0, "b": 2.0}
    # round 0: 151/150, round 1: 153/150, round 2: 153/180 (the spike shows as noise, not hidden)
    assert c["overhead_reps"] == [round(1 / 150 * 100, 2), round(3 / 150 * 100, 2), round(-27 / 180 * 100, 2)]
    assert c["turns_s"] == {"bare": 150.0, "method": 152.0}
    assert c["command_s"] == {"bare": 2.0, "method": 3.0}   # medians: a 2 vs 1, b 1 vs 1
    assert c["stall_s"] == 0.3
    assert c["bytes"] == 1000        # one round's bytes, not three rounds'
    md = report_md(out, ["--reps", "3"])
    assert "median of 3 round(s)" in md and "a +1.0 %" in md


def test_one_round_is_the_plain_ratio() -> None:
    recs = [_run("a", "reference", 0, 80), _run("a", "crabd", 0, 100, nbytes=7)]
    c = summarize(recs, ["crabd"], [], [_T("a")], _args())["methods"]["crabd"]
    assert c["overhead_pct"] == 25.0 and c["overhead_reps"] == [25.0] and c["bytes"] == 7


def test_chain_summary_counts_points_and_names_the_wrong_ones() -> None:
    from recovery_chain import ChainPoint, ChainRecord, report_lines
    from recovery_chain import summarize as chain_summary

    t = argparse.Namespace(name="a", turns=[None] * 4)
    good = ChainRecord("a", "crabd", "boundary", [ChainPoint(k, k, True, 100.0) for k in (1, 2, 3)], True, 5.0)
    bad = ChainRecord("a", "crabd-fs", "mid-turn",
                      [ChainPoint(1, 0, True, 90.0), ChainPoint(2, 1, False, 80.0), ChainPoint(3, 2, True, 70.0)],
                      False, 4.0)
    out = chain_summary([good, bad], [t])
    assert out["crabd"]["boundary"]["points"] == out["crabd"]["boundary"]["points_planned"] == 3
    assert out["crabd"]["boundary"]["state_ok_pct"] == 100.0 and out["crabd"]["boundary"]["wrong"] == []
    fs = out["crabd-fs"]["mid-turn"]
    assert fs["points_planned"] == 4 and fs["points"] == 3 and fs["state_ok"] == 2 and fs["end_correct"] == 0
    assert fs["wrong"] == ["a@2", "a: end state"]
    assert fs["rollback_ms"] == {"p50": 80.0, "p99": 90.0}
    md = "\n".join(report_lines({"chain": out}))
    assert "| crabd-fs | mid-turn | 3 (4) | 2 (66.7 %) | 0 of 1 |" in md
