"""The effects ledger and budgets of a sandbox lineage.

A file-system rollback cannot unsend an email. The ledger is how an agent
makes its external calls (payments, messages, pushes: anything crabd cannot
undo) safe to repeat after a rollback, a fork or a restart:

    d = client.effect_intent(sid, "payments.charge", key=call_id, args=args)
    if d["decision"] == "execute":
        r = call_the_service(...)                     # the external effect
        client.effect_commit(d["effect"]["id"], receipt=r)   # or fail / unknown
    elif d["decision"] == "replay":
        r = d["receipt"]                              # done before: reuse its receipt
    elif d["decision"] == "reconcile":
        ...check the outside world, then client.effect_reconcile(id, "committed" | "failed")
    elif d["decision"] == "ask":
        ...ask a human; intent(..., force=True) executes anyway

Lifecycle of an effect: `intent` -> `committed` | `failed` | `unknown`;
`unknown` (a timeout, or an intent that crabd was restarted under) ->
`committed` | `failed` only through commit/fail/reconcile, never by itself.
Each effect is tied to the sandbox's branch, turn counter and head checkpoint
at the time of the intent (the state the effect was made *from*).

Matching (`decide`): an intent matches an earlier managed effect of the same
lineage (every sandbox forked from the same root, every branch, abandoned
ones included) and the same operation name when
  1. its idempotency key is equal (exact string comparison), or
  2. its argument fingerprint is equal (`fingerprint`), whatever the key.
Committed matches win over unknown/in-flight ones, which win over failed
ones; a key match wins over a fingerprint match of the same state. Then:
committed -> the operation's policy: `replay` (default: the recorded
receipt, nothing runs), `allow` (execute again), `ask`; unknown or intent
-> `reconcile` (policy `allow`: execute); failed -> execute, counted as a
retry against the `retries` budget; no match -> execute.

Limits of the fingerprint (README "Effects ledger and budgets"): it is an
exact comparison of canonical JSON after named volatile keys are dropped;
it does not understand paraphrase ("Hi Bob" vs "Hello Bob" differ), it
drops volatile keys by name only (a UUID under a meaningful name such as
`account` is kept, on purpose: replaying a payment to another account would
be worse than a duplicate prompt), and two deliberate identical calls are
one effect under `replay` (use `allow` for that operation, or a
distinguishing argument).

Budgets (per lineage: turns, wall seconds of exec, cost units, retries) are
rows of the same database: rollbacks, forks and restarts do not reset them.

Size (~650 lines): one ledger: its matching, its lifecycle, the budgets
it charges and the rollback walk that says what a rollback leaves behind
share one store and one lineage rule.
"""

from __future__ import annotations

import hashlib
import builtins
import json
import math
import re
import secrets
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .errors import BudgetExceeded, FailedPrecondition, InvalidArgument, IntegrityError, NotFound

__all__ = [
    "BudgetExceeded", "Ledger", "Prior", "Decision", "POLICIES", "STATES", "VOLATILE_NAMES",
    "VOLATILE_SUFFIXES", "canonical_args", "fingerprint", "decide", "effects_after", "budget_problem",
    "AbandonedLine", "abandoned_line", "seen_not_undone",
]

POLICIES = ("replay", "allow", "ask")
STATES = ("intent", "committed", "failed", "unknown")
BUDGET_FIELDS = ("turns", "wall_s", "cost", "retries")

# Argument names whose values differ between two attempts of the same call,
# compared after `_norm_name` (camelCase -> snake_case, '-'/' ' -> '_').
VOLATILE_NAMES = frozenset({
    "uuid", "guid", "request_id", "idempotency_key", "trace_id", "span_id", "correlation_id",
    "nonce", "timestamp", "ts", "created_at", "updated_at", "sent_at", "requested_at",
})
VOLATILE_SUFFIXES = ("_uuid", "_guid", "_nonce", "_request_id", "_trace_id", "_timestamp")


# --- fingerprints (pure) ------------------------------------------------------------------
def _norm_name(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", unicodedata.normalize("NFC", name).strip())
    return re.sub(r"[-\s]+", "_", s).casefold()


def is_volatile(name: str, extra: Iterable[str] = ()) -> bool:
    n = _norm_name(name)
    return n in VOLATILE_NAMES or n.endswith(VOLATILE_SUFFIXES) or n in {_norm_name(x) for x in extra}


MAX_DEPTH = 64  # nesting of arguments and receipts: deeper is refused, not a RecursionError


def _utf8(s: str, path: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"argument {path or '(root)'} is not valid UTF-8 (a lone surrogate)") from None
    return s


def check_json(v: Any, what: str = "receipt", depth: int = 0) -> Any:
    """`v` as JSON crabd can store: finite numbers, UTF-8 text, nesting <= MAX_DEPTH."""
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"{what} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(v, float) and not math.isfinite(v):
        raise InvalidArgument(f"{what} holds {v}: not JSON")
    if isinstance(v, str):
        _utf8(v, what)
    elif isinstance(v, (list, tuple)):
        for x in v:
            check_json(x, what, depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            _utf8(str(k), what)
            check_json(x, what, depth + 1)
    elif v is not None and not isinstance(v, (bool, int, float)):
        raise InvalidArgument(f"{what} holds a {type(v).__name__}: not JSON")
    return v


def _canon(v: Any, extra: frozenset[str], path: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidArgument(f"argument {path or '(root)'} is nested deeper than {MAX_DEPTH} levels")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise InvalidArgument(f"argument {path or '(root)'} is {v}: not JSON",
                                  fix="send finite numbers, or the value as a string")
        return int(v) if v.is_integer() else v
    if isinstance(v, str):
        return " ".join(unicodedata.normalize("NFC", _utf8(v, path)).split())
    if isinstance(v, (list, tuple)):
        return [_canon(x, extra, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise InvalidArgument(f"argument {path or '(root)'} has a non-string key {k!r}")
            if x is None or is_volatile(k, extra):
                continue
            nk = unicodedata.normalize("NFC", _utf8(k, path)).strip()
            if nk in out:
                raise InvalidArgument(f"argument {path or '(root)'} has two keys that normalise to {nk!r}")
            out[nk] = _canon(x, extra, f"{path}.{nk}" if path else nk, depth + 1)
        return out
    raise InvalidArgument(f"argument {path or '(root)'} has type {type(v).__name__}: not JSON")


def canonical_args(args: Any, volatile: Iterable[str] = ()) -> str:
    """The canonical JSON text of a call's arguments.

    Rules: object keys sorted; keys whose value is null dropped (an omitted
    optional argument = an explicit null); keys named volatile
    (VOLATILE_NAMES, names ending in VOLATILE_SUFFIXES, and `volatile`) dropped
    at any depth; strings NFC-normalised, trimmed, inner whitespace runs made
    one space; 1.0 == 1; list order and letter case kept (both can matter)."""
    extra = frozenset(_norm_name(x) for x in volatile)
    return json.dumps(_canon(args, extra, ""), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(args: Any, volatile: Iterable[str] = ()) -> str:
    """sha256 of `canonical_args` (hex)."""
    return hashlib.sha256(canonical_args(args, volatile).encode()).hexdigest()


# --- matching (pure) -----------------------------------------------------------------------
@dataclass(frozen=True)
class Prior:
    """An effect already in the ledger, as matching sees it."""

    id: str
    key: str | None
    fingerprint: str
    state: str


@dataclass(frozen=True)
class Decision:
    action: str                 # execute | replay | ask | reconcile
    match: Prior | None = None  # the earlier effect that decided it
    by: str | None = None       # "key" | "fingerprint"
    retry: bool = False         # executing again after a failed attempt


_RANK = {"committed": 0, "unknown": 1, "intent": 1, "failed": 2}


def decide(priors: Sequence[Prior], key: str | None, fp: str, policy: str = "replay",
           force: bool = False) -> Decision:
    """What an intent gets, given the earlier managed effects of the same
    lineage and operation (see the module docstring for the rules)."""
    if policy not in POLICIES:
        raise InvalidArgument(f"unknown policy {policy!r}", fix=f"one of {', '.join(POLICIES)}")
    best: tuple[tuple[int, int, int], Prior, str] | None = None
    for i, p in enumerate(priors):
        by = "key" if key is not None and p.key == key else "fingerprint" if p.fingerprint == fp else None
        if by is None or p.state not in _RANK:
            continue
        rank = (_RANK[p.state], 0 if by == "key" else 1, i)
        if best is None or rank < best[0]:
            best = (rank, p, by)
    if best is None:
        return Decision("execute")
    _, p, by = best
    if p.state == "failed":
        return Decision("execute", p, by, retry=True)
    if force or policy == "allow":
        return Decision("execute", p, by)
    if p.state == "committed":
        return Decision("replay" if policy == "replay" else "ask", p, by)
    return Decision("reconcile", p, by)


def effects_after(path: Sequence[tuple[str | None, int]], effects: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The effects made after a rollback target on the line being abandoned.

    `path` holds one pair per checkpoint from the head back to the target
    (or to the head's last common ancestor with it): (checkpoint id, the
    branch of the line that left it towards the head); for the head itself,
    the sandbox's current branch. An effect records the checkpoint it was
    made from and the branch then, so it was made on that stretch exactly
    when its pair is in `path`; the same checkpoint's effects with another
    branch belong to lines abandoned by earlier rollbacks."""
    on_line = set(path)
    return [e for e in effects if (e.get("checkpoint"), e.get("branch")) in on_line]


@dataclass(frozen=True)
class AbandonedLine:
    """What a rollback from the head to a target leaves behind (`abandoned_line`).

    `path`: `effects_after`'s argument, one (checkpoint id, branch of the
    line that left it towards the head) per checkpoint from the head back to
    `meets`, both included. `lost`: the checkpoint rows of that stretch
    without `meets`, newest first: the turns made after the target's line
    was left, none of them an ancestor of the target. `meets`: where the
    head's line joins the target's ancestry (the target itself when it is on
    the head's line); None when the head's line ends first (a broken chain)."""
    path: list[tuple[str, int]]
    lost: list[Any]
    meets: str | None


def abandoned_line(head: str | None, branch: int, target: str, get: Callable[[str], Any | None]) -> AbandonedLine:
    """The stretch of history a rollback of a sandbox at `head` (on `branch`)
    to `target` abandons: the one ancestor walk behind the rollback's reply,
    its ledger report and the operator view's preview (pure: `get(id)` gives a
    checkpoint row with `.parent` and `.branch`, or None when it is gone).
    An effect is "not undone" by the rollback exactly when it was made on
    this stretch: after the target in the sandbox's history and not one of
    the target's ancestors -- for a target on another branch, the stretch
    stops where the two lines meet, not at the root."""
    keep: set[str] = set()
    cid: str | None = target
    while cid and cid not in keep:
        keep.add(cid)
        c = get(cid)
        cid = c.parent if c is not None else None
    path: list[tuple[str, int]] = []
    lost: list[Any] = []
    cid, b = head, branch
    walked: set[str] = set()
    while cid and cid not in walked:   # a cycle (crabd never writes one) still ends
        walked.add(cid)
        path.append((cid, b))
        if cid in keep:
            return AbandonedLine(path, lost, cid)
        c = get(cid)
        if c is None:
            break
        lost.append(c)
        cid, b = c.parent, c.branch
    return AbandonedLine(path, lost, None)


def seen_not_undone(lost: Sequence[Any]) -> list[dict[str, Any]]:
    """The turns among `lost` (`AbandonedLine.lost`) whose effects the
    inspector saw reach (or maybe reach) the outside, oldest first: what a
    rollback's reply lists as `effects_not_undone`."""
    out = []
    for c in reversed(lost):
        eff = c.effects or {}
        if eff.get("external") or eff.get("external_unknown"):
            out.append({"checkpoint": c.id, "turn": c.turn, "reasons": eff.get("external_reasons", []),
                        "unknown": bool(eff.get("external_unknown"))})
    return out


_FLAGS = {"turns": "--turns", "wall_s": "--wall-s", "cost": "--cost", "retries": "--retries"}


def budget_problem(b: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) when a lineage may not run another turn, else None (pure).
    A limit is used up when usage has reached it: a limit of 0 allows none."""
    for f, unit in (("turns", "turns"), ("wall_s", "s of exec wall time"), ("cost", "cost units")):
        lim = b["limits"].get(f)
        if lim is not None and b["used"].get(f, 0) >= lim:
            return f, f"its {f} budget is used up ({_num(b['used'][f])} of {_num(lim)} {unit})"
    return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


# --- the ledger (SQLite, the store's database) ---------------------------------------------
_EFFECT_COLS = ("id", "lineage", "sandbox_id", "branch", "turn", "checkpoint", "op", "key", "fingerprint",
                "postcondition", "kind", "state", "receipt", "result_digest", "error", "replays",
                "created_at", "updated_at")
_BUDGET_COLS = ("lineage", "max_turns", "max_wall_s", "max_cost", "max_retries", "used_turns", "used_wall_s",
                "used_cost", "used_retries", "updated_at")


class Ledger:
    """The effects and budgets tables, in the store's database and under its
    lock and transactions, so a ledger write and a sandbox update can land
    together. Rows are signed with the store's keyed digest."""

    def __init__(self, store: Any) -> None:
        self.store = store
        # Exec wall time not yet written, per lineage: it lands with the next
        # budget write (the next turn's count, at the latest), which saves a
        # synchronous commit per exec; a kill -9 loses at most the last
        # turn's wall time (its turn was counted before it ran). flush() at stop.
        self._unsaved_wall: dict[str, float] = {}

    # The ledger's tables live in the store's database: it uses the store's
    # connection and lock (the same serialisation the store's own calls use).
    def _q(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self.store._lock:
            return self.store._db.execute(sql, list(args)).fetchall()

    # --- effects -------------------------------------------------------------------------
    def _sign_effect(self, d: dict[str, Any]) -> str:
        return self.store.sign({k: d[k] for k in _EFFECT_COLS})

    def _row(self, r: Any) -> dict[str, Any]:
        d = {k: r[k] for k in _EFFECT_COLS}
        ok = bool(r["digest"]) and secrets.compare_digest(r["digest"], self._sign_effect(d))
        out = dict(d)
        out["receipt"] = json.loads(d["receipt"]) if d["receipt"] else None
        out["verified"] = ok
        return out

    def _insert(self, d: dict[str, Any]) -> None:
        d = {k: d.get(k) for k in _EFFECT_COLS}
        sig = self._sign_effect(d)
        cols = (*_EFFECT_COLS, "digest")
        self.store._db.execute(f"INSERT INTO effects ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
                               [*d.values(), sig])

    def _update(self, eid: str, **fields: Any) -> dict[str, Any]:
        r = self.store._db.execute("SELECT * FROM effects WHERE id=?", (eid,)).fetchone()
        if r is None:
            raise NotFound(f"no effect {eid!r}", fix="crabd effects ls SANDBOX lists them")
        d = {k: r[k] for k in _EFFECT_COLS}
        if not r["digest"] or not secrets.compare_digest(r["digest"], self._sign_effect(d)):
            # Re-signing it would launder the change.
            raise IntegrityError(f"effect {eid}'s ledger row does not match its digest: not changing it",
                                 fix="it was modified outside crabd; inspect it with crabd effects ls --json")
        d.update(fields, updated_at=time.time())
        sets = ",".join(f"{k}=?" for k in (*fields, "updated_at", "digest"))
        self.store._db.execute(f"UPDATE effects SET {sets} WHERE id=?",
                               [*(d[k] for k in (*fields, "updated_at")), self._sign_effect(d), eid])
        r = self.store._db.execute("SELECT * FROM effects WHERE id=?", (eid,)).fetchone()
        return self._row(r)

    def has_effects(self, sid: str) -> bool:
        return bool(self._q("SELECT 1 FROM effects WHERE sandbox_id=? LIMIT 1", (sid,)))

    def get(self, eid: str) -> dict[str, Any]:
        rows = self._q("SELECT * FROM effects WHERE id=?", (eid,))
        if not rows:
            raise NotFound(f"no effect {eid!r}", fix="crabd effects ls SANDBOX lists them")
        return self._row(rows[0])

    def list(self, lineage: str, *, sandbox_id: str | None = None, states: Sequence[str] | None = None,
             op: str | None = None) -> list[dict[str, Any]]:
        q, args = "SELECT * FROM effects WHERE lineage=?", [lineage]
        if sandbox_id is not None:
            q, args = q + " AND sandbox_id=?", [*args, sandbox_id]
        if states:
            q, args = q + f" AND state IN ({','.join('?' * len(states))})", [*args, *states]
        if op is not None:
            q, args = q + " AND op=?", [*args, op]
        return [self._row(r) for r in self._q(q + " ORDER BY created_at, rowid", args)]

    def intent(self, sb: Any, op: str, *, key: str | None, args: Any, postcondition: str | None = None,
               volatile: Iterable[str] = (), force: bool = False) -> dict[str, Any]:
        """Decide an intent for sandbox row `sb` and, for `execute`, record it."""
        if not op or len(op) > 200:
            raise InvalidArgument("op must be 1 to 200 characters", fix="name the operation, e.g. 'email.send'")
        if key is not None and not 1 <= len(key) <= 500:
            raise InvalidArgument("key must be 1 to 500 characters, or omitted")
        fp = fingerprint(args, volatile)
        with self.store.transaction():
            policy = self._policy(sb.lineage, op)
            rows = self.store._db.execute(
                "SELECT * FROM effects WHERE lineage=? AND op=? AND kind='managed' "
                "AND ((key IS NOT NULL AND key=?) OR fingerprint=?) ORDER BY created_at, rowid",
                (sb.lineage, op, key, fp)).fetchall()
            priors = [Prior(r["id"], r["key"], r["fingerprint"], r["state"]) for r in rows]
            d = decide(priors, key, fp, policy, force)
            out: dict[str, Any] = {"decision": d.action, "policy": policy, "fingerprint": fp,
                                   "matched": d.match.id if d.match else None, "matched_by": d.by}
            if d.match is not None:
                m = self._row(next(r for r in rows if r["id"] == d.match.id))
                if not m["verified"] and d.action in ("replay", "ask", "reconcile"):
                    raise IntegrityError(f"effect {m['id']}'s ledger row does not match its digest",
                                         fix="it was modified outside crabd; inspect it with crabd effects ls")
                out["match"] = m
            if d.action == "replay":
                assert d.match is not None
                m = self._update(d.match.id, replays=out["match"]["replays"] + 1)
                out.update(receipt=m["receipt"], result_digest=m["result_digest"], match=m)
            elif d.action == "execute":
                if d.retry:
                    self._charge_locked(sb.lineage, retries=1, check_retries=True)
                now = time.time()
                row = {"id": f"eff-{secrets.token_hex(8)}", "lineage": sb.lineage, "sandbox_id": sb.id,
                       "branch": sb.branch, "turn": sb.turn, "checkpoint": sb.head, "op": op, "key": key,
                       "fingerprint": fp, "postcondition": postcondition, "kind": "managed", "state": "intent",
                       "receipt": None, "result_digest": None, "error": None, "replays": 0,
                       "created_at": now, "updated_at": now}
                self._insert(row)
                out["effect"] = self._row(self.store._db.execute("SELECT * FROM effects WHERE id=?",
                                                                 (row["id"],)).fetchone())
                out["retry"] = d.retry
        return out

    def finish(self, eid: str, state: str, *, receipt: Any = None, result_digest: str | None = None,
               error: str | None = None, reconciled: bool = False) -> dict[str, Any]:
        """intent|unknown -> committed|failed|unknown. A committed or failed
        effect is final: finishing it again the same way is a no-op."""
        if state not in ("committed", "failed", "unknown"):
            raise InvalidArgument(f"state must be committed, failed or unknown, not {state!r}")
        with self.store.transaction():
            r = self.store._db.execute("SELECT * FROM effects WHERE id=?", (eid,)).fetchone()
            if r is None:
                raise NotFound(f"no effect {eid!r}", fix="crabd effects ls SANDBOX lists them")
            cur = self._row(r)
            if cur["kind"] != "managed":
                raise FailedPrecondition(f"effect {eid} is an unmanaged effect crabd observed; it has no outcome to set")
            if cur["state"] in ("committed", "failed"):
                if cur["state"] == state:
                    return cur
                raise FailedPrecondition(f"effect {eid} is already {cur['state']}",
                                         fix="a finished effect is final; record a new intent for a new attempt")
            if state == "unknown" and reconciled:
                raise InvalidArgument("reconcile needs the outcome you found: committed or failed")
            fields: dict[str, Any] = {"state": state}
            if receipt is not None:
                check_json(receipt)
                fields["receipt"] = json.dumps(receipt, sort_keys=True, default=str)
            if result_digest is not None:
                fields["result_digest"] = result_digest
            if error is not None:
                fields["error"] = error
            return self._update(eid, **fields)

    def record_unmanaged(self, sb: Any, *, turn: int, checkpoint: str | None, reasons: Sequence[str],
                         unknown: bool) -> builtins.list[dict[str, Any]]:
        """Effects the inspector saw on its own during a turn (outbound
        connections, network tools): recorded, never matched or replayed."""
        now = time.time()
        items = [("committed", r) for r in reasons]
        if unknown:
            items.append(("unknown", "external effects may have happened unseen (events dropped, or no BPF)"))
        made = []
        with self.store.transaction():
            for state, why in items:
                op = "net.connect" if why.startswith(("connect ", "send ")) else \
                    "exec.tool" if why.startswith("exec of ") else "unseen"
                row = {"id": f"eff-{secrets.token_hex(8)}", "lineage": sb.lineage, "sandbox_id": sb.id,
                       "branch": sb.branch, "turn": turn, "checkpoint": checkpoint, "op": op, "key": None,
                       "fingerprint": hashlib.sha256(why.encode()).hexdigest(), "postcondition": why,
                       "kind": "unmanaged", "state": state, "receipt": None, "result_digest": None, "error": None,
                       "replays": 0, "created_at": now, "updated_at": now}
                self._insert(row)
                made.append(row["id"])
        return made

    def mark_in_flight_unknown(self) -> builtins.list[tuple[str, str | None]]:
        """At daemon start: intents a previous crabd left open may or may not
        have happened: they are `unknown` until reconciled. Returns (effect,
        sandbox) pairs."""
        done = []
        with self.store.transaction():
            rows = self.store._db.execute("SELECT id, sandbox_id FROM effects WHERE state='intent'").fetchall()
            for eid, sid in rows:
                try:
                    self._update(eid, state="unknown", error="crabd restarted while this effect was in flight")
                    done.append((eid, sid))
                except IntegrityError:
                    pass  # left as it is; listing shows it unverified, using it is refused
        return done

    def rollback_report(self, sid: str, lineage: str, path: Sequence[tuple[str, int]]) -> dict[str, Any]:
        """For a rollback of `sid`: the effects it did not undo (made after the
        target on the abandoned line, committed) and the sandbox's effects
        whose outcome is not known (unknown or still in flight)."""
        mine = self.list(lineage, sandbox_id=sid)
        after = effects_after(path, mine)
        # Unmanaged effects were seen (or may have happened unseen): all count
        # as not undone; only managed ones have an outcome to reconcile.
        return {"committed_after": [_brief(e) for e in after if e["state"] == "committed" or e["kind"] == "unmanaged"],
                "unknown": [_brief(e) for e in mine if e["state"] in ("unknown", "intent") and e["kind"] == "managed"]}

    # --- policies ---------------------------------------------------------------------------
    def _policy(self, lineage: str, op: str) -> str:
        r = self.store._db.execute("SELECT policy FROM effect_policies WHERE lineage=? AND op IN (?, '*') "
                                   "ORDER BY op='*' LIMIT 1", (lineage, op)).fetchone()
        return r[0] if r else "replay"

    def policies(self, lineage: str) -> dict[str, str]:
        return {r[0]: r[1] for r in self._q("SELECT op, policy FROM effect_policies WHERE lineage=? ORDER BY op",
                                            (lineage,))}

    def set_policy(self, lineage: str, op: str, policy: str) -> None:
        """Policy of operation `op` ('*': every operation without its own)."""
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown policy {policy!r}", fix=f"one of {', '.join(POLICIES)}")
        if not op or len(op) > 200:
            raise InvalidArgument("op must be 1 to 200 characters")
        with self.store.transaction():
            self.store._db.execute("INSERT INTO effect_policies (lineage, op, policy) VALUES (?,?,?) "
                                   "ON CONFLICT (lineage, op) DO UPDATE SET policy=excluded.policy",
                                   (lineage, op, policy))

    # --- budgets ----------------------------------------------------------------------------
    def _budget_row(self, lineage: str) -> dict[str, Any]:
        r = self.store._db.execute("SELECT * FROM budgets WHERE lineage=?", (lineage,)).fetchone()
        if r is None:
            d: dict[str, Any] = {k: None for k in _BUDGET_COLS}
            d.update(lineage=lineage, used_turns=0, used_wall_s=0.0, used_cost=0.0, used_retries=0, updated_at=0.0)
            d["used_wall_s"] += self._unsaved_wall.get(lineage, 0.0)
            return d
        d = {k: r[k] for k in _BUDGET_COLS}
        if not r["digest"] or not secrets.compare_digest(r["digest"], self.store.sign(d)):
            raise IntegrityError(f"the budget of lineage {lineage} does not match its digest",
                                 fix="it was modified outside crabd; set it again: crabd budget set")
        d["used_wall_s"] += self._unsaved_wall.get(lineage, 0.0)
        return d

    def _write_budget(self, d: dict[str, Any]) -> None:
        """Write a row read by _budget_row under the same lock hold (it holds the unsaved wall time)."""
        d = dict(d, updated_at=time.time())
        # The types SQLite gives back (REAL columns return floats), so the
        # digest signed now is the one computed on read.
        for k in ("max_wall_s", "max_cost", "used_wall_s", "used_cost"):
            d[k] = None if d[k] is None else float(d[k])
        cols = (*_BUDGET_COLS, "digest")
        self.store._db.execute(
            f"INSERT OR REPLACE INTO budgets ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})",
            [*(d[k] for k in _BUDGET_COLS), self.store.sign({k: d[k] for k in _BUDGET_COLS})])
        self._unsaved_wall.pop(d["lineage"], None)

    def add_wall(self, lineage: str, wall_s: float) -> None:
        """Count a turn's exec wall time (written with the next budget write)."""
        with self.store._lock:
            self._unsaved_wall[lineage] = self._unsaved_wall.get(lineage, 0.0) + wall_s

    def flush(self) -> None:
        """Write the unsaved wall time (at daemon stop)."""
        with self.store.transaction():
            for lineage in list(self._unsaved_wall):
                self._write_budget(self._budget_row(lineage))

    def budget(self, lineage: str) -> dict[str, Any]:
        with self.store._lock:
            return _budget_view(self._budget_row(lineage))

    def set_budget(self, lineage: str, limits: dict[str, float | None]) -> dict[str, Any]:
        """Set limits (None: no limit); fields not in `limits` keep theirs."""
        bad = set(limits) - set(BUDGET_FIELDS)
        if bad:
            raise InvalidArgument(f"unknown budget fields {sorted(bad)}", fix=f"use {', '.join(BUDGET_FIELDS)}")
        limits = dict(limits)
        for f, v in list(limits.items()):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e15):
                raise InvalidArgument(f"budget {f} must be a number from 0 to 1e15, or null for no limit")
            if v is not None and f in ("turns", "retries"):
                if not float(v).is_integer():
                    raise InvalidArgument(f"budget {f} must be a whole number, not {v}")
                limits[f] = int(v)
        with self.store.transaction():
            d = self._budget_row(lineage)
            for f, v in limits.items():
                d[f"max_{f}"] = v
            self._write_budget(d)
            return _budget_view(d)

    def _charge_locked(self, lineage: str, *, turns: int = 0, wall_s: float = 0.0, cost: float = 0.0,
                       retries: int = 0, check_retries: bool = False) -> dict[str, Any]:
        d = self._budget_row(lineage)
        if check_retries and d["max_retries"] is not None and d["used_retries"] + retries > d["max_retries"]:
            raise BudgetExceeded(
                f"lineage {lineage} has used its retries budget ({d['used_retries']} of {d['max_retries']})",
                fix=f"raise it: crabd budget set SANDBOX --retries {d['max_retries'] + 10} "
                    "(PUT /v1/sandboxes/{id}/budget), or reconcile instead of retrying")
        d["used_turns"] += turns
        d["used_wall_s"] += wall_s
        d["used_cost"] += cost
        d["used_retries"] += retries
        self._write_budget(d)
        return _budget_view(d)

    def charge(self, lineage: str, **usage: Any) -> dict[str, Any]:
        with self.store.transaction():
            return self._charge_locked(lineage, **usage)

    def begin_turn(self, lineage: str, sid: str) -> None:
        """Before a turn runs: refuse it when the budget is used up, else count
        it (counted first, so a turn that takes crabd down still counts)."""
        with self.store.transaction():
            d = self._budget_row(lineage)
            problem = budget_problem(_budget_view(d))
            if problem is None:
                d["used_turns"] += 1
            self._write_budget(d)  # the count, or (refused) the wall time so far
        if problem is not None:
            f, why = problem
            raise BudgetExceeded(
                f"sandbox {sid} may not run another turn: {why}; rollbacks, forks and restarts do not reset it",
                fix=f"raise the limit: crabd budget set {sid} {_FLAGS[f]} N "
                    f"(PUT /v1/sandboxes/{sid}/budget), or `{_FLAGS[f]} none` for no limit")


def _budget_view(d: dict[str, Any]) -> dict[str, Any]:
    return {"lineage": d["lineage"],
            "limits": {f: d[f"max_{f}"] for f in BUDGET_FIELDS},
            "used": {f: d[f"used_{f}"] for f in BUDGET_FIELDS},
            "updated_at": d["updated_at"]}


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: e[k] for k in ("id", "op", "key", "kind", "state", "turn", "checkpoint", "branch", "receipt",
                              "postcondition")}
