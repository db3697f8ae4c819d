"""Hot standbys: a checkpoint's processes restored next to their sandbox and
kept stopped, so that a rollback to that checkpoint is a SIGCONT.

Part of `crabd.runtime`, beside the CRIU glue (`criu.py`) it restores with.

    st = prepare_standby(rt, "agent-1", store, "sb-x@7", root=snaps.prepare(fork_key, parent=name))
    promote_standby(rt, st)                              # rollback as a SIGCONT

Standbys live in `<state>/standbys/<sandbox id>/<token>/`, outside the
sandbox dir so that destroying a sandbox never deletes through a standby's
mounted root. A standby is a runc container with the sandbox's own id under a
runc root of its own, restored from the sandbox's bundle config with its own
root and its own cgroup (`/crabd/<id>.<token>`), and CRIU's `leave-stopped`
(through the bundle's `org.criu.config` annotation): its tasks exist, hold
their memory and sockets, and do not run. Promotion kills the sandbox's
current init, installs the standby's runc state as the sandbox's, sends
SIGCONT to every standby task, then moves them into the sandbox's cgroups and
binds the standby's root at the sandbox's bundle/rootfs: from then on the
runtime sees it as the sandbox (exec, freeze, pids, stop/start).

A *fresh* standby (`prepare_fresh_standby`) is the same thing for a
checkpoint without processes: a new crabd-init started by runc on the
standby's root and stopped at once (SIGSTOP), so that a rollback to an
FS-only checkpoint is the same promotion instead of `runc create` + `start`.
Its files are the snapshot fork untouched (the init writes nothing; runc
makes the same mount points a cold start would), and it holds little
memory (measured into `memory_bytes` after the start).

Standbys are bounded by deltacr.StandbyPolicy (per sandbox, host memory):
`admit_standby` applies it to any set of standbys (the daemon's own, held in
memory), `make_room_for_standby` to those on this host's disk.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from deltacr import Admission, ImageStore, StandbyPolicy, StandbyRecord
from deltafs import Mount, is_mountpoint, mount_all, unmount
from deltafs.mount import unmount_below

from ..errors import FailedPrecondition, NotFound
from .cgroups import Freezer, copy_limits, sweep_cgroup
from .criu import restore_into, restore_options, runc_for, scratch_dir
from .procfs import cgroup_procs, ns_pid, task_stat
from .sandbox import Runtime, Sandbox

__all__ = ["Standby", "prepare_standby", "prepare_fresh_standby", "promote_standby", "discard_standby", "list_standbys",
           "remove_standby_leftovers", "standby_memory", "admit_standby", "make_room_for_standby"]


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
    fresh: bool = False     # a stopped fresh init (no process image), not a CRIU restore
    keep_stopped: tuple[int, ...] = ()  # pids (in the sandbox's pid namespace) stopped when dumped: no SIGCONT

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
                "created": self.created, "prepare_ms": self.prepare_ms, "fresh": self.fresh,
                "keep_stopped": list(self.keep_stopped)}


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
    ropts = restore_options(store, checkpoint_id)
    st = _new_standby(rt, sb, checkpoint_id, root, standby_memory(store, checkpoint_id), criu_stopped=True)
    image = scratch_dir(store, "image-", m.raw_bytes)
    try:
        store.get(checkpoint_id, image)
        mount_all(st.root, str(st.bundle / "rootfs"))
        st.pid = restore_into(rt, store, checkpoint_id, sb.id, st.bundle, runc_for(rt, st.runc_root), ropts, image)
    except BaseException:
        _discard_dir(rt, st)
        raise
    finally:
        shutil.rmtree(image, ignore_errors=True)
    st.prepare_ms = (time.monotonic() - t0) * 1e3
    st.keep_stopped = tuple(m.meta.get("stopped_nspids") or ())
    (st.dir / "standby.json").write_text(json.dumps(st.to_dict(), indent=2))
    return st


# What admission assumes a fresh standby holds before it exists: a stopped
# static crabd-init plus its container's kernel objects, ~0.3-0.6 MiB measured
# here (memory cgroup usage); `memory_bytes` is the measured figure afterwards.
FRESH_STANDBY_MEMORY = 1024 * 1024


def prepare_fresh_standby(rt: Runtime, sandbox_ref: str, checkpoint_id: str, root: list[Mount]) -> Standby:
    """Start a fresh init of the sandbox on `root` (its own file-system fork
    of an FS-only checkpoint) in a spare container, and stop it: promoting
    it (`promote_standby`) is a rollback to that checkpoint without
    processes, as `Runtime.start` on the same files would make it."""
    t0 = time.monotonic()
    sb = rt.get(sandbox_ref)
    st = _new_standby(rt, sb, checkpoint_id, root, FRESH_STANDBY_MEMORY, criu_stopped=False)
    st.fresh = True
    argv = [rt.runc_bin, "--root", str(st.runc_root)]
    try:
        mount_all(st.root, str(st.bundle / "rootfs"))
        pidfile = st.dir / "init.pid"
        rt.runner.run([*argv, "create", "--bundle", str(st.bundle), "--pid-file", str(pidfile), sb.id], timeout=60,
                      check=True, context=f"runc create of a standby of {sb.id}", log=str(st.dir / "init.log"))
        st.pid = int(pidfile.read_text())
        # Stopped right after `runc start`, not before: runc's init waits on
        # its exec fifo and `runc start` waits for it to write there, so a
        # stopped init would hang the start. crabd-init runs only its own
        # set-up meanwhile (signals, the channel's listener): nothing the
        # sandbox's files or a promotion could tell apart from a cold start.
        rt.runner.run([*argv, "start", sb.id], timeout=60, check=True, context=f"runc start of a standby of {sb.id}")
        # ... and once it is crabd-init: `runc start` returns before runc's
        # init has exec'd, and a runc init stopped there holds ~2 MiB more
        # (runc's Go runtime; measured: 0.4-0.7 MiB vs 2.2 MiB in its cgroup).
        _wait_exec(st.pid)
        os.kill(st.pid, signal.SIGSTOP)
        _wait_stopped(st.pid)
        st.memory_bytes = _cgroup_memory(rt, st) or FRESH_STANDBY_MEMORY
    except BaseException:
        _discard_dir(rt, st)
        raise
    st.prepare_ms = (time.monotonic() - t0) * 1e3
    (st.dir / "standby.json").write_text(json.dumps(st.to_dict(), indent=2))
    return st


def _new_standby(rt: Runtime, sb: Sandbox, checkpoint_id: str, root: list[Mount], memory: int,
                 criu_stopped: bool) -> Standby:
    """A standby's directory and bundle: the sandbox's config with a cgroup of
    its own (and CRIU's `leave-stopped` for a restored one)."""
    token = secrets.token_hex(4)
    d = _standbys_dir(rt, sb.id) / token
    (d / "bundle" / "rootfs").mkdir(parents=True)
    cfg = json.loads((sb.bundle / "config.json").read_text())
    if criu_stopped:
        cfg.setdefault("annotations", {})["org.criu.config"] = str(d / "criu.conf")
        (d / "criu.conf").write_text("leave-stopped\n")
    cfg["linux"]["cgroupsPath"] = f"/crabd/{sb.id}.{token}"
    (d / "bundle" / "config.json").write_text(json.dumps(cfg, indent=2))
    return Standby(sb.id, checkpoint_id, token, d, list(root), 0, memory, time.time())


def _wait_exec(pid: int, timeout: float = 5.0) -> None:
    """Until `pid` is no longer runc's init (`runc:[2:INIT]`): it exec'd."""
    deadline = time.monotonic() + timeout
    while task_stat(pid).comm.startswith("runc:"):
        if time.monotonic() > deadline:
            raise FailedPrecondition(f"the standby's init {pid} did not exec crabd-init within {timeout} s",
                                     fix="see the standby's init.log; crabd-init must be runnable in the sandbox")
        time.sleep(0.001)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while task_stat(pid).state != "T":
        if time.monotonic() > deadline:
            raise FailedPrecondition(f"the standby's init {pid} did not stop within {timeout} s",
                                     fix="look for a tracer of it (state t) or a kernel that delays SIGSTOP")
        time.sleep(0.001)


def _cgroup_memory(rt: Runtime, st: Standby) -> int | None:
    """The standby cgroup's memory use (v2 memory.current, or the v1 memory
    controller's usage on hybrid hosts, where it stays in v1)."""
    lay, rel = rt.layout, st.cgroup_rel.lstrip("/")
    if lay.v2_only and lay.unified is not None:
        f = lay.unified / rel / "memory.current"
    elif lay.v1_freezer is not None:
        f = lay.v1_freezer.parent / "memory" / rel / "memory.usage_in_bytes"
    else:
        return None
    try:
        return int(f.read_text())
    except (OSError, ValueError):
        return None


def standby_memory(store: ImageStore, checkpoint_id: str) -> int:
    """The memory a standby of `checkpoint_id` holds: its image's page files."""
    return sum(f.size for f in store.manifest(checkpoint_id).files if f.name.startswith("pages-"))


def admit_standby(policy: StandbyPolicy, new: StandbyRecord, current: Sequence[StandbyRecord],
                  evict: Callable[[StandbyRecord], None]) -> Admission:
    """Ask `policy` whether standby `new` may be prepared beside `current`;
    when it may, `evict` each standby the policy says must go first."""
    adm = policy.admit(new, list(current))
    if adm.admit:
        for ev in adm.evict:
            evict(ev)
    return adm


def make_room_for_standby(rt: Runtime, policy: StandbyPolicy, sandbox_ref: str, store: ImageStore,
                          checkpoint_id: str) -> Admission:
    """`admit_standby` over the standbys on this host's disk (host-wide),
    discarding those that must go first."""
    sb = rt.get(sandbox_ref)
    new = StandbyRecord(sb.id, checkpoint_id, standby_memory(store, checkpoint_id), time.time())
    current = list_standbys(rt)

    def evict(ev: StandbyRecord) -> None:
        for s in current:
            if s.sandbox_id == ev.sandbox_id and s.checkpoint_id == ev.checkpoint_id:
                discard_standby(rt, s)

    return admit_standby(policy, new, [s.record() for s in current], evict)


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
                               j.get("prepare_ms", 0.0), fresh=j.get("fresh", False),
                               keep_stopped=tuple(j.get("keep_stopped") or ())))
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
    # The sandbox's record without asking runc: a `runc state` spawn was a
    # third of an API rollback here (profiled), and the runc state is
    # replaced below anyway. Its processes are found in its cgroup.
    sb = rt._load(rt.sandboxes_dir / st.sandbox_id)  # noqa: SLF001 -- see the report to the runtime's owner
    try:
        stopped = task_stat(st.pid).state == "T"
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
    # 1. End the sandbox's current processes (all of its cgroup's: not only
    #    the init, which a dead sandbox may lack); frozen tasks die once thawed.
    _kill_cgroup(rt, sb)
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
        if st.keep_stopped and ns_pid(pid) in st.keep_stopped:
            continue  # stopped when dumped (SIGSTOP): CRIU restored it stopped, it stays so
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
            copy_limits(src, dst)
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


def _kill_cgroup(rt: Runtime, sb: Sandbox) -> None:
    fz = Freezer(rt.layout, sb.cgroup_rel)
    for pid in cgroup_procs(fz.dir / "cgroup.procs"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        if fz.state() != "THAWED":
            fz.thaw()
    except (FailedPrecondition, OSError):
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
    sweep_cgroup(st.cgroup_rel, kill=False)  # runc's state may not list the unified one
    if not unmount_below(str(st.dir)):  # never removed through a mount (see _remove_standby_dir)
        # Out of standbys/ at once (its runc state names the promoted tasks:
        # a leftover sweep's `runc delete` of it would kill the sandbox), and
        # removed off the rollback's critical path (~a fifth of it, profiled).
        trash = _trash_dir(rt) / f"{st.sandbox_id}.{st.token}"
        trash.parent.mkdir(exist_ok=True)
        os.rename(st.dir, trash)
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                         name="standby-rm", daemon=True).start()
    _rmdir_if_empty(st.dir.parent)


def _trash_dir(rt: Runtime) -> Path:
    return rt.state_dir / "standbys-trash"


def remove_standby_leftovers(rt: Runtime) -> list[str]:
    """After a crash: remove every standby directory, also those a prepare
    killed midway left without standby.json (list_standbys skips them):
    their runc container, stopped tasks, cgroups and mounts. Returns the
    directories looked at (one still mounted stays, and is tried again at
    the next start)."""
    _remove_standby_dir(_trash_dir(rt))  # promoted standbys' dirs a stop left behind
    base = rt.state_dir / "standbys"
    out: list[str] = []
    for sd in (sorted(base.iterdir()) if base.is_dir() else []):
        if not sd.is_dir():
            continue
        for d in sorted(sd.iterdir()):
            _tear_down(rt, Standby(sd.name, "", d.name, d, [], 0, 0, 0.0))
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
    still = _tear_down(rt, st)
    if still:
        raise FailedPrecondition(f"standby {st.dir} could not be removed: still mounted: {', '.join(still)}",
                                 fix=f"umount -l {' '.join(still)}; rm -r {st.dir}")
    _rmdir_if_empty(st.dir.parent)


def _tear_down(rt: Runtime, st: Standby) -> list[str]:
    """Kill the standby's tasks, then remove its dir, never through a
    mount. Returns the mounts still below it (then nothing was removed)."""
    # A `runc restore` killed half-way (crabd's stall timeout) leaves runc's
    # bind of the standby's root at runc/<id>/criu-root, and `runc delete`
    # removes its state dir with everything below it: unmounted first, or
    # runc deletes the files of the caller's fork through it.
    unmount_below(str(st.runc_root))
    if (st.runc_root / st.sandbox_id).exists():
        try:
            runc_for(rt, st.runc_root).delete(st.sandbox_id, force=True)
        except Exception:  # noqa: BLE001 -- best effort; the cgroups below are swept anyway
            pass
    sweep_cgroup(st.cgroup_rel)
    rootfs = str(st.bundle / "rootfs")
    if is_mountpoint(rootfs):
        try:
            unmount(rootfs)  # a clean unmount when it can; _remove_standby_dir detaches what is left
        except OSError:
            pass
    return _remove_standby_dir(st.dir)


def _remove_standby_dir(d: Path) -> list[str]:
    """Remove a standby's dir, never through a mount: every mount below it
    is detached first, and if one is still there nothing is removed (the
    mounts left are returned): rmtree would walk into the standby's root
    (bundle/rootfs, or runc's criu-root bind of it) and delete the files of
    the caller's file-system fork."""
    still = unmount_below(str(d))
    if not still:
        shutil.rmtree(d, ignore_errors=True)
    return still


