"""The classifier's decision table, rule by rule, and its monotonicity."""

from hypothesis import given
from hypothesis import strategies as st

from ebpf import Effects, PlanKind, ProcessRecord, Sample, SocketRecord, classify


def eff(**kw) -> Effects:
    return Effects(sandbox_id="sb", turn=1, source="bpf-cgroup", **kw)


P = ProcessRecord(pid=7, comm="sleep", cmdline=["sleep", "1000"])


def test_nothing_is_skip():
    plan = classify(eff(write_syscalls=500, exec_count=3))
    assert plan.kind is PlanKind.SKIP
    assert plan.reasons == ["no recovery-relevant OS effect seen"]


def test_file_change_is_fs():
    plan = classify(eff(files={"write": Sample(count=1, sample=["/app/f"])}))
    assert plan.kind is PlanKind.FS
    assert "/app/f" in plan.reasons[0]


def test_device_and_own_proc_writes_are_skip():
    plan = classify(eff(special_writes={"device": Sample(count=4, sample=["/dev/null"]),
                                        "process": Sample(count=1, sample=["/proc/self/oom_score_adj"])}))
    assert plan.kind is PlanKind.SKIP


def test_package_manager_is_fs_even_without_writes_seen():
    assert classify(eff(package_managers=["pip"])).kind is PlanKind.FS


def test_fs_proc_rules():
    cases = [
        eff(dropped_events=1),
        eff(blind_spots=["io_uring"]),
        eff(new_processes=[P]),
        eff(exited_processes=[P]),
        eff(active_processes=[P]),
        eff(listening=[SocketRecord(pid=7, address="0.0.0.0:8000", alive=True)]),
        eff(mounts=Sample(count=1, sample=["mount /mnt"])),
        eff(kernel_objects=Sample(count=1, sample=["System V shared memory"])),
        eff(special_writes={"kernel": Sample(count=1, sample=["/proc/sys/x"])}),
        eff(special_writes={"tmpfs": Sample(count=1, sample=["/dev/shm/x"])}),
    ]
    for e in cases:
        assert classify(e).kind is PlanKind.FS_PROC, e


def test_dead_listener_is_not_proc():
    plan = classify(eff(listening=[SocketRecord(pid=7, address="0.0.0.0:8000", alive=False)]))
    assert plan.kind is PlanKind.SKIP


def test_reasons_accumulate_and_external_is_carried():
    e = eff(files={"delete": Sample(count=2, sample=["a", "b"])}, new_processes=[P],
            external=True, external_reasons=["connect to 10.0.0.1:443 (curl)"])
    plan = classify(e)
    assert plan.kind is PlanKind.FS_PROC
    assert len(plan.reasons) == 2
    assert plan.external and plan.external_reasons == ["connect to 10.0.0.1:443 (curl)"]


def test_plan_round_trips_json():
    plan = classify(eff(new_processes=[P]))
    assert type(plan).model_validate_json(plan.model_dump_json()) == plan


samples = st.builds(lambda n: Sample(count=n, sample=["p"] * min(n, 1)), st.integers(0, 3))
effects = st.builds(
    lambda files, drops, procs, pm, mounts: eff(
        files={"write": files}, dropped_events=drops, new_processes=[P] * procs,
        package_managers=["pip"] if pm else [], mounts=mounts),
    samples, st.integers(0, 2), st.integers(0, 2), st.booleans(), samples)
RANK = {PlanKind.SKIP: 0, PlanKind.FS: 1, PlanKind.FS_PROC: 2}


@given(effects, effects)
def test_more_effects_never_lower_the_plan(a, b):
    merged = eff(
        files={"write": Sample(count=a.files["write"].count + b.files["write"].count, sample=["p"])},
        dropped_events=a.dropped_events + b.dropped_events,
        new_processes=a.new_processes + b.new_processes,
        package_managers=sorted(set(a.package_managers + b.package_managers)),
        mounts=Sample(count=a.mounts.count + b.mounts.count),
    )
    assert RANK[classify(merged).kind] >= max(RANK[classify(a).kind], RANK[classify(b).kind])


@given(effects)
def test_drops_always_mean_worst_case(e):
    e.dropped_events = max(e.dropped_events, 1)
    assert classify(e).kind is PlanKind.FS_PROC


def test_what_a_process_checkpoint_will_not_hold_is_among_the_reasons():
    from ebpf._queues import inotify_events_waiting
    from ebpf.effects import NOT_RESTORED
    assert inotify_events_waiting("fd4:0 ino3:64 123:0")
    assert not inotify_events_waiting("fd4:8 ino3:0 ino5:-1 123:4")
    note = NOT_RESTORED + "inotify events waiting for 7 'watcher'"
    lossy = eff(notes=[note], new_processes=[ProcessRecord(pid=7, comm="watcher")])
    assert note in classify(lossy).reasons
    quiet = eff(notes=[note])
    assert note not in classify(quiet).reasons  # no process image taken: its parent's says it
