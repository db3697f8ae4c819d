"""The fast exec path (issue 16 item 4): the sandbox's own init spawns the
command, asked over a unix socket, instead of a `runc exec` per command.

`Runtime.exec` tries this path first; it exists for sandboxes created
with the channel on (the default; `CRABD_EXEC_CHANNEL=0` turns it off: their
init runs as `crabd-init --channel crabd-exec`, see init.c mode 3). It falls back to `runc exec`
whenever the channel cannot be used *before anything was started*
(`Unavailable`): an init without the channel, nobody listening, a listener
that is not the sandbox's init, a refused request. Once the init has the
request there is no fallback: a command must never run twice.

Why it is as safe as runc exec (the design questions of the issue):
- Same place: the command is a child of the sandbox's PID 1, so it is in the
  sandbox's namespaces (time namespace included, after a CRIU restore), its
  cgroups (the inspector's per-cgroup attribution is unchanged), with the
  config's capabilities and uid 0, as a `runc exec` of the config's process.
- Only crabd is served: the init answers a peer only if SO_PEERCRED says its
  pid is 0 in the sandbox's pid namespace (a process outside it: crabd) and
  its uid 0; a process of the sandbox that connects is closed unanswered.
  crabd checks the other direction: the listener must be the sandbox's PID 1
  (SO_PEERCRED pid = the init found in the sandbox's cgroup, whose NSpid is
  "<pid> 1"), so a sandbox process squatting the name gets no request.
- Where the channel lives: an abstract unix socket in the sandbox's network
  namespace. crabd makes its socket there (deltacr.netns.in_netns, from a
  short-lived thread) and connects; crabd's own threads never change
  namespace. Not a socket file in the /dev/.crabd bind mount: CRIU dumps
  that listener but cannot restore it ("Can't setns .../mnt", measured
  here), and the rollback then starts a fresh init, losing the sandbox's
  processes. The network namespace is dumped and restored with the init, so
  the listener comes back with it after a rollback, a fork or a standby
  promotion; a hot standby (its own network namespace) never collides with
  the live sandbox's name. A daemon restart needs nothing: the next exec
  connects again. At a dump no command is in flight (captures run between
  turns), so no connection is ever dumped.
- Descriptors: crabd makes the pipes and passes the command's ends with
  SCM_RIGHTS; the init closes its copies once the command has them, so end
  of file and background children behave as with runc exec (a `server &`
  keeps stdout; crabd stops reading once the command's status arrived and
  the pipes drained, as runner.capture does).
- Timeouts: crabd sends "K"; the init SIGKILLs the command and every
  descendant (the tree psutil walks for runc exec's wrapper).
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import time
from pathlib import Path
from typing import Callable, Sequence

from deltacr.netns import in_netns

from ..runner import Captured, CappedOutput, drain_now, take

__all__ = ["NAME", "Unavailable", "find_init", "connect", "run"]

NAME = "crabd-exec"         # the abstract socket "@crabd-exec" of the sandbox's network namespace
MAGIC = "crabd-exec-1"      # a request's first word; also how a channel-capable init binary is recognised
CONNECT_TIMEOUT = 2.0
LISTEN_WAIT = 1.0           # how long a just-started init with the channel may take to listen
KILL_GRACE = 5.0            # after "K": how long to wait for the init's report
DRAIN_AFTER_EXIT = 0.05     # as runner.SubprocessRunner: output in flight after the status


class Unavailable(Exception):
    """The channel cannot run this command; nothing was started (use runc exec)."""


def _peer_pid(s: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid)


def is_sandbox_init(pid: int, cgroup_rel: str) -> bool:
    """Is host pid `pid` the PID 1 of a pid namespace one level below ours,
    in the sandbox's cgroup `cgroup_rel`?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
    if nspid != [str(pid), "1"]:
        return False
    return any(ln.split(":", 2)[-1] == cgroup_rel for ln in cgroups.splitlines())


def dying(status: str) -> bool:
    """Pure: does a /proc/PID/status text say the task is exiting (a zombie or
    dead) or has a SIGKILL pending?"""
    fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
    if fields.get("State", "").split()[:1] in (["Z"], ["X"]):
        return True
    sigkill = 1 << 8  # signal 9's bit in the pending masks
    for key in ("SigPnd", "ShdPnd"):
        try:
            if int(fields.get(key, "0").strip(), 16) & sigkill:
                return True
        except ValueError:
            pass
    return False


def find_init(procs: Path, cgroup_rel: str) -> int | None:
    """The host pid of the sandbox's PID 1 among `procs` (its cgroup.procs).
    An init being killed is passed over: right after a standby's promotion
    the old init, SIGKILLed, can still be in the cgroup with its channel
    open, and a command sent to it died with it unreported (seen once in CI
    at load ~20: `python3 was killed before it could report`)."""
    try:
        pids = [int(x) for x in procs.read_text().split()]
    except (OSError, ValueError):
        return None
    for p in sorted(pids):
        if not is_sandbox_init(p, cgroup_rel):
            continue
        try:
            if dying(Path(f"/proc/{p}/status").read_text()):
                continue
        except OSError:
            continue
        return p
    return None


def connect(init_pid: int, cgroup_rel: str) -> socket.socket:
    """A connection to the init `init_pid`'s channel, checked to be answered
    by that init. The socket is made in the sandbox's network namespace
    (where the abstract name lives); crabd itself never enters it."""
    if not is_sandbox_init(init_pid, cgroup_rel):
        raise Unavailable(f"pid {init_pid} is not the sandbox's init")
    try:
        s = in_netns(init_pid, lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC))
    except OSError as e:
        raise Unavailable(f"entering the sandbox's network namespace: {e}") from None
    s.settimeout(CONNECT_TIMEOUT)
    deadline = time.monotonic() + LISTEN_WAIT
    try:
        while True:
            try:
                s.connect(b"\0" + NAME.encode())
                break
            except ConnectionRefusedError:
                # `runc start` returns before the init has exec'd crabd-init,
                # let alone listens: an init that may have the channel gets a moment.
                if time.monotonic() > deadline or not _may_listen(init_pid):
                    raise
                time.sleep(0.001)
        pid = _peer_pid(s)
    except OSError as e:
        s.close()
        raise Unavailable(f"no exec channel @{NAME}: {e.strerror or e}") from None
    if pid != init_pid:
        s.close()
        raise Unavailable(f"@{NAME} is answered by pid {pid}, not by the sandbox's init {init_pid}")
    return s


def _may_listen(pid: int) -> bool:
    """Can init `pid` still come to listen: it runs crabd-init --channel, or
    it is still `runc init` (runc start returns before the exec of crabd-init)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not args[0].endswith(b"crabd-init"):
        return True
    return b"--channel" in args


def request(argv: Sequence[str], env: Sequence[str], cwd: str) -> bytes:
    """The request's bytes (init.c mode 3): a u32 length, then NUL-terminated
    strings: magic, cwd, argc, argv..., env..."""
    words = [MAGIC.encode(), cwd.encode(), str(len(argv)).encode(), *(a.encode() for a in argv),
             *(e.encode() for e in env)]
    body = b"\0".join(words) + b"\0"
    return struct.pack("<I", len(body)) + body


def run(s: socket.socket, argv: Sequence[str], env: Sequence[str], cwd: str, *, stdin: bytes,
        timeout: float | None, cap: int) -> Captured:
    """Run one command over the connection `s` (from `connect`, consumed).
    Raises Unavailable only if the init refused the request before starting
    anything; every other outcome is a Captured whose `status` is the init's
    report ("X code", "S sig", "E errno", "C errno"; None: the init went away)."""
    start = time.monotonic()
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        data = request(argv, env, cwd)
        try:
            n = socket.send_fds(s, [data], [in_r, out_w, err_w])
            if n < len(data):
                s.sendall(data[n:])
        except OSError as e:
            raise Unavailable(f"sending the request failed: {e}") from None
    except BaseException:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        s.close()
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)   # the init (then the command) holds them now
    try:
        return _follow(s, in_w, out_r, err_r, stdin, timeout, cap, start)
    finally:
        s.close()
        os.close(out_r)
        os.close(err_r)


def _follow(s: socket.socket, in_w: int, out_r: int, err_r: int, stdin: bytes, timeout: float | None,
            cap: int, start: float) -> Captured:
    """Feed stdin, read output and the init's reports (closes `in_w`)."""
    stdin_open = [True]

    def close_stdin() -> None:
        if stdin_open[0]:
            stdin_open[0] = False
            os.close(in_w)
    try:
        return _follow_loop(s, in_w, close_stdin, out_r, err_r, stdin, timeout, cap, start)
    finally:
        close_stdin()


def _follow_loop(s: socket.socket, in_w: int, close_stdin: Callable[[], None], out_r: int, err_r: int,
                 stdin: bytes, timeout: float | None, cap: int, start: float) -> Captured:
    s.setblocking(False)
    sel = selectors.DefaultSelector()
    output = CappedOutput(cap)
    for fd, name in ((out_r, "out"), (err_r, "err")):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    sel.register(s, selectors.EVENT_READ, "ctl")
    pending = memoryview(stdin)
    os.set_blocking(in_w, False)
    if pending:
        sel.register(in_w, selectors.EVENT_WRITE, "in")
    else:
        close_stdin()   # end of file at once, as runc exec's empty stdin pipe
    lines: list[str] = []
    refused: str | None = None
    ctl = b""
    final: str | None = None
    started = False
    timed_out = False
    killed_at: float | None = None
    done_at: float | None = None
    while True:
        now = time.monotonic()
        if final is not None and done_at is None:
            drain_now(sel, output)   # all the command wrote is in the pipes now
            done_at = now
        if done_at is not None and (now - done_at > DRAIN_AFTER_EXIT or
                                    not any(k.data in ("out", "err") for k in sel.get_map().values())):
            break
        if timeout is not None and killed_at is None and final is None and now - start > timeout:
            timed_out, killed_at = True, now
            try:
                s.send(b"K\n")
            except OSError:
                pass
        if killed_at is not None and final is None and now - killed_at > KILL_GRACE:
            break
        if refused is not None:
            break
        if "ctl" not in {k.data for k in sel.get_map().values()} and final is None:
            break   # the init went away without a report (the sandbox died)
        events = sel.select(timeout=0.002 if done_at is not None else 0.05)
        if done_at is not None and not events:
            break
        for key, _ in events:
            if key.data == "in":
                try:
                    n = os.write(in_w, pending[:65536])
                    pending = pending[n:]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(in_w)
                    close_stdin()
                continue
            if key.data == "ctl":
                try:
                    chunk = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    sel.unregister(s)
                    continue
                ctl += chunk
                while b"\n" in ctl:
                    line, ctl = ctl.split(b"\n", 1)
                    lines.append(line.decode(errors="replace"))
                for text in lines:
                    kind = text[:1]
                    if kind == "P":
                        started = True
                    elif kind == "R" and not started:
                        refused = text[2:]
                    elif kind in ("X", "S", "E", "C") and final is None:
                        final = text
                lines.clear()
                continue
            got = take(sel, key)
            if got:
                output.add(key.data, got)
    sel.close()
    if refused is not None:
        raise Unavailable(f"the init refused the request: {refused}")
    return output.captured(None if timed_out else 0, time.monotonic() - start, timed_out, final)

