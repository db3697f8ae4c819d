#!/usr/bin/env python3
"""Recovery benchmark: agent traces, injected faults, and how each method recovers.

    python bench/recovery.py [--quick] [--traces DIR] [--methods chat-only,replay,full,crabd-fs,crabd]
                             [--faults boundary,mid-turn,daemon|none] [--time-scale 0.05]
                             [--json] [--out DIR]
    python bench/recovery.py --scale 1,4,16,32 [--scale-trace NAME] [--json] [--out DIR]
    (or: crabd bench recovery ...)

For every trace (bench/traces/*.json, format in README.md "Traces"):
1. a fault-free run on a bare runtime sandbox (no daemon, no checkpoints) is
   the reference: its checks and the digests of its state paths are what a
   correct recovery must reach, and its time is the baseline of every
   method's overhead;
2. per method, a fault-free run measures checkpoint bytes and latencies,
   stalls, SKIP turns and the end-to-end time;
3. per fault point and method, the trace runs to the fault, the fault hits,
   the method recovers, the trace goes on; correct = checks pass and every
   state digest equals the reference's.

Methods: `chat-only` (a fresh sandbox from the image with the task's files and
setup, then the next turn: a framework that saved only the transcript),
`replay` (the same, then every earlier turn re-run, without LLM waits),
`full` (`crabd serve --capture full`: a CRIU dump and a copy of every changed
file at every turn), `crabd-fs` (`--capture fs-only`: never process images),
`crabd` (`--capture auto`). The crabd methods recover on their own: the
agent waits for the daemon's `sandbox.rolled_back` event and goes on after
the turn of the checkpoint it restored (re-issuing later commands, as an
agent that keeps its transcript would; an unknown turn means the interrupted
turn's own partial checkpoint, and the agent retries that turn).

Faults (`--faults`):
- `boundary`: kill -9 of every process of the sandbox in the LLM wait after
  turn k, once turn k's checkpoint is durable;
- `mid-turn`: the same kill at a seeded random instant inside turn k's
  command (20-80 % of its fault-free duration); the agent retries turn k;
- `daemon`: kill -9 of crabd right after turn k's reply, while its
  checkpoint is being captured, then a restart. chat-only and replay own no
  daemon: for them the process that owned the sandbox died, so the sandbox
  is lost, which is the `boundary` case.
Full mode: every fault at every turn k. `--quick`: at most 3 traces (a fixed
list), one fault each in rotation (with fewer traces than faults, a trace
takes several); k = the middle turn (boundary), the
longest command of the middle third (mid-turn), the first turn from the
middle on whose plan is not SKIP in crabd's run (daemon).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from crabd.errors import CrabdError  # noqa: E402
from crabd.runtime import Runtime  # noqa: E402
from crabd.testing import CRABD, DaemonHandle, cleanup_state_dir  # noqa: E402
from crabd.traces import STATE_DIGEST, Trace, load_traces  # noqa: E402

import inputs  # noqa: E402  (bench/inputs.py: trace images and PyPI inputs)

METHODS = ("chat-only", "replay", "full", "crabd-fs", "crabd")
DAEMON_METHODS = ("crabd", "crabd-fs", "full")   # also the order they run in: crabd picks the daemon k
CAPTURE = {"full": "full", "crabd-fs": "fs-only", "crabd": "auto"}
FAULTS = ("boundary", "mid-turn", "daemon")
QUICK_TRACES = ("calc-repair", "dev-server", "git-refactor")

# The digest of the state paths: contents, modes, symlink targets and
# directories; `.git` and `__pycache__` left out (object packing and bytecode
# timestamps differ between equal trees). python3 when the image has it, else
# the same walk in POSIX sh (busybox). Both are run the same way for the
# reference and the faulted run of a trace.
DIGEST_PY = STATE_DIGEST  # crabd/traces.py: the one state digest (check_traces uses it too)
DIGEST_SH = r"""
if command -v python3 >/dev/null 2>&1; then exec python3 -c "$CRABD_DIGEST_PY" "$@"; fi
for top in "$@"; do
  [ -e "$top" ] && find "$top" \( -name .git -o -name __pycache__ \) -prune -o -print
done | LC_ALL=C sort | while IFS= read -r p; do
  if [ -L "$p" ]; then echo "L $p $(readlink "$p")"
  elif [ -d "$p" ]; then echo "D $p $(stat -c %a "$p")"
  elif [ -f "$p" ]; then echo "F $p $(stat -c %a "$p") $(sha256sum < "$p" | cut -c1-64)"
  else echo "O $p $(stat -c %f "$p")"; fi
done | sha256sum | cut -c1-64
"""

Verdict = tuple[list[tuple[int, str]], str]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))], 3)


def last_seq(c: Any, sid: str) -> int:
    """The sequence number of the sandbox's newest event (0: none yet); `c` a crabd Client."""
    seq = 0
    while True:
        evs = c.events(since=seq, sandbox=sid)
        if not evs:
            return seq
        seq = evs[-1]["seq"]


@dataclass
class RunRecord:
    """One trace run: fault-free (fault None) or with one fault at turn k."""

    trace: str
    method: str
    fault: str | None = None
    k: int | None = None
    correct: bool | None = None
    seconds: float = 0.0             # the turns, LLM waits included (not setup, not the checks)
    bytes: int = 0
    ckpt_ms: list[float] = field(default_factory=list)
    stall_ms: list[float] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)   # per turn, s (the reference run's are the mid-turn clock)
    rollback_ms: float | None = None
    note: str = ""
    external_calls: int = 0          # distinct external calls that reached the outside world
    duplicate_calls: int = 0         # repeats of one of them (a side effect done twice)
    rep: int = 0                     # the round of a fault-free run (--reps)


@dataclass
class Box:
    """One sandbox, through the daemon or on the bare runtime."""

    sid: str
    run: Callable[..., dict[str, Any]]   # (cmd, env=None) -> exec reply; raises CrabdError
    destroy: Callable[[], None]


class Outside:
    """The outside world of the traces' external calls (`turn.external`): an
    HTTP service on the host that counts every call it receives by operation
    and arguments. Each attempt carries a fresh `request_id`, as a regenerated
    tool call after a restart does, so a repeat is a side effect done twice."""

    def __init__(self) -> None:
        import collections
        import http.server
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        outside = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
                args = {k: v for k, v in (body.get("args") or {}).items() if k != "request_id"}
                key = json.dumps({"op": body.get("op"), "args": args}, sort_keys=True)
                with outside.lock:
                    outside.counts[key] += 1
                    n = sum(outside.counts.values())
                out = json.dumps({"id": f"ext-{n}", "op": body.get("op")}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/call"

    def call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        import urllib.request
        req = urllib.request.Request(self.url, data=json.dumps({"op": op, "args": args}).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def take(self) -> tuple[int, int]:
        """(distinct calls, repeats) since the last take; starts a new count."""
        with self.lock:
            distinct, total = len(self.counts), sum(self.counts.values())
            self.counts.clear()
        return distinct, total - distinct

    def close(self) -> None:
        self.server.shutdown()


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.state = Path(tempfile.mkdtemp(prefix="crabd-bench-rec-", dir="/var/tmp"))
        self.rt = Runtime(self.state)
        self.dh: DaemonHandle | None = None
        self.k_daemon: dict[str, int] = {}
        self.unsized: list[tuple[RunRecord, Box, int]] = []   # fault-free runs whose bytes are still counted
        self.outside = Outside()
        self._client: Any = None
        self._client_key: tuple[int, int] | None = None
        self.killed_at: float | None = None   # wall time of the last kill_all
        self.capture_flag = "--capture" in subprocess.run([CRABD, "serve", "--help"], capture_output=True,
                                                          text=True, timeout=60).stdout

    # -- setup ------------------------------------------------------------------------------------
    def prepare(self, traces: list[Trace]) -> None:
        """Import every trace's image (found in a known cache, or built once by
        bench/inputs.py) and fetch the traces' PyPI inputs into the cache."""
        for image in sorted({t.image for t in traces}):
            if not self.rt.images.exists(image):
                self.rt.images.import_path(str(inputs.image_rootfs(image)), image)
        inputs.fetch(sorted({n for t in traces for n in t.inputs}))

    def client(self) -> Any:
        """One crabd client per daemon process, as an agent keeps one (a new
        connection per call would be the bench's cost, not crabd's)."""
        assert self.dh is not None and self.dh.proc is not None
        key = (id(self.dh), self.dh.proc.pid)
        if self._client_key != key:
            if self._client is not None:
                self._client.close()
            self._client, self._client_key = self.dh.client(), key
        return self._client

    def serve(self, args: list[str]) -> None:
        self.stop_daemon()
        # --inspector proc: the /proc inspector, no BPF compile at each (re)start
        env = {"CRABD_INSPECTOR": "proc"} if self.a.inspector == "proc" else None
        self.dh = DaemonHandle(self.state, args=args, env=env)
        self.dh.start()

    def serve_method(self, method: str) -> None:
        if not self.capture_flag:
            if method != "crabd":
                raise SystemExit(f"method {method!r} needs `crabd serve --capture {CAPTURE[method]}`, which this "
                                 f"crabd does not have yet (issue 7); run with --methods chat-only,replay,crabd")
            self.serve([])
        else:
            self.serve(["--capture", CAPTURE[method]])

    def stop_daemon(self) -> None:
        if self.dh is not None:
            try:
                c = self.client()
                for sb in c.sandboxes():
                    c.delete_sandbox(sb["id"])
            except Exception:
                pass
            self.dh.stop()
            self.dh = None

    def close(self) -> None:
        self.outside.close()
        self.stop_daemon()
        if self._client is not None:
            self._client.close()
        for sb in self.rt.list():
            try:
                self.rt.destroy(sb.id)
            except Exception:
                pass
        cleanup_state_dir(self.state)

    # -- sandboxes ----------------------------------------------------------------------------------
    def daemon_box(self, image: str) -> Box:
        assert self.dh is not None
        sid = self.client().create_sandbox(image)["id"]

        def run(cmd: str | list[str], env: dict[str, str] | None = None, stdin: str | None = None) -> dict[str, Any]:
            assert self.dh is not None
            return self.client().exec(sid, cmd, timeout=600, env=env, stdin=stdin)

        def destroy() -> None:
            assert self.dh is not None
            self.client().delete_sandbox(sid)
        return Box(sid, run, destroy)

    def bare_box(self, image: str) -> Box:
        sb = self.rt.create(image)
        return Box(sb.id, lambda cmd, env=None, stdin=None: self.rt.exec(sb.id, cmd, env=env, stdin=stdin,
                                                                          timeout=600).to_dict(),
                   lambda: self.rt.destroy(sb.id))

    def kill_all(self, sid: str) -> None:
        """kill -9 every process of the sandbox, as the OOM killer or a crash would."""
        self.killed_at = time.time()
        for pid in self.rt.pids(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- the agent ----------------------------------------------------------------------------------
    def start(self, t: Trace, box: Box) -> list[dict[str, Any]]:
        """The task's inputs, files and setup (bench/inputs.prelude); the exec replies."""
        replies: list[dict[str, Any]] = []

        def run(cmd: list[str] | str, stdin: str | None) -> dict[str, Any]:
            r = box.run(cmd, None, stdin)
            replies.append(r)
            return r

        inputs.prelude(t, run)
        return replies

    def wait(self, t: Trace, i: int) -> None:
        time.sleep(t.turns[i].llm_wait_ms / 1000 * self.a.time_scale)

    def verdict(self, t: Trace, box: Box) -> Verdict:
        outs = []
        for ch in t.check:
            try:
                r = box.run(ch.run)
                outs.append((r["exit_code"], r["stdout"]))
            except CrabdError as e:
                outs.append((-1, str(e)))
        return outs, self.digest(t, box)

    @staticmethod
    def digest(t: Trace, box: Box) -> str:
        """The digest of the trace's state paths in the sandbox (DIGEST_SH)."""
        r = box.run(["/bin/sh", "-c", DIGEST_SH, "digest", *t.state_paths], env={"CRABD_DIGEST_PY": DIGEST_PY})
        return r["stdout"].strip()

    @staticmethod
    def correct(t: Trace, got: Verdict, ref: Verdict) -> bool:
        checks, digest = got
        for ch, (code, out) in zip(t.check, checks):
            if code != ch.expect_exit or (ch.expect_stdout is not None and out != ch.expect_stdout):
                return False
        return digest == ref[1]

    def mid_turn_timer(self, t: Trace, k: int, ref: RunRecord, sid: str) -> threading.Timer:
        rng = random.Random(f"{t.name}:mid-turn:{k}")
        delay = rng.uniform(0.2, 0.8) * ref.durations[k - 1]
        return threading.Timer(delay, self.kill_all, (sid,))

    # -- bare runtime: the reference, chat-only, replay --------------------------------------------------
    def external(self, t: Trace, i: int, box: Box, ledger: bool) -> None:
        """The agent's external call after turn i (if it has one): directly, or
        (crabd methods) through crabd's effects ledger, which replays a call
        already committed in the sandbox's lineage instead of repeating it."""
        ext = t.turns[i].external
        if ext is None:
            return
        args = {**ext.args, "request_id": os.urandom(8).hex()}  # regenerated on every attempt
        if ledger:
            assert self.dh is not None
            self.client().effect_call(box.sid, ext.op, args, lambda: self.outside.call(ext.op, args))
        else:
            self.outside.call(ext.op, args)

    def run_bare(self, t: Trace, method: str, fault: str | None = None, k: int | None = None,
                 ref: RunRecord | None = None) -> tuple[RunRecord, Verdict]:
        rec = RunRecord(t.name, method, fault, k)
        self.outside.take()  # a count of this run only
        box = self.bare_box(t.image)
        try:
            self.start(t, box)
            n, pos = len(t.turns), 0
            t0 = time.monotonic()
            while pos < n:
                if fault == "mid-turn" and pos == (k or 0) - 1 and rec.rollback_ms is None:
                    assert ref is not None
                    timer = self.mid_turn_timer(t, k or 0, ref, box.sid)
                    timer.start()
                    try:
                        box.run(t.turns[pos].run)
                    except CrabdError:
                        pass
                    timer.join()
                    box, rec.rollback_ms = self.fresh(t, box, method, pos)
                    continue  # the agent retries turn k
                t1 = time.monotonic()
                box.run(t.turns[pos].run)
                rec.durations.append(time.monotonic() - t1)
                self.external(t, pos, box, ledger=False)
                pos += 1
                if fault in ("boundary", "daemon") and pos == k and rec.rollback_ms is None:
                    self.kill_all(box.sid)
                    box, rec.rollback_ms = self.fresh(t, box, method, pos)
                self.wait(t, pos - 1)
            rec.seconds = time.monotonic() - t0
            rec.external_calls, rec.duplicate_calls = self.outside.take()
            return rec, self.verdict(t, box)
        finally:
            box.destroy()

    def fresh(self, t: Trace, dead: Box, method: str, done: int) -> tuple[Box, float]:
        """What a framework without crabd has: a new sandbox, the task, and (replay) the transcript."""
        t0 = time.monotonic()
        dead.destroy()
        box = self.bare_box(t.image)
        self.start(t, box)
        if method == "replay":
            for i, turn in enumerate(t.turns[:done]):
                box.run(turn.run)   # tool calls from the transcript: no LLM waits
                self.external(t, i, box, ledger=False)
        return box, (time.monotonic() - t0) * 1000

    # -- through crabd ----------------------------------------------------------------------------------
    def last_seq(self, sid: str) -> int:
        assert self.dh is not None
        return last_seq(self.client(), sid)

    def await_rollback(self, t: Trace, sid: str, since: int, timeout: float = 180) -> int | None:
        """The turn of the checkpoint crabd rolled the sandbox back to (None: no rollback yet)."""
        assert self.dh is not None
        c = self.client()
        deadline = time.monotonic() + timeout
        while True:
            for e in c.events(since=since, sandbox=sid):
                since = e["seq"]
                if e["kind"] == "sandbox.rolled_back":
                    return int(c.checkpoint(e["data"]["checkpoint"])["turn"])
                if e["kind"] == "sandbox.recovery_failed":
                    raise RuntimeError(f"{t.name}: crabd could not recover {sid}: {e['data'].get('error')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{t.name}: crabd did not roll {sid} back within {timeout:.0f} s")
            time.sleep(0.01)

    def head_turn(self, sid: str) -> int:
        """The turn of the sandbox's head checkpoint. After an automatic
        recovery that is the checkpoint restored, unless an exec the agent had
        already sent ran after the recovery (the kill came before its command
        started): then its own checkpoint, whose effects are in the sandbox."""
        assert self.dh is not None
        c = self.client()
        return int(c.checkpoint(c.sandbox(sid)["head"])["turn"])

    def wait_durable(self, sid: str, cid: str | None = None, timeout: float = 180,
                     sized: bool = False) -> list[dict[str, Any]]:
        """Wait until checkpoint `cid` (None: every one) is no longer pending;
        `sized`: and every committed one has its bytes counted (the daemon
        sizes checkpoints as idle work after the commit)."""
        assert self.dh is not None
        c = self.client()
        deadline = time.monotonic() + timeout
        while True:
            cks = c.checkpoints(sid, all=True)
            pending = [x for x in cks if x["state"] == "pending" and (cid is None or x["id"] == cid)]
            if sized:
                pending += [x for x in cks if x["state"] == "committed" and x["seq"] > 0 and x["plan"] != "SKIP"
                            and not x["bytes"] and "size" not in (x.get("durations") or {})]
            if not pending:
                return cks
            if time.monotonic() > deadline:
                if sized and all(x["state"] != "pending" for x in cks):
                    return cks  # the caller counts the unsized ones
                raise RuntimeError(f"checkpoints of {sid} still pending after {timeout:.0f} s: "
                                   f"{[x['id'] for x in pending]}")
            time.sleep(0.02)

    def run_daemon(self, t: Trace, method: str, fault: str | None = None, k: int | None = None,
                   ref: RunRecord | None = None, quick: bool = False) -> tuple[RunRecord, Verdict]:
        assert self.dh is not None
        rec = RunRecord(t.name, method, fault, k)
        self.outside.take()  # a count of this run only
        box = self.daemon_box(t.image)
        kept = False
        try:
            pos_of = {0: 0}    # the daemon's turn number -> trace turns done after it
            for r in self.start(t, box):
                pos_of[r["turn"]] = 0
            n, pos, since_pre = len(t.turns), 0, 0
            t0 = time.monotonic()
            while pos < n:
                if fault == "mid-turn" and pos == (k or 0) - 1 and rec.rollback_ms is None:
                    assert ref is not None
                    since = self.last_seq(box.sid)
                    timer = self.mid_turn_timer(t, k or 0, ref, box.sid)
                    timer.start()
                    tk = time.monotonic()
                    try:
                        r = box.run(t.turns[pos].run)
                        pos_of[r["turn"]] = pos + 1
                        rec.note = "the kill came after the command ended"
                    except CrabdError:
                        pass
                    timer.join()
                    turn = self.await_rollback(t, box.sid, since)
                    rec.rollback_ms = (time.monotonic() - tk) * 1000
                    # A turn the agent never saw end: the interrupted turn's own
                    # checkpoint; the agent retries that turn on top of it.
                    pos = pos_of.get(self.head_turn(box.sid), pos_of.get(turn, pos))
                    continue
                if fault == "daemon" and rec.rollback_ms is None:
                    # taken before the turn: after its reply, the kill must not wait on an API call
                    since_pre = self.last_seq(box.sid)
                t1 = time.monotonic()
                r = box.run(t.turns[pos].run)
                rec.durations.append(time.monotonic() - t1)
                rec.stall_ms.append(r["stall_ms"])
                rec.plans.append(r["plan"])
                pos_of[r["turn"]] = pos + 1
                self.external(t, pos, box, ledger=True)
                pos += 1
                done = pos - 1
                if rec.rollback_ms is None and self.fault_here(t, fault, k, pos, r, quick):
                    rec.k = pos
                    pos = self.inject(t, box, fault or "", r, pos_of, rec, since_pre)
                self.wait(t, done)
            rec.seconds = time.monotonic() - t0
            rec.external_calls, rec.duplicate_calls = self.outside.take()
            last_turn = max(t_ for t_, p_ in pos_of.items() if p_ == n)
            verdict = self.verdict(t, box)
            if fault is None:
                # Bytes count in fault-free runs only, once the daemon's idle
                # sizing got to them: the sandbox stays until finish_sizing().
                self.unsized.append((rec, box, last_turn))
                kept = True
            else:
                self.count(rec, self.wait_durable(box.sid), last_turn)
            return rec, verdict
        finally:
            if not kept:
                try:
                    box.destroy()
                except CrabdError as e:
                    print(f"destroying {box.sid}: {e}", file=sys.stderr)

    @staticmethod
    def count(rec: RunRecord, cks: list[dict[str, Any]], last_turn: int) -> None:
        """Bytes and capture times of the checkpoints of the trace's turns (not the checks')."""
        for ck in cks:
            if ck["state"] != "committed" or ck["turn"] > last_turn:
                continue
            rec.bytes += ck["bytes"] or 0
            total = (ck.get("durations") or {}).get("total")
            if ck["plan"] != "SKIP" and total is not None:
                rec.ckpt_ms.append(total * 1000)

    def finish_sizing(self, timeout: float = 120) -> None:
        """Wait for the daemon to size the fault-free runs' checkpoints (idle
        work; a rollback cancels it, so faulted runs are not sized), count
        them, destroy those sandboxes."""
        deadline = time.monotonic() + timeout
        for rec, box, last_turn in self.unsized:
            try:
                cks = self.wait_durable(box.sid, sized=True, timeout=max(5.0, deadline - time.monotonic()))
                unsized = [ck["id"] for ck in cks if ck["state"] == "committed" and 0 < ck["turn"] <= last_turn
                           and ck["plan"] != "SKIP" and not ck["bytes"]
                           and "size" not in (ck.get("durations") or {})]
                if unsized:
                    rec.note = f"{len(unsized)} checkpoints not sized in time: {unsized[:5]}"
                self.count(rec, cks, last_turn)
            finally:
                try:
                    box.destroy()
                except CrabdError as e:
                    print(f"destroying {box.sid}: {e}", file=sys.stderr)
        self.unsized = []

    def fault_here(self, t: Trace, fault: str | None, k: int | None, pos: int, r: dict[str, Any],
                   quick: bool) -> bool:
        if fault not in ("boundary", "daemon"):
            return False
        if fault == "daemon" and quick and t.name not in self.k_daemon:
            # quick: the first turn from the middle on that has something to capture
            if pos >= len(t.turns) // 2 and (r["plan"] != "SKIP" or pos == len(t.turns) - 1):
                self.k_daemon[t.name] = pos
                return True
            return False
        if fault == "daemon" and quick:
            return pos == self.k_daemon[t.name]
        return pos == k

    def inject(self, t: Trace, box: Box, fault: str, r: dict[str, Any], pos_of: dict[int, int],
               rec: RunRecord, since_pre: int) -> int:
        """The fault after turn k (its reply is `r`); returns the trace position to go on from."""
        assert self.dh is not None
        pos = pos_of[r["turn"]]
        if fault == "boundary":
            self.wait_durable(box.sid, r["checkpoint"])  # the crash comes in the LLM wait, after the capture
            since = self.last_seq(box.sid)
            tk = time.monotonic()
            self.kill_all(box.sid)
            turn = self.await_rollback(t, box.sid, since)
            rec.rollback_ms = (time.monotonic() - tk) * 1000
            return pos_of.get(turn, pos) if turn is not None else pos
        # daemon: kill -9 crabd while turn k's checkpoint is being captured, restart it
        since = since_pre
        tk = time.monotonic()
        self.dh.kill9()
        self.dh.start()
        rec.rollback_ms = (time.monotonic() - tk) * 1000
        c = self.client()
        ck = c.checkpoint(r["checkpoint"])
        rec.note = f"turn {rec.k}'s {r['plan']} checkpoint was {ck['state']} after the restart"
        rolled = [e for e in c.events(since=since, sandbox=box.sid) if e["kind"] == "sandbox.rolled_back"]
        if rolled:
            turn = int(c.checkpoint(rolled[-1]["data"]["checkpoint"])["turn"])
            return pos_of.get(turn, pos)
        return pos


# -- the runs -----------------------------------------------------------------------------------------------
def plan_runs(traces: list[Trace], faults: list[str], quick: bool) -> list[tuple[Trace, str, int | None]]:
    """(trace, fault, k) of every fault run; k None = chosen online (quick daemon)."""
    out: list[tuple[Trace, str, int | None]] = []
    if quick:
        # one fault per trace in rotation; every fault at least once
        for i in range(max(len(traces), len(faults)) if faults else 0):
            t, f = traces[i % len(traces)], faults[i % len(faults)]
            out.append((t, f, None if f == "daemon" else len(t.turns) // 2 if f == "boundary" else -1))
        return out
    for t in traces:
        n = len(t.turns)
        for f in faults:
            ks = range(1, n + 1) if f == "mid-turn" else range(1, n)
            out += [(t, f, k) for k in ks]
    return out


def longest_middle_turn(ref: RunRecord) -> int:
    n = len(ref.durations)
    lo, hi = n // 3, max(n // 3 + 1, (2 * n) // 3)
    return max(range(lo, hi), key=lambda i: (ref.durations[i], -i)) + 1


def pick_traces(traces: list[Trace], quick: bool) -> list[Trace]:
    if not quick:
        return traces
    named = [t for t in traces if t.name in QUICK_TRACES]
    return named if named else traces[:3]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="at most 3 traces, one fault each in rotation")
    ap.add_argument("--traces", default=str(ROOT / "bench" / "traces"))
    ap.add_argument("--trace", action="append", default=[], help="only these traces (by name; repeatable)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--faults", default=",".join(FAULTS), help="boundary,mid-turn,daemon or none")
    ap.add_argument("--time-scale", type=float, default=0.05, help="multiplier of the traces' LLM waits")
    ap.add_argument("--chain", action="store_true",
                    help="every fault point of every trace, chained: one run per trace, fault and crabd method "
                         "(bench/recovery_chain.py)")
    ap.add_argument("--reps", type=int, default=1,
                    help="rounds of fault-free runs (bare and each daemon method, interleaved); "
                         "the overhead is taken from the per-trace medians")
    ap.add_argument("--scale", default=None, help="run the scale benchmark instead: numbers of concurrent sandboxes")
    ap.add_argument("--scale-trace", default="calc-repair", help="the trace every sandbox runs in --scale")
    ap.add_argument("--inspector", choices=("bpf", "proc"), default="bpf",
                    help="the daemon's turn inspector (proc: no BPF compile at each daemon start; for tests)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON line")
    ap.add_argument("--out", default=None, help="directory for results.json, report.md and PNG plots")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the recovery benchmark needs root (it runs crabd and runc sandboxes)")
    # kill/SIGTERM: unwind like Ctrl-C, so that sandboxes, daemons and mounts go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    faults = [] if a.faults.strip() == "none" else [f.strip() for f in a.faults.split(",") if f.strip()]
    if set(faults) - set(FAULTS):
        raise SystemExit(f"unknown faults {sorted(set(faults) - set(FAULTS))}; known: {', '.join(FAULTS)} or none")
    traces = load_traces(a.traces)
    if a.trace:
        missing = set(a.trace) - {t.name for t in traces}
        if missing:
            raise SystemExit(f"no traces named {sorted(missing)} in {a.traces}")
        traces = [t for t in traces if t.name in a.trace]
    from recovery_report import progress, summarize, write_out
    t_start = time.monotonic()
    b = Bench(a)
    if a.scale:
        from recovery_scale import run_scale
        ns = [int(x) for x in a.scale.split(",") if x.strip()]
        trace = next((t for t in traces if t.name == a.scale_trace), None)
        if trace is None:
            raise SystemExit(f"no trace {a.scale_trace!r} in {a.traces}")
        try:
            b.prepare([trace])
            scale = run_scale(b, trace, ns)
        finally:
            b.close()
        result: dict[str, Any] = {"methods": {}, "scale": scale, "scale_trace": trace.name,
                                  "time_scale": a.time_scale, "seconds": round(time.monotonic() - t_start, 1)}
        write_out(result, a, sys.argv[1:])
        return 0

    traces = pick_traces(traces, a.quick)
    if a.chain:
        result = run_chained(b, traces, methods, faults)
        result["seconds"] = round(time.monotonic() - t_start, 1)
        write_out(result, a, sys.argv[1:])
        return 0 if all(m["end_correct"] == m["runs"] for f in result["chain"].values() for m in f.values()) else 1
    order = [m for m in DAEMON_METHODS if m in methods] + [m for m in methods if m not in DAEMON_METHODS]
    fault_runs = plan_runs(traces, faults, a.quick)
    reps = max(1, a.reps)
    total = reps * len(traces) * (1 + sum(m in DAEMON_METHODS for m in methods)) + len(fault_runs) * len(methods)
    records: list[RunRecord] = []
    refs: dict[str, tuple[RunRecord, Verdict]] = {}
    with progress(total) as bar:
        def step(rec: RunRecord) -> None:
            records.append(rec)
            what = f"{rec.method} {rec.trace}" + (f" {rec.fault}@{rec.k}" if rec.fault else " fault-free")
            bar.advance(what + ("" if rec.correct is None else " ok" if rec.correct else " WRONG"))
        try:
            b.prepare(traces)
            # --reps N: the fault-free runs N times, interleaved (bare, then each
            # daemon method, again and again), so that the host's drift hits
            # every method alike; the fault runs come once, in the last round.
            for rep in range(reps):
                for t in traces:
                    bar.describe(f"reference {t.name}" + (f" (round {rep + 1}/{reps})" if reps > 1 else ""))
                    rec, v = b.run_bare(t, "reference")
                    rec.rep = rep
                    rec.correct = b.correct(t, v, refs[t.name][1] if t.name in refs else v)
                    if not rec.correct:
                        raise SystemExit(f"trace {t.name}: its checks fail even without a fault "
                                         f"(or its state differs between fault-free runs): {v[0]}")
                    refs.setdefault(t.name, (rec, v))
                    step(rec)
                for m in order:
                    last = rep == reps - 1
                    if m not in DAEMON_METHODS and not last:
                        continue
                    if m in DAEMON_METHODS:
                        b.serve_method(m)
                    for t in traces:
                        ref, v = refs[t.name]
                        if m in DAEMON_METHODS:
                            bar.describe(f"{m} {t.name} fault-free")
                            rec, got = b.run_daemon(t, m)
                            rec.rep = rep
                            rec.correct = b.correct(t, got, v)
                            step(rec)
                        for (ft, f, k) in fault_runs if last else []:
                            if ft is not t:
                                continue
                            if k == -1:
                                k = longest_middle_turn(ref)
                            if f == "daemon" and k is None and m not in DAEMON_METHODS:
                                k = b.k_daemon.get(t.name, len(t.turns) // 2)
                            bar.describe(f"{m} {t.name} {f}@{k if k is not None else 'auto'}")
                            if m in DAEMON_METHODS:
                                rec, got = b.run_daemon(t, m, f, k, ref, quick=a.quick and f == "daemon")
                            else:
                                rec, got = b.run_bare(t, m, f, k, ref)
                            rec.correct = b.correct(t, got, v)
                            step(rec)
                    if m in DAEMON_METHODS:
                        bar.describe(f"{m}: waiting for checkpoint sizes")
                        b.finish_sizing()
                        b.stop_daemon()
        finally:
            b.close()
    result = summarize(records, methods, faults, traces, a)
    result["seconds"] = round(time.monotonic() - t_start, 1)
    write_out(result, a, sys.argv[1:])
    return 0


def run_chained(b: Bench, traces: list[Trace], methods: list[str], faults: list[str]) -> dict[str, Any]:
    """--chain: per trace a reference with a digest after every turn, then per
    crabd method and fault one run with the fault at every point."""
    import recovery_chain as chain
    from recovery_report import progress
    dms = [m for m in DAEMON_METHODS if m in methods]
    if not dms or not faults:
        raise SystemExit("--chain runs the crabd methods (crabd, crabd-fs, full) with at least one fault")
    records: list[chain.ChainRecord] = []
    with progress(len(traces) * (1 + len(dms) * len(faults))) as bar:
        try:
            b.prepare(traces)
            refs = {}
            for t in traces:
                bar.describe(f"reference {t.name} (a digest after every turn)")
                refs[t.name] = chain.reference(b, t)
                bar.advance(f"reference {t.name}: {len(t.turns)} turns")
            for m in dms:
                b.serve_method(m)
                for t in traces:
                    for f in faults:
                        bar.describe(f"{m} {t.name} {f} at every turn")
                        rec = chain.run_chain(b, t, m, f, *refs[t.name])
                        records.append(rec)
                        bad = [p.k for p in rec.points if not p.state_ok]
                        bar.advance(f"{m} {t.name} {f}: {len(rec.points)} points, "
                                    f"{len(rec.points) - len(bad)} right" + (f" (wrong at {bad})" if bad else "")
                                    + ("; end ok" if rec.correct else "; END WRONG")
                                    + (f"; {rec.error}" if rec.error else ""))
                b.stop_daemon()
        finally:
            b.close()
    return {"methods": {}, "chain": chain.summarize(records, traces), "traces": [t.name for t in traces],
            "faults": faults, "time_scale": b.a.time_scale, "inspector": b.a.inspector,
            "chain_runs": chain.records_dict(records)}


def record_dict(rec: RunRecord) -> dict[str, Any]:
    d = asdict(rec)
    d["durations"] = [round(x, 4) for x in rec.durations]
    d["seconds"] = round(rec.seconds, 3)
    return d


__all__ = ["Bench", "RunRecord", "record_dict", "pct", "statistics"]

if __name__ == "__main__":
    sys.exit(main())
