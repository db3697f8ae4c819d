"""Hostile sandboxes (issue 8): symlinks and links to host paths, odd names,
fifos, device nodes, a 1 TiB sparse file, many files, a fork bomb and a full
disk, through a real daemon. Runs `bench/hostile.py` at a small size and
checks its report: the host canary untouched (and the canary's self-check
proving it would have seen an access), content intact after checkpoint,
rollback and fork, limits reported as errors, the daemon answering."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

ROOT = Path(__file__).resolve().parents[3]


def test_hostile_sandbox_stays_inside(busybox_image):
    try:
        r = subprocess.run([sys.executable, "-m", "bench.hostile", "--quick", "--files", "3000", "--wide", "300", "--deep", "1100",
                            "--disk-mib", "512", "--json"],
                           capture_output=True, text=True, timeout=420, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"bench/hostile.py hung (420 s): {(e.stderr or b'')[-2000:]!r}") from None
    assert r.stdout.strip(), f"no report; stderr: {r.stderr[-3000:]}"
    rep = json.loads(r.stdout)
    assert rep["canary_self_check"] == {"read_detected": True, "touch_detected": True}, rep["canary_self_check"]
    assert rep["canary"]["events"] == 0 and not rep["canary"]["changed"], rep["canary"]
    assert rep["problems"] == [], "\n".join(rep["problems"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert rep["host_hardlink"].startswith("refused"), rep["host_hardlink"]
    assert rep["diff"]["changes"] >= 3000, rep["diff"]
    bomb = rep["fork_bomb"]
    assert bomb["pids_peak"] is not None and bomb["pids_peak"] <= bomb["pids_limit"], bomb
    assert bomb["pids_events"] and bomb["pids_events"] != "max 0", f"the fork bomb never hit the pids limit: {bomb}"
    assert bomb["after_rollback"] == "ok", bomb
    full = rep["disk_fill"]
    assert full["health_when_full"] is True and full["destroy_filler"] == "ok", full
    assert full["checkpoint_after_free"] == "committed", full
    assert rep["guard"]["calls"] > 0 and rep["guard"]["blocked"] == [], rep["guard"]
