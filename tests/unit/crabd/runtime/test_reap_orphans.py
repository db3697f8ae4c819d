"""crabd (a child subreaper) reaps the `runc init` stages it adopts when a
`runc exec` dies half-way, and nothing else of its children; its periodic
AdoptedReaper also reaps CRIU once it lingers, and never takes the exit
status of a child a subprocess.Popen waits on."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# A subreaper that adopts orphans: a child forks a grandchild that names
# itself `name` and exits; the child exits first, so the grandchild is
# adopted by this process.
PRELUDE = textwrap.dedent(r"""
    import ctypes, os, subprocess, sys, time
    from crabd.runtime import AdoptedReaper, reap_runc_orphans
    from crabd.runtime.reaper import become_subreaper
    become_subreaper()
    libc = ctypes.CDLL(None, use_errno=True)

    def orphan(name):
        mid = os.fork()
        if mid == 0:
            if os.fork() == 0:
                libc.prctl(15, name.encode(), 0, 0, 0)   # PR_SET_NAME
                time.sleep(0.3)
                os._exit(0)
            os._exit(0)
        os.waitpid(mid, 0)
""")

SCRIPT = PRELUDE + textwrap.dedent(r"""
    orphan("runc:[2:INIT]")
    orphan("runc:[1:CHILD]")
    orphan("other")
    time.sleep(1.5)          # every one has exited: zombies now
    reaped = reap_runc_orphans()
    def zombies():
        out = []
        for t in os.listdir("/proc/self/task"):
            for p in open(f"/proc/self/task/{t}/children").read().split():
                st = open(f"/proc/{p}/stat").read()
                out.append(st[st.find("(") + 1:st.rfind(")")])
        return sorted(out)
    print(len(reaped), ",".join(zombies()))
""")


def test_only_adopted_runc_stages_are_reaped() -> None:
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    n, left = p.stdout.split()
    # the two adopted runc stages are reaped; another zombie child is left to its owner
    assert n == "2", p.stdout
    assert left == "other", p.stdout


ADOPTED = PRELUDE + textwrap.dedent(r"""
    orphan("runc:[2:INIT]")
    orphan("criu")
    orphan("other")
    own = subprocess.Popen(["sh", "-c", "exit 3"])   # a Popen child, exited, not yet waited on
    time.sleep(1.0)
    r = AdoptedReaper()
    first = sorted(c for _, c in r.reap())
    second = sorted(c for _, c in r.reap())          # CRIU only once it lingered a round
    print(",".join(first) or "-", ",".join(second) or "-", own.wait())
""")


def test_the_adopted_reaper_never_takes_a_popen_childs_status() -> None:
    p = subprocess.run([sys.executable, "-c", ADOPTED], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    first, second, status = p.stdout.split()
    assert first == "runc:[2:INIT]" and second == "criu", p.stdout
    assert status == "3", p.stdout  # the Popen child's exit status is still its own
