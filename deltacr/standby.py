"""Which hot standbys to keep: a pure policy.

A hot standby is a sandbox restored in advance from a checkpoint and kept
stopped, so that rolling back to that checkpoint is a SIGCONT instead of a
CRIU restore. Each one holds the memory of the checkpoint's processes, so
they are bounded: at most `per_sandbox` per sandbox, and a host-wide
memory budget. The policy only decides; the caller (crabd) prepares and
discards standbys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidArgument

__all__ = ["StandbyRecord", "Admission", "StandbyPolicy"]


@dataclass(frozen=True)
class StandbyRecord:
    sandbox_id: str
    checkpoint_id: str
    memory_bytes: int   # what it holds resident (about the image's page bytes)
    created: float      # when it was prepared; older ones go first


@dataclass(frozen=True)
class Admission:
    admit: bool
    evict: tuple[StandbyRecord, ...] = ()   # discard these first
    reason: str = ""


@dataclass(frozen=True)
class StandbyPolicy:
    per_sandbox: int = 1                 # standbys kept per sandbox
    memory_budget: int = 2 * 1024**3     # bytes, all standbys of the host
    # Only standbys of checkpoints this recent are worth their memory; the
    # caller passes the checkpoint ids it would roll back to first.
    protected: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.per_sandbox < 0:
            raise InvalidArgument("per_sandbox must be >= 0")
        if self.memory_budget < 0:
            raise InvalidArgument("memory_budget must be >= 0")

    def admit(self, new: StandbyRecord, current: list[StandbyRecord]) -> Admission:
        """May `new` be prepared, and which of `current` must go for it? Pure.

        Per sandbox: the oldest of that sandbox's standbys make room. Host
        wide: the oldest standbys of any sandbox go until `new` fits; a
        standby bigger than the whole budget is refused. A standby of the
        same checkpoint already there means `new` is not needed."""
        if any(c.sandbox_id == new.sandbox_id and c.checkpoint_id == new.checkpoint_id for c in current):
            return Admission(False, (), f"a standby of checkpoint {new.checkpoint_id} already exists")
        if self.per_sandbox == 0:
            return Admission(False, (), "standbys are disabled (per_sandbox = 0)")
        if new.memory_bytes > self.memory_budget:
            return Admission(False, (), f"needs {new.memory_bytes} bytes, more than the whole budget "
                                        f"of {self.memory_budget}")
        evict: list[StandbyRecord] = []
        mine = sorted((c for c in current if c.sandbox_id == new.sandbox_id), key=lambda c: c.created)
        while len(mine) - len(evict) >= self.per_sandbox:
            evict.append(mine[len(evict)])
        used = sum(c.memory_bytes for c in current if c not in evict)
        others = sorted((c for c in current if c not in evict), key=lambda c: (c.checkpoint_id in self.protected,
                                                                                 c.created))
        i = 0
        while used + new.memory_bytes > self.memory_budget and i < len(others):
            evict.append(others[i])
            used -= others[i].memory_bytes
            i += 1
        if used + new.memory_bytes > self.memory_budget:
            return Admission(False, (), "does not fit the memory budget")
        return Admission(True, tuple(evict), "fits" if not evict else f"evicts {len(evict)} older standby(s)")
