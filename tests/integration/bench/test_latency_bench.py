"""The latency benchmark (bench/latency.py, issue 16 item 6) end to end with
tiny counts: one round, one exec per peer, one daemon restart, the /proc
inspector (no BPF compile at the restart). Its JSON has the documented shape:
every figure is {"p50", "p99", "n"} with n samples taken, and p50 <= p99.
Only the shape is checked: timings are the benchmark's business."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "docker")

ROOT = Path(__file__).resolve().parents[3]

SHAPE = {
    "kill_to_running_ms": ("fs", "proc"),
    "kill_to_rolled_back_ms": ("fs", "proc"),
    "rollback_ms": ("latest_fs", "latest_proc", "older_fs", "older_proc"),
    "fork_ms": ("1", "8", "1_proc", "8_proc"),
    "exec_true_ms": ("crabd", "docker"),
    "restart_ms": ("serving", "adopted"),
}


def test_latency_bench_json_shape(busybox_image):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "bench.latency", "--rounds", "1", "--execs", "1", "--restarts", "1",
                        "--inspector", "proc", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    for group, keys in SHAPE.items():
        assert set(keys) <= set(res[group]), (group, res[group])
        for k in keys:
            p = res[group][k]
            assert set(p) == {"p50", "p99", "n"}, (group, k, p)
            assert p["n"] >= 1, (group, k, p)
            assert isinstance(p["p50"], (int, float)) and 0 <= p["p50"] <= p["p99"], (group, k, p)
    assert res["config"]["inspector"] == "proc"
    assert res["config"]["docker"] is True
