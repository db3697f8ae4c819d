"""`crabd effects ...` and `crabd budget ...`: the effects ledger (external
calls made replay-safe) and the budgets of a sandbox lineage, as
crabd/effects.py keeps them, through the daemon.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from ._common import JsonOpt, SocketOpt, client, guard, out, print_json, table

effects_app = typer.Typer(no_args_is_help=True, help="Effects ledger: external calls made replay-safe.")
budget_app = typer.Typer(no_args_is_help=True, help="Budgets per sandbox lineage: turns, wall time, cost, retries.")
_EFFECT_COLS = ["id", "op", "key", "kind", "state", "turn", "checkpoint", "branch", "replays"]


def _json_arg(text: Optional[str], what: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        from ..errors import InvalidArgument
        raise InvalidArgument(f"{what} is not JSON: {e}", fix=f"quote it, e.g. {what} '{{\"to\": \"bob\"}}'") from e


@effects_app.command("ls")
def effects_ls(sandbox: str, state: Optional[List[str]] = typer.Option(None, "--state", help="intent|committed|failed|unknown (repeatable)"),
               op: Optional[str] = typer.Option(None, "--op"),
               lineage: bool = typer.Option(False, "--lineage", help="every sandbox of the lineage"),
               socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List a sandbox's effects (managed ones and the unmanaged ones the inspector saw)."""
    rows = guard(lambda: client(socket).effects(sandbox, state=state, op=op, lineage=lineage), as_json)
    print_json(rows) if as_json else table(rows, _EFFECT_COLS)


@effects_app.command("intent")
def effects_intent(sandbox: str, op: str, key: Optional[str] = typer.Option(None, "--key", help="idempotency key"),
                   args: Optional[str] = typer.Option(None, "--args", help="the call's arguments as JSON"),
                   postcondition: Optional[str] = typer.Option(None, "--postcondition"),
                   volatile: Optional[List[str]] = typer.Option(None, "--volatile", help="argument name to ignore (repeatable)"),
                   force: bool = typer.Option(False, "--force", help="execute even if a match says otherwise"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Before an external call: prints execute (with a new effect id), replay (with the receipt), ask or reconcile."""
    d = guard(lambda: client(socket).effect_intent(sandbox, op, key=key, args=_json_arg(args, "--args"),
                                                     postcondition=postcondition, volatile=volatile or [],
                                                     force=force), as_json)
    if as_json:
        print_json(d)
        return
    line = d["decision"]
    if d["decision"] == "execute":
        line += f" {d['effect']['id']}" + (" (retry)" if d.get("retry") else "")
    if d.get("matched"):
        line += f" (matches {d['matched']} by {d['matched_by']})"
    out.print(line, highlight=False)
    if d["decision"] == "replay":
        out.print(json.dumps(d.get("receipt")), highlight=False)


def _finish(verb: str, effect: str, socket: Optional[Path], as_json: bool, **kw: Any) -> None:
    c = client(socket)
    fn = {"commit": c.effect_commit, "fail": c.effect_fail, "unknown": c.effect_unknown,
          "reconcile": c.effect_reconcile}[verb]
    e = guard(lambda: fn(effect, **kw), as_json)
    print_json(e) if as_json else out.print(f"{e['id']}: {e['state']}", highlight=False)


@effects_app.command("commit")
def effects_commit(effect: str, receipt: Optional[str] = typer.Option(None, "--receipt", help="JSON"),
                   result_digest: Optional[str] = typer.Option(None, "--result-digest"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The external call succeeded: record its receipt."""
    _finish("commit", effect, socket, as_json, receipt=guard(lambda: _json_arg(receipt, "--receipt"), as_json),
            result_digest=result_digest)


@effects_app.command("fail")
def effects_fail(effect: str, error: Optional[str] = typer.Option(None, "--error"),
                 socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The external call certainly did not happen."""
    _finish("fail", effect, socket, as_json, error=error)


@effects_app.command("unknown")
def effects_unknown(effect: str, error: Optional[str] = typer.Option(None, "--error"),
                    socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The outcome is not known (a timeout): reconcile it later."""
    _finish("unknown", effect, socket, as_json, error=error)


@effects_app.command("reconcile")
def effects_reconcile(effect: str, outcome: str = typer.Argument(..., help="committed | failed"),
                      receipt: Optional[str] = typer.Option(None, "--receipt", help="JSON"),
                      result_digest: Optional[str] = typer.Option(None, "--result-digest"),
                      error: Optional[str] = typer.Option(None, "--error"),
                      socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """After checking the outside world: settle an unknown effect."""
    _finish("reconcile", effect, socket, as_json, outcome=outcome,
            receipt=guard(lambda: _json_arg(receipt, "--receipt"), as_json), result_digest=result_digest, error=error)


@effects_app.command("policy")
def effects_policy(sandbox: str, op: Optional[str] = typer.Argument(None, help="operation ('*': the default)"),
                   policy: Optional[str] = typer.Argument(None, help="replay | allow | ask"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the lineage's per-operation policies, or set one (default: replay)."""
    c = client(socket)
    if op is not None and policy is not None:
        guard(lambda: c.set_effect_policy(sandbox, op, policy), as_json)
    pol = guard(lambda: c.effect_policies(sandbox), as_json)
    if as_json:
        print_json(pol)
    else:
        table([{"op": k, "policy": v} for k, v in pol.items()] or [{"op": "*", "policy": "replay"}], ["op", "policy"])


def _budget_out(b: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(b)
        return
    rows = [{"budget": f, "used": b["used"][f], "limit": b["limits"][f]} for f in b["limits"]]
    table(rows, ["budget", "used", "limit"])


@budget_app.command("show")
def budgetshow(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the budget of the sandbox's lineage (limits and usage)."""
    _budget_out(guard(lambda: client(socket).budget(sandbox), as_json), as_json)


def _limit(text: Optional[str], name: str) -> Any:
    if text is None or text.lower() == "none":
        return None
    try:
        v = float(text)
    except ValueError:
        from ..errors import InvalidArgument
        raise InvalidArgument(f"--{name} must be a number or 'none', not {text!r}") from None
    return int(v) if name in ("turns", "retries") and v.is_integer() else v


@budget_app.command("set")
def budget_set(sandbox: str,
               turns: Optional[str] = typer.Option(None, "--turns", help="max turns (execs); 'none' = no limit"),
               wall_s: Optional[str] = typer.Option(None, "--wall-s", help="max seconds of exec wall time"),
               cost: Optional[str] = typer.Option(None, "--cost", help="max cost units"),
               retries: Optional[str] = typer.Option(None, "--retries", help="max re-executions of failed effects"),
               socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Set limits of the lineage's budget; the options not given keep theirs."""
    given = {"turns": turns, "wall_s": wall_s, "cost": cost, "retries": retries}
    limits = guard(lambda: {k: _limit(v, k.replace("_", "-")) for k, v in given.items() if v is not None}, as_json)
    _budget_out(guard(lambda: client(socket).set_budget(sandbox, **limits), as_json), as_json)
