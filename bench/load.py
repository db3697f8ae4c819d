#!/usr/bin/env python3
"""Load: N sandboxes x M turns through one daemon, with random think times.

    python -m bench.load [--quick] [--sandboxes N --turns M] [--think-ms MAX] [--seed S] [--json]
    (or: crabd bench load ...)

Full: 32 x 200; quick: 8 x 50 (busybox image, a fresh state dir). Each
sandbox has its own client thread; a turn is a write (`echo` into a log
file: an FS checkpoint) or, one time in four, a read (`cat`: a SKIP turn),
after a think time drawn uniformly from 0..--think-ms (the agent's LLM wait).

Reported:
- exec latency (client wall time) and exec *overhead* = wall time minus the
  command's own duration as the exec result reports it (`duration`: the
  runtime's time from starting `runc exec` to its exit), so the overhead is
  the daemon's work around the command: API, turn bookkeeping, inspector,
  opening the checkpoint, and the stall behind the previous turn's capture;
  p50 / p90 / p99 / max; the stall alone as the result reports it;
- daemon RSS sampled every --rss-interval s over the whole run;
- consistency: every checkpoint the run created is committed (none pending or
  failed) or was retired by retention; after the daemon stops, every
  committed row verifies against its keyed digest (crabd.store.Store.verify);
  before that, a seeded sample of checkpoints per sandbox is rolled back to
  and the log file must equal what the run had written up to that turn.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench._stats import quantiles  # (nearest rank)
from bench.harness import RssSampler, report, require_root
from crabd.client import Client
from crabd.errors import CrabdError, NotFound
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, ensure_busybox_image, settled_checkpoints

ROOT = Path(__file__).resolve().parent.parent


def summary_ms(xs: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), **quantiles(ms, (50, 90, 99), 2),
            "max": round(max(ms), 2) if ms else None}


class Agent(threading.Thread):
    """One sandbox's turns, as an agent would drive them."""

    def __init__(self, socket: Path, sid: str, turns: int, think_ms: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.client = Client(socket, timeout=600)
        self.sid, self.turns, self.think_ms = sid, turns, think_ms
        self.rng = random.Random(seed)
        self.wall: list[float] = []
        self.overhead: list[float] = []
        self.stall: list[float] = []
        self.expected: dict[str, list[str]] = {}  # checkpoint id -> lines of /root/log after its turn
        self.errors: list[str] = []

    def run(self) -> None:
        lines: list[str] = []
        for turn in range(1, self.turns + 1):
            time.sleep(self.rng.uniform(0, self.think_ms) / 1000)
            write = self.rng.random() >= 0.25
            cmd = f"echo t{turn} >> /root/log" if write else "cat /root/log > /dev/null 2>&1; true"
            t = time.monotonic()
            try:
                r = self.client.exec(self.sid, cmd, timeout=120)
            except CrabdError as e:
                self.errors.append(f"turn {turn}: {e}")
                continue
            wall = time.monotonic() - t
            if r["exit_code"] != 0:
                self.errors.append(f"turn {turn}: exit {r['exit_code']}: {r['stderr'][:200]}")
                continue
            if write:
                lines.append(f"t{turn}")
            self.wall.append(wall)
            self.overhead.append(max(0.0, wall - r["duration"]))
            self.stall.append(r.get("stall_ms", 0) / 1000)
            self.expected[r["checkpoint"]] = list(lines)


def run(a: argparse.Namespace) -> dict[str, Any]:
    n = a.sandboxes or (8 if a.quick else 32)
    m = a.turns or (50 if a.quick else 200)
    problems: list[str] = []
    state = Path(tempfile.mkdtemp(prefix="crabd-load-", dir=a.workdir))
    log_path = Path(tempfile.mkstemp(prefix="crabd-load-", suffix=".log", dir=a.workdir)[1])
    d = DaemonHandle(state)
    d.log = log_path
    out: dict[str, Any] = {"sandboxes": n, "turns": m, "think_ms_max": a.think_ms, "seed": a.seed}
    try:
        ensure_busybox_image(Runtime(state))
        d.start()
        assert d.proc is not None
        c = Client(d.socket)
        t = time.monotonic()
        sids = [c.create_sandbox("busybox", name=f"load{i}")["id"] for i in range(n)]
        out["create_s"] = round(time.monotonic() - t, 2)
        rss = RssSampler(d.proc.pid, a.rss_interval)
        rss.start()
        agents = [Agent(d.socket, sid, m, a.think_ms, a.seed * 1000 + i) for i, sid in enumerate(sids)]
        t = time.monotonic()
        for ag in agents:
            ag.start()
        for ag in agents:
            ag.join()
        out["run_s"] = round(time.monotonic() - t, 2)
        for ag in agents:
            problems += [f"{ag.sid}: {e}" for e in ag.errors[:3]]
        wall = [x for ag in agents for x in ag.wall]
        out["execs"] = len(wall)
        out["exec_ms"] = summary_ms(wall)
        out["exec_overhead_ms"] = summary_ms([x for ag in agents for x in ag.overhead])
        out["stall_ms"] = summary_ms([x for ag in agents for x in ag.stall])

        # consistency: nothing left pending or failed; a sample rolls back to what was written
        states: dict[str, int] = {}
        retired = 0
        for ag in agents:
            cks = {k["id"]: k for k in settled_checkpoints(c, ag.sid, 600)}
            for cid in ag.expected:
                st = cks[cid]["state"] if cid in cks else "retired"
                states[st] = states.get(st, 0) + 1
                retired += st == "retired"
        out["checkpoints"] = states
        bad = {k: v for k, v in states.items() if k not in ("committed", "retired")}
        if bad:
            problems.append(f"checkpoints not committed: {bad}")
        rng = random.Random(a.seed)
        checked = wrong = 0
        for ag in agents:
            present = [k["id"] for k in c.checkpoints(ag.sid) if k["id"] in ag.expected]
            for cid in rng.sample(present, min(a.rollback_sample, len(present))):
                try:
                    c.rollback(ag.sid, cid)
                    got = c.exec(ag.sid, "cat /root/log 2>/dev/null; true")["stdout"].split()
                except NotFound:
                    continue  # retired between the listing and the rollback
                checked += 1
                if got != ag.expected[cid]:
                    wrong += 1
                    problems.append(f"rollback to {cid}: /root/log has {len(got)} lines, expected "
                                    f"{len(ag.expected[cid])}")
        out["rollback_checks"] = {"checked": checked, "wrong": wrong}
        rss.stop()
        series = rss.mib()
        xs = [r for _, r in series]
        step = max(1, len(series) // 40)
        out["daemon_rss_mib"] = {"start": xs[0] if xs else None, "peak": max(xs) if xs else None,
                                 "end": xs[-1] if xs else None, "samples": series[::step]}
        # Every committed row verifies against its keyed digest (read with
        # the store's own code, next to the running daemon: WAL readers).
        from crabd.store import Store
        store = Store(state)
        try:
            ok = failed = 0
            for sid in sids:
                for row in store.list_checkpoints(sid):
                    try:
                        store.verify(row)
                        ok += 1
                    except CrabdError as e:
                        failed += 1
                        problems.append(f"{row.id} does not verify: {e}")
        finally:
            store.close()
        out["verified"] = {"ok": ok, "failed": failed}
        for sid in sids:
            c.delete_sandbox(sid)
    except BaseException:
        print(f"--- crabd log tail:\n{log_path.read_text(errors='replace')[-3000:]}", file=sys.stderr)
        raise
    finally:
        d.stop()
        cleanup_state_dir(state)
        log_path.unlink(missing_ok=True)
    out["problems"] = problems
    out["ok"] = not problems
    return out


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 sandboxes x 50 turns")
    ap.add_argument("--sandboxes", type=int, default=None, help="default: full 32, quick 8")
    ap.add_argument("--turns", type=int, default=None, help="default: full 200, quick 50")
    ap.add_argument("--think-ms", type=float, default=200.0, help="think time per turn: uniform 0..this")
    ap.add_argument("--rollback-sample", type=int, default=3, help="checkpoints per sandbox rolled back to")
    ap.add_argument("--rss-interval", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--workdir", default="/var/tmp")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    require_root("bench load needs root (it runs a crabd daemon)")
    return report(run(a), a.json)


if __name__ == "__main__":
    sys.exit(main())
