"""The process half of crabd's checkpoints: thin glue between the runtime's
sandboxes and deltacr.

    info = checkpoint_processes(rt, "agent-1", store, "sb-x@7", fs_commit=lambda: snaps.checkpoint(key))
    ... the agent breaks things ...
    restore_processes(rt, "agent-1", store, "sb-x@7")   # root already rolled back by deltafs
    st = prepare_standby(rt, "agent-1", store, "sb-x@7", root=snaps.prepare(fork_key, parent=name))
    promote_standby(rt, st)                              # rollback as a SIGCONT

What deltacr cannot know and this module supplies: runc's root and binary,
the sandbox's bundle, cgroup and freezer, and where standbys live
(`<state>/standbys/<sandbox id>/<token>/`, outside the sandbox dir so that
destroying a sandbox never deletes through a standby's mounted root).

A standby is a runc container with the sandbox's own id under a runc root of
its own, restored from the sandbox's bundle config with its own root and its
own cgroup (`/crabd/<id>.<token>`), and CRIU's `leave-stopped` (through the
bundle's `org.criu.config` annotation): its tasks exist, hold their memory
and sockets, and do not run. Promotion kills the sandbox's current init,
installs the standby's runc state as the sandbox's, sends SIGCONT to every
standby task, then moves them into the sandbox's cgroups and binds the
standby's root at the sandbox's bundle/rootfs: from then on the runtime
sees it as the sandbox (exec, freeze, pids, stop/start).

Standbys are bounded by deltacr.StandbyPolicy (per sandbox, host memory);
`make_room_for_standby` applies it. Errors: crabd's own (SandboxNotRunning,
FailedPrecondition, NotFound) and deltacr's (CriuFailed with CRIU's `Error`
lines, ImageCorrupted, CriuUnavailable, AlreadyExists), left as they are for
the API layer to map.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deltacr import (Admission, AlreadyExists, CriuFailed, DumpOptions, ImageStore, RestoreOptions, Runc,
                     StandbyPolicy, StandbyRecord, capture_consistent, skipped_in_flight)
from deltacr.compat import host_criu
from deltafs import Mount, is_mountpoint, mount_all, unmount

from ..errors import CommandFailed, FailedPrecondition, NotFound, SandboxNotRunning
from ..runner import Completed, SubprocessRunner
from .cgroups import Freezer
from .sandbox import Runtime, Sandbox, reap

log = logging.getLogger(__name__)

__all__ = ["ProcessCheckpoint", "Standby", "checkpoint_processes", "restore_processes", "rollback_processes",
           "prepare_standby", "promote_standby", "discard_standby", "list_standbys", "remove_standby_leftovers", "make_room_for_standby", "gc_scratch",
           "CheckpointableRunner"]


@dataclass(frozen=True)
class ProcessCheckpoint:
    checkpoint_id: str
    sandbox_id: str
    raw_bytes: int          # size of the CRIU image
    pause_ms: float         # sandbox frozen: fs commit + dump
    fs_ms: float
    dump_ms: float
    store_ms: float         # compress + de-duplicate, after the thaw
    fs_result: Any = None   # what fs_commit returned
    digest: str = ""        # the manifest's
    written_bytes: int = 0  # what the de-duplicated, compressed store actually wrote
    notes: tuple[str, ...] = ()  # what the image leaves out, for the checkpoint's reasons


@dataclass
class Standby:
    sandbox_id: str
    checkpoint_id: str
    token: str
    dir: Path
    root: list[Mount]
    pid: int                # host pid of its (stopped) init
    memory_bytes: int
    created: float
    prepare_ms: float = 0.0
    promote_ms: float | None = field(default=None)  # until its processes run
    swap_ms: float | None = field(default=None)     # ... and sit in the sandbox's cgroups

    @property
    def bundle(self) -> Path:
        return self.dir / "bundle"

    @property
    def runc_root(self) -> Path:
        return self.dir / "runc"

    @property
    def cgroup_rel(self) -> str:
        return f"/crabd/{self.sandbox_id}.{self.token}"

    def record(self) -> StandbyRecord:
        return StandbyRecord(self.sandbox_id, self.checkpoint_id, self.memory_bytes, self.created)

    def to_dict(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox_id, "checkpoint_id": self.checkpoint_id, "token": self.token,
                "root": [m.to_dict() for m in self.root], "pid": self.pid, "memory_bytes": self.memory_bytes,
                "created": self.created, "prepare_ms": self.prepare_ms}


def _runc(rt: Runtime, root: Path | None = None) -> Runc:
    # CRABD_CRIU: the CRIU command runc runs (default `criu` on PATH); tests
    # point it at a wrapper that makes CRIU fail (tests/integration/test_criu_failure.py).
    criu = host_criu(rt.state_dir / "deltacr", criu=os.environ.get("CRABD_CRIU") or "criu")
    return Runc(root or rt.runc_root, runc=rt.runc_bin, criu=criu)


def _running(rt: Runtime, ref: str) -> Sandbox:
    sb = rt.get(ref)
    if sb.status not in ("running", "paused"):
        raise SandboxNotRunning(f"sandbox {sb.id} is {sb.status}; there are no processes to checkpoint")
    return sb


# --- checkpoint / restore ------------------------------------------------------------------------
def checkpoint_processes(rt: Runtime, sandbox_ref: str, store: ImageStore, checkpoint_id: str,
                         fs_commit: Callable[[], Any] | None = None,
                         opts: DumpOptions | None = None) -> ProcessCheckpoint:
    """Dump the sandbox's processes into `store` as `checkpoint_id`, the
    sandbox frozen from the start of `fs_commit` until the dump is done.
    Options: DumpOptions.for_private_netns (TCP connections, file locks and
    leases dumped) unless `opts` says otherwise.

    On a CRIU refusal raises deltacr.CriuFailed (CRIU's reasons, the log kept
    in store.log_dir(checkpoint_id)); the sandbox keeps running as it was.
    If `fs_commit` had succeeded, the error's `.fs_result` holds what it
    returned (a file-system checkpoint without its processes)."""
    sb = _running(rt, sandbox_ref)
    if store.exists(checkpoint_id):
        raise AlreadyExists(f"checkpoint {checkpoint_id!r} already has a process image")
    init_pid = sb.pid
    _check_init_stdio(sb, init_pid)
    freezer = Freezer(rt.layout, sb.cgroup_rel)
    was_frozen = freezer.state() == "FROZEN"
    if freezer.v1 and not was_frozen:
        _check_not_stopped(sb, freezer.dir / "cgroup.procs")
    _check_one_time_ns(sb, freezer.dir / "cgroup.procs")
    if opts is None:
        opts = DumpOptions.for_private_netns(tcp_connections=_tcp_connected(init_pid))
    runc = _runc(rt)
    work = _scratch(store, "dump-", _rss_bytes(freezer.dir / "cgroup.procs"))
    img, logs = work / "image", work / "work"

    def dump() -> float:
        _check_tree(sb, freezer.dir / "cgroup.procs", init_pid)
        return runc.checkpoint(sb.id, img, logs, opts)

    try:
        dumped = False
        try:
            cap = capture_consistent(freezer.freeze, (lambda: None) if was_frozen else freezer.thaw, dump, fs_commit)
            dumped = True
        except CriuFailed as e:
            kept = store.log_dir(checkpoint_id)
            kept.mkdir(parents=True, exist_ok=True)
            if e.log_path and os.path.isfile(e.log_path):
                shutil.copyfile(e.log_path, kept / "dump.log")
                e.log_path = str(kept / "dump.log")
            raise
        finally:
            if not dumped:
                _unlock_network(sb, init_pid)
            _check_thawed(sb, freezer, was_frozen)
        notes = _dump_notes(logs / "dump.log")
        t = time.monotonic()
        m = store.put(checkpoint_id, img, logs=[logs / "dump.log"],
                      meta={"sandbox_id": sb.id, "options": opts.to_dict(), "kind": "criu-runc"})
        store_s = time.monotonic() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ProcessCheckpoint(checkpoint_id, sb.id, m.raw_bytes, cap.pause_seconds * 1e3, cap.fs_seconds * 1e3,
                             cap.dump_seconds * 1e3, store_s * 1e3, cap.fs_result, m.digest, m.written, notes)


def _dump_notes(log: Path) -> tuple[str, ...]:
    """What a successful dump left out of the image, from CRIU's log."""
    try:
        data = log.read_bytes()
    except OSError:
        return ()
    # The log can be megabytes (level 4): a byte search first, the parse only on a hit.
    skipped = skipped_in_flight(data.decode(errors="replace")) if b"in-flight" in data else []
    if not skipped:
        return ()
    return (f"not-yet-accepted TCP connections left out of the process image ({len(skipped)} listening "
            "socket(s), CRIU --skip-in-flight): their clients see a reset after a restore",)


# Scratch space for CRIU images on their way into or out of the store: a
# tmpfs when it has room (CRIU and the store then never wait on disk
# writeback; measured: staging 200 MiB took 0.28-0.38 s on /dev/shm against
# 0.49-0.64 s on the state dir's disk here), else the store's own tmp/.
_TMPFS = Path("/dev/shm")


def _scratch(store: ImageStore, prefix: str, need_bytes: int) -> Path:
    try:
        st = os.statvfs(_TMPFS)
        room = st.f_bavail * st.f_frsize
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        if room > 2 * need_bytes + (64 << 20) and avail > 4 * need_bytes + (256 << 20):
            return Path(tempfile.mkdtemp(prefix=f"crabd-cr-{prefix}", dir=_TMPFS))
    except (OSError, StopIteration, ValueError):
        pass
    return store.tmpdir(prefix)


def gc_scratch(grace: float = 3600.0) -> int:
    """Remove scratch dirs a crashed crabd left on the tmpfs; returns how many."""
    n = 0
    now = time.time()
    for d in _TMPFS.glob("crabd-cr-*"):
        try:
            if now - d.lstat().st_mtime >= grace and d.is_dir() and not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
                n += 1
        except FileNotFoundError:
            pass
    return n


def _rss_bytes(procs_file: Path) -> int:
    """Resident memory of the tasks in a cgroup: about what a dump writes."""
    total = 0
    try:
        pids = procs_file.read_text().split()
    except OSError:
        return 1 << 30
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


def _ppid_comm(pid: int) -> tuple[int, str]:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    comm = data[data.index(b"(") + 1:data.rindex(b")")].decode(errors="replace")
    return int(data[data.rindex(b")") + 2:].split()[1]), comm


def _check_init_stdio(sb: Sandbox, init_pid: int | None) -> None:
    """CRIU cannot dump a file the init holds from outside the sandbox's
    mounts (Runtime.start's init.log): say so with the fix, before freezing."""
    for fd in (0, 1, 2):
        try:
            target = os.readlink(f"/proc/{init_pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/"):
            raise FailedPrecondition(
                f"the init of sandbox {sb.id} holds {target} (fd {fd}), a host file CRIU cannot dump",
                fix="start sandboxes with Runtime(runner=CheckpointableRunner()) so the init's output is a pipe")


# Why a stopped task cannot be dumped on a cgroup v1 host, for the reasons of
# the checkpoint and `crabd doctor` (seen here: CRIU 4.1.1's log ends at the
# SEIZE of the task before the stopped one, and the dump never returns).
STOPPED_TASK_LIMIT = (
    "host limit: this host's cgroup v1 freezer and ptrace cannot seize a stopped task: runc always has CRIU "
    "freeze the sandbox's freezer cgroup, and PTRACE_SEIZE of a task in group stop waits for the task to leave "
    "the stop, which a frozen task never does (the kernel loses the wake-up; CRIU hangs, upstream: all its "
    "stopped* tests fail with --freeze-cgroup, criu PR #1905)")


def _procs(procs_file: Path) -> list[int]:
    """The pids a cgroup.procs file lists (none when it cannot be read)."""
    try:
        return [int(x) for x in procs_file.read_text().split()]
    except OSError:
        return []


def _check_not_stopped(sb: Sandbox, procs_file: Path) -> None:
    """Refuse, before freezing, a dump CRIU would hang in: a task stopped by
    SIGSTOP/SIGTSTP/SIGTTIN/SIGTTOU (state T) on a cgroup v1 freezer."""
    stopped = []
    for pid in _procs(procs_file):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if data[data.rindex(b")") + 2:][:1] == b"T":
            stopped.append(f"{pid} ({data[data.index(b'(') + 1:data.rindex(b')')].decode(errors='replace')})")
    if stopped:
        raise FailedPrecondition(f"sandbox {sb.id} has stopped tasks: {', '.join(stopped[:8])}; {STOPPED_TASK_LIMIT}",
                                 fix="let stopped tasks continue (SIGCONT) before the turn ends to have the "
                                     "processes checkpointed")


TIME_NS_LIMIT = ("CRIU restores processes in a time namespace of its own, runc 1.1 starts commands exec'd "
                 "later in the host's, and CRIU can dump but not restore a tree that spans two time "
                 "namespaces (\"Can't restore sub-task in NS\")")


def _check_one_time_ns(sb: Sandbox, procs_file: Path) -> None:
    """Refuse a dump whose restore is known to fail: tasks in more than one
    time namespace (the sandbox was restored by CRIU, then a command was
    exec'd in it). Found by the ground-truth oracle (bench/oracle.py): the
    dump succeeded and every later restore fell back to a fresh init."""
    seen: dict[int, list[int]] = {}
    for pid in _procs(procs_file):
        try:
            seen.setdefault(os.stat(f"/proc/{pid}/ns/time").st_ino, []).append(pid)
        except OSError:
            continue  # gone, or no time namespaces on this kernel
    if len(seen) > 1:
        groups = "; ".join(f"{', '.join(map(str, p[:4]))}{' ...' if len(p) > 4 else ''}" for p in seen.values())
        raise FailedPrecondition(f"sandbox {sb.id} has processes in {len(seen)} time namespaces ({groups}): "
                                 f"{TIME_NS_LIMIT}",
                                 fix="roll back to or fork the checkpoint before the commands started after "
                                     "the last restore, or let those commands exit before the turn ends")


def _tcp_connected(pid: int | None) -> bool:
    """Has the network namespace of `pid` a TCP socket that a process holds
    (inode not 0: TIME_WAIT and orphaned sockets are not dumped) and that is
    neither listening nor closed (/proc/PID/net/tcp{,6}, columns `st`, `inode`)?"""
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                if tcp_table_connected(f.read()):
                    return True
        except OSError:
            return True  # cannot tell: lock, the safe side
    return False


def tcp_table_connected(table: str) -> bool:
    """The test of _tcp_connected on the text of one /proc/net/tcp table. Pure."""
    rows = (ln.split() for ln in table.splitlines()[1:])
    return any(len(r) > 9 and r[3] not in ("0A", "07") and r[9] != "0" for r in rows)


def _unlock_network(sb: Sandbox, pid: int | None) -> None:
    """Remove CRIU's network lock from the sandbox's network namespace if a
    dump left it there: CRIU unlocks on every failure it survives, but one
    killed (stalled, timed out) after locking leaves its `CRIU` chain, which
    drops every packet on the sandbox's loopback. The same rules CRIU's own
    unlock deletes (criu/net.c), IPv4 and IPv6; nothing when there is no
    such chain (one `iptables -C` each)."""
    for tool in ("iptables", "ip6tables"):
        exe, nsenter = shutil.which(tool), shutil.which("nsenter")
        if not exe or not nsenter or not pid:
            continue
        enter = [nsenter, "-t", str(pid), "-n", exe, "-w", "5"]
        try:
            if subprocess.run(enter + ["-C", "INPUT", "-j", "CRIU"], capture_output=True, timeout=15).returncode:
                continue
            log.warning("removing CRIU's network lock left in sandbox %s (%s)", sb.id, tool)
            for rule in (["-D", "INPUT", "-j", "CRIU"], ["-D", "OUTPUT", "-j", "CRIU"], ["-F", "CRIU"], ["-X", "CRIU"]):
                subprocess.run(enter + rule, capture_output=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            log.warning("could not check %s for CRIU's network lock in sandbox %s", tool, sb.id, exc_info=True)


def _check_thawed(sb: Sandbox, freezer: Freezer, was_frozen: bool) -> None:
    """After a dump, failed or not, the sandbox is as frozen as it was
    before: a CRIU left behind could re-freeze it (it restores the freezer
    state it found), so look, and thaw again if needed."""
    if was_frozen:
        return
    try:
        if freezer.state() != "THAWED":
            log.warning("sandbox %s was left %s after a dump; thawing it", sb.id, freezer.state())
            freezer.thaw()
    except FileNotFoundError:
        pass  # the sandbox is gone


def _check_tree(sb: Sandbox, procs_file: Path, init_pid: int | None) -> None:
    """CRIU dumps the tree of the sandbox's init. A command still running
    through `runc exec` is not in it (its parent was runc, outside the
    sandbox), and would silently be missing from the image: refuse."""
    if init_pid is None:
        raise SandboxNotRunning(f"sandbox {sb.id} has no init")
    outside = []
    for pid in (int(x) for x in procs_file.read_text().split()):
        p, comm, hops = pid, "", 0
        try:
            _, comm = _ppid_comm(pid)
            while p not in (init_pid, 0, 1) and hops < 4096:
                p, _ = _ppid_comm(p)
                hops += 1
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue  # gone meanwhile
        if p != init_pid and pid != init_pid:
            outside.append(f"{pid} ({comm})")
    if outside:
        raise FailedPrecondition(
            f"sandbox {sb.id} has processes outside its init's tree: {', '.join(outside[:8])}; "
            "they belong to a command still running through exec, and CRIU would not dump them",
            fix="checkpoint when no exec is in progress (at the turn boundary)")


def _restore_opts(store: ImageStore, checkpoint_id: str) -> RestoreOptions:
    meta = store.manifest(checkpoint_id).meta
    return RestoreOptions.from_dump(DumpOptions.from_dict(meta.get("options") or {}))


def _restore_into(rt: Runtime, store: ImageStore, checkpoint_id: str, container_id: str, bundle: Path,
                  runc: Runc, opts: RestoreOptions, image: Path) -> int:
    work = store.tmpdir("restore-")
    try:
        try:
            return runc.restore(container_id, bundle, image, work, opts)
        except CriuFailed as e:
            kept = store.log_dir(checkpoint_id)
            kept.mkdir(parents=True, exist_ok=True)
            if e.log_path and os.path.isfile(e.log_path):
                dst = kept / f"restore-{int(time.time())}-{secrets.token_hex(2)}.log"
                shutil.copyfile(e.log_path, dst)
                e.log_path = str(dst)
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def restore_processes(rt: Runtime, sandbox_ref: str, store: ImageStore, checkpoint_id: str,
                      opts: RestoreOptions | None = None) -> Sandbox:
    """Replace the sandbox's processes with those of `checkpoint_id`.

    The sandbox's root (sb.root, mounted at bundle/rootfs) must already be
    the file-system state of the same checkpoint. The image is verified
    before the sandbox is touched: a corrupted one raises
    deltacr.ImageCorrupted and the sandbox stays as it was."""
    sb = rt.get(sandbox_ref)
    ropts = opts or _restore_opts(store, checkpoint_id)
    image = _scratch(store, "image-", store.manifest(checkpoint_id).raw_bytes)
    runc = _runc(rt)
    try:
        store.get(checkpoint_id, image)          # verifies everything first
        _kill_init(rt, sb)
        if sb.status != "absent":
            runc.delete(sb.id, force=True)
        if not is_mountpoint(str(sb.rootfs)):
            mount_all(sb.root, str(sb.rootfs))
        pid = _restore_into(rt, store, checkpoint_id, sb.id, sb.bundle, runc, ropts, image)
    finally:
        shutil.rmtree(image, ignore_errors=True)
    sb.status, sb.pid = "running", pid
    return sb


def _kill_init(rt: Runtime, sb: Sandbox, timeout: float = 10.0) -> None:
    """SIGKILL the sandbox's init and wait until it is dead: the kernel
    kills the rest of its pid namespace. Faster than `runc delete --force`
    (~100 ms here: it freezes, signals and waits on every task) or
    Runtime.stop (polls `runc state`); the root stays mounted."""
    if not sb.pid:
        return
    fz = Freezer(rt.layout, sb.cgroup_rel)
    try:
        if fz.state() == "FROZEN":
            fz.thaw()  # SIGKILL reaches frozen tasks only once thawed
    except (FailedPrecondition, OSError):
        pass
    try:
        os.kill(sb.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # The init is often ours: runc create's child, re-parented to
            # the runtime (a subreaper). Reap it, or it lingers as a zombie.
            done, _ = os.waitpid(sb.pid, os.WNOHANG)
            if done == sb.pid:
                return
        except ChildProcessError:
            try:
                with open(f"/proc/{sb.pid}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                        return
            except (FileNotFoundError, ProcessLookupError):
                return
        time.sleep(0.0005)


def rollback_processes(rt: Runtime, sandbox_ref: str, store: ImageStore, checkpoint_id: str | None) -> Sandbox:
    """Processes of a rollback: the checkpoint's image when it has one, else a
    fresh init (a checkpoint taken with the FS plan only)."""
    if checkpoint_id is not None and store.exists(checkpoint_id):
        return restore_processes(rt, sandbox_ref, store, checkpoint_id)
    sb = rt.stop(sandbox_ref)
    return rt.start(sb.id)


# --- hot standbys ----------------------------------------------------------------------------------
def _standbys_dir(rt: Runtime, sandbox_id: str) -> Path:
    return rt.state_dir / "standbys" / sandbox_id


def prepare_standby(rt: Runtime, sandbox_ref: str, store: ImageStore, checkpoint_id: str,
                    root: list[Mount]) -> Standby:
    """Restore `checkpoint_id` next to the sandbox, stopped, on `root` (its
    own file-system fork of the checkpoint, e.g. a deltafs snapshot)."""
    t0 = time.monotonic()
    sb = rt.get(sandbox_ref)
    m = store.manifest(checkpoint_id)
    ropts = _restore_opts(store, checkpoint_id)
    token = secrets.token_hex(4)
    d = _standbys_dir(rt, sb.id) / token
    (d / "bundle" / "rootfs").mkdir(parents=True)
    cfg = json.loads((sb.bundle / "config.json").read_text())
    cfg.setdefault("annotations", {})["org.criu.config"] = str(d / "criu.conf")
    cfg["linux"]["cgroupsPath"] = f"/crabd/{sb.id}.{token}"
    (d / "criu.conf").write_text("leave-stopped\n")
    (d / "bundle" / "config.json").write_text(json.dumps(cfg, indent=2))
    st = Standby(sb.id, checkpoint_id, token, d, list(root), 0,
                 sum(f.size for f in m.files if f.name.startswith("pages-")), time.time())
    image = _scratch(store, "image-", m.raw_bytes)
    try:
        store.get(checkpoint_id, image)
        mount_all(st.root, str(st.bundle / "rootfs"))
        st.pid = _restore_into(rt, store, checkpoint_id, sb.id, st.bundle, _runc(rt, st.runc_root), ropts, image)
    except BaseException:
        _discard_dir(rt, st)
        raise
    finally:
        shutil.rmtree(image, ignore_errors=True)
    st.prepare_ms = (time.monotonic() - t0) * 1e3
    (d / "standby.json").write_text(json.dumps(st.to_dict(), indent=2))
    return st


def make_room_for_standby(rt: Runtime, policy: StandbyPolicy, sandbox_ref: str, store: ImageStore,
                          checkpoint_id: str) -> Admission:
    """Ask `policy` whether a standby of `checkpoint_id` may be prepared,
    and discard the standbys it says must go first (host-wide)."""
    sb = rt.get(sandbox_ref)
    m = store.manifest(checkpoint_id)
    new = StandbyRecord(sb.id, checkpoint_id, sum(f.size for f in m.files if f.name.startswith("pages-")), time.time())
    current = list_standbys(rt)
    adm = policy.admit(new, [s.record() for s in current])
    if adm.admit:
        for ev in adm.evict:
            for s in current:
                if s.sandbox_id == ev.sandbox_id and s.checkpoint_id == ev.checkpoint_id:
                    discard_standby(rt, s)
    return adm


def list_standbys(rt: Runtime, sandbox_ref: str | None = None) -> list[Standby]:
    base = rt.state_dir / "standbys"
    dirs = [base / rt.get(sandbox_ref).id] if sandbox_ref else (sorted(base.iterdir()) if base.is_dir() else [])
    out = []
    for sd in dirs:
        if not sd.is_dir():
            continue
        for d in sorted(sd.iterdir()):
            try:
                j = json.loads((d / "standby.json").read_text())
            except (FileNotFoundError, ValueError):
                continue
            out.append(Standby(j["sandbox_id"], j["checkpoint_id"], j["token"], d,
                               [Mount.from_dict(x) for x in j["root"]], j["pid"], j["memory_bytes"], j["created"],
                               j.get("prepare_ms", 0.0)))
    return out


def _cgroup_paths(state: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in (state.get("cgroup_paths") or {}).items() if v}


def promote_standby(rt: Runtime, st: Standby) -> Sandbox:
    """Make the standby the sandbox: its processes replace the sandbox's.

    Critical path: kill the sandbox's init (its pid namespace dies with
    it), install the standby's runc state as the sandbox's, SIGCONT every
    standby task -- `st.promote_ms` is the time until the checkpoint's
    processes run again. Then their tasks move into the sandbox's cgroups
    (`st.swap_ms` includes that: the first cgroup migration waits for an
    RCU grace period, ~5-10 ms here, unless the cgroup hierarchy is mounted
    with `favordynmods`). Reaping the old tasks, the root mount and removing
    the standby's dir happen after both clocks stop."""
    sb = rt.get(st.sandbox_id)  # before the clock: a runc spawn, not part of the swap
    try:
        stopped = Path(f"/proc/{st.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, IndexError):
        stopped = False
    if not stopped:
        raise FailedPrecondition(f"standby {st.token} of sandbox {sb.id} (checkpoint {st.checkpoint_id}) "
                                 "is gone or was resumed; the sandbox is left as it is",
                                 fix="discard it and restore the checkpoint instead")
    t0 = time.monotonic()
    old_state_path = rt.runc_root / sb.id / "state.json"
    new_state_path = st.runc_root / sb.id / "state.json"
    try:
        new_state = json.loads(new_state_path.read_text())
    except FileNotFoundError:
        raise NotFound(f"standby {st.token} of sandbox {sb.id} has no runc state (discarded?)") from None
    src_rel, dst_rel = st.cgroup_rel, sb.cgroup_rel
    paths = _cgroup_paths(new_state)
    # 1. End the sandbox's current processes; frozen tasks only die once thawed.
    if sb.pid:
        fz = Freezer(rt.layout, sb.cgroup_rel)
        try:
            if fz.state() == "FROZEN":
                fz.thaw()
        except (FailedPrecondition, FileNotFoundError):
            pass
        try:
            os.kill(sb.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # 2. The standby's runc state becomes the sandbox's (its cgroups, its bundle).
    text = json.dumps(new_state).replace(src_rel, dst_rel).replace(str(st.bundle), str(sb.bundle))
    state = json.loads(text)
    labels = state.get("config", {}).get("labels") or []
    state["config"]["labels"] = [lb for lb in labels if not lb.startswith("org.criu.config=")]
    old_state_path.parent.mkdir(mode=0o711, parents=True, exist_ok=True)
    tmp = old_state_path.with_suffix(".promote")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, old_state_path)
    # 3. Run.
    src_procs = Path(paths.get("freezer") or next(iter(paths.values()))) / "cgroup.procs"
    moved = [int(x) for x in src_procs.read_text().split()]
    for pid in moved:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    st.promote_ms = (time.monotonic() - t0) * 1e3
    # 4. Into the sandbox's cgroups, hierarchy by hierarchy (same limits
    #    on both sides meanwhile: the standby's config is the sandbox's).
    for _, p in sorted(paths.items()):
        src = Path(p)
        dst = Path(p.replace(src_rel, dst_rel))
        if not dst.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            _copy_limits(src, dst)
        for pid in (int(x) for x in (src / "cgroup.procs").read_text().split()):
            try:
                with open(dst / "cgroup.procs", "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                pass
    st.swap_ms = (time.monotonic() - t0) * 1e3
    _after_promotion(rt, sb, st, src_rel, paths)
    sb.status, sb.pid = "running", st.pid
    return sb


def _copy_limits(src: Path, dst: Path) -> None:
    # cpuset first: a v1 cpuset cgroup with no cpus refuses tasks (ENOSPC).
    for name in ("cpuset.cpus", "cpuset.mems", "memory.limit_in_bytes", "pids.max", "cpu.cfs_period_us", "cpu.cfs_quota_us", "memory.max",
                 "cpu.max"):
        try:
            v = (src / name).read_text().strip()
            (dst / name).write_text(v)
        except OSError:
            pass


def _after_promotion(rt: Runtime, sb: Sandbox, st: Standby, src_rel: str, paths: dict[str, str]) -> None:
    # The sandbox's root becomes the standby's: bind it where the runtime
    # expects the root, so a later stop + start (fresh init) uses it too.
    rootfs = str(sb.rootfs)
    deadline = time.monotonic() + 5
    while is_mountpoint(rootfs) and time.monotonic() < deadline:
        try:
            unmount(rootfs)
        except OSError:
            time.sleep(0.01)  # the old tasks still hold it while they die
    if is_mountpoint(rootfs):
        unmount(rootfs, detach=True)
    mount_all([Mount("bind", str(st.bundle / "rootfs"), ("bind",))], rootfs)
    unmount(str(st.bundle / "rootfs"), detach=True)
    sb.root = list(st.root)
    rt._save(sb)  # noqa: SLF001 -- records the new root; see the report to the runtime's owner
    for p in paths.values():
        try:
            os.rmdir(p)
        except OSError:
            pass
    _sweep_cgroups(st, kill=False)  # runc's state may not list the unified one
    shutil.rmtree(st.runc_root, ignore_errors=True)
    if not is_mountpoint(str(st.bundle / "rootfs")):
        shutil.rmtree(st.dir, ignore_errors=True)
    _rmdir_if_empty(st.dir.parent)


def _sweep_cgroups(st: Standby, kill: bool = True) -> None:
    """Kill whatever is left in a standby's cgroups (every hierarchy, the
    unified one included: runc delete may leave that one) and remove them.
    kill=False (after a promotion): only remove the empty ones."""
    from .cgroups import CGROUP_ROOT
    cgs = [c / st.cgroup_rel.lstrip("/") for c in CGROUP_ROOT.iterdir()]
    cgs = [c for c in cgs if c.is_dir()]
    if not kill:
        for c in cgs:
            try:
                os.rmdir(c)
            except OSError:
                pass
        return
    for c in cgs:  # thaw (a frozen task ignores SIGKILL until thawed), then kill
        for name, val in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
            try:
                (c / name).write_text(val)
            except OSError:
                pass
    killed: set[int] = set()
    for c in cgs:
        try:
            pids = [int(x) for x in (c / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for c in cgs:
        while True:
            try:
                os.rmdir(c)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                # Killed tasks still exiting; a zombie child of crabd (the
                # subreaper) keeps a v2 cgroup populated until reaped.
                for pid in killed:
                    reap(pid)
                time.sleep(0.05)


def sweep_standby_cgroups(rt: Runtime, sandbox_id: str, keep: set[str] = frozenset()) -> int:  # type: ignore[assignment]
    """Remove the empty cgroups `/crabd/<sandbox_id>.<token>` (every
    hierarchy) of standbys that are gone (tokens not in `keep`): e.g. made
    by a runc restore that outlived a killed crabd. Returns how many went."""
    from .cgroups import CGROUP_ROOT
    n = 0
    for h in CGROUP_ROOT.iterdir():
        base = h / "crabd"
        if not base.is_dir():
            continue
        for c in base.glob(f"{sandbox_id}.*"):
            if c.name.partition(".")[2] in keep or not c.is_dir():
                continue
            try:
                os.rmdir(c)
                n += 1
            except OSError:
                pass
    return n


def remove_standby_leftovers(rt: Runtime) -> list[str]:
    """After a crash: remove every standby directory, also those a prepare
    killed midway left without standby.json (list_standbys skips them):
    their runc container, stopped tasks, cgroups and mounts. Returns the
    directories removed."""
    from deltafs.mount import mountinfo
    base = rt.state_dir / "standbys"
    out: list[str] = []
    for sd in (sorted(base.iterdir()) if base.is_dir() else []):
        if not sd.is_dir():
            continue
        for d in sorted(sd.iterdir()):
            st = Standby(sd.name, "", d.name, d, [], 0, 0, 0.0)
            if (st.runc_root / sd.name).exists():
                try:
                    _runc(rt, st.runc_root).delete(sd.name, force=True)
                except Exception:  # noqa: BLE001 -- best effort; the cgroups below are swept anyway
                    pass
            _sweep_cgroups(st)
            real = str(d.resolve())
            for m in sorted((m.target for m in mountinfo() if m.target.startswith(real + "/")),
                            key=len, reverse=True):
                try:
                    unmount(m, detach=True)
                except OSError:
                    pass
            if not any(m.target.startswith(real + "/") for m in mountinfo()):
                shutil.rmtree(d, ignore_errors=True)
            out.append(str(d))
        _rmdir_if_empty(sd)
    return out


def _rmdir_if_empty(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def discard_standby(rt: Runtime, st: Standby) -> None:
    """Kill a standby's tasks and remove it. Its root (caller's fork) is
    unmounted, not deleted: the caller removes the snapshot."""
    _discard_dir(rt, st)


def _discard_dir(rt: Runtime, st: Standby) -> None:
    if (st.runc_root / st.sandbox_id).exists():
        try:
            _runc(rt, st.runc_root).delete(st.sandbox_id, force=True)
        except Exception:  # noqa: BLE001 -- best effort; the checks below decide
            pass
    _sweep_cgroups(st)
    rootfs = str(st.bundle / "rootfs")
    if is_mountpoint(rootfs):
        try:
            unmount(rootfs)
        except OSError:
            unmount(rootfs, detach=True)
    if is_mountpoint(rootfs):
        raise FailedPrecondition(f"root of standby {st.dir} is still mounted", fix=f"umount {rootfs}")
    shutil.rmtree(st.dir, ignore_errors=True)
    _rmdir_if_empty(st.dir.parent)


# --- stopgap for the runtime ------------------------------------------------------------------------
class CheckpointableRunner(SubprocessRunner):
    """A SubprocessRunner whose `runc create` gives the sandbox init a pipe
    for stdout/stderr instead of the host file init.log.

    Why: CRIU cannot dump a process holding a file of a mount outside its
    mount namespace ("Can't lookup mount=N for fd=1 path=.../init.log"); a
    pipe it can (runc marks it external and re-plugs it on restore). The
    pipe's output (runc create's errors) still goes to init.log. Meant to
    move into Runtime.start; until then crabd passes
    `Runtime(..., runner=CheckpointableRunner())`.
    """

    def run(self, argv: list[str], *, timeout: float, input: bytes | None = None,
            check: bool = True, context: str = "", log: str | None = None) -> Completed:
        if log is None or "create" not in argv:
            return super().run(argv, timeout=timeout, input=input, check=check, context=context, log=log)
        r, w = os.pipe()
        try:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=w, stderr=w)
        except FileNotFoundError as e:
            os.close(r)
            raise CommandFailed(argv, 127, str(e), context=context) from e
        finally:
            os.close(w)
        out = bytearray()
        os.set_blocking(r, False)
        start = time.monotonic()
        try:
            while True:
                done = p.poll() is not None
                try:
                    chunk = os.read(r, 65536)
                    if chunk:
                        out += chunk[: max(0, (1 << 20) - len(out))]
                        continue
                    if chunk == b"":
                        if done:
                            break
                except BlockingIOError:
                    if done:
                        break  # the init holds the pipe open: runc itself is done
                if time.monotonic() - start > timeout:
                    p.kill()
                    p.wait()
                    raise CommandFailed(argv, -9, f"timed out after {timeout}s. {out.decode(errors='replace')}",
                                        context=context)
                time.sleep(0.001)
        finally:
            os.close(r)
        with open(log, "ab") as f:
            f.write(out)
        if check and p.returncode != 0:
            raise CommandFailed(argv, p.returncode, out.decode(errors="replace"), context=context)
        return Completed(list(argv), p.returncode, b"", bytes(out))
