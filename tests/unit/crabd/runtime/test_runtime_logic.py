"""Runtime logic driven through FakeRunner: no root, no runc."""

import json

import pytest

from crabd.errors import (CommandNotFound, ExecError, ExecTimeout, InvalidArgument, NotFound,
                          SandboxNotRunning)
from crabd.images import validate_name
from crabd.runtime.cgroups import CgroupLayout
from crabd.runtime.exec_result import merge_env
from crabd.runtime.sandbox import Runtime
from crabd.testing import FakeRunner
from deltafs import Mount


@pytest.fixture
def rt(tmp_path, monkeypatch):
    fake = FakeRunner()
    fake.on("state", stdout=json.dumps({"status": "running", "pid": 4242}).encode())
    init = tmp_path / "crabd-init"
    init.write_bytes(b"\x7fELF")
    r = Runtime(tmp_path / "state", runner=fake, layout=CgroupLayout(False, None, None), init_binary=init)
    img = tmp_path / "state" / "images" / "img" / "rootfs"
    img.mkdir(parents=True)
    (img.parent / "image.json").write_text(json.dumps(
        {"name": "img", "source": "test", "created_at": 0, "size_bytes": 0, "files": 0,
         "env": ["FOO=image"], "workdir": "/work"}))
    # No mounting in unit tests: the root is created but never started.
    sb = r.create("img", name="t", start=False, root=[Mount("bind", "/nonexistent", ("bind",))])
    r.fake = fake
    r.sb = sb
    return r


def test_exec_reports_exit_code_and_output(rt):
    rt.fake.on_capture(status="X 3", stdout=b"out", stderr=b"err")
    res = rt.exec(rt.sb.id, "echo hi", env={"BAR": "x"})
    assert (res.exit_code, res.stdout, res.stderr) == (3, "out", "err")
    argv = rt.fake.calls[-1]
    assert "--detach" in argv and argv[-3:] == ["/bin/sh", "-c", "echo hi"]
    envs = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert "FOO=image" in envs and "BAR=x" in envs
    assert argv[argv.index("--cwd") + 1] == "/work"  # the image's working dir


def test_exec_signal_maps_to_128_plus(rt):
    rt.fake.on_capture(status="S 9")
    assert rt.exec(rt.sb.id, ["sleep", "1"]).exit_code == 137


def test_exec_missing_program_is_typed(rt):
    rt.fake.on_capture(status="E 2")
    with pytest.raises(CommandNotFound, match="nosuch"):
        rt.exec(rt.sb.id, ["nosuch"])
    rt.fake.on_capture(status="E 13")
    with pytest.raises(ExecError, match="Permission denied"):
        rt.exec(rt.sb.id, ["/etc/passwd"])


def test_exec_timeout_is_typed_and_keeps_partial_output(rt):
    rt.fake.on_capture(status=None, returncode=None, timed_out=True, stdout=b"partial")
    with pytest.raises(ExecTimeout) as ei:
        rt.exec(rt.sb.id, "sleep 100", timeout=0.5)
    assert ei.value.stdout == "partial"


def test_truncated_output_carries_a_marker(rt):
    rt.fake.on_capture(status="X 0", stdout=b"x" * 10, dropped=990)
    res = rt.exec(rt.sb.id, "yes")
    assert res.stdout_truncated and "990 more bytes not shown" in res.stdout


def test_exec_on_stopped_sandbox_is_typed(rt):
    rt.fake.on("state", stdout=json.dumps({"status": "stopped", "pid": 0}).encode())
    with pytest.raises(SandboxNotRunning):
        rt.exec(rt.sb.id, "true")


def test_bad_commands_are_invalid_arguments(rt):
    for bad in ([], [""] if False else [1], ["a\0b"]):
        with pytest.raises(InvalidArgument):
            rt.exec(rt.sb.id, bad)
    with pytest.raises(InvalidArgument):
        rt.exec(rt.sb.id, "true", timeout=0)


def test_unknown_sandbox_is_not_found(rt):
    with pytest.raises(NotFound):
        rt.get("sb-ffffffffff")
    with pytest.raises(NotFound):
        rt.get("../../etc")


def test_sandbox_found_by_name_and_image_in_use(rt):
    assert rt.get("t").id == rt.sb.id
    assert rt.images.users("img") == [rt.sb.id]


def test_merge_env_later_wins():
    assert merge_env(("A=1", "B=2"), ("A=3", "C=")) == ("A=3", "B=2", "C=")


@pytest.mark.parametrize("name", ["debian", "a", "py3.11-slim", "x_y"])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", "A", "a/b", "..", ".x", "a" * 64, "a b", "é"])
def test_invalid_names(name):
    with pytest.raises(InvalidArgument):
        validate_name(name)
