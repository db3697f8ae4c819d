"""Loading /etc/crabd/config.toml: defaults, the sample file, and errors that
name the key and the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.errors import InvalidArgument
from crabd.settings import Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "systemd" / "config.toml.sample"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return p


def test_defaults():
    s = Settings()
    assert s.state_dir == Path("/var/lib/crabd")
    assert s.socket == Path("/run/crabd/crabd.sock")
    assert s.tcp_listen is None and s.token_file is None and s.tcp_host_port is None
    assert s.auto_rollback is True and s.watchdog is True
    assert (s.retention.keep_last, s.retention.keep_every) == (50, 10)
    assert s.scheduler.max_concurrency == 2 and s.scheduler.enabled is True
    assert s.scheduler.io_budget_bytes > 0
    assert s.snapshot.driver == "auto"
    assert load_settings(None) == s


def test_the_shipped_sample_loads_and_equals_the_defaults():
    """The sample documents every key with its default value."""
    assert load_settings(SAMPLE) == Settings()
    text = SAMPLE.read_text()
    for key in ("state_dir", "socket", "tcp_listen", "token_file", "auto_rollback", "watchdog",
                "keep_last", "keep_every", "max_concurrency", "max_background", "io_budget_bytes",
                "default_llm_wait", "gap_smoothing", "background_max_delay", "driver", "enabled"):
        assert key in text, key


def test_a_full_file(tmp_path):
    p = write(tmp_path, """
state_dir = "/srv/crabd"
socket = "/run/crabd-2/api.sock"
tcp_listen = "127.0.0.1:7411"
token_file = "/etc/crabd/token"
auto_rollback = false

[retention]
keep_last = 5
keep_every = 0

[scheduler]
enabled = false
max_concurrency = 8
io_budget_bytes = 1073741824
background_max_delay = 300

[snapshot]
driver = "overlay"
""")
    s = load_settings(p)
    assert s.state_dir == Path("/srv/crabd") and s.socket == Path("/run/crabd-2/api.sock")
    assert s.tcp_host_port == ("127.0.0.1", 7411)
    assert s.auto_rollback is False
    assert (s.retention.keep_last, s.retention.keep_every) == (5, 0)
    assert (s.scheduler.enabled, s.scheduler.max_concurrency, s.scheduler.io_budget_bytes) == (False, 8, 1 << 30)
    assert s.scheduler.background_max_delay == 300.0
    assert s.scheduler.max_background == 1  # unspecified keys keep defaults
    assert s.snapshot.driver == "overlay"


def test_ipv6_listen(tmp_path):
    s = load_settings(write(tmp_path, 'tcp_listen = "[::1]:7411"\ntoken_file = "/t"\n'))
    assert s.tcp_host_port == ("::1", 7411)


@pytest.mark.parametrize("text, key", [
    ("keep_lst = 3\n", "keep_lst"),
    ("[retention]\nkeep_lst = 3\n", "retention.keep_lst"),
    ("[schedular]\nmax_concurrency = 3\n", "schedular"),
])
def test_unknown_keys_are_errors_naming_the_key(tmp_path, text, key):
    p = write(tmp_path, text)
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    assert f"unknown key {key!r}" in str(e.value)
    assert str(p) in str(e.value)
    assert e.value.path == p and e.value.field == key


@pytest.mark.parametrize("text, field", [
    ("[scheduler]\nmax_concurrency = 0\n", "scheduler.max_concurrency"),
    ('[scheduler]\nmax_concurrency = "two"\n', "scheduler.max_concurrency"),
    ("[retention]\nkeep_last = -1\n", "retention.keep_last"),
    ('[snapshot]\ndriver = "zfs"\n', "snapshot.driver"),
    ('state_dir = "var/lib/crabd"\n', "state_dir"),
    ('socket = "/' + "x" * 120 + '"\n', "socket"),
    ('tcp_listen = "localhost"\ntoken_file = "/t"\n', "tcp_listen"),
    ('tcp_listen = "127.0.0.1:99999"\ntoken_file = "/t"\n', "tcp_listen"),
    ("auto_rollback = 3\n", "auto_rollback"),
])
def test_bad_values_name_the_field_and_the_file(tmp_path, text, field):
    p = write(tmp_path, text)
    with pytest.raises(SettingsError) as e:
        load_settings(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: {field}: "), msg
    assert e.value.field == field
    assert isinstance(e.value, InvalidArgument)  # the API/CLI map it to 422


def test_tcp_needs_a_token(tmp_path):
    p = write(tmp_path, 'tcp_listen = "0.0.0.0:7411"\n')
    with pytest.raises(SettingsError, match="tcp_listen is set but token_file is not"):
        load_settings(p)


def test_not_toml(tmp_path):
    p = write(tmp_path, "state_dir = \n")
    with pytest.raises(SettingsError, match=r"not valid TOML.*line 1"):
        load_settings(p)
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(SettingsError, match="not UTF-8"):
        load_settings(p)


def test_missing_file(tmp_path):
    with pytest.raises(SettingsError, match="no such configuration file") as e:
        load_settings(tmp_path / "nope.toml")
    assert e.value.fix
    assert load_settings(tmp_path / "nope.toml", missing_ok=True) == Settings()


def test_overrides_are_validated_like_the_file():
    s = Settings()
    t = s.with_overrides(state_dir="/tmp/crabd-a", socket=None, scheduler={"enabled": False})
    assert t.state_dir == Path("/tmp/crabd-a")
    assert t.socket == s.socket  # None = not given
    assert t.scheduler.enabled is False and t.scheduler.max_concurrency == 2  # merged, not replaced
    with pytest.raises(SettingsError, match="state_dir"):
        s.with_overrides(state_dir="relative/dir")
    with pytest.raises(SettingsError, match="unknown key 'stat_dir'"):
        s.with_overrides(stat_dir="/x")


def test_settings_are_immutable():
    with pytest.raises(Exception):
        Settings().state_dir = Path("/x")  # type: ignore[misc]


def test_scheduler_settings_build_the_policy():
    s = Settings().with_overrides(scheduler={"max_concurrency": 4, "io_budget_bytes": 1 << 20, "enabled": False,
                                             "default_llm_wait": 3.5, "background_max_delay": 60})
    p = s.scheduler.policy()
    assert (p.max_concurrency, p.io_budget_bytes, p.enabled) == (4, 1 << 20, False)
    assert p.expected_wait("any") == 3.5 and p.background_max_delay == 60.0
    assert Settings().scheduler.policy().max_concurrency == 2
