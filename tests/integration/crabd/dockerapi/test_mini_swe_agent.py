"""mini-swe-agent (PyPI, pinned in the `agents` extra) on crabd, unmodified:
its DefaultAgent and DockerEnvironment, configured only (DOCKER_HOST, cwd,
interpreter) to use crabd's Docker API, with a scripted model in this file
(no network). The task: a small shell "repository" whose test fails until
its bug is fixed.

Shows (a) every agent step is a crabd turn with a plan and a checkpoint;
(b) the sandbox's processes are killed (kill -9 of its init) while the agent
"waits on its LLM", crabd rolls it back and the agent goes on to submit
with the task's test passing; (c) best-of-N: the checkpoint of the step
before the fix is forked into two branches, each driven by the same agent
and environment classes with a different scripted continuation; the branch
whose test passes is kept.

Not shown here: a PyPI sdist as the task; the same crash on plain Docker
losing the work is in bench/docker.py (crash_mid_session: it needs a dockerd
with the image), with the docker CLI's session pattern, not mini-swe-agent.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess

from crabd.testing import wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "docker")

SETUP = ("mkdir -p /repo && cd /repo && printf 'add() { echo $(($1 - $2)); }\\n' > lib.sh && "
         "printf '. ./lib.sh\\n[ \"$(add 2 3)\" = 5 ]\\n' > test.sh")
SUBMIT = "sh test.sh && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
GOOD_FIX = "sed -i 's/- \\$2/+ $2/' lib.sh"
BAD_FIX = "sed -i 's/- \\$2/* $2/' lib.sh"


def _agent(model_outputs, env, before=None):
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.test_models import DeterministicModel

    class ScriptedModel(DeterministicModel):
        """DeterministicModel with a hook run before answer k: the "LLM wait"."""

        def query(self, messages, **kw):
            if before and self.current_index + 1 in before:
                before[self.current_index + 1]()
            return super().query(messages, **kw)

    model = ScriptedModel(outputs=model_outputs)
    return DefaultAgent(model, env, system_template="You fix bugs.", instance_template="{{task}}", step_limit=20,
                        cost_limit=100.0)


def _out(cmd):
    from minisweagent.models.test_models import make_output
    return make_output(f"```mswea_bash_command\n{cmd}\n```", [{"command": cmd}])


def test_mini_swe_agent_recovers_and_forks(start_daemon, monkeypatch):
    from minisweagent.environments.docker import DockerEnvironment

    d = start_daemon(env={"CRABD_INSPECTOR": "proc"})
    monkeypatch.setenv("DOCKER_HOST", f"unix://{d.state / 'docker.sock'}")
    c = d.client()
    env = DockerEnvironment(image="busybox", cwd="/", interpreter=["sh", "-c"], timeout=120, pull_timeout=120)
    insp = subprocess.run(["docker", "inspect", env.container_id], capture_output=True, timeout=120, check=True)
    sid = json.loads(insp.stdout)[0]["Crabd"]["sandbox"]  # the Docker id is not crabd's
    since = max([e["seq"] for e in c.events()] or [0])

    def crash() -> None:
        # The agent waits on its model: crabd captured the last turn by now.
        wait_until(lambda: all(k["state"] == "committed" for k in c.checkpoints(sid, all=True)), "captures")
        os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)
        wait_until(lambda: "sandbox.rolled_back" in [e["kind"] for e in c.events(since=since, sandbox=sid)],
                   "crabd's automatic rollback", timeout=60)

    steps = [SETUP, "cd /repo && sh test.sh; echo rc=$?", f"cd /repo && {GOOD_FIX}", f"cd /repo && {SUBMIT}"]
    agent = _agent([_out(s) for s in steps], env, before={3: crash})
    result = agent.run("make /repo/test.sh pass")
    assert result.get("exit_status") == "Submitted", agent.messages[-3:]
    outs = [m["content"] for m in agent.messages if m["role"] in ("user", "tool")][1:]
    assert "rc=1" in outs[1]  # the bug was there
    cks = c.checkpoints(sid)
    assert len([k for k in cks if k["turn"] >= 1]) >= 4 and all(k["plan"] in ("SKIP", "FS", "FS_PROC") for k in cks)

    # Best-of-N from the checkpoint of step 2 (before the fix).
    step2 = max((k for k in cks if k["turn"] == 2), key=lambda k: k["seq"])
    forks = c.fork(step2["id"], 2)["sandboxes"]
    kept = []
    for fork, fix in zip(forks, [BAD_FIX, GOOD_FIX]):
        branch = DockerEnvironment.__new__(DockerEnvironment)  # the same class, attached to the fork
        branch.config, branch.logger, branch.container_id = env.config, logging.getLogger("branch"), fork
        a = _agent([_out(f"cd /repo && {fix}"), _out(f"cd /repo && {SUBMIT}"), _out("echo gave up; exit 1")], branch)
        try:
            r = a.run("make /repo/test.sh pass")
        except IndexError:  # the scripted model ran out of answers: this branch did not submit
            r = {}
        if r.get("exit_status") == "Submitted":
            kept.append(fork)
    assert kept == [forks[1]]
    host = os.environ["DOCKER_HOST"]
    for s in [*forks, sid]:
        subprocess.run(["docker", "-H", host, "rm", "-f", s], capture_output=True, timeout=120, check=True)
    env.container_id = None  # removed above: its __del__ has nothing to stop
    assert json.loads(json.dumps(c.sandboxes())) == []
