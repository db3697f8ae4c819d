"""Trace loading: good traces load, bad ones name the field. No root."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from crabd.errors import InvalidArgument
from crabd.traces import load_trace, load_traces

ROOT = Path(__file__).resolve().parents[3]


def _bench_module(name):
    """A module of bench/ (not a package: the benches are scripts)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return importlib.import_module(name)


def write(tmp_path, data):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    return p


def test_shipped_traces_load():
    traces = load_traces(ROOT / "bench" / "traces")
    assert len(traces) >= 12
    assert len({t.name for t in traces}) == len(traces)
    for t in traces:
        assert 15 <= len(t.turns) <= 60, t.name
        assert t.check and t.state_paths
        assert all(1000 <= turn.llm_wait_ms <= 10000 for turn in t.turns), t.name


def test_shipped_traces_inputs_and_images_are_known():
    """What a shipped trace names must be fetchable: pinned inputs, images bench/inputs.py can build."""
    inputs = _bench_module("inputs")
    for t in load_traces(ROOT / "bench" / "traces"):
        assert set(t.inputs) <= set(inputs.PINNED), t.name
        assert t.image in inputs.IMAGES, t.name
    for name, (req, kind) in inputs.PINNED.items():
        assert "==" in req and kind in ("sdist", "wheel")
        assert name.startswith(req.split("==")[0].replace("_", "-")) and req.split("==")[1] in name


def test_malformed_traces_name_the_field(tmp_path):
    good = {"name": "x", "turns": [{"run": "ls"}]}
    assert load_trace(write(tmp_path, good)).turns[0].llm_wait_ms == 2000
    cases = [
        ({"name": "x", "turns": [{"llm_wait_ms": 5}]}, "turns.0.run"),
        ({"name": "x", "turns": []}, "turns"),
        ({"name": "x", "turns": [{"run": "ls"}], "files": {"rel/path": ""}}, "files"),
        ({"name": "X Y", "turns": [{"run": "ls"}]}, "name"),
        ({"name": "x", "turns": [{"run": "ls"}], "bogus": 1}, "bogus"),
        ({"name": "x", "turns": [{"run": "ls", "llm_wait_ms": -1}]}, "turns.0.llm_wait_ms"),
        ({"name": "x", "turns": [{"run": "ls"}], "inputs": ["../etc/passwd"]}, "inputs"),
    ]
    for data, field in cases:
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            load_trace(write(tmp_path, data))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(InvalidArgument, match="not JSON"):
        load_trace(tmp_path / "bad.json")


# -- bench/swebench.py: pure parts ---------------------------------------------------------------
def test_swebench_actions_track_the_open_file():
    sw = _bench_module("swebench")
    v = sw.AgentView()
    assert sw.action_to_shell("open pkg/mod.py 120", v) == "cat -n pkg/mod.py | sed -n '70,169p'"
    assert sw.action_to_shell("scroll_down", v) == "cat -n pkg/mod.py | sed -n '170,269p'"
    assert sw.action_to_shell("goto 10", v) == "cat -n pkg/mod.py | sed -n '1,100p'"
    assert sw.action_to_shell("search_file 'def f'", v) == "grep -n -F -e 'def f' pkg/mod.py"
    assert sw.action_to_shell("find_file setup.py", v) == "find . -name setup.py"
    assert sw.action_to_shell("submit", v) == "git add -A && git diff --cached"
    assert sw.action_to_shell("  ", v) is None
    assert sw.action_to_shell("pytest -x tests/ | tail -3", v) == "pytest -x tests/ | tail -3"  # bash passes through


def test_swebench_edit_and_str_replace_run_in_a_shell(tmp_path):
    sw = _bench_module("swebench")
    f = tmp_path / "m.py"
    f.write_text("a = 1\nb = 2\nc = 3\n")
    v = sw.AgentView()
    sw.action_to_shell(f"open {f}", v)
    cmd = sw.action_to_shell("edit 2:2\nb = 20\nb2 = 21\nend_of_edit", v)
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert f.read_text() == "a = 1\nb = 20\nb2 = 21\nc = 3\n"
    assert "     3\tb2 = 21" in r.stdout  # the window after the edit, as SWE-agent shows it
    cmd = sw.action_to_shell(f"str_replace_editor str_replace {f} --old_str 'c = 3' --new_str 'c = 30'", v)
    assert subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=30).returncode == 0
    assert f.read_text().endswith("c = 30\n")


def test_swebench_instances_name_what_is_missing(tmp_path):
    sw = _bench_module("swebench")
    p = tmp_path / "i.jsonl"
    p.write_text(json.dumps({"instance_id": "a__b-1", "repo": "a/b"}) + "\n")
    with pytest.raises(sw.ConversionError, match="lacks base_commit, patch, test_patch, FAIL_TO_PASS"):
        sw.read_instances(p)
    p.write_text("{bad\n")
    with pytest.raises(sw.ConversionError, match="i.jsonl:1: not JSON"):
        sw.read_instances(p)
    full = {"instance_id": "Django__Django-11099", "repo": "django/django", "base_commit": "abc", "patch": "",
            "test_patch": "", "FAIL_TO_PASS": '["t1"]', "PASS_TO_PASS": ""}
    p.write_text(json.dumps(full) + "\n")
    inst = sw.read_instances(p)[0]
    assert inst["FAIL_TO_PASS"] == ["t1"] and inst["PASS_TO_PASS"] == []
    assert sw.trace_name(inst["instance_id"]) == "django__django-11099"
    assert sw.test_command(inst, None, ["a b"]) == "python tests/runtests.py 'a b'"
    with pytest.raises(sw.ConversionError, match="no git checkout of django/django"):
        sw.find_repo(tmp_path, "django/django")


def test_inputs_are_staged_in_pieces(tmp_path, monkeypatch):
    """stage() splits a file into base64 pieces (the API's body limit); the pieces append."""
    import base64

    inputs = _bench_module("inputs")
    monkeypatch.setattr(inputs, "CACHE", tmp_path)
    monkeypatch.setattr(inputs, "CHUNK", 1000)
    data = bytes(range(256)) * 17  # 4352 bytes: 5 pieces
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "blob.bin").write_bytes(data)
    got: dict[str, bytes] = {}
    calls = []

    def run(argv, stdin):
        calls.append(argv[-1])
        redirect, dst = argv[-1].split("base64 -d ")[1].split(" ")
        got[dst] = (got.get(dst, b"") if redirect == ">>" else b"") + base64.b64decode(stdin)
        return {"exit_code": 0}

    inputs.stage(["blob.bin"], run)
    assert got == {"/inputs/blob.bin": data} and len(calls) == 5
    with pytest.raises(SystemExit, match="neither pinned"):
        inputs.stage(["nope.tar.gz"], run)
