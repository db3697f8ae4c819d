"""Chaos: kill -9 crabd inside its critical phases (file-system commit, CRIU
dump, overlay compaction, rollback, fork) on both deltafs drivers, restart,
and check nothing was lost, corrupted or leaked: bench/chaos.py in quick
mode (10 kills, seeded), checked here counter by counter.

How the kills are aimed, what is checked and the counters: see the
docstring of bench/chaos.py. The longer run: `crabd bench chaos --json`
(50 kills).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "btrfs", "overlay")

ROOT = Path(__file__).resolve().parents[3]

MUST_BE_ZERO = ("lost_sandboxes", "lost_checkpoints", "corrupt_accepted", "unrestorable_checkpoints",
                "leaked_mounts", "leaked_cgroups", "leaked_standbys", "leaked_containers", "leaked_snapshots",
                "unusable_sandboxes")


def test_chaos_quick(busybox_image):
    p = subprocess.run([sys.executable, "-m", "bench.chaos", "--quick", "--json", "--seed", "7",
                        "--verify-cap", "4"],
                       capture_output=True, text=True, timeout=480, cwd=ROOT)
    log = p.stderr[-6000:]
    assert p.stdout.strip(), f"bench chaos printed no JSON (exit {p.returncode}):\n{log}"
    out = json.loads(p.stdout)
    assert out["kills"] >= 10, out
    bad = {k: out[k] for k in MUST_BE_ZERO if out[k]}
    assert not bad, f"chaos found {bad}:\n{log}"
    # every phase was aimed at on its driver, and checkpoints were really rolled back to
    want = {f"btrfs/{ph}" for ph in ("fs_commit", "criu_dump", "rollback", "fork")} | \
           {f"overlay/{ph}" for ph in ("fs_commit", "criu_dump", "compaction", "rollback", "fork")}
    assert want <= set(out["per_phase"]), out["per_phase"]
    assert out["verified_checkpoints"] >= 10, out
    assert p.returncode == 0, log
