import pytest

from deltacr import (CgroupsMode, DumpOptions, InvalidArgument, NetworkLock, RestoreOptions, checkpoint_argv,
                     config_lines, required_features, restore_argv)


def test_defaults_are_a_safe_checkpoint():
    o = DumpOptions()
    assert o.leave_running and not o.tcp_established and not o.ext_unix_sk
    assert o.manage_cgroups_mode is CgroupsMode.SOFT


def test_checkpoint_argv_carries_runtime_facts_and_intent():
    argv = checkpoint_argv("runc", "/r", "sb-1", "/img", "/work", DumpOptions(tcp_established=True, file_locks=True))
    assert argv[:3] == ["runc", "--root", "/r"]
    assert argv[3] == "checkpoint"
    assert argv[argv.index("--image-path") + 1] == "/img"
    assert argv[argv.index("--work-path") + 1] == "/work"
    assert "--leave-running" in argv and "--tcp-established" in argv and "--file-locks" in argv
    assert "--ext-unix-sk" not in argv and "--shell-job" not in argv
    assert argv[-1] == "sb-1"


def test_checkpoint_without_leave_running_and_with_criu_wrapper():
    argv = checkpoint_argv("runc", "/r", "sb-1", "/i", "/w", DumpOptions(leave_running=False), criu="/x/criu")
    assert "--leave-running" not in argv
    assert argv[3:5] == ["--criu", "/x/criu"]


def test_restore_argv_is_detached_with_pid_file():
    argv = restore_argv("runc", "/r", "sb-1", "/b", "/img", "/w", "/w/pid",
                        RestoreOptions(no_pivot=True, manage_cgroups_mode="full"))
    assert argv[3] == "restore"
    assert "--detach" in argv and argv[argv.index("--pid-file") + 1] == "/w/pid"
    assert argv[argv.index("--bundle") + 1] == "/b"
    assert "--no-pivot" in argv
    assert argv[argv.index("--manage-cgroups-mode") + 1] == "full"
    assert argv[-1] == "sb-1"


@pytest.mark.parametrize("kw", [{"tcp_established": "yes"}, {"timeout": 0}, {"timeout": True},
                                {"manage_cgroups_mode": "loose"}, {"network_lock": "maybe"}])
def test_invalid_options_are_refused(kw):
    with pytest.raises(InvalidArgument):
        DumpOptions(**kw)


def test_from_dict_round_trip_and_unknown_keys():
    o = DumpOptions(shell_job=True, manage_cgroups_mode=CgroupsMode.STRICT)
    assert DumpOptions.from_dict(o.to_dict()) == o
    with pytest.raises(InvalidArgument, match="unknown option"):
        DumpOptions.from_dict({"leave_runing": True})


def test_restore_options_follow_the_dump():
    d = DumpOptions(tcp_established=True, ext_unix_sk=True, network_lock=NetworkLock.LOCK)
    r = RestoreOptions.from_dump(d)
    assert r.tcp_established and r.ext_unix_sk and r.network_lock is NetworkLock.LOCK


def test_network_lock_auto_skips_without_tcp():
    assert config_lines(DumpOptions()) == ["network-lock skip"]
    assert config_lines(DumpOptions(tcp_established=True)) == []
    assert config_lines(DumpOptions(network_lock="lock")) == []
    assert config_lines(RestoreOptions(tcp_established=True, network_lock="skip")) == ["network-lock skip"]


def test_required_features_follow_options():
    assert "tcp_half_closed" not in required_features(DumpOptions())
    assert "tcp_half_closed" in required_features(DumpOptions(tcp_established=True))
    assert "fdinfo_lock" in required_features(RestoreOptions(file_locks=True))


def test_private_netns_dumps_tcp_and_locks_and_locks_the_network_only_for_tcp():
    with_tcp = DumpOptions.for_private_netns(tcp_connections=True)
    assert with_tcp.tcp_established and with_tcp.file_locks and with_tcp.network_lock is NetworkLock.LOCK
    assert config_lines(with_tcp) == ["skip-in-flight", f"ghost-limit {64 << 20}"]
    without = DumpOptions.for_private_netns(tcp_connections=False)
    assert without.tcp_established and without.file_locks
    assert config_lines(without) == ["network-lock skip", "skip-in-flight", f"ghost-limit {64 << 20}"]
    argv = checkpoint_argv("runc", "/r", "sb-1", "/img", "/work", without)
    assert "--tcp-established" in argv and "--file-locks" in argv
    # what the image needs comes back for its restore
    r = RestoreOptions.from_dump(without)
    assert r.tcp_established and r.file_locks and r.network_lock is NetworkLock.SKIP


@pytest.mark.parametrize("v", [0, -1, True, "10"])
def test_stall_timeout_is_a_positive_number(v):
    with pytest.raises(InvalidArgument):
        DumpOptions(stall_timeout=v)


def test_private_netns_skips_in_flight_connections_through_the_config_file():
    # A listening socket with connections not yet accept()ed: without the
    # flag CRIU refuses the whole dump (zdtm socket-tcp-skip-in-flight).
    assert DumpOptions().skip_in_flight is False
    assert "skip-in-flight" not in config_lines(DumpOptions())
    for tcp in (True, False):
        o = DumpOptions.for_private_netns(tcp_connections=tcp)
        assert o.skip_in_flight and "skip-in-flight" in config_lines(o)
        # runc has no flag for it: only the config file carries it
        assert not any("in-flight" in a for a in checkpoint_argv("runc", "/r", "sb-1", "/img", "/work", o))
    assert DumpOptions.for_private_netns(tcp_connections=True, skip_in_flight=False).skip_in_flight is False
    assert DumpOptions.from_dict(DumpOptions(skip_in_flight=True).to_dict()).skip_in_flight


def test_ghost_limit_is_a_config_line_and_a_number_of_bytes():
    assert not any("ghost" in x for x in config_lines(DumpOptions()))
    assert "ghost-limit 4096" in config_lines(DumpOptions(ghost_limit=4096))
    assert DumpOptions.for_private_netns(tcp_connections=False).ghost_limit == 64 << 20
    for bad in (-1, True, "8M", 1.5):
        with pytest.raises(InvalidArgument):
            DumpOptions(ghost_limit=bad)
    assert DumpOptions.from_dict(DumpOptions(ghost_limit=5).to_dict()).ghost_limit == 5


def test_link_remap_goes_into_the_config_file():
    assert "link-remap" in config_lines(DumpOptions(link_remap=True))
    assert "link-remap" not in config_lines(DumpOptions())
    assert DumpOptions.from_dict(DumpOptions(link_remap=True).to_dict()).link_remap
