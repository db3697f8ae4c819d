"""CrabdCheckpointSaver on a real daemon: a LangGraph agent with a scripted
fake LLM (no network) edits files in a busybox sandbox over several steps,
crashes (its sandbox's processes are killed and the tool raises), is resumed
from an earlier graph checkpoint, and forked into a second thread. The files
are compared by sha256 with what each step wrote.

LangGraph's conformance suite runs in full against the saver with an
in-process fake of the client (tests/unit/crabd/integrations/test_langgraph_saver.py), and in
full here against the daemon too (issue 17, item 5: the claim rests on the
real thing): put, put_writes, list, get_tuple, delete_thread. It makes a
sandbox for each of its ~50 threads: ~45 s on a loaded host."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

import pytest

from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from crabd.client import AsyncClient, Client
from crabd.integrations.langgraph import CrabdCheckpointSaver, record_of
from crabd.testing import DaemonHandle, cleanup_state_dir

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")

# What the fake LLM asks for, one tool call per turn: (file, shell to run).
EDITS = [
    ("a.txt", "mkdir -p /work && printf 'alpha\\n' > /work/a.txt"),
    ("a.txt", "printf 'beta\\n' >> /work/a.txt"),
    ("b.txt", "printf 'gamma\\n' > /work/b.txt"),
    ("a.txt", "sed -i 's/alpha/ALPHA/' /work/a.txt"),
    ("c.txt", "printf 'delta\\n' > /work/c.txt"),
]


def expected_files(n: int) -> dict[str, str]:
    """sha256 of each file of /work after the first n edits (the same edits, in Python)."""
    files: dict[str, str] = {}
    contents = [("a.txt", "alpha\n", "w"), ("a.txt", "beta\n", "a"), ("b.txt", "gamma\n", "w"),
                ("a.txt", None, "sed"), ("c.txt", "delta\n", "w")]
    for name, text, mode in contents[:n]:
        if mode == "w":
            files[name] = text or ""
        elif mode == "a":
            files[name] = files.get(name, "") + (text or "")
        else:
            files[name] = files[name].replace("alpha", "ALPHA", 1)
    return {k: hashlib.sha256(v.encode()).hexdigest() for k, v in files.items()}


def sandbox_files(c: Client, sid: str) -> dict[str, str]:
    r = c.exec(sid, "mkdir -p /work && cd /work && for f in $(ls | sort); do sha256sum \"$f\"; done")
    assert r["exit_code"] == 0, r["stderr"]
    return {name: digest for digest, name in (line.split() for line in r["stdout"].splitlines())}


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def fake_llm(messages: list[AnyMessage]) -> AIMessage:
    """A scripted model: its answer depends only on the conversation, so a
    resumed or forked run asks for the same calls again."""
    done = sum(isinstance(m, ToolMessage) for m in messages)
    if done == len(EDITS):
        return AIMessage(content="all edits done")
    name, cmd = EDITS[done]
    return AIMessage(content="", tool_calls=[{"name": "sh", "args": {"cmd": cmd, "file": name}, "id": f"call{done}"}])


def build_agent(saver: CrabdCheckpointSaver, c: Client, crash: dict[str, Any]) -> Any:
    def agent(state: State) -> dict[str, Any]:
        return {"messages": [fake_llm(state["messages"])]}

    def tools(state: State, config: RunnableConfig) -> dict[str, Any]:
        sid = saver.sandbox_for(config)  # pins the step's sandbox state before running anything
        call = state["messages"][-1].tool_calls[0]
        r = c.exec(sid, call["args"]["cmd"])
        assert r["exit_code"] == 0, r["stderr"]
        n = sum(isinstance(m, ToolMessage) for m in state["messages"]) + 1
        if n == crash.get("at"):
            crash.pop("at")
            os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)  # every process of the sandbox dies
            raise RuntimeError(f"agent crashed during edit {n}")
        return {"messages": [ToolMessage(content=f"ran {call['args']['cmd']}", tool_call_id=call["id"])]}

    g = StateGraph(State)
    g.add_node("agent", agent)
    g.add_node("tools", tools)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", lambda s: "tools" if s["messages"][-1].tool_calls else END)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=saver)


def wait_recovered(c: Client, sid: str, since: int) -> None:
    deadline = time.monotonic() + 120
    kinds: list[str] = []
    while time.monotonic() < deadline:
        kinds = [e["kind"] for e in c.events(since=since, sandbox=sid)]
        if "sandbox.rolled_back" in kinds:
            return
        time.sleep(0.1)
    raise AssertionError(f"crabd did not recover sandbox {sid} after its processes were killed: {kinds}")


@pytest.fixture(scope="module")
def daemon(runtime, busybox_image):
    """One daemon for this module's tests (starting one is most of their cost).
    The /proc inspector (CRABD_INSPECTOR=proc): the saver takes manual
    checkpoints, so what the turn inspector classifies does not change these
    tests, and it spares compiling the BPF program at start."""
    from crabd.runtime import Runtime
    st = Path(tempfile.mkdtemp(prefix="crabd-test-", dir="/var/tmp"))
    Runtime(st).images.import_path(runtime.images.get(busybox_image).path, busybox_image)
    d = DaemonHandle(st, env={"CRABD_INSPECTOR": "proc"})
    try:
        d.start()
        yield d
    finally:
        try:
            d.shutdown(strict=True)
        finally:
            cleanup_state_dir(st)


def test_conformance_suite_against_the_daemon(daemon):
    from langgraph.checkpoint.conformance import checkpointer_test, validate
    c = daemon.client()
    before = {s["id"] for s in c.sandboxes()}

    @checkpointer_test(name="CrabdCheckpointSaver(crabd daemon, AsyncClient)")
    async def factory() -> Any:
        ac = AsyncClient(daemon.socket)  # the suite calls the async API: aput, aget_tuple, ...
        try:
            yield CrabdCheckpointSaver(c, aclient=ac, image="busybox")
        finally:
            await ac.aclose()

    report = asyncio.run(validate(factory))
    report.print_report()
    assert report.passed_all_base(), report.results
    for cap in ("put", "put_writes", "get_tuple", "list", "delete_thread"):
        res = report.results[cap]
        assert res.tests_passed > 0 and res.tests_failed == 0, (cap, res.failures)
    # every graph checkpoint got a real crabd checkpoint of its thread's sandbox
    made = [s for s in c.sandboxes() if s["id"] not in before]
    assert made and all(len(c.checkpoints(s["id"])) >= 2 for s in made)
    for s in made:
        c.delete_sandbox(s["id"])


def test_agent_crash_resume_from_earlier_checkpoint_and_fork(daemon):
    c = daemon.client()
    saver = CrabdCheckpointSaver(c, image="busybox")
    crash: dict[str, Any] = {"at": 4}
    graph = build_agent(saver, c, crash)
    cfg: RunnableConfig = {"configurable": {"thread_id": "agent-1"}}

    events_before = max([e["seq"] for e in c.events()] or [0])
    try:
        graph.invoke({"messages": [HumanMessage("edit the files")]}, cfg)
        raise AssertionError("the agent did not crash")
    except RuntimeError as e:
        assert "crashed during edit 4" in str(e)
    sid = saver.sandbox_for(cfg)
    wait_recovered(c, sid, events_before)

    # Every graph checkpoint records a crabd checkpoint of this thread's sandbox.
    history = list(graph.get_state_history(cfg))
    recs = [record_of(saver.get_tuple(s.config)) for s in history]
    assert all(r is not None and r["sandbox"] == sid and r["thread"] == "agent-1" for r in recs), recs

    def after(n: int) -> Any:  # the checkpoint where the model is about to be asked after n edits
        return next(s for s in history if s.next == ("agent",)
                    and sum(isinstance(m, ToolMessage) for m in s.values["messages"]) == n)

    # Time travel to the checkpoint after edit 2: the first value of the run is
    # that checkpoint, and the sandbox's files are those of edit 2 (the
    # crashed edit 4 and edit 3 are gone), whatever crabd's recovery restored.
    seen: list[dict[str, str]] = []
    for i, _ in enumerate(graph.stream(None, after(2).config, stream_mode="values")):
        if i == 0:
            seen.append(sandbox_files(c, sid))
    assert seen == [expected_files(2)]
    assert saver.last_rollback("agent-1")["checkpoint"] == record_of(saver.get_tuple(after(2).config))["checkpoint"]
    assert sandbox_files(c, sid) == expected_files(len(EDITS))
    final = graph.get_state(cfg).values["messages"][-1]
    assert final.content == "all edits done"

    # A fork of the thread at edit 3 gets its own sandbox, forked from the
    # crabd checkpoint recorded there; the two sandboxes diverge.
    history = list(graph.get_state_history(cfg))
    at3 = next(s for s in history if s.next == ("agent",)
               and sum(isinstance(m, ToolMessage) for m in s.values["messages"]) == 3)
    fork_cfg = saver.fork_thread(at3.config, "agent-fork")
    fsid = saver.sandbox_for(fork_cfg)
    forked = c.sandbox(fsid)
    assert fsid != sid and forked["status"] == "running"
    # crabd forked the very checkpoint recorded with the graph checkpoint at edit 3
    assert forked["forked_from"] == record_of(saver.get_tuple(at3.config))["checkpoint"]
    assert forked["lineage"] == c.sandbox(sid)["lineage"]
    assert sandbox_files(c, fsid) == expected_files(3)
    graph.invoke(None, {"configurable": {"thread_id": "agent-fork"}})
    assert sandbox_files(c, fsid) == expected_files(len(EDITS))
    c.exec(fsid, "printf 'fork only\\n' > /work/fork.txt")
    assert "fork.txt" in sandbox_files(c, fsid)
    assert sandbox_files(c, sid) == expected_files(len(EDITS))

    saver.delete_thread("agent-fork")
    saver.delete_thread("agent-1")
    assert {s["id"] for s in c.sandboxes()}.isdisjoint({sid, fsid})
