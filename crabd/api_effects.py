"""REST routes of the effects ledger and budgets (crabd/effects.py), mounted
by crabd/api.py. Errors use the API's usual JSON shape: 404 unknown
sandbox/effect, 409 a finished effect or a used-up budget
(`budget_exceeded`), 422 malformed input.

    POST /v1/sandboxes/{sid}/effects/intent      -> {decision, effect | receipt | match, ...}
    POST /v1/effects/{eid}/commit|fail|unknown    -> the effect
    POST /v1/effects/{eid}/reconcile              -> the effect ({"outcome": committed|failed})
    GET  /v1/effects/{eid}                        -> the effect
    GET  /v1/sandboxes/{sid}/effects              -> {effects: [...]} (?state=&op=&lineage=true)
    GET  /v1/sandboxes/{sid}/effects/policies     -> {policies: {op: policy}}
    PUT  /v1/sandboxes/{sid}/effects/policies/{op} {"policy": replay|allow|ask}
    GET  /v1/sandboxes/{sid}/budget               -> {limits, used}
    PUT  /v1/sandboxes/{sid}/budget               {"turns"?, "wall_s"?, "cost"?, "retries"?} (null: no limit)
    POST /v1/sandboxes/{sid}/budget/charge        {"cost": units}
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import Field

from .api import AS_INT, Id, StrictIn, Text

__all__ = ["make_router"]


class IntentIn(StrictIn):
    op: Text = Field(min_length=1, max_length=200, description="operation name, e.g. 'email.send'")
    key: Text | None = Field(None, min_length=1, max_length=500, description="idempotency key")
    args: Any = Field(None, description="the call's arguments (JSON); fingerprinted, not stored")
    postcondition: Text | None = Field(None, max_length=4096, description="what should hold after it")
    volatile: list[Text] = Field(default_factory=list, max_length=100,
                                description="more argument names to leave out of the fingerprint")
    force: bool = Field(False, description="execute even when a match says replay/ask/reconcile")


class FinishIn(StrictIn):
    receipt: Any = Field(None, description="downstream ids etc. (JSON), returned on replay")
    result_digest: Text | None = Field(None, max_length=200)
    error: Text | None = Field(None, max_length=4096)


class ReconcileIn(FinishIn):
    outcome: Literal["committed", "failed"]


class PolicyIn(StrictIn):
    policy: Literal["replay", "allow", "ask"]


class BudgetIn(StrictIn):
    turns: Annotated[int, Field(ge=0, le=10**15), AS_INT] | None = None
    wall_s: float | None = Field(None, ge=0, le=1e15)
    cost: float | None = Field(None, ge=0, le=1e15)
    retries: Annotated[int, Field(ge=0, le=10**15), AS_INT] | None = None


class ChargeIn(StrictIn):
    cost: float = Field(gt=0, le=1e12)


def make_router(daemon: Any) -> APIRouter:
    r = APIRouter(tags=["effects"])
    ledger = daemon.ledger

    def call(fn: Any, *a: Any, **kw: Any) -> Any:
        return asyncio.to_thread(fn, *a, **kw)

    def lineage(sid: str) -> str:
        return daemon.store.get_sandbox(sid).lineage

    @r.post("/v1/sandboxes/{sid}/effects/intent")
    async def intent(sid: Id, body: IntentIn) -> dict[str, Any]:
        """Ask before an external call: `execute` (a new effect), `replay` (its receipt from an earlier
        attempt), `reconcile` (an earlier attempt's outcome is unknown) or `ask` (policy)."""
        return await call(daemon.effect_intent, sid, body.op, key=body.key, args=body.args,
                          postcondition=body.postcondition, volatile=body.volatile, force=body.force)

    def finish(state: str) -> Any:
        async def handler(eid: Id, body: FinishIn) -> dict[str, Any]:
            """Record how the external call ended: `committed` (its receipt is kept for replays), `failed`, or
            `unknown` (a timeout: it may have happened)."""
            return await call(daemon.effect_finish, eid, state, receipt=body.receipt,
                              result_digest=body.result_digest, error=body.error)
        return handler

    for state, verb in (("committed", "commit"), ("failed", "fail"), ("unknown", "unknown")):
        r.add_api_route(f"/v1/effects/{{eid}}/{verb}", finish(state), methods=["POST"], name=f"effect_{verb}")

    @r.post("/v1/effects/{eid}/reconcile")
    async def reconcile(eid: Id, body: ReconcileIn) -> dict[str, Any]:
        """Settle an effect whose outcome was unknown: `committed` or `failed`, as found in the outside world."""
        return await call(daemon.effect_finish, eid, body.outcome, receipt=body.receipt,
                          result_digest=body.result_digest, error=body.error, reconciled=True)

    @r.get("/v1/effects/{eid}")
    async def get_effect(eid: Id) -> dict[str, Any]:
        """One effect of the ledger."""
        return await call(ledger.get, eid)

    @r.get("/v1/sandboxes/{sid}/effects")
    async def list_effects(sid: Id, state: list[Literal["intent", "committed", "failed", "unknown"]] | None = Query(None),
                           op: Text | None = None,
                           all_lineage: bool = Query(False, alias="lineage",
                                                     description="every sandbox of the lineage")) -> dict[str, Any]:
        """The sandbox's effects (`lineage=true`: of every sandbox of its lineage), filtered by `state` and
        `op`."""
        sb = await call(daemon.store.get_sandbox, sid)
        rows = await call(ledger.list, sb.lineage, sandbox_id=None if all_lineage else sb.id, states=state, op=op)
        return {"lineage": sb.lineage, "effects": rows}

    @r.get("/v1/sandboxes/{sid}/effects/policies")
    async def policies(sid: Id) -> dict[str, Any]:
        """The lineage's policies per operation (`replay`, `allow`, `ask`)."""
        lin = await call(lineage, sid)
        return {"lineage": lin, "default": "replay", "policies": await call(ledger.policies, lin)}

    @r.put("/v1/sandboxes/{sid}/effects/policies/{op}")
    async def set_policy(sid: Id, body: PolicyIn,
                         op: str = Path(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9._:-]{0,199})$",
                                        description="operation name, or * for the lineage's default")
                         ) -> dict[str, Any]:
        """Set an operation's policy for the lineage (`*`: its default)."""
        lin = await call(lineage, sid)
        await call(ledger.set_policy, lin, op, body.policy)
        return {"lineage": lin, "op": op, "policy": body.policy}

    @r.get("/v1/sandboxes/{sid}/budget")
    async def budget(sid: Id) -> dict[str, Any]:
        """The lineage's budget: `limits` and `used` (turns, wall_s, cost, retries)."""
        return await call(ledger.budget, await call(lineage, sid))

    @r.put("/v1/sandboxes/{sid}/budget")
    async def set_budget(sid: Id, body: BudgetIn) -> dict[str, Any]:
        """Set budget limits (null: no limit); keys left out keep their limit."""
        lin = await call(lineage, sid)
        return await call(ledger.set_budget, lin, body.model_dump(exclude_unset=True))

    @r.post("/v1/sandboxes/{sid}/budget/charge")
    async def charge(sid: Id, body: ChargeIn) -> dict[str, Any]:
        """Charge cost units to the lineage's budget."""
        return await call(ledger.charge, await call(lineage, sid), cost=body.cost)

    return r
