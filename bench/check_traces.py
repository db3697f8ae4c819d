#!/usr/bin/env python3
"""Prove the shipped traces are fit for the recovery benchmark.

    python -m bench.check_traces [--traces DIR] [--only NAME,...] [--time-scale 0.02]
                                 [--json] [--out DIR]
    (or: crabd bench check-traces ...)

For every trace, through a real `crabd serve` (each turn is a checkpointed turn):
1. fault-free: inputs staged, files written, setup and all turns run; every
   turn with `expect_exit` has that exit code; the checks pass;
2. deterministic: a second fault-free run in a new sandbox gives the same
   check outputs and the same state-path digest;
3. needs recovery: `chat-only` at the middle turn (a fresh sandbox with the
   task's inputs, files and setup, then turns k..n, as a framework that kept
   only the transcript would continue) FAILS at least one check.

Exit status 0 when every trace passes all three. `--out` writes summary.json
and summary.md (bench/results/traces/ holds the committed ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench import inputs
from crabd.client import Client
from crabd.images import ImageStore
from crabd.testing import DaemonHandle, cleanup_state_dir
from crabd.traces import STATE_DIGEST, Trace, load_traces

ROOT = Path(__file__).resolve().parent.parent


class TraceRun:
    """One sandbox through the daemon, driven turn by turn."""

    def __init__(self, c: Client, t: Trace) -> None:
        self.c, self.t = c, t
        self.sid = c.create_sandbox(t.image)["id"]
        self.problems: list[str] = []

    def sh(self, cmd: str | list[str], stdin: str | None = None) -> dict:
        return self.c.exec(self.sid, cmd, timeout=600, stdin=stdin)

    def prelude(self) -> None:
        """What the task gives: inputs, files, setup (also all a chat-only restart has)."""
        inputs.prelude(self.t, self.sh)

    def turns(self, lo: int, hi: int, time_scale: float) -> None:
        for i, turn in enumerate(self.t.turns[lo:hi], start=lo):
            r = self.sh(turn.run)
            if turn.expect_exit is not None and r["exit_code"] != turn.expect_exit:
                self.problems.append(f"turn {i} exited {r['exit_code']}, expected {turn.expect_exit}")
            time.sleep(turn.llm_wait_ms / 1000 * time_scale)

    def verdict(self) -> dict:
        checks = []
        for ch in self.t.check:
            r = self.sh(ch.run)
            ok = r["exit_code"] == ch.expect_exit and (ch.expect_stdout is None or r["stdout"] == ch.expect_stdout)
            checks.append({"ok": ok, "exit": r["exit_code"], "stdout": r["stdout"][-400:]})
        r = self.sh(["python3", "-c", STATE_DIGEST, *self.t.state_paths])
        return {"checks": checks, "checks_ok": all(c["ok"] for c in checks),
                "digest": r["stdout"].strip() if r["exit_code"] == 0 else f"error: {r['stderr'][-200:]}",
                "turn_problems": list(self.problems)}

    def destroy(self) -> None:
        self.c.delete_sandbox(self.sid)


def run(c: Client, t: Trace, lo_hi: tuple[int, int], time_scale: float) -> dict:
    tr = TraceRun(c, t)
    try:
        tr.prelude()
        tr.turns(*lo_hi, time_scale)
        return tr.verdict()
    finally:
        tr.destroy()


def check_trace(c: Client, t: Trace, time_scale: float) -> dict:
    n = len(t.turns)
    k = n // 2
    t0 = time.monotonic()
    a = run(c, t, (0, n), time_scale)
    b = run(c, t, (0, n), time_scale)
    chat = run(c, t, (k, n), time_scale)
    same = a["digest"] == b["digest"] and [x["stdout"] for x in a["checks"]] == [x["stdout"] for x in b["checks"]]
    res = {
        "name": t.name, "image": t.image, "turns": n, "middle": k,
        "fault_free": a["checks_ok"] and not a["turn_problems"],
        "deterministic": same,
        "chat_only_fails": not chat["checks_ok"],
        "chat_only_digest_differs": chat["digest"] != a["digest"],
        "digest": a["digest"],
        "seconds": round(time.monotonic() - t0, 1),
        "runs": {"first": a, "second": b, "chat_only": chat},
    }
    res["ok"] = res["fault_free"] and res["deterministic"] and res["chat_only_fails"]
    return res


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default=str(ROOT / "bench" / "traces"))
    ap.add_argument("--only", default="", help="comma-separated trace names")
    ap.add_argument("--time-scale", type=float, default=0.02, help="multiplier of the traces' LLM waits")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="directory for summary.json and summary.md")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    traces = load_traces(a.traces)
    if a.only:
        want = {x.strip() for x in a.only.split(",") if x.strip()}
        unknown = want - {t.name for t in traces}
        if unknown:
            raise SystemExit(f"unknown traces {sorted(unknown)} in {a.traces}")
        traces = [t for t in traces if t.name in want]
    for t in traces:
        inputs.fetch(t.inputs)
    state = Path(tempfile.mkdtemp(prefix="crabd-check-traces-", dir="/var/tmp"))
    d = DaemonHandle(state)
    results = []
    t_start = time.monotonic()
    try:
        store = ImageStore(state)
        for image in sorted({t.image for t in traces}):
            store.import_path(str(inputs.image_rootfs(image)), image)
        d.start()
        c = d.client()
        for t in traces:
            try:
                res = check_trace(c, t, a.time_scale)
            except Exception as e:  # one broken trace must not hide the others' results
                res = {"name": t.name, "image": t.image, "turns": len(t.turns), "ok": False, "error": str(e)}
            results.append(res)
            if not a.json:
                flags = "error: " + res["error"] if "error" in res else (
                    f"fault-free {'yes' if res['fault_free'] else 'NO'}, deterministic "
                    f"{'yes' if res['deterministic'] else 'NO'}, chat-only at turn {res['middle']} "
                    f"{'fails' if res['chat_only_fails'] else 'PASSES'} ({res['seconds']} s)")
                print(f"{'ok  ' if res['ok'] else 'FAIL'} {t.name:24} {res['turns']:2} turns  {flags}",
                      file=sys.stderr, flush=True)
    finally:
        d.stop()
        cleanup_state_dir(state)
    summary = {"traces": len(results), "ok": sum(r["ok"] for r in results), "time_scale": a.time_scale,
               "seconds": round(time.monotonic() - t_start, 1), "results": results}
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        lines = ["# Trace check", "",
                 f"`python -m bench.check_traces {' '.join(sys.argv[1:])}`: {summary['ok']}/{summary['traces']} "
                 f"traces pass, {summary['seconds']} s.", "",
                 "| trace | image | turns | fault-free | deterministic | chat-only at middle | seconds |",
                 "|---|---|---|---|---|---|---|"]
        for r in results:
            if "error" in r:
                lines.append(f"| {r['name']} | {r['image']} | {r['turns']} | error: {r['error'][:80]} | | | |")
                continue
            chat = "checks fail" if r["chat_only_fails"] else "checks PASS"
            if r["chat_only_digest_differs"]:
                chat += ", state differs"
            lines.append(f"| {r['name']} | {r['image']} | {r['turns']} | {'yes' if r['fault_free'] else 'NO'} | "
                         f"{'yes' if r['deterministic'] else 'NO'} | {chat} (turn {r['middle']}) | {r['seconds']} |")
        (out / "summary.md").write_text("\n".join(lines) + "\n")
    if a.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['ok']}/{summary['traces']} traces pass ({summary['seconds']} s)")
    return 0 if summary["ok"] == summary["traces"] else 1


if __name__ == "__main__":
    sys.exit(main())
