"""The differential oracle end to end (bench/oracle.py on `crabd serve
--oracle`): a short seeded run on debian-py whose JSON has the documented
shape; a planted difference (one checkpoint compared with its parent's
ground truth) is reported, so this test can fail; and sessions with none of
the shapes of issue 14's open bugs A, B and C (--avoid-known: no crabd kills,
no worker timers, no tmpfs through relative paths or symlinks) have no false
negative."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"turns", "false_negatives", "false_positives", "effect_kinds", "faults", "differences"}


def test_oracle_short_seeded_run(debian_image):
    p = subprocess.run([sys.executable, "-m", "bench.oracle", "--turns", "16", "--session", "8",
                        "--seed", "5", "--avoid-known", "--plant", "--shrink-s", "0", "--json"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout)
    assert KEYS <= set(res), set(res)
    assert res["turns"] == 16
    assert res["compared"] >= 16  # every turn's checkpoint (+ the setup turn's, + rollbacks)
    assert res["planted"]["done"] and res["planted"]["detected"], res["planted"]
    assert any(k.startswith("fs:") for k in res["effect_kinds"])
    assert res["false_negatives"] == 0, json.dumps(res["differences"], indent=1)[:6000]
