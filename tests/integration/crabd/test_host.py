"""The host as crabd needs it: doctor reports every check ok after
scripts/setup-host, and re-running setup-host is fast and changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "btrfs", "overlay")

ROOT = Path(__file__).resolve().parents[3]


def test_doctor_reports_every_check_ok():
    r = subprocess.run([str(Path(sys.executable).parent / "crabd"), "doctor", "--json"],
                       capture_output=True, text=True, timeout=300)
    report = json.loads(r.stdout)
    bad = [c for c in report["checks"] if c["status"] != "ok"]
    assert not bad, "\n".join(f"{c['name']}: {c['status']}: {c['detail']} (fix: {c['fix']})" for c in bad)
    assert report["ok"] is True and r.returncode == 0
    names = {c["name"] for c in report["checks"]}
    assert {"root", "kernel", "overlayfs", "btrfs", "xfs-reflink", "cgroup-freezer", "criu", "runc", "bpf",
            "tracefs", "docker", "disk-space", "criu-stopped-tasks", "criu-rlimits", "restore-loopback"} <= names
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix"}


def test_setup_host_rerun_changes_nothing():
    # (How long a re-run takes is measured, not asserted: README.md, `time scripts/setup-host`.)
    r = subprocess.run([str(ROOT / "scripts" / "setup-host")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln.split(None, 1) for ln in r.stdout.splitlines() if ln.strip()]
    steps = {ln[0]: ln[1] for ln in lines}
    assert "done" in steps
    changed = {k: v for k, v in steps.items() if k != "done" and not v.startswith(("ok", "skipped"))}
    assert not changed, f"a re-run changed something: {changed}"
