"""The recovery benchmark's summary (bench/recovery_report.summarize): the
overhead of the fault-free runs from per-trace medians over --reps rounds,
one figure per round, where the time went, and bytes counted once per round."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.recovery_report import report_md, summarize
from bench.recovery_runs import RunRecord

ROOT = Path(__file__).resolve().parents[3]


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
    from bench.recovery_chain import ChainPoint, ChainRecord, report_lines
    from bench.recovery_chain import summarize as chain_summary

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


def test_bytes_against_the_fair_and_the_naive_full() -> None:
    """bytes_vs_full_pct is against `full` counted like crabd (its `bytes`);
    the naive raw figure (raw CRIU images + tar) has its own key."""
    recs = [_run("a", "reference", 0, 100),
            _run("a", "full", 0, 110, nbytes=4000), _run("a", "crabd", 0, 101, nbytes=1000)]
    recs[1].bytes_naive_raw = 40_000
    recs[1].bytes_by_plan = {"FS_PROC": 4000}
    recs[2].bytes_by_plan = {"FS": 200, "FS_PROC": 800, "SKIP": 0}
    out = summarize(recs, ["full", "crabd"], [], [_T("a")], _args())
    full, crabd = out["methods"]["full"], out["methods"]["crabd"]
    assert full["bytes_naive_raw"] == 40_000 and crabd["bytes_naive_raw"] is None
    assert crabd["bytes_vs_full_pct"] == 25.0 and crabd["bytes_vs_full_raw_pct"] == 2.5
    assert full["bytes_vs_full_pct"] == 100.0 and full["bytes_vs_full_raw_pct"] == 10.0
    assert crabd["bytes_by_plan"] == {"FS": 200, "FS_PROC": 800, "SKIP": 0}
    assert crabd["bytes_by_trace"] == {"a": 1000}
    assert set(out["full_baseline"]) == {"fair", "naive_raw"}
    md = report_md(out, ["--quick"])
    assert "% of fair full | % of naive full" in md
    assert "| crabd | – | 0.00 MB | 25.0 % | 2.5 % |" in md


def test_command_overhead_beside_end_to_end() -> None:
    # bare: 100 s per session, of which the commands 1 s; crabd: 101 s, commands 1.5 s over 2 turns
    recs = [_run("a", "reference", 0, 100, commands=1.0), _run("a", "crabd", 0, 101, commands=1.5)]
    c = summarize(recs, ["crabd"], [], [_T("a")], _args())["methods"]["crabd"]
    assert c["overhead_pct"] == 1.0                 # end to end
    assert c["command_overhead_pct"] == 50.0        # the commands' own time
    assert c["command_overhead_by_trace"] == {"a": 50.0}
    assert c["command_overhead_ms_per_turn"] == 250.0
    md = report_md({"methods": {"crabd": {**c, "correct_pct": None, "runs": 0, "correct_by_fault": {},
                                          "skip_fraction": None, "wrong": []}}}, [])
    assert "overhead end-to-end | overhead commands" in md and "+1.0 % | +50.0 %" in md


def test_the_inspector_used_is_recorded_and_a_fallback_said() -> None:
    recs = [_run("a", "reference", 0, 100), _run("a", "crabd", 0, 101)]
    recs[1].inspector = "bpf-cgroup"
    out = summarize(recs, ["crabd"], [], [_T("a")], _args())
    assert out["inspector"] == "bpf-cgroup" and out["inspector_requested"] == "bpf"
    assert out["inspector_fallback"] is False and out["methods"]["crabd"]["inspector"] == ["bpf-cgroup"]
    assert "Inspector (from the daemon's health): `bpf-cgroup`" in report_md(out, [])
    recs[1].inspector = "bpf-cgroup, then proc"    # a restarted daemon could not load BPF
    out = summarize(recs, ["crabd"], [], [_T("a")], _args())
    assert out["inspector"] == "bpf-cgroup, proc" and out["inspector_fallback"] is True
    assert "fell back to the /proc inspector" in report_md(out, [])


def test_daemon_fault_rollback_checks_are_summarized() -> None:
    ok = {"what": "recovery target", "checkpoint": "sb-9", "turn": 9, "pos": 8, "ok": True, "error": ""}
    bad = {"what": "recovery target", "checkpoint": "sb-10", "turn": 10, "pos": 8, "ok": False,
           "error": "the digest exec exited 127: sh: not found"}
    r1 = RunRecord("a", "crabd", "daemon", 8, correct=True, rollback_checks=[ok])
    r2 = RunRecord("b", "crabd", "daemon", 8, correct=False, rollback_checks=[ok, bad])
    out = summarize([r1, r2], ["crabd"], ["daemon"], [_T("a"), _T("b")], _args())
    c = out["methods"]["crabd"]
    assert c["rollback_checks"]["checks"] == 3 and c["rollback_checks"]["ok"] == 2
    assert c["rollback_checks"]["failed"] == ["b daemon@8: recovery target (sb-10, turn 10): "
                                              "the digest exec exited 127: sh: not found"]
    assert c["correct_by_fault"] == {"daemon": 50.0} and c["wrong"] == ["b daemon@8"]
    assert "2 of 3 right" in report_md(out, [])


def test_tar_bytes_is_the_size_tarfile_writes(tmp_path) -> None:
    """The naive figure's tar, computed from a diff's sizes, equals a tar
    written the way `full` used to write it (PAX, float mtimes), long names,
    symlinks, fifos and the deletions member included."""
    import io
    import os
    import random
    import tarfile

    from bench.recovery_runs import tar_bytes
    rng = random.Random(7)
    changes, out = [], tmp_path / "t.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        def add(path: str, typ: str, size: int = 0) -> None:
            ti = tarfile.TarInfo(path)
            ti.mtime = 1700000000.25
            ti.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                       "fifo": tarfile.FIFOTYPE}[typ]
            if typ == "file":
                ti.size = size
            if typ == "symlink":
                ti.linkname = "t" * size
            tar.addfile(ti, io.BytesIO(os.urandom(size)) if typ == "file" else None)
            changes.append({"kind": "added", "path": path, "type": typ, "size": size})
        add("work", "dir")
        for i in range(40):
            add(f"work/f{i}" + "x" * rng.randint(0, 140), "file", rng.randint(0, 9000))
        add("work/link", "symlink", 11)
        add("work/" + "é" * 60, "file", 3)
        add("work/fifo", "fifo")
        ti = tarfile.TarInfo(".crabd-deleted")
        body = b"etc/old\netc/x\n"
        ti.size = len(body)
        tar.addfile(ti, io.BytesIO(body))
    changes += [{"kind": "deleted", "path": "etc/old", "type": "file", "size": 1},
                {"kind": "deleted", "path": "etc/x", "type": "dir", "size": 0},
                {"kind": "added", "path": "run/sock", "type": "socket", "size": 0}]   # nothing to copy
    assert tar_bytes(changes) == out.stat().st_size


def test_one_percentile_for_every_benchmark() -> None:
    """bench/_stats.py: nearest rank, always a sample; every bench script uses it."""
    import re

    from bench._stats import median, percentile, quantiles
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(xs, p) for p in (0, 20, 21, 50, 99, 100)] == [1.0, 1.0, 2.0, 3.0, 5.0, 5.0]
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert percentile([], 50) is None and quantiles([0.12345]) == {"p50": 0.123, "p99": 0.123}
    assert quantiles(range(1, 201), (50, 90, 99), None) == {"p50": 100, "p90": 180, "p99": 198}
    # no other rank rule left in bench/: a percentile or median helper
    # elsewhere may only delegate (it sorts nothing itself)
    import ast
    for p in sorted((ROOT / "bench").glob("*.py")):
        if p.name == "_stats.py":
            continue
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, ast.FunctionDef) and re.search(r"pct|percentile|median|quantile|^_q$", fn.name):
                sorts = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and (
                    getattr(n.func, "id", None) == "sorted" or getattr(n.func, "attr", None) == "sort")]
                assert not sorts, f"{p.name}: {fn.name} ranks samples itself; use bench/_stats.py"
        assert "statistics.median(" not in p.read_text(), p.name
