"""The retention policy: pure, no root."""

import pytest
from hypothesis import given, strategies as st

from crabd.retention import Retention, keep_reasons, victims


def cks(n):
    return [(f"sb-{i}", i) for i in range(n)]


def test_keeps_initial_last_every_head_and_protected():
    r = Retention(keep_last=3, keep_every=5)
    gone = victims(cks(13), r, head="sb-7", protected=["sb-2"])
    assert gone == ["sb-1", "sb-3", "sb-4", "sb-6", "sb-8", "sb-9"]
    why = keep_reasons(cks(13), r, head="sb-7", protected=["sb-2"])
    assert why["sb-0"] == ["initial"] and why["sb-12"] == ["last 3"] and why["sb-5"] == ["every 5"]
    assert why["sb-10"] == ["last 3", "every 5"]
    assert why["sb-7"] == ["head"] and why["sb-2"] == ["protected"]


def test_short_histories_lose_nothing():
    assert victims(cks(5), Retention(keep_last=50, keep_every=10)) == []


def test_keep_every_zero_means_none():
    assert victims(cks(6), Retention(keep_last=2, keep_every=0)) == ["sb-1", "sb-2", "sb-3"]


def test_bad_policies():
    with pytest.raises(ValueError):
        Retention(keep_last=0)
    with pytest.raises(ValueError):
        Retention(keep_every=-1)


@given(n=st.integers(0, 200), last=st.integers(1, 30), every=st.integers(0, 20), head=st.integers(0, 199))
def test_invariants(n, last, every, head):
    all_ = cks(n)
    h = f"sb-{head}" if head < n else None
    gone = set(victims(all_, Retention(last, every), head=h))
    kept = {c for c, _ in all_} - gone
    assert {c for c, _ in all_[-last:]} <= kept          # the newest always stay
    assert n == 0 or "sb-0" in kept                       # and the initial state
    assert h is None or h in kept                         # and the head
    assert len(kept) <= min(n, last + (n // every if every else 0) + 2)
