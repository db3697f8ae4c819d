"""crabd.runtime: sandboxes as runc containers whose root is given as data.

    rt = Runtime("/var/lib/crabd")
    sb = rt.create("debian-py", name="agent-1")         # started
    rt.exec(sb.id, ["python3", "-c", "print(1)"]).stdout  # '1\\n'
    rt.freeze(sb.id); rt.thaw(sb.id)
    rt.cgroup_v2_dir(sb.id)   # unified-hierarchy cgroup (BPF attribution)
    rt.pids(sb.id)            # host pids of the sandbox's processes
    rt.destroy(sb.id)
"""

from .cgroups import CgroupLayout, Freezer, detect_layout
from .oci import Limits, build_config
from .exec_result import ExecResult
from .reaper import AdoptedReaper, pid_alive, reap, reap_runc_orphans
from .sandbox import DEFAULT_OUTPUT_LIMIT, Runtime, Sandbox

__all__ = ["CgroupLayout", "Freezer", "detect_layout", "Limits", "build_config",
           "DEFAULT_OUTPUT_LIMIT", "ExecResult", "Runtime", "Sandbox", "pid_alive", "reap", "reap_runc_orphans",
           "AdoptedReaper"]
