"""What waits in a process's sockets and pipes: its receive queues.

Part of the inspectors' process comparison (`ebpf._proc.ProcInfo.queued`).
A datagram sent to a unix or loopback socket whose owner does not read it,
or a connection made to a listener that does not accept, changes that
process's state (CRIU saves unix queues and listen queues with it) while
the owner does not run, and while the sender may be a short-lived process
of a later turn. So does a FIFO written to, or drained, by a later turn's
process (`echo x > /tmp/fifo`, `cat /proc/PID/fd/0`: an open for reading is
not an event the inspector keeps), and an inotify queue filled by a later
turn's file changes. No system call of the owner, and none of the sender's
that the inspector reads, says so; the queues do.

`socket_queues(pid)` reads, for each socket the process holds (its fds),
through NETLINK_SOCK_DIAG in the process's network namespace: unix sockets
(UNIX_DIAG_RQLEN: messages or bytes queued, a listener's pending
connections), UDP sockets (rqueue) and TCP listeners (rqueue: the accept
backlog). An established TCP connection is left out: only a process that
holds its other end can queue data in it, and that process ran (or is
new), which the comparison sees already; listing them would walk the
kernel's whole connection hash (~20 ms here, /proc/net/tcp ~70 ms). The
result is a fingerprint to compare, not a report; "" for a process with no
sockets (no namespace is entered then).

Pipes, FIFOs and inotify instances: FIONREAD (bytes waiting) on a copy of
the fd taken with pidfd_getfd(2) (crabd is root; the copy is closed at
once, nothing is read).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import stat
import struct
import sys
import termios
from collections.abc import Callable

__all__ = ["queues", "INOTIFY", "inotify_events_waiting"]

# An inotify instance's entry in the fingerprint: "ino<fd>:<bytes>" (other
# pipes and FIFOs: "fd<fd>:<bytes>"). CRIU restores an inotify instance and
# its watches, not the events waiting in it: `inotify_events_waiting` tells
# which processes would lose some.
INOTIFY = "ino"

_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_RQLEN = 0x10
_UNIX_DIAG_RQLEN = 4
_NETLINK_SOCK_DIAG = 4
_TCP_LISTEN = 10
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (asm-generic)
_libc = ctypes.CDLL(None, use_errno=True)


def _fds(pid: int, links: dict[int, str]) -> tuple[set[int], list[int]]:
    """The inodes of `pid`'s sockets, and its fds that are pipes, FIFOs or
    inotify instances (`links`: ebpf._proc.fd_links)."""
    sockets: set[int] = set()
    others: list[int] = []
    for fd, link in links.items():
        if link.startswith("socket:["):
            sockets.add(int(link[8:-1]))
        elif link.startswith("pipe:[") or link == "anon_inode:inotify" or _is_fifo(pid, str(fd)):
            others.append(fd)
    return sockets, others


def _is_fifo(pid: int, fd: str) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
    except OSError:
        return False


def _waiting(pid: int, fds: list[int]) -> dict[int, int]:
    """fd -> bytes waiting in it (FIONREAD on a copy taken with
    pidfd_getfd); -1 when it could not be read."""
    out: dict[int, int] = {}
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return {fd: -1 for fd in fds}
    try:
        for fd in fds:
            copy = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                out[fd] = -1
                continue
            try:
                buf = bytearray(4)
                fcntl.ioctl(copy, termios.FIONREAD, buf)
                out[fd] = int.from_bytes(buf, sys.byteorder)
            except OSError:
                out[fd] = -1
            finally:
                os.close(copy)
    finally:
        os.close(pidfd)
    return out


def _dump(req: bytes, parse: Callable[[bytes], tuple[int, int] | None]) -> dict[int, int]:
    """One NETLINK_SOCK_DIAG dump in this thread's network namespace:
    inode -> receive queue, as `parse` reads each message's body."""
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req
    out: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as s:
        s.send(msg)
        while True:
            data = s.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == _NLMSG_DONE or length < 16:
                    return out
                if kind == _NLMSG_ERROR:
                    raise OSError(-struct.unpack_from("=i", data, off + 16)[0], "socket diag failed")
                got = parse(data[off + 16 : off + length])
                if got is not None:
                    out[got[0]] = got[1]
                off += (length + 3) & ~3


def _unix(body: bytes) -> tuple[int, int] | None:
    ino = struct.unpack_from("=I", body, 4)[0]  # unix_diag_msg: family, type, state, pad, ino, cookie
    a = 16  # its attributes follow
    while a + 4 <= len(body):
        alen, atype = struct.unpack_from("=HH", body, a)
        if alen < 4:
            break
        if atype == _UNIX_DIAG_RQLEN and alen >= 12:
            return ino, struct.unpack_from("=I", body, a + 4)[0]
        a += (alen + 3) & ~3
    return None


def _inet(body: bytes) -> tuple[int, int] | None:
    # inet_diag_msg: family, state, timer, retrans, id (48 bytes), expires, rqueue, wqueue, uid, inode
    rqueue, _wq, _uid, ino = struct.unpack_from("=IIII", body, 56)
    return ino, rqueue


def _all_queues() -> dict[int, int]:
    out = _dump(struct.pack("=BBHIII8x", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, _UDIAG_SHOW_RQLEN), _unix)
    for family in (socket.AF_INET, socket.AF_INET6):
        for proto, states in ((socket.IPPROTO_TCP, 1 << _TCP_LISTEN), (socket.IPPROTO_UDP, 0xFFFFFFFF)):
            out.update(_dump(struct.pack("=BBBxI48x", family, proto, 0, states), _inet))
    return out


def queues(pid: int, links: dict[int, str]) -> str:
    """A fingerprint of what waits in `pid`'s sockets, pipes, FIFOs and
    inotify instances ("" if it holds none), given its fds (`links`:
    ebpf._proc.fd_links). A socket whose queue cannot be read makes it "?"."""
    inodes, others = _fds(pid, links)
    parts = ([f"{INOTIFY if links.get(fd) == 'anon_inode:inotify' else 'fd'}{fd}:{n}"
              for fd, n in sorted(_waiting(pid, others).items())] if others else [])
    if inodes:
        from deltacr.netns import in_netns  # the one setns helper (a thread enters the namespace)
        try:
            got = in_netns(pid, _all_queues)
        except OSError:
            return "?"
        parts += [f"{i}:{got.get(i, '-')}" for i in sorted(inodes)]
    return " ".join(parts)


def inotify_events_waiting(fingerprint: str) -> bool:
    """Whether a `queues` fingerprint has events waiting in an inotify instance."""
    return any(p.startswith(INOTIFY) and p.rsplit(":", 1)[1] not in ("0", "-1") for p in fingerprint.split())
