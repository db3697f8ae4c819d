"""zdtm conformance (issue 15, point 1): a few of CRIU's own static tests,
run through `crabd bench zdtm` on a daemon of their own, in every variant
(native, dump with the sandbox left running, automatic recovery after a
host-side SIGKILL, rollback, fork). A test that passes natively must pass in
every variant.

On a fresh host the first run fetches CRIU 4.1.1's source with apt and
builds the zdtm library plus only these tests (static); later runs find
them in /var/cache/crabd-zdtm. The whole set: `crabd bench zdtm`
(bench/results/zdtm/).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "debian-py")

ROOT = Path(__file__).resolve().parents[3]

# Pipes, unix sockets, POSIX timers, pending signals, an eventfd: each
# passes every variant on main.
# The last four failed on main before issue 15's fixes (bench/results/zdtm:
# lo up after the restore, no --tcp-established, no --file-locks, no
# CAP_SYS_RESOURCE for CRIU's rlimit read); bench/results/zdtm/after-fixes
# has the whole list of the issue's failures passing now but these.
# socket-tcp-skip-in-flight failed every variant but native until crabd
# passed --skip-in-flight (a listening socket with a connection not yet
# accept()ed refused the whole dump).
# mlock_setuid gave no verdict even natively until the bench's run dir lost
# its sticky bit (the test renames its output file after a setuid).
# The stopped* tests (refused as a host limit until crabd froze such a
# sandbox through its v2 cgroup) are not added, to keep this run short: see
# tests/integration/crabd/runtime/test_stopped_task.py and
# bench/results/zdtm/2026-12-02-h15. Nor is unlink_fstat03: its process now
# comes back with its file (test_link_remap.py), but the test also wants the
# file's st_dev unchanged, and a rollback's root is a new mount.
SUBSET = ("pipe00", "sockets00", "posix_timers", "sigpending", "eventfs00",
          "socket_udp", "socket-tcp-local", "file_lease00", "pid00", "socket-tcp-skip-in-flight", "mlock_setuid")

# Still not restorable, by a property of these hosts (reported in the
# checkpoint's reasons and by `crabd doctor`, see README Reliability): none
# of issue 15's list now.
KNOWN_FAILING_ISSUE_15: dict[str, str] = {}


def test_subset_passes_every_variant(debian_image):
    assert not set(SUBSET) & set(KNOWN_FAILING_ISSUE_15)
    p = subprocess.run([sys.executable, "-m", "crabd.cli", "bench", "zdtm", "--tests", ",".join(SUBSET),
                        "--jobs", "2", "--json"], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["host_limited"] == [], s["host_limited"]
    assert s["tests"] == s["native_pass"] == len(SUBSET), p.stderr[-3000:]
    assert s["failures"] == [], json.dumps(s["failures"], indent=1)
    for v in ("dump_continue", "auto_recovery", "rollback", "fork"):
        assert s["variants"][v]["pass"] == len(SUBSET), (v, s["variants"])
    # Every recovery and rollback brought the processes back, not only files.
    restored = {(r["test"], r["variant"]): r["restored"] for r in s["results"] if r["variant"] != "native"}
    assert all(str(restored[(t, v)]).startswith("fs+proc") for t in SUBSET
               for v in ("auto_recovery", "rollback", "fork")), restored
