"""What several benchmarks do the same way: the daemon's resident memory,
and the end of a daemon benchmark's `main` (root check, result printed).

The daemon, the busybox image and "wait until the checkpoints settle" are
shared with the tests and live in `crabd.testing`; this module holds only
what the tests never need.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import psutil

__all__ = ["RssSampler", "require_root", "report"]


def require_root(what: str) -> None:
    """Exit with `what` (e.g. "bench load needs root (it runs a crabd daemon)") when not root."""
    if os.geteuid() != 0:
        raise SystemExit(what)


def report(out: dict[str, Any], as_json: bool) -> int:
    """Print a daemon benchmark's result (one JSON document, or one `key: value`
    line per key) and return its exit status: 0 when `out["ok"]`."""
    if as_json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v if isinstance(v, str) else json.dumps(v)}")
    return 0 if out["ok"] else 1


class RssSampler(threading.Thread):
    """Samples a process's RSS every `interval` s in the background:
    `samples` = [(seconds since start, bytes)]. `stop()` ends it."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.proc, self.interval = psutil.Process(pid), interval
        self.samples: list[tuple[float, int]] = []
        self.stop_ev = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_ev.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.proc.memory_info().rss))
            except psutil.Error:
                return  # the process is gone: the samples so far are the record
            self.stop_ev.wait(self.interval)

    def stop(self) -> None:
        self.stop_ev.set()
        self.join()

    def peak_since(self, t: float) -> int:
        """Peak bytes over the samples taken since monotonic time `t` (one
        interval of slack: the sample just before `t` may be the phase's)."""
        xs = [r for (s, r) in self.samples if s >= t - self.t0 - self.interval]
        return max(xs) if xs else 0

    def mib(self) -> list[tuple[float, float]]:
        """The samples as (seconds, MiB), both rounded to 0.1."""
        return [(round(s, 1), round(r / 2**20, 1)) for s, r in self.samples]
