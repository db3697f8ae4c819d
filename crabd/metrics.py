"""crabd's Prometheus metrics, served at `GET /metrics` by the API.

Every metric lives in a `CollectorRegistry` owned by one `Metrics` object,
not in prometheus-client's process-global registry: tests and the benchmark
run several daemons (or several `Metrics`) in one process, and the global
registry refuses a second metric of the same name.

Who feeds what (see DESIGN.md):

    coordinator  turns_total{plan}, stall_seconds, exec_seconds,
                 checkpoint_duration_seconds{phase} (writeback .. total),
                 checkpoint_bytes_total, rollbacks_total{result}
    scheduler    checkpoint_duration_seconds{phase="queue"}, scheduler_queue_depth
    api/store    sandboxes

Label values are a closed set, pre-created at zero so a dashboard sees every
series from the first scrape (a counter that appears only after its first
increment breaks `rate()` over the first window).
"""

from __future__ import annotations

from typing import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["Metrics", "PHASES", "PLANS", "ROLLBACK_RESULTS", "CONTENT_TYPE"]

#: Phases of one checkpoint, in order. `queue` is time in the scheduler;
#: `writeback` is the early flush of dirty pages (a btrfs snapshot flushes
#: first, so starting it before the freeze shortens the freeze); `total` is
#: turn end to checkpoint committed.
PHASES = ("queue", "writeback", "freeze", "fs_commit", "proc_dump", "thaw", "total")
#: Checkpoint plans, as ebpf.classifier.PlanKind values.
PLANS = ("SKIP", "FS", "FS_PROC")
#: Rollback outcomes; "auto" rollbacks (after a sandbox died) count here too.
ROLLBACK_RESULTS = ("ok", "failed")
CONTENT_TYPE = CONTENT_TYPE_LATEST

# A freeze+thaw costs ~0.3 ms here, a btrfs commit ~2 ms, a flush of 64 MiB
# ~100 ms, a CRIU dump of a Python process tens to hundreds of ms: buckets
# from 100 us to 30 s cover all phases with resolution where they sit.
_CHECKPOINT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Stalls should be 0 (captured within the LLM wait); anything above is user-visible latency.
_STALL_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Agent commands: from `cat` (ms) to `pip install` (minutes).
_EXEC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    """The daemon's metrics and their private registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.checkpoint_duration = Histogram(
            "crabd_checkpoint_duration_seconds",
            "Duration of each checkpoint phase (queue = wait in the host scheduler).",
            ["phase"],
            buckets=_CHECKPOINT_BUCKETS,
            registry=r,
        )
        self.checkpoint_bytes = Counter(
            "crabd_checkpoint_bytes",  # exposed as crabd_checkpoint_bytes_total
            "Bytes written by checkpoints (file-system layers and process images).",
            registry=r,
        )
        self.stall = Histogram(
            "crabd_stall_seconds",
            "Time a turn's exec waited for the previous turn's checkpoint to be captured.",
            buckets=_STALL_BUCKETS,
            registry=r,
        )
        self.rollbacks = Counter(
            "crabd_rollbacks",  # exposed as crabd_rollbacks_total
            "Rollbacks, manual and automatic, by result.",
            ["result"],
            registry=r,
        )
        self.turns = Counter(
            "crabd_turns",  # exposed as crabd_turns_total
            "Agent turns ended, by the checkpoint plan the inspector chose.",
            ["plan"],
            registry=r,
        )
        self.sandboxes = Gauge("crabd_sandboxes", "Sandboxes known to this daemon.", registry=r)
        self.exec_seconds = Histogram(
            "crabd_exec_seconds",
            "Wall time of commands run through the exec API.",
            buckets=_EXEC_BUCKETS,
            registry=r,
        )
        self.scheduler_queue_depth = Gauge(
            "crabd_scheduler_queue_depth",
            "Jobs queued in the host-scoped checkpoint scheduler (not yet running).",
            registry=r,
        )
        for phase in PHASES:
            self.checkpoint_duration.labels(phase=phase)
        for result in ROLLBACK_RESULTS:
            self.rollbacks.labels(result=result)
        for plan in PLANS:
            self.turns.labels(plan=plan)

    def observe_checkpoint(self, phases: Mapping[str, float], bytes_written: int = 0) -> None:
        """Record one finished checkpoint: seconds per phase, and bytes written.

        Unknown phase names raise: a typo would otherwise open a new series
        that no dashboard looks at.
        """
        for phase, seconds in phases.items():
            if phase not in PHASES:
                raise ValueError(f"unknown checkpoint phase {phase!r} (known: {', '.join(PHASES)})")
            self.checkpoint_duration.labels(phase=phase).observe(seconds)
        if bytes_written:
            self.checkpoint_bytes.inc(bytes_written)

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (serve with CONTENT_TYPE)."""
        return generate_latest(self.registry)
