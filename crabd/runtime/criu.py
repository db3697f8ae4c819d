"""CRIU glue: a sandbox's processes dumped into deltacr's image store and
restored from it, through runc.

Part of `crabd.runtime`; thin glue between the runtime's sandboxes and
deltacr. What deltacr cannot know and this module supplies: runc's root and
binary, the sandbox's bundle, cgroup and freezer, where CRIU stages its
images (`scratch_dir`: a tmpfs when it has room; `gc_scratch` removes what a
crashed crabd left there, called at daemon start), and the checks that refuse,
before freezing, a dump CRIU would hang in or could not restore.

    info = checkpoint_processes(rt, "agent-1", store, "sb-x@7", fs_commit=lambda: snaps.checkpoint(key))
    ... the agent breaks things ...
    restore_processes(rt, "agent-1", store, "sb-x@7")   # root already rolled back by deltafs

Hot standbys (restored, kept stopped) are `standby.py`. Errors: crabd's own
(SandboxNotRunning, FailedPrecondition, NotFound) and deltacr's (CriuFailed
with CRIU's `Error` lines, ImageCorrupted, CriuUnavailable, AlreadyExists),
left as they are for the API layer to map.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from deltacr import (AlreadyExists, CriuFailed, DumpOptions, ImageStore, RestoreOptions, Runc, capture_consistent,
                     skipped_in_flight)
from deltacr.compat import host_criu
from deltafs import is_mountpoint, mount_all

from ..errors import CommandFailed, FailedPrecondition, SandboxNotRunning
from ..runner import Completed, SubprocessRunner
from .cgroups import Freezer, unified_freezer
from .linkremap import cleanup_restore, journal, link_open_unlinked, prepare_restore, unlink_all
from .procfs import cgroup_procs, ns_pid, rss_bytes, task_stat, tcp_connected, time_namespaces
from .sandbox import Runtime, Sandbox

log = logging.getLogger("crabd.runtime.process")  # its name before the split: log lines unchanged

__all__ = ["ProcessCheckpoint", "checkpoint_processes", "restore_processes", "rollback_processes", "gc_scratch",
           "scratch_dir", "runc_for", "restore_options", "restore_into", "kill_init", "STOPPED_TASK_LIMIT",
           "TIME_NS_LIMIT", "CheckpointableRunner", "signal_init"]


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


def runc_for(rt: Runtime, root: Path | None = None) -> Runc:
    # CRABD_CRIU: the CRIU command runc runs (default `criu` on PATH); tests
    # point it at a wrapper that makes CRIU fail (tests/integration/crabd/daemon/test_criu_failure.py).
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
    returned (a file-system checkpoint without its processes), and
    `.committed_links` the link-remap links that commit holds (linkremap.py):
    the caller must commit the files again without them."""
    sb = _running(rt, sandbox_ref)
    if store.exists(checkpoint_id):
        raise AlreadyExists(f"checkpoint {checkpoint_id!r} already has a process image")
    init_pid = sb.pid
    _check_init_stdio(sb, init_pid)
    freezer = Freezer(rt.layout, sb.cgroup_rel)
    was_frozen = freezer.state() == "FROZEN"
    criu_conf: Path | None = None
    stopped = _stopped_tasks(freezer.dir / "cgroup.procs")
    if stopped and freezer.v1 and not was_frozen:
        # v1 freezer + a stopped task = a CRIU hung in PTRACE_SEIZE; the v2
        # freezer of the unified hierarchy has no such hang (STOPPED_TASK_LIMIT).
        v2 = unified_freezer(rt.layout, sb.cgroup_rel)
        criu_conf = _criu_freeze_config(rt, sb, v2) if v2 is not None else None
        if v2 is None or criu_conf is None:
            raise FailedPrecondition(f"sandbox {sb.id} has stopped tasks: "
                                     f"{', '.join(f'{p} ({c})' for p, c in stopped[:8])}; "
                                     f"{STOPPED_TASK_LIMIT}",
                                     fix="let stopped tasks continue (SIGCONT) before the turn ends to have the "
                                         "processes checkpointed")
        freezer = v2
    _check_one_time_ns(sb, freezer.dir / "cgroup.procs")
    if opts is None:
        opts = DumpOptions.for_private_netns(tcp_connections=tcp_connected(init_pid))
    runc = runc_for(rt)
    work = scratch_dir(store, "dump-", rss_bytes(freezer.dir / "cgroup.procs"))
    img, logs = work / "image", work / "work"

    # Open files whose name was unlinked but which another hard link keeps:
    # crabd's own link goes into the FS commit, CRIU's --link-remap then
    # dumps them (linkremap.py). Only with an FS commit to keep the link.
    remaps: list[dict[str, Any]] = []
    missed: list[str] = []
    used = opts
    links_journal = journal(rt.state_dir, f"dump-{sb.id}")  # for a crash before they are removed

    def commit() -> Any:
        nonlocal remaps, missed
        remaps, missed = link_open_unlinked(cgroup_procs(freezer.dir / "cgroup.procs"), sb.rootfs, links_journal)
        assert fs_commit is not None
        return fs_commit()

    def dump() -> float:
        nonlocal used
        _check_tree(sb, freezer.dir / "cgroup.procs", init_pid)
        if remaps and not missed:
            used = replace(opts, link_remap=True)
        elif missed:
            log.info("sandbox %s: open unlinked files crabd cannot keep: %s", sb.id, "; ".join(missed))
        try:
            return runc.checkpoint(sb.id, img, logs, used)
        finally:
            unlink_all(sb.rootfs, remaps, links_journal)  # still frozen: the sandbox never sees them

    try:
        dumped = False
        try:
            cap = capture_consistent(freezer.freeze, (lambda: None) if was_frozen else freezer.thaw, dump,
                                     commit if fs_commit is not None else None)
            dumped = True
        except BaseException as e:
            if isinstance(e, CriuFailed):
                kept = store.log_dir(checkpoint_id)
                kept.mkdir(parents=True, exist_ok=True)
                if e.log_path and os.path.isfile(e.log_path):
                    shutil.copyfile(e.log_path, kept / "dump.log")
                    e.log_path = str(kept / "dump.log")
            # Failed or refused after the FS commit: that commit holds crabd's
            # links, which no process image will use; the caller replaces it
            # (`committed_links`, pipeline._capture_proc).
            if remaps and getattr(e, "fs_result", None) is not None:
                e.committed_links = list(remaps)  # type: ignore[attr-defined]
            raise
        finally:
            unlink_all(sb.rootfs, remaps, links_journal)  # the FS commit or the dump failed
            if criu_conf is not None:
                _set_criu_config(rt, sb, criu_conf, on=False)
            if not dumped:
                _unlock_network(sb, init_pid)
            _check_thawed(sb, freezer, was_frozen)
        notes = _dump_notes(logs / "dump.log")
        stopped_ns = sorted(n for n in (ns_pid(p) for p, _ in stopped) if n is not None)
        t = time.monotonic()
        m = store.put(checkpoint_id, img, logs=[logs / "dump.log"],
                      meta={"sandbox_id": sb.id, "options": used.to_dict(), "kind": "criu-runc",
                            # a hot standby's promotion must not SIGCONT these (standby.py)
                            **({"stopped_nspids": stopped_ns} if stopped_ns else {}),
                            # crabd's links in the FS commit, for the restore (linkremap.py)
                            **({"link_remaps": remaps} if used.link_remap else {})})
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


def scratch_dir(store: ImageStore, prefix: str, need_bytes: int) -> Path:
    """A new directory to stage about `need_bytes` of CRIU image in (the caller removes it)."""
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


# Why a stopped task cannot be dumped through a cgroup v1 freezer, for the
# reasons of the checkpoint and `crabd doctor`. Reproduced with plain CRIU
# 4.1.1 (no runc, no crabd; bench/results/zdtm/2026-12-02-h15/SUMMARY.md):
# --freeze-cgroup on a v1 freezer hangs at the SEIZE of the task before the
# stopped one; on the same tree's v2 cgroup, or without --freeze-cgroup, the
# dump succeeds and the task stays stopped. The kernel's v1 freezer puts a
# stopped task in TASK_FROZEN; ptrace_attach wakes it for __TASK_STOPPED
# (a wake-up the freezer only records) and waits, killable, until the task
# reaches its trap, which it cannot before the thaw CRIU does after seizing.
# On a hybrid host crabd avoids it by freezing through the unified (v2)
# hierarchy; only a v1-only host (or a sandbox without a unified cgroup)
# still refuses.
STOPPED_TASK_LIMIT = (
    "host limit: this host has only the cgroup v1 freezer, and CRIU cannot seize a stopped task in a frozen v1 "
    "freezer cgroup: PTRACE_SEIZE of a task in group stop waits for the task to reach its trap, which a task the "
    "v1 freezer holds never does (CRIU hangs; upstream: its stopped* tests fail with --freeze-cgroup on v1, "
    "criu PR #1905); a host with a unified (v2) hierarchy has no such limit")


def _stopped_tasks(procs_file: Path) -> list[tuple[int, str]]:
    """The tasks stopped by SIGSTOP/SIGTSTP/SIGTTIN/SIGTTOU (state T), as
    (pid, comm)."""
    stopped = []
    for pid in cgroup_procs(procs_file):
        try:
            stat = task_stat(pid)
        except OSError:
            continue
        if stat.state == "T":
            stopped.append((pid, stat.comm))
    return stopped


_CRIU_CONFIG_LABEL = "org.criu.config="


def _criu_freeze_config(rt: Runtime, sb: Sandbox, freezer: Freezer) -> Path | None:
    """Have runc's CRIU freeze the sandbox through `freezer` (its v2 cgroup)
    for the next dump: runc always hands CRIU the v1 freezer cgroup on a
    hybrid host, and CRIU lets the RPC configuration file runc names (the
    container's `org.criu.config` label; runc's default is
    /etc/criu/runc.conf) override it. The label goes into runc's state of
    the container for the dump only (`_set_criu_config(..., on=False)`
    after). None, leaving everything as it was, when the container already
    has such a label of its own."""
    conf = sb.dir / "criu-dump.conf"
    conf.write_text(f"freeze-cgroup {freezer.dir}\n")
    return conf if _set_criu_config(rt, sb, conf, on=True) else None


def _set_criu_config(rt: Runtime, sb: Sandbox, conf: Path, *, on: bool) -> bool:
    """Add (`on`) or remove the `org.criu.config=<conf>` label of the
    container in runc's state; False if another such label is there."""
    path = rt.runc_root / sb.id / "state.json"
    state = json.loads(path.read_text())
    cfg = state.setdefault("config", {})
    labels = [lb for lb in (cfg.get("labels") or []) if lb != _CRIU_CONFIG_LABEL + str(conf)]
    if on:
        if any(lb.startswith(_CRIU_CONFIG_LABEL) for lb in labels):
            return False
        labels.append(_CRIU_CONFIG_LABEL + str(conf))
    cfg["labels"] = labels
    tmp = path.with_suffix(".crabd-criu")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return True


TIME_NS_LIMIT = ("CRIU restores processes in a time namespace of its own, runc 1.1 starts commands exec'd "
                 "later in the host's, and CRIU can dump but not restore a tree that spans two time "
                 "namespaces (\"Can't restore sub-task in NS\")")


def _check_one_time_ns(sb: Sandbox, procs_file: Path) -> None:
    """Refuse a dump whose restore is known to fail: tasks in more than one
    time namespace (the sandbox was restored by CRIU, then a command was
    exec'd in it). Found by the ground-truth oracle (bench/oracle.py): the
    dump succeeded and every later restore fell back to a fresh init."""
    seen = time_namespaces(cgroup_procs(procs_file))
    if len(seen) > 1:
        groups = "; ".join(f"{', '.join(map(str, p[:4]))}{' ...' if len(p) > 4 else ''}" for p in seen.values())
        raise FailedPrecondition(f"sandbox {sb.id} has processes in {len(seen)} time namespaces ({groups}): "
                                 f"{TIME_NS_LIMIT}",
                                 fix="roll back to or fork the checkpoint before the commands started after "
                                     "the last restore, or let those commands exit before the turn ends")


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
            comm = task_stat(pid).comm
            while p not in (init_pid, 0, 1) and hops < 4096:
                p = task_stat(p).ppid
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


def restore_options(store: ImageStore, checkpoint_id: str) -> RestoreOptions:
    meta = store.manifest(checkpoint_id).meta
    return RestoreOptions.from_dump(DumpOptions.from_dict(meta.get("options") or {}))


def restore_into(rt: Runtime, store: ImageStore, checkpoint_id: str, container_id: str, bundle: Path,
                  runc: Runc, opts: RestoreOptions, image: Path) -> int:
    work = store.tmpdir("restore-")
    remaps = store.manifest(checkpoint_id).meta.get("link_remaps") or []
    # its own: a standby's restore runs under the sandbox's id beside the sandbox's dump
    links_journal = journal(rt.state_dir, f"restore-{container_id}-{secrets.token_hex(4)}")
    made = prepare_restore(bundle / "rootfs", image, remaps, links_journal) if remaps else []
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
        if remaps:
            cleanup_restore(bundle / "rootfs", remaps, made, links_journal)
        shutil.rmtree(work, ignore_errors=True)


def restore_processes(rt: Runtime, sandbox_ref: str, store: ImageStore, checkpoint_id: str,
                      opts: RestoreOptions | None = None) -> Sandbox:
    """Replace the sandbox's processes with those of `checkpoint_id`.

    The sandbox's root (sb.root, mounted at bundle/rootfs) must already be
    the file-system state of the same checkpoint. The image is verified
    before the sandbox is touched: a corrupted one raises
    deltacr.ImageCorrupted and the sandbox stays as it was."""
    sb = rt.get(sandbox_ref)
    ropts = opts or restore_options(store, checkpoint_id)
    image = scratch_dir(store, "image-", store.manifest(checkpoint_id).raw_bytes)
    runc = runc_for(rt)
    try:
        store.get(checkpoint_id, image)          # verifies everything first
        kill_init(rt, sb)
        if sb.status != "absent":
            runc.delete(sb.id, force=True)
        if not is_mountpoint(str(sb.rootfs)):
            mount_all(sb.root, str(sb.rootfs))
        pid = restore_into(rt, store, checkpoint_id, sb.id, sb.bundle, runc, ropts, image)
    finally:
        shutil.rmtree(image, ignore_errors=True)
    sb.status, sb.pid = "running", pid
    return sb


def signal_init(rt: Runtime, sb: Sandbox, sig: int = signal.SIGKILL) -> bool:
    """Send `sig` to the sandbox's init, its cgroup thawed first (a frozen
    task gets a SIGKILL only once thawed). False when the init was gone."""
    fz = Freezer(rt.layout, sb.cgroup_rel)
    try:
        if fz.state() == "FROZEN":
            fz.thaw()
    except (FailedPrecondition, OSError):
        pass
    try:
        os.kill(sb.pid, sig)  # type: ignore[arg-type]
    except ProcessLookupError:
        return False
    return True


def kill_init(rt: Runtime, sb: Sandbox, timeout: float = 10.0) -> None:
    """SIGKILL the sandbox's init and wait until it is dead: the kernel
    kills the rest of its pid namespace. Faster than `runc delete --force`
    (~100 ms here: it freezes, signals and waits on every task) or
    Runtime.stop (polls `runc state`); the root stays mounted."""
    if not sb.pid or not signal_init(rt, sb):
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
                if task_stat(sb.pid).state in ("Z", "X"):
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
