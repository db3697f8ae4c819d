"""Checkpoints through an OCI registry: what a per-turn push costs against a
full push, and a restore on a second daemon (issue 18).

    crabd bench remote [--quick] [--json] [--turns N] [--image NAME]

One daemon runs a sandbox for N small turns (a file written, a log line
appended: a typical edit); after each, its checkpoint is pushed to one
repository of a local docker-registry (incremental: blobs there are skipped)
and to a fresh repository (a full push: every blob sent). A second daemon
then creates a sandbox from the last push. `incremental_pct` is the p50 of
the per-turn incremental bytes as a percentage of the p50 full-push bytes.

Migration (`migration_downtime_ms`, `migrated_correct`) is not implemented
yet: those keys are null / false, and `migration` says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import percentile
from crabd.remote.testing import LocalRegistry
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, settled_checkpoint

TEST_STATE = Path("/var/lib/crabd-test")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="crabd bench remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="busybox and 5 turns")
    ap.add_argument("--turns", type=int, default=20, help="turns after the first checkpoint")
    ap.add_argument("--image", default="debian-py", help="image of the sandbox (from the test image cache)")
    ap.add_argument("--json", action="store_true")
    return ap


def _daemon(image: str) -> DaemonHandle:
    state = Path(tempfile.mkdtemp(prefix="crabd-bench-remote-", dir="/var/tmp"))
    Runtime(state).images.import_path(Runtime(TEST_STATE).images.get(image).path, image)
    d = DaemonHandle(state)
    d.start()
    return d


def run(image: str, turns: int) -> dict[str, Any]:
    reg_dir = Path(tempfile.mkdtemp(prefix="crabd-bench-registry-"))
    reg = LocalRegistry(reg_dir).start()
    a = b = None
    try:
        a, b = _daemon(image), _daemon(image)
        ca, cb = a.client(), b.client()
        sid = ca.create_sandbox(image)["id"]
        first = ca.exec(sid, "mkdir -p /work && echo start > /work/log")
        settled_checkpoint(ca, first["checkpoint"])
        t = time.monotonic()
        p0 = ca.push_checkpoint(first["checkpoint"], f"{reg.host}/bench/sb:0")
        push_first_ms = (time.monotonic() - t) * 1000
        inc, full, inc_ms = [], [], []
        last = first["checkpoint"]
        for i in range(1, turns + 1):
            r = ca.exec(sid, f"echo turn {i} >> /work/log; head -c 4096 /dev/urandom > /work/f{i}")
            settled_checkpoint(ca, r["checkpoint"])
            t = time.monotonic()
            p = ca.push_checkpoint(r["checkpoint"], f"{reg.host}/bench/sb:{i}")
            inc_ms.append((time.monotonic() - t) * 1000)
            inc.append(p["bytes_pushed"])
            f = ca.push_checkpoint(r["checkpoint"], f"{reg.host}/bench/full{i}:1")
            full.append(f["bytes_pushed"])
            last = r["checkpoint"]
        t = time.monotonic()
        got = cb.pull_sandbox(f"{reg.host}/bench/sb:{turns}")
        restore_ms = (time.monotonic() - t) * 1000
        log = cb.exec(got["sandbox"], "cat /work/log")["stdout"]
        inc_p50, full_p50 = percentile(inc, 50), percentile(full, 50)
        return {
            "image": image, "turns": turns, "last_checkpoint": last,
            "push_first_bytes": p0["bytes_pushed"], "push_first_ms": round(push_first_ms, 1),
            "push_turn_bytes": {"p50": inc_p50, "max": max(inc)},
            "push_turn_ms": {"p50": percentile(inc_ms, 50, 1)},
            "full_push_bytes": {"p50": full_p50},
            "incremental_pct": round(100.0 * (inc_p50 or 0) / (full_p50 or 1), 3),
            "restore_other_daemon_ms": round(restore_ms, 1), "restored": got["restored"],
            "restored_correct": log.count("turn") == turns,
            "migration_downtime_ms": {"p50": None, "p99": None, "n": 0},
            "migrated_correct": False,
            "migration": "not implemented (crabd sandbox migrate is open)",
        }
    finally:
        for d in (a, b):
            if d is not None:
                d.shutdown()
                cleanup_state_dir(d.state)
        reg.stop()
        shutil.rmtree(reg_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    image, turns = ("busybox", 5) if a.quick else (a.image, a.turns)
    out = run(image, turns)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
