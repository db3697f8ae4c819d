"""Sandboxes: runc containers whose root file system is given as data.

A sandbox lives in `<state>/sandboxes/<id>/`:

    sandbox.json   what it is: id, name, image, limits, root mounts
    bundle/        the OCI bundle: config.json, rootfs/ (mount point)
    upper/ work/   the default root's writable overlay layer (when the
                   caller gives no root mounts of its own)
    init.log       whatever the sandbox's init and runc create printed

The root is a list of `deltafs.Mount` specs mounted on `bundle/rootfs`
before `runc create`: by default a plain overlay of the image; deltafs
supplies snapshot mounts instead. runc's own state lives in `<state>/runc`
so several crabd instances (tests) never see each other's containers.

Beside it: exec_result.py (what an exec's report means, pure) and reaper.py
(the children crabd adopts as a child subreaper, and their reaping).

Size (~600 lines): one class, the runtime seam the daemon drives (create,
start, exec by runc or by the init's channel, stop, reset, state); what is
pure already lives in the two modules above.
"""

from __future__ import annotations

import json
import logging
import builtins
import os
import re
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from deltafs import Mount, is_mountpoint, mount_all, unmount
from deltafs.mount import unmount_below

from .. import config
from ..errors import FailedPrecondition, InvalidArgument, NotFound, SandboxNotRunning
from ..images import ImageStore, validate_name
from ..runner import Runner, SubprocessRunner
from . import channel
from .cgroups import CgroupLayout, Freezer, detect_layout
from .exec_result import ExecResult, exec_result, merge_env
from .oci import DEFAULT_ENV, INIT_PATH, RUN_PATH, Limits, build_config, loopback_hook
from .reaper import become_subreaper, kill_tree_from_pidfile, pidfile_alive, read_pid, reap, reap_runc_orphans

log = logging.getLogger(__name__)

__all__ = ["Sandbox", "ExecResult", "Runtime", "DEFAULT_OUTPUT_LIMIT"]

DEFAULT_OUTPUT_LIMIT = 1 << 20  # bytes kept per stream of one exec
_ID = re.compile(r"^sb-[0-9a-f]{10}$")


@dataclass
class Sandbox:
    id: str
    name: str
    image: str
    created_at: float
    limits: Limits
    root: list[Mount]
    dir: Path
    status: str = "unknown"  # runc's: created, running, paused, stopped; or absent
    pid: int | None = None    # host pid of the sandbox's init while it runs
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def bundle(self) -> Path:
        return self.dir / "bundle"

    @property
    def rootfs(self) -> Path:
        return self.bundle / "rootfs"

    @property
    def cgroup_rel(self) -> str:
        return f"/crabd/{self.id}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "name": self.name, "image": self.image, "created_at": self.created_at,
            "limits": self.limits.to_dict(), "root": [m.to_dict() for m in self.root],
            "status": self.status, "pid": self.pid, "labels": dict(self.labels),
        }


class Runtime:
    """Create, run commands in, freeze, stop and destroy sandboxes.

    Thread-safe per sandbox: lifecycle changes of one sandbox are serialised;
    execs run concurrently.
    """

    def __init__(self, state_dir: Path | str | None = None, *, runner: Runner | None = None,
                 layout: CgroupLayout | None = None, init_binary: Path | str | None = None,
                 runc: str | None = None, exec_channel: bool | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else config.state_dir_from_env()
        self.runner = runner or SubprocessRunner()
        self._layout = layout
        self.init_binary = Path(init_binary) if init_binary else config.init_binary()
        self.runc_bin = runc or config.runc_binary()
        # On: new sandboxes' inits serve the fast exec path (channel.py), and
        # execs use it wherever an init has it. Off: runc exec only, as before.
        self.exec_channel = config.exec_channel() if exec_channel is None else exec_channel
        self._channel_init: tuple[str, int, int] | None = None   # the init binary checked to have it
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.runc_root = self.state_dir / "runc"
        self.images = ImageStore(self.state_dir, runner=self.runner, users=self._image_users)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        # `runc exec --detach` exits right after starting the command's
        # wrapper. Its orphan would be re-parented to the host's init (not the
        # sandbox's: runc lives in the host's pid namespace), and some inits
        # never reap. As a child subreaper this process adopts the wrappers
        # and reaps each one when its exec ends.
        become_subreaper()
        self._unreaped: set[int] = set()
        self._reap_guard = threading.Lock()

    @property
    def layout(self) -> CgroupLayout:
        if self._layout is None:
            self._layout = detect_layout()
        return self._layout

    # --- queries ---------------------------------------------------------------
    def list(self) -> list[Sandbox]:
        if not self.sandboxes_dir.is_dir():
            return []
        out = []
        for d in sorted(self.sandboxes_dir.iterdir()):
            if (d / "sandbox.json").is_file():
                out.append(self._refresh(self._load(d)))
        return out

    def get(self, ref: str) -> Sandbox:
        """A sandbox by id or name."""
        if isinstance(ref, str) and _ID.match(ref) and (self.sandboxes_dir / ref / "sandbox.json").is_file():
            return self._refresh(self._load(self.sandboxes_dir / ref))
        if isinstance(ref, str) and re.match(r"^[A-Za-z0-9._-]{1,64}$", ref):
            for sb in self.list():
                if sb.name == ref:
                    return sb
        raise NotFound(f"no sandbox {ref!r}", fix="crabd sandbox ls lists the sandboxes")

    def pids(self, ref: str) -> builtins.list[int]:
        """Host pids of every process in the sandbox (from its cgroup)."""
        sb = self.get(ref)
        procs = self.layout.freezer_dir(sb.cgroup_rel) / "cgroup.procs"
        try:
            return [int(x) for x in procs.read_text().split()]
        except FileNotFoundError:
            return []

    def cgroup_v2_dir(self, ref: str) -> Path | None:
        """The sandbox's unified-hierarchy cgroup (what BPF attribution keys on)."""
        return self.layout.v2_dir(self.get(ref).cgroup_rel)

    # --- lifecycle ----------------------------------------------------------------
    def create(self, image: str, *, name: str | None = None, limits: Limits | None = None,
               root: Sequence[Mount] | None = None, start: bool = True,
               labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> Sandbox:
        """Create a sandbox from `image`; start it unless `start=False`.

        `root` is the root file system as mount specs; by default a fresh
        overlay whose lower layer is the image.
        """
        img = self.images.get(image)
        if name is not None:
            validate_name(name, "sandbox")
            if any(s.name == name for s in self.list()):
                raise_exists(name)
        if not self.init_binary.is_file():
            raise FailedPrecondition(f"crabd's sandbox init {self.init_binary} is missing",
                                     fix="run scripts/setup-host (it builds crabd-init)")
        sid = "sb-" + secrets.token_hex(5)
        d = self.sandboxes_dir / sid
        (d / "bundle" / "rootfs").mkdir(parents=True)
        (d / "run").mkdir(mode=0o700)
        if root is None:
            (d / "upper").mkdir()
            (d / "work").mkdir()
            root = [Mount("overlay", "overlay", (f"lowerdir={img.path}", f"upperdir={d / 'upper'}",
                                                 f"workdir={d / 'work'}", "index=off"))]
        sb = Sandbox(id=sid, name=name or sid, image=image, created_at=time.time(), limits=limits or Limits(),
                     root=list(root), dir=d, labels=dict(labels or {}))
        env = merge_env(DEFAULT_ENV, tuple(img.env))
        cfg = build_config(sandbox_id=sid, init_source=str(self.init_binary), run_source=str(d / "run"),
                           cgroups_path=sb.cgroup_rel,
                           limits=sb.limits, env=env, annotations=annotations, hooks=_hooks(),
                           init_args=("--channel", channel.NAME) if self._init_has_channel() else ())
        (d / "bundle" / "config.json").write_text(json.dumps(cfg, indent=2))
        self._save(sb)
        if start:
            try:
                self.start(sid)
            except BaseException:
                self.destroy(sid)
                raise
        return self.get(sid)

    def start(self, ref: str) -> Sandbox:
        """Mount the root and start the sandbox's init (a new runc container)."""
        sb = self.get(ref)
        with self._lock(sb.id):
            if sb.status in ("running", "paused"):
                return sb
            if sb.status in ("created", "stopped"):
                self._runc("delete", "--force", sb.id, check=False)
            if not is_mountpoint(str(sb.rootfs)):
                mount_all(sb.root, str(sb.rootfs))
            pidfile = sb.dir / "init.pid"
            self._runc("create", "--bundle", str(sb.bundle), "--pid-file", str(pidfile), sb.id,
                       log=str(sb.dir / "init.log"), context=f"runc create of sandbox {sb.id}")
            self._runc("start", sb.id, context=f"runc start of sandbox {sb.id}")
        return self.get(sb.id)

    def set_root(self, ref: str, root: Sequence[Mount]) -> Sandbox:
        """Replace a stopped sandbox's root (rollback, restore): unmounts the
        old root and mounts the new one on the same path."""
        sb = self.get(ref)
        with self._lock(sb.id):
            if sb.status in ("running", "paused", "created"):
                raise FailedPrecondition(f"sandbox {sb.id} is {sb.status}; stop it before replacing its root")
            self._unmount_root(sb)
            sb.root = list(root)
            self._save(sb)
            mount_all(sb.root, str(sb.rootfs))
        return self.get(sb.id)

    def unmount_root(self, ref: str) -> None:
        """Unmount a stopped sandbox's root (before its snapshot is removed)."""
        sb = self.get(ref)
        with self._lock(sb.id):
            self._unmount_root(sb)

    def _unmount_root(self, sb: Sandbox) -> None:
        if is_mountpoint(str(sb.rootfs)):
            try:
                unmount(str(sb.rootfs))
            except OSError:
                # Something still holds it (a shell cd'ed into it on the
                # host); detach so it goes when released.
                unmount(str(sb.rootfs), detach=True)
        if is_mountpoint(str(sb.rootfs)):
            raise FailedPrecondition(f"root of sandbox {sb.id} is still mounted at {sb.rootfs}",
                                     fix=f"umount {sb.rootfs}, then retry")

    def freeze(self, ref: str) -> None:
        sb = self._running(ref)
        Freezer(self.layout, sb.cgroup_rel).freeze()

    def thaw(self, ref: str) -> None:
        sb = self.get(ref)
        if sb.status not in ("running", "paused"):
            raise SandboxNotRunning(f"sandbox {sb.id} is {sb.status}")
        Freezer(self.layout, sb.cgroup_rel).thaw()

    def stop(self, ref: str, *, timeout: float = 10.0) -> Sandbox:
        """Kill every process of the sandbox and delete its runc container.
        The root stays mounted and the sandbox can be started again."""
        sb = self.get(ref)
        with self._lock(sb.id):
            self._stop_locked(sb, timeout)
        return self.get(sb.id)

    def reset(self, ref: str, timeout: float = 10.0) -> Sandbox:
        """After a failed or killed `runc restore`: kill whatever is in the
        sandbox's cgroup and remove runc's state of it without asking runc
        (which may be left waiting on a dead CRIU), so `start` can create the
        container again. The root stays mounted."""
        sb = self.get(ref)
        with self._lock(sb.id):
            self._kill_cgroup_tasks(sb, timeout)
            self._remove_runc_state(sb)
        return self.get(sb.id)

    def _remove_runc_state(self, sb: Sandbox) -> None:
        """Remove runc's state dir of `sb` without asking runc. A `runc
        restore` killed half-way leaves its `criu-root` in it: the bind
        mount of the sandbox's root runc makes for CRIU and unmounts only
        when the restore ends. rmtree cannot remove a mount point, and the
        dir left behind makes `runc create` refuse the id ("container with
        given ID already exists"). Worse, rmtree walks into the mount and
        deletes the sandbox's files. So: unmount first, never remove through
        a mount, and fail here, with the fix, if the dir is still there."""
        state_dir = self.runc_root / sb.id
        if not state_dir.exists():
            return
        still = unmount_below(str(state_dir))
        if not still:
            shutil.rmtree(state_dir, ignore_errors=True)
        if state_dir.exists():
            raise FailedPrecondition(
                f"runc's state of sandbox {sb.id} ({state_dir}) could not be removed"
                + (f": still mounted: {', '.join(still)}" if still else ""),
                fix=f"umount -l {state_dir}/criu-root; rm -r {state_dir}; then roll the sandbox back again")

    def _kill_cgroup_tasks(self, sb: Sandbox, timeout: float = 10.0) -> None:
        """SIGKILL every task in the sandbox's cgroup (thawed first: a frozen
        task gets SIGKILL only once thawed) until it is empty or `timeout`."""
        fr = Freezer(self.layout, sb.cgroup_rel)
        try:
            if fr.state() != "THAWED":
                fr.thaw()
        except (FailedPrecondition, OSError):
            pass
        deadline = time.monotonic() + timeout
        while (pids := self.pids(sb.id)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(pid)
            time.sleep(0.01)

    def destroy(self, ref: str) -> None:
        """Kill everything, unmount the root, remove the bundle and its dir.
        Leaves no mounts and no cgroups behind."""
        sb = self.get(ref)
        with self._lock(sb.id):
            self._stop_locked(sb, 10.0)
            # Never delete through a mounted root: that would delete the image.
            self._unmount_root(sb)
            shutil.rmtree(sb.dir)
        with self._locks_guard:
            self._locks.pop(sb.id, None)

    # --- commands ---------------------------------------------------------------
    def exec(self, ref: str, cmd: Sequence[str] | str, *, env: dict[str, str] | None = None,
             cwd: str | None = None, stdin: bytes | str | None = None, timeout: float | None = 600.0,
             output_limit: int = DEFAULT_OUTPUT_LIMIT) -> ExecResult:
        """Run `cmd` in the sandbox and return when it ends.

        `cmd` is an argv list, or a string run by /bin/sh -c. Output beyond
        `output_limit` bytes per stream is dropped and a marker says how much.
        Processes the command leaves in the background keep running.
        """
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd]
        else:
            argv = list(cmd)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument("cmd must be a non-empty list of strings or a shell string")
        if any("\0" in a for a in argv):
            raise InvalidArgument("cmd contains a NUL byte")
        if timeout is not None and timeout <= 0:
            raise InvalidArgument("timeout must be positive")
        # No stdin: an empty pipe (end of file at once), never the host's
        # /dev/null: a command that daemonizes keeps its stdin, and CRIU cannot
        # dump a file of a mount outside the sandbox ("Can't lookup mount").
        data = stdin.encode() if isinstance(stdin, str) else (b"" if stdin is None else stdin)
        fast = self._exec_by_init(ref, argv, env, cwd, data, timeout, output_limit)
        if fast is not None:
            return fast
        sb = self._running(ref)
        img = self._image_of(sb)  # read once: env and working dir
        full_env = self._exec_env(img, env)
        tok = secrets.token_hex(6)
        pidfile = sb.dir / f"exec-{tok}.pid"
        fifo = sb.dir / "run" / f"exec-{tok}.fifo"
        os.mkfifo(fifo, 0o600)
        # O_RDWR: we hold a writer too, so the fifo never reads as end-of-file
        # before the wrapper has opened it; completion is the status line.
        status_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        rargv = [self.runc_bin, "--root", str(self.runc_root), "exec", "--detach", "--pid-file", str(pidfile)]
        rargv += ["--cwd", cwd or (img.workdir if img else "/") or "/"]
        for e in full_env:
            rargv += ["--env", e]
        # After a CRIU restore the init lives in a time namespace of its own;
        # the wrapper joins it (see init.c) so that the sandbox stays one
        # tree CRIU can restore. It needs CAP_SYS_ADMIN for that, and drops
        # it before the command runs.
        time_ns = _other_time_ns(sb.pid)
        if time_ns:
            rargv[4:4] = ["--cap", "CAP_SYS_ADMIN"]
        rargv += [sb.id, INIT_PATH, "--run", f"{RUN_PATH}/{fifo.name}", *(["--time-ns"] if time_ns else []),
                  "--", *argv]

        def kill_tree() -> None:
            kill_tree_from_pidfile(pidfile)

        def wrapper_alive() -> bool:
            return pidfile_alive(pidfile)

        try:
            cap = self.runner.capture(rargv, timeout=timeout, input=data, cap=output_limit, on_timeout=kill_tree,
                                      status_fd=status_fd, still_running=wrapper_alive)
            self._reap(read_pid(pidfile))
        finally:
            os.close(status_fd)
            fifo.unlink(missing_ok=True)
            pidfile.unlink(missing_ok=True)
        return self._exec_result(sb, argv, cap, timeout)

    def _init_has_channel(self) -> bool:
        """The setting is on and the init binary knows `--channel`: an older
        build would print its usage and exit, and the sandbox with it."""
        if not self.exec_channel:
            return False
        st = self.init_binary.stat()
        key = (str(self.init_binary), st.st_ino, st.st_mtime_ns)
        if self._channel_init != key:
            if channel.MAGIC.encode() not in self.init_binary.read_bytes():
                log.warning("%s predates the exec channel: execs use runc exec (rebuild it: scripts/setup-host)",
                            self.init_binary)
                return False
            self._channel_init = key
        return True

    def _exec_env(self, img: Any, env: dict[str, str] | None) -> tuple[str, ...]:
        img_env = tuple(img.env) if img else ()
        return merge_env(merge_env(DEFAULT_ENV, img_env), tuple(f"{k}={v}" for k, v in (env or {}).items()))

    def _exec_by_init(self, ref: str, argv: builtins.list[str], env: dict[str, str] | None, cwd: str | None, data: bytes,
                      timeout: float | None, output_limit: int) -> ExecResult | None:
        """The fast path (channel.py): the sandbox's init spawns the command.
        None when it cannot be used (no channel, frozen, refused): then
        nothing ran, and the caller runs the command with runc exec."""
        if not (self.exec_channel and isinstance(ref, str) and _ID.match(ref)
                and (self.sandboxes_dir / ref / "sandbox.json").is_file()):
            return None
        sb = self._load(self.sandboxes_dir / ref)
        try:
            fz = Freezer(self.layout, sb.cgroup_rel)
            if fz.state() != "THAWED":
                return None  # runc exec's path says "frozen"
        except (OSError, FailedPrecondition):
            return None  # no cgroup (gone, or a host without the freezer): runc exec's path says why
        init = channel.find_init(fz.dir / "cgroup.procs", sb.cgroup_rel)
        if init is None:
            return None  # not running: runc exec's path says so
        try:
            conn = channel.connect(init, sb.cgroup_rel)
        except channel.Unavailable as e:
            log.debug("exec in %s by runc exec: %s", sb.id, e)
            return None
        img = self._image_of(sb)
        try:
            cap = channel.run(conn, argv, self._exec_env(img, env), cwd or (img.workdir if img else "/") or "/",
                              stdin=data, timeout=timeout, cap=output_limit)
        except channel.Unavailable as e:
            log.warning("exec in %s by runc exec: %s", sb.id, e)
            return None
        return self._exec_result(sb, argv, cap, timeout)

    def _exec_result(self, sb: Sandbox, argv: builtins.list[str], cap: Any, timeout: float | None) -> ExecResult:
        return exec_result(sb.id, argv, cap, timeout, running=lambda: self._status(sb.id)[0] == "running")

    # --- internals -------------------------------------------------------------------
    def _reap(self, pid: int | None) -> None:
        """Reap an exec wrapper we adopted, and any earlier ones still due."""
        with self._reap_guard:
            if pid is not None:
                self._unreaped.add(pid)
            deadline = time.monotonic() + 0.5
            for p in sorted(self._unreaped):
                while True:
                    try:
                        done, _ = os.waitpid(p, os.WNOHANG)
                    except ChildProcessError:
                        done = p  # not ours (reaped elsewhere): forget it
                    if done == p:
                        self._unreaped.discard(p)
                        break
                    if p != pid or time.monotonic() > deadline:
                        break  # still running: try again on a later exec
                    time.sleep(0.0005)

    def _running(self, ref: str) -> Sandbox:
        sb = self.get(ref)
        if sb.status == "paused":
            raise FailedPrecondition(f"sandbox {sb.id} is frozen", fix="thaw it first")
        if sb.status != "running":
            raise SandboxNotRunning(f"sandbox {sb.id} is not running (status: {sb.status})",
                                    fix=f"crabd sandbox start {sb.id}, roll it back, or recreate it")
        return sb

    def _stop_locked(self, sb: Sandbox, timeout: float) -> None:
        status, _ = self._status(sb.id)
        if status == "absent":
            self._clear_stale_state(sb)
            return
        if status in ("running", "paused"):
            # SIGKILL is not delivered to frozen tasks until they thaw. crabd
            # freezes through the freezer file (runc may still say running):
            # ask the freezer itself, e.g. after a crash mid-checkpoint.
            fr = Freezer(self.layout, sb.cgroup_rel)
            try:
                if status == "paused" or fr.state() != "THAWED":
                    fr.thaw()
            except (FailedPrecondition, OSError):
                pass
        if status in ("running", "paused", "created"):
            _, pid = self._status(sb.id)
            self._runc("kill", sb.id, "KILL", check=False)
            deadline = time.monotonic() + timeout
            while self._status(sb.id)[0] not in ("stopped", "absent"):
                if time.monotonic() > deadline:
                    break
                if pid:
                    reap(pid)
                reap_runc_orphans()  # one in its pid namespace keeps the init from exiting
                time.sleep(0.01)
            if pid:
                reap(pid)  # runc says stopped as soon as the init is a zombie: ours (a subreaper) to reap
        self._runc("delete", "--force", sb.id, check=False, context=f"runc delete of {sb.id}")
        if self._status(sb.id)[0] != "absent":
            raise FailedPrecondition(f"sandbox {sb.id} could not be stopped", fix=f"runc --root {self.runc_root} delete --force {sb.id}")

    def _clear_stale_state(self, sb: Sandbox) -> None:
        """runc's state dir of a container that `runc state` cannot read (a
        restore or create killed half-way writes the dir before state.json):
        `runc create` would refuse the id ("container with given ID already
        exists"). Kill whatever is in the sandbox's cgroup, then remove it."""
        state_dir = self.runc_root / sb.id
        if not state_dir.is_dir():
            return
        self._kill_cgroup_tasks(sb)
        log.warning("removing runc's unreadable state of %s (%s)", sb.id, state_dir)
        self._remove_runc_state(sb)

    def _status(self, sid: str) -> tuple[str, int | None]:
        res = self._runc("state", sid, check=False)
        if res.returncode != 0:
            return "absent", None
        st = json.loads(res.stdout)
        return st.get("status", "unknown"), (st.get("pid") or None)

    def _refresh(self, sb: Sandbox) -> Sandbox:
        sb.status, sb.pid = self._status(sb.id)
        if sb.status == "stopped":
            sb.pid = None
        return sb

    def _runc(self, *args: str, check: bool = True, context: str = "", log: str | None = None):  # type: ignore[no-untyped-def]
        argv = [self.runc_bin, "--root", str(self.runc_root), *args]
        return self.runner.run(argv, timeout=60, check=check, context=context or f"runc {args[0]}", log=log)

    def _image_of(self, sb: Sandbox) -> Any:
        """The sandbox's image, or None once it was removed."""
        try:
            return self.images.get(sb.image)
        except NotFound:
            return None

    def _lock(self, sid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(sid, threading.Lock())

    def _save(self, sb: Sandbox) -> None:
        data = sb.to_dict()
        for k in ("status", "pid"):
            data.pop(k)
        tmp = sb.dir / "sandbox.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, sb.dir / "sandbox.json")

    def _load(self, d: Path) -> Sandbox:
        data = json.loads((d / "sandbox.json").read_text())
        return Sandbox(id=data["id"], name=data["name"], image=data["image"], created_at=data["created_at"],
                       limits=Limits.from_dict(data["limits"]), root=[Mount.from_dict(m) for m in data["root"]],
                       dir=d, labels=data.get("labels") or {})

    def _image_users(self, image: str) -> builtins.list[str]:
        out = []
        if self.sandboxes_dir.is_dir():
            for d in self.sandboxes_dir.iterdir():
                try:
                    if json.loads((d / "sandbox.json").read_text())["image"] == image:
                        out.append(d.name)
                except (FileNotFoundError, KeyError, json.JSONDecodeError):
                    continue
        return out


def _hooks() -> dict[str, list[dict[str, Any]]] | None:
    """The bundle's OCI hooks: `lo` up in a restored sandbox (see oci.py).
    Without sh, nsenter or ip on the host there is none, and deltacr brings
    `lo` up after the restore instead (too late for sockets on 127.0.0.1:
    `crabd doctor` says so)."""
    tools = [shutil.which(t) for t in ("sh", "nsenter", "ip")]
    if not all(tools):
        return None
    return {"createRuntime": [loopback_hook(*tools)]}  # type: ignore[arg-type]


def raise_exists(name: str) -> None:
    from ..errors import AlreadyExists
    raise AlreadyExists(f"a sandbox named {name!r} already exists", fix="pick another name or remove that sandbox")


def _other_time_ns(pid: int | None) -> bool:
    """Is `pid` (a sandbox's init) in a time namespace other than crabd's?
    True after a CRIU restore; False when unknown (no pid, gone, or a
    kernel without time namespaces): the dump-time check in
    runtime/criu.py still refuses a tree that spans two."""
    if not pid:
        return False
    try:
        return os.stat(f"/proc/{pid}/ns/time").st_ino != os.stat("/proc/self/ns/time").st_ino
    except OSError:
        return False
