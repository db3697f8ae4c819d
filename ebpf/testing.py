"""Fakes of the inspector's seams, so unit tests drive the real aggregation
code without root: `FakeLoader` (the BPF side) and `FakeProcessTable`
(/proc and cgroup.procs).

    procs = FakeProcessTable()
    procs.start("/cg/sb", 1, ("crabd-init",))
    loader = FakeLoader()                                  # pid-following mode: no stat of the cgroup
    insp = Inspector(loader, processes=procs, clock=FakeClock(), poll_interval=None)
    insp.watch("sb", "/cg/sb", init_pid=1)
    loader.emit(Event(EventKind.OPEN_WRITE, tag=loader.tag_of(1), pid=10, path="/app/x", arg=0o1101))
    assert insp.end_turn("sb").files["write"].count == 1

The second half of the module is for root tests and the benchmark: the
labelled turn set (`LABELLED_TURNS`), `CgroupCell` (a fresh cgroup v2
directory and scratch directory to run turns in), `tree_state` (the
independent oracle), `make_wheel` and `TestPeer` (a network-namespace peer).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

from ebpf._events import Event, program_text
from ebpf._proc import ProcInfo


class FakeClock:
    """A monotonic clock that advances 1 µs per reading."""

    def __init__(self, start: int = 1_000_000) -> None:
        self._it = itertools.count(start, 1000)

    def __call__(self) -> int:
        return next(self._it)


class FakeLoader:
    """Records what the inspector asks of the kernel; events are pushed with `emit`.

    Pid-following mode by default, so that `watch` touches no file system;
    `mode="bpf-cgroup"` makes `watch` stat the cgroup directory for its id."""

    def __init__(self, mode: str = "bpf-pids") -> None:
        self.mode = mode
        self.opened = False
        self.closed = False
        self.cgroups: dict[int, tuple[int, int]] = {}  # id -> (level, tag)
        self.pids: dict[int, int] = {}
        self.queue: list[Event] = []
        self.writes: dict[int, int] = {}
        self.dropped: dict[int, int] = {}
        self.fail_open: Exception | None = None
        self.epochs: dict[int, int] = {}
        self.suppressed: dict[int, dict[int, int]] = {}
        # crabd's pauses: the armed tags; what the kernel would count in
        # them is set by the test (`woke`); it drops CRIU's parasite's
        # events itself, so the fake never sees them
        self.pauses: set[int] = set()
        self.woken: dict[int, set[int]] = {}
        self.ended: list[int] = []

    def program(self) -> str:
        return program_text(self.mode == "bpf-pids")

    def open(self) -> None:
        if self.fail_open:
            raise self.fail_open
        self.opened = True

    def add_cgroup(self, cgroup_id: int, level: int, tag: int) -> None:
        self.cgroups[cgroup_id] = (level, tag)

    def remove_cgroup(self, cgroup_id: int) -> None:
        self.cgroups.pop(cgroup_id, None)

    def add_pid(self, pid: int, tag: int) -> None:
        self.pids[pid] = tag

    def remove_tag_pids(self, tag: int) -> None:
        self.pids = {p: t for p, t in self.pids.items() if t != tag}

    def tag_of(self, pid_or_cgroup: int) -> int:
        if pid_or_cgroup in self.pids:
            return self.pids[pid_or_cgroup]
        return self.cgroups[pid_or_cgroup][1]

    def emit(self, *events: Event, ts: int | None = None) -> None:
        for ev in events:
            self.queue.append(replace(ev, ts=ts) if ts is not None else ev)

    def suppressed_counts(self, tag: int) -> dict[int, int]:
        return dict(self.suppressed.get(tag, {}))

    def suppress(self, tag: int, kind: int, n: int = 1) -> None:
        """Pretend the kernel counted `n` file events of `kind` without sending them."""
        d = self.suppressed.setdefault(tag, {})
        d[kind] = d.get(kind, 0) + n

    def begin_pause(self, tag: int) -> None:
        self.pauses.add(tag)
        self.woken[tag] = set()

    def woke(self, tag: int, *pids: int) -> None:
        """Pretend threads of `pids` made system calls in the pause beyond restarting an interrupted one."""
        self.woken.setdefault(tag, set()).update(pids)

    def end_pause(self, tag: int) -> set[int]:
        if tag not in self.pauses:
            return set()
        self.pauses.discard(tag)
        self.ended.append(tag)
        return self.woken.pop(tag, set())

    def next_epoch(self, tag: int) -> None:
        self.epochs[tag] = self.epochs.get(tag, 0) + 1

    def count_writes(self, tag: int, n: int = 1) -> None:
        self.writes[tag] = self.writes.get(tag, 0) + n

    def drop(self, tag: int, n: int = 1) -> None:
        self.dropped[tag] = self.dropped.get(tag, 0) + n

    def read_events(self, timeout_ms: int = 0) -> list[Event]:
        out, self.queue = self.queue, []
        return out

    def write_count(self, tag: int) -> int:
        return self.writes.get(tag, 0)

    def dropped_count(self, tag: int) -> int:
        return self.dropped.get(tag, 0)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeProcessTable:
    """Processes per cgroup path, edited by the test."""

    members: dict[Path, set[int]] = field(default_factory=dict)
    procs: dict[int, ProcInfo] = field(default_factory=dict)
    sockets: dict[int, list[str]] = field(default_factory=dict)
    blocked: dict[int, dict[int, int]] = field(default_factory=dict)  # pid -> tid -> call blocked in

    def start(self, cgroup: str | Path, pid: int, cmdline: tuple[str, ...] = ("sh",), start: int = 1) -> ProcInfo:
        info = ProcInfo(pid, start, 0, 0, False, cmdline[0].rsplit("/", 1)[-1][:15], cmdline)
        self.members.setdefault(Path(cgroup), set()).add(pid)
        self.procs[pid] = info
        return info

    def stop(self, pid: int) -> None:
        self.procs.pop(pid, None)
        for s in self.members.values():
            s.discard(pid)

    def run(self, pid: int, switches: int = 1) -> None:
        """The process was scheduled (its context-switch count moves)."""
        self.procs[pid] = replace(self.procs[pid], switches=self.procs[pid].switches + switches)

    def pids(self, cgroup_path: Path) -> set[int]:
        return set(self.members.get(Path(cgroup_path), set()))

    def info(self, pid: int) -> ProcInfo | None:
        return self.procs.get(pid)

    def listening(self, pids: set[int]) -> dict[int, list[str]]:
        return {p: a for p, a in self.sockets.items() if p in pids}

    def blocked_calls(self, pid: int) -> dict[int, int]:
        """tid -> call number; one thread, in call 0 (read), unless `blocked` says otherwise."""
        if pid not in self.procs:
            return {}
        return dict(self.blocked.get(pid, {pid: 0}))


# --- labelled turns and a cgroup cell to run them in (root) ----------------------
#
# Shared by tests/integration/ebpf/test_ebpf_turns.py and bench/inspector.py. A
# `CgroupCell` is a fresh cgroup v2 directory plus a scratch directory; every
# command runs as `sh -c 'echo $$ > CG/cgroup.procs; exec sh -c CMD'` in the
# scratch directory, so the whole command tree is in the cell's cgroup, as a
# `runc exec`'d process is in its container's.

import os  # noqa: E402
import signal  # noqa: E402
import stat  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import zipfile  # noqa: E402

UNIFIED = Path("/sys/fs/cgroup/unified")


@dataclass(frozen=True)
class LabelledTurn:
    """A scripted turn with its ground truth.

    `setup` runs in the cell before the turn (its effects belong to no turn);
    `label` is the plan a correct inspector must reach (SKIP, FS, FS_PROC);
    `external` whether the turn has an external effect; `peer` whether it
    needs the test peer (a network namespace pair, 10.251.0.0/30)."""

    name: str
    cmd: str
    label: str
    setup: str = ""
    external: bool = False
    peer: bool = False


_PY = "/usr/bin/python3"
_FILES = "echo alpha > a; mkdir -p d; echo beta > d/b"
_GIT = (
    "git init -q r && cd r && echo x > x && git add x && git commit -qm init"
    " && sleep 1.1 && git status >/dev/null"
)
_TESTS = (
    "mkdir -p t && printf 'def test_a():\\n    assert 1\\n\\ndef test_b():\\n    assert [1] == [1]\\n' > t/test_x.py"
    " && {venv_python} -m pytest -q -p no:cacheprovider t >/dev/null"
)
PEER_NS = ("crabd-ebpf-a", "crabd-ebpf-b")
PEER_ADDR = "10.251.0.2"
PEER_PORT = 9000

LABELLED_TURNS: tuple[LabelledTurn, ...] = (
    LabelledTurn("ls", "ls -la . d", "SKIP", _FILES),
    LabelledTurn("cat", "cat a d/b", "SKIP", _FILES),
    LabelledTurn("grep -r", "grep -r beta .", "SKIP", _FILES),
    LabelledTurn("python3 -c", f"{_PY} -c 'print(1)'", "SKIP"),
    LabelledTurn("git status", "cd r && git status", "SKIP", _GIT),
    LabelledTurn("pytest (read-only)", "{venv_python} -m pytest -q -p no:cacheprovider t", "SKIP", _TESTS),
    LabelledTurn("writes to /dev/null", "echo hi > /dev/null; ls > /dev/null 2>&1", "SKIP"),
    LabelledTurn("sed -i", "sed -i s/alpha/ALPHA/ a", "FS", _FILES),
    LabelledTurn("echo > f", "echo hi > f", "FS"),
    LabelledTurn("mv", "mv a a2", "FS", _FILES),
    LabelledTurn("rm", "rm a", "FS", _FILES),
    LabelledTurn("touch", "touch a", "FS", _FILES),
    LabelledTurn("chmod", "chmod 600 a", "FS", _FILES),
    LabelledTurn("mkdir", "mkdir newdir", "FS"),
    LabelledTurn("write in /tmp of the rootfs", "mkdir -p tmp && echo x > tmp/x", "FS"),
    LabelledTurn(
        "pip install local wheel",
        f"{_PY} -m pip install -q --no-index --no-deps --no-cache-dir --target site ./tiny-0.1-py3-none-any.whl",
        "FS",
        "make-wheel",
    ),
    LabelledTurn("git commit", "cd r && echo y >> x && git commit -qam change", "FS", _GIT),
    LabelledTurn("http.server outlives turn", f"{_PY} -m http.server 0 --bind 127.0.0.1 >/dev/null 2>&1 &",
                 "FS_PROC"),
    LabelledTurn("sleep 1000 &", "sleep 1000 >/dev/null 2>&1 &", "FS_PROC"),
    LabelledTurn("process started and finished", "sleep 0.2 & wait; (sleep 0.1 &); sleep 0.3", "SKIP"),
    LabelledTurn(
        "connect to test peer",
        f"nsenter --net=/run/netns/{PEER_NS[0]} {_PY} -c \"import socket; "
        f"socket.create_connection(('{PEER_ADDR}', {PEER_PORT}), timeout=3).sendall(b'hi')\"",
        "SKIP",
        external=True,
        peer=True,
    ),
    LabelledTurn(
        "curl to test peer",
        f"nsenter --net=/run/netns/{PEER_NS[0]} curl -s -m 3 -o /dev/null http://{PEER_ADDR}:{PEER_PORT}/ || true",
        "SKIP",
        external=True,
        peer=True,
    ),
    LabelledTurn(
        "loopback connect",
        f"{_PY} -c \"import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "c = socket.create_connection(s.getsockname()); c.sendall(b'x')\"",
        "SKIP",
    ),
)


def make_wheel(directory: Path, name: str = "tiny", version: str = "0.1") -> Path:
    """A minimal pure-Python wheel, written by hand (no build backend needed)."""
    whl = directory / f"{name}-{version}-py3-none-any.whl"
    di = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{di}/WHEEL": "Wheel-Version: 1.0\nGenerator: crabd-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},,\n" for p in files) + f"{di}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
        z.writestr(f"{di}/RECORD", record)
    return whl


def tree_state(root: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of everything under root, symlinks not followed:
    the independent oracle that tells whether a turn changed the scratch tree."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                # a directory's own mtime moves when a temporary entry comes
                # and goes (lock files): not a change worth a checkpoint
                out[os.path.relpath(p, root)] = (st.st_mode, 0, 0)
            else:
                out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


class CgroupCell:
    """A fresh cgroup under /sys/fs/cgroup/unified and a scratch directory."""

    _seq = 0

    def __init__(self, scratch_parent: Path, name: str = "") -> None:
        CgroupCell._seq += 1
        self.name = f"crabd-test-{os.getpid()}-{CgroupCell._seq}"
        self.cgroup = UNIFIED / self.name
        self.cgroup.mkdir()
        self.scratch = scratch_parent / self.name
        self.scratch.mkdir(parents=True)
        (self.scratch / "home").mkdir()
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": str(self.scratch / "home"),
            "LANG": "C.UTF-8",
            "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }  # fmt: skip

    def run(self, cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = cmd.replace("{venv_python}", sys.executable)
        wrapper = f'echo $$ > {self.cgroup}/cgroup.procs && exec sh -c "$0"'
        return subprocess.run(
            ["sh", "-c", wrapper, cmd], cwd=self.scratch, env=self.env, timeout=timeout,
            capture_output=True, text=True,
        )  # fmt: skip

    def setup(self, turn: LabelledTurn) -> None:
        if turn.setup == "make-wheel":
            make_wheel(self.scratch)
        elif turn.setup:
            r = self.run(turn.setup)
            if r.returncode != 0:
                raise RuntimeError(f"setup of {turn.name!r} failed: {r.stderr.strip()}")

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.cgroup / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        try:
            self.cgroup.rmdir()
        except OSError:
            pass
        subprocess.run(["rm", "-rf", str(self.scratch)], timeout=60)

    def __enter__(self) -> CgroupCell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TestPeer:
    """Two network namespaces joined by a veth pair (10.251.0.1/30 <->
    10.251.0.2/30) and a TCP listener in the second: an "outside" peer that
    is never a real outside address."""

    __test__ = False  # not a pytest class

    def __init__(self) -> None:
        self.listener: subprocess.Popen[bytes] | None = None

    def _ip(self, *args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def start(self) -> TestPeer:
        a, b = PEER_NS
        self.stop()
        self._ip("netns", "add", a)
        self._ip("netns", "add", b)
        self._ip("link", "add", "crabd-eva", "netns", a, "type", "veth", "peer", "name", "crabd-evb", "netns", b)
        self._ip("-n", a, "addr", "add", "10.251.0.1/30", "dev", "crabd-eva")
        self._ip("-n", b, "addr", "add", f"{PEER_ADDR}/30", "dev", "crabd-evb")
        for ns, dev in ((a, "crabd-eva"), (b, "crabd-evb")):
            self._ip("-n", ns, "link", "set", dev, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        server = (
            "import socket\n"
            f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{PEER_ADDR}', {PEER_PORT})); s.listen(16); print('ready', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept()\n"
            "    c.settimeout(2)\n"
            "    try: c.recv(4096); c.sendall(b'HTTP/1.0 200 OK\\r\\nContent-Length: 0\\r\\n\\r\\n')\n"
            "    except OSError: pass\n"
            "    c.close()\n"
        )
        self.listener = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{b}", _PY, "-c", server], stdout=subprocess.PIPE
        )
        assert self.listener.stdout is not None
        if self.listener.stdout.readline().strip() != b"ready":
            raise RuntimeError("test peer listener did not start")
        return self

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.kill()
            self.listener.wait()
            self.listener = None
        for ns in PEER_NS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
