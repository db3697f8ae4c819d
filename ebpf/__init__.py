"""ebpf: what each agent turn changed in its sandbox, and what to checkpoint.

BPF programs on tracepoints (ebpf/inspector.c, loaded with bcc) attribute
file, process, network and mount activity to sandboxes by cgroup v2 id;
`Inspector` turns it into one `Effects` record per turn; `classify` maps
that to a `Plan` (SKIP, FS or FS_PROC, with reasons). Without BPF,
`ProcInspector` builds the same record from /proc and the file-system
layer's change probe. `open_inspector` picks one; `open_inspector_async`
returns at once a `LoadingInspector` that loads it in the background (every
turn before it is ready is blind, so planned FS_PROC). This library never
imports crabd.
"""

from __future__ import annotations

import logging
from typing import Callable

from ebpf._bcc import bpf_problem
from ebpf.classifier import Plan, PlanKind, classify
from ebpf.effects import SCHEMA_VERSION, Connections, Effects, ExecRecord, ProcessRecord, Sample, SocketRecord
from ebpf.errors import AlreadyWatched, BPFUnavailable, InspectorError, InvalidArgument, NotWatched
from ebpf.fallback import ChangeProbe, ProcInspector
from ebpf._inspector import Inspector, Loader
from ebpf._loading import LoadingInspector

__all__ = [
    "SCHEMA_VERSION",
    "AlreadyWatched",
    "BPFUnavailable",
    "ChangeProbe",
    "Connections",
    "Effects",
    "ExecRecord",
    "Inspector",
    "InspectorError",
    "InvalidArgument",
    "Loader",
    "LoadingInspector",
    "NotWatched",
    "Plan",
    "PlanKind",
    "ProcInspector",
    "ProcessRecord",
    "Sample",
    "SocketRecord",
    "bpf_problem",
    "classify",
    "open_inspector",
    "open_inspector_async",
]

log = logging.getLogger(__name__)


def open_inspector(change_probe: ChangeProbe | None = None) -> Inspector | ProcInspector:
    """The BPF inspector, loaded; or, when BPF cannot be used here, the /proc
    fallback, with a warning that says why (crabd doctor reports the same)."""
    insp = Inspector()
    try:
        insp.open()
    except BPFUnavailable as e:
        log.warning("BPF inspector unavailable, using the /proc fallback (coarser, slower): %s", e)
        return ProcInspector(change_probe)
    return insp


def open_inspector_async(change_probe: ChangeProbe | None = None,
                         before_load: Callable[[], None] | None = None) -> LoadingInspector:
    """`open_inspector` in a background thread, behind a `LoadingInspector`
    that stands in for it meanwhile (see ebpf/_loading.py). `before_load`
    runs first in that thread (a test hook: hold the load)."""
    def load() -> Inspector | ProcInspector:
        if before_load is not None:
            before_load()
        return open_inspector(change_probe)
    return LoadingInspector(load, fallback=lambda: ProcInspector(change_probe))
