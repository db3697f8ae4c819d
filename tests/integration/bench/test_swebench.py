"""`crabd bench swebench`: a SWE-bench instance and a SWE-agent trajectory that this
test builds itself become a trace, and that trace solves the task in a real sandbox.

Requires root, runc and the debian-py test image. The trace runs in a runc sandbox of the
runtime (no daemon: checkpoints are not what is tested here, the conversion is)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from crabd.traces import STATE_DIGEST, load_traces

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "debian-py")

ROOT = Path(__file__).resolve().parents[3]
CRABD = str(Path(sys.executable).parent / "crabd")
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a + b\n"
TESTS = ("import unittest\n\nfrom calc import add\n\n\nclass CalcTests(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
NEW_TEST = "\n    def test_sub(self):\n        from calc import sub\n        self.assertEqual(sub(5, 3), 2)\n"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}, timeout=60).stdout


def make_repo(repos: Path) -> tuple[str, str, str]:
    """acme/calc with a bug in sub(); returns (base commit, gold patch, test patch)."""
    repo = repos / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text(CALC)
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "__init__.py").write_text(CALC.replace("return a + b\n", "return a - b\n").replace(
        "return a - b\n", "return a + b\n", 1))
    gold = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    (repo / "tests" / "test_calc.py").write_text(TESTS + NEW_TEST)
    test_patch = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    assert "return a - b" in gold and "test_sub" in test_patch
    return base, gold, test_patch


def test_swebench_instance_and_trajectory_run_in_a_sandbox(tmp_path, runtime, debian_image, sandbox_factory):
    base, gold, test_patch = make_repo(tmp_path / "repos")
    inst = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base, "patch": gold,
            "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["tests.test_calc.CalcTests.test_sub"]),
            "PASS_TO_PASS": ["tests.test_calc.CalcTests.test_add"]}
    other = {**inst, "instance_id": "acme__calc-2"}  # no trajectory: the oracle session
    (tmp_path / "instances.jsonl").write_text(json.dumps(inst) + "\n" + json.dumps(other) + "\n")
    (tmp_path / "trajs" / "run1").mkdir(parents=True)
    (tmp_path / "trajs" / "run1" / "acme__calc-1.traj").write_text(json.dumps({"trajectory": [
        {"action": "find_file __init__.py calc"},
        {"action": "open calc/__init__.py"},
        {"action": "search_file 'def sub'"},
        {"action": "edit 6:6\n    return a - b\nend_of_edit"},
        {"action": "python3 -c 'import calc; print(calc.sub(5, 3))'"},
        {"action": "submit"},
    ], "info": {"exit_status": "submitted"}}))
    cache = tmp_path / "cache"
    out = tmp_path / "traces"
    r = subprocess.run([CRABD, "bench", "swebench", "--instances", str(tmp_path / "instances.jsonl"),
                        "--repos", str(tmp_path / "repos"), "--trajectories", str(tmp_path / "trajs"),
                        "--out", str(out), "--test-cmd", "python3 -m unittest", "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "CRABD_BENCH_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    made = {w["instance_id"]: w for w in json.loads(r.stdout)["traces"]}
    assert made["acme__calc-1"]["from"] == "trajectory" and made["acme__calc-2"]["from"] == "oracle"
    traces = {t.name: t for t in load_traces(out)}
    t = traces["acme__calc-1"]
    assert len(t.turns) == 6 and t.inputs == ["swebench-acme__calc-1.tar.gz"]
    assert (cache / "local" / t.inputs[0]).is_file()
    assert "git apply -v /swebench/gold.patch" in " ".join(x.run for x in traces["acme__calc-2"].turns)

    # The trajectory's trace, run in a real sandbox through the daemon, solves the task.
    os.environ["CRABD_BENCH_CACHE"] = str(cache)
    try:
        import importlib

        from bench import inputs
        importlib.reload(inputs)  # CACHE is read at import
        assert t.image == debian_image
        sb = sandbox_factory(t.image)
        ex = lambda cmd, stdin=None: runtime.exec(sb.id, cmd, timeout=300, stdin=stdin).to_dict()  # noqa: E731
        inputs.prelude(t, ex)  # the archive into /inputs, the patches, setup: as the benches do
        # Before the agent's turns, SWE-bench's verdict fails: the bug is there.
        assert ex(t.check[0].run)["exit_code"] != 0
        outs = [ex(turn.run) for turn in t.turns]
        assert outs[0]["stdout"] == "calc/__init__.py\n"
        assert "6\t    return a + b" in outs[1]["stdout"]  # `open` shows numbered lines
        assert outs[4]["stdout"] == "2\n", outs[4]
        assert "+    return a - b" in outs[5]["stdout"]  # submit shows the diff
        res = ex(t.check[0].run)
        assert res["exit_code"] == 0, res["stderr"]
        assert "Ran 2 tests" in res["stderr"]
        assert ex(["python3", "-c", STATE_DIGEST, *t.state_paths])["exit_code"] == 0

        # The oracle session (no trajectory) applies the test patch, sees the failure,
        # applies the gold patch: its verdict passes too.
        o = traces["acme__calc-2"]
        sb2 = sandbox_factory(o.image)
        ex2 = lambda cmd, stdin=None: runtime.exec(sb2.id, cmd, timeout=300, stdin=stdin).to_dict()  # noqa: E731
        inputs.prelude(o, ex2)
        outs = [ex2(turn.run) for turn in o.turns]
        assert any("FAILED (failures=1)" in x["stdout"] for x in outs), [x["stdout"] for x in outs]
        res = ex2(o.check[0].run)
        assert res["exit_code"] == 0, res["stderr"]
    finally:
        del os.environ["CRABD_BENCH_CACHE"]
