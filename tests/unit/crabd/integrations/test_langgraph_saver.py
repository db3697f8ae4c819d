"""CrabdCheckpointSaver against LangGraph's own conformance suite and the
rules that keep chat and sandbox state together, with an in-process fake of
crabd's client (no daemon, no root). The real daemon: tests/integration/crabd/integrations/test_langgraph.py."""

from __future__ import annotations

import asyncio
import itertools
import operator
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph

from crabd.errors import FailedPrecondition, NotFound
from crabd.integrations.langgraph import META_KEY, CrabdCheckpointSaver, record_of


class FakeCrabd:
    """The slice of crabd.client.Client the saver uses, in memory: a sandbox is
    a dict of files; a checkpoint is a copy of it; `write` is a turn."""

    def __init__(self) -> None:
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self._ids = itertools.count(1)

    def _new(self, files: dict[str, str]) -> str:
        sid = f"sb{next(self._ids)}"
        self.sandboxes[sid] = {"files": dict(files), "head": None, "seq": 0}
        self._ck(sid)
        return sid

    def _ck(self, sid: str) -> str:
        sb = self.sandboxes[sid]
        cid = f"{sid}-{sb['seq']}"
        sb["seq"] += 1
        self.checkpoints[cid] = {"sandbox": sid, "files": dict(sb["files"])}
        sb["head"] = cid
        return cid

    def _get(self, sid: str) -> dict[str, Any]:
        if sid not in self.sandboxes:
            raise NotFound(f"no sandbox {sid!r}")
        return self.sandboxes[sid]

    def write(self, sid: str, path: str, data: str) -> str:
        self._get(sid)["files"][path] = data
        return self._ck(sid)

    def files(self, sid: str) -> dict[str, str]:
        return dict(self._get(sid)["files"])

    # the Client methods
    def create_sandbox(self, image: str, name: str | None = None, limits: Any = None) -> dict[str, Any]:
        self.calls.append("create_sandbox")
        return {"id": self._new({})}

    def sandbox(self, sid: str) -> dict[str, Any]:
        self.calls.append("sandbox")
        sb = self._get(sid)
        return {"id": sid, "head": sb["head"], "status": "running"}

    def delete_sandbox(self, sid: str) -> None:
        self.calls.append("delete_sandbox")
        self._get(sid)
        del self.sandboxes[sid]

    def create_checkpoint(self, sid: str) -> dict[str, Any]:
        self.calls.append("create_checkpoint")
        self._get(sid)
        return {"id": self._ck(sid), "state": "committed"}

    def rollback(self, sid: str, checkpoint: str) -> dict[str, Any]:
        self.calls.append("rollback")
        sb = self._get(sid)
        ck = self.checkpoints.get(checkpoint)
        if ck is None:
            raise NotFound(f"no checkpoint {checkpoint!r}")
        if ck["sandbox"] != sid:
            raise FailedPrecondition(f"checkpoint {checkpoint} belongs to {ck['sandbox']}")
        sb["files"], sb["head"] = dict(ck["files"]), checkpoint
        return {"sandbox": sid, "checkpoint": checkpoint, "effects_not_undone": []}

    def fork(self, cid: str, count: int = 1) -> dict[str, Any]:
        self.calls.append("fork")
        if cid not in self.checkpoints:
            raise NotFound(f"no checkpoint {cid!r}")
        return {"checkpoint": cid, "sandboxes": [self._new(self.checkpoints[cid]["files"])]}


class FakeAsyncCrabd:
    def __init__(self, fake: FakeCrabd) -> None:
        self.fake = fake

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.fake, name)

        async def call(*a: Any, **kw: Any) -> Any:
            return fn(*a, **kw)
        return call


def _report(saver_factory: Any) -> Any:
    report = asyncio.run(validate(saver_factory, progress=ProgressCallbacks.verbose()))
    report.print_report()
    assert report.passed_all_base(), report.results
    for cap in ("put", "put_writes", "get_tuple", "list", "delete_thread"):
        res = report.results[cap]
        assert res.tests_passed > 0 and res.tests_failed == 0, (cap, res.failures)
    return report


def test_conformance_sync_client_in_a_thread() -> None:
    fake = FakeCrabd()

    @checkpointer_test(name="CrabdCheckpointSaver(fake crabd)")
    async def factory() -> Any:
        yield CrabdCheckpointSaver(fake, inner=InMemorySaver(), image="busybox")

    _report(factory)
    # every put recorded a sandbox state; the suite's threads got sandboxes
    assert fake.calls.count("create_sandbox") > 10 and fake.calls.count("create_checkpoint") > 10


def test_conformance_async_client() -> None:
    fake = FakeCrabd()

    @checkpointer_test(name="CrabdCheckpointSaver(fake async crabd)")
    async def factory() -> Any:
        yield CrabdCheckpointSaver(fake, aclient=FakeAsyncCrabd(fake), image="busybox")  # type: ignore[arg-type]

    _report(factory)
    assert "create_checkpoint" in fake.calls


# -- a graph whose nodes write files into the thread's sandbox ----------------------------------
class State(TypedDict):
    log: Annotated[list[str], operator.add]
    n: int


def _graph(saver: CrabdCheckpointSaver, fake: FakeCrabd, steps: int, fail_at: int | None = None) -> Any:
    def step(state: State, config: RunnableConfig) -> dict[str, Any]:
        n = state["n"] + 1
        sid = saver.sandbox_for(config)
        fake.write(sid, f"/work/f{n}", f"step {n}")
        if n == fail_at:
            raise RuntimeError(f"crash in step {n}")
        return {"log": [f"step {n}"], "n": n}

    g = StateGraph(State)
    g.add_node("step", step)
    g.add_edge(START, "step")
    g.add_conditional_edges("step", lambda s: END if s["n"] >= steps else "step")
    return g.compile(checkpointer=saver)


def _files_at(n: int) -> dict[str, str]:
    return {f"/work/f{i}": f"step {i}" for i in range(1, n + 1)}


def test_run_records_each_checkpoint_and_time_travel_rolls_back() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    graph = _graph(saver, fake, steps=4)
    cfg = {"configurable": {"thread_id": "t1"}}
    assert graph.invoke({"log": [], "n": 0}, cfg)["n"] == 4
    sid = saver.sandbox_for(cfg)
    hist = list(graph.get_state_history(cfg))
    for snap in hist:
        rec = record_of(saver.get_tuple(snap.config))
        assert rec is not None and rec["sandbox"] == sid and rec["thread"] == "t1"
        # the recorded crabd checkpoint holds exactly the files of that step
        assert fake.checkpoints[rec["checkpoint"]]["files"] == _files_at(snap.values.get("n", 0))
    assert fake.calls.count("rollback") == 0
    # get_state / get_state_history never move the sandbox
    assert fake.files(sid) == _files_at(4)
    # time travel to the checkpoint after step 2: the files go back, then the run goes on
    at2 = next(s for s in hist if s.values.get("n") == 2 and s.next == ("step",))
    fake.calls.clear()
    out = graph.invoke(None, at2.config)
    assert fake.calls.count("rollback") == 1, fake.calls  # the superseded-check read did not roll back again
    assert saver.last_rollback("t1")["checkpoint"] == record_of(saver.get_tuple(at2.config))["checkpoint"]
    assert out["n"] == 4 and fake.files(sid) == _files_at(4)
    assert out["log"] == [f"step {i}" for i in range(1, 5)]


def test_resume_after_crash_rolls_back_the_half_done_step() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    cfg = {"configurable": {"thread_id": "t"}}
    with pytest.raises(RuntimeError, match="crash in step 3"):
        _graph(saver, fake, steps=5, fail_at=3).invoke({"log": [], "n": 0}, cfg)
    sid = saver.sandbox_for(cfg)
    assert "/work/f3" in fake.files(sid)  # the failed step's write is in the sandbox
    seen: list[dict[str, str]] = []
    graph = _graph(saver, fake, steps=5)
    first = graph.get_state(cfg)
    assert first.values["n"] == 2
    for _ in graph.stream(None, cfg, stream_mode="values"):
        seen.append(fake.files(sid))
    # the first value streamed is the resumed checkpoint: the half-done step is gone
    assert seen[0] == _files_at(2)
    assert fake.files(sid) == _files_at(5)


def test_update_state_on_an_old_checkpoint_moves_the_files_to_it() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    graph = _graph(saver, fake, steps=3)
    cfg = {"configurable": {"thread_id": "t"}}
    graph.invoke({"log": [], "n": 0}, cfg)
    sid = saver.sandbox_for(cfg)
    at1 = next(s for s in graph.get_state_history(cfg) if s.values.get("n") == 1)
    new_cfg = graph.update_state(at1.config, {"log": ["edited"]})
    assert fake.files(sid) == _files_at(1)
    rec = record_of(saver.get_tuple(new_cfg))
    assert rec is not None and fake.checkpoints[rec["checkpoint"]]["files"] == _files_at(1)


def test_fork_thread_gets_a_forked_sandbox() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    graph = _graph(saver, fake, steps=3)
    a = {"configurable": {"thread_id": "a"}}
    graph.invoke({"log": [], "n": 0}, a)
    sa = saver.sandbox_for(a)
    at2 = next(s for s in graph.get_state_history(a) if s.values.get("n") == 2 and s.next)
    b = saver.fork_thread(at2.config, "b")
    sb = saver.sandbox_for(b)
    assert sb != sa and fake.files(sb) == _files_at(2)
    assert graph.get_state({"configurable": {"thread_id": "b"}}).values["n"] == 2
    graph.invoke(None, {"configurable": {"thread_id": "b"}})
    assert fake.files(sb) == _files_at(3) and fake.files(sa) == _files_at(3)
    fake.write(sb, "/work/only-b", "x")
    assert "/work/only-b" not in fake.files(sa)
    # deleting the fork's thread deletes the sandbox made for it, not the source's
    saver.delete_thread("b")
    assert sb not in fake.sandboxes and sa in fake.sandboxes


def test_copied_thread_forks_on_first_use() -> None:
    fake = FakeCrabd()
    inner = InMemorySaver()
    saver = CrabdCheckpointSaver(fake, inner=inner, image="busybox")
    graph = _graph(saver, fake, steps=2)
    graph.invoke({"log": [], "n": 0}, {"configurable": {"thread_id": "a"}})
    sa = saver.sandbox_for({"configurable": {"thread_id": "a"}})
    # copy the graph state only, as the inner saver does it (records still name thread a)
    for tup in reversed(list(inner.list({"configurable": {"thread_id": "a"}}))):
        cfg = {"configurable": {"thread_id": "c", "checkpoint_ns": "",
                                "checkpoint_id": tup.parent_config["configurable"]["checkpoint_id"]
                                if tup.parent_config else None}}
        if cfg["configurable"]["checkpoint_id"] is None:
            del cfg["configurable"]["checkpoint_id"]
        inner.put(cfg, tup.checkpoint, tup.metadata, tup.checkpoint["channel_versions"])
    sc = saver.sandbox_for({"configurable": {"thread_id": "c"}})
    assert sc != sa and fake.files(sc) == _files_at(2)


def test_unbound_thread_without_image_is_refused_with_the_fix() -> None:
    saver = CrabdCheckpointSaver(FakeCrabd())
    with pytest.raises(FailedPrecondition) as ei:
        saver.sandbox_for({"configurable": {"thread_id": "x"}})
    assert "bind" in (ei.value.fix or "")


def test_bound_sandbox_is_used_and_kept_on_delete() -> None:
    fake = FakeCrabd()
    sid = fake.create_sandbox("busybox")["id"]
    saver = CrabdCheckpointSaver(fake)
    saver.bind("t", sid)
    graph = _graph(saver, fake, steps=1)
    graph.invoke({"log": [], "n": 0}, {"configurable": {"thread_id": "t"}})
    tup = saver.get_tuple({"configurable": {"thread_id": "t"}})
    assert tup is not None and tup.metadata[META_KEY]["sandbox"] == sid
    saver.delete_thread("t")
    assert sid in fake.sandboxes


def test_dropped_crabd_checkpoint_fails_with_the_fix() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    graph = _graph(saver, fake, steps=2)
    cfg = {"configurable": {"thread_id": "t"}}
    graph.invoke({"log": [], "n": 0}, cfg)
    at1 = next(s for s in graph.get_state_history(cfg) if s.values.get("n") == 1)
    del fake.checkpoints[record_of(saver.get_tuple(at1.config))["checkpoint"]]  # retention dropped it
    with pytest.raises(FailedPrecondition, match="no longer exists") as ei:
        graph.invoke(None, at1.config)
    assert "keep_last" in (ei.value.fix or "")


def test_async_graph_time_travel() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, aclient=FakeAsyncCrabd(fake), image="busybox")  # type: ignore[arg-type]
    graph = _graph(saver, fake, steps=3)
    cfg = {"configurable": {"thread_id": "t"}}

    async def run() -> None:
        await graph.ainvoke({"log": [], "n": 0}, cfg)
        sid = await saver.asandbox_for(cfg)
        at1 = [s async for s in graph.aget_state_history(cfg) if s.values.get("n") == 1][0]
        fake.calls.clear()
        seen = [fake.files(sid) async for _ in _aiter_first(graph.astream(None, at1.config, stream_mode="values"))]
        assert seen == [_files_at(1)] and fake.calls.count("rollback") == 1

    asyncio.run(run())


async def _aiter_first(agen: Any) -> Any:
    async for item in agen:
        yield item
        break


def test_with_allowlist_widens_the_inner_saver_and_shares_state() -> None:
    fake = FakeCrabd()
    strict = InMemorySaver(serde=JsonPlusSerializer(allowed_msgpack_modules=None))
    saver = CrabdCheckpointSaver(fake, inner=strict, image="busybox")
    sid = saver.sandbox_for({"configurable": {"thread_id": "t"}})
    clone = saver.with_allowlist([("my.module", "MyType")])
    assert clone is not saver and clone.inner is not saver.inner and clone.serde is clone.inner.serde
    assert clone.sandbox_for({"configurable": {"thread_id": "t"}}) == sid


def test_put_and_a_nodes_ask_share_one_crabd_checkpoint_and_errors_release_the_lock() -> None:
    import threading
    import time

    from langgraph.checkpoint.base import empty_checkpoint

    class Slow(FakeCrabd):
        fail = False

        def create_checkpoint(self, sid: str) -> dict[str, Any]:
            time.sleep(0.05)  # both callers are inside the record at once without the lock
            if self.fail:
                self.fail = False
                raise FailedPrecondition("capture failed")
            return super().create_checkpoint(sid)

    fake = Slow()
    saver = CrabdCheckpointSaver(fake, image="busybox")
    cfg = {"configurable": {"thread_id": "t", "checkpoint_ns": ""}}
    saver.sandbox_for(cfg)
    fake.write(saver.sandbox_for(cfg), "/f", "1")  # the head moved: the next record takes a checkpoint
    ck = empty_checkpoint()
    node_cfg = {"configurable": {"thread_id": "t", "checkpoint_map": {"": ck["id"]}}}
    fake.calls.clear()
    threads = [threading.Thread(target=saver.put, args=(cfg, ck, {"source": "loop", "step": 0}, {})),
               threading.Thread(target=saver.sandbox_for, args=(node_cfg,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert fake.calls.count("create_checkpoint") == 1
    # a failed record raises and leaves the sandbox usable
    fake.fail = True
    fake.write(saver.sandbox_for(cfg), "/f", "2")
    with pytest.raises(FailedPrecondition, match="capture failed"):
        saver.put(cfg, empty_checkpoint(), {"source": "loop", "step": 1}, {})
    saver.put(cfg, empty_checkpoint(), {"source": "loop", "step": 1}, {})


def test_a_new_saver_on_the_same_inner_store_finds_the_sandbox_and_resumes() -> None:
    # a process restart: the bindings are gone, the records are in the inner saver
    fake, inner = FakeCrabd(), InMemorySaver()
    cfg = {"configurable": {"thread_id": "t"}}
    first = CrabdCheckpointSaver(fake, inner=inner, image="busybox")
    with pytest.raises(RuntimeError):
        _graph(first, fake, steps=3, fail_at=2).invoke({"log": [], "n": 0}, cfg)
    sid = first.sandbox_for(cfg)
    assert fake.files(sid) == _files_at(2)  # the crashed step's write
    second = CrabdCheckpointSaver(fake, inner=inner)  # no image: it must find the sandbox
    fake.calls.clear()
    out = _graph(second, fake, steps=3).invoke(None, cfg)
    assert out["n"] == 3 and second.sandbox_for(cfg) == sid and len(fake.sandboxes) == 1
    assert fake.calls.count("rollback") == 1  # the half-done step 2 was undone first
    assert fake.files(sid) == _files_at(3)


def test_resuming_an_interrupt_rolls_nothing_back() -> None:
    from langgraph.types import Command, interrupt

    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")

    def work(state: State, config: RunnableConfig) -> dict[str, Any]:
        fake.write(saver.sandbox_for(config), "/work/f1", "step 1")
        return {"n": 1, "log": ["step 1"]}

    def ask(state: State) -> dict[str, Any]:
        return {"log": [interrupt("ok?")]}

    g = StateGraph(State)
    g.add_node("work", work)
    g.add_node("ask", ask)
    g.add_edge(START, "work")
    g.add_edge("work", "ask")
    g.add_edge("ask", END)
    graph = g.compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "t"}}
    graph.invoke({"log": [], "n": 0}, cfg)
    assert graph.get_state(cfg).next == ("ask",)
    out = graph.invoke(Command(resume="yes"), cfg)
    assert out["log"] == ["step 1", "yes"] and "rollback" not in fake.calls
    assert fake.files(saver.sandbox_for(cfg)) == _files_at(1)


def test_a_subgraph_writing_files_records_and_time_travels_with_its_parent() -> None:
    fake = FakeCrabd()
    saver = CrabdCheckpointSaver(fake, image="busybox")

    def write(state: State, config: RunnableConfig) -> dict[str, Any]:
        n = state["n"] + 1
        fake.write(saver.sandbox_for(config), f"/work/f{n}", f"step {n}")
        return {"n": n, "log": [f"step {n}"]}

    sub = StateGraph(State)
    sub.add_node("w1", write)
    sub.add_node("w2", write)
    sub.add_edge(START, "w1")
    sub.add_edge("w1", "w2")
    sub.add_edge("w2", END)
    g = StateGraph(State)
    g.add_node("first", write)
    g.add_node("sub", sub.compile())
    g.add_node("last", write)
    g.add_edge(START, "first")
    g.add_edge("first", "sub")
    g.add_edge("sub", "last")
    g.add_edge("last", END)
    graph = g.compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "t"}}
    assert graph.invoke({"log": [], "n": 0}, cfg)["n"] == 4
    sid = saver.sandbox_for(cfg)
    assert len(fake.sandboxes) == 1 and "rollback" not in fake.calls
    for snap in graph.get_state_history(cfg):
        rec = record_of(saver.get_tuple(snap.config))
        assert rec is not None and fake.checkpoints[rec["checkpoint"]]["files"] == _files_at(snap.values.get("n", 0))
    at1 = next(s for s in graph.get_state_history(cfg) if s.next == ("sub",))
    seen = [fake.files(sid) for _, _ in zip(range(1), graph.stream(None, at1.config, stream_mode="values"))]
    assert seen == [_files_at(1)]
