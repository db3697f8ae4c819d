"""`crabd doctor`: is this host ready for crabd, and if not, what to do.

Each check really exercises the feature (mounts an overlay, formats and
mounts a loop btrfs, loads a BPF program, runs `criu check`) rather than
looking for a file, and reports ok / warn / fail with a one-line fix. A check
never raises: whatever goes wrong inside it becomes its `fail` line.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import config
from .runtime.cgroups import detect_layout

__all__ = ["Check", "run_checks", "CHECKS"]

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_FREE_OK = 10 * 1024**3
MIN_FREE_WARN = 2 * 1024**3


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def check_root(state_dir: Path) -> Check:
    if os.geteuid() == 0:
        return Check("root", OK, "running as root")
    return Check("root", FAIL, f"running as uid {os.geteuid()}", "run crabd as root (it manages mounts, cgroups, runc)")


def check_kernel(state_dir: Path) -> Check:
    rel = platform.release()
    m = re.match(r"(\d+)\.(\d+)", rel)
    ver = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if ver >= (5, 10):
        return Check("kernel", OK, f"Linux {rel}")
    return Check("kernel", FAIL, f"Linux {rel} is older than 5.10", "boot a kernel >= 5.10")


def check_overlayfs(state_dir: Path) -> Check:
    with tempfile.TemporaryDirectory(prefix="crabd-doctor-") as t:
        for d in ("lower", "upper", "work", "merged"):
            os.mkdir(os.path.join(t, d))
        Path(t, "lower", "a").write_text("lower")
        opts = f"lowerdir={t}/lower,upperdir={t}/upper,workdir={t}/work"
        r = _run(["mount", "-t", "overlay", "overlay", "-o", opts, f"{t}/merged"])
        if r.returncode != 0:
            return Check("overlayfs", FAIL, f"mount -t overlay failed: {r.stderr.strip()}", "modprobe overlay")
        try:
            Path(t, "merged", "a").write_text("upper")
            ok = Path(t, "upper", "a").read_text() == "upper" and Path(t, "lower", "a").read_text() == "lower"
        finally:
            _run(["umount", f"{t}/merged"])
        if not ok:
            return Check("overlayfs", FAIL, "overlay copy-up did not behave", "check the kernel's overlayfs")
        return Check("overlayfs", OK, "overlay mount and copy-up work")


def _loop_fs(kind: str, mkfs: list[str], size: int, probe: Callable[[str], str]) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="crabd-doctor-", dir="/var/tmp") as t:
        img = os.path.join(t, "img")
        mnt = os.path.join(t, "mnt")
        os.mkdir(mnt)
        with open(img, "wb") as f:
            f.truncate(size)  # sparse
        r = _run([*mkfs, img], timeout=60)
        if r.returncode != 0:
            return False, f"{mkfs[0]} failed: {r.stderr.strip().splitlines()[-1:]}"
        r = _run(["mount", "-o", "loop", img, mnt])
        if r.returncode != 0:
            return False, f"loop mount of {kind} failed: {r.stderr.strip()}"
        try:
            return True, probe(mnt)
        finally:
            _run(["umount", mnt])


def check_btrfs(state_dir: Path) -> Check:
    if shutil.which("mkfs.btrfs") is None:
        return Check("btrfs", FAIL, "mkfs.btrfs not found", "apt-get install btrfs-progs (scripts/setup-host)")

    def probe(mnt: str) -> str:
        r = _run(["btrfs", "subvolume", "create", f"{mnt}/sv"])
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip())
        r = _run(["btrfs", "subvolume", "snapshot", "-r", f"{mnt}/sv", f"{mnt}/snap"])
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip())
        return "loop-backed btrfs: subvolume and read-only snapshot work"

    try:
        ok, detail = _loop_fs("btrfs", ["mkfs.btrfs", "-q", "-f"], 256 * 1024**2, probe)
    except Exception as e:
        return Check("btrfs", FAIL, f"btrfs probe failed: {e}", "modprobe btrfs loop")
    on_btrfs = _fstype(state_dir) == "btrfs"
    if ok:
        where = "state dir is on btrfs" if on_btrfs else "state dir is not on btrfs: crabd uses a loop-backed pool file"
        return Check("btrfs", OK, f"{detail}; {where}")
    return Check("btrfs", FAIL, detail, "modprobe btrfs loop; check /dev/loop-control exists")


def check_xfs_reflink(state_dir: Path) -> Check:
    if shutil.which("mkfs.xfs") is None:
        return Check("xfs-reflink", WARN, "mkfs.xfs not found", "apt-get install xfsprogs (scripts/setup-host)")

    def probe(mnt: str) -> str:
        Path(mnt, "a").write_bytes(b"x" * 65536)
        r = _run(["cp", "--reflink=always", f"{mnt}/a", f"{mnt}/b"])
        if r.returncode != 0:
            raise RuntimeError(f"cp --reflink=always: {r.stderr.strip()}")
        return "loop-backed XFS with reflink=1: cp --reflink works"

    try:
        ok, detail = _loop_fs("xfs", ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], 512 * 1024**2, probe)
    except Exception as e:
        return Check("xfs-reflink", WARN, f"XFS reflink probe failed: {e}", "only the overlay driver's copy speed depends on it")
    if ok:
        return Check("xfs-reflink", OK, detail)
    return Check("xfs-reflink", WARN, detail, "only the overlay driver's copy speed depends on it")


def check_freezer(state_dir: Path) -> Check:
    lay = detect_layout()
    if lay.v1_freezer is not None:
        return Check("cgroup-freezer", OK, f"cgroup v1 freezer at {lay.v1_freezer}")
    if lay.v2_only:
        return Check("cgroup-freezer", OK, "cgroup v2 freezer (cgroup.freeze)")
    return Check("cgroup-freezer", FAIL, "no cgroup freezer", "mount -t cgroup -o freezer freezer /sys/fs/cgroup/freezer")


def check_unified(state_dir: Path) -> Check:
    lay = detect_layout()
    if lay.unified is not None:
        return Check("cgroup-v2", OK, f"unified hierarchy at {lay.unified}: BPF attributes tasks by cgroup id")
    return Check("cgroup-v2", WARN, "no unified cgroup hierarchy: the inspector follows pids instead (may miss runc exec'd processes)",
                 "mount -t cgroup2 none /sys/fs/cgroup/unified")


def check_criu(state_dir: Path) -> Check:
    """deltacr's own CRIU check (version, `criu check`), the one the daemon's
    first dump runs, cached per process: doctor and the daemon cannot
    disagree about what CRIU needs."""
    from deltacr import CriuUnavailable, check_criu as criu_info
    from deltacr.runc import SubprocessCommandRunner
    try:
        info = criu_info(SubprocessCommandRunner())
    except CriuUnavailable as e:
        return Check("criu", FAIL, e.message, e.fix or "run scripts/setup-host (installs CRIU >= 4)")
    exe = shutil.which(info.binary) or info.binary
    return Check("criu", OK, f"CRIU {'.'.join(map(str, info.version))} ({exe}); criu check passes")


def check_criu_stopped_tasks(state_dir: Path) -> Check:
    """A host property: on a cgroup v1 freezer, a stopped task cannot be dumped."""
    from .runtime.criu import STOPPED_TASK_LIMIT
    lay = detect_layout()
    if lay.v1_freezer is None:
        return Check("criu-stopped-tasks", OK, "cgroup v2 freezer: the v1 freezer's hang seizing stopped (SIGSTOP) "
                     "tasks does not apply; CRIU dumps and restores them (checked with CRIU 4.1.1 and a v2 freezer, "
                     "test_criu_conformance; crabd's whole path is not run on a v2-only host)")
    if lay.unified is not None:
        return Check("criu-stopped-tasks", OK, "cgroup v1 freezer with a unified (v2) hierarchy: a dump of a sandbox "
                     "with a stopped (SIGSTOP) task freezes it through its v2 cgroup (the v1 freezer would hang CRIU "
                     "seizing the stopped task), so its processes are checkpointed and come back stopped")
    # ok, not warn: a property of the host that no setup step changes; the
    # checkpoint of such a sandbox says why it holds files only.
    return Check("criu-stopped-tasks", OK,
                 f"host property: a sandbox with a stopped (SIGSTOP/SIGTSTP) task gets files-only checkpoints: "
                 f"{STOPPED_TASK_LIMIT}",
                 "SIGCONT stopped tasks before a turn ends; a host with cgroup v2 only does not have this limit "
                 "(CRIU with a v2 freezer dumps them)")


def check_criu_rlimits(state_dir: Path) -> Check:
    """A host property: without CAP_SYS_RESOURCE CRIU cannot prlimit() another
    user's task; deltacr's shim reads /proc/PID/limits instead."""
    from deltacr.compat import has_cap_sys_resource
    if has_cap_sys_resource():
        return Check("criu-rlimits", OK, "CAP_SYS_RESOURCE: CRIU reads every task's rlimits itself")
    detail = ("host property: no CAP_SYS_RESOURCE on this host: CRIU's prlimit() of a task of another user (www-data, nobody) is "
              "refused; crabd runs CRIU with deltacr's shim, which reads those rlimits from /proc/PID/limits")
    if shutil.which("cc") or shutil.which("gcc"):
        return Check("criu-rlimits", OK, detail + " (C compiler present to build it)")
    return Check("criu-rlimits", FAIL, detail + ", and no C compiler is installed to build the shim: processes of "
                 "other users cannot be checkpointed", "apt-get install gcc libc6-dev")


def check_restore_loopback(state_dir: Path) -> Check:
    missing = [t for t in ("sh", "nsenter", "ip") if not shutil.which(t)]
    if not missing:
        return Check("restore-loopback", OK, "sandboxes get a createRuntime hook that brings lo up before CRIU "
                     "restores their sockets (sh, nsenter, ip)")
    return Check("restore-loopback", WARN, f"{', '.join(missing)} not found: lo comes up only after a restore, so "
                 "sockets bound or connected to 127.0.0.1 cannot be restored", "apt-get install iproute2 util-linux")


def check_runc(state_dir: Path) -> Check:
    exe = shutil.which(config.runc_binary())
    if exe is None:
        return Check("runc", FAIL, "runc not found", "apt-get install runc (scripts/setup-host)")
    r = _run([exe, "--version"])
    first = r.stdout.splitlines()[0] if r.stdout else "?"
    init = config.init_binary()
    if not init.is_file():
        return Check("runc", FAIL, f"{first}; crabd-init missing at {init}", "run scripts/setup-host (builds crabd-init)")
    return Check("runc", OK, f"{first}; sandbox init {init}")


_BPF_PROBE = """
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) { return 0; }
"""


def check_bpf(state_dir: Path) -> Check:
    # In a child process: bcc compiles with clang in-process and a failure
    # there must not take the doctor down; it also keeps load time separate.
    code = ("import bcc; b = bcc.BPF(text=%r); "
            "print('loaded', len(b.tracepoint_fn) if hasattr(b, 'tracepoint_fn') else 1)") % _BPF_PROBE
    try:
        r = subprocess.run([os.environ.get("CRABD_PYTHON", _python()), "-c", code], capture_output=True,
                           text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return Check("bpf", FAIL, "loading a BPF tracepoint program timed out", "check kernel headers (scripts/setup-host)")
    if r.returncode == 0:
        return Check("bpf", OK, "bcc compiled and attached a tracepoint program (syscalls:sys_enter_getppid)")
    err = r.stderr.strip().splitlines()
    if any("No module named 'bcc'" in ln for ln in err):
        return Check("bpf", FAIL, "Python bcc bindings not importable", "apt-get install python3-bpfcc; run scripts/setup-host")
    return Check("bpf", FAIL, f"BPF load failed: {' | '.join(err[-3:])}",
                 "run scripts/setup-host (kernel headers at /lib/modules/$(uname -r)/build); the fallback /proc inspector is used meanwhile")


def _python() -> str:
    import sys
    return sys.executable


def check_tracefs(state_dir: Path) -> Check:
    if Path("/sys/kernel/tracing/events/syscalls").is_dir():
        return Check("tracefs", OK, "tracefs at /sys/kernel/tracing with syscall tracepoints")
    if Path("/sys/kernel/tracing/events").is_dir():
        return Check("tracefs", WARN, "tracefs mounted but no syscall tracepoints", "kernel needs CONFIG_FTRACE_SYSCALLS")
    return Check("tracefs", FAIL, "tracefs not mounted", "mount -t tracefs tracefs /sys/kernel/tracing")


def check_docker(state_dir: Path) -> Check:
    try:
        import docker
        client = docker.from_env(timeout=5)
        v = client.version()
        return Check("docker", OK, f"Docker engine {v.get('Version', '?')} answers (docker:// image imports work)")
    except Exception as e:
        return Check("docker", WARN, f"no Docker engine answers ({type(e).__name__})",
                     "dockerd --iptables=false --bridge=none & (scripts/setup-host starts one); only docker:// imports need it")


def check_space(state_dir: Path) -> Check:
    p = state_dir
    while not p.exists() and p != p.parent:
        p = p.parent
    du = shutil.disk_usage(p)
    detail = f"{du.free / 1024**3:.1f} GiB free for {state_dir} (on {p})"
    if du.free >= MIN_FREE_OK:
        return Check("disk-space", OK, detail)
    if du.free >= MIN_FREE_WARN:
        return Check("disk-space", WARN, detail, "free space or move --state-dir: checkpoints and images need room")
    return Check("disk-space", FAIL, detail, "free space or move --state-dir (need >= 2 GiB)")


def _fstype(path: Path) -> str:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    r = _run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(p)])
    return r.stdout.strip()


CHECKS: list[Callable[[Path], Check]] = [
    check_root, check_kernel, check_overlayfs, check_btrfs, check_xfs_reflink, check_freezer, check_unified,
    check_criu, check_criu_stopped_tasks, check_criu_rlimits, check_restore_loopback, check_runc, check_bpf, check_tracefs, check_docker, check_space,
]


def run_checks(state_dir: Path | None = None) -> list[Check]:
    sd = state_dir or config.state_dir_from_env()
    out = []
    for fn in CHECKS:
        try:
            out.append(fn(sd))
        except Exception as e:  # a broken check is a failed check, not a crash
            name = fn.__name__.removeprefix("check_").replace("_", "-")
            out.append(Check(name, FAIL, f"check crashed: {type(e).__name__}: {e}", "report this as a crabd bug"))
    return out
