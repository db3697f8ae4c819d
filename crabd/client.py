"""Python client of crabd's REST API, over the daemon's unix socket.

    from crabd.client import Client
    c = Client()                                  # $CRABD_SOCKET or /run/crabd/crabd.sock
    sb = c.create_sandbox("debian-py")
    r = c.exec(sb["id"], "pytest -q")             # a turn: checkpointed while you wait on the LLM
    c.rollback(sb["id"], r["checkpoint"])         # back to the state after that turn

Errors come back as the same `crabd.errors` classes the daemon raised
(NotFound, FailedPrecondition, InvalidArgument, ExecTimeout, ...).
`AsyncClient` has the same methods, awaitable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence

import httpx

from . import errors as E

__all__ = ["Client", "AsyncClient", "DEFAULT_SOCKET", "default_socket"]

DEFAULT_SOCKET = "/run/crabd/crabd.sock"
_BY_CODE = E.by_code()


def default_socket() -> str:
    return os.environ.get("CRABD_SOCKET", DEFAULT_SOCKET)


def _raise(resp: httpx.Response) -> Any:
    if resp.status_code < 400:
        return resp.json() if resp.content else None
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise E.CrabdError(f"HTTP {resp.status_code}: {resp.text[:300]}") from None
    code, msg, fix = err.get("code", ""), err.get("message", ""), err.get("fix")
    if code == "exec_timeout":
        raise E.ExecTimeout(msg, stdout=err.get("stdout", ""), stderr=err.get("stderr", ""))
    cls = _BY_CODE.get(code, E.CrabdError)
    # The class's own constructor may want more than the wire carries
    # (CommandFailed's argv): the base sets message and fix, the rest stays empty.
    e = cls.__new__(cls)
    E.CrabdError.__init__(e, msg, fix=fix)
    if isinstance(e, E.CommandFailed):
        e.argv, e.returncode, e.stderr = [], -1, ""
    e.code = code or e.code
    raise e


def _remote(reference: str, registry_auth: str | None, insecure: bool) -> dict[str, Any]:
    return {"reference": reference, "registry_auth": registry_auth, "insecure": insecure}


def _body(cmd: Sequence[str] | str, timeout: float | None, env: dict[str, str] | None, cwd: str | None,
          stdin: str | None) -> dict[str, Any]:
    b: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "timeout": timeout}
    for k, v in (("env", env), ("cwd", cwd), ("stdin", stdin)):
        if v is not None:
            b[k] = v
    return b


def _intent(op: str, key: str | None, args: Any, postcondition: str | None, volatile: Sequence[str],
            force: bool) -> dict[str, Any]:
    return {"op": op, "key": key, "args": args, "postcondition": postcondition, "volatile": list(volatile),
            "force": force}


def _effect_step(d: dict[str, Any], lookup: Any) -> str:
    """What effect_call does with an intent's decision: execute, replay or reconcile."""
    if d["decision"] == "ask":
        raise E.FailedPrecondition(f"operation {d['match']['op']!r} has policy ask and matches effect {d['matched']}",
                                   fix="ask the user; then effect_intent(..., force=True) executes it")
    if d["decision"] == "reconcile" and lookup is None:
        raise E.FailedPrecondition(f"effect {d['matched']} ({d['match']['op']}) has an unknown outcome",
                                   fix="pass lookup= to check the outside world by key, or call effect_reconcile")
    return str(d["decision"])


def _effects_q(state: Sequence[str] | None, op: str | None, lineage: bool) -> dict[str, Any]:
    q: dict[str, Any] = {"lineage": lineage}
    if state:
        q["state"] = list(state)
    if op:
        q["op"] = op
    return q


class Client:
    """Synchronous client. `socket` defaults to $CRABD_SOCKET or /run/crabd/crabd.sock."""

    def __init__(self, socket: str | Path | None = None, *, timeout: float = 3600.0) -> None:
        self.socket = str(socket or default_socket())
        # Plain HTTP over a unix socket: no TLS, so no certificate store to
        # load (verify=True would cost ~20 ms per Client, on every exec of an
        # agent that makes one per call).
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket, verify=False),
                                  base_url="http://crabd", timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _req(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _raise(self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise E.FailedPrecondition(f"cannot reach crabd at {self.socket}: {e}",
                                       fix="start it: crabd serve (or systemctl start crabd); or set CRABD_SOCKET") from e

    # sandboxes
    def create_sandbox(self, image: str, name: str | None = None, limits: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._req("POST", "/v1/sandboxes", json={"image": image, "name": name, "limits": limits})

    def sandboxes(self) -> list[dict[str, Any]]:
        return self._req("GET", "/v1/sandboxes")["sandboxes"]

    def sandbox(self, sid: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/sandboxes/{sid}")

    def delete_sandbox(self, sid: str) -> None:
        self._req("DELETE", f"/v1/sandboxes/{sid}")

    # turns
    def exec(self, sid: str, cmd: Sequence[str] | str, *, timeout: float | None = 600.0,
             env: dict[str, str] | None = None, cwd: str | None = None, stdin: str | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/sandboxes/{sid}/exec", json=_body(cmd, timeout, env, cwd, stdin))

    def end_turn(self, sid: str) -> dict[str, Any]:
        return self._req("POST", f"/v1/sandboxes/{sid}/turns/end")

    # checkpoints
    def checkpoints(self, sid: str, all: bool = False) -> list[dict[str, Any]]:
        return self._req("GET", f"/v1/sandboxes/{sid}/checkpoints", params={"all": all})["checkpoints"]

    def checkpoint(self, cid: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/checkpoints/{cid}")

    def create_checkpoint(self, sid: str) -> dict[str, Any]:
        return self._req("POST", f"/v1/sandboxes/{sid}/checkpoints")

    def delete_checkpoint(self, cid: str) -> None:
        self._req("DELETE", f"/v1/checkpoints/{cid}")

    def diff(self, a: str, b: str, limit: int = 10_000) -> dict[str, Any]:
        return self._req("GET", f"/v1/checkpoints/{a}/diff/{b}", params={"limit": limit})

    def rollback(self, sid: str, checkpoint: str | int | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": checkpoint})

    def fork(self, cid: str, count: int = 1) -> dict[str, Any]:
        return self._req("POST", f"/v1/checkpoints/{cid}/fork", json={"count": count})

    # OCI registries (crabd/remote)
    def push_checkpoint(self, cid: str, reference: str, *, registry_auth: str | None = None,
                        insecure: bool = False) -> dict[str, Any]:
        """Push checkpoint `cid` to `reference` (HOST[:PORT]/REPO[:TAG]); blobs the registry has are skipped."""
        return self._req("POST", f"/v1/checkpoints/{cid}/push",
                         json=_remote(reference, registry_auth, insecure))

    def pull_sandbox(self, reference: str, *, name: str | None = None, registry_auth: str | None = None,
                     insecure: bool = False, processes: bool = True, prefetch: bool = False) -> dict[str, Any]:
        """A new sandbox from a pushed checkpoint: its files and its processes
        (`prefetch`: only import them, no sandbox: a migration's pre-copy)."""
        return self._req("POST", "/v1/sandboxes/pull",
                         json={**_remote(reference, registry_auth, insecure), "name": name, "processes": processes,
                               "prefetch": prefetch})

    def migrate_sandbox(self, sid: str, reference: str, target_socket: str | Path, *,
                        registry_auth: str | None = None, insecure: bool = False) -> dict[str, Any]:
        """Live-migrate a sandbox to the daemon at `target_socket` through `reference`; reports the downtime."""
        return self._req("POST", f"/v1/sandboxes/{sid}/migrate",
                         json={**_remote(reference, registry_auth, insecure), "target_socket": str(target_socket)})

    # effects ledger and budgets (crabd/effects.py)
    def effect_intent(self, sid: str, op: str, *, key: str | None = None, args: Any = None,
                      postcondition: str | None = None, volatile: Sequence[str] = (),
                      force: bool = False) -> dict[str, Any]:
        """Before an external call: {"decision": execute|replay|ask|reconcile, ...}."""
        return self._req("POST", f"/v1/sandboxes/{sid}/effects/intent",
                         json=_intent(op, key, args, postcondition, volatile, force))

    def effect_commit(self, eid: str, receipt: Any = None, result_digest: str | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/effects/{eid}/commit", json={"receipt": receipt, "result_digest": result_digest})

    def effect_fail(self, eid: str, error: str | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/effects/{eid}/fail", json={"error": error})

    def effect_unknown(self, eid: str, error: str | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/effects/{eid}/unknown", json={"error": error})

    def effect_reconcile(self, eid: str, outcome: str, receipt: Any = None, result_digest: str | None = None,
                         error: str | None = None) -> dict[str, Any]:
        return self._req("POST", f"/v1/effects/{eid}/reconcile",
                         json={"outcome": outcome, "receipt": receipt, "result_digest": result_digest, "error": error})

    def effect(self, eid: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/effects/{eid}")

    def effects(self, sid: str, state: Sequence[str] | None = None, op: str | None = None,
                lineage: bool = False) -> list[dict[str, Any]]:
        return self._req("GET", f"/v1/sandboxes/{sid}/effects", params=_effects_q(state, op, lineage))["effects"]

    def effect_policies(self, sid: str) -> dict[str, str]:
        return self._req("GET", f"/v1/sandboxes/{sid}/effects/policies")["policies"]

    def set_effect_policy(self, sid: str, op: str, policy: str) -> dict[str, Any]:
        return self._req("PUT", f"/v1/sandboxes/{sid}/effects/policies/{op}", json={"policy": policy})

    def budget(self, sid: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/sandboxes/{sid}/budget")

    def set_budget(self, sid: str, **limits: float | None) -> dict[str, Any]:
        """Limits turns, wall_s, cost, retries (None: no limit); others unchanged."""
        return self._req("PUT", f"/v1/sandboxes/{sid}/budget", json=limits)

    def charge(self, sid: str, cost: float) -> dict[str, Any]:
        return self._req("POST", f"/v1/sandboxes/{sid}/budget/charge", json={"cost": cost})

    def effect_call(self, sid: str, op: str, args: Any, run: Callable[[], Any], *, key: str | None = None,
                    lookup: Callable[[str | None], Any] | None = None, postcondition: str | None = None,
                    volatile: Sequence[str] = (), failed_on: tuple[type[BaseException], ...] = ()) -> dict[str, Any]:
        """Run the external call `run()` through the ledger: at most once per
        lineage for the same key or the same op and arguments (policy
        `replay`). Returns {"decision": "execute"|"replay", "receipt", "effect"}.

        `run()` returns the receipt (JSON). An exception from it leaves the
        effect `unknown` (it may have reached the other side), except the
        types in `failed_on`, which record `failed`; it is re-raised either
        way. A `reconcile` decision calls `lookup(key of the earlier
        attempt)` -> its receipt, or None when the outside world has no
        trace of it; then the intent is asked again. Policy `ask` raises
        FailedPrecondition."""
        for _ in range(8):  # a reconcile settles the match; the next intent decides
            d = self.effect_intent(sid, op, key=key, args=args, postcondition=postcondition, volatile=volatile)
            step = _effect_step(d, lookup)
            if step == "replay":
                return {"decision": "replay", "receipt": d.get("receipt"), "effect": d["match"]}
            if step == "reconcile":
                found = lookup(d["match"]["key"])  # type: ignore[misc]
                self.effect_reconcile(d["matched"], "committed" if found is not None else "failed", receipt=found)
                continue
            eid = d["effect"]["id"]
            try:
                receipt = run()
            except failed_on as e:
                self.effect_fail(eid, f"{type(e).__name__}: {e}")
                raise
            except BaseException as e:
                self.effect_unknown(eid, f"{type(e).__name__}: {e}")
                raise
            return {"decision": "execute", "receipt": receipt, "effect": self.effect_commit(eid, receipt=receipt)}
        raise E.FailedPrecondition(f"effect {op!r} did not settle after 8 reconciles", fix="inspect: crabd effects ls")

    # events, health
    def events(self, since: int = 0, sandbox: str | None = None, *, latest: int | None = None) -> list[dict[str, Any]]:
        """One page (at most 1,000) of events after `since`, oldest first; or
        the newest `latest` of them. To read everything, page with events_page."""
        return self.events_page(since, sandbox, latest=latest)["events"]

    def events_page(self, since: int = 0, sandbox: str | None = None, *, latest: int | None = None,
                    order: str = "asc", before: int | None = None, limit: int | None = None) -> dict[str, Any]:
        """{events, order, limit, max_limit, more, next, last_seq}: pass `next`
        as `since` for the next page (as `before` with order="desc")."""
        return self._req("GET", "/v1/events", params=_event_params(since, sandbox, latest, order, before, limit))

    def last_event_seq(self) -> int:
        """The newest event's seq: `since` for "what happens from now on"."""
        return int(self.events_page(latest=1)["last_seq"])

    def follow_events(self, since: int = 0, sandbox: str | None = None, *,
                      latest: int | None = None) -> Iterator[dict[str, Any]]:
        params = _event_params(since, sandbox, latest, follow=True)
        with self._http.stream("GET", "/v1/events", params=params, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])

    def health(self) -> dict[str, Any]:
        return self._req("GET", "/v1/health")


class AsyncClient:
    """The same API, awaitable (for agents built on asyncio)."""

    def __init__(self, socket: str | Path | None = None, *, timeout: float = 3600.0) -> None:
        self.socket = str(socket or default_socket())
        self._http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.socket, verify=False),
                                       base_url="http://crabd", timeout=timeout)  # no TLS: see Client

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _req(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _raise(await self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise E.FailedPrecondition(f"cannot reach crabd at {self.socket}: {e}",
                                       fix="start it: crabd serve; or set CRABD_SOCKET") from e

    async def create_sandbox(self, image: str, name: str | None = None,
                             limits: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self._req("POST", "/v1/sandboxes", json={"image": image, "name": name, "limits": limits})

    async def sandboxes(self) -> list[dict[str, Any]]:
        return (await self._req("GET", "/v1/sandboxes"))["sandboxes"]

    async def sandbox(self, sid: str) -> dict[str, Any]:
        return await self._req("GET", f"/v1/sandboxes/{sid}")

    async def delete_sandbox(self, sid: str) -> None:
        await self._req("DELETE", f"/v1/sandboxes/{sid}")

    async def exec(self, sid: str, cmd: Sequence[str] | str, *, timeout: float | None = 600.0,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   stdin: str | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/exec", json=_body(cmd, timeout, env, cwd, stdin))

    async def end_turn(self, sid: str) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/turns/end")

    async def checkpoints(self, sid: str, all: bool = False) -> list[dict[str, Any]]:
        return (await self._req("GET", f"/v1/sandboxes/{sid}/checkpoints", params={"all": all}))["checkpoints"]

    async def checkpoint(self, cid: str) -> dict[str, Any]:
        return await self._req("GET", f"/v1/checkpoints/{cid}")

    async def create_checkpoint(self, sid: str) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/checkpoints")

    async def delete_checkpoint(self, cid: str) -> None:
        await self._req("DELETE", f"/v1/checkpoints/{cid}")

    async def diff(self, a: str, b: str, limit: int = 10_000) -> dict[str, Any]:
        return await self._req("GET", f"/v1/checkpoints/{a}/diff/{b}", params={"limit": limit})

    async def rollback(self, sid: str, checkpoint: str | int | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/rollback", json={"checkpoint": checkpoint})

    async def fork(self, cid: str, count: int = 1) -> dict[str, Any]:
        return await self._req("POST", f"/v1/checkpoints/{cid}/fork", json={"count": count})

    async def push_checkpoint(self, cid: str, reference: str, *, registry_auth: str | None = None,
                              insecure: bool = False) -> dict[str, Any]:
        return await self._req("POST", f"/v1/checkpoints/{cid}/push",
                               json=_remote(reference, registry_auth, insecure))

    async def pull_sandbox(self, reference: str, *, name: str | None = None, registry_auth: str | None = None,
                           insecure: bool = False, processes: bool = True, prefetch: bool = False) -> dict[str, Any]:
        return await self._req("POST", "/v1/sandboxes/pull",
                               json={**_remote(reference, registry_auth, insecure), "name": name,
                                     "processes": processes, "prefetch": prefetch})

    async def migrate_sandbox(self, sid: str, reference: str, target_socket: str | Path, *,
                              registry_auth: str | None = None, insecure: bool = False) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/migrate",
                               json={**_remote(reference, registry_auth, insecure),
                                     "target_socket": str(target_socket)})

    async def effect_intent(self, sid: str, op: str, *, key: str | None = None, args: Any = None,
                            postcondition: str | None = None, volatile: Sequence[str] = (),
                            force: bool = False) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/effects/intent",
                               json=_intent(op, key, args, postcondition, volatile, force))

    async def effect_commit(self, eid: str, receipt: Any = None, result_digest: str | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/effects/{eid}/commit",
                               json={"receipt": receipt, "result_digest": result_digest})

    async def effect_fail(self, eid: str, error: str | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/effects/{eid}/fail", json={"error": error})

    async def effect_unknown(self, eid: str, error: str | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/effects/{eid}/unknown", json={"error": error})

    async def effect_reconcile(self, eid: str, outcome: str, receipt: Any = None, result_digest: str | None = None,
                               error: str | None = None) -> dict[str, Any]:
        return await self._req("POST", f"/v1/effects/{eid}/reconcile",
                               json={"outcome": outcome, "receipt": receipt, "result_digest": result_digest,
                                     "error": error})

    async def effect(self, eid: str) -> dict[str, Any]:
        return await self._req("GET", f"/v1/effects/{eid}")

    async def effects(self, sid: str, state: Sequence[str] | None = None, op: str | None = None,
                      lineage: bool = False) -> list[dict[str, Any]]:
        return (await self._req("GET", f"/v1/sandboxes/{sid}/effects",
                                params=_effects_q(state, op, lineage)))["effects"]

    async def effect_policies(self, sid: str) -> dict[str, str]:
        return (await self._req("GET", f"/v1/sandboxes/{sid}/effects/policies"))["policies"]

    async def set_effect_policy(self, sid: str, op: str, policy: str) -> dict[str, Any]:
        return await self._req("PUT", f"/v1/sandboxes/{sid}/effects/policies/{op}", json={"policy": policy})

    async def budget(self, sid: str) -> dict[str, Any]:
        return await self._req("GET", f"/v1/sandboxes/{sid}/budget")

    async def set_budget(self, sid: str, **limits: float | None) -> dict[str, Any]:
        return await self._req("PUT", f"/v1/sandboxes/{sid}/budget", json=limits)

    async def charge(self, sid: str, cost: float) -> dict[str, Any]:
        return await self._req("POST", f"/v1/sandboxes/{sid}/budget/charge", json={"cost": cost})

    async def effect_call(self, sid: str, op: str, args: Any, run: Callable[[], Awaitable[Any]], *,
                          key: str | None = None, lookup: Callable[[str | None], Awaitable[Any]] | None = None,
                          postcondition: str | None = None, volatile: Sequence[str] = (),
                          failed_on: tuple[type[BaseException], ...] = ()) -> dict[str, Any]:
        """`Client.effect_call` with an awaitable `run()` and `lookup()`."""
        for _ in range(8):
            d = await self.effect_intent(sid, op, key=key, args=args, postcondition=postcondition, volatile=volatile)
            step = _effect_step(d, lookup)
            if step == "replay":
                return {"decision": "replay", "receipt": d.get("receipt"), "effect": d["match"]}
            if step == "reconcile":
                found = await lookup(d["match"]["key"])  # type: ignore[misc]
                await self.effect_reconcile(d["matched"], "committed" if found is not None else "failed",
                                            receipt=found)
                continue
            eid = d["effect"]["id"]
            try:
                receipt = await run()
            except failed_on as e:
                await self.effect_fail(eid, f"{type(e).__name__}: {e}")
                raise
            except BaseException as e:
                await self.effect_unknown(eid, f"{type(e).__name__}: {e}")
                raise
            return {"decision": "execute", "receipt": receipt,
                    "effect": await self.effect_commit(eid, receipt=receipt)}
        raise E.FailedPrecondition(f"effect {op!r} did not settle after 8 reconciles", fix="inspect: crabd effects ls")

    async def events(self, since: int = 0, sandbox: str | None = None, *,
                     latest: int | None = None) -> list[dict[str, Any]]:
        return (await self.events_page(since, sandbox, latest=latest))["events"]

    async def events_page(self, since: int = 0, sandbox: str | None = None, *, latest: int | None = None,
                          order: str = "asc", before: int | None = None, limit: int | None = None) -> dict[str, Any]:
        return await self._req("GET", "/v1/events", params=_event_params(since, sandbox, latest, order, before, limit))

    async def last_event_seq(self) -> int:
        return int((await self.events_page(latest=1))["last_seq"])

    async def follow_events(self, since: int = 0, sandbox: str | None = None, *,
                            latest: int | None = None) -> AsyncIterator[dict[str, Any]]:
        params = _event_params(since, sandbox, latest, follow=True)
        async with self._http.stream("GET", "/v1/events", params=params, timeout=None) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    yield json.loads(line[6:])

    async def health(self) -> dict[str, Any]:
        return await self._req("GET", "/v1/health")


def _event_params(since: int, sandbox: str | None, latest: int | None, order: str = "asc",
                  before: int | None = None, limit: int | None = None, follow: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"since": since, "follow": follow}
    if sandbox:
        params["sandbox"] = sandbox
    for k, v in (("latest", latest), ("before", before), ("limit", limit)):
        if v is not None:
            params[k] = v
    if order != "asc":
        params["order"] = order
    return params
