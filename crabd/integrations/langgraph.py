"""A LangGraph checkpoint saver that keeps chat state and sandbox state together.

    from crabd.client import Client
    from crabd.integrations.langgraph import CrabdCheckpointSaver

    saver = CrabdCheckpointSaver(Client(), image="busybox")   # a sandbox per thread
    graph = builder.compile(checkpointer=saver)
    cfg = {"configurable": {"thread_id": "t1"}}
    # a node finds its thread's sandbox with saver.sandbox_for(config) and runs
    # commands there with Client.exec
    graph.invoke(inputs, cfg)
    old = list(graph.get_state_history(cfg))[3].config
    graph.invoke(None, old)           # time travel: the sandbox's files go back too

What is recorded. Every graph checkpoint is stored by an inner saver (default
`InMemorySaver`; any `BaseCheckpointSaver` works: Sqlite, Postgres, ...), with
one extra metadata key, `"crabd": {"thread", "sandbox", "checkpoint"}`: the
thread that recorded it, its sandbox, and the crabd checkpoint holding the
sandbox's files (and processes) at the moment the graph state was saved. The
record lives with the graph checkpoint, so it is as durable as the inner saver.
A put takes a manual crabd checkpoint unless the sandbox's head is the one
recorded last (nothing ran since), so a graph step without commands costs
one GET. With LangGraph's default durability="async" a checkpoint's put may
run after the next step's nodes started, so a node that touches the sandbox
gets its id from `saver.sandbox_for(config)` first: that pins the sandbox's
state for the step's starting checkpoint before the node runs anything, and
the put uses the pin (whichever asks first records; the other reuses it).

What happens on a read. The first read of a run (LangGraph's Pregel loop reads
once when `invoke`/`stream` starts; the `__pregel_runtime` object in the
config tells a run's reads from `get_state`) decides the sandbox's state:
- the checkpoint was recorded by this thread: its sandbox is rolled back to
  the recorded crabd checkpoint, unless that checkpoint is already its head
  (a resume after a crash mid-step rolls back the half-done step's files);
- the checkpoint was recorded by another thread (a thread copied with the
  inner saver's `copy_thread`, or `fork_thread`): the recorded crabd
  checkpoint is forked (crabd's fork API) into a new sandbox for this thread,
  so the two threads never share a sandbox.
Later reads of the same run (LangGraph's "superseded" check, subgraphs) change
nothing. A put whose parent is not the checkpoint the sandbox is at
(`update_state` on an old checkpoint: a branch in time) first moves the
sandbox to the parent's recorded state, then records.

Limits: one run per thread at a time (as LangGraph assumes); changes made in
the sandbox without crabd seeing a turn (a background process writing after
the last checkpoint) are only undone if a command ran since; a superstep with
parallel nodes where one fails keeps the writes of the ones that succeeded but
the resume rolls back their files too; crabd's retention (keep-last-N) may drop
an old recorded checkpoint, and time travel to it then fails with the fix.
"""

from __future__ import annotations

import builtins
import asyncio
import copy
import logging
import threading
from collections.abc import AsyncIterator, Collection, Generator, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
)
from langgraph.checkpoint.memory import InMemorySaver

from ..client import AsyncClient, Client
from ..errors import FailedPrecondition, NotFound

__all__ = ["CrabdCheckpointSaver", "META_KEY", "record_of"]

log = logging.getLogger("crabd.integrations.langgraph")

META_KEY = "crabd"
# LangGraph's Pregel loop puts its Runtime object into the config of the reads
# it makes for a run (one object per run); get_state()/get_state_history() and
# update_state() reads do not carry it.
_RUNTIME_KEY = "__pregel_runtime"

_MAX_PINS = 4096  # pins kept (the oldest go first); one per graph checkpoint

T = TypeVar("T")
# A step of the saver's logic asks for one call: ("crabd", method, args, kwargs)
# on the crabd client, ("inner", method, args, kwargs) on the inner saver
# (sync name; the async driver calls the `a`-prefixed twin), or ("lock"|"unlock",
# sandbox, (), {}) on a per-sandbox lock. The same logic thus runs under the
# sync and the async API.
_Call = tuple[str, str, tuple[Any, ...], dict[str, Any]]
_Logic = Generator[_Call, Any, T]


def record_of(tup: CheckpointTuple | None) -> dict[str, str] | None:
    """The crabd record stored with a graph checkpoint, or None."""
    if tup is None:
        return None
    rec = (tup.metadata or {}).get(META_KEY)
    if isinstance(rec, Mapping) and all(isinstance(rec.get(k), str) for k in ("thread", "sandbox", "checkpoint")):
        return dict(rec)
    return None


def _crabd(method: str, *args: Any, **kw: Any) -> _Call:
    return ("crabd", method, args, kw)


def _inner(method: str, *args: Any, **kw: Any) -> _Call:
    return ("inner", method, args, kw)


def _conf(config: RunnableConfig) -> dict[str, Any]:
    return dict(config.get("configurable") or {})


class CrabdCheckpointSaver(BaseCheckpointSaver[Any]):
    """A `BaseCheckpointSaver` that records the sandbox's crabd checkpoint with
    every graph checkpoint and moves the sandbox back (or forks it) when a run
    resumes from one. See the module docstring for the rules.

    client: crabd's sync client (default `Client()`: $CRABD_SOCKET);
    aclient: optional `AsyncClient` for the async API (otherwise the sync
    client runs in a worker thread); inner: the saver of the graph state
    (default `InMemorySaver()`); image: when set, a thread with no sandbox gets
    a new one of this image at its first put (`bind()` gives one explicitly).
    """

    def __init__(self, client: Client | None = None, *, aclient: AsyncClient | None = None,
                 inner: BaseCheckpointSaver[Any] | None = None, image: str | None = None) -> None:
        self.inner: BaseCheckpointSaver[Any] = inner if inner is not None else InMemorySaver()
        super().__init__(serde=self.inner.serde)
        self.client = client if client is not None else Client(aclient.socket if aclient is not None else None)
        self.aclient = aclient
        self.image = image
        self._sandbox: dict[str, str] = {}       # thread -> its sandbox
        self._owned: dict[str, list[str]] = {}   # thread -> sandboxes this saver made for it
        self._recorded: dict[str, str] = {}      # sandbox -> crabd checkpoint it was last recorded/rolled to
        self._at: dict[str, str | None] = {}     # thread -> graph checkpoint (root ns) its sandbox is at
        self._run: dict[str, Any] = {}           # thread -> Runtime of the run whose first read synced it
        self._forks: dict[tuple[str, str], str] = {}  # (thread, foreign crabd checkpoint) -> forked sandbox
        self._fork_base: dict[str, str] = {}     # forked sandbox -> its initial checkpoint
        # (thread, ns, graph checkpoint) -> (sandbox, crabd checkpoint) pinned for it
        self._pins: dict[tuple[str, str, str], tuple[str, str]] = {}
        self._locks: dict[str, threading.Lock] = {}  # sandbox -> lock around recording it
        self._rollbacks: dict[str, dict[str, Any]] = {}  # thread -> crabd's reply to its last rollback

    # --- public helpers ------------------------------------------------------------------
    def bind(self, thread_id: str, sandbox_id: str) -> None:
        """Use an existing sandbox for a thread (before its first put)."""
        self._sandbox[str(thread_id)] = sandbox_id

    def sandbox_for(self, config: RunnableConfig) -> str:
        """The sandbox of the config's thread (made from `image` when it has none).

        Called from a node with the node's config, it also pins the sandbox's
        state for the graph checkpoint the node's step starts from, before the
        node runs any command: with LangGraph's default durability="async" that
        checkpoint's put may run after the next step's commands."""
        return self._drive(self._l_sandbox_for(config))

    async def asandbox_for(self, config: RunnableConfig) -> str:
        return await self._adrive(self._l_sandbox_for(config))

    def last_rollback(self, thread_id: str) -> dict[str, Any] | None:
        """crabd's reply to the last rollback this saver made for the thread
        (checkpoint, branch, `effects_not_undone`: external effects after the
        checkpoint that a file-system rollback cannot take back), or None."""
        return self._rollbacks.get(str(thread_id))

    def fork_thread(self, config: RunnableConfig, thread_id: str) -> RunnableConfig:
        """Start thread `thread_id` from the graph checkpoint `config` names
        (latest of its thread when it has no checkpoint_id), with a fork of the
        sandbox at the crabd checkpoint recorded with it. Returns the config of
        the new thread's checkpoint."""
        return self._drive(self._l_fork_thread(config, str(thread_id)))

    async def afork_thread(self, config: RunnableConfig, thread_id: str) -> RunnableConfig:
        return await self._adrive(self._l_fork_thread(config, str(thread_id)))

    # --- BaseCheckpointSaver ---------------------------------------------------------------
    @property
    def config_specs(self) -> list:  # type: ignore[override]
        return self.inner.config_specs

    def get_next_version(self, current: Any, channel: None) -> Any:
        return self.inner.get_next_version(current, channel)

    def with_allowlist(self, extra_allowlist: Collection[tuple[str, ...]]) -> CrabdCheckpointSaver:
        # compile() widens the msgpack allowlist with the graph's state types; the
        # inner saver is the one that deserializes. The clone shares this one's
        # bindings and pins (shallow copy), so saver.sandbox_for() keeps working.
        inner = self.inner.with_allowlist(extra_allowlist)
        if inner is self.inner:
            return self
        clone = copy.copy(self)
        clone.inner = inner
        clone.serde = inner.serde
        return clone

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._drive(self._l_get(config))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self._adrive(self._l_get(config))

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None, limit: int | None = None) -> Iterator[CheckpointTuple]:
        return self.inner.list(config, filter=filter, before=before, limit=limit)

    async def alist(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
                    before: RunnableConfig | None = None, limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        async for tup in self.inner.alist(config, filter=filter, before=before, limit=limit):
            yield tup

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        return self._drive(self._l_put(config, checkpoint, metadata, new_versions))

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
                   new_versions: ChannelVersions) -> RunnableConfig:
        return await self._adrive(self._l_put(config, checkpoint, metadata, new_versions))

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                   task_path: str = "") -> None:
        self.inner.put_writes(config, writes, task_id, task_path)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str,
                          task_path: str = "") -> None:
        await self.inner.aput_writes(config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        """Delete the thread's graph checkpoints and the sandboxes this saver
        made for it (a sandbox given with `bind()` is left alone)."""
        self.inner.delete_thread(thread_id)
        for sid in self._forget(str(thread_id)):
            try:
                self.client.delete_sandbox(sid)
            except NotFound:
                pass

    async def adelete_thread(self, thread_id: str) -> None:
        await self.inner.adelete_thread(thread_id)
        for sid in self._forget(str(thread_id)):
            try:
                if self.aclient is not None:
                    await self.aclient.delete_sandbox(sid)
                else:
                    await asyncio.to_thread(self.client.delete_sandbox, sid)
            except NotFound:
                pass

    def get_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]) -> Any:
        # The inner saver's walk: its reads must not count as a run's first read.
        return self.inner.get_delta_channel_history(config=config, channels=channels)

    async def aget_delta_channel_history(self, *, config: RunnableConfig, channels: Sequence[str]) -> Any:
        return await self.inner.aget_delta_channel_history(config=config, channels=channels)

    # --- the logic (generators of calls; see _drive/_adrive) ------------------------------------
    def _l_sandbox(self, thread: str, create: bool) -> _Logic[str]:
        sid = self._sandbox.get(thread)
        if sid is not None:
            return sid
        # Not known in this process (a restart): the thread's latest checkpoint says.
        tup = yield _inner("get_tuple", {"configurable": {"thread_id": thread, "checkpoint_ns": ""}})
        rec = record_of(tup)
        if rec is not None and rec["thread"] == thread:
            self._sandbox[thread] = rec["sandbox"]
            return rec["sandbox"]
        if rec is not None:  # a copied thread's first use: fork, never share
            yield from self._l_sync(thread, tup)
            return self._sandbox[thread]
        if not create or self.image is None:
            raise FailedPrecondition(
                f"LangGraph thread {thread!r} has no crabd sandbox",
                fix="give it one with saver.bind(thread_id, sandbox_id), or construct the saver with "
                    "image='<image>' to create one per thread")
        sb = yield _crabd("create_sandbox", self.image)
        # A put and a node of the first step may ask at once: one sandbox wins.
        sid = self._sandbox.setdefault(thread, sb["id"])
        if sid != sb["id"]:
            yield _crabd("delete_sandbox", sb["id"])
        else:
            self._owned.setdefault(thread, []).append(sid)
        return sid

    def _l_sandbox_for(self, config: RunnableConfig) -> _Logic[str]:
        c = _conf(config)
        thread = str(c["thread_id"])
        sid = yield from self._l_sandbox(thread, create=True)
        for ns, graph_ck in (c.get("checkpoint_map") or {}).items():
            yield from self._l_pin(thread, ns, graph_ck)
        return sid

    def _l_pin(self, thread: str, ns: str, graph_ck: str) -> _Logic[tuple[str, str]]:
        """The sandbox state recorded for a graph checkpoint: the first to ask
        (its put, or a node of the step after it, whichever runs first) records
        it; a node runs commands only after its own ask returned, so the first
        record predates them all."""
        key = (thread, ns, graph_ck)
        pin = self._pins.get(key)
        if pin is not None:
            return pin
        sid = yield from self._l_sandbox(thread, create=True)
        # One record at a time per sandbox: the put and the node's ask then
        # share one crabd checkpoint instead of taking two.
        yield ("lock", sid, (), {})
        try:
            pin = self._pins.get(key)
            if pin is None:
                cid = yield from self._l_record(sid)
                pin = self._pins.setdefault(key, (sid, cid))
                while len(self._pins) > _MAX_PINS:
                    del self._pins[next(iter(self._pins))]
        finally:
            yield ("unlock", sid, (), {})
        return pin

    def _l_record(self, sid: str) -> _Logic[str]:
        """The crabd checkpoint that holds the sandbox's state now."""
        sb = yield _crabd("sandbox", sid)
        head = sb.get("head")
        if head is not None and self._recorded.get(sid) == head:
            return head  # nothing ran since the last record
        ck = yield _crabd("create_checkpoint", sid)
        if ck.get("state") != "committed":
            raise FailedPrecondition(
                f"crabd checkpoint {ck.get('id')} of sandbox {sid} is {ck.get('state')}: {ck.get('error')}",
                fix=f"see `crabd events --sandbox {sid}`; the graph checkpoint was not saved")
        self._recorded[sid] = ck["id"]
        return ck["id"]

    def _l_sync(self, thread: str, tup: CheckpointTuple) -> _Logic[None]:
        """Put the thread's sandbox in the state recorded with `tup`."""
        rec = record_of(tup)
        if rec is None:
            return  # saved without a sandbox record: nothing to go back to
        if rec["thread"] == thread:
            sid, target = rec["sandbox"], rec["checkpoint"]
        else:
            # Recorded by another thread (a copy or a fork of it): never share its
            # sandbox; fork the recorded checkpoint, once per (thread, checkpoint).
            key = (thread, rec["checkpoint"])
            sid = self._forks.get(key, "")
            if not sid:
                try:
                    out = yield _crabd("fork", rec["checkpoint"])
                except NotFound as e:
                    raise self._gone(thread, tup, rec) from e
                sid = out["sandboxes"][0]
                sb = yield _crabd("sandbox", sid)
                self._forks[key] = sid
                self._fork_base[sid] = sb["head"]
                self._owned.setdefault(thread, []).append(sid)
            target = self._fork_base[sid]
        self._sandbox[thread] = sid
        sb = yield _crabd("sandbox", sid)
        if sb.get("head") != target or sb.get("status") not in ("running", "paused"):  # paused: a capture
            try:
                out = yield _crabd("rollback", sid, target)
            except NotFound as e:
                raise self._gone(thread, tup, rec) from e
            self._rollbacks[thread] = out
            if out and out.get("effects_not_undone"):
                log.warning("thread %s: sandbox %s rolled back to %s; external effects after it were not "
                            "undone: %s", thread, sid, target, out["effects_not_undone"])
        self._recorded[sid] = target

    @staticmethod
    def _gone(thread: str, tup: CheckpointTuple, rec: dict[str, str]) -> FailedPrecondition:
        return FailedPrecondition(
            f"graph checkpoint {tup.checkpoint['id']} of thread {thread!r} recorded crabd checkpoint "
            f"{rec['checkpoint']} of sandbox {rec['sandbox']}, which no longer exists",
            fix="crabd's retention dropped it or the sandbox was destroyed: raise [retention] keep_last, "
                "or resume from a newer graph checkpoint")

    def _l_get(self, config: RunnableConfig) -> _Logic[CheckpointTuple | None]:
        tup = yield _inner("get_tuple", config)
        c = _conf(config)
        runtime = c.get(_RUNTIME_KEY)
        if runtime is None or c.get("checkpoint_ns", "") != "":
            return tup  # not a run's read of the root graph
        thread = str(c["thread_id"])
        if self._run.get(thread) is runtime:
            return tup  # not the first read of this run
        self._run[thread] = runtime
        if tup is not None:
            yield from self._l_sync(thread, tup)
        self._at[thread] = tup.checkpoint["id"] if tup is not None else None
        return tup

    def _l_put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
               new_versions: ChannelVersions) -> _Logic[RunnableConfig]:
        c = _conf(config)
        thread, ns, parent = str(c["thread_id"]), c.get("checkpoint_ns", ""), c.get("checkpoint_id")
        if ns == "" and parent is not None and (thread not in self._at or self._at[thread] != parent):
            # A branch from a checkpoint the sandbox is not at (update_state on an
            # old checkpoint, or a put after a restart): the files follow the parent.
            ptup = yield _inner("get_tuple", config)
            if ptup is not None:
                yield from self._l_sync(thread, ptup)
        sid, cid = yield from self._l_pin(thread, ns, checkpoint["id"])
        md = {**metadata, META_KEY: {"thread": thread, "sandbox": sid, "checkpoint": cid}}
        out = yield _inner("put", config, checkpoint, md, new_versions)
        if ns == "":
            self._at[thread] = checkpoint["id"]
        return out

    def _l_fork_thread(self, config: RunnableConfig, thread: str) -> _Logic[RunnableConfig]:
        src = _conf(config)
        if str(src["thread_id"]) == thread:
            raise FailedPrecondition(f"fork_thread: thread {thread!r} is the source thread",
                                     fix="give the fork a new thread_id")
        tup = yield _inner("get_tuple", {"configurable": {**src, "checkpoint_ns": src.get("checkpoint_ns", "")}})
        if tup is None:
            raise NotFound(f"no graph checkpoint for {src}")
        if record_of(tup) is None:
            raise FailedPrecondition(f"graph checkpoint {tup.checkpoint['id']} has no crabd record to fork",
                                     fix="fork a checkpoint saved by CrabdCheckpointSaver")
        yield from self._l_sync(thread, tup)  # recorded by another thread: forks the sandbox
        sid = self._sandbox[thread]
        md = {**tup.metadata, "source": "fork",
              META_KEY: {"thread": thread, "sandbox": sid, "checkpoint": self._recorded[sid]}}
        target: RunnableConfig = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
        # The source's pending writes are not copied: the tasks that made them
        # ran after the recorded sandbox state, so the fork runs them again.
        out = yield _inner("put", target, tup.checkpoint, md, dict(tup.checkpoint["channel_versions"]))
        self._at[thread] = tup.checkpoint["id"]
        return out

    def _forget(self, thread: str) -> builtins.list[str]:
        owned = self._owned.pop(thread, [])
        for m in (self._sandbox, self._at, self._run, self._rollbacks):
            m.pop(thread, None)
        for key in [k for k in self._forks if k[0] == thread]:
            del self._forks[key]
        for pin in [k for k in self._pins if k[0] == thread]:
            del self._pins[pin]
        for sid in owned:
            self._recorded.pop(sid, None)
            self._fork_base.pop(sid, None)
        return owned

    # --- drivers ----------------------------------------------------------------------------
    def _drive(self, logic: _Logic[T]) -> T:
        try:
            call = next(logic)
            while True:
                kind, method, args, kw = call
                result: Any
                try:
                    if kind == "lock":
                        result = self._locks.setdefault(method, threading.Lock()).acquire()
                    elif kind == "unlock":
                        self._locks[method].release()
                        result = None
                    else:
                        result = getattr(self.client if kind == "crabd" else self.inner, method)(*args, **kw)
                except BaseException as e:  # cancellation too: the logic releases its lock
                    call = logic.throw(e)
                    continue
                call = logic.send(result)
        except StopIteration as stop:
            return stop.value

    async def _adrive(self, logic: _Logic[T]) -> T:
        try:
            call = next(logic)
            while True:
                kind, method, args, kw = call
                result: Any
                try:
                    if kind == "lock":  # a thread lock (sync callers share it), polled: cancellable
                        lock = self._locks.setdefault(method, threading.Lock())
                        while not lock.acquire(blocking=False):
                            await asyncio.sleep(0.005)
                        result = True
                    elif kind == "unlock":
                        self._locks[method].release()
                        result = None
                    elif kind == "inner":
                        result = await getattr(self.inner, "a" + method)(*args, **kw)
                    elif self.aclient is not None:
                        result = await getattr(self.aclient, method)(*args, **kw)
                    else:
                        result = await asyncio.to_thread(getattr(self.client, method), *args, **kw)
                except BaseException as e:  # cancellation too: the logic releases its lock
                    call = logic.throw(e)
                    continue
                call = logic.send(result)
        except StopIteration as stop:
            return stop.value
