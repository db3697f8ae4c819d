"""Fakes of crabd's I/O seams, so unit tests drive real logic without root.

`FakeRunner` stands in for `crabd.runner.SubprocessRunner`: it records every
command and answers from rules keyed on argument words, e.g.

    fake = FakeRunner()
    fake.on("state", stdout=b'{"status": "running", "pid": 42}')
    fake.on_capture(status="E 2")      # the next exec: "command not found"
    rt = Runtime(tmp, runner=fake, layout=CgroupLayout(False, None, None))
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .errors import CommandFailed, FailedPrecondition
from .runner import Captured, Completed

if TYPE_CHECKING:
    from .client import Client
    from .runtime import Runtime

__all__ = ["FakeRunner", "DaemonHandle", "busybox_rootfs", "cleanup_state_dir", "ensure_busybox_image",
           "settled_checkpoints", "settled_checkpoint", "all_settled", "wait_until"]

CRABD = str(Path(sys.executable).parent / "crabd")
# How long start() waits for `crabd serve` to answer and load its inspector
# (bcc compiles the BPF program: ~9 s idle, a minute under heavy load).
INSPECTOR_WAIT_S = 180


@dataclass
class _Rule:
    words: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes


@dataclass
class FakeRunner:
    calls: list[list[str]] = field(default_factory=list)
    rules: list[_Rule] = field(default_factory=list)
    captures: list[Captured] = field(default_factory=list)

    def on(self, *words: str, returncode: int = 0, stdout: bytes = b"", stderr: bytes = b"") -> None:
        """Answer commands containing all `words` (the latest rule wins)."""
        self.rules.insert(0, _Rule(words, returncode, stdout, stderr))

    def on_capture(self, *, status: str | None = "X 0", stdout: bytes = b"", stderr: bytes = b"",
                   returncode: int | None = 0, timed_out: bool = False, dropped: int = 0) -> None:
        """Queue the result of the next `capture` (an exec)."""
        self.captures.append(Captured(returncode, stdout, stderr, dropped, 0, 0.001, timed_out, status))

    def run(self, argv: list[str], *, timeout: float, input: bytes | None = None,
            check: bool = True, context: str = "", log: str | None = None) -> Completed:
        self.calls.append(list(argv))
        for r in self.rules:
            if all(w in argv for w in r.words):
                if check and r.returncode != 0:
                    raise CommandFailed(argv, r.returncode, r.stderr.decode(), context=context)
                return Completed(list(argv), r.returncode, r.stdout, r.stderr)
        return Completed(list(argv), 0, b"", b"")

    def capture(self, argv: list[str], *, timeout: float | None, input: bytes | None, cap: int,
                on_timeout: Callable[[], None] | None = None, status_fd: int | None = None,
                still_running: Callable[[], bool] | None = None) -> Captured:
        self.calls.append(list(argv))
        if not self.captures:
            raise AssertionError(f"FakeRunner: unexpected capture of {argv}")
        c = self.captures.pop(0)
        if c.timed_out and on_timeout:
            on_timeout()
        return c


def cleanup_state_dir(path: Path) -> None:
    """Unmount everything under a (test) state dir, deepest first, then delete it."""
    real = str(Path(path).resolve())
    mps = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == real or mp.startswith(real + "/"):
                mps.append(mp)
    for mp in sorted(mps, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


class DaemonHandle:
    """A real `crabd serve` child on a state dir, for integration tests and
    benches: start, kill -9, restart, stop; extra serve flags and environment."""

    def __init__(self, state: Path, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.state = Path(state)
        self.socket = self.state / "api.sock"
        self.log = self.state / "daemon.log"
        self.args = list(args or [])
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_inspector: bool = True, wait_adopted: bool = True) -> None:
        """Start `crabd serve` and wait until it answers; with `wait_adopted`,
        also until it has re-adopted its sandboxes (it answers health before:
        crabd.serve); with `wait_inspector`, until its inspector has loaded
        (it serves before: turns that end meanwhile are planned FS_PROC,
        which tests of plans must not see)."""
        env = None if self.env is None else {**os.environ, **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([CRABD, "serve", "--state-dir", str(self.state), "--socket", str(self.socket),
                                          *self.args], stdout=log, stderr=log, start_new_session=True, env=env)
        deadline = time.monotonic() + INSPECTOR_WAIT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"crabd serve exited: {self.log.read_text()[-2000:]}")
            try:
                h = _client(self.socket).health()
            except FailedPrecondition:
                time.sleep(0.2)
                continue
            # Sandboxes are re-adopted after it serves (crabd.serve): tests
            # expect them watched (or recovered) once it has started.
            if ((not wait_adopted or h.get("adopting", 0) == 0)
                    and (not wait_inspector or h.get("inspector_ready", True))):
                return
            time.sleep(0.1)
        raise AssertionError(f"crabd serve did not answer (or load its inspector) in {INSPECTOR_WAIT_S} s: "
                             f"{self.log.read_text()[-2000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def client(self) -> Client:
        return _client(self.socket)

    def shutdown(self, strict: bool = False) -> None:
        """Delete every sandbox through the API (while crabd is up), then stop
        it. `strict`: a failed delete is raised (after the stop), else ignored."""
        try:
            if self.proc and self.proc.poll() is None:
                c = self.client()
                for sb in c.sandboxes():
                    c.delete_sandbox(sb["id"])
        except Exception:
            if strict:
                raise
        finally:
            self.stop()


def _client(socket: Path) -> "Client":
    from .client import Client  # the client imports httpx; unit fakes above do not need it
    return Client(socket)


def wait_until(pred: Callable[[], object], what: str, timeout: float = 120, interval: float = 0.1) -> object:
    """Poll `pred` until it returns something truthy, and return that. A hang
    guard for a loaded host, not a latency check: after `timeout` seconds it
    fails the test, naming `what` it waited for."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"hang guard: no {what} after {timeout} s")
        time.sleep(interval)


def settled_checkpoints(c: "Client", sid: str, timeout: float = 240, *, all: bool = True,
                        interval: float = 0.1) -> list[dict[str, Any]]:
    """Wait until no checkpoint of sandbox `sid` is pending (each committed or
    failed: its capture is over) and return them (`all`: retired ones too).
    The one "wait until the checkpoints settle" of the tests and benches; a
    hang guard like `wait_until` (AssertionError after `timeout` s)."""
    def settled() -> list[dict[str, Any]] | None:
        cks = c.checkpoints(sid, all=all)
        return cks if all_settled(cks) else None
    return wait_until(settled, f"settled checkpoints of {sid}", timeout, interval)  # type: ignore[return-value]


def settled_checkpoint(c: "Client", cid: str, timeout: float = 120, interval: float = 0.2) -> dict[str, Any]:
    """Checkpoint `cid` once it is no longer pending (a hang guard like `wait_until`)."""
    def settled() -> dict[str, Any] | None:
        ck = c.checkpoint(cid)
        return ck if ck["state"] != "pending" else None
    return wait_until(settled, f"settled checkpoint {cid}", timeout, interval)  # type: ignore[return-value]


def all_settled(cks: list[dict[str, Any]]) -> bool:
    return not any(k["state"] == "pending" for k in cks)


def ensure_busybox_image(runtime: "Runtime", name: str = "busybox", extra_dirs: tuple[str, ...] = ()) -> str:
    """Image `name` in `runtime`'s store: a busybox root (`busybox_rootfs`),
    imported the first time; returns the name."""
    if runtime.images.exists(name):
        return name
    with tempfile.TemporaryDirectory(prefix="crabd-bb-", dir=str(runtime.state_dir)) as tmp:
        runtime.images.import_path(str(busybox_rootfs(Path(tmp) / "rootfs", extra_dirs)), name)
    return name


def busybox_rootfs(dst: Path, extra_dirs: tuple[str, ...] = ()) -> Path:
    """Fill `dst` with a minimal image root: static busybox and its applet
    links, nothing else but `extra_dirs` (the tests' and benches' busybox image)."""
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        raise FailedPrecondition("/bin/busybox is missing", fix="run scripts/setup-host (it installs busybox-static)")
    dst = Path(dst)
    for d in ("bin", "tmp", "etc", "root", *extra_dirs):
        (dst / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, dst / "bin" / "busybox")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True,
                             timeout=30).stdout.split()
    for a in applets:
        if a != "busybox":
            (dst / "bin" / a).symlink_to("busybox")
    (dst / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return dst
