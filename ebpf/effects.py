"""`Effects`: what one agent turn did to the OS, as data.

One record per turn and sandbox, produced by `Inspector.end_turn` (BPF) or
`ProcInspector.end_turn` (/proc fallback), consumed by `ebpf.classify` and
stored by crabd in its effects ledger. It is a pydantic model, so
`effects.model_dump_json()` / `Effects.model_validate_json()` round-trip, and
`Effects.model_json_schema()` is the documented schema.

Conventions:
- A turn covers everything since the previous `end_turn` of the sandbox (or
  since `watch`): a change made between turns, by a background process, is
  reported with the next turn, because the last checkpoint does not hold it.
- Paths are as the sandbox's processes named them, in their own mount
  namespace: absolute paths are paths inside the sandbox; relative paths are
  relative to the process's working directory; `fd<N>:name` is relative to
  directory fd N; `fd<N>` alone is an operation on an open fd (fchmod, ...).
- Pids are host pids (the inspector runs in the host's pid namespace).
- Samples are bounded (`MAX_SAMPLES` distinct values, first seen first);
  `count` is always the full count.
- Names need not be UTF-8 (file names, argv, unix socket paths -- a bind
  whose address has no NUL shows the bytes after it too). Inside a record
  they keep their bytes as surrogate escapes; serialized, the bytes that are
  not UTF-8 read as `\\xNN` (JSON and UTF-8 cannot carry lone surrogates).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_serializer

SCHEMA_VERSION: Literal[1] = 1
MAX_SAMPLES = 16

Source = Literal["bpf-cgroup", "bpf-pids", "proc", "loading"]


def text_safe(v: Any) -> Any:
    """`v` with every string's surrogate escapes (bytes that are not UTF-8)
    shown as `\\xNN`, so that it encodes as UTF-8 and JSON. Pure."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
            return v
        except UnicodeEncodeError:
            return v.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(v, dict):
        return {text_safe(k): text_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [text_safe(x) for x in v]
    return v


class Sample(BaseModel):
    """A count and a bounded sample of distinct values (paths, addresses)."""

    model_config = ConfigDict(extra="forbid")

    count: int = 0
    sample: list[str] = Field(default_factory=list)

    def add(self, value: str, limit: int = MAX_SAMPLES) -> None:
        self.count += 1
        if len(self.sample) < limit and value not in self.sample:
            self.sample.append(value)


class ExecRecord(BaseModel):
    """A program a sandbox process exec'd (successfully) during the turn."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    filename: str
    argv: list[str] = Field(default_factory=list, description="first 8 arguments, each cut at 31 bytes")
    package_manager: str | None = Field(None, description="canonical name (apt, dpkg, pip, npm, cargo, go, gem, ...)")
    external_tool: str | None = Field(None, description="why this program is an external effect (e.g. 'git push')")


class ProcessRecord(BaseModel):
    """A process of the sandbox, as /proc showed it at the end of the turn
    (or at the end of the previous turn, for processes that are gone)."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    comm: str = ""
    cmdline: list[str] = Field(default_factory=list)


class SocketRecord(BaseModel):
    """A socket put into listening state during the turn."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    address: str = Field(description="'0.0.0.0:8000', '[::]:80', a unix path, or '?' when the bind was not seen")
    alive: bool = Field(description="the listening process was alive at the end of the turn")


class Connections(BaseModel):
    """Outbound connections (connect, and sends with a destination address)."""

    model_config = ConfigDict(extra="forbid")

    loopback: Sample = Field(default_factory=Sample, description="127.0.0.0/8, ::1, 0.0.0.0")
    external: Sample = Field(default_factory=Sample, description="any other inet/inet6 destination, or an unknown family")
    unix: Sample = Field(default_factory=Sample, description="unix-domain sockets (paths, @abstract names)")


# A note that starts so names state a process checkpoint of this turn does not
# hold (the classifier repeats it among an FS_PROC plan's reasons).
NOT_RESTORED = "not restored: "


class Effects(BaseModel):
    """The OS-visible effects of one turn of one sandbox."""

    model_config = ConfigDict(extra="forbid")

    # Every field, nested records included. A wrap field serializer with no
    # return annotation keeps the serialization JSON schema (an annotation,
    # or a model serializer, would replace every field's schema).
    @field_serializer("*", mode="wrap")
    def _serialize(self, value: Any, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # zdtm sk-unix-rel: a unix bind's path with bytes that are not UTF-8
        # made every API reply carrying these effects fail to encode (500).
        return text_safe(handler(value))

    schema_version: Literal[1] = SCHEMA_VERSION
    sandbox_id: str
    turn: int = Field(description="1 for the first end_turn after watch, then +1 per end_turn")
    source: Source = Field(description="bpf-cgroup, bpf-pids (no unified cgroup hierarchy), proc (no BPF), or "
                        "loading (the inspector had not loaded yet: nothing was observed)")
    started_ns: int = Field(0, description="CLOCK_MONOTONIC at begin_turn (0 if begin_turn was not called)")
    ended_ns: int = Field(0, description="CLOCK_MONOTONIC at end_turn")

    files: dict[str, Sample] = Field(
        default_factory=dict,
        description=(
            "changes to the sandbox's file system per kind: write (open for write/create/truncate), "
            "delete, rmdir, rename ('old -> new'), mkdir, link, symlink ('link -> target'), chmod, chown, "
            "truncate, xattr, mknod, utimes, attr (inode flags set by ioctl: chattr), socket (unix socket file "
            "bound); the proc fallback reports "
            "everything its change probe saw as 'changed'"
        ),
    )
    special_writes: dict[str, Sample] = Field(
        default_factory=dict,
        description=(
            "writes outside the file-system snapshot: device (/dev/null, /dev/pts/*, ...: ignored), "
            "process (/proc/self/*: affects only the writer), kernel (/proc, /sys: kernel state), "
            "tmpfs (/dev/shm, the rest of /dev, /dev/mqueue: lives in memory, only a process checkpoint "
            "keeps it; a write by an absolute /dev path, or a path the turn-end comparison of the "
            "sandbox's memory file systems found changed, sampled as 'PATH (changed in memory)'), "
            "held (a file only a process holds: deleted while open, or a memfd, reached through "
            "/proc/PID/fd/N; only that process's checkpoint keeps it), "
            "outside (under a path the watcher declared not part of the sandbox's file system: ignored)"
        ),
    )
    transient_files: int = Field(
        0,
        description=(
            "files/directories created (O_EXCL, mkdir) and deleted again by the same process within "
            "the turn, e.g. lock files: no net change, not counted in `files`"
        ),
    )
    write_syscalls: int = Field(0, description="write/pwrite/writev/sendfile/splice/copy_file_range/fallocate calls")

    execs: list[ExecRecord] = Field(default_factory=list, description=f"first {MAX_SAMPLES} execs")
    exec_count: int = 0
    package_managers: list[str] = Field(default_factory=list, description="package managers run (sorted)")
    processes_started: int = Field(0, description="forks seen during the turn")
    new_processes: list[ProcessRecord] = Field(
        default_factory=list, description="created during the turn and still alive at its end"
    )
    exited_processes: list[ProcessRecord] = Field(
        default_factory=list, description="alive at the previous turn's end, gone now"
    )
    active_processes: list[ProcessRecord] = Field(
        default_factory=list,
        description="alive at the previous turn's end and ran during this one (their memory may have changed)",
    )
    listening: list[SocketRecord] = Field(default_factory=list)
    connections: Connections = Field(default_factory=Connections)
    mounts: Sample = Field(default_factory=Sample, description="mount, umount, move_mount, mount_setattr")
    kernel_objects: Sample = Field(
        default_factory=Sample, description="System V IPC objects, POSIX message queues created or used"
    )
    blind_spots: list[str] = Field(
        default_factory=list,
        description="things done that the inspector cannot see through (io_uring, ptrace pokes, ...)",
    )
    dropped_events: int = Field(0, description="events lost (full ring buffer or pending table)")

    external: bool = Field(False, description="an effect outside the sandbox was seen: rollback cannot undo it")
    external_reasons: list[str] = Field(default_factory=list)
    external_unknown: bool = Field(
        False, description="external effects may have happened unseen (dropped events, proc fallback)"
    )
    notes: list[str] = Field(default_factory=list)

    @property
    def file_changes(self) -> int:
        return sum(s.count for s in self.files.values())
