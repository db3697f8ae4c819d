"""The process half of crabd's checkpoints, as one import: kept so that
`from crabd.runtime.process import ...` goes on working.

The code lives in three modules of `crabd.runtime`:
* `criu.py`     CRIU glue: dump a sandbox's processes into deltacr's image
                store and restore them, through runc; the checks before a dump;
                CRIU's scratch space (`gc_scratch`);
* `standby.py`  hot standbys: prepared (restored, stopped), promoted (SIGCONT),
                discarded, bounded by deltacr.StandbyPolicy;
* `procfs.py`   what is read from /proc;
and cgroup sweeps are in `cgroups.py`.
"""

from __future__ import annotations

from .cgroups import sweep_standby_cgroups as _sweep_standby_cgroups
from .criu import (STOPPED_TASK_LIMIT, TIME_NS_LIMIT, CheckpointableRunner, ProcessCheckpoint, checkpoint_processes,
                   gc_scratch, restore_processes, rollback_processes)
from .criu import _check_tree as _check_tree  # noqa: F401 -- re-exported: tests/unit/crabd/runtime/test_deltacr_process.py
from .criu import scratch_dir as _scratch  # noqa: F401 -- its old name: bench/cr.py
from .procfs import tcp_table_connected
from .sandbox import Runtime
from .standby import (Standby, admit_standby, discard_standby, list_standbys, make_room_for_standby,
                      prepare_standby, promote_standby, remove_standby_leftovers, standby_memory)

__all__ = ["ProcessCheckpoint", "Standby", "checkpoint_processes", "restore_processes", "rollback_processes",
           "prepare_standby", "promote_standby", "discard_standby", "list_standbys", "remove_standby_leftovers",
           "make_room_for_standby", "admit_standby", "standby_memory", "gc_scratch", "sweep_standby_cgroups",
           "CheckpointableRunner", "STOPPED_TASK_LIMIT", "TIME_NS_LIMIT", "tcp_table_connected"]


def sweep_standby_cgroups(rt: Runtime, sandbox_id: str, keep: frozenset[str] | set[str] = frozenset()) -> int:
    """`cgroups.sweep_standby_cgroups` under its old signature (the runtime is not needed)."""
    return _sweep_standby_cgroups(sandbox_id, keep)
