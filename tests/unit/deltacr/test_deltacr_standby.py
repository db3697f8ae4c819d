import pytest

from deltacr import InvalidArgument, StandbyPolicy, StandbyRecord

MiB = 1 << 20


def rec(sb, ck, mb, t):
    return StandbyRecord(sb, ck, mb * MiB, t)


def test_admits_when_it_fits():
    a = StandbyPolicy(per_sandbox=2, memory_budget=100 * MiB).admit(rec("a", "a@1", 10, 1), [])
    assert a.admit and a.evict == ()


def test_per_sandbox_bound_evicts_that_sandboxs_oldest():
    cur = [rec("a", "a@1", 10, 1), rec("a", "a@2", 10, 2), rec("b", "b@1", 10, 0)]
    a = StandbyPolicy(per_sandbox=2, memory_budget=1000 * MiB).admit(rec("a", "a@3", 10, 3), cur)
    assert a.admit and [e.checkpoint_id for e in a.evict] == ["a@1"]


def test_memory_budget_evicts_oldest_host_wide():
    cur = [rec("a", "a@1", 40, 5), rec("b", "b@1", 40, 1), rec("c", "c@1", 10, 3)]
    a = StandbyPolicy(per_sandbox=1, memory_budget=100 * MiB).admit(rec("d", "d@1", 40, 9), cur)
    assert a.admit and [e.checkpoint_id for e in a.evict] == ["b@1"]


def test_protected_checkpoints_go_last():
    cur = [rec("a", "a@1", 50, 1), rec("b", "b@1", 50, 2)]
    pol = StandbyPolicy(per_sandbox=1, memory_budget=100 * MiB, protected=frozenset({"a@1"}))
    a = pol.admit(rec("c", "c@1", 50, 3), cur)
    assert a.admit and [e.checkpoint_id for e in a.evict] == ["b@1"]


def test_refusals():
    pol = StandbyPolicy(per_sandbox=1, memory_budget=100 * MiB)
    assert not pol.admit(rec("a", "a@1", 200, 1), []).admit
    assert not pol.admit(rec("a", "a@1", 1, 2), [rec("a", "a@1", 1, 1)]).admit
    assert not StandbyPolicy(per_sandbox=0).admit(rec("a", "a@1", 1, 1), []).admit
    with pytest.raises(InvalidArgument):
        StandbyPolicy(per_sandbox=-1)
