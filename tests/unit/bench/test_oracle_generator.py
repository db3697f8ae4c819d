"""The oracle benchmark's generator (bench/oracle.py): seeded, and it draws
the adversary effects of a later turn on an older process."""

from __future__ import annotations

from bench.oracle import EFFECT_KINDS, SHORT_WAITS_MS, Generator


def _kinds(seed: int, turns: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in Generator(seed).session(turns):
        for k in t.kinds:
            out[k] = out.get(k, 0) + 1
    return out


def test_same_seed_same_session():
    a = [(t.argv(), t.wait_ms, t.fault) for t in Generator(3).session(40)]
    b = [(t.argv(), t.wait_ms, t.fault) for t in Generator(3).session(40)]
    assert a == b


def test_every_drawn_kind_is_declared_and_the_other_process_ops_are_drawn():
    got: dict[str, int] = {}
    for seed in range(100):
        for k, n in _kinds(seed, 12).items():
            got[k] = got.get(k, 0) + n
    assert set(got) <= set(EFFECT_KINDS), set(got) - set(EFFECT_KINDS)
    for k in ("proc:fd-taken", "ipc:msgsnd", "ipc:shmrm", "ipc:semset", "prio:nice", "prio:rlimit", "prio:sched",
              "queue:pipe", "queue:fifo", "queue:unix", "queue:inotify", "held:rm", "held:mv", "bg:hold", "bg:ipc", "bg:queue",
              "bg:holddel", "heldfd:append", "heldfd:truncate", "fs:chattr"):
        assert got.get(k), k


def test_long_llm_waits_only_while_a_timer_may_fire():
    """With no worker timer pending, the agent's wait is drawn from the short ones."""
    for t in Generator(11, avoid_known=True).session(60):  # avoid_known: workers have no timers
        assert t.wait_ms in SHORT_WAITS_MS, t.to_dict()


def test_avoid_known_draws_chattr_on_the_rootfs_only():
    """A tmpfs file's inode flags are lost by a process-image restore (not
    fixed yet): --avoid-known leaves that shape out, the default draws it."""
    def chattrs(avoid: bool) -> list[str]:
        return [op[1] for seed in range(40) for t in Generator(seed, avoid_known=avoid).session(12)
                for op in t.ops if op[0] == "chattr"]
    on_tmpfs = [p for p in chattrs(True) if p.startswith("/dev/") and not p.startswith("/dev/shm/work/")]
    assert chattrs(True) and not on_tmpfs, on_tmpfs  # (/dev/shm/work is a symlink to /work)
    assert any(p.startswith("/dev/") for p in chattrs(False))
