"""The loopback of a restored sandbox.

runc always asks CRIU to restore the network namespace *empty* ("runc
doesn't manage network devices", runc's setEmptyNsMask), and brings up
nothing itself on restore: the restored sockets are back, bound to
127.0.0.1, but `lo` is down and every connection fails with "Network is
unreachable". `loopback_up(pid)` sets IFF_UP on `lo` in `pid`'s network
namespace, from a short-lived thread that enters the namespace (setns
moves only the calling thread), so no process is spawned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import threading
from typing import Callable, TypeVar


__all__ = ["loopback_up", "in_netns"]

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _set_up(ifname: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", ifname, 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", ifname, flags | _IFF_UP))


def loopback_up(pid: int) -> bool:
    """Bring `lo` up in the network namespace of host pid `pid`. False when
    `pid` is gone: a restored init killed right after its restore is a death
    for the caller's death watch to notice, not a failed restore."""
    try:
        in_netns(pid, lambda: _set_up(b"lo"))
    except ProcessLookupError:
        return False
    return True


def in_netns(pid: int, fn: Callable[[], T]) -> T:
    """fn()'s result, called in the network namespace of host pid `pid` (in
    a short-lived thread: setns moves only the calling thread). Sockets fn
    creates stay in that namespace. ProcessLookupError when `pid` is gone."""
    err: list[BaseException] = []
    out: list[T] = []

    def work() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            os.close(own)
            err.append(ProcessLookupError(f"process {pid} is gone"))
            return
        try:
            if _libc.setns(target, _CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                err.append(OSError(e, f"setns into net namespace of {pid}: {os.strerror(e)}"))
                return
            try:
                out.append(fn())
            except BaseException as e:
                err.append(e)
            finally:
                if _libc.setns(own, _CLONE_NEWNET) != 0:
                    # This thread stays in the sandbox's namespace: it is
                    # about to exit and holds nothing, so that is harmless.
                    pass
        finally:
            os.close(target)
            os.close(own)

    t = threading.Thread(target=work, name=f"deltacr-netns-{pid}")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
