"""Checkpoints through an OCI registry: what a per-turn push costs against a
full push, a restore on a second daemon, and live migration (issue 18).

    crabd bench remote [--quick] [--json] [--turns N] [--image NAME] [--migrations N]

One daemon runs a sandbox for N small turns (a file written, a log line
appended: a typical edit); after each, its checkpoint is pushed to one
repository of a local docker-registry (incremental: blobs there are skipped)
and to a fresh repository (a full push: every blob sent). A second daemon
then creates a sandbox from the last push. `incremental_pct` is the p50 of
the per-turn incremental bytes as a percentage of the p50 full-push bytes.

Migration: the `dev-server` trace (debian-py, a Python server whose counter
lives only in memory) runs on daemon A; the sandbox is then migrated A -> B
-> A ... (`crabd sandbox migrate`), with a turn that asks the server between
migrations. `migration_downtime_ms` is the migrations' downtime (frozen on
the source until running on the target), `migration_phases_ms` where it goes
(p50 per phase: freeze, capture, push, pull, and stop_source after the
downtime; then each phase's own steps, `capture.*` from the checkpoint's
durations, `push.*` and `pull.*` from the transfer's timing_ms);
`migrated_correct`: every migration restored files and
processes, the source kept nothing, the server answered its counter after
each one, and at the end the trace's checks pass and its state digest is the
one before the first migration.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import inputs
from bench._stats import percentile
from crabd.remote.testing import LocalRegistry
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, settled_checkpoint, settled_checkpoints
from crabd.traces import STATE_DIGEST, load_trace

TEST_STATE = Path("/var/lib/crabd-test")
TRACE = Path(__file__).resolve().parent / "traces" / "dev-server.json"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="crabd bench remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="busybox and 5 turns")
    ap.add_argument("--turns", type=int, default=20, help="turns after the first checkpoint")
    ap.add_argument("--image", default="debian-py", help="image of the sandbox (from the test image cache)")
    ap.add_argument("--migrations", type=int, default=10, help="migrations of the dev-server sandbox (--quick: 3)")
    ap.add_argument("--json", action="store_true")
    return ap


def _daemon(*images: str) -> DaemonHandle:
    state = Path(tempfile.mkdtemp(prefix="crabd-bench-remote-", dir="/var/tmp"))
    for image in dict.fromkeys(images):
        Runtime(state).images.import_path(Runtime(TEST_STATE).images.get(image).path, image)
    d = DaemonHandle(state)
    d.start()
    return d


def _migrations(a: DaemonHandle, b: DaemonHandle, host: str, n: int) -> dict[str, Any]:
    """The dev-server trace on A, then `n` migrations back and forth."""
    t = load_trace(TRACE)
    hosts = [a, b]
    c = a.client()
    sid = c.create_sandbox(t.image)["id"]

    def sh(cmd: list[str] | str, stdin: str | None = None) -> dict[str, Any]:
        return c.exec(sid, cmd, timeout=600, stdin=stdin)

    inputs.prelude(t, sh)
    for turn in t.turns:
        c.exec(sid, turn.run, timeout=600)
    counter = c.exec(sid, "python3 /work/srv/get.py /")["stdout"]
    settled_checkpoints(c, sid)
    want = c.exec(sid, ["python3", "-c", STATE_DIGEST, *t.state_paths])["stdout"]
    downtime: list[float] = []
    phases: dict[str, list[float]] = {}
    problems: list[str] = []
    cur = 0
    for i in range(n):
        src, dst = hosts[cur], hosts[1 - cur]
        r = src.client().migrate_sandbox(sid, f"{host}/bench/migrate:{i}", dst.socket)
        downtime.append(r["downtime_ms"])
        for k, v in r["phases_ms"].items():
            phases.setdefault(k, []).append(v)
        for k, v in r["pull_timing_ms"].items():
            phases.setdefault(f"pull.{k}", []).append(v)
        for k, v in r.get("capture_timing_ms", {}).items():
            phases.setdefault(f"capture.{k}", []).append(v)
        for k, v in r.get("push_timing_ms", {}).items():
            phases.setdefault(f"push.{k}", []).append(v)
        if r["restored"] != "fs+proc" or r["status"] != "running":
            problems.append(f"migration {i}: {r['status']}, restored {r['restored']}")
        if any(x["id"] == sid for x in src.client().sandboxes()):
            problems.append(f"migration {i}: the source still holds {sid}")
        sid, cur = r["target_sandbox"], 1 - cur
        c = dst.client()
        got = c.exec(sid, "python3 /work/srv/get.py /")["stdout"]  # the server's memory, on the new host
        if got != counter:
            problems.append(f"migration {i}: the server answered {got!r}, not {counter!r}")
        settled_checkpoints(c, sid)
    for ch in t.check:
        r = c.exec(sid, ch.run)
        if r["exit_code"] != ch.expect_exit or (ch.expect_stdout is not None and r["stdout"] != ch.expect_stdout):
            problems.append(f"check {ch.run!r}: exit {r['exit_code']}, {r['stdout'][-200:]!r}")
    if c.exec(sid, ["python3", "-c", STATE_DIGEST, *t.state_paths])["stdout"] != want:
        problems.append("the state digest differs from the one before the first migration")
    return {"migration_downtime_ms": {"p50": percentile(downtime, 50, 1), "p99": percentile(downtime, 99, 1),
                                      "n": len(downtime)},
            "migration_phases_ms": {k: percentile(v, 50, 1) for k, v in phases.items()},
            "migrated_correct": not problems and len(downtime) == n, "migration_problems": problems,
            "migration_trace": t.name, "migration_image": t.image}


def run(image: str, turns: int, migrations: int = 10) -> dict[str, Any]:
    reg_dir = Path(tempfile.mkdtemp(prefix="crabd-bench-registry-"))
    reg = LocalRegistry(reg_dir).start()
    a = b = None
    mig_image = load_trace(TRACE).image
    try:
        a, b = _daemon(image, mig_image), _daemon(image, mig_image)
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
            **_migrations(a, b, reg.host, migrations),
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
    image, turns, migrations = ("busybox", 5, 3) if a.quick else (a.image, a.turns, a.migrations)
    out = run(image, turns, migrations)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
