#!/usr/bin/env python3
"""make demo: crabd's main job on this host, end to end, on a real agent trace.

One trace from bench/traces (the recovery benchmark's format, README.md
"Traces"; default `dev-server`: a dev server started in the background whose
in-memory counter no file holds) is played three times:

1. fault-free on the bare runtime (no daemon, no checkpoints): the reference.
   Its checks and the digest of its state paths are what a correct recovery
   must reach (the benchmark's rule: bench/recovery_runs.py `Bench.correct`);
2. through a crabd daemon (real BPF inspector, `--capture auto`), turns shown
   live. In the middle of a turn in the second half, every process of the
   sandbox is killed (kill -9, as an OOM kill or crash does: the server too).
   crabd notices, rolls the sandbox back to its newest complete checkpoint on
   its own, files and processes, and the agent retries the interrupted turn
   and finishes the trace;
3. the same crash recovered chat-only, on the bare runtime: a fresh sandbox
   from the image with the task's files and setup, then the interrupted turn
   again and the rest (what a framework that saved only the transcript does).

A short table compares them. Exit 0 only if crabd's run is correct; chat-only
is reported as measured. Sandboxes are deleted and the daemon stopped at the
end, also on an error or Ctrl-C.

    python scripts/demo.py [--json]       # (make demo, as root)

Environment:
    CRABD_DEMO_STATE       state dir (default /var/lib/crabd-demo); the trace's
                           image is imported there from a known cache
                           (bench/inputs.py IMAGE_SOURCES, $CRABD_TEST_STATE_DIR
                           included) or debootstrapped once
    CRABD_DEMO_TRACE       trace file (default bench/traces/dev-server.json)
    CRABD_DEMO_TIME_SCALE  multiplier of the trace's LLM waits (default 0.1)
    CRABD_DEMO_CRASH_TURN  the turn the crash interrupts (default: chosen from
                           the reference run, see crash_turn)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))   # run by path (`make demo`): the checkout's crabd and bench packages

from rich import box  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from crabd.errors import CrabdError  # noqa: E402
from crabd.runtime import Runtime  # noqa: E402
from crabd.testing import DaemonHandle  # noqa: E402
from crabd.traces import STATE_DIGEST, Trace, load_trace  # noqa: E402

from bench import inputs  # noqa: E402  (bench/inputs.py: trace images, PyPI inputs, the task's prelude)
from bench.recovery_runs import DIGEST_SH, Bench, last_seq  # noqa: E402  (the benchmark's digest and correctness rule)

STATE = Path(os.environ.get("CRABD_DEMO_STATE", "/var/lib/crabd-demo"))
TRACE = Path(os.environ.get("CRABD_DEMO_TRACE", str(ROOT / "bench" / "traces" / "dev-server.json")))
con = Console()

Run = Callable[..., dict[str, Any]]   # (cmd, stdin=None) -> exec reply; raises CrabdError


@dataclass
class Outcome:
    """One method's run of the trace, as the final table shows it."""

    method: str
    checks: list[tuple[int, str]] = field(default_factory=list)
    digest: str = ""
    files: dict[str, str] = field(default_factory=dict)   # state path -> content digest (what was lost)
    procs: list[str] = field(default_factory=list)        # processes at the end (besides the init)
    recovered: str = ""
    recovery_ms: float | None = None
    bytes: int | None = None
    correct: bool = False
    checks_pass: bool = False
    seconds: float = 0.0


# A listing of the state paths (path -> sha256 of the file or link target; 'dir'),
# to say which files a wrong recovery lost or changed; the digest stays STATE_DIGEST's.
FILES_PY = r"""
import hashlib, json, os, sys
out = {}
for top in sys.argv[1:]:
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if x not in ('.git', '__pycache__'))
        for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            if os.path.islink(p):
                data = b'link:' + os.readlink(p).encode()
            elif os.path.isfile(p):
                data = open(p, 'rb').read()
            else:
                data = b'other'
            out[p] = hashlib.sha256(data).hexdigest()[:12] + oct(os.lstat(p).st_mode)
print(json.dumps(out))
"""


def short(cmd: str, n: int = 34) -> str:
    one = " ".join(cmd.split())
    return one if len(one) <= n else one[: n - 1] + "…"


# -- the sandbox's processes, seen from the host -------------------------------------------------------
def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(x.decode(errors="replace") for x in raw.split(b"\0") if x)


def processes(rt: Runtime, sid: str) -> list[str]:
    """Command lines of the sandbox's own processes: not its init, nor the
    init's helpers that run each exec (the same binary)."""
    init = rt.get(sid).pid
    helper = cmdline(init).split(" ")[0] if init else ""
    return [c for p in rt.pids(sid) if p != init and (c := cmdline(p)) and not (helper and c.startswith(helper))]


def kill_all(rt: Runtime, sid: str) -> tuple[int, list[str]]:
    """kill -9 every process of the sandbox, as the OOM killer would; how
    many, and the command lines of those killed (`processes`)."""
    # the command lines first: once the init is dead, the kernel kills the rest
    names = processes(rt, sid)
    n = 0
    for pid in rt.pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
            n += 1
        except ProcessLookupError:
            pass
    return n, names


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def crash_mid_turn(rt: Runtime, sid: str, run_turn: Callable[[], dict[str, Any]],
                   ref_s: float) -> tuple[dict[str, Any] | None, tuple[int, list[str]], bool, float]:
    """Run one turn and kill every process of the sandbox while its command runs.

    The kill comes once the turn's command is running in the sandbox (a
    process that was not there before the turn has exec'd something other
    than runc's init), a moment later (10 % of the turn's fault-free time, at
    most 20 ms). Returns (the turn's reply, None if it failed; the command
    lines killed; whether the turn's process was still running at the kill;
    monotonic time of the kill)."""
    before = set(rt.pids(sid))
    got: dict[str, Any] = {}

    def turn() -> None:
        try:
            got["reply"] = run_turn()
        except CrabdError as e:
            got["error"] = e

    th = threading.Thread(target=turn, daemon=True)
    t0 = time.monotonic()
    th.start()
    init = rt.get(sid).pid
    helper = cmdline(init).split(" ")[0] if init else ""
    mine: int | None = None
    while mine is None and th.is_alive() and time.monotonic() - t0 < 120:
        for pid in set(rt.pids(sid)) - before:
            c = cmdline(pid)
            if c and not c.startswith("runc") and not (helper and c.startswith(helper)):
                mine = pid
                break
        else:
            time.sleep(0.001)
    time.sleep(min(0.1 * ref_s, 0.02))
    mid = mine is not None and running(mine)
    killed = kill_all(rt, sid)
    tk = time.monotonic()
    th.join(600)
    if th.is_alive():
        raise SystemExit(f"turn still running 600 s after the sandbox {sid} was killed")
    return got.get("reply"), killed, mid, tk


# -- the agent ----------------------------------------------------------------------------------------
def prelude(t: Trace, run: Run) -> list[dict[str, Any]]:
    """The task's inputs, files and setup (bench/inputs.prelude); the exec replies."""
    replies: list[dict[str, Any]] = []

    def one(cmd: list[str] | str, stdin: str | None) -> dict[str, Any]:
        r = run(cmd, stdin)
        replies.append(r)
        return r

    inputs.prelude(t, one)
    return replies


def verdict(t: Trace, run: Run, out: Outcome, ref: Outcome | None) -> None:
    """Checks and state digest exactly as the benchmark takes them (bench/recovery_runs.py verdict)."""
    for ch in t.check:
        try:
            r = run(ch.run)
            out.checks.append((r["exit_code"], r["stdout"]))
        except CrabdError as e:
            out.checks.append((-1, str(e)))
    r = run(["/bin/sh", "-c", DIGEST_SH, "digest", *t.state_paths], env={"CRABD_DIGEST_PY": STATE_DIGEST})
    out.digest = r["stdout"].strip()
    r = run(["python3", "-c", FILES_PY, *t.state_paths])
    try:
        out.files = json.loads(r["stdout"]) if r["exit_code"] == 0 else {}
    except ValueError:
        out.files = {}
    mine = (out.checks, out.digest)
    out.correct = Bench.correct(t, mine, mine if ref is None else (ref.checks, ref.digest))
    out.checks_pass = Bench.correct(t, (out.checks, ""), ([], ""))


def crash_turn(t: Trace, ref_durations: list[float]) -> int:
    """The turn (1-based) the crash interrupts: CRABD_DEMO_CRASH_TURN, else in
    the second half (not the last turn), among the turns whose fault-free
    command took at least 60 % of the longest there (a kill must find it
    running), the one nearest two thirds into the session."""
    n = len(t.turns)
    env = os.environ.get("CRABD_DEMO_CRASH_TURN")
    if env:
        k = int(env)
        if not 1 <= k <= n:
            raise SystemExit(f"CRABD_DEMO_CRASH_TURN={env}: the trace has turns 1..{n}")
        return k
    cands = list(range(n // 2 + 1, n)) or [n]
    longest = max(ref_durations[k - 1] for k in cands)
    slow = [k for k in cands if ref_durations[k - 1] >= 0.6 * longest]
    return min(slow, key=lambda k: (abs(k - 2 * n / 3), -k))


class Row:
    """One live row per turn: turn, command, exit, plan, checkpoint, ms."""

    HEAD = f"{'turn':>4}  {'command':<34}  {'exit':>4}  {'plan':<7}  {'checkpoint':<17}{'ms':>6}"

    @staticmethod
    def show(turn: int, cmd: str, code: Any, plan: str = "", ck: str = "", ms: float | None = None,
             style: str = "") -> None:
        line = f"{turn:>4}  {short(cmd):<34}  {str(code):>4}  {plan:<7}  {ck:<17}{'' if ms is None else f'{ms:.0f}':>6}"
        con.print(f"[{style}]{line}[/{style}]" if style else line, highlight=False, markup=bool(style))


# -- the demo ------------------------------------------------------------------------------------------
class Demo:
    def __init__(self, t: Trace, time_scale: float) -> None:
        self.t = t
        self.scale = time_scale
        self.rt = Runtime(STATE)
        self.dh: DaemonHandle | None = None
        self.bare: list[str] = []          # bare runtime sandboxes to destroy
        self.k = 0
        self.ref_durations: list[float] = []
        self.rolled_ts = 0.0
        self.ck_note = ""

    def wait(self, i: int) -> None:
        """The agent's LLM wait after turn i (0-based), scaled."""
        time.sleep(self.t.turns[i].llm_wait_ms / 1000 * self.scale)

    # -- image ----------------------------------------------------------------------------------------
    def ensure_image(self) -> None:
        name = self.t.image
        if self.rt.images.exists(name):
            return
        for d in inputs.IMAGE_SOURCES:
            src = d / name
            if src.resolve() == (self.rt.images.root / name).resolve():
                continue
            if (src / "rootfs").is_dir() and (src / "image.json").is_file():
                t0 = time.monotonic()
                with con.status(f"importing image {name} from {src} ..."):
                    self.rt.images.import_path(str(src / "rootfs"), name)
                con.print(f"imported image {name} from {src} in {time.monotonic() - t0:.0f} s")
                return
        if name not in inputs.IMAGES:
            raise SystemExit(f"image {name!r} is in none of {', '.join(map(str, inputs.IMAGE_SOURCES))}, and "
                             f"only {', '.join(inputs.IMAGES)} can be built here; fix: crabd image import PATH "
                             f"--name {name} --state-dir {STATE}")
        t0 = time.monotonic()
        self.rt.images.gc()
        with con.status(f"building image {name} with debootstrap (once per host, 1-3 min) ...") as st:
            self.rt.images.build_debian(name, packages=inputs.IMAGES[name],
                                        progress=lambda line: st.update(f"debootstrap: {line[:70]}"))
        con.print(f"built image {name} in {time.monotonic() - t0:.0f} s")

    # -- bare runtime -------------------------------------------------------------------------------------
    def bare_box(self) -> tuple[str, Run]:
        sid = self.rt.create(self.t.image).id
        self.bare.append(sid)

        def run(cmd: list[str] | str, stdin: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
            return self.rt.exec(sid, cmd, stdin=stdin, env=env, timeout=600).to_dict()
        return sid, run

    def destroy_bare(self, sid: str) -> None:
        self.rt.destroy(sid)
        self.bare.remove(sid)

    def reference(self) -> Outcome:
        out = Outcome("fault-free")
        sid, run = self.bare_box()
        with con.status("fault-free reference on the bare runtime (no crabd): the task's files and setup") as st:
            prelude(self.t, run)
            t0 = time.monotonic()
            for i, turn in enumerate(self.t.turns):
                st.update(f"fault-free reference on the bare runtime (no crabd): turn {i + 1}/{len(self.t.turns)}")
                t1 = time.monotonic()
                run(turn.run)
                self.ref_durations.append(time.monotonic() - t1)
                self.wait(i)
            out.seconds = time.monotonic() - t0
            verdict(self.t, run, out, None)
            out.procs = processes(self.rt, sid)
        self.destroy_bare(sid)
        return out

    def chat_only(self, ref: Outcome) -> Outcome:
        """The same crash, recovered as a framework that kept only the transcript does."""
        out = Outcome("chat-only")
        t, k = self.t, self.k
        sid, run = self.bare_box()
        prelude(t, run)
        con.print(f"sandbox {sid} on the bare runtime: the same session up to turn {k}, then the same crash "
                  f"[dim](turns 1-{k - 1} not shown)[/dim]", highlight=False)
        t0 = time.monotonic()
        for i in range(k - 1):
            run(t.turns[i].run)
            self.wait(i)
        reply, killed, mid, tk = crash_mid_turn(self.rt, sid, lambda: run(t.turns[k - 1].run),
                                                self.ref_durations[k - 1])
        Row.show(k, t.turns[k - 1].run, "kill" if reply is None else reply["exit_code"], style="red")
        con.print(f"[red bold]crash[/red bold] in turn {k}: kill -9 of all {killed[0]} processes in {sid}, "
                  f"these among them: {'; '.join(short(x, 30) for x in killed[1])}"
                  + ("" if mid else " [dim](the command had just ended)[/dim]"), highlight=False)
        self.destroy_bare(sid)
        sid, run = self.bare_box()
        prelude(t, run)
        out.recovery_ms = (time.monotonic() - tk) * 1000
        out.recovered = "task files only"
        out.bytes = 0
        con.print(f"chat-only: fresh sandbox {sid} from the image + the task's files and setup in "
                  f"{out.recovery_ms:.0f} ms; the agent retries turn {k}", highlight=False)
        con.print(Row.HEAD, style="bold", highlight=False)
        for i in range(k - 1, len(t.turns)):
            t1 = time.monotonic()
            r = run(t.turns[i].run)
            Row.show(i + 1, t.turns[i].run, r["exit_code"], ms=(time.monotonic() - t1) * 1000,
                     style="" if r["exit_code"] == 0 else "yellow")
            self.wait(i)
        out.seconds = time.monotonic() - t0
        out.procs = processes(self.rt, sid)
        verdict(t, run, out, ref)
        self.destroy_bare(sid)
        return out

    # -- through crabd --------------------------------------------------------------------------------------
    @staticmethod
    def check_no_daemon() -> None:
        """A daemon left on the demo's state (a demo killed with -9) would own its sandboxes."""
        probe = DaemonHandle(STATE)
        try:
            probe.client().health()
        except CrabdError:
            return
        raise SystemExit(f"a crabd daemon already serves {STATE} ({probe.socket}); fix: stop it "
                         f"(or set CRABD_DEMO_STATE to another directory)")

    def start_daemon(self) -> None:
        self.check_no_daemon()
        t0 = time.monotonic()
        with con.status("starting crabd (loads the eBPF inspector) ..."):
            self.dh = DaemonHandle(STATE, args=["--capture", "auto"])
            try:
                self.dh.start()
            except AssertionError as e:
                raise SystemExit(f"crabd serve did not start: {e}") from None
        h = self.dh.client().health()
        con.print(f"crabd is up in {time.monotonic() - t0:.1f} s: file-system snapshots on [bold]{h['fs_driver']}"
                  f"[/bold], turn inspector [bold]{h['inspector']}[/bold], capture auto", highlight=False)


    def await_rollback(self, sid: str, since: int, timeout: float = 180) -> tuple[dict[str, Any], int, float | None]:
        """The checkpoint crabd rolled the sandbox back to (its row), the
        sandbox's new branch, and the wall time crabd noticed the death at."""
        assert self.dh is not None
        c = self.dh.client()
        died: float | None = None
        deadline = time.monotonic() + timeout
        while True:
            for e in c.events(since=since, sandbox=sid):
                since = e["seq"]
                if e["kind"] == "sandbox.died" and died is None:
                    died = float(e["ts"])
                if e["kind"] == "sandbox.rolled_back":
                    self.rolled_ts = float(e["ts"])
                    return c.checkpoint(e["data"]["checkpoint"]), int(e["data"]["branch"]), died
                if e["kind"] == "sandbox.recovery_failed":
                    raise SystemExit(f"crabd could not recover {sid}: {e['data'].get('error')} "
                                     f"(daemon log: {self.dh.log})")
            if time.monotonic() > deadline:
                raise SystemExit(f"crabd did not roll {sid} back within {timeout:.0f} s (daemon log: {self.dh.log})")
            time.sleep(0.01)

    def checkpoint_bytes(self, sid: str, last_turn: int, timeout: float = 60) -> tuple[int, int, int]:
        """(bytes, checkpoints, unsized): what crabd wrote for the sandbox's
        committed checkpoints of the task and the trace's turns (not those of
        the checks after it, as the benchmark counts), once its idle sizing
        got to them (a rollback queues again the sizing it cancelled); after
        `timeout`, those still unsized are counted as such."""
        assert self.dh is not None
        c = self.dh.client()
        deadline = time.monotonic() + timeout
        while True:
            cks = [x for x in c.checkpoints(sid, all=True) if x["turn"] <= last_turn]
            unsized = [x for x in cks if x["state"] == "committed" and x["seq"] > 0 and x["plan"] != "SKIP"
                       and not x["bytes"] and "size" not in (x.get("durations") or {})]
            waiting = [x for x in cks if x["state"] == "pending"] + unsized
            if not waiting or time.monotonic() > deadline:
                done = [x for x in cks if x["state"] == "committed"]
                return sum(x["bytes"] or 0 for x in done), len(done), len(unsized)
            time.sleep(0.1)

    def origin(self, ck: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint whose capture a SKIP checkpoint shares (itself if not SKIP)."""
        assert self.dh is not None
        c = self.dh.client()
        while ck["plan"] == "SKIP" and ck.get("parent"):
            ck = c.checkpoint(ck["parent"])
        return ck

    def crabd(self, ref: Outcome) -> Outcome:
        assert self.dh is not None
        out = Outcome("crabd")
        t, k = self.t, self.k
        c = self.dh.client()
        sid = c.create_sandbox(t.image, name=f"demo-{os.getpid()}")["id"]

        def run(cmd: list[str] | str, stdin: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
            assert self.dh is not None
            return self.dh.client().exec(sid, cmd, timeout=600, stdin=stdin, env=env)

        pos_of = {0: 0}   # the daemon's turn number -> trace turns done after it
        for r in prelude(t, run):
            pos_of[r["turn"]] = 0
        con.print(f"sandbox [bold]{sid}[/bold]: the task's files and setup written; the agent starts\n",
                  highlight=False)
        con.print(Row.HEAD, style="bold", highlight=False)
        pos, crashed, branch, last_turn = 0, False, 0, 0
        t0 = time.monotonic()
        while pos < len(t.turns):
            if pos == k - 1 and not crashed:
                crashed = True
                since = last_seq(self.dh.client(), sid)
                reply, killed, mid, tk = crash_mid_turn(self.rt, sid, lambda: run(t.turns[k - 1].run),
                                                        self.ref_durations[k - 1])
                if reply is not None:
                    pos_of[reply["turn"]] = k
                    last_turn = reply["turn"]
                Row.show(k, t.turns[k - 1].run, "kill" if reply is None else reply["exit_code"],
                         style="red")
                con.print(f"\n[red bold]crash[/red bold] in turn {k}: kill -9 of all {killed[0]} processes in "
                          f"{sid}, these among them: {'; '.join(short(x, 30) for x in killed[1])}"
                          + ("" if mid else " [dim](the command had just ended)[/dim]"), highlight=False)
                kill_wall = time.time() - (time.monotonic() - tk)
                ck, branch, died = self.await_rollback(sid, since)
                out.recovery_ms = (time.monotonic() - tk) * 1000
                phases = ("" if died is None else
                          f": noticed the death after {max(0.0, died - kill_wall) * 1000:.0f} ms, rolled back "
                          f"{max(0.0, self.rolled_ts - died) * 1000:.0f} ms later")
                back = pos_of.get(ck["turn"], k - 1)
                procs = processes(self.rt, sid)
                n_procs = f"{len(procs)} process{'es' if len(procs) != 1 else ''}"
                out.recovered = f"files + {n_procs}" if ck.get("proc_image") else "files (fresh init)"
                src = self.origin(ck)
                how = ("files + process image" if ck.get("proc_image") else "files only, a fresh init")
                if src["id"] != ck["id"]:
                    how = (f"SKIP: the state of turn {pos_of.get(src['turn'], '?')}'s {src['plan']} "
                           f"checkpoint, {how}")
                else:
                    how = f"{ck['plan']}: {how}"
                con.print(f"[green bold]crabd rolled it back on its own[/green bold] in {out.recovery_ms:.0f} ms "
                          f"from the kill{phases}; to checkpoint {ck['id']}, taken after turn {back} ({how})",
                          highlight=False)
                if procs:
                    con.print(f"  running again with their memory: {'; '.join(short(p, 40) for p in procs)}",
                              highlight=False)
                con.print(f"  the agent {'retries' if back < k else 'goes on after'} turn {k}\n", highlight=False)
                con.print(Row.HEAD, style="bold", highlight=False)
                pos = back
                continue
            r = run(t.turns[pos].run)
            pos_of[r["turn"]] = pos + 1
            last_turn = r["turn"]
            Row.show(pos + 1, t.turns[pos].run, r["exit_code"], r["plan"], r["checkpoint"], r["duration"] * 1000,
                     style="" if r["exit_code"] == 0 else "yellow")
            pos += 1
            self.wait(pos - 1)
        out.seconds = time.monotonic() - t0
        out.procs = processes(self.rt, sid)
        verdict(t, run, out, ref)
        with con.status("waiting for crabd to size its checkpoints (idle work) ..."):
            out.bytes, n, unsized = self.checkpoint_bytes(sid, last_turn)
        self.ck_note = (f"crabd: {out.bytes / 2**20:.1f} MiB in {n} checkpoints (file-system snapshots and CRIU "
                        f"images)" + (f"; {unsized} not sized within 60 s (not counted)" if unsized else ""))
        c.delete_sandbox(sid)
        return out

    def stop_daemon(self) -> None:
        if self.dh is not None:
            self.dh.shutdown()
            self.dh = None

    def cleanup(self) -> None:
        for sid in list(self.bare):
            try:
                self.destroy_bare(sid)
            except Exception as e:  # noqa: BLE001 (cleanup goes on; says what is left)
                con.print(f"[red]destroying {sid}: {e}[/red]")
        self.stop_daemon()


def lost(t: Trace, got: Outcome, ref: Outcome) -> list[str]:
    """What a run lacks against the fault-free one: processes, files, failed checks."""
    out = []
    missing = [p for p in ref.procs if p not in got.procs]
    if missing:
        out.append(f"processes: {'; '.join(short(p, 40) for p in missing)}")
    gone = sorted(set(ref.files) - set(got.files))
    changed = sorted(p for p in ref.files if p in got.files and got.files[p] != ref.files[p])
    extra = sorted(set(got.files) - set(ref.files))
    if gone:
        out.append(f"files missing: {', '.join(gone)}")
    if changed:
        out.append(f"files with other contents: {', '.join(changed)}")
    if extra:
        out.append(f"files the fault-free run does not have: {', '.join(extra)}")
    for ch, (code, stdout) in zip(t.check, got.checks):
        if code != ch.expect_exit or (ch.expect_stdout is not None and stdout != ch.expect_stdout):
            want = f"exit {ch.expect_exit}" + (f", {ch.expect_stdout!r}" if ch.expect_stdout is not None else "")
            out.append(f"check `{short(ch.run, 40)}`: wanted {want}, got exit {code}, {short(repr(stdout), 40)}")
    return out


def table(rows: list[Outcome], ref: Outcome) -> Table:
    tb = Table(title="after the crash", header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("method", "recovered state", "checks\npass", "digest =\nfault-free", "recovery\ntime",
                "bytes\nwritten"):
        tb.add_column(col)

    def yes(b: bool) -> str:
        return "[green]yes[/green]" if b else "[red]no[/red]"

    for o in rows:
        size = "?" if o.bytes is None else "0" if o.bytes == 0 else f"{o.bytes / 2**20:.1f} MiB"
        tb.add_row(o.method, o.recovered, yes(o.checks_pass), yes(o.digest == ref.digest),
                   "-" if o.recovery_ms is None else f"{o.recovery_ms:.0f} ms", size)
    return tb


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line on stdout "
                                                        "(the narrative goes to stderr)")
    a = ap.parse_args()
    global con
    if a.json:
        con = Console(stderr=True)
    if os.geteuid() != 0:
        raise SystemExit("the demo needs root (it runs crabd, runc sandboxes, CRIU and BPF): run `make demo` as root")
    try:
        scale = float(os.environ.get("CRABD_DEMO_TIME_SCALE", "0.1"))
    except ValueError:
        raise SystemExit("CRABD_DEMO_TIME_SCALE must be a number (a multiplier of the LLM waits, e.g. 0.1)") from None
    try:
        t = load_trace(TRACE)
    except CrabdError as e:
        raise SystemExit(f"CRABD_DEMO_TRACE: {e}") from None
    if not t.state_paths or not t.check:
        raise SystemExit(f"trace {TRACE}: the demo needs `check` and `state_paths` (what a correct recovery reaches)")
    STATE.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    con.rule("[bold]crabd demo: an agent session crashes mid-turn")
    con.print(f"trace [bold]{t.name}[/bold] ({TRACE}): {len(t.turns)} turns, image {t.image}, "
              f"LLM waits x{scale:g}\n[dim]{t.description}[/dim]", highlight=False)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    d = Demo(t, scale)
    result: dict[str, Any] = {}
    try:
        d.check_no_daemon()
        d.ensure_image()
        inputs.fetch(t.inputs)
        con.rule("1/3 fault-free reference (bare runtime, no crabd)", style="dim")
        ref = d.reference()
        if not ref.correct:
            raise SystemExit(f"trace {t.name}: its checks fail even without a crash: {ref.checks}")
        d.k = crash_turn(t, d.ref_durations)
        con.print(f"{len(t.turns)} turns in {ref.seconds:.1f} s; checks pass; state digest {ref.digest[:16]}; "
                  f"processes at the end: {'; '.join(short(p, 40) for p in ref.procs) or 'none'}", highlight=False)
        con.print(f"the crash will come in the middle of turn {d.k}: `{short(t.turns[d.k - 1].run, 50)}`",
                  highlight=False)

        con.rule("2/3 the agent through crabd", style="dim")
        d.start_daemon()
        got = d.crabd(ref)
        ck_note = d.ck_note
        d.stop_daemon()
        con.print(f"checks {'pass' if got.checks_pass else 'FAIL'}; state digest "
                  f"{'matches' if got.digest == ref.digest else 'DIFFERS from'} the fault-free run; "
                  f"crabd stopped, its sandbox deleted", highlight=False)

        con.rule("3/3 the same crash, chat-only (bare runtime)", style="dim")
        chat = d.chat_only(ref)

        con.print()
        con.print(table([got, chat], ref))
        con.print(f"{ck_note}; chat-only keeps only the transcript. Recovery time: from the kill until the "
                  f"sandbox runs again (crabd: its death noticed, the rollback; chat-only: a fresh sandbox and "
                  f"the task's files, its agent told at once)", highlight=False)
        chat_lost = lost(t, chat, ref)
        crabd_lost = lost(t, got, ref)
        if chat_lost:
            con.print("[bold]chat-only lost[/bold] against the fault-free run:")
            for x in chat_lost:
                con.print(f"  - {x}", highlight=False)
        else:
            con.print("chat-only reached the fault-free end state on this trace (nothing it needed was lost)")
        if crabd_lost:
            con.print("[red bold]crabd's run differs from the fault-free run:[/red bold]")
            for x in crabd_lost:
                con.print(f"  - {x}", highlight=False)
        result = {"trace": t.name, "crash_turn": d.k, "time_scale": scale,
                  "reference": {"digest": ref.digest, "seconds": round(ref.seconds, 2), "processes": ref.procs},
                  "methods": {o.method: {"correct": o.correct, "checks_pass": o.checks_pass,
                                         "digest_matches": o.digest == ref.digest, "recovered": o.recovered,
                                         "recovery_ms": None if o.recovery_ms is None else round(o.recovery_ms, 1),
                                         "bytes": o.bytes, "processes": o.procs,
                                         "lost": lost(t, o, ref)} for o in (got, chat)}}
        ok = got.correct
    except KeyboardInterrupt:
        con.print("[red]interrupted[/red]")
        ok = False
    finally:
        d.cleanup()
        con.print(f"[dim]cleaned up: sandboxes deleted, daemon stopped "
                  f"({time.monotonic() - t_start:.0f} s in all)[/dim]")
    if a.json and result:
        result["seconds"] = round(time.monotonic() - t_start, 1)
        print(json.dumps(result), flush=True)
    if ok:
        con.print("[green bold]crabd recovered the session correctly[/green bold]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
