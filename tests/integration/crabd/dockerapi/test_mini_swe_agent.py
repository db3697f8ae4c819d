"""mini-swe-agent (PyPI, pinned in tests/requirements-harness.txt) on crabd,
unmodified: its DefaultAgent and DockerEnvironment, configured only
(DOCKER_HOST, image, cwd, run_args) to use crabd's Docker API, with a
scripted model in this file (no network).

The task is a real repository: the sdist of `roman` 5.2 from PyPI (vendored
in tests/data, hash pinned below), copied into the container with `docker
cp`, committed to git, and broken by one injected bug; the scripted agent
runs the package's own unittest suite, reads the code, edits it, runs the
suite again and submits its `git diff` once the suite passes.

Shows, on crabd: (a) every agent step is a crabd turn with a plan and a
checkpoint; (b) the sandbox's processes are killed (kill -9 of its init)
right after the edit, while the agent "waits on its LLM": crabd rolls it
back to that step's checkpoint, the next step finds the edit and the suite
passes; (c) best-of-N: the checkpoint of the step before the edit is forked
into two branches, each an environment made by mini-swe-agent's own
`get_environment` from the same config plus the run_args label
`crabd.fork-from=CHECKPOINT`, each driven with a different scripted fix;
the branch whose suite passes is kept. And on a plain dockerd (same
harness, same config but DOCKER_HOST, same steps, same kill): the container
is gone, every later step fails and the edit is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from crabd.testing import wait_until

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py", "docker")

# tests/data, wherever under tests/ this file is moved
SDIST = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "data" / "roman-5.2.tar.gz"
SDIST_SHA256 = "275fe9f46290f7d0ffaea1c33251b92b8e463ace23660508ceef522e7587cb6f"
IMAGE = "debian-py"
TASK = "The unittest suite of the roman package in /testbed (cd src && python3 -m unittest tests) fails. Fix it."

# The harness's instance preparation (as SWE-bench's images do): the sdist
# as a git repository whose HEAD already has the bug.
BUG = "sed -i 's/while n >= integer:/while n > integer:/' src/roman/__init__.py"
PREPARE = ("tar -xzf /tmp/roman-5.2.tar.gz -C /testbed --strip-components=1 && rm /tmp/roman-5.2.tar.gz && "
           f"cd /testbed && {BUG} && git init -q && git add -A && "
           "git -c user.name=harness -c user.email=harness@localhost commit -qm 'roman 5.2 with a bug'")

RUN_TESTS = "cd src && python3 -m unittest tests 2>&1 | tail -n 12"
GOOD_FIX = "sed -i 's/while n > integer:/while n >= integer:/' src/roman/__init__.py && git diff --stat"
BAD_FIX = "sed -i 's/while n > integer:/if n >= integer:/' src/roman/__init__.py && git diff --stat"
SUBMIT = ("cd src && python3 -m unittest tests >/dev/null 2>&1 && cd .. && "
          "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff")
# Read, run, edit, run, submit. The kill comes before answer 4: right after the edit.
STEPS = [RUN_TESTS, "grep -n 'while n' src/roman/__init__.py", GOOD_FIX, RUN_TESTS, SUBMIT]
KILL_BEFORE = 4


def _agent(commands, env, before=None):
    """DefaultAgent with a DeterministicModel answering `commands` in order;
    before[k]() runs before answer k (1-based): the agent's "LLM wait"."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.test_models import DeterministicModel, make_output

    class ScriptedModel(DeterministicModel):
        def query(self, messages, **kw):
            if before and self.current_index + 2 in before:
                before[self.current_index + 2]()
            return super().query(messages, **kw)

    model = ScriptedModel(outputs=[make_output(f"```mswea_bash_command\n{c}\n```", [{"command": c}])
                                   for c in commands])
    # step_limit: a script that runs out without submitting ends as LimitsExceeded.
    return DefaultAgent(model, env, system_template="You fix bugs.", instance_template="{{task}}",
                        step_limit=len(commands), cost_limit=100.0)


def _observations(agent) -> list[str]:
    return [m["content"] for m in agent.messages if m["role"] in ("user", "tool")][1:]  # [0] is the task


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The docker CLI on $DOCKER_HOST (the engine under test)."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, check=check)


def _environment(**extra):
    """mini-swe-agent's docker environment, from its public config."""
    from minisweagent.environments import get_environment

    return get_environment({"environment_class": "docker", "image": IMAGE, "cwd": "/testbed", "timeout": 120,
                            "pull_timeout": 120, "run_args": ["--rm", "--network", "none"], **extra})


def _prepare(env) -> None:
    assert hashlib.sha256(SDIST.read_bytes()).hexdigest() == SDIST_SHA256
    _docker("cp", str(SDIST), f"{env.container_id}:/tmp/roman-5.2.tar.gz")
    _docker("exec", env.container_id, "bash", "-c", PREPARE)


def _remove(*envs) -> None:
    for env in envs:
        _docker("rm", "-f", env.container_id, check=False)
        env.container_id = None  # removed: its __del__ has nothing to stop


def _init_pid(env) -> int:
    return int(_docker("inspect", "--format", "{{.State.Pid}}", env.container_id).stdout)


def test_mini_swe_agent_repairs_sdist_recovers_and_forks(start_daemon, debian_image, monkeypatch):
    d = start_daemon(env={"CRABD_INSPECTOR": "proc"}, images=(IMAGE,))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{d.state / 'docker.sock'}")
    c = d.client()
    env = _environment()
    sid = json.loads(_docker("inspect", env.container_id).stdout)[0]["Crabd"]["sandbox"]  # Docker's id is not crabd's
    _prepare(env)
    since = max([e["seq"] for e in c.events()] or [0])
    turn0 = c.sandbox(sid)["turn"]  # the harness's own turns: create, cp, prepare
    fork_point: dict[str, str] = {}

    def captured() -> list[dict]:
        # The agent waits on its model: crabd captures the last turn meanwhile.
        wait_until(lambda: all(k["state"] == "committed" for k in c.checkpoints(sid, all=True)), "captures")
        return c.checkpoints(sid)

    def before_edit() -> None:
        fork_point["id"] = max(captured(), key=lambda k: k["seq"])["id"]

    def crash() -> None:
        captured()
        os.kill(_init_pid(env), signal.SIGKILL)
        wait_until(lambda: "sandbox.rolled_back" in [e["kind"] for e in c.events(since=since, sandbox=sid)],
                   "crabd's automatic rollback", timeout=60)

    agent = _agent(STEPS, env, before={3: before_edit, KILL_BEFORE: crash})
    result = agent.run(TASK)
    obs = _observations(agent)
    assert "FAILED" in obs[0] and "while n > integer:" in obs[1], obs[:2]  # the bug was there and was read
    assert "\nOK\n" in obs[3] and "FAILED" not in obs[3], obs[3]  # after the kill: the edit is there, the suite passes
    assert result.get("exit_status") == "Submitted", obs[-2:]
    assert "+        while n >= integer:" in result["submission"]
    # One turn and one checkpoint (with its plan) per step; the kill rolled
    # the sandbox back to the edit's checkpoint, the steps after it are on
    # the next branch.
    cks = {k["turn"]: k for k in c.checkpoints(sid) if k["turn"] > turn0}
    assert sorted(cks) == list(range(turn0 + 1, turn0 + 1 + len(STEPS))), cks
    assert all(k["plan"] in ("SKIP", "FS", "FS_PROC") for k in cks.values())
    edit = cks[turn0 + KILL_BEFORE - 1]
    assert [k["branch"] for k in cks.values()] == [edit["branch"]] * (KILL_BEFORE - 1) + \
        [edit["branch"] + 1] * (len(STEPS) - KILL_BEFORE + 1)
    rolled = [e for e in c.events(since=since, sandbox=sid) if e["kind"] == "sandbox.rolled_back"]
    assert [e["data"]["checkpoint"] for e in rolled] == [edit["id"]]
    assert fork_point["id"] == cks[turn0 + 2]["id"]

    # Best-of-N from the checkpoint of step 2 (read, not yet edited): each
    # branch is the same environment class built from its public config.
    branches, kept = [], []
    for fix in (BAD_FIX, GOOD_FIX):
        branch = _environment(run_args=["--rm", "--network", "none", "--label", f"crabd.fork-from={fork_point['id']}"])
        branches.append(branch)
        r = _agent([fix, SUBMIT], branch).run(TASK)
        if r.get("exit_status") == "Submitted":
            kept.append(branch)
    assert kept == [branches[1]]
    assert "+        while n >= integer:" in _docker("exec", "-w", "/testbed", branches[1].container_id,
                                                    "git", "diff").stdout
    for b in branches:  # crabd forks of the step-2 checkpoint, not fresh containers
        info = json.loads(_docker("inspect", b.container_id).stdout)[0]
        assert c.sandbox(info["Crabd"]["sandbox"])["image"] == IMAGE
    _remove(env, *branches)
    assert c.sandboxes() == []


def test_plain_docker_loses_the_work(plain_dockerd, monkeypatch):
    """The same harness, config, steps and kill on a plain dockerd."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{plain_dockerd}")
    env = _environment()
    cid = env.container_id
    _prepare(env)

    def crash() -> None:
        os.kill(_init_pid(env), signal.SIGKILL)
        wait_until(lambda: _docker("inspect", cid, check=False).returncode != 0, "the container gone (--rm)")

    agent = _agent(STEPS, env, before={KILL_BEFORE: crash})
    result = agent.run(TASK)
    obs = _observations(agent)
    assert "FAILED" in obs[0] and "while n > integer:" in obs[1] and "1 file changed" in obs[2], obs[:3]
    assert result.get("exit_status") == "LimitsExceeded"  # never submitted
    for o in obs[KILL_BEFORE - 1:]:  # every step after the kill
        assert "<returncode>1</returncode>" in o and "No such container" in o, o
    env.container_id = None  # gone with the kill (--rm)
