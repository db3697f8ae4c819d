"""Trace loading: good traces load, bad ones name the field. No root."""

import json
from pathlib import Path

import pytest

from crabd.errors import InvalidArgument
from crabd.traces import load_trace, load_traces

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, data):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(data))
    return p


def test_shipped_traces_load():
    traces = load_traces(ROOT / "bench" / "traces")
    assert len(traces) >= 3
    for t in traces:
        assert 15 <= len(t.turns) <= 60, t.name
        assert t.check and t.state_paths


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
    ]
    for data, field in cases:
        with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
            load_trace(write(tmp_path, data))
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(InvalidArgument, match="not JSON"):
        load_trace(tmp_path / "bad.json")
