"""`crabd checkpoint ...`, `crabd rollback` and `crabd fork`: a sandbox's
checkpoints, going back to one, and new sandboxes from one (here, or on
another daemon through an OCI registry), through the daemon.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from ._common import InsecureOpt, JsonOpt, RegistryAuthOpt, SocketOpt, client, err, guard, out, print_json, show, table

checkpoint_app = typer.Typer(no_args_is_help=True, help="Checkpoints: list, inspect, create, delete, diff.")


@checkpoint_app.command("ls")
def checkpoint_ls(sandbox: str, all_states: bool = typer.Option(False, "--all", help="include failed ones"),
                  socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List a sandbox's checkpoints (the current head is marked)."""
    cks = guard(lambda: client(socket).checkpoints(sandbox, all=all_states), as_json)
    if as_json:
        print_json({"checkpoints": cks})
        return
    for c in cks:
        c["head"] = "*" if c.get("head") else ""
        c["pause_ms"] = f"{1000 * c['durations'].get('pause', 0):.1f}" if c.get("durations") else "-"
        c["kept"] = ", ".join(c.get("kept") or []) or ("retire" if c["state"] == "committed" else "")
    table(cks, ["head", "seq", "id", "turn", "branch", "plan", "state", "bytes", "pause_ms", "kept"])


@checkpoint_app.command("inspect")
def checkpoint_inspect(checkpoint: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show a checkpoint with its Effects, Plan, sizes and timings."""
    show(guard(lambda: client(socket).checkpoint(checkpoint), as_json), as_json)


@checkpoint_app.command("create")
def checkpoint_create(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Checkpoint a sandbox now (file system, whatever the inspector saw)."""
    ck = guard(lambda: client(socket).create_checkpoint(sandbox), as_json)
    print_json(ck) if as_json else out.print(f"{ck['id']} {ck['state']} ({ck['bytes']} bytes)")


@checkpoint_app.command("rm")
def checkpoint_rm(checkpoint: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Delete a checkpoint (not the head, not one with children)."""
    guard(lambda: client(socket).delete_checkpoint(checkpoint), as_json)
    print_json({"removed": checkpoint}) if as_json else out.print(f"removed {checkpoint}")


@checkpoint_app.command("push")
def checkpoint_push(checkpoint: str, reference: str, registry_auth: Optional[str] = RegistryAuthOpt,
                    insecure: bool = InsecureOpt, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Push a checkpoint to an OCI registry as REFERENCE (HOST[:PORT]/REPO[:TAG]); blobs it has are skipped."""
    r = guard(lambda: client(socket).push_checkpoint(checkpoint, reference, registry_auth=registry_auth,
                                                       insecure=insecure), as_json)
    print_json(r) if as_json else out.print(
        f"{r['pinned']}  ({r['blobs_pushed']} blobs pushed, {r['blobs_skipped']} skipped, "
        f"{r['bytes_pushed']} of {r['bytes_total']} bytes sent)")


@checkpoint_app.command("diff")
def checkpoint_diff(a: str, b: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Files added, modified and deleted from checkpoint A to checkpoint B."""
    d = guard(lambda: client(socket).diff(a, b), as_json)
    if as_json:
        print_json(d)
    else:
        table(d["changes"], ["kind", "path", "type", "size"])


def rollback(sandbox: str, to: Optional[str] = typer.Option(None, "--to", help="checkpoint id or seq",
                                                           show_default="the latest complete one"),
             socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Roll a sandbox back to a checkpoint; a new branch starts there."""
    r = guard(lambda: client(socket).rollback(sandbox, to), as_json)
    if as_json:
        print_json(r)
        return
    out.print(f"{r['sandbox']} rolled back to {r['checkpoint']} (turn {r['turn']}, branch {r['branch']}) "
              f"in {r['duration_ms']:.0f} ms")
    for e in r["effects_not_undone"]:
        out.print(f"[yellow]not undone:[/yellow] turn {e['turn']}: {'; '.join(e['reasons']) or 'unknown effects'}")


def fork(checkpoint: str, count: int = typer.Option(1, "--count"),
         to: Optional[str] = typer.Option(None, "--to", help="fork onto another daemon through this registry "
                                          "reference (HOST[:PORT]/REPO[:TAG]): push here, create there"),
         target_socket: Optional[Path] = typer.Option(None, "--target-socket", help="with --to: the other "
                                                      "daemon's API socket"),
         registry_auth: Optional[str] = RegistryAuthOpt, insecure: bool = InsecureOpt,
         socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Create COUNT new sandboxes from a checkpoint (tree search); with --to, on another daemon."""
    if to is not None:
        r = guard(lambda: _fork_to(checkpoint, count, to, target_socket, registry_auth, insecure, socket), as_json)
        print_json(r) if as_json else out.print("\n".join(r["sandboxes"]))
        return
    with err.status(f"forking {checkpoint} x{count} ..."):
        r = guard(lambda: client(socket).fork(checkpoint, count), as_json)
    print_json(r) if as_json else out.print("\n".join(r["sandboxes"]))


def _fork_to(checkpoint: str, count: int, ref: str, target_socket: Optional[Path], registry_auth: Optional[str],
             insecure: bool, socket: Optional[Path]) -> dict[str, Any]:
    """The source keeps running: its checkpoint is pushed once (pinned by
    digest), then the target daemon creates COUNT sandboxes from it."""
    if target_socket is None:
        from ..errors import InvalidArgument
        raise InvalidArgument("--to needs --target-socket (the daemon to fork onto)")
    pushed = client(socket).push_checkpoint(checkpoint, ref, registry_auth=registry_auth, insecure=insecure)
    target = client(target_socket)
    made = [target.pull_sandbox(pushed["pinned"], registry_auth=registry_auth, insecure=insecure)
            for _ in range(count)]
    return {"checkpoint": checkpoint, "reference": pushed["pinned"], "push": pushed,
            "sandboxes": [m["sandbox"] for m in made], "created": made}
