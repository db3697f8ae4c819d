#!/usr/bin/env python3
"""Convert SWE-bench task instances (and SWE-agent trajectories) into traces.

    python -m bench.swebench --instances FILE.jsonl --repos DIR --out DIR
                             [--trajectories DIR] [--image debian-py] [--test-cmd CMD]
                             [--llm-wait-ms 3000] [--json]
    (or: crabd bench swebench ...)

For users who have the repositories (and images with their dependencies)
locally; nothing is fetched. Each instance (one JSON object per line with
instance_id, repo, base_commit, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS) becomes one trace in --out:

- inputs: `git archive` of base_commit from the checkout in --repos
  (DIR/OWNER__NAME, DIR/NAME or DIR/OWNER/NAME), written into the bench
  input cache as swebench-ID.tar.gz and unpacked at /testbed in setup, where
  it becomes a one-commit git repository (fixed dates: deterministic);
- turns: with a SWE-agent `ID.traj` under --trajectories, its steps'
  actions (SWE-agent's file tools become shell commands, see
  `action_to_shell`); without one, an oracle session: look around, read the
  files the patch touches, apply the test patch, run FAIL_TO_PASS, apply
  the gold patch, run the tests again, diff;
- check: in a copy of /testbed with the test patch applied, the
  FAIL_TO_PASS and PASS_TO_PASS tests pass (SWE-bench's verdict);
- state_paths: /testbed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import inputs
from crabd.traces import Trace

ROOT = Path(__file__).resolve().parent.parent

TESTBED = "/testbed"
REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
GIT_ENV = ("GIT_AUTHOR_NAME=swebench GIT_AUTHOR_EMAIL=swebench@example.com GIT_COMMITTER_NAME=swebench "
           "GIT_COMMITTER_EMAIL=swebench@example.com GIT_AUTHOR_DATE=2024-01-01T00:00:00Z "
           "GIT_COMMITTER_DATE=2024-01-01T00:00:00Z")
WINDOW = 100  # lines SWE-agent's `open` shows


class ConversionError(Exception):
    pass


# -- instances ---------------------------------------------------------------------------------
def read_instances(path: Path) -> list[dict[str, Any]]:
    out = []
    for no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            inst = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConversionError(f"{path}:{no}: not JSON: {e}") from None
        missing = [k for k in REQUIRED if k not in inst]
        if missing:
            raise ConversionError(f"{path}:{no}: instance lacks {', '.join(missing)} (SWE-bench fields: "
                                  f"{', '.join(REQUIRED)})")
        for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):  # the HF dataset stores these as JSON strings
            if isinstance(inst[k], str):
                inst[k] = json.loads(inst[k]) if inst[k].strip() else []
        out.append(inst)
    if not out:
        raise ConversionError(f"{path}: no instances")
    return out


def trace_name(instance_id: str) -> str:
    n = re.sub(r"[^a-z0-9._-]+", "-", instance_id.lower()).strip("-._")
    return n[:63] or "instance"


def find_repo(repos: Path, repo: str) -> Path:
    owner, _, name = repo.partition("/")
    for cand in (repos / repo.replace("/", "__"), repos / name, repos / owner / name):
        if (cand / ".git").exists():
            return cand
    raise ConversionError(f"no git checkout of {repo} in {repos} (looked for {repo.replace('/', '__')}, {name}, "
                          f"{owner}/{name}); fix: git clone https://github.com/{repo} {repos / name}")


def archive(repo_dir: Path, commit: str, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["git", "-C", str(repo_dir), "archive", "--format=tar.gz", "-o", str(dst), commit],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise ConversionError(f"git archive {commit} in {repo_dir} failed: {r.stderr.strip()}; "
                              f"fix: git -C {repo_dir} fetch (the checkout lacks the base commit)")


def patch_files(patch: str) -> list[str]:
    return sorted({m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch, flags=re.M)})


def test_command(inst: dict[str, Any], test_cmd: str | None, tests: list[str]) -> str:
    base = test_cmd or ("python tests/runtests.py" if inst["repo"] == "django/django" else "python -m pytest -q")
    return base + "".join(" " + shlex.quote(t) for t in tests)


# -- SWE-agent trajectories -----------------------------------------------------------------------
@dataclass
class AgentView:
    """SWE-agent's editor state that its file commands depend on."""

    file: str | None = None
    line: int = 1
    notes: list[str] = field(default_factory=list)


def _window(view: AgentView) -> str:
    lo = max(1, view.line - WINDOW // 2)
    return f"cat -n {shlex.quote(view.file or '')} | sed -n '{lo},{lo + WINDOW - 1}p'"


def _py(script: str, *args: str, then: str = "") -> str:
    """`python3 - ARGS` with the script as a here-document, then `then` if it succeeded."""
    return ("python3 - " + " ".join(shlex.quote(a) for a in args) + " <<'CRABD_PY'"
            + (f" && {then}" if then else "") + "\n" + script + "\nCRABD_PY")


_EDIT = """import sys
path, lo, hi, text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = open(path).read().split('\\n')
new = text.split('\\n') if text else []
lines[lo - 1:hi] = new
open(path, 'w').write('\\n'.join(lines))
print(f'[File: {path} edited, lines {lo}-{hi} replaced by {len(new)}]')"""

_STR_REPLACE = """import sys
path, old, new = sys.argv[1], sys.argv[2], sys.argv[3]
s = open(path).read()
if s.count(old) != 1:
    sys.exit(f'old_str found {s.count(old)} times in {path}')
open(path, 'w').write(s.replace(old, new))
print(f'The file {path} has been edited.')"""


def action_to_shell(action: str, view: AgentView) -> str | None:
    """One SWE-agent action as the shell command that has its effect (None: no-op).

    Bash passes through. SWE-agent's own tools (open/goto/scroll, create, edit
    a:b ... end_of_edit, search_*, find_file, submit, str_replace_editor) are
    translated, tracking the open file and window like SWE-agent does.
    """
    action = action.strip()
    if not action:
        return None
    head, _, rest = action.partition("\n")
    try:
        argv = shlex.split(head)
    except ValueError:
        return action
    if not argv:
        return None
    cmd, args = argv[0], argv[1:]
    if cmd == "open" and args:
        view.file, view.line = args[0], int(args[1]) if len(args) > 1 and args[1].isdigit() else 1
        return _window(view)
    if cmd == "goto" and args and args[0].isdigit() and view.file:
        view.line = int(args[0])
        return _window(view)
    if cmd in ("scroll_down", "scroll_up") and view.file:
        view.line = max(1, view.line + (WINDOW if cmd == "scroll_down" else -WINDOW))
        return _window(view)
    if cmd == "create" and args:
        view.file, view.line = args[0], 1
        return f"touch {shlex.quote(args[0])} && cat -n {shlex.quote(args[0])}"
    if cmd == "edit" and args and re.match(r"^\d+:\d+$", args[0]) and view.file:
        lo, hi = args[0].split(":")
        body = rest
        if body.endswith("end_of_edit"):
            body = body[: -len("end_of_edit")]
        body = body[:-1] if body.endswith("\n") else body
        view.line = int(lo)
        return _py(_EDIT, view.file, lo, hi, body, then=_window(view))
    if cmd == "search_dir" and args:
        where = shlex.quote(args[1]) if len(args) > 1 else "."
        return f"grep -rn --include='*' -F -e {shlex.quote(args[0])} {where} | head -100"
    if cmd == "search_file" and args:
        f = args[1] if len(args) > 1 else view.file
        return f"grep -n -F -e {shlex.quote(args[0])} {shlex.quote(f or '')}"
    if cmd == "find_file" and args:
        where = shlex.quote(args[1]) if len(args) > 1 else "."
        return f"find {where} -name {shlex.quote(args[0])}"
    if cmd == "submit":
        return "git add -A && git diff --cached"
    if cmd == "str_replace_editor" and args:
        sub = args[0]
        opts = _options(args[2:])
        path = shlex.quote(args[1]) if len(args) > 1 else ""
        if sub == "view":
            return f"if [ -d {path} ]; then find {path} -maxdepth 2 -not -path '*/.*'; else cat -n {path}; fi"
        if sub == "create":
            return f"mkdir -p $(dirname {path}) && cat > {path} <<'CRABD_EOF'\n{opts.get('file_text', '')}\nCRABD_EOF"
        if sub == "str_replace":
            return _py(_STR_REPLACE, args[1], opts.get("old_str", ""), opts.get("new_str", ""))
    return action


def _options(args: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(args):
        if args[i].startswith("--") and i + 1 < len(args):
            out[args[i][2:]] = args[i + 1]
            i += 2
        else:
            i += 1
    return out


def trajectory_actions(traj_path: Path) -> list[str]:
    try:
        data = json.loads(traj_path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{traj_path}: not JSON: {e}") from None
    steps = data.get("trajectory") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise ConversionError(f"{traj_path}: no 'trajectory' list (a SWE-agent .traj file has one)")
    acts = []
    for i, s in enumerate(steps):
        if not isinstance(s, dict) or not isinstance(s.get("action"), str):
            raise ConversionError(f"{traj_path}: trajectory.{i}.action: missing or not a string")
        acts.append(s["action"])
    return acts


# -- one instance ---------------------------------------------------------------------------------
def convert(inst: dict[str, Any], *, repos: Path, traj: Path | None, image: str, test_cmd: str | None,
            llm_wait_ms: int) -> Trace:
    iid = inst["instance_id"]
    input_name = f"swebench-{trace_name(iid)}.tar.gz"
    archive(find_repo(repos, inst["repo"]), inst["base_commit"], inputs.local_path(input_name))
    f2p, p2p = list(inst["FAIL_TO_PASS"]), list(inst["PASS_TO_PASS"])
    files = {"/swebench/test.patch": inst["test_patch"], "/swebench/gold.patch": inst["patch"]}
    setup = [f"mkdir -p {TESTBED} && tar --no-same-owner -xzf /inputs/{input_name} -C {TESTBED}",
             f"cd {TESTBED} && git init -q && git add -A && {GIT_ENV} git commit -qm 'base {inst['base_commit'][:12]}'"]
    if traj is not None:
        view = AgentView()
        cmds = [c for c in (action_to_shell(a, view) for a in trajectory_actions(traj)) if c]
        turns = [f"cd {TESTBED} && {c}" for c in cmds]
    else:
        run_f2p = test_command(inst, test_cmd, f2p)
        turns = [f"cd {TESTBED} && ls", f"cd {TESTBED} && git log --oneline | head -3 && git status --short"]
        for f in patch_files(inst["patch"]):
            turns.append(f"cd {TESTBED} && wc -l {shlex.quote(f)} && head -80 {shlex.quote(f)}")
        for f in patch_files(inst["test_patch"]):
            turns.append(f"cd {TESTBED} && ls -l {shlex.quote(f)} 2>&1; grep -n 'def test' {shlex.quote(f)} | head -30")
        turns += [f"cd {TESTBED} && git apply -v /swebench/test.patch 2>&1 | tail -5",
                  f"cd {TESTBED} && {run_f2p} 2>&1 | tail -20",
                  f"cd {TESTBED} && git apply -v /swebench/gold.patch 2>&1 | tail -5",
                  f"cd {TESTBED} && git diff --stat",
                  f"cd {TESTBED} && {run_f2p} 2>&1 | tail -20",
                  f"cd {TESTBED} && git diff"]
    if not turns:
        raise ConversionError(f"{iid}: the trajectory {traj} has no actions")
    check = (f"rm -rf /tmp/eval && cp -a {TESTBED} /tmp/eval && cd /tmp/eval && git checkout -q -- "
             + " ".join(shlex.quote(f) for f in patch_files(inst["test_patch"]))
             + " 2>/dev/null; git apply /swebench/test.patch && "
             + test_command(inst, test_cmd, f2p + p2p))
    return Trace.model_validate({
        "name": trace_name(iid), "image": image,
        "description": f"SWE-bench {iid} ({inst['repo']} at {inst['base_commit'][:12]})"
                       + (f", SWE-agent trajectory {traj.name}" if traj else ", oracle session (gold patch)"),
        "inputs": [input_name], "files": files, "setup": setup,
        "turns": [{"run": t, "llm_wait_ms": llm_wait_ms} for t in turns],
        "check": [{"run": check, "expect_exit": 0}],
        "state_paths": [TESTBED],
    })


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", required=True, type=Path, help="SWE-bench instances, one JSON object a line")
    ap.add_argument("--repos", required=True, type=Path, help="directory with git checkouts of the instances' repos")
    ap.add_argument("--trajectories", type=Path, default=None, help="directory searched for SWE-agent ID.traj files")
    ap.add_argument("--out", required=True, type=Path, help="directory the traces are written to")
    ap.add_argument("--image", default="debian-py", help="crabd image the traces run in (with the repo's deps)")
    ap.add_argument("--test-cmd", default=None, help="test runner; test ids are appended [pytest; django: runtests.py]")
    ap.add_argument("--llm-wait-ms", type=int, default=3000)
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        insts = read_instances(a.instances)
        trajs = {p.stem: p for p in sorted(a.trajectories.rglob("*.traj"))} if a.trajectories else {}
        a.out.mkdir(parents=True, exist_ok=True)
        written = []
        for inst in insts:
            traj = trajs.get(inst["instance_id"])
            t = convert(inst, repos=a.repos, traj=traj, image=a.image, test_cmd=a.test_cmd,
                        llm_wait_ms=a.llm_wait_ms)
            p = a.out / f"{t.name}.json"
            p.write_text(json.dumps(t.model_dump(), indent=1) + "\n")
            written.append({"instance_id": inst["instance_id"], "trace": str(p), "turns": len(t.turns),
                            "from": "trajectory" if traj else "oracle"})
    except (ConversionError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"traces": written}))
    else:
        for w in written:
            print(f"{w['trace']}  {w['turns']} turns ({w['from']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
