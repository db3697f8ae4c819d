"""The event record the BPF program emits, and its constants.

This module is the single source of truth for the layout: `program_text()`
renders the constants as C `#define`s in front of ebpf/inspector.c, and
`decode()` turns the raw bytes of one ring-buffer record into an `Event`.
Nothing here touches the kernel, so it is tested without root.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import platform
from dataclasses import dataclass
from importlib import resources

PATH_LEN = 256
ARGV_SLOTS = 8
ARG_LEN = PATH_LEN // ARGV_SLOTS
MAX_TAGS = 1024
MAX_LEVELS = 4
MAX_PIDS = 65536
MAX_PENDING = 16384
MAX_SEEN = 65536
FILE_KINDS_MAX = 16  # file event kinds are < 16
FILE_EMIT_LIMIT = 256  # plain file events per CPU and turn sent to userspace
RINGBUF_PAGES = 1024  # 4 MiB: ~7000 events in flight
AT_FDCWD = -100

O_WRONLY = 0o1
O_RDWR = 0o2
O_CREAT = 0o100
O_EXCL = 0o200
O_TRUNC = 0o1000
O_APPEND = 0o2000
O_TMPFILE = 0o20000000 | 0o200000
# ioctl commands that set an inode's attributes (linux/fs.h; the generic
# _IOW encoding of x86_64, arm64 and riscv64): FS_IOC_SETFLAGS (long and its
# 32-bit form, chattr) and FS_IOC_FSSETXATTR (struct fsxattr, xfs_io chattr)
FS_IOC_SETFLAGS = 0x40086602
FS_IOC32_SETFLAGS = 0x40046602
FS_IOC_FSSETXATTR = 0x401C5820
# Flags with which an open can change a file (O_TMPFILE needs O_WRONLY/RDWR).
OPEN_WRITE_FLAGS = O_WRONLY | O_RDWR | O_CREAT | O_TRUNC | O_APPEND

# restart_syscall(2): how the kernel resumes a sleep a signal or the freezer
# interrupted (nanosleep, poll, futex with a timeout), per architecture
RESTART_SYSCALL = {"x86_64": 219, "aarch64": 128, "riscv64": 128, "ppc64le": 0, "s390x": 7}
RESTART_SYSCALL_NR = RESTART_SYSCALL.get(platform.machine(), -1)

# EV_OPAQUE's arg: what could not be seen through (reasons in ebpf._turn).
OPAQUE_URING_SETUP, OPAQUE_VM_WRITE, OPAQUE_PTRACE_POKE, OPAQUE_URING_WORK = 1, 2, 3, 4
OPAQUE_FD_TAKEN, OPAQUE_OTHER_PROCESS = 5, 6
# io_uring opcodes (include/uapi/linux/io_uring.h), for the reasons only:
# every one of them counts.
URING_OPS = (
    "NOP READV WRITEV FSYNC READ_FIXED WRITE_FIXED POLL_ADD POLL_REMOVE SYNC_FILE_RANGE SENDMSG RECVMSG "
    "TIMEOUT TIMEOUT_REMOVE ACCEPT ASYNC_CANCEL LINK_TIMEOUT CONNECT FALLOCATE OPENAT CLOSE FILES_UPDATE "
    "STATX READ WRITE FADVISE MADVISE SEND RECV OPENAT2 EPOLL_CTL SPLICE PROVIDE_BUFFERS REMOVE_BUFFERS TEE "
    "SHUTDOWN RENAMEAT UNLINKAT MKDIRAT SYMLINKAT LINKAT MSG_RING FSETXATTR SETXATTR FGETXATTR GETXATTR "
    "SOCKET URING_CMD SEND_ZC SENDMSG_ZC READ_MULTISHOT WAITID FUTEX_WAIT FUTEX_WAKE FUTEX_WAITV "
    "FIXED_FD_INSTALL FTRUNCATE BIND LISTEN RECV_ZC EPOLL_WAIT READV_FIXED WRITEV_FIXED PIPE"
).split()

# Where an open for write landed, by the file system's s_magic (linux/magic.h):
# state a file-system snapshot does not hold. Read in the kernel at the
# open's exit (inspector.c, fd_fs and lands_special; device nodes excepted),
# so relative paths, directory fds and symlinks do not hide it.
LANDED_SCOPE: dict[int, str] = {
    0x9FA0: "kernel",  # proc
    0x62656572: "kernel",  # sysfs
    0x27E0EB: "kernel",  # cgroup
    0x63677270: "kernel",  # cgroup2
    0xCAFE4A11: "kernel",  # bpf
    0x64626720: "kernel",  # debugfs
    0x74726163: "kernel",  # tracefs
    0x73636673: "kernel",  # securityfs
    0x01021994: "tmpfs",  # tmpfs
    0x858458F6: "tmpfs",  # ramfs
    0x19800202: "tmpfs",  # mqueue
    0x958458F6: "tmpfs",  # hugetlbfs
}
S_IFMT, S_IFCHR, S_IFBLK = 0o170000, 0o020000, 0o060000
# Set by fd_fs() in an open's fsmode (above i_mode's 16 bits): the file is a
# regular file with no name left, deleted while a process held it open and
# reached again through /proc/PID/fd/N. Its content is in no snapshot, only
# in the holder's process image.
FS_UNLINKED = 0x10000


def landed_scope(magic: int, mode: int) -> str | None:
    """Pure: the scope (as ebpf._turn.path_scope names them) of the file
    system an open landed on; "held" for a deleted file a process still
    holds (FS_UNLINKED); None for unknown, a device node, or a file system
    whose changes a snapshot holds."""
    if mode & S_IFMT in (S_IFCHR, S_IFBLK):
        return None
    if magic in LANDED_SCOPE:
        return LANDED_SCOPE[magic]
    return "held" if mode & FS_UNLINKED else None


AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16


class EventKind(enum.IntEnum):
    """What one event records; the C side sees them as EV_<NAME>."""

    OPEN_WRITE = 1
    UNLINK = 2
    RMDIR = 3
    RENAME = 4
    MKDIR = 5
    LINK = 6
    SYMLINK = 7
    CHMOD = 8
    CHOWN = 9
    TRUNCATE = 10
    XATTR = 11
    MKNOD = 12
    UTIMES = 13
    ATTR = 14
    MOUNT = 20
    UMOUNT = 21
    KERNEL_OBJECT = 22
    OPAQUE = 23
    CONNECT = 30
    BIND = 31
    LISTEN = 32
    SEND = 33
    EXEC_ARGS = 40
    EXEC = 41
    FORK = 42
    EXIT = 43


# Kinds that change the file system, with the name used in `Effects.files`.
FILE_KINDS: dict[EventKind, str] = {
    EventKind.OPEN_WRITE: "write",
    EventKind.UNLINK: "delete",
    EventKind.RMDIR: "rmdir",
    EventKind.RENAME: "rename",
    EventKind.MKDIR: "mkdir",
    EventKind.LINK: "link",
    EventKind.SYMLINK: "symlink",
    EventKind.CHMOD: "chmod",
    EventKind.CHOWN: "chown",
    EventKind.TRUNCATE: "truncate",
    EventKind.XATTR: "xattr",
    EventKind.MKNOD: "mknod",
    EventKind.UTIMES: "utimes",
    EventKind.ATTR: "attr",
}


class RawEvent(ctypes.Structure):
    """Mirror of `struct event` in inspector.c (natural alignment, no packing)."""

    _fields_ = [
        ("ts", ctypes.c_uint64),
        ("tag", ctypes.c_uint32),
        ("kind", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("ret", ctypes.c_int64),
        ("arg", ctypes.c_int64),
        ("dfd", ctypes.c_int32),
        ("dfd2", ctypes.c_int32),
        ("family", ctypes.c_uint16),
        ("port", ctypes.c_uint16),
        ("nargs", ctypes.c_uint32),
        ("fsmagic", ctypes.c_uint32),
        ("fsmode", ctypes.c_uint32),
        ("addr", ctypes.c_uint8 * 16),
        ("comm", ctypes.c_char * 16),
        ("path", ctypes.c_char * PATH_LEN),
        ("path2", ctypes.c_char * PATH_LEN),
    ]


@dataclass(frozen=True)
class Event:
    """One decoded event. Pids are in the host's pid namespace."""

    kind: EventKind
    tag: int
    pid: int
    tid: int = 0
    ts: int = 0
    ret: int = 0
    arg: int = 0
    dfd: int = AT_FDCWD
    dfd2: int = AT_FDCWD
    path: str = ""
    path2: str = ""
    argv: tuple[str, ...] = ()
    comm: str = ""
    family: int = 0
    addr: str = ""
    port: int = 0
    fsmagic: int = 0  # OPEN_WRITE: s_magic of the file system the file landed on (0: unknown)
    fsmode: int = 0  # OPEN_WRITE: the opened inode's mode

    def __post_init__(self) -> None:
        if self.tid == 0:
            object.__setattr__(self, "tid", self.pid)


def _text(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def _field_bytes(raw: RawEvent, name: str) -> bytes:
    # ctypes turns a char-array field into bytes cut at the first NUL; the
    # exec argv slots need the whole array
    f = getattr(RawEvent, name)
    return ctypes.string_at(ctypes.addressof(raw) + f.offset, f.size)


def _cstr(b: bytes) -> str:
    return _text(b.split(b"\0", 1)[0])


def decode(data: bytes | ctypes.Array | int, size: int | None = None) -> Event:
    """Decode one ring-buffer record (bytes, or a pointer as bcc passes it)."""
    if isinstance(data, int):
        raw = RawEvent.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(RawEvent)))
    else:
        raw = RawEvent.from_buffer_copy(bytes(data)[: ctypes.sizeof(RawEvent)])
    kind = EventKind(raw.kind)
    argv: tuple[str, ...] = ()
    path2 = ""
    if kind == EventKind.EXEC_ARGS:
        blob = _field_bytes(raw, "path2")
        argv = tuple(_cstr(blob[i * ARG_LEN : (i + 1) * ARG_LEN]) for i in range(min(raw.nargs, ARGV_SLOTS)))
    else:
        path2 = _cstr(_field_bytes(raw, "path2"))
    addr = ""
    path = _cstr(_field_bytes(raw, "path"))
    if raw.family == AF_INET:
        addr = str(ipaddress.IPv4Address(bytes(raw.addr[:4])))
    elif raw.family == AF_INET6:
        addr = str(ipaddress.IPv6Address(bytes(raw.addr)))
    elif raw.family == AF_UNIX:
        # abstract socket names start with NUL; shown as "@name"
        sun = _field_bytes(raw, "path")[:108]
        path = "@" + _cstr(sun[1:]) if sun[:1] == b"\0" else _cstr(sun)
    return Event(
        kind=kind,
        tag=raw.tag,
        pid=raw.pid,
        tid=raw.tid,
        ts=raw.ts,
        ret=raw.ret,
        arg=raw.arg,
        dfd=raw.dfd,
        dfd2=raw.dfd2,
        path=path,
        path2=path2,
        argv=argv,
        comm=_text(raw.comm),
        family=raw.family,
        addr=addr,
        port=raw.port,
        fsmagic=raw.fsmagic,
        fsmode=raw.fsmode,
    )


def defines(follow_pids: bool = False, count_writes: bool = True,
            offsets: dict[str, int] | None = None) -> dict[str, int]:
    """The constants the C program is compiled with. `offsets`: the kernel
    struct offsets of ebpf._btf.fd_fs_offsets(), or None to leave the
    kernel-side file-system check off (FD_FS 0)."""
    d = {
        "PATH_LEN": PATH_LEN,
        "ARGV_SLOTS": ARGV_SLOTS,
        "ARG_LEN": ARG_LEN,
        "MAX_TAGS": MAX_TAGS,
        "MAX_LEVELS": MAX_LEVELS,
        "MAX_PIDS": MAX_PIDS,
        "MAX_PENDING": MAX_PENDING,
        "MAX_SEEN": MAX_SEEN,
        "FILE_KINDS_MAX": FILE_KINDS_MAX,
        "FILE_EMIT_LIMIT": FILE_EMIT_LIMIT,
        "RINGBUF_PAGES": RINGBUF_PAGES,
        "AT_FDCWD_": AT_FDCWD,
        "O_CREAT_": O_CREAT,
        "O_TRUNC_": O_TRUNC,
        "O_TMPFILE_": O_TMPFILE,
        "FS_UNLINKED": FS_UNLINKED,
        "FS_IOC_SETFLAGS_": FS_IOC_SETFLAGS,
        "FS_IOC32_SETFLAGS_": FS_IOC32_SETFLAGS,
        "FS_IOC_FSSETXATTR_": FS_IOC_FSSETXATTR,
        "OPEN_WRITE_FLAGS": OPEN_WRITE_FLAGS,
        "AF_UNIX_": AF_UNIX,
        "AF_INET_": AF_INET,
        "AF_INET6_": AF_INET6,
        "FOLLOW_PIDS": int(follow_pids),
        "COUNT_WRITES": int(count_writes),
        "RESTART_SYSCALL_NR": RESTART_SYSCALL_NR,
        "FD_FS": int(bool(offsets)),
        "OPAQUE_URING_SETUP": OPAQUE_URING_SETUP,
        "OPAQUE_VM_WRITE": OPAQUE_VM_WRITE,
        "OPAQUE_PTRACE_POKE": OPAQUE_PTRACE_POKE,
        "OPAQUE_URING_WORK": OPAQUE_URING_WORK,
        "OPAQUE_FD_TAKEN": OPAQUE_FD_TAKEN,
        "OPAQUE_OTHER_PROCESS": OPAQUE_OTHER_PROCESS,
    }
    d.update(offsets or {})
    d.update({f"EV_{k.name}": int(k) for k in EventKind})
    return d


def program_text(follow_pids: bool = False, count_writes: bool = True,
                 offsets: dict[str, int] | None = None) -> str:
    """The complete C program as bcc compiles it."""
    head = ["/* generated by ebpf._events.program_text() */"]
    head += [f"#define {k} ({v})" for k, v in defines(follow_pids, count_writes, offsets).items()]
    head.append("#define LANDS_SPECIAL_CASES " + " ".join(f"case {m:#x}:" for m in LANDED_SCOPE))
    body = resources.files("ebpf").joinpath("inspector.c").read_text()
    return "\n".join(head) + "\n" + body
