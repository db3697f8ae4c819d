"""Dump and restore through runc, which drives CRIU.

The one seam where deltacr runs commands is `CommandRunner`; unit tests
inject `deltacr.testing.FakeCommandRunner`. CRIU's version and features are
checked once per (binary, feature set) and cached. A failed dump or restore
raises `CriuFailed` with the `Error` lines of CRIU's own log; the log stays
in the work directory (the image store keeps it next to the image).

Why a runner of our own and not `subprocess.run`: a restored sandbox init
inherits `runc restore`'s stdout/stderr when its dumped ones were pipes, so
the pipe never reaches end of file; we read until runc itself exits.

A dump or restore that stops making progress is killed, CRIU with it:
runc runs in a session of its own, and CRIU (runc's child) is in it; killing
only runc would leave CRIU running -- still holding the sandbox's tasks
under ptrace, and putting the freezer back to the state it found once it
wakes up. "Progress" is CRIU's log or image growing (runc runs CRIU at log
level 4, which logs every step), or work done by CRIU and what it forks (the
restored tasks): CPU time and bytes read or written, from /proc, or one of
them runnable (waiting for a CPU on a loaded host is not a hang). A restore
writes no image and can go quiet in its log for seconds while it maps and
reads a big image, so bytes alone made a slow restore on a starved host look
hung (zdtm maps04 at load 20). `stall` seconds (10 by default) without any
of these means CRIU waits on something that will not come, e.g. the
kernel's PTRACE_SEIZE of a stopped task in a frozen cgroup (blocked: no CPU,
no I/O). The whole-command `timeout` (120 s) stays as the outer bound.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from .errors import CommandFailed, CriuFailed, CriuUnavailable
from .netns import loopback_up
from .options import DumpOptions, RestoreOptions, checkpoint_argv, config_lines, required_features, restore_argv

__all__ = ["Result", "CommandRunner", "SubprocessCommandRunner", "CriuInfo", "check_criu", "criu_errors",
           "skipped_in_flight", "Runc", "MIN_CRIU_VERSION", "kill_session", "StallGuard", "tree_activity"]

MIN_CRIU_VERSION = (3, 17)  # leave-stopped through a config file, cgroup v1 freezer handling
# Logged on every CRIU run on these hosts (setrlimit is refused) and never the cause.
_NOISE = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE")
_ERROR = re.compile(r"\bError \(")
# CRIU 4.x, sk-inet.c, at info level (runc's log level 4 has it), once per
# listening socket whose accept queue was left out (--skip-in-flight).
_SKIPPED_IN_FLIGHT = re.compile(r"Skipping in-flight connection \(l\) for ([0-9a-f]+)")


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int | None   # None: killed (see `killed`)
    output: bytes            # stdout and stderr, interleaved
    duration: float
    killed: str = ""         # why it was killed: "timeout" or "stalled"


class CommandRunner(Protocol):
    def run(self, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
            progress: Callable[[], int] | None = None, stall: float | None = None) -> Result: ...


class SubprocessCommandRunner:
    """Runs a command with stdin on /dev/null and its output on one pipe; done
    when the command exits (not when the pipe closes, see module doc)."""

    MAX_OUTPUT = 1 << 20
    PROGRESS_EVERY = 0.5  # seconds between two `progress()` readings

    def run(self, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
            progress: Callable[[], int] | None = None, stall: float | None = None) -> Result:
        """`env`: variables added to this process's environment. With
        `progress` (a number that grows while the command gets on, e.g. the
        bytes of its log) and `stall`: killed once the number has not changed
        for `stall` seconds. Killed means the command's whole session."""
        start = time.monotonic()
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env={**os.environ, **env} if env else None, start_new_session=True)
        except FileNotFoundError as e:
            raise CommandFailed(argv, 127, str(e), context=f"running {argv[0]}") from e
        assert p.stdout is not None
        fd = p.stdout.fileno()
        os.set_blocking(fd, False)
        out = bytearray()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        killed = ""
        open_ = True
        guard = StallGuard(stall, start) if progress is not None and stall is not None else None
        checked_at = start
        try:
            while True:
                exited = p.poll() is not None
                now = time.monotonic()
                if not exited and guard is not None and progress is not None and now - checked_at >= self.PROGRESS_EVERY:
                    checked_at = now
                    work, runnable = tree_activity(p.pid)
                    if guard.stalled((progress(), work), runnable, now):
                        killed = "stalled"
                if not exited and not killed and now - start > timeout:
                    killed = "timeout"
                if killed:
                    kill_session(p.pid)
                    p.wait()
                    break
                if open_:
                    events = sel.select(timeout=0 if exited else 0.002)
                    if events:
                        try:
                            chunk = os.read(fd, 65536)
                        except BlockingIOError:
                            chunk = None
                        if chunk == b"":
                            open_ = False
                            sel.unregister(fd)
                        elif chunk:
                            if len(out) < self.MAX_OUTPUT:
                                out += chunk[: self.MAX_OUTPUT - len(out)]
                            continue
                if exited:
                    break
                if not open_:
                    time.sleep(0.001)
        finally:
            sel.close()
            p.stdout.close()
        rc = p.wait()
        return Result(list(argv), None if killed else rc, bytes(out), time.monotonic() - start, killed)


class StallGuard:
    """When a command has made no progress for `stall` seconds. Pure: the
    caller passes the readings and the clock.

    A reading is anything comparable (the log's bytes, the CPU time and I/O
    of CRIU's tree): progress is a reading that differs from the last one,
    or a task that is runnable (on a loaded host it waits for a CPU, it is
    not hung)."""

    def __init__(self, stall: float, now: float) -> None:
        self.stall = stall
        self._seen: object = None
        self._seen_at = now

    def stalled(self, reading: object, runnable: bool, now: float) -> bool:
        if runnable or reading != self._seen:
            self._seen, self._seen_at = reading, now
            return False
        return now - self._seen_at > self.stall


def _proc_stat(pid: int) -> tuple[str, str, int, int] | None:
    """(comm, state, ppid, utime + stime in ticks) of `pid`, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    comm = data[data.index(b"(") + 1:data.rindex(b")")].decode(errors="replace")
    fields = data[data.rindex(b")") + 2:].split()
    return comm, fields[0].decode(), int(fields[1]), int(fields[11]) + int(fields[12])


def _proc_io(pid: int) -> int:
    """Bytes `pid` has read and written (rchar + wchar), 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            return sum(int(ln.split()[1]) for ln in f if ln.startswith((b"rchar:", b"wchar:")))
    except (OSError, ValueError, IndexError):
        return 0


def tree_activity(root: int) -> tuple[int, bool]:
    """(CPU ticks + bytes read and written, any of them runnable) summed
    over the descendants of `root` (runc: CRIU, and the tasks a restore
    forks). `root` itself and other runc processes are left out: Go's
    runtime wakes up now and then while runc only waits, which would make
    a hung CRIU look busy."""
    stats: dict[int, tuple[str, str, int, int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _proc_stat(int(d))) is not None:
            stats[int(d)] = st
    children: dict[int, list[int]] = {}
    for pid, (_, _, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    work, runnable = 0, False
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, ())
        comm, state, _, ticks = stats[pid]
        if comm.startswith("runc") or state in ("Z", "X"):
            continue
        work += ticks + _proc_io(pid)
        runnable = runnable or state == "R"
    return work, runnable


def _session_members(sid: int) -> list[int]:
    """Pids whose session or process group is `sid` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2:].split()
        # fields[0] is the state, [2] the process group, [3] the session
        if fields[0] not in (b"Z", b"X") and sid in (int(fields[2]), int(fields[3])):
            out.append(int(d))
    return out


def kill_session(sid: int, wait: float = 5.0) -> list[int]:
    """SIGKILL every process of session `sid` (a command started with
    start_new_session, and CRIU under it) until none is left or `wait`
    seconds pass; reap those that are our children (crabd is a child
    subreaper: a CRIU whose runc died is re-parented to it). Returns the
    pids still alive (none, normally)."""
    deadline = time.monotonic() + wait
    while True:
        pids = _session_members(sid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            if pid == sid:
                continue  # the command itself: its Popen waits for it
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.01)


@dataclass(frozen=True)
class CriuInfo:
    binary: str
    version: tuple[int, ...]
    features: frozenset[str]


_criu_cache: dict[tuple[str, tuple[str, ...]], CriuInfo] = {}
_criu_lock = threading.Lock()


def check_criu(runner: CommandRunner, criu: str = "criu", features: Iterable[str] = ()) -> CriuInfo:
    """CRIU's version and the given features, checked once and cached.

    Raises CriuUnavailable listing everything that is missing (binary, a
    new enough version, a working `criu check`, each feature)."""
    want = tuple(sorted(set(features)))
    key = (criu, want)
    with _criu_lock:
        if key in _criu_cache:
            return _criu_cache[key]
        fix = "run scripts/setup-host (it installs CRIU 4.x under /opt/crabd/criu and /usr/local/bin/criu)"
        try:
            res = runner.run([criu, "--version"], timeout=10)
        except CommandFailed:
            raise CriuUnavailable(f"CRIU ({criu}) is not installed", missing=[criu], fix=fix) from None
        m = re.search(rb"Version:\s*(\d+(?:\.\d+)*)", res.output)
        if res.returncode != 0 or not m:
            raise CriuUnavailable(f"`{criu} --version` failed: {res.output.decode(errors='replace').strip()[-300:]}",
                                  missing=[criu], fix=fix)
        version = tuple(int(x) for x in m.group(1).decode().split("."))
        missing: list[str] = []
        if version < MIN_CRIU_VERSION:
            missing.append(f"CRIU >= {'.'.join(map(str, MIN_CRIU_VERSION))} (found {'.'.join(map(str, version))})")
        res = runner.run([criu, "check"], timeout=30)
        if res.returncode != 0:
            errs, _ = criu_errors(res.output.decode(errors="replace"))
            missing.append("a passing `criu check`" + (f" ({'; '.join(errs[:3])})" if errs else ""))
        have = set()
        for f in want:
            r = runner.run([criu, "check", "--feature", f], timeout=30)
            if r.returncode == 0 and b"is supported" in r.output:
                have.add(f)
            else:
                missing.append(f"feature {f}")
        if missing:
            raise CriuUnavailable(f"CRIU at {criu} cannot be used: missing {', '.join(missing)}",
                                  missing=missing, fix=fix)
        info = CriuInfo(criu, version, frozenset(have))
        _criu_cache[key] = info
        return info


def criu_errors(log_text: str, context_lines: int = 3) -> tuple[list[str], list[str]]:
    """(Error lines, the lines just before the first of them) of a CRIU log,
    without the rlimit noise of these hosts. Pure."""
    lines = log_text.splitlines()
    errors: list[str] = []
    context: list[str] = []
    for i, ln in enumerate(lines):
        if _ERROR.search(ln) and not _NOISE.search(ln):
            if not errors:
                context = [c.strip() for c in lines[max(0, i - context_lines):i] if not _NOISE.search(c)]
            errors.append(ln.strip())
    return errors, context


def skipped_in_flight(log_text: str) -> list[str]:
    """Inodes (hex, as CRIU logs them) of the listening TCP sockets a dump
    saved without their not-yet-accepted connections. Pure."""
    return _SKIPPED_IN_FLIGHT.findall(log_text)


def _read_log(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-(4 << 20):].decode(errors="replace")
    except OSError:
        return ""


class Runc:
    """runc's checkpoint and restore for containers under one runc root."""

    def __init__(self, root: str | os.PathLike[str], *, runc: str = "runc", criu: str = "criu",
                 runner: CommandRunner | None = None, check: bool = True, loopback: bool = True) -> None:
        self.root = str(root)
        self.runc = runc
        self.criu = criu
        self.runner = runner or SubprocessCommandRunner()
        self.check = check
        self.loopback = loopback

    def _require(self, opts: DumpOptions | RestoreOptions) -> None:
        if self.check:
            check_criu(self.runner, self.criu, required_features(opts))

    def checkpoint(self, container_id: str, image_dir: str | os.PathLike[str], work_dir: str | os.PathLike[str],
                   opts: DumpOptions = DumpOptions()) -> float:
        """Dump `container_id` into `image_dir` (log: `work_dir`/dump.log).
        Returns seconds taken. Raises CriuFailed with CRIU's reasons."""
        self._require(opts)
        os.makedirs(image_dir, exist_ok=True)
        os.makedirs(work_dir, exist_ok=True)
        argv = checkpoint_argv(self.runc, self.root, container_id, str(image_dir), str(work_dir), opts, self.criu)
        res = self.runner.run(argv, timeout=opts.timeout, env=_criu_env(work_dir, opts),
                              progress=lambda: _bytes_in(image_dir, work_dir), stall=opts.stall_timeout)
        if res.returncode != 0:
            self._fail(f"dump of container {container_id}", res, Path(work_dir) / "dump.log")
        return res.duration

    def restore(self, container_id: str, bundle: str | os.PathLike[str], image_dir: str | os.PathLike[str],
                work_dir: str | os.PathLike[str], opts: RestoreOptions = RestoreOptions()) -> int:
        """Restore `image_dir` as detached container `container_id` from
        `bundle` (whose rootfs must already hold the matching file system).
        Returns the host pid of the restored init."""
        self._require(opts)
        os.makedirs(work_dir, exist_ok=True)
        pid_file = Path(work_dir) / "restore.pid"
        pid_file.unlink(missing_ok=True)
        argv = restore_argv(self.runc, self.root, container_id, str(bundle), str(image_dir), str(work_dir),
                            str(pid_file), opts, self.criu)
        res = self.runner.run(argv, timeout=opts.timeout, env=_criu_env(work_dir, opts),
                              progress=lambda: _bytes_in(work_dir), stall=opts.stall_timeout)
        if res.returncode != 0:
            self._fail(f"restore of container {container_id}", res, Path(work_dir) / "restore.log")
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError) as e:
            raise CommandFailed(argv, 0, f"runc restore wrote no pid file {pid_file}: {e}",
                                context=f"restore of container {container_id}") from e
        if self.loopback:
            loopback_up(pid)  # runc restores the network namespace empty: see netns.py
        return pid

    def delete(self, container_id: str, *, force: bool = True) -> None:
        """Forget `container_id` (with `force`, kill its tasks first). A
        container that does not exist is not an error."""
        argv = [self.runc, "--root", self.root, "delete"] + (["--force"] if force else []) + [container_id]
        res = self.runner.run(argv, timeout=30)
        if res.returncode != 0 and os.path.exists(os.path.join(self.root, container_id)):
            raise CommandFailed(argv, -9 if res.returncode is None else res.returncode,
                                res.output.decode(errors="replace"), context=f"runc delete of {container_id}")

    def _fail(self, what: str, res: Result, log: Path) -> None:
        output = res.output.decode(errors="replace")
        if res.killed == "stalled":
            what += (f" (killed with CRIU after {res.duration:.0f} s: no progress: its log and image had stopped "
                     "growing, and CRIU and its tasks used no CPU and did no I/O)")
        elif res.returncode is None:
            what += f" (killed with CRIU at its timeout, {res.duration:.0f} s)"
        text = _read_log(log)
        errors, context = criu_errors(text)
        if res.returncode is None and not errors and text.strip():
            errors = [f"CRIU's last log line: {text.strip().splitlines()[-1].strip()}"]
        if not errors and not log.exists():
            raise CommandFailed(res.argv, -9 if res.returncode is None else res.returncode, output, context=what)
        raise CriuFailed(what, errors=errors, context=context, log_path=str(log), output=output)


def _bytes_in(*dirs: str | os.PathLike[str]) -> int:
    """Bytes of the files directly in `dirs`: CRIU's progress (its log, the
    image files it writes)."""
    total = 0
    for d in dirs:
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
        except OSError:
            pass
    return total


def _criu_env(work_dir: str | os.PathLike[str], opts: DumpOptions | RestoreOptions) -> dict[str, str] | None:
    """CRIU settings runc has no flag for, as a config file named by
    CRIU_CONFIG_FILE (runc passes its environment on to CRIU; CRIU reads
    that file as well as the RPC config file runc names, which keeps e.g. a
    standby bundle's `leave-stopped`)."""
    lines = config_lines(opts)
    if not lines:
        return None
    path = Path(work_dir) / "deltacr-criu.conf"
    path.write_text("".join(f"{ln}\n" for ln in lines))
    return {"CRIU_CONFIG_FILE": str(path)}
