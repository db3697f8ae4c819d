"""The recovery benchmark's runs: one trace on a bare sandbox or through a
crabd daemon, with a fault injected and the method's recovery checked
(`Bench`), and the record of each run (`RunRecord`).

Size: the one harness every recovery mode shares (five methods, three
faults, their checks); splitting it by method would repeat the trace driver.

bench/recovery.py is the command (options, the order of the runs);
recovery_chain.py, recovery_scale.py and recovery_report.py build on this
module and never import the command, so the modules form no cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench import inputs  # (bench/inputs.py: trace images and PyPI inputs)
from crabd.errors import CrabdError
from crabd.runtime import Runtime
from crabd.testing import CRABD, DaemonHandle, cleanup_state_dir
from crabd.traces import STATE_DIGEST, Trace

ROOT = Path(__file__).resolve().parent.parent

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

_TAR_TYPES = {"file": b"0", "dir": b"5", "symlink": b"2", "fifo": b"6", "char": b"3", "block": b"4"}


def tar_bytes(changes: list[dict[str, Any]]) -> int:
    """The size of the PAX tar, as Python's tarfile writes it, of what a
    checkpoint diff against the image names (`changes`: kind, path, type,
    size, as `GET /v1/checkpoints/{a}/diff/{b}` gives them): one member per
    entry still there (sockets have nothing to copy), file data padded to
    512 bytes, deletions listed in a member `.crabd-deleted`, the end blocks
    and the padding to tar's 10 KiB record. This is the tar `full` wrote at
    every turn before it became the fair baseline (`write_full_copy`,
    stat mtimes as floats: a PAX header per member), computed from the
    format's sizes instead of written. Pure."""
    import base64
    import tarfile
    total = 0
    deleted: list[bytes] = []
    for ch in changes:
        path = base64.b64decode(ch["path_b64"]) if "path_b64" in ch else ch["path"].encode()
        if ch["kind"] == "deleted":
            deleted.append(path)
            continue
        if ch["type"] not in _TAR_TYPES:
            continue
        ti = tarfile.TarInfo(path.decode("utf-8", "surrogateescape"))
        ti.type = _TAR_TYPES[ch["type"]]
        ti.mtime = 1.5   # a float, as a stat gives it
        if ch["type"] == "file":
            ti.size = ch["size"]
            total += -(-ch["size"] // 512) * 512
        elif ch["type"] == "symlink":
            ti.linkname = "x" * ch["size"]   # a symlink's size is its target's length
        total += len(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
    if deleted:
        body = b"\n".join(deleted) + b"\n"
        ti = tarfile.TarInfo(".crabd-deleted")
        ti.size = len(body)
        total += len(ti.tobuf(tarfile.PAX_FORMAT)) + -(-len(body) // 512) * 512
    total += 2 * 512   # the end-of-archive blocks
    return -(-total // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


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
    inspector: str = ""              # the inspector the daemon used (its health), "" on a bare runtime
    bytes_naive_raw: int = 0         # full: raw CRIU images + a tar of the files changed vs the image
    bytes_by_plan: dict[str, int] = field(default_factory=dict)
    # daemon fault: the state after the restart, after a rollback to the
    # recovery target and after one to an older checkpoint, against the
    # per-turn reference: {"what", "checkpoint", "turn", "pos", "ok", "error"}
    rollback_checks: list[dict[str, Any]] = field(default_factory=list)


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
        self.step_digests: dict[str, list[str]] = {}   # trace -> reference digest after setup (0) and each turn
        self.inspector_used = ""   # the running daemon's inspector, from its health
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
        self.inspector_used = self.used_inspector()

    def used_inspector(self) -> str:
        """The inspector the running daemon really uses, from its health:
        `bpf-cgroup`, `bpf-pids`, or `proc` -- the /proc fallback, also when
        BPF was asked for and could not be loaded (a silent fallback would
        otherwise be measured as if it were the BPF inspector)."""
        try:
            return str(self.client().health().get("inspector") or "unknown")
        except CrabdError as e:
            return f"unknown ({e})"

    def fresh_image_store(self) -> None:
        """Empty the process-image store between daemon methods (no daemon
        runs; the previous one deleted its sandboxes, so no manifest names a
        chunk): each method's dumps de-duplicate against its own images only,
        never against chunks another method left."""
        from deltacr import ImageStore
        if (self.state / "cr").is_dir():
            ImageStore(self.state / "cr").gc(grace=0)

    def serve_method(self, method: str) -> None:
        self.stop_daemon()
        self.fresh_image_store()
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
        rec = RunRecord(t.name, method, fault, k, inspector=self.inspector_used)
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
            rec.bytes_by_plan[ck["plan"]] = rec.bytes_by_plan.get(ck["plan"], 0) + (ck["bytes"] or 0)
            total = (ck.get("durations") or {}).get("total")
            if ck["plan"] != "SKIP" and total is not None:
                rec.ckpt_ms.append(total * 1000)

    def finish_sizing(self, timeout: float = 1800) -> None:
        """Wait for the daemon to size the fault-free runs' checkpoints (idle
        work; a rollback cancels it, so faulted runs are not sized), count
        them, destroy those sandboxes. The wait is long on purpose: sizing
        runs at the lowest CPU priority, and `full` has a snapshot to size at
        every turn; a baseline counted in part spoils the ratio against it (a
        run that still times out says so in its note)."""
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
                if rec.method == "full":
                    self.count_naive(rec, box.sid, cks, last_turn)
            finally:
                try:
                    box.destroy()
                except CrabdError as e:
                    print(f"destroying {box.sid}: {e}", file=sys.stderr)
        self.unsized = []

    def count_naive(self, rec: RunRecord, sid: str, cks: list[dict[str, Any]], last_turn: int) -> None:
        """`full`'s naive raw figure (module doc, "Bytes"): per counted
        checkpoint, its CRIU image's raw bytes (the image store's manifest)
        plus the tar of its files that differ from the image (`tar_bytes` of
        the daemon's diff against the sandbox's initial checkpoint). After
        the run, untimed."""
        from deltacr import ImageStore
        store = ImageStore(self.state / "cr")
        c = self.client()
        for ck in cks:
            if ck["state"] != "committed" or ck["turn"] > last_turn or ck["seq"] == 0:
                continue
            if ck.get("proc_image") == ck["id"]:
                rec.bytes_naive_raw += store.manifest(ck["id"]).raw_bytes
            if ck.get("fs_snapshot") == ck["id"]:
                d = c.diff(f"{sid}-0", ck["id"], limit=1_000_000)
                if d["truncated"]:
                    rec.note += f"; {ck['id']}: diff truncated at {len(d['changes'])} of {d['total']} changes"
                rec.bytes_naive_raw += tar_bytes(d["changes"])

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
        used = self.used_inspector()
        if used != self.inspector_used:
            rec.inspector = f"{self.inspector_used}, then {used}"   # the restart changed it
            self.inspector_used = used
        ck = c.checkpoint(r["checkpoint"])
        rec.note = f"turn {rec.k}'s {r['plan']} checkpoint was {ck['state']} after the restart"
        rolled = [e for e in c.events(since=since, sandbox=box.sid) if e["kind"] == "sandbox.rolled_back"]
        if rolled:
            turn = int(c.checkpoint(rolled[-1]["data"]["checkpoint"])["turn"])
            pos = pos_of.get(turn, pos)
        return self.check_rollbacks(t, box, pos, pos_of, rec)

    def check_rollbacks(self, t: Trace, box: Box, pos: int, pos_of: dict[int, int], rec: RunRecord) -> int:
        """After a daemon restart: the live sandbox's state, then a rollback
        to the recovery target (no checkpoint named: what automatic recovery
        picks) and one to an older checkpoint (the newest one before the
        target's turn), each against the per-turn reference digests
        (`rec.rollback_checks`). A restart must leave every checkpoint a
        rollback can reach whole, not only the running sandbox. Returns the
        trace position the agent goes on from: the older checkpoint's."""
        digests = self.step_digests.get(t.name)
        if digests is None:
            rec.note += "; no per-turn reference: the rollbacks after the restart were not checked"
            return pos
        c = self.client()
        self.check_state(t, box, "live after the restart", None, pos, pos_of, digests, rec)
        limit = pos
        try:
            target = c.rollback(box.sid)
        except CrabdError as e:
            rec.rollback_checks.append({"what": "recovery target", "checkpoint": None, "turn": None, "pos": None,
                                        "ok": False, "error": f"rollback failed: {e}"})
        else:
            tpos = pos_of.get(int(target["turn"]))
            self.check_state(t, box, "recovery target", target["checkpoint"], tpos, pos_of, digests, rec,
                             turn=int(target["turn"]))
            limit = tpos if tpos is not None else pos
        # (not seq 0: the image before the task's setup, which no trace position is)
        older = [x for x in c.checkpoints(box.sid, all=True)
                 if x["state"] == "committed" and x["seq"] > 0 and x["turn"] in pos_of and pos_of[x["turn"]] < limit]
        if not older:
            rec.note += f"; no checkpoint older than position {limit} to roll back to"
            return limit
        o = max(older, key=lambda x: x["seq"])
        try:
            c.rollback(box.sid, o["id"])
        except CrabdError as e:
            rec.rollback_checks.append({"what": "older checkpoint", "checkpoint": o["id"], "turn": o["turn"],
                                        "pos": pos_of[o["turn"]], "ok": False, "error": f"rollback failed: {e}"})
            raise RuntimeError(f"{t.name}: rollback of {box.sid} to {o['id']} after the restart failed: {e}") from e
        self.check_state(t, box, "older checkpoint", o["id"], pos_of[o["turn"]], pos_of, digests, rec,
                         turn=o["turn"])
        return pos_of[o["turn"]]

    def check_state(self, t: Trace, box: Box, what: str, cid: str | None, pos: int | None, pos_of: dict[int, int],
                    digests: list[str], rec: RunRecord, turn: int | None = None) -> None:
        """One entry of `rec.rollback_checks`: the state digest now against
        the reference's after `pos` trace turns. The digest is an exec, so a
        turn of its own: it is mapped to `pos` (the agent goes on from there)."""
        entry: dict[str, Any] = {"what": what, "checkpoint": cid, "turn": turn, "pos": pos, "ok": False,
                                 "error": ""}
        rec.rollback_checks.append(entry)
        try:
            r = box.run(["/bin/sh", "-c", DIGEST_SH, "digest", *t.state_paths], env={"CRABD_DIGEST_PY": DIGEST_PY})
        except CrabdError as e:
            entry["error"] = f"the digest exec failed: {e}"
            return
        if pos is not None:
            pos_of[r["turn"]] = pos
        if r["exit_code"] != 0:
            entry["error"] = f"the digest exec exited {r['exit_code']}: {r.get('stderr', '')[-300:]}"
        elif pos is None:
            entry["error"] = f"checkpoint {cid} is of turn {turn}, which is none of the trace's"
        elif r["stdout"].strip() != digests[pos]:
            entry["error"] = f"state differs from the reference after {pos} turns"
        else:
            entry["ok"] = True


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


def record_dict(rec: RunRecord) -> dict[str, Any]:
    d = asdict(rec)
    d["durations"] = [round(x, 4) for x in rec.durations]
    d["seconds"] = round(rec.seconds, 3)
    return d


__all__ = ["Bench", "Box", "RunRecord", "record_dict", "tar_bytes"]
