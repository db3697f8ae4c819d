"""What a caller wants from a dump or a restore, as a flat record of intent,
and the pure functions that turn it into runc command lines.

Modelled on runc's CriuOpts: one field per decision, one comment per field,
modes as validated enums. Runtime facts (which container, where its root
and images are) are not options: the functions that run runc fill them in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Mapping

from .errors import InvalidArgument

__all__ = ["CgroupsMode", "NetworkLock", "DumpOptions", "config_lines", "RestoreOptions", "checkpoint_argv", "restore_argv", "required_features"]


class CgroupsMode(str, enum.Enum):
    """How CRIU treats the container's cgroups (runc --manage-cgroups-mode)."""

    SOFT = "soft"      # restore cgroup properties only where the cgroup is new (runc's default)
    FULL = "full"      # restore every property
    STRICT = "strict"  # refuse to restore into cgroups that differ from the dumped ones


class NetworkLock(str, enum.Enum):
    """Whether CRIU locks the sandbox's network (iptables/nftables rules)
    while it dumps or restores, so that TCP peers see no resets."""

    AUTO = "auto"  # lock only when TCP connections are dumped (tcp_established)
    LOCK = "lock"  # always lock (CRIU's own default)
    SKIP = "skip"  # never lock: a sandbox on loopback only has no peer to protect; saves ~40-60 ms per run


# DumpOptions.for_private_netns's ghost_limit: a deleted-but-open file up to
# this size is saved with the processes (zdtm ghost_multi_hole*: 4 MiB).
GHOST_LIMIT = 64 << 20


@dataclass(frozen=True)
class DumpOptions:
    # Keep the sandbox running after the dump (a checkpoint, not a migration).
    leave_running: bool = True
    # Dump established TCP connections (CRIU repairs them on restore); without
    # it a connected TCP socket makes the dump fail.
    tcp_established: bool = False
    # Dump unix sockets whose peer is outside the sandbox (the peer is not
    # restored; the socket comes back disconnected). Without it such a
    # socket makes the dump fail -- the safe default.
    ext_unix_sk: bool = False
    # Allow processes attached to a terminal / session outside the sandbox.
    shell_job: bool = False
    # Dump and restore file locks (flock, POSIX locks).
    file_locks: bool = False
    # Dump a listening TCP socket whose accept queue holds connections
    # without them (CRIU's --skip-in-flight): the socket comes back with an
    # empty queue, so those clients lose their connection (a reset, as when
    # a server restarts). Without it such a socket makes the whole dump fail.
    skip_in_flight: bool = False
    # Largest deleted-but-open file whose contents the image carries (CRIU's
    # --ghost-limit, bytes); 0 keeps CRIU's default, 1 MiB. A bigger one
    # makes the whole dump fail.
    ghost_limit: int = 0
    # cgroup handling; see CgroupsMode.
    manage_cgroups_mode: CgroupsMode = CgroupsMode.SOFT
    # Network locking during the dump; see NetworkLock.
    network_lock: NetworkLock = NetworkLock.AUTO
    # An open file whose name was unlinked while another hard link keeps it
    # is dumped through a hard link CRIU makes next to the old name (CRIU's
    # --link-remap), which the restore opens and removes. CRIU removes it
    # after a dump that leaves the tasks running, so the caller must keep it
    # in the file system the restore sees (crabd.runtime.linkremap). Without
    # it such a file makes the whole dump fail.
    link_remap: bool = False
    # Seconds the whole runc checkpoint may take before it is killed.
    timeout: float = 120.0
    # Seconds without progress (CRIU's log and image not growing, CRIU using
    # no CPU and doing no I/O; see deltacr.runc) before the dump is killed,
    # CRIU with it: a dump that cannot get on (e.g. seizing a stopped task
    # in a frozen cgroup) stalls the turn this long, not `timeout`.
    stall_timeout: float = 10.0

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def for_private_netns(cls, tcp_connections: bool, **kw: Any) -> "DumpOptions":
        """What a sandbox in a network namespace of its own (loopback only)
        needs: every TCP connection there has both ends in the sandbox, so
        dumping established ones is exact (CRIU repairs both ends on
        restore); file locks and leases are dumped (SQLite, pip, apt and
        servers hold them). The network is locked only while there are TCP
        connections to protect (`tcp_connections`, a runtime fact the caller
        reads): a lock costs CRIU an iptables-restore on each side of the
        dump and of the restore. A connection to a peer outside the sandbox
        (a sandbox given a shared network namespace) would be dumped too, but
        on restore the peer has moved on: it sees a reset or a stale stream.

        Connections a server has not accept()ed yet are left out of the
        image (`skip_in_flight`): CRIU cannot dump an accept queue, and the
        choice is between losing those connections and losing every process
        of the sandbox (a refused dump leaves a files-only checkpoint). Both
        lose the connection; the client sees a reset after a restore, as
        after a server restart, and the checkpoint's reasons say it
        happened (`skipped_in_flight` in the dump log).

        Deleted files a process still holds open (temporary files, a log
        rotated away) go into the image up to GHOST_LIMIT each instead of
        CRIU's 1 MiB: a bigger one would cost the whole process image."""
        lock = NetworkLock.LOCK if tcp_connections else NetworkLock.SKIP
        return cls(**{"tcp_established": True, "file_locks": True, "skip_in_flight": True, "network_lock": lock,
                      "ghost_limit": GHOST_LIMIT, **kw})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DumpOptions":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


@dataclass(frozen=True)
class RestoreOptions:
    # Same meanings as in DumpOptions; must match what the image holds (a
    # dump with tcp_established needs a restore with it).
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    file_locks: bool = False
    manage_cgroups_mode: CgroupsMode = CgroupsMode.SOFT
    network_lock: NetworkLock = NetworkLock.AUTO
    # Use chroot-like MS_MOVE instead of pivot_root (roots on a ramdisk).
    no_pivot: bool = False
    # Seconds the whole runc restore may take before it is killed.
    timeout: float = 120.0
    # Seconds without progress before the restore is killed (see DumpOptions).
    stall_timeout: float = 10.0

    def __post_init__(self) -> None:
        _validate(self)

    @classmethod
    def from_dump(cls, d: DumpOptions) -> "RestoreOptions":
        """The restore options an image dumped with `d` needs."""
        return cls(tcp_established=d.tcp_established, ext_unix_sk=d.ext_unix_sk, shell_job=d.shell_job,
                   file_locks=d.file_locks, manage_cgroups_mode=d.manage_cgroups_mode, network_lock=d.network_lock)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RestoreOptions":
        return _from_dict(cls, d)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def _validate(o: DumpOptions | RestoreOptions) -> None:
    for f in fields(o):
        v = getattr(o, f.name)
        if f.name in ("manage_cgroups_mode", "network_lock"):
            enum_t = CgroupsMode if f.name == "manage_cgroups_mode" else NetworkLock
            try:
                object.__setattr__(o, f.name, enum_t(v))
            except ValueError:
                raise InvalidArgument(f"{f.name} {v!r} is not one of "
                                      f"{', '.join(m.value for m in enum_t)}") from None
        elif f.name == "ghost_limit":
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgument(f"ghost_limit must be a number of bytes >= 0, not {v!r}")
        elif f.name in ("timeout", "stall_timeout"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise InvalidArgument(f"{f.name} must be a positive number of seconds, not {v!r}")
        elif not isinstance(v, bool):
            raise InvalidArgument(f"option {f.name} must be true or false, not {v!r}")


def _from_dict(cls, d: Mapping[str, Any]):  # type: ignore[no-untyped-def]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise InvalidArgument(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**dict(d))


def _to_dict(o: DumpOptions | RestoreOptions) -> dict[str, Any]:
    out = {f.name: getattr(o, f.name) for f in fields(o)}
    out["manage_cgroups_mode"] = o.manage_cgroups_mode.value
    out["network_lock"] = o.network_lock.value
    return out


def config_lines(o: DumpOptions | RestoreOptions) -> list[str]:
    """CRIU config-file lines for what runc has no flag for. Pure."""
    lock = o.network_lock
    if lock is NetworkLock.AUTO:
        lock = NetworkLock.LOCK if o.tcp_established else NetworkLock.SKIP
    out = ["network-lock skip"] if lock is NetworkLock.SKIP else []
    if isinstance(o, DumpOptions) and o.skip_in_flight:
        out.append("skip-in-flight")
    if isinstance(o, DumpOptions) and o.ghost_limit:
        out.append(f"ghost-limit {o.ghost_limit}")
    if isinstance(o, DumpOptions) and o.link_remap:
        out.append("link-remap")
    return out


def _common_flags(o: DumpOptions | RestoreOptions) -> list[str]:
    out = []
    if o.tcp_established:
        out.append("--tcp-established")
    if o.ext_unix_sk:
        out.append("--ext-unix-sk")
    if o.shell_job:
        out.append("--shell-job")
    if o.file_locks:
        out.append("--file-locks")
    if o.manage_cgroups_mode is not CgroupsMode.SOFT:
        out += ["--manage-cgroups-mode", o.manage_cgroups_mode.value]
    return out


def _runc_prefix(runc: str, runc_root: str, criu: str) -> list[str]:
    argv = [runc, "--root", runc_root]
    if criu != "criu":
        argv += ["--criu", criu]
    return argv


def checkpoint_argv(runc: str, runc_root: str, container_id: str, image_dir: str, work_dir: str,
                    opts: DumpOptions, criu: str = "criu") -> list[str]:
    """`runc checkpoint` of `container_id` into `image_dir`. Pure."""
    argv = _runc_prefix(runc, runc_root, criu) + ["checkpoint", "--image-path", image_dir, "--work-path", work_dir]
    if opts.leave_running:
        argv.append("--leave-running")
    return argv + _common_flags(opts) + [container_id]


def restore_argv(runc: str, runc_root: str, container_id: str, bundle: str, image_dir: str, work_dir: str,
                 pid_file: str, opts: RestoreOptions, criu: str = "criu") -> list[str]:
    """Detached `runc restore` of `image_dir` as container `container_id`. Pure."""
    argv = _runc_prefix(runc, runc_root, criu) + ["restore", "--bundle", bundle, "--image-path", image_dir,
            "--work-path", work_dir, "--detach", "--pid-file", pid_file]
    if opts.no_pivot:
        argv.append("--no-pivot")
    return argv + _common_flags(opts) + [container_id]


# CRIU features (`criu check --feature NAME`) each option relies on.
_BASE_FEATURES = ("mnt_id", "seccomp_filters", "ns_pid")


def required_features(o: DumpOptions | RestoreOptions) -> tuple[str, ...]:
    """The CRIU features a dump/restore with `o` needs. Pure."""
    feats = list(_BASE_FEATURES)
    if o.tcp_established:
        feats.append("tcp_half_closed")
    if o.file_locks:
        feats.append("fdinfo_lock")
    return tuple(feats)
