"""Which checkpoints of a sandbox to keep: a pure policy.

`keep_last` newest checkpoints, plus every `keep_every`-th by sequence
number, plus those that must stay whatever their age: the initial state
(seq 0), the sandbox's head, and any the caller protects (the base of a
fork, the checkpoint a hot standby holds). Everything else may go; the
daemon drops the row (its children take its parent) and the snapshot and
process image once no remaining checkpoint shares them.

    keep_reasons(cks, keep_last=50, keep_every=10, head="sb-1-97")
      -> {"sb-1-0": ["initial"], "sb-1-10": ["every 10"], ..., "sb-1-97": ["last 50", "head"]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["Retention", "keep_reasons", "victims"]


@dataclass(frozen=True)
class Retention:
    keep_last: int = 50     # newest N checkpoints (>= 1)
    keep_every: int = 10    # and every Mth by sequence number; 0 = none

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if self.keep_every < 0:
            raise ValueError("keep_every must be >= 0")


def keep_reasons(checkpoints: Iterable[tuple[str, int]], policy: Retention, *, head: str | None = None,
                 protected: Iterable[str] = ()) -> dict[str, list[str]]:
    """Why each kept checkpoint is kept; checkpoints absent from the result may go.

    `checkpoints` are (id, seq) pairs of one sandbox's committed checkpoints."""
    cks = sorted(checkpoints, key=lambda c: c[1])
    prot = set(protected)
    out: dict[str, list[str]] = {}
    newest = {cid for cid, _ in cks[-policy.keep_last:]}
    for cid, seq in cks:
        why = []
        if seq == 0:
            why.append("initial")
        if cid in newest:
            why.append(f"last {policy.keep_last}")
        if policy.keep_every and seq % policy.keep_every == 0 and seq:
            why.append(f"every {policy.keep_every}")
        if cid == head:
            why.append("head")
        if cid in prot:
            why.append("protected")
        if why:
            out[cid] = why
    return out


def victims(checkpoints: Iterable[tuple[str, int]], policy: Retention, *, head: str | None = None,
            protected: Iterable[str] = ()) -> list[str]:
    """The checkpoints the policy lets go, oldest first."""
    cks = sorted(checkpoints, key=lambda c: c[1])
    kept = keep_reasons(cks, policy, head=head, protected=protected)
    return [cid for cid, _ in cks if cid not in kept]
