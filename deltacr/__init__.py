"""deltacr: process checkpoint/restore through CRIU, a de-duplicated image
store, and the policy for hot standbys.

A library usable without the crabd daemon (it never imports `crabd`).

    runc = Runc("/var/lib/crabd/runc")                  # runc's --root
    store = ImageStore("/var/lib/crabd/cr")
    work = store.tmpdir()
    cap = capture_consistent(freeze, thaw,               # frozen from fs commit to dump end
                             lambda: runc.checkpoint("sb-1", work / "img", work / "log"),
                             fs_commit=lambda: snapshotter.checkpoint("sb-1"))
    store.put("sb-1@7", work / "img", logs=[work / "log" / "dump.log"])
    ...
    store.get("sb-1@7", dest)                            # verified, then written out
    runc.restore("sb-1", bundle, dest, work2, RestoreOptions())

Modules: options (the record of intent and runc argv builders), runc
(CRIU check, dump, restore, CRIU log errors), store (chunks, manifests,
gc), capture (freeze -> fs commit -> dump -> thaw), standby (policy),
errors, testing (fakes of the command seam).
"""

from .compat import host_criu, needs_sockopt_shim
from .capture import Capture, capture_consistent
from .errors import (AlreadyExists, CommandFailed, CriuFailed, CriuUnavailable, DeltacrError, FailedPrecondition,
                     ImageCorrupted, InvalidArgument, NotFound)
from .options import CgroupsMode, DumpOptions, NetworkLock, config_lines, RestoreOptions, checkpoint_argv, required_features, restore_argv
from .runc import CommandRunner, CriuInfo, Result, Runc, SubprocessCommandRunner, check_criu, criu_errors, skipped_in_flight
from .standby import Admission, StandbyPolicy, StandbyRecord
from .store import CHUNK_SIZE, FileEntry, ImageStore, Manifest, StoreStats, chunk_spans, parse_pagemap

__all__ = [
    "Capture", "capture_consistent", "host_criu", "needs_sockopt_shim",
    "DeltacrError", "NotFound", "AlreadyExists", "InvalidArgument", "FailedPrecondition", "CriuUnavailable",
    "CriuFailed", "ImageCorrupted", "CommandFailed",
    "CgroupsMode", "NetworkLock", "config_lines", "DumpOptions", "RestoreOptions", "checkpoint_argv", "restore_argv", "required_features",
    "CommandRunner", "Result", "SubprocessCommandRunner", "CriuInfo", "check_criu", "criu_errors", "skipped_in_flight", "Runc",
    "StandbyPolicy", "StandbyRecord", "Admission",
    "ImageStore", "Manifest", "FileEntry", "StoreStats", "chunk_spans", "parse_pagemap", "CHUNK_SIZE",
]
