#!/usr/bin/env python3
"""Recovery benchmark: agent traces, a crash, and how each method recovers.

    python bench/recovery.py [--quick] [--traces DIR] [--methods chat-only,replay,crabd]
                             [--time-scale 0.05] [--json] [--out DIR]
    (or: crabd bench recovery ...)

For every trace (bench/traces/*.json, format in README.md "Traces"):
1. a fault-free run through a crabd daemon is the reference: its checks and
   the digests of its state paths are what a correct recovery must reach;
   the same trace run on a bare runtime sandbox (no daemon, no checkpoints)
   is the baseline for crabd's time overhead;
2. for each fault point (quick: the middle turn boundary; full: every one)
   and each method, the trace runs to the fault, every process of the
   sandbox is killed (as an OOM kill would), the method recovers, and the
   trace continues; correct = checks pass and every state digest equals
   the reference's.

Methods: `chat-only` (a fresh sandbox from the image, the task's files and
setup, then the next turn: what a framework that saved only the transcript
does), `replay` (the same, then every earlier turn re-run), `crabd` (the
daemon rolls the sandbox back on its own; the trace continues in it).

The crash comes during the LLM wait after turn k, once turn k's checkpoint is
durable. Not measured yet (see README.md): crashes in the middle of a turn,
kill -9 of crabd itself, the `full` and `crabd-fs` methods, and the scale run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crabd.client import Client  # noqa: E402
from crabd.errors import FailedPrecondition  # noqa: E402
from crabd.runtime import Runtime  # noqa: E402
from crabd.testing import cleanup_state_dir  # noqa: E402
from crabd.traces import Trace, load_traces  # noqa: E402

DIGEST = r"""
import hashlib, os, sys
h = hashlib.sha256()
for top in sys.argv[1:]:
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if x not in ('.git', '__pycache__'))
        for n in sorted(files) + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            st = os.lstat(p)
            h.update(p.encode() + oct(st.st_mode).encode())
            if os.path.islink(p):
                h.update(os.readlink(p).encode())
            elif os.path.isfile(p):
                h.update(open(p, 'rb').read())
print(h.hexdigest())
"""
IMAGE_SOURCES = [Path("/var/lib/crabd-test/images"), Path("/var/lib/crabd-demo/images"), Path("/var/lib/crabd/images")]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 3)


@dataclass
class Sandbox:
    """One way to run commands: through the daemon, or on a bare runtime."""

    run: object      # callable(cmd, timeout) -> dict with exit_code, stdout, stderr (+ daemon fields)
    sid: str
    kill: object     # callable(): kill every process of the sandbox
    destroy: object


@dataclass
class Stats:
    runs: int = 0
    correct: int = 0
    bytes: int = 0
    ckpt_ms: list[float] = field(default_factory=list)
    stall_ms: list[float] = field(default_factory=list)
    rollback_ms: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.state = Path(tempfile.mkdtemp(prefix="crabd-bench-rec-", dir="/var/tmp"))
        self.rt = Runtime(self.state)
        self.proc: subprocess.Popen[bytes] | None = None
        self.c: Client | None = None

    # -- setup ----------------------------------------------------------------------------
    def prepare(self, traces: list[Trace]) -> None:
        for image in sorted({t.image for t in traces}):
            src = next((d / image / "rootfs" for d in IMAGE_SOURCES if (d / image / "rootfs").is_dir()), None)
            if src is not None:
                self.rt.images.import_path(str(src), image)
            elif image == "debian-py":
                print("building debian-py with debootstrap (once, ~1 min) ...", file=sys.stderr)
                self.rt.images.build_debian(image)
            else:
                raise SystemExit(f"image {image!r} not found under {', '.join(map(str, IMAGE_SOURCES))}")
        crabd = str(Path(sys.executable).parent / "crabd")
        sock = self.state / "api.sock"
        self.proc = subprocess.Popen([crabd, "serve", "--state-dir", str(self.state), "--socket", str(sock)],
                                     stdout=open(self.state / "daemon.log", "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                Client(sock).health()
                break
            except FailedPrecondition:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"crabd serve did not start; see {self.state / 'daemon.log'}")
                time.sleep(0.2)
        self.c = Client(sock)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        cleanup_state_dir(self.state)

    # -- sandboxes ---------------------------------------------------------------------------
    def daemon_sandbox(self, image: str) -> Sandbox:
        assert self.c is not None
        c = self.c
        sid = c.create_sandbox(image)["id"]
        return Sandbox(lambda cmd, t=300: c.exec(sid, cmd, timeout=t), sid,
                       lambda: os.kill(c.sandbox(sid)["pid"], signal.SIGKILL), lambda: c.delete_sandbox(sid))

    def bare_sandbox(self, image: str) -> Sandbox:
        sb = self.rt.create(image)
        return Sandbox(lambda cmd, t=300: self.rt.exec(sb.id, cmd, timeout=t).to_dict(), sb.id,
                       lambda: os.kill(self.rt.get(sb.id).pid or 0, signal.SIGKILL), lambda: self.rt.destroy(sb.id))

    # -- one trace run ------------------------------------------------------------------------
    def start(self, t: Trace, sb: Sandbox) -> None:
        for path, content in t.files.items():
            d = os.path.dirname(path)
            r = sb.run(f"mkdir -p '{d}' && cat > '{path}' <<'CRABD_EOF'\n{content}CRABD_EOF")
            if r["exit_code"] != 0:
                raise RuntimeError(f"{t.name}: writing {path}: {r['stderr']}")
        for cmd in t.setup:
            r = sb.run(cmd)
            if r["exit_code"] != 0:
                raise RuntimeError(f"{t.name}: setup {cmd!r}: {r['stderr']}")

    def turns(self, t: Trace, sb: Sandbox, lo: int, hi: int, st: Stats | None) -> None:
        for turn in t.turns[lo:hi]:
            r = sb.run(turn.run)
            if st is not None and "plan" in r:
                st.stall_ms.append(r["stall_ms"])
                st.plans.append(r["plan"])
            time.sleep(turn.llm_wait_ms / 1000 * self.a.time_scale)

    def verdict(self, t: Trace, sb: Sandbox) -> tuple[list[tuple[int, str]], str]:
        outs = []
        for ch in t.check:
            r = sb.run(ch.run)
            outs.append((r["exit_code"], r["stdout"]))
        r = sb.run(["python3", "-c", DIGEST, *t.state_paths])
        return outs, r["stdout"].strip()

    def correct(self, t: Trace, got: tuple[list[tuple[int, str]], str], ref: tuple[list[tuple[int, str]], str]) -> bool:
        checks, digest = got
        for ch, (code, out) in zip(t.check, checks):
            if code != ch.expect_exit or (ch.expect_stdout is not None and out != ch.expect_stdout):
                return False
        return digest == ref[1]

    def wait_captured(self, sid: str) -> list[dict]:
        assert self.c is not None
        deadline = time.monotonic() + 120
        while True:
            cks = self.c.checkpoints(sid)
            if all(k["state"] == "committed" for k in cks) or time.monotonic() > deadline:
                return cks
            time.sleep(0.05)

    # -- methods ---------------------------------------------------------------------------------
    def run_crabd(self, t: Trace, k: int | None, st: Stats) -> tuple[list[tuple[int, str]], str]:
        assert self.c is not None
        sb = self.daemon_sandbox(t.image)
        try:
            self.start(t, sb)
            n = len(t.turns)
            self.turns(t, sb, 0, k if k is not None else n, st)
            if k is not None:
                self.wait_captured(sb.sid)  # the crash comes in the LLM wait, after the capture
                since = max([e["seq"] for e in self.c.events()] or [0])
                t0 = time.monotonic()
                sb.kill()
                while not any(e["kind"] == "sandbox.rolled_back" for e in self.c.events(since=since, sandbox=sb.sid)):
                    if time.monotonic() - t0 > 120:
                        raise RuntimeError(f"{t.name}: crabd did not recover {sb.sid}")
                    time.sleep(0.01)
                st.rollback_ms.append((time.monotonic() - t0) * 1000)
                self.turns(t, sb, k, n, st)
            cks = self.wait_captured(sb.sid)
            st.bytes += sum(c["bytes"] for c in cks)
            st.ckpt_ms += [c["durations"]["total"] * 1000 for c in cks if c["durations"].get("total")]
            return self.verdict(t, sb)
        finally:
            sb.destroy()

    def run_fresh(self, t: Trace, k: int, st: Stats, replay: bool) -> tuple[list[tuple[int, str]], str]:
        first = self.daemon_sandbox(t.image)
        try:
            self.start(t, first)
            self.turns(t, first, 0, k, None)
            t0 = time.monotonic()
            first.kill()
        finally:
            first.destroy()
        sb = self.daemon_sandbox(t.image)  # a fresh sandbox from the image: all the framework has
        try:
            self.start(t, sb)
            if replay:
                self.turns(t, sb, 0, k, None)
            st.rollback_ms.append((time.monotonic() - t0) * 1000)
            self.turns(t, sb, k, len(t.turns), None)
            return self.verdict(t, sb)
        finally:
            sb.destroy()

    def baseline_seconds(self, t: Trace) -> float:
        sb = self.bare_sandbox(t.image)
        try:
            self.start(t, sb)
            t0 = time.monotonic()
            self.turns(t, sb, 0, len(t.turns), None)
            return time.monotonic() - t0
        finally:
            sb.destroy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one fault point per trace (the middle turn boundary)")
    ap.add_argument("--traces", default=str(ROOT / "bench" / "traces"))
    ap.add_argument("--methods", default="chat-only,replay,crabd")
    ap.add_argument("--time-scale", type=float, default=0.05, help="multiplier of the traces' LLM waits")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="directory for report.md and results.json")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the recovery benchmark needs root (it runs crabd and runc sandboxes)")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = set(methods) - {"chat-only", "replay", "crabd"}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: chat-only, replay, crabd")
    traces = load_traces(a.traces)
    b = Bench(a)
    stats = {m: Stats() for m in methods}
    overhead: list[float] = []
    t_start = time.monotonic()
    try:
        b.prepare(traces)
        for t in traces:
            ref_stats = Stats()
            t0 = time.monotonic()
            ref = b.run_crabd(t, None, ref_stats)
            crabd_s = time.monotonic() - t0
            if not b.correct(t, ref, ref):
                raise SystemExit(f"trace {t.name}: its checks fail even without a fault: {ref[0]}")
            base_s = b.baseline_seconds(t)
            overhead.append((crabd_s - base_s) / base_s * 100)
            points = [len(t.turns) // 2] if a.quick else list(range(1, len(t.turns)))
            for k in points:
                for m in methods:
                    st = stats[m]
                    if m == "crabd":
                        got = b.run_crabd(t, k, st)
                    else:
                        got = b.run_fresh(t, k, st, replay=(m == "replay"))
                    st.runs += 1
                    ok = b.correct(t, got, ref)
                    st.correct += ok
                    if not ok:
                        st.failures.append(f"{t.name}@{k}")
                    if not a.json:
                        print(f"{t.name:16} crash after turn {k:2}  {m:10} {'correct' if ok else 'WRONG'}",
                              file=sys.stderr, flush=True)
    finally:
        b.close()
    result: dict = {"methods": {}, "traces": [t.name for t in traces], "quick": a.quick,
                    "time_scale": a.time_scale, "seconds": round(time.monotonic() - t_start, 1)}
    for m, st in stats.items():
        result["methods"][m] = {
            "runs": st.runs,
            "correct_pct": round(100 * st.correct / st.runs, 1) if st.runs else None,
            "bytes": st.bytes,
            "bytes_vs_full_pct": None,  # the `full` method is not implemented yet
            "overhead_pct": round(statistics.median(overhead), 2) if m == "crabd" and overhead else None,
            "ckpt_ms": {"p50": pct(st.ckpt_ms, 0.5), "p99": pct(st.ckpt_ms, 0.99)},
            "stall_ms": {"p50": pct(st.stall_ms, 0.5), "p99": pct(st.stall_ms, 0.99)},
            "rollback_ms": {"p50": pct(st.rollback_ms, 0.5), "p99": pct(st.rollback_ms, 0.99)},
            "skip_fraction": round(st.plans.count("SKIP") / len(st.plans), 3) if st.plans else None,
            "wrong": st.failures,
        }
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2))
        lines = ["# crabd recovery benchmark", "",
                 f"`python bench/recovery.py {' '.join(sys.argv[1:])}` — {len(traces)} traces, "
                 f"{result['seconds']} s", "",
                 "| method | correct | bytes | overhead | ckpt p50/p99 ms | stall p50/p99 ms | recovery p50/p99 ms | SKIP |",
                 "|---|---|---|---|---|---|---|---|"]
        for m, r in result["methods"].items():
            lines.append(f"| {m} | {r['correct_pct']} % | {r['bytes']} | {r['overhead_pct']} | "
                         f"{r['ckpt_ms']['p50']}/{r['ckpt_ms']['p99']} | {r['stall_ms']['p50']}/{r['stall_ms']['p99']} | "
                         f"{r['rollback_ms']['p50']}/{r['rollback_ms']['p99']} | {r['skip_fraction']} |")
        (out / "report.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=2 if not a.json else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
