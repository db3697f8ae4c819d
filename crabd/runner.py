"""The one seam where crabd runs external commands.

Every external command (runc, tar, debootstrap, criu) goes through a `Runner`:
an argument list, never a shell string; a timeout; stderr kept for the error
message. Tests inject `crabd.testing.FakeRunner` to drive the real logic of
the runtime without root.

`capture` is the variant for commands run *inside* a sandbox on behalf of an
agent: it feeds stdin, caps what it keeps of stdout/stderr, enforces a
timeout by killing the command's process tree, and does not wait for end of
file on the pipes once the command has exited -- a `server &` started by the
command keeps the pipe open for as long as it lives, and the agent must get
its answer when the command itself ends.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .errors import CommandFailed

__all__ = ["Completed", "Captured", "CappedOutput", "Runner", "SubprocessRunner", "read_ready", "take", "drain_now"]


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class Captured:
    returncode: int | None      # None when the command was killed at its timeout
    stdout: bytes
    stderr: bytes
    stdout_dropped: int         # bytes read past the cap and discarded
    stderr_dropped: int
    duration: float
    timed_out: bool
    status: str | None = None   # the wrapper's status line, when one was asked for


class CappedOutput:
    """A command's stdout and stderr ("out", "err"), each kept up to `cap`
    bytes; what is read past that is counted, not kept (capture's rule, also
    the exec channel's: crabd/runtime/channel.py)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.bufs = {"out": bytearray(), "err": bytearray()}
        self.dropped = {"out": 0, "err": 0}

    def add(self, name: str, chunk: bytes) -> None:
        buf = self.bufs[name]
        room = self.cap - len(buf)
        if room > 0:
            buf += chunk[:room]
        self.dropped[name] += max(0, len(chunk) - max(room, 0))

    def captured(self, returncode: int | None, duration: float, timed_out: bool, status: str | None) -> Captured:
        return Captured(returncode, bytes(self.bufs["out"]), bytes(self.bufs["err"]), self.dropped["out"],
                        self.dropped["err"], duration, timed_out, status)


def read_ready(fd: int) -> bytes | None:
    """What a non-blocking `fd` has: b"" at end of file, None when nothing is ready."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None


def take(sel: selectors.BaseSelector, key: selectors.SelectorKey) -> bytes | None:
    """One read of the pipe registered as `key`: its bytes, or None when
    nothing is ready or it is at end of file (then it is unregistered)."""
    fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()  # type: ignore[union-attr]
    chunk = read_ready(fd)
    if chunk == b"":
        sel.unregister(key.fileobj)
        return None
    return chunk


#: The most `drain_now` reads from one pipe (a background child that keeps
#: writing cannot hold the reader there).
DRAIN_LIMIT = 16 << 20


def drain_now(sel: selectors.BaseSelector, output: CappedOutput) -> None:
    """Read what the output pipes registered in `sel` (data "out" and
    "err") hold now, until each is empty or at end of file (then it is
    unregistered). Called when a command's end is seen: everything it wrote
    is in the pipes by then, however long this thread was kept off the CPU
    since; the short window after the end (DRAIN_AFTER_EXIT) is only for
    output still in flight, never for what is already there. Without this,
    a reader descheduled past that window dropped the rest of the output
    unmarked (a 1 MiB output came back 8,075 bytes short, 1 in ~150 execs
    at load 15)."""
    for key in [k for k in sel.get_map().values() if k.data in ("out", "err")]:
        taken = 0
        while taken < DRAIN_LIMIT and (chunk := take(sel, key)):
            output.add(key.data, chunk)
            taken += len(chunk)


class Runner(Protocol):
    def run(self, argv: list[str], *, timeout: float, input: bytes | None = None,
            check: bool = True, context: str = "", log: str | None = None) -> Completed: ...

    def capture(self, argv: list[str], *, timeout: float | None, input: bytes | None,
                cap: int, on_timeout: Callable[[], None] | None = None,
                status_fd: int | None = None, still_running: Callable[[], bool] | None = None) -> Captured: ...


class SubprocessRunner:
    """The real runner."""

    # After the command exits, how long to keep reading output that is
    # already in flight before closing the pipes on background children.
    DRAIN_AFTER_EXIT = 0.05

    def run(self, argv: list[str], *, timeout: float, input: bytes | None = None,
            check: bool = True, context: str = "", log: str | None = None) -> Completed:
        """Run to completion. With `log`, stdout and stderr go to that file
        instead of pipes: needed for `runc create`, whose container init
        inherits them and would otherwise hold our pipes open forever."""
        if log is not None:
            return self._run_logged(argv, timeout=timeout, check=check, context=context, log=log)
        try:
            p = subprocess.run(argv, input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError as e:
            raise CommandFailed(argv, 127, str(e), context=context,
                                fix=f"install {argv[0]} (scripts/setup-host does)") from e
        except subprocess.TimeoutExpired as e:
            err = (e.stderr or b"").decode(errors="replace")
            raise CommandFailed(argv, -9, f"timed out after {timeout}s. {err}", context=context) from e
        done = Completed(argv, p.returncode, p.stdout, p.stderr)
        if check and p.returncode != 0:
            raise CommandFailed(argv, p.returncode, p.stderr.decode(errors="replace"), context=context)
        return done

    def _run_logged(self, argv: list[str], *, timeout: float, check: bool, context: str, log: str) -> Completed:
        with open(log, "ab") as f:
            start = f.tell()
            try:
                p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, timeout=timeout)
            except FileNotFoundError as e:
                raise CommandFailed(argv, 127, str(e), context=context,
                                    fix=f"install {argv[0]} (scripts/setup-host does)") from e
            except subprocess.TimeoutExpired as e:
                raise CommandFailed(argv, -9, f"timed out after {timeout}s", context=context) from e
        with open(log, "rb") as f:
            f.seek(start)
            out = f.read(1 << 20)
        if check and p.returncode != 0:
            raise CommandFailed(argv, p.returncode, out.decode(errors="replace"), context=context)
        return Completed(argv, p.returncode, b"", out)

    def capture(self, argv: list[str], *, timeout: float | None, input: bytes | None,
                cap: int, on_timeout: Callable[[], None] | None = None,
                status_fd: int | None = None, still_running: Callable[[], bool] | None = None) -> Captured:
        """Run `argv`, feeding `input`, keeping at most `cap` bytes per stream.

        Without `status_fd` the command is done when `argv` exits. With it
        (a `runc exec --detach` whose wrapper reports on a fifo), the command
        is done when a status line arrives on `status_fd`, or when `argv`
        exited and `still_running()` says the wrapper is gone without one.
        """
        start = time.monotonic()
        p = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        output = CappedOutput(cap)
        sel = selectors.DefaultSelector()
        assert p.stdout is not None and p.stderr is not None
        for name, f in (("out", p.stdout), ("err", p.stderr)):
            os.set_blocking(f.fileno(), False)
            sel.register(f, selectors.EVENT_READ, name)
        status = bytearray()
        if status_fd is not None:
            os.set_blocking(status_fd, False)
            sel.register(status_fd, selectors.EVENT_READ, "status")
        pending_in = memoryview(input or b"")
        if input is not None:
            assert p.stdin is not None
            os.set_blocking(p.stdin.fileno(), False)
            if pending_in:
                sel.register(p.stdin, selectors.EVENT_WRITE, "in")
            else:
                p.stdin.close()
        timed_out = False
        done_at: float | None = None
        while True:
            now = time.monotonic()
            if done_at is None:
                exited = p.poll() is not None
                if status_fd is None:
                    finished = exited
                else:
                    finished = b"\n" in status or (exited and (p.returncode != 0 or not (still_running and still_running())))
                if finished:
                    drain_now(sel, output)
                    done_at = now
            if done_at is not None and (now - done_at > self.DRAIN_AFTER_EXIT or
                                        not any(k.data in ("out", "err") for k in sel.get_map().values())):
                break  # background children may hold the pipes: stop reading
            if timeout is not None and done_at is None and now - start > timeout:
                timed_out = True
                if on_timeout:
                    on_timeout()
                _kill_group(p)
                p.wait()
                drain_now(sel, output)
                done_at = time.monotonic()
            events = sel.select(timeout=0.002 if done_at is not None else 0.01)
            if done_at is not None and not events:
                break  # everything the command wrote before it ended is read
            for key, _ in events:
                if key.data == "in":
                    try:
                        n = os.write(p.stdin.fileno(), pending_in[:65536])  # type: ignore[union-attr]
                        pending_in = pending_in[n:]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending_in = pending_in[:0]  # the command stopped reading
                    if not pending_in:
                        sel.unregister(key.fileobj)
                        p.stdin.close()  # type: ignore[union-attr]
                    continue
                chunk = take(sel, key)
                if not chunk:
                    continue
                if key.data == "status":
                    status += chunk
                    continue
                output.add(key.data, chunk)
        # The status line the wrapper wrote before it went: read it whatever
        # ended the loop. Once drain_now empties the output pipes at the end,
        # the loop can stop before a select ever reports the status fifo
        # ready, and the command looked killed ("killed before it could
        # report its exit status": test_ebpf_runc, 2 of 3 runs).
        if status_fd is not None and b"\n" not in status:
            while (chunk := read_ready(status_fd)):
                status += chunk
        for key in list(sel.get_map().values()):
            sel.unregister(key.fileobj)
        sel.close()
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None and not stream.closed:
                stream.close()
        rc = p.wait()
        line = bytes(status).split(b"\n", 1)[0].decode(errors="replace") if b"\n" in status else None
        return output.captured(None if timed_out else rc, time.monotonic() - start, timed_out, line)


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
