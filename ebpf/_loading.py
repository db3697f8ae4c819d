"""The inspector while its BPF program compiles: crabd serves at once.

Compiling the inspector's program with bcc takes seconds (9 s on an idle
2-core host, a minute under load), and a restarted daemon used to serve
nothing until it was done. `LoadingInspector` loads the real inspector
(`ebpf.open_inspector`: BPF, or the /proc fallback when BPF cannot be used)
in a background thread and stands in for it meanwhile, with the same calls:

- a turn that ends before the inspector is ready was not observed: its
  `Effects` carries a blind spot, so the classifier plans FS_PROC (save
  everything) and says why;
- `watch` calls made meanwhile are replayed on the real inspector once it is
  loaded, and the first turn each such sandbox ends after that is blind too:
  its record started in the middle of the turn (or of the wait before it);
- `begin_turn`, the pause calls and `unwatch` are passed on once it is
  ready, and are no-ops before (nothing is recorded yet).

Correct before fast: no turn is planned from a partial record. The cost is
one full checkpoint per sandbox and turn during the first seconds after a
start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from ebpf.effects import Effects

__all__ = ["LoadingInspector", "LOADING_SPOT", "LATE_WATCH_SPOT"]

log = logging.getLogger(__name__)

LOADING_SPOT = "the inspector's loading (it started {s:.1f} s before this turn ended): nothing of the turn was observed"
LATE_WATCH_SPOT = "the inspector's late start on this sandbox (it finished loading during the turn)"


class LoadingInspector:
    """Stands in for the inspector `load()` returns until it has loaded."""

    def __init__(self, load: Callable[[], Any], *, fallback: Callable[[], Any] | None = None) -> None:
        self._load_fn = load
        self._fallback = fallback
        self._inner: Any = None
        self._lock = threading.Lock()
        self._watches: dict[str, tuple[str, dict[str, Any]]] = {}
        self._blind: set[str] = set()  # next end_turn is blind
        self._failed: dict[str, str] = {}  # sandbox -> why its replayed watch failed
        self._turns: dict[str, int] = {}
        self._started = time.monotonic()
        self.ready = threading.Event()
        self.load_seconds: float | None = None
        self.load_error: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._load, name="ebpf-inspector-load", daemon=True)
        self._thread.start()

    # -- loading
    def _load(self) -> None:
        try:
            inner = self._load_fn()
        except Exception as e:  # noqa: BLE001 - any failure falls back, with its reason
            self.load_error = str(e)
            log.error("loading the inspector failed (%s): using the fallback", e)
            if self._fallback is None:
                return
            inner = self._fallback()
        with self._lock:
            if self._closed:
                inner.close()
                return
            for sid, (cgroup_path, kw) in self._watches.items():
                try:
                    inner.watch(sid, cgroup_path, **kw)
                except Exception as e:  # noqa: BLE001 - that sandbox stays blind, with the reason
                    self._failed[sid] = f"the inspector's failed watch after loading: {e}"
                    log.warning("inspector: watching %s after loading failed: %s", sid, e)
            self._inner = inner
            self.load_seconds = round(time.monotonic() - self._started, 3)
        self.ready.set()
        log.info("inspector ready (%s) %.1f s after start", getattr(inner, "source", "?"), self.load_seconds)

    def wait(self, timeout: float | None = None) -> bool:
        return self.ready.wait(timeout)

    @property
    def inner(self) -> Any:
        return self._inner

    @property
    def source(self) -> str:
        inner = self._inner
        return inner.source if inner is not None else "loading"

    # -- the inspector's calls
    def watch(self, sandbox_id: str, cgroup_path: str | os.PathLike[str], *, init_pid: int | None = None,
              outside_paths: tuple[str, ...] = ()) -> None:
        kw: dict[str, Any] = {"init_pid": init_pid, "outside_paths": outside_paths}
        with self._lock:
            if self._inner is None:
                self._watches[sandbox_id] = (str(cgroup_path), kw)
                self._blind.add(sandbox_id)
                return
            inner = self._inner
        inner.watch(sandbox_id, cgroup_path, **kw)
        with self._lock:
            self._failed.pop(sandbox_id, None)

    def unwatch(self, sandbox_id: str) -> None:
        with self._lock:
            self._watches.pop(sandbox_id, None)
            self._blind.discard(sandbox_id)
            self._failed.pop(sandbox_id, None)
            self._turns.pop(sandbox_id, None)
            inner = self._inner
        if inner is not None:
            inner.unwatch(sandbox_id)

    def _pass(self, name: str, sandbox_id: str) -> None:
        inner = self._inner
        if inner is not None and sandbox_id not in self._failed:
            getattr(inner, name)(sandbox_id)

    def begin_turn(self, sandbox_id: str) -> None:
        self._pass("begin_turn", sandbox_id)

    def before_pause(self, sandbox_id: str) -> None:
        self._pass("before_pause", sandbox_id)

    def after_pause(self, sandbox_id: str) -> None:
        self._pass("after_pause", sandbox_id)

    def end_turn(self, sandbox_id: str) -> Effects:
        with self._lock:
            inner = self._inner
            failed = self._failed.get(sandbox_id)
            blind = sandbox_id in self._blind
            if inner is not None and failed is None:
                self._blind.discard(sandbox_id)
        if inner is None or failed is not None:
            why = failed or LOADING_SPOT.format(s=time.monotonic() - self._started)
            return self._blind_effects(sandbox_id, why)
        eff = inner.end_turn(sandbox_id)
        if blind:
            eff.blind_spots.append(LATE_WATCH_SPOT)
        return eff

    def _blind_effects(self, sandbox_id: str, why: str) -> Effects:
        with self._lock:
            turn = self._turns[sandbox_id] = self._turns.get(sandbox_id, 0) + 1
        now = time.monotonic_ns()
        return Effects(sandbox_id=sandbox_id, turn=turn, source="loading", ended_ns=now, blind_spots=[why],
                       external_unknown=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            inner = self._inner
        if inner is not None:
            inner.close()
