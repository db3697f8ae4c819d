"""Aggregation of one sandbox's events and process snapshots into `Effects`.

Pure code: `TurnRecorder.add(event)` per decoded event, then
`TurnRecorder.effects(...)` with the process snapshots taken at the previous
and at this turn end. Shared by the BPF inspector and the /proc fallback.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Iterable

from ebpf._events import (
    AF_INET,
    AF_INET6,
    AF_NETLINK,
    AF_UNIX,
    AT_FDCWD,
    FILE_KINDS,
    O_CREAT,
    O_EXCL,
    O_TMPFILE,
    OPAQUE_FD_TAKEN,
    OPAQUE_OTHER_PROCESS,
    OPAQUE_PTRACE_POKE,
    OPAQUE_URING_SETUP,
    OPAQUE_URING_WORK,
    OPAQUE_VM_WRITE,
    URING_OPS,
    Event,
    EventKind,
    landed_scope,
)
from ebpf._proc import ProcInfo
from ebpf._queues import inotify_events_waiting
from ebpf.effects import (
    MAX_SAMPLES,
    NOT_RESTORED,
    Connections,
    Effects,
    ExecRecord,
    ProcessRecord,
    Sample,
    SocketRecord,
    Source,
)

def _pids_text(infos: list[ProcInfo], limit: int = 3) -> str:
    shown = ", ".join(f"{i.pid} {i.comm!r}" for i in infos[:limit])
    return shown + (f" and {len(infos) - limit} more" if len(infos) > limit else "")


# Programs whose run changes installed software (canonical name per binary).
PACKAGE_MANAGERS = {
    "apt": "apt", "apt-get": "apt", "aptitude": "apt", "dpkg": "dpkg", "dpkg-deb": "dpkg",
    "pip": "pip", "pipx": "pip", "uv": "pip", "poetry": "pip", "conda": "conda", "mamba": "conda",
    "npm": "npm", "npx": "npm", "yarn": "npm", "pnpm": "npm", "bun": "npm",
    "cargo": "cargo", "rustup": "cargo", "go": "go", "gem": "gem", "bundle": "gem", "bundler": "gem",
    "composer": "composer", "apk": "apk", "dnf": "rpm", "yum": "rpm", "rpm": "rpm",
}  # fmt: skip
# Programs that reach outside the sandbox whatever their arguments.
EXTERNAL_TOOLS = {
    "curl", "wget", "ssh", "scp", "sftp", "rsync", "nc", "ncat", "netcat", "socat", "telnet", "ftp",
    "sendmail", "mail", "mailx", "mutt", "gh", "aws", "gcloud", "az", "kubectl", "http", "https",
}  # fmt: skip
# Sub-commands that publish: (program, sub-command).
EXTERNAL_SUBCOMMANDS = {
    "git": {"push", "send-email"},
    "npm": {"publish"}, "yarn": {"publish"}, "pnpm": {"publish"},
    "cargo": {"publish"}, "twine": {"upload"}, "gem": {"push"}, "docker": {"push"}, "podman": {"push"},
}  # fmt: skip
# Init processes that only reap zombies: their waking up changes nothing.
# (crabd bind-mounts its init as /dev/.crabd-init, hence the comm with a dot)
DEFAULT_STATELESS = frozenset({"crabd-init", ".crabd-init", "tini", "dumb-init", "catatonit"})

_DEVICES = {
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/console",
    "/dev/ptmx", "/dev/kmsg",
}  # fmt: skip
# /proc paths that alias files of the file system.
_PROC_ALIAS = re.compile(r"^/proc/[^/]+/(fd|cwd|root|map_files|task/[^/]+/(fd|cwd|root))(/|$)")
# ... of them, those that reach a file through a process's open files: it may
# have no name left (deleted while held, a memfd), so only that process's image
# holds it. An open through one is resolved in the kernel (ebpf._events.
# landed_scope); any other change through one (truncate, chmod, xattr, ...),
# or an open the kernel side could not resolve, is taken as such a file. A
# link from one names the file in the snapshot (an O_TMPFILE made visible).
_PROC_FD = re.compile(r"^/proc/[^/]+/(fd|map_files|task/[^/]+/fd)/")
_OPAQUE = {OPAQUE_URING_SETUP: "io_uring", OPAQUE_VM_WRITE: "process_vm_writev",
           OPAQUE_PTRACE_POKE: "ptrace writes into another process",
           OPAQUE_FD_TAKEN: "pidfd_getfd: a file descriptor taken from another process",
           OPAQUE_OTHER_PROCESS: "another process's scheduling, I/O priority or limits changed"}
_KOBJ = {1: "System V shared memory", 2: "System V message queue", 3: "System V semaphore", 4: "POSIX mqueue"}


def path_scope(path: str) -> str:
    """Where a write to `path` lands: rootfs, device, process, kernel or tmpfs.

    Anything not absolute (relative to a cwd or a directory fd we cannot
    resolve) is rootfs, and symlinks are not resolved: `cd /dev/shm; echo >
    f` looks like a rootfs write here. A tmpfs change is still caught by the
    turn-end comparison of the memory file systems (ebpf._tmpfs), which does
    not depend on the path the write named."""
    if not path.startswith("/"):
        return "rootfs"
    p = posixpath.normpath(path)
    if p.startswith("//"):
        p = p[1:]
    if p in _DEVICES or p.startswith(("/dev/pts/", "/dev/tty")):
        return "device"
    if p in ("/dev/stdout", "/dev/stderr", "/dev/stdin") or p.startswith("/dev/fd/"):
        return "rootfs"  # aliases of open fds: may be files
    if p == "/dev" or p.startswith("/dev/"):
        return "tmpfs"  # runc's /dev (and /dev/shm, /dev/mqueue) is memory
    if _PROC_ALIAS.match(p):
        return "rootfs"
    if p.startswith(("/proc/self/", "/proc/thread-self/")):
        return "process"
    if p.startswith(("/proc/", "/sys/")) or p in ("/proc", "/sys"):
        return "kernel"
    return "rootfs"


def display_path(path: str, dfd: int) -> str:
    if not path:
        return f"fd{dfd}" if dfd != AT_FDCWD else "?"
    if path.startswith("/") or dfd == AT_FDCWD:
        return path
    return f"fd{dfd}:{path}"


def _canonical(name: str) -> str:
    base = posixpath.basename(name)
    return re.sub(r"[0-9.]+$", "", base) or base


def package_manager(filename: str, argv: Iterable[str]) -> str | None:
    args = list(argv)
    for cand in (args[0] if args else "", filename):
        pm = PACKAGE_MANAGERS.get(_canonical(cand))
        if pm:
            return pm
    # python -m pip / ensurepip
    if _canonical(args[0] if args else filename).startswith("python"):
        for i, a in enumerate(args[:-1]):
            if a == "-m" and args[i + 1] in ("pip", "ensurepip", "pipx", "uv"):
                return "pip"
    return None


def external_tool(filename: str, argv: Iterable[str]) -> str | None:
    args = list(argv)
    prog = _canonical(args[0] if args else filename)
    fprog = _canonical(filename)
    for p in (prog, fprog):
        if p in EXTERNAL_TOOLS:
            return p
        subs = EXTERNAL_SUBCOMMANDS.get(p)
        if subs:
            hit = next((a for a in args[1:] if a in subs), None)
            if hit:
                return f"{p} {hit}"
    return None


def _is_loopback(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _sockaddr(ev: Event) -> str:
    if ev.family == AF_INET:
        return f"{ev.addr}:{ev.port}"
    if ev.family == AF_INET6:
        return f"[{ev.addr}]:{ev.port}"
    if ev.family == AF_UNIX:
        return ev.path or "@"
    return f"family {ev.family}"


class TurnRecorder:
    """Accumulates one sandbox's events for one turn."""

    def __init__(self, max_samples: int = MAX_SAMPLES, outside: tuple[str, ...] = ()) -> None:
        self.max = max_samples
        # path prefixes that are not the sandbox's file system (host bind
        # mounts used by the runtime itself): writes there are "outside"
        self.outside = tuple(posixpath.normpath(p) for p in outside)
        self.files: dict[str, Sample] = {}
        self.special: dict[str, Sample] = {}
        self.flags_in_memory: list[str] = []  # inode flags set (chattr) on a memory file system
        self.execs: list[ExecRecord] = []
        self.exec_count = 0
        self.package_managers: set[str] = set()
        self.external: list[str] = []
        self.forks = 0
        self.conn = Connections()
        self.mounts = Sample()
        self.kobjs = Sample()
        self.blind: list[str] = []
        self.active_pids: set[int] = set()  # pids that did something traced
        self.exited_pids: set[int] = set()
        self._exec_args: dict[int, Event] = {}
        self._bound: dict[tuple[int, int], str] = {}
        self._listens: list[tuple[int, int]] = []
        # Files and directories this turn certainly created (O_CREAT|O_EXCL,
        # mkdir) by an absolute path, held back: if the same process deletes
        # the same path before the turn ends, both cancel out (lock files,
        # temporary files: git status takes and drops .git/index.lock).
        # Key: (pid, normalized path). The kernel's dedup forgets a path's
        # create entries when that process deletes it, so a re-create is seen.
        self._fresh: dict[tuple[int, str], tuple[str, str]] = {}
        self.transient = 0
        self.events = 0

    # -- helpers
    def _sample(self, table: dict[str, Sample], key: str, value: str) -> None:
        table.setdefault(key, Sample()).add(value, self.max)

    def _external(self, why: str) -> None:
        if why not in self.external and len(self.external) < self.max:
            self.external.append(why)

    @staticmethod
    def _fresh_key(ev: Event) -> tuple[int, str] | None:
        # Only absolute paths: a relative one may resolve elsewhere after a
        # chdir, or a directory fd reused for another directory.
        if not ev.path.startswith("/"):
            return None
        return (ev.pid, posixpath.normpath(ev.path))

    def _scope(self, path: str) -> str:
        if path.startswith("/") and self.outside:
            p = posixpath.normpath(path)
            if any(p == o or p.startswith(o + "/") for o in self.outside):
                return "outside"
        return path_scope(path) if path else "rootfs"

    def _file(self, kind: str, shown: str, paths: list[tuple[str, int]], landed: str | None = None) -> None:
        """`landed`: where the kernel says the (first) path's file is (an
        open's fsmagic): it overrides a path that only looked like the root
        file system (relative, through a dirfd or a symlink)."""
        scopes = {self._scope(p) for p, _dfd in paths}
        if landed and self._scope(paths[0][0]) == "rootfs":
            scopes.discard("rootfs")
            scopes.add(landed)
            shown = f"{shown} (a file only a process holds: deleted, or a memfd)" if landed == "held" \
                else f"{shown} (on {landed} fs)"
        if "rootfs" in scopes:
            self._sample(self.files, kind, shown)
        for s in scopes - {"rootfs"}:
            self._sample(self.special, s, shown)

    # -- the event sink
    def add(self, ev: Event) -> None:
        self.events += 1
        k = ev.kind
        if k != EventKind.EXIT:
            self.active_pids.add(ev.pid)
        if k in FILE_KINDS:
            a = display_path(ev.path, ev.dfd)
            if k == EventKind.OPEN_WRITE and not ev.path and ev.dfd != AT_FDCWD:
                a = f"handle@fd{ev.dfd}"
            paths = [(ev.path, ev.dfd)]
            if k in (EventKind.RENAME, EventKind.LINK):
                b = display_path(ev.path2, ev.dfd2)
                paths.append((ev.path2, ev.dfd2))
                shown = f"{a} -> {b}"
            elif k == EventKind.SYMLINK:
                shown = f"{a} -> {ev.path2}"
            elif k == EventKind.XATTR:
                shown = f"{a} [{ev.path2}]"
            else:
                shown = a
            if k == EventKind.OPEN_WRITE and ev.arg & O_TMPFILE == O_TMPFILE:
                # an unnamed file in a directory: invisible unless linkat()
                # names it later, and that is a LINK event of its own
                self.transient += 1
                return
            key = self._fresh_key(ev)
            if key is not None and (
                (k == EventKind.OPEN_WRITE and ev.arg & (O_CREAT | O_EXCL) == O_CREAT | O_EXCL) or k == EventKind.MKDIR
            ):
                self._fresh[key] = (FILE_KINDS[k], shown)
                return
            if key is not None and k in (EventKind.UNLINK, EventKind.RMDIR):
                if self._fresh.pop(key, None) is not None:
                    self.transient += 1
                    return
            resolved = k in (EventKind.OPEN_WRITE, EventKind.ATTR)  # the kernel side read where the fd's file is
            landed = landed_scope(ev.fsmagic, ev.fsmode) if resolved else None
            if landed is None and k != EventKind.LINK and (not resolved or not ev.fsmagic) and \
                    _PROC_FD.match(posixpath.normpath(ev.path or ".")):
                landed = "held"  # not resolved in the kernel: taken as a file only a process holds
            if k == EventKind.ATTR and landed == "tmpfs":
                self.flags_in_memory.append(shown)
            self._file(FILE_KINDS[k], shown, paths, landed)
        elif k == EventKind.EXEC_ARGS:
            self._exec_args[ev.tid] = ev
        elif k == EventKind.EXEC:
            attempt = self._exec_args.pop(ev.arg, None) or self._exec_args.pop(ev.pid, None)
            filename = attempt.path if attempt and attempt.path else ev.comm
            argv = list(attempt.argv) if attempt else [ev.comm]
            pm = package_manager(filename, argv)
            ext = external_tool(filename, argv)
            self.exec_count += 1
            if pm:
                self.package_managers.add(pm)
            if ext:
                self._external(f"exec of {ext}: {' '.join(argv)[:120]}")
            if len(self.execs) < self.max:
                self.execs.append(
                    ExecRecord(pid=ev.pid, filename=filename, argv=argv, package_manager=pm, external_tool=ext)
                )
        elif k == EventKind.FORK:
            self.forks += 1
        elif k == EventKind.EXIT:
            self.exited_pids.add(ev.pid)
        elif k in (EventKind.CONNECT, EventKind.SEND):
            self._connect(ev)
        elif k == EventKind.BIND:
            self._bound[(ev.pid, ev.arg)] = _sockaddr(ev)
            if ev.family == AF_UNIX and ev.path and not ev.path.startswith("@"):
                self._file("socket", ev.path, [(ev.path, AT_FDCWD)])
        elif k == EventKind.LISTEN:
            self._listens.append((ev.pid, ev.arg))
        elif k in (EventKind.MOUNT, EventKind.UMOUNT):
            verb = "mount" if k == EventKind.MOUNT else "umount"
            what = ev.path or "(fd)"
            self.mounts.add(f"{verb} {what}" + (f" ({ev.path2})" if ev.path2 else ""), self.max)
        elif k == EventKind.KERNEL_OBJECT:
            self.kobjs.add(_KOBJ.get(ev.arg, "kernel object") + (f" {ev.path}" if ev.path else ""), self.max)
        elif k == EventKind.OPAQUE:
            b = _OPAQUE.get(ev.arg, "an opaque call")
            if ev.arg == OPAQUE_URING_WORK:
                op = URING_OPS[ev.ret] if 0 <= ev.ret < len(URING_OPS) else None
                b = f"io_uring work of {ev.pid} {ev.comm!r} ({op or 'a request submitted earlier'})"
            if b not in self.blind:
                self.blind.append(b)

    def _connect(self, ev: Event) -> None:
        if ev.family in (0, AF_NETLINK):
            return  # AF_UNSPEC dissolves an association; netlink talks to the kernel
        dest = _sockaddr(ev)
        if ev.family == AF_UNIX:
            self.conn.unix.add(dest, self.max)
        elif ev.family in (AF_INET, AF_INET6) and _is_loopback(ev.addr):
            self.conn.loopback.add(dest, self.max)
        else:
            self.conn.external.add(dest, self.max)
            self._external(f"{'connect' if ev.kind == EventKind.CONNECT else 'send'} to {dest} ({ev.comm})")

    def _flush_fresh(self) -> None:
        for (_pid, path), (kind, shown) in self._fresh.items():
            self._file(kind, shown, [(path, AT_FDCWD)])
        self._fresh.clear()

    def carry_over(self, nxt: TurnRecorder) -> None:
        """Hand exec attempts not yet confirmed to the next turn's recorder."""
        for tid, ev in self._exec_args.items():
            nxt._exec_args.setdefault(tid, ev)
        nxt.outside = self.outside
        self._exec_args.clear()

    # -- the result
    def effects(
        self,
        *,
        sandbox_id: str,
        turn: int,
        source: Source,
        started_ns: int,
        ended_ns: int,
        before: dict[int, ProcInfo],
        after: dict[int, ProcInfo],
        write_syscalls: int = 0,
        dropped: int = 0,
        stateless: frozenset[str] = DEFAULT_STATELESS,
        listening_now: dict[int, list[str]] | None = None,
        notes: list[str] | None = None,
        external_unknown: bool = False,
        suppressed: dict[int, int] | None = None,
        tmpfs_changed: list[str] | None = None,
    ) -> Effects:
        self._flush_fresh()
        notes = list(notes or [])
        waiting = [i for _p, i in sorted(after.items()) if inotify_events_waiting(i.queued)]
        if waiting:
            notes.append(f"{NOT_RESTORED}inotify events waiting for {_pids_text(waiting)}: a restore gives back "
                         "the instance and its watches, not the events (CRIU)")
        if self.flags_in_memory:
            notes.append(f"{NOT_RESTORED}inode flags set on a memory file system ({', '.join(self.flags_in_memory[:3])}): "
                         "a restore gives back the files of a tmpfs, not their chattr flags (CRIU)")
        if tmpfs_changed:
            # seen by comparing the memory file systems' state (ebpf._tmpfs),
            # whatever path, fd or mapping the change went through
            for p in tmpfs_changed:
                self._sample(self.special, "tmpfs", f"{p} (changed in memory)")
        if suppressed:
            # counted in the kernel only: all plain (rootfs) file changes
            for kind, n in sorted(suppressed.items()):
                name = FILE_KINDS.get(EventKind(kind), "write")
                self.files.setdefault(name, Sample()).count += n
            notes.append(
                f"{sum(suppressed.values())} file events past the per-turn sample budget were counted, not sampled"
            )

        def rec(i: ProcInfo) -> ProcessRecord:
            return ProcessRecord(pid=i.pid, comm=i.comm, cmdline=list(i.cmdline))

        new = [rec(i) for p, i in sorted(after.items()) if p not in before or before[p].start != i.start]
        exited = [rec(i) for p, i in sorted(before.items()) if p not in after or after[p].start != i.start]
        active = []
        for pid, i in sorted(after.items()):
            b = before.get(pid)
            if b is None or b.start != i.start or i.comm in stateless:
                continue
            if pid in self.active_pids or i.ran_since(b):
                active.append(rec(i))
        listening = [
            SocketRecord(pid=pid, address=self._bound.get((pid, fd), "?"), alive=pid in after)
            for pid, fd in self._listens
        ]
        seen = {(s.pid, s.address) for s in listening}
        for pid, addrs in (listening_now or {}).items():
            for a in addrs:
                if (pid, a) not in seen:
                    listening.append(SocketRecord(pid=pid, address=a, alive=True))
        external = list(self.external)
        if dropped:
            external_unknown = True
        return Effects(
            sandbox_id=sandbox_id,
            turn=turn,
            source=source,
            started_ns=started_ns,
            ended_ns=ended_ns,
            files=self.files,
            special_writes=self.special,
            write_syscalls=write_syscalls,
            transient_files=self.transient,
            execs=self.execs,
            exec_count=self.exec_count,
            package_managers=sorted(self.package_managers),
            processes_started=self.forks,
            new_processes=new,
            exited_processes=exited,
            active_processes=active,
            listening=listening,
            connections=self.conn,
            mounts=self.mounts,
            kernel_objects=self.kobjs,
            blind_spots=list(self.blind),
            dropped_events=dropped,
            external=bool(external),
            external_reasons=external,
            external_unknown=external_unknown,
            notes=notes,
        )
