"""Where runc puts a sandbox's cgroups, and the freezer.

runc (cgroupfs driver) places a container with cgroupsPath `/crabd/<id>` at
`<hierarchy>/crabd/<id>` in every v1 controller and, on hybrid hosts, in the
unified (v2) hierarchy too -- which is what BPF attribution keys on.

Freezing writes the cgroup's freezer file directly instead of running
`runc pause` (a process spawn, ~10 ms): a freeze+thaw of a small sandbox
costs ~0.3 ms this way, and it is on the checkpoint's critical path.

Sweeps: a hot standby (`standby.py`) has cgroups of its own,
`/crabd/<sandbox id>.<token>` in every hierarchy; `sweep_cgroup` kills what
is left in one and removes it, `sweep_standby_cgroups` removes the empty ones
of standbys that are gone (e.g. made by a runc restore that outlived a
killed crabd).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import FailedPrecondition

__all__ = ["CgroupLayout", "detect_layout", "Freezer", "unified_freezer", "copy_limits", "sweep_cgroup", "sweep_standby_cgroups"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupLayout:
    """Which cgroup hierarchies this host has. Pure data, detected once."""

    v2_only: bool            # pure cgroup v2 (unified at /sys/fs/cgroup)
    unified: Path | None     # the v2 hierarchy (hybrid: /sys/fs/cgroup/unified)
    v1_freezer: Path | None  # /sys/fs/cgroup/freezer on v1/hybrid hosts

    def freezer_dir(self, rel: str) -> Path:
        rel = rel.lstrip("/")
        if self.v1_freezer is not None:
            return self.v1_freezer / rel
        if self.unified is not None:
            return self.unified / rel
        raise FailedPrecondition("no cgroup freezer on this host", fix="mount the v1 freezer or use cgroup v2")

    def v2_dir(self, rel: str) -> Path | None:
        return self.unified / rel.lstrip("/") if self.unified is not None else None

    def oom_events_file(self, rel: str) -> Path | None:
        """The file whose `oom_kill N` line counts the cgroup's OOM kills:
        v2 memory.events, or v1 memory.oom_control (hybrid hosts keep the
        memory controller in v1)."""
        rel = rel.lstrip("/")
        if self.v2_only and self.unified is not None:
            return self.unified / rel / "memory.events"
        if self.v1_freezer is not None:
            return self.v1_freezer.parent / "memory" / rel / "memory.oom_control"
        return None


def detect_layout(root: Path = CGROUP_ROOT) -> CgroupLayout:
    if (root / "cgroup.controllers").exists():
        return CgroupLayout(v2_only=True, unified=root, v1_freezer=None)
    unified = root / "unified"
    freezer = root / "freezer"
    return CgroupLayout(
        v2_only=False,
        unified=unified if (unified / "cgroup.procs").exists() else None,
        v1_freezer=freezer if (freezer / "freezer.state").exists() or (freezer / "tasks").exists() else None,
    )


class Freezer:
    """Freeze and thaw one cgroup (v1 freezer.state or v2 cgroup.freeze).

    `unified`: on a hybrid host, the cgroup's v2 freezer in the unified
    hierarchy (runc puts the sandbox there too) instead of the v1 freezer;
    see `unified_freezer`."""

    def __init__(self, layout: CgroupLayout, rel: str, *, unified: bool = False) -> None:
        self.layout = layout
        v2 = layout.v2_dir(rel) if unified else None
        if unified and v2 is None:
            raise FailedPrecondition("no unified cgroup hierarchy on this host", fix="mount cgroup2 (hybrid or v2)")
        self.dir = v2 if v2 is not None else layout.freezer_dir(rel)
        self.v1 = v2 is None and layout.v1_freezer is not None

    def freeze(self, timeout: float = 10.0) -> None:
        if self.v1:
            self._write("freezer.state", "FROZEN")
            self._wait(lambda: self._read("freezer.state") == "FROZEN", timeout, "freeze")
        else:
            self._write("cgroup.freeze", "1")
            self._wait(lambda: "frozen 1" in self._read("cgroup.events"), timeout, "freeze")

    def thaw(self, timeout: float = 10.0) -> None:
        if self.v1:
            self._write("freezer.state", "THAWED")
            self._wait(lambda: self._read("freezer.state") == "THAWED", timeout, "thaw")
        else:
            self._write("cgroup.freeze", "0")
            self._wait(lambda: "frozen 0" in self._read("cgroup.events"), timeout, "thaw")

    def state(self) -> str:
        if self.v1:
            return self._read("freezer.state")
        return "FROZEN" if "frozen 1" in self._read("cgroup.events") else "THAWED"

    def _read(self, name: str) -> str:
        with open(self.dir / name) as f:
            return f.read().strip()

    def _write(self, name: str, value: str) -> None:
        try:
            fd = os.open(self.dir / name, os.O_WRONLY)
        except FileNotFoundError as e:
            raise FailedPrecondition(f"cgroup {self.dir} does not exist (sandbox not running?)") from e
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    @staticmethod
    def _wait(done, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while not done():
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"cgroup {what} did not complete within {timeout}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)


def unified_freezer(layout: CgroupLayout, rel: str) -> Freezer | None:
    """The v2 freezer of cgroup `rel` on a hybrid host (v1 freezer and a
    unified hierarchy holding the cgroup), else None."""
    v2 = layout.v2_dir(rel)
    if layout.v1_freezer is None or v2 is None or not (v2 / "cgroup.freeze").exists():
        return None
    return Freezer(layout, rel, unified=True)


def copy_limits(src: Path, dst: Path) -> None:
    """Give cgroup `dst` the resource limits of `src` (those runc sets)."""
    # cpuset first: a v1 cpuset cgroup with no cpus refuses tasks (ENOSPC).
    for name in ("cpuset.cpus", "cpuset.mems", "memory.limit_in_bytes", "pids.max", "cpu.cfs_period_us",
                 "cpu.cfs_quota_us", "memory.max", "cpu.max"):
        try:
            v = (src / name).read_text().strip()
            (dst / name).write_text(v)
        except OSError:
            pass


def sweep_cgroup(rel: str, kill: bool = True) -> None:
    """Kill whatever is left in cgroup `rel` (every hierarchy, the unified
    one included: runc delete may leave that one) and remove it.
    kill=False (after a standby's promotion): only remove the empty ones."""
    from .reaper import reap
    cgs = [c / rel.lstrip("/") for c in CGROUP_ROOT.iterdir()]
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


def sweep_standby_cgroups(sandbox_id: str, keep: frozenset[str] | set[str] = frozenset()) -> int:
    """Remove the empty cgroups `/crabd/<sandbox_id>.<token>` (every
    hierarchy) of standbys that are gone (tokens not in `keep`). Returns how
    many went."""
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
