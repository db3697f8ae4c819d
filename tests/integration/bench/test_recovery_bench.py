"""The recovery benchmark end to end, on a tiny busybox trace the test writes:
bench/recovery.py --quick runs each fault (boundary, mid-turn, daemon; one
trace, so it takes all three in rotation) for every method this crabd has,
and its JSON has the documented shape; crabd recovers correctly and
chat-only does not; the trace's external call reaches the outside world
once through crabd's effects ledger, and twice under replay. The daemon
fault's rollbacks after the restart (to the recovery target and to an older
checkpoint) are checked against the per-turn reference; bytes are against
the fair `full` and, under their own key, the naive raw one; the command
overhead is beside the end-to-end one; the inspector is the daemon's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

ROOT = Path(__file__).resolve().parents[3]


def _trace(name: str, extra: str) -> dict:
    # Every turn leaves state a fresh sandbox would not have; turn 3 runs
    # ~0.5 s (the mid-turn kill lands inside it) and is not idempotent.
    return {
        "name": name, "image": "busybox", "description": "tiny test trace",
        "files": {"/work/a.txt": "one\n"},
        "turns": [
            # an external call (a ticket opened): replay repeats it, crabd's ledger must not
            {"run": "echo two >> /work/a.txt", "llm_wait_ms": 200,
             "external": {"op": "tickets.create", "args": {"title": f"{name}: two"}}},
            {"run": f"mkdir -p /work/d && echo {extra} > /work/d/x", "llm_wait_ms": 200},
            {"run": "for i in 1 2 3 4 5; do echo $i >> /work/log; sleep 0.1; done", "llm_wait_ms": 200},
            {"run": "ls /work", "llm_wait_ms": 200},
            {"run": "mv /work/d /work/e && ln -s e/x /work/link && chmod 600 /work/e/x", "llm_wait_ms": 200},
        ],
        "check": [{"run": "cat /work/a.txt; wc -l < /work/log", "expect_exit": 0, "expect_stdout": "one\ntwo\n5\n"}],
        "state_paths": ["/work"],
    }


def write_traces(d: Path, names: tuple[str, ...] = ("bb-a",)) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name in names:
        (d / f"{name}.json").write_text(json.dumps(_trace(name, name)))


def _methods() -> str:
    # `full` is in: the fair baseline's bytes and the naive figure computed
    # after the run (diff against the image, the image store's manifests)
    # are what bytes_vs_full_pct / bytes_vs_full_raw_pct stand on.
    crabd = str(Path(sys.executable).parent / "crabd")
    helptext = subprocess.run([crabd, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    if "--capture" in helptext:
        return "chat-only,replay,full,crabd-fs,crabd"
    return "chat-only,replay,crabd"


def test_recovery_bench_quick_on_busybox(tmp_path, busybox_image):
    traces = tmp_path / "traces"
    write_traces(traces)
    methods = _methods()
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "bench.recovery", "--quick", "--traces", str(traces),
                        "--methods", methods, "--faults", "boundary,mid-turn,daemon", "--time-scale", "0.05",
                        "--inspector", "proc", "--json", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout)
    assert set(res["methods"]) == set(methods.split(","))
    # the inspector the daemons really used (their health), and no fallback from what was asked
    assert res["inspector"] == "proc" and res["inspector_requested"] == "proc" and not res["inspector_fallback"]
    for m, r in res["methods"].items():
        for key in ("correct_pct", "bytes", "bytes_vs_full_pct", "bytes_vs_full_raw_pct", "overhead_pct",
                    "skip_fraction", "rollback_checks", "inspector"):
            assert key in r, (m, key)
        for key in ("ckpt_ms", "stall_ms", "rollback_ms"):
            assert set(r[key]) >= {"p50", "p99"}, (m, key)
        assert r["runs"] == 3, (m, r)
        assert set(r["correct_by_fault"]) == {"boundary", "mid-turn", "daemon"}
    crabd = res["methods"]["crabd"]
    assert crabd["correct_pct"] == 100.0, (crabd["wrong"], p.stderr[-3000:])
    assert crabd["fault_free_correct"] is True
    assert crabd["bytes"] > 0 and crabd["ckpt_ms"]["p50"] is not None
    assert crabd["command_overhead_pct"] is not None and crabd["overhead_pct"] is not None
    assert crabd["inspector"] == ["proc"]
    # the daemon fault: live state, rollback to the recovery target, rollback
    # to an older checkpoint, each against the reference after that turn
    daemon_run = next(r for r in res["runs"] if r["method"] == "crabd" and r["fault"] == "daemon")
    assert [c["what"] for c in daemon_run["rollback_checks"]] == [
        "live after the restart", "recovery target", "older checkpoint"], daemon_run
    assert crabd["rollback_checks"]["failed"] == [], crabd["rollback_checks"]
    if "full" in res["methods"]:
        full = res["methods"]["full"]
        # fair: through the same store as crabd; naive: raw images + tar, far more
        assert full["bytes_vs_full_pct"] == 100.0 and full["bytes_naive_raw"] > full["bytes"] > 0, full
        assert crabd["bytes_vs_full_raw_pct"] < crabd["bytes_vs_full_pct"], crabd
    assert crabd["rollback_ms"]["p50"] is not None and crabd["skip_fraction"] is not None
    assert res["methods"]["chat-only"]["correct_pct"] == 0.0, res["methods"]["chat-only"]["wrong"]
    assert res["methods"]["replay"]["correct_pct"] == 100.0, res["methods"]["replay"]["wrong"]
    # the external call of turn 1: through crabd's effects ledger never twice; replay repeats it
    assert crabd["external_calls"] > 0 and crabd["duplicate_effect_pct"] == 0.0, crabd
    assert res["methods"]["replay"]["duplicate_effect_pct"] > 0, res["methods"]["replay"]
    if "crabd-fs" in res["methods"]:  # these traces keep no state in processes
        assert res["methods"]["crabd-fs"]["correct_pct"] == 100.0, res["methods"]["crabd-fs"]["wrong"]
    faults = {(r["method"], r["fault"]) for r in res["runs"] if r["fault"]}
    assert {("crabd", f) for f in ("boundary", "mid-turn", "daemon")} <= faults
    assert {"results.json", "report.md", "correct.png", "bytes.png", "latency.png"} <= {x.name for x in out.iterdir()}


def test_recovery_bench_chain_hits_every_fault_point(tmp_path, busybox_image):
    """--chain: one run per fault kind with the fault at every turn of the
    trace; crabd's state is right after every recovery and at the end."""
    traces = tmp_path / "traces"
    write_traces(traces)
    p = subprocess.run([sys.executable, "-m", "bench.recovery", "--chain", "--traces", str(traces),
                        "--methods", "crabd", "--time-scale", "0.05", "--inspector", "proc", "--json"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout)
    chain = res["chain"]["crabd"]
    assert set(chain) == {"boundary", "mid-turn", "daemon"}
    n = len(_trace("bb-a", "bb-a")["turns"])
    for fault, m in chain.items():
        planned = n if fault == "mid-turn" else n - 1
        assert m["points"] == m["points_planned"] == planned, (fault, m)
        assert m["state_ok"] == planned and m["end_correct"] == m["runs"] == 1, (fault, m)
        assert not m["errors"], m["errors"]
    # every point is in the per-run records, with the turn the agent went on from
    runs = {r["fault"]: r for r in res["chain_runs"]}
    assert [pt["k"] for pt in runs["boundary"]["points"]] == list(range(1, n))
    assert all(pt["resumed_at"] >= pt["k"] - 1 for f, r in runs.items() if f != "daemon" for pt in r["points"])
    # daemon: after the restart the agent goes on from the older checkpoint it rolled back to
    assert all(0 <= pt["resumed_at"] < pt["k"] for pt in runs["daemon"]["points"])
