"""OCI runtime config for a sandbox, built as a pure function.

What is in it, and why:
- No `rlimits`: setrlimit is refused on these hosts and runc would fail.
- crabd's own init (a static binary) bind-mounted read-only at
  /dev/.crabd-init: /dev is a tmpfs, so the mount point leaves no trace in
  the sandbox's root file system (and so none in its snapshots), and images
  need no init of their own.
- New network namespace: runc brings up loopback only; sandboxes have no
  outside network unless crabd is told otherwise.
- A createRuntime hook that brings `lo` up (`loopback_hook`). Not for
  `runc create`, which does that itself, but for `runc restore`: runc has
  CRIU restore the network namespace empty (lo down) and runs the
  createRuntime hooks at CRIU's setup-namespaces step, after the namespace
  exists and before any socket is restored. Without it a socket connected
  or bound to 127.0.0.1 (UDP, TCP with tcp-established) cannot be restored:
  "Can't connect inet socket back: Network is unreachable".
- Docker's default capability set and device rules (mknod allowed, access
  to devices not), masked /proc paths, read-only /sys.
- A seccomp filter that allows everything but the kernel state no
  checkpoint can hold (`SECCOMP`): the kernel keyrings are not namespaced
  (the sandbox's uid 0 is the host's, so `add_key` wrote the host root's
  keyring, outlived every rollback and was shared by all sandboxes), and
  CRIU does not save POSIX message queues. Refusing them (EPERM for the
  keyring calls, as Docker's default profile does; ENOSYS for `mq_*`, so a
  program takes its fallback) is the alternative to losing them silently on
  the next rollback. /dev/mqueue is read-only for the same reason (a queue
  can be made by `open` there). New user namespaces are refused too (EPERM
  for `unshare` and `clone` with CLONE_NEWUSER, ENOSYS for `clone3`, whose
  flags a filter cannot read, so glibc falls back to `clone`; Docker's
  default profile refuses them to a container without CAP_SYS_ADMIN the
  same way): in one, a sandbox's process holds every capability, mounts
  file systems, and CRIU cannot dump it, so its processes were lost on the
  next rollback (the checkpoint said `proc_failed`). CRIU dumps and
  restores the filter with the processes; `runc exec` applies it to each
  command.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["Limits", "SECCOMP", "KEYRING_CALLS", "MQUEUE_CALLS", "CLONE_NEWUSER", "INIT_PATH", "RUN_PATH", "build_config", "loopback_hook", "DEFAULT_ENV"]

INIT_PATH = "/dev/.crabd-init"
# Per-sandbox host directory for exec status fifos (see init.c, mode 2).
RUN_PATH = "/dev/.crabd"

DEFAULT_ENV = (
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    "LANG=C.UTF-8",
    "TERM=dumb",
)

_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
    "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]

_MASKED = [
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
    "/sys/firmware",
]
# Architectures whose syscall numbers the rules cover (a 32-bit binary calls
# keyctl by another number; libseccomp maps the names per architecture).
_SECCOMP_ARCHES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
KEYRING_CALLS = ("add_key", "keyctl", "request_key")
MQUEUE_CALLS = ("mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr")
EPERM, ENOSYS = 1, 38
CLONE_NEWUSER = 0x10000000
# unshare(flags) and clone(flags, ...): the flags are argument 0 on these architectures
_NEWUSER_ARG = [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}]
SECCOMP: dict[str, Any] = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": _SECCOMP_ARCHES,
    "syscalls": [
        {"names": list(KEYRING_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        {"names": list(MQUEUE_CALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
        {"names": ["unshare", "clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM, "args": _NEWUSER_ARG},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ],
}

_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


@dataclass(frozen=True)
class Limits:
    """cgroup limits of a sandbox. None = no limit."""

    memory_bytes: int | None = 2 * 1024**3
    pids: int | None = 1024
    cpus: float | None = None  # e.g. 1.5 = one and a half cores

    def to_resources(self) -> dict[str, Any]:
        res: dict[str, Any] = {
            # Docker's defaults: deny all, allow mknod of any device (so an
            # agent's tar of a rootfs works) and the usual pseudo devices.
            "devices": [
                {"allow": False, "access": "rwm"},
                {"allow": True, "type": "c", "access": "m"},
                {"allow": True, "type": "b", "access": "m"},
                {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"},   # null
                {"allow": True, "type": "c", "major": 1, "minor": 5, "access": "rwm"},   # zero
                {"allow": True, "type": "c", "major": 1, "minor": 7, "access": "rwm"},   # full
                {"allow": True, "type": "c", "major": 1, "minor": 8, "access": "rwm"},   # random
                {"allow": True, "type": "c", "major": 1, "minor": 9, "access": "rwm"},   # urandom
                {"allow": True, "type": "c", "major": 5, "minor": 0, "access": "rwm"},   # tty
                {"allow": True, "type": "c", "major": 5, "minor": 2, "access": "rwm"},   # ptmx
                {"allow": True, "type": "c", "major": 136, "access": "rwm"},             # pts
            ],
        }
        if self.memory_bytes is not None:
            res["memory"] = {"limit": int(self.memory_bytes)}
        if self.pids is not None:
            res["pids"] = {"limit": int(self.pids)}
        if self.cpus is not None:
            period = 100_000
            res["cpu"] = {"quota": int(self.cpus * period), "period": period}
        return res

    def to_dict(self) -> dict[str, Any]:
        return {"memory_bytes": self.memory_bytes, "pids": self.pids, "cpus": self.cpus}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Limits":
        return cls(memory_bytes=d.get("memory_bytes"), pids=d.get("pids"), cpus=d.get("cpus"))


def loopback_hook(sh: str, nsenter: str, ip: str) -> dict[str, Any]:
    """An OCI hook that sets `lo` up in the network namespace of the pid in
    the container state runc writes on the hook's stdin (compact JSON,
    `"pid":N`). Parsed with shell builtins only: sh, nsenter and ip are
    the three processes it costs (a few ms, on create and on restore). Pure."""
    script = (f'IFS= read -r s; p=${{s#*\\"pid\\":}}; p=${{p%%[!0-9]*}}; '
              f'[ -n "$p" ] && exec {nsenter} -t "$p" -n {ip} link set lo up')
    return {"path": sh, "args": ["sh", "-c", script], "timeout": 10}


def build_config(*, sandbox_id: str, init_source: str, run_source: str, cgroups_path: str, limits: Limits,
                 env: tuple[str, ...] = DEFAULT_ENV, annotations: dict[str, str] | None = None,
                 network_ns_path: str | None = None, hooks: dict[str, list[dict[str, Any]]] | None = None,
                 init_args: tuple[str, ...] = (),
                 ) -> dict[str, Any]:
    """The config.json of a sandbox bundle whose root is `<bundle>/rootfs`.
    `hooks`: OCI hooks by kind, e.g. {"createRuntime": [loopback_hook(...)]}.
    `init_args`: arguments of crabd's init (("--channel", path): the fast exec path)."""
    namespaces: list[dict[str, str]] = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    namespaces.append({"type": "network", "path": network_ns_path} if network_ns_path else {"type": "network"})
    caps = list(_CAPS)
    cfg: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH, *init_args],
            "env": list(env),
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": False,
        },
        "root": {"path": "rootfs", "readonly": False},
        "hostname": sandbox_id[:63],
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": INIT_PATH, "type": "bind", "source": init_source,
             "options": ["bind", "ro", "nosuid", "nodev"]},
            {"destination": RUN_PATH, "type": "bind", "source": run_source,
             "options": ["bind", "ro", "nosuid", "nodev", "noexec"]},
        ],
        "annotations": dict(annotations or {}),
        "linux": {
            "cgroupsPath": cgroups_path,
            "resources": limits.to_resources(),
            "namespaces": namespaces,
            "maskedPaths": list(_MASKED),
            "readonlyPaths": list(_READONLY),
            "seccomp": copy.deepcopy(SECCOMP),
        },
    }
    if hooks:
        cfg["hooks"] = {k: list(v) for k, v in hooks.items()}
    return cfg
