"""The bcc loader: compiles ebpf/inspector.c, attaches it, reads its maps.

This is the only module that imports bcc. bcc's exceptions (plain
`Exception` with a message, mostly) are converted to `BPFUnavailable` with
the fix in the message where they enter here. The `Loader` protocol it
implements is in `ebpf._loader`; `ebpf.testing.FakeLoader` is its fake.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from pathlib import Path

from ebpf._btf import BtfError, fd_fs_offsets
from ebpf._events import FILE_KINDS, FILE_KINDS_MAX, MAX_LEVELS, Event, decode, program_text
from ebpf.errors import BPFUnavailable

log = logging.getLogger(__name__)


def kernel_headers_problem() -> str | None:
    """Why bcc will not find usable kernel headers, with the fix; None if fine."""
    mod = Path("/lib/modules") / platform.release()
    build, source = mod / "build", mod / "source"
    if not build.exists():
        return (
            f"no kernel headers at {build}; fix: run scripts/setup-host (it links "
            f"Debian's nearest linux-headers package there)"
        )
    if (build / "include/linux/kconfig.h").exists():
        return None
    if (source / "include/linux/kconfig.h").exists():
        return None
    # Debian splits headers into <ver>-<arch> (generated files, linked as
    # `build`) and <ver>-common (the sources, expected as `source`).
    real = build.resolve()
    common = real.with_name(real.name.rsplit("-", 1)[0] + "-common")
    fix = f"ln -sfn {common} {source}" if common.is_dir() else "install the matching -common headers package"
    return f"{source} does not hold kernel sources (include/linux/kconfig.h); fix: {fix}"


def bpf_problem() -> str | None:
    """Why the BPF inspector cannot load here, with the fix; None when it can
    (as far as can be told without compiling: root, bcc, headers, tracefs)."""
    if os.geteuid() != 0:
        return "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)"
    try:
        import bcc  # noqa: F401
    except ImportError as e:
        return (f"cannot import bcc ({e}); fix: apt-get install python3-bpfcc and make it importable "
                f"(scripts/setup-host does both for the project venv)")
    if "BCC_KERNEL_SOURCE" not in os.environ:
        problem = kernel_headers_problem()
        if problem:
            return problem
    if not any(Path(p).is_dir() for p in ("/sys/kernel/tracing/events/syscalls",
                                          "/sys/kernel/debug/tracing/events/syscalls")):
        return "tracefs is not mounted; fix: mount -t tracefs tracefs /sys/kernel/tracing"
    return None


# The pause's system call counters (inspector.c): not attached between pauses.
PAUSE_TRACEPOINTS = (b"raw_syscalls:sys_enter", b"raw_syscalls:sys_exit")


class BccLoader:
    """Compile and attach the inspector program with bcc (needs root)."""

    def __init__(self, follow_pids: bool = False, count_writes: bool = True) -> None:
        self.follow_pids = follow_pids
        self.count_writes = count_writes
        self.mode = "bpf-pids" if follow_pids else "bpf-cgroup"
        self._bpf = None
        self._batch: list[Event] = []
        self._levels: list[int] = []
        # Records that could not be decoded; not attributable to a sandbox, so
        # every sandbox's dropped count includes them (assume the worst).
        self._undecodable = 0
        self._pausing: set[int] = set()  # tags armed with begin_pause
        self._fd_fs: dict[str, int] | None = None
        self.fd_fs_problem: str | None = None
        self._pause_lock = threading.Lock()

    def program(self) -> str:
        return program_text(self.follow_pids, self.count_writes, self._offsets())

    def _offsets(self) -> dict[str, int] | None:
        """Kernel struct offsets for the landed-file-system check (see
        ebpf/_btf.py); None, with the reason in `fd_fs_problem`, without BTF."""
        if self._fd_fs is None:
            try:
                self._fd_fs = fd_fs_offsets()
                self.fd_fs_problem = None
            except BtfError as e:
                log.warning("the inspector cannot tell where relative paths land (%s): "
                            "the path rules and the tmpfs manifest alone apply", e)
                self._fd_fs = {}
                self.fd_fs_problem = str(e)
        return self._fd_fs or None

    def open(self) -> None:
        if self._bpf is not None:
            return
        problem = bpf_problem()
        if problem:
            raise BPFUnavailable(problem)
        from bcc import BPF  # Debian's python3-bpfcc

        try:
            bpf = BPF(text=self.program().encode(), cflags=["-w"])  # the kernel headers warn a lot
            bpf[b"events"].open_ring_buffer(self._on_event)
            # every system call of the host would run these: attached only
            # while a pause is armed (begin_pause .. end_pause)
            for tp in PAUSE_TRACEPOINTS:
                bpf.detach_tracepoint(tp)
        except Exception as e:  # bcc raises bare Exception
            raise BPFUnavailable(f"compiling or attaching the inspector program failed: {e}") from e
        self._bpf = bpf

    def _on_event(self, ctx: object, data: int, size: int) -> None:
        try:
            self._batch.append(decode(data, size))
        except Exception:  # noqa: BLE001 - an undecodable record is a lost event
            self._undecodable += 1

    def _table(self, name: str):  # noqa: ANN202 - bcc table types are untyped
        if self._bpf is None:
            raise BPFUnavailable("the inspector program is not loaded; call open() first")
        return self._bpf[name.encode()]

    def add_cgroup(self, cgroup_id: int, level: int, tag: int) -> None:
        self._table("watched")[ctypes.c_uint64(cgroup_id)] = ctypes.c_uint32(tag)
        if level > 0 and level not in self._levels:
            if len(self._levels) >= MAX_LEVELS:
                raise BPFUnavailable(f"sandbox cgroups at more than {MAX_LEVELS} distinct depths")
            self._levels.append(level)
            self._table("levels")[ctypes.c_int(len(self._levels) - 1)] = ctypes.c_uint32(level)

    def remove_cgroup(self, cgroup_id: int) -> None:
        try:
            del self._table("watched")[ctypes.c_uint64(cgroup_id)]
        except KeyError:
            pass

    def add_pid(self, pid: int, tag: int) -> None:
        self._table("watched_pids")[ctypes.c_uint32(pid)] = ctypes.c_uint32(tag)

    def remove_tag_pids(self, tag: int) -> None:
        t = self._table("watched_pids")
        for k, v in list(t.items()):
            if v.value == tag:
                try:
                    del t[k]
                except KeyError:
                    pass

    def read_events(self, timeout_ms: int = 0) -> list[Event]:
        bpf = self._bpf
        if bpf is None:
            return []
        # the program submits with BPF_RB_NO_WAKEUP: poll() would sleep
        # through pending records, consume() takes them
        bpf.ring_buffer_consume()
        out, self._batch = self._batch, []
        return out

    def next_epoch(self, tag: int) -> None:
        t = self._table("epochs")
        k = ctypes.c_int(tag)
        t[k] = ctypes.c_uint64(t[k].value + 1)

    def suppressed_counts(self, tag: int) -> dict[int, int]:
        t = self._table("suppressed")
        out = {}
        for kind in FILE_KINDS:
            n = int(sum(t[ctypes.c_int(tag * FILE_KINDS_MAX + int(kind))]))
            if n:
                out[int(kind)] = n
        return out

    # -- crabd's own pause (see "crabd's own pause" in inspector.c)
    def begin_pause(self, tag: int) -> None:
        with self._pause_lock:
            if not self._pausing:
                bpf = self._bpf
                if bpf is None:
                    raise BPFUnavailable("the inspector program is not loaded; call open() first")
                try:
                    for tp in PAUSE_TRACEPOINTS:
                        if tp not in bpf.tracepoint_fds:
                            cat, ev = tp.split(b":")
                            bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + cat + b"__" + ev)
                except Exception as e:  # bcc raises bare Exception
                    raise BPFUnavailable(f"attaching the pause's system call counters failed: {e}") from e
            self._table("pauses")[ctypes.c_int(tag)] = ctypes.c_uint64(1)
            self._pausing.add(tag)
            self._table("pausing")[ctypes.c_int(0)] = ctypes.c_uint64(len(self._pausing))

    def end_pause(self, tag: int) -> set[int]:
        """Disarm; the pids with a thread that made a system call while the
        pause was armed other than the restart of an interrupted one (empty
        if not armed)."""
        with self._pause_lock:
            if tag not in self._pausing:
                return set()
            self._table("pauses")[ctypes.c_int(tag)] = ctypes.c_uint64(0)
            self._pausing.discard(tag)
            self._table("pausing")[ctypes.c_int(0)] = ctypes.c_uint64(len(self._pausing))
            busy: set[int] = set()
            w = self._table("woken")
            for tid, v in list(w.items()):
                if v.tag != tag:
                    continue
                if v.other:
                    busy.add(int(v.tgid))
                try:
                    del w[tid]
                except KeyError:
                    pass
            if not self._pausing:
                self._table("seized").clear()  # tracees that died seized
                # detaching waits for the kernel's RCU grace periods (~0.15 s
                # here): off the capture's path
                threading.Thread(target=self._detach_pause, name="ebpf-pause-detach", daemon=True).start()
            return busy

    def _detach_pause(self) -> None:
        with self._pause_lock:
            bpf = self._bpf
            if self._pausing or bpf is None:
                return  # armed again meanwhile, or closed
            for tp in PAUSE_TRACEPOINTS:
                if tp in bpf.tracepoint_fds:
                    try:
                        bpf.detach_tracepoint(tp)
                    except Exception:  # noqa: BLE001 - the guard in the program keeps it inert
                        pass

    def _percpu_sum(self, name: str, tag: int) -> int:
        vals = self._table(name)[ctypes.c_int(tag)]
        return int(sum(v for v in vals))

    def write_count(self, tag: int) -> int:
        return self._percpu_sum("writes", tag)

    def dropped_count(self, tag: int) -> int:
        return self._percpu_sum("dropped", tag) + self._undecodable

    def close(self) -> None:
        with self._pause_lock:
            if self._bpf is not None:
                try:
                    self._bpf.cleanup()
                finally:
                    self._bpf = None
