"""What waits in the receive queues of a process's sockets.

Part of the inspectors' process comparison (`ebpf._proc.ProcInfo.queued`).
A datagram sent to a unix or loopback socket whose owner does not read it,
or a connection made to a listener that does not accept, changes that
process's state (CRIU saves unix queues and listen queues with it) while
the owner does not run, and while the sender may be a short-lived process
of a later turn. No system call of the owner, and none of the sender's that
the inspector reads, says so; the queues do.

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
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable

__all__ = ["socket_queues"]

_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_RQLEN = 0x10
_UNIX_DIAG_RQLEN = 4
_NETLINK_SOCK_DIAG = 4
_TCP_LISTEN = 10


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
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


def socket_queues(pid: int) -> str:
    """A fingerprint of what waits in `pid`'s sockets' receive queues ("" if
    it holds none). A socket whose queue cannot be read counts as "?"."""
    inodes = _socket_inodes(pid)
    if not inodes:
        return ""
    from deltacr.netns import in_netns  # the one setns helper (a thread enters the namespace)
    try:
        queues = in_netns(pid, _all_queues)
    except OSError:
        return "?"
    return " ".join(f"{i}:{queues.get(i, '-')}" for i in sorted(inodes))
