"""Load through the daemon (issue 8), tiny: 3 sandboxes x 10 turns with
think times, by `bench/load.py`. Every checkpoint of the run is committed
(or retired by retention), every committed row verifies, rollbacks to a
seeded sample give the content the run wrote, and the report carries the
latency and RSS figures (their values belong to the bench, not to a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

ROOT = Path(__file__).resolve().parents[3]


def test_load_tiny_run_is_consistent(busybox_image):
    try:
        r = subprocess.run([sys.executable, "-m", "bench.load", "--sandboxes", "3", "--turns", "10", "--think-ms", "50",
                            "--rollback-sample", "1", "--rss-interval", "0.5", "--json"],
                           capture_output=True, text=True, timeout=420, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"bench/load.py hung (420 s): {(e.stderr or b'')[-2000:]!r}") from None
    assert r.stdout.strip(), f"no report; stderr: {r.stderr[-3000:]}"
    rep = json.loads(r.stdout)
    assert rep["problems"] == [], "\n".join(rep["problems"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert rep["execs"] == 30, rep
    assert set(rep["checkpoints"]) <= {"committed", "retired"} and sum(rep["checkpoints"].values()) == 30, rep
    assert rep["verified"]["failed"] == 0 and rep["verified"]["ok"] >= 30, rep["verified"]
    assert rep["rollback_checks"] == {"checked": 3, "wrong": 0}, rep["rollback_checks"]
    for k in ("exec_ms", "exec_overhead_ms", "stall_ms"):
        assert rep[k]["n"] == 30 and rep[k]["p99"] is not None, (k, rep[k])
    assert rep["daemon_rss_mib"]["samples"], "no RSS samples"
