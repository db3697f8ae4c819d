"""The recovery benchmark's output: progress on stderr, the per-method summary
(the JSON of `crabd bench recovery`), report.md and PNG plots."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from bench._stats import median, quantiles
from bench.recovery_runs import METHODS, RunRecord, record_dict


class _Bar:
    def __init__(self, prog: Any, task: Any) -> None:
        self.prog, self.task = prog, task

    def describe(self, what: str) -> None:
        self.prog.update(self.task, description=what)

    def advance(self, what: str) -> None:
        self.prog.console.log(what)
        self.prog.advance(self.task)


@contextmanager
def progress(total: int) -> Iterator[_Bar]:
    """A rich progress bar on stderr (stdout stays for the JSON)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as prog:
        yield _Bar(prog, prog.add_task("runs", total=total))


def _q(xs: list[float]) -> dict[str, float | None]:
    return quantiles(xs, (50, 99), 3)   # bench/_stats.py: nearest rank


FULL_BASELINE = {
    "fair": "bytes_vs_full_pct: against `full` = every turn a copy-on-write snapshot of the files and a CRIU dump "
            "into the same chunked, zstd, de-duplicated image store as crabd, counted as crabd's checkpoints are "
            "(snapshot bytes over its parent + the store's new bytes); each method starts with an empty image store",
    "naive_raw": "bytes_vs_full_raw_pct: against `full` counted raw = per turn the uncompressed CRIU image plus a "
                 "tar of every file that differs from the image (what docker commit / podman checkpoint --export "
                 "per turn would write)",
}


def inspector_fields(used: list[str], requested: str) -> dict[str, Any]:
    """What the result says about the inspector: the ones the daemons
    really used (their health), the one asked for, and whether a BPF run fell
    back to /proc -- its plans then come from the coarser /proc inspector,
    and its numbers are not the BPF inspector's."""
    used = sorted({u.strip() for x in used for u in x.split(", then ") if u.strip()})   # "a, then b": a restart
    return {"inspector": ", ".join(used) if used else None, "inspector_requested": requested,
            "inspector_fallback": requested == "bpf" and any(not u.startswith("bpf") for u in used)}


def inspector_line(result: dict[str, Any]) -> str:
    used, asked = result.get("inspector"), result.get("inspector_requested")
    if used is None:
        return ""
    if result.get("inspector_fallback"):
        return (f"**Inspector: `{used}` -- the daemon fell back to the /proc inspector although `{asked}` was "
                f"requested; plans and overheads here are not the BPF inspector's.**")
    return f"Inspector (from the daemon's health): `{used}` (requested `{asked}`)."


def overhead(clean: list[RunRecord], refs: list[RunRecord]) -> dict[str, Any]:
    """End-to-end overhead of a method's fault-free runs against the bare
    reference runs: per trace the median over rounds (--reps), summed over
    traces. `overhead_reps` pairs each round's runs (one figure per round; their
    spread is the noise), `overhead_by_trace` splits it per trace, and
    `command_s`/`stall_s` say where the time went (median per trace, summed):
    the turns' commands as the agent saw them, and how long they waited for
    the previous capture. `command_overhead_pct` is the commands' own time
    through crabd against bare (exec request to reply, the stall included;
    `command_overhead_ms_per_turn` the same per turn), beside the end-to-end
    `overhead_pct` (turns plus LLM waits): the first is what crabd adds to
    each command, the second what it adds to a session whose captures fit
    in the LLM waits."""
    traces = sorted({r.trace for r in clean})

    def med(rs: list[RunRecord], f: Callable[[RunRecord], float]) -> float:
        return median([f(r) for r in rs])

    by_trace, base, mine = {}, 0.0, 0.0
    cmd = {"bare": 0.0, "method": 0.0}
    cmd_by_trace: dict[str, float] = {}
    stall, turns = 0.0, 0.0
    for t in traces:
        m_runs = [r for r in clean if r.trace == t]
        r_runs = [r for r in refs if r.trace == t]
        b, x = med(r_runs, lambda r: r.seconds), med(m_runs, lambda r: r.seconds)
        by_trace[t] = round((x - b) / b * 100, 2)
        base, mine = base + b, mine + x
        cb, cm = med(r_runs, lambda r: sum(r.durations)), med(m_runs, lambda r: sum(r.durations))
        cmd["bare"] += cb
        cmd["method"] += cm
        cmd_by_trace[t] = round((cm - cb) / cb * 100, 2) if cb else None
        turns += med(m_runs, lambda r: len(r.durations))
        stall += med(m_runs, lambda r: sum(r.stall_ms) / 1000)
    rounds = sorted({r.rep for r in clean})
    per_round = []
    for k in rounds:
        b = sum(r.seconds for r in refs if r.rep == k and r.trace in traces)
        x = sum(r.seconds for r in clean if r.rep == k)
        if b:
            per_round.append(round((x - b) / b * 100, 2))
    return {"overhead_pct": round((mine - base) / base * 100, 2),
            "overhead_by_trace": by_trace,
            "overhead_reps": per_round,
            "command_s": {"bare": round(cmd["bare"], 2), "method": round(cmd["method"], 2)},
            "command_overhead_pct": (round((cmd["method"] - cmd["bare"]) / cmd["bare"] * 100, 2)
                                     if cmd["bare"] else None),
            "command_overhead_by_trace": cmd_by_trace,
            "command_overhead_ms_per_turn": round((cmd["method"] - cmd["bare"]) / turns * 1000, 1) if turns else None,
            "stall_s": round(stall, 2),
            "turns_s": {"bare": round(base, 2), "method": round(mine, 2)}}


def summarize(records: list[RunRecord], methods: list[str], faults: list[str], traces: list[Any],
              a: argparse.Namespace) -> dict[str, Any]:
    refs = [r for r in records if r.method == "reference"]
    reps = max([r.rep for r in records] or [0]) + 1
    out: dict[str, Any] = {"methods": {}}
    for m in methods:
        clean = [r for r in records if r.method == m and r.fault is None]
        faulted = [r for r in records if r.method == m and r.fault is not None]
        ok = [r for r in faulted if r.correct]
        by_fault = {}
        for f in faults:
            fr = [r for r in faulted if r.fault == f]
            by_fault[f] = round(100 * sum(bool(r.correct) for r in fr) / len(fr), 1) if fr else None
        plans = [p for r in clean for p in r.plans]
        entry: dict[str, Any] = {
            "runs": len(faulted),
            "correct_pct": round(100 * len(ok) / len(faulted), 1) if faulted else None,
            "correct_by_fault": by_fault,
            "bytes": round(sum(r.bytes for r in clean) / reps),   # one round's
            # against the fair `full` (same snapshots and image store, counted alike)
            "bytes_vs_full_pct": None,
            # against the naive `full`: raw CRIU images + a tar of the changed files
            "bytes_vs_full_raw_pct": None,
            "bytes_naive_raw": round(sum(r.bytes_naive_raw for r in clean) / reps) if m == "full" else None,
            # where the bytes go: per plan and per trace (one round's)
            "bytes_by_plan": {p: round(sum(r.bytes_by_plan.get(p, 0) for r in clean) / reps)
                              for p in sorted({p for r in clean for p in r.bytes_by_plan})},
            "bytes_by_trace": {t: round(sum(r.bytes for r in clean if r.trace == t) / reps)
                               for t in sorted({r.trace for r in clean})},
            "overhead_pct": None,
            "ckpt_ms": _q([x for r in clean for x in r.ckpt_ms]),
            "stall_ms": _q([x for r in clean for x in r.stall_ms]),
            "rollback_ms": _q([r.rollback_ms for r in faulted if r.rollback_ms is not None]),
            "skip_fraction": round(plans.count("SKIP") / len(plans), 3) if plans else None,
            "fault_free_correct": all(bool(r.correct) for r in clean) if clean else None,
            "wrong": [f"{r.trace} {r.fault}@{r.k}" for r in faulted if not r.correct],
            # daemon fault: the states checked after the restart (live, rollback
            # to the recovery target, rollback to an older checkpoint)
            "rollback_checks": {
                "checks": sum(len(r.rollback_checks) for r in faulted),
                "ok": sum(ch["ok"] for r in faulted for ch in r.rollback_checks),
                "failed": [f"{r.trace} {r.fault}@{r.k}: {ch['what']} ({ch['checkpoint']}, turn {ch['turn']}): "
                           f"{ch['error']}" for r in faulted for ch in r.rollback_checks if not ch["ok"]]},
            "inspector": sorted({r.inspector for r in clean + faulted if r.inspector}) or None,
            # external calls (turn.external) of the faulted runs that reached the outside
            # world more than once: side effects done twice after a recovery
            "external_calls": sum(r.external_calls for r in faulted),
            "duplicate_effect_pct": (round(100 * sum(r.duplicate_calls for r in faulted)
                                           / sum(r.external_calls for r in faulted), 1)
                                     if sum(r.external_calls for r in faulted) else None),
        }
        if clean:
            entry.update(overhead(clean, refs))
        elif m in ("chat-only", "replay"):
            # They run on bare sandboxes and save nothing but the transcript: no overhead, no bytes.
            entry["overhead_pct"] = 0.0
        out["methods"][m] = entry
    full = out["methods"].get("full")
    if full and full["bytes"]:
        for e in out["methods"].values():
            e["bytes_vs_full_pct"] = round(100 * e["bytes"] / full["bytes"], 2)
    if full and full["bytes_naive_raw"]:
        for e in out["methods"].values():
            e["bytes_vs_full_raw_pct"] = round(100 * e["bytes"] / full["bytes_naive_raw"], 2)
    out.update(traces=[t.name for t in traces], quick=a.quick, faults=faults, time_scale=a.time_scale,
               reps=reps,
               **inspector_fields([r.inspector for r in records], a.inspector),
               full_baseline=FULL_BASELINE,
               runs=[record_dict(r) for r in records])
    return out


def _fmt_ms(q: dict[str, Any]) -> str:
    if q.get("p50") is None:
        return "–"
    return f"{q['p50']:.0f} / {q['p99']:.0f}"


def report_md(result: dict[str, Any], argv: list[str]) -> str:
    cmd = "crabd bench recovery " + " ".join(argv)
    lines = ["# crabd recovery benchmark", "", f"`{cmd}` — {result.get('seconds')} s", ""]
    if result["methods"]:
        faults = result.get("faults", [])
        lines += [f"traces: {', '.join(result.get('traces', []))}; LLM waits × {result.get('time_scale')}", ""]
        if inspector_line(result):
            lines += [inspector_line(result), ""]
        lines += ["| method | correct | " + " | ".join(faults) + (" | " if faults else "") +
                  "bytes | % of fair full | % of naive full | overhead end-to-end | overhead commands | "
                  "ckpt p50/p99 ms | stall p50/p99 ms | recovery p50/p99 ms | SKIP |",
                  "|---|---|" + "---|" * len(faults) + "---|---|---|---|---|---|---|---|---|"]
        for m, r in result["methods"].items():
            bf = " | ".join("–" if r["correct_by_fault"].get(f) is None else f"{r['correct_by_fault'][f]} %"
                            for f in faults)
            fair = "–" if r.get("bytes_vs_full_pct") is None else f"{r['bytes_vs_full_pct']} %"
            raw = "–" if r.get("bytes_vs_full_raw_pct") is None else f"{r['bytes_vs_full_raw_pct']} %"
            corr = "–" if r["correct_pct"] is None else f"{r['correct_pct']} % of {r['runs']}"
            ovh = "–" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f} %"
            cmd = "–" if r.get("command_overhead_pct") is None else f"{r['command_overhead_pct']:+.1f} %"
            skip = "–" if r["skip_fraction"] is None else f"{100 * r['skip_fraction']:.0f} %"
            lines.append(f"| {m} | {corr} | {bf}{' | ' if faults else ''}{r['bytes'] / 1e6:.2f} MB | {fair} | {raw} | "
                         f"{ovh} | {cmd} | {_fmt_ms(r['ckpt_ms'])} | {_fmt_ms(r['stall_ms'])} | "
                         f"{_fmt_ms(r['rollback_ms'])} | {skip} |")
        full = result["methods"].get("full")
        if full and full.get("bytes_naive_raw"):
            lines += ["", f"`full`, the fair baseline: {full['bytes'] / 1e6:.2f} MB; counted naively (raw CRIU images "
                      f"+ a tar of the changed files, per turn): {full['bytes_naive_raw'] / 1e6:.2f} MB. "
                      "See `full_baseline` in results.json."]
        by = [(m, r) for m, r in result["methods"].items() if r.get("bytes_by_plan")]
        if by:
            lines += ["", "Where the bytes go (fault-free runs, one round):", "",
                      "| method | by plan | by trace |", "|---|---|---|"]
            for m, r in by:
                plans = ", ".join(f"{p} {v / 1e6:.2f} MB" for p, v in r["bytes_by_plan"].items())
                per = ", ".join(f"{t} {v / 1e6:.2f} MB" for t, v in r.get("bytes_by_trace", {}).items())
                lines.append(f"| {m} | {plans} | {per} |")
        checks = [(m, r["rollback_checks"]) for m, r in result["methods"].items()
                  if (r.get("rollback_checks") or {}).get("checks")]
        if checks:
            lines += ["", "Daemon fault: states checked after the restart (live sandbox, rollback to the recovery "
                      "target, rollback to an older checkpoint), against the reference after that turn:", ""]
            for m, c in checks:
                lines.append(f"- {m}: {c['ok']} of {c['checks']} right" +
                             ("" if not c["failed"] else "; wrong: " + "; ".join(c["failed"])))
        ovh = {m: r for m, r in result["methods"].items() if r.get("overhead_by_trace")}
        if ovh:
            lines += ["", f"Overhead of the fault-free runs against the bare runtime (median of "
                      f"{result.get('reps', 1)} round(s) per trace). End-to-end: the turns with their LLM waits. "
                      "Commands: the commands' own time, exec request to reply (the stall included):", "",
                      "| method | end-to-end | per round | per trace | turns s (bare → method) | commands | "
                      "commands s (bare → method) | per turn | stall s |", "|---|---|---|---|---|---|---|---|---|"]
            for m, r in ovh.items():
                per_trace = ", ".join(f"{t} {v:+.1f} %" for t, v in r["overhead_by_trace"].items())
                rounds = ", ".join(f"{v:+.1f} %" for v in r["overhead_reps"])
                cmd = "–" if r.get("command_overhead_pct") is None else f"{r['command_overhead_pct']:+.1f} %"
                per_turn = ("–" if r.get("command_overhead_ms_per_turn") is None
                            else f"{r['command_overhead_ms_per_turn']:+.0f} ms")
                lines.append(f"| {m} | {r['overhead_pct']:+.2f} % | {rounds} | {per_trace} | "
                             f"{r['turns_s']['bare']} → {r['turns_s']['method']} | {cmd} | "
                             f"{r['command_s']['bare']} → {r['command_s']['method']} | {per_turn} | {r['stall_s']} |")
        wrong = [(m, r["wrong"]) for m, r in result["methods"].items() if r["wrong"]]
        if wrong:
            lines += ["", "Wrong recoveries:", ""] + [f"- {m}: {', '.join(w)}" for m, w in wrong]
        notes = [f"- {r['method']} {r['trace']} " + (f"{r['fault']}@{r['k']}" if r["fault"] else "fault-free")
                 + f": {r['note']}" for r in result.get("runs", []) if r.get("note")]
        if notes:
            lines += ["", "Notes:", ""] + notes
    if result.get("chain"):
        from bench.recovery_chain import report_lines
        lines += [f"traces: {', '.join(result.get('traces', []))}; LLM waits × {result.get('time_scale')}"]
        if inspector_line(result):
            lines += ["", inspector_line(result)]
        lines += report_lines(result)
    if result.get("scale"):
        lines += ["", f"Scale: `{result.get('scale_trace')}` in N sandboxes at once through one daemon", "",
                  "| N | scheduler | stall p50 / p99 ms | total s | bytes |", "|---|---|---|---|---|"]
        for s in result["scale"]:
            lines.append(f"| {s['n']} | {'on' if s['scheduler'] else 'off'} | {_fmt_ms(s['stall_ms'])} | "
                         f"{s['seconds']} | {s['bytes'] / 1e6:.1f} MB |")
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    ms = result["methods"]
    if ms:
        names = list(ms)
        faults = result.get("faults") or []
        if faults:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            w = 0.8 / len(faults)
            for i, f in enumerate(faults):
                ax.bar([j + i * w for j in range(len(names))],
                       [ms[m]["correct_by_fault"].get(f) or 0 for m in names], w, label=f)
            ax.set_xticks([j + w * (len(faults) - 1) / 2 for j in range(len(names))], names)
            ax.set_ylabel("correct recoveries (%)")
            ax.set_ylim(0, 105)
            ax.legend()
            fig.tight_layout()
            fig.savefig(out / "correct.png", dpi=100)
            plt.close(fig)
            made.append("correct.png")
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(names, [ms[m]["bytes"] / 1e6 for m in names])
        ax.set_ylabel("checkpoint bytes, fault-free runs (MB)")
        fig.tight_layout()
        fig.savefig(out / "bytes.png", dpi=100)
        plt.close(fig)
        made.append("bytes.png")
        fig, ax = plt.subplots(figsize=(8, 3.5))
        kinds = ["ckpt_ms", "stall_ms", "rollback_ms"]
        w = 0.8 / (2 * len(kinds))
        for i, kind in enumerate(kinds):
            for j, q in enumerate(("p50", "p99")):
                ax.bar([x + (2 * i + j) * w for x in range(len(names))],
                       [ms[m][kind][q] or 0 for m in names], w, label=f"{kind[:-3]} {q}")
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(names))], names)
        ax.set_yscale("symlog")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7, ncol=3)
        fig.tight_layout()
        fig.savefig(out / "latency.png", dpi=100)
        plt.close(fig)
        made.append("latency.png")
    if result.get("scale"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for sched in (True, False):
            pts = [s for s in result["scale"] if s["scheduler"] == sched]
            ax.plot([s["n"] for s in pts], [s["stall_ms"]["p99"] or 0 for s in pts], "o-",
                    label="scheduler " + ("on" if sched else "off"))
        ax.set_xlabel("concurrent sandboxes")
        ax.set_ylabel("stall p99 (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "scale.png", dpi=100)
        plt.close(fig)
        made.append("scale.png")
    return made


def write_out(result: dict[str, Any], a: argparse.Namespace, argv: list[str]) -> None:
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "report.md").write_text(report_md(result, argv))
        result_plots = plots(result, out)
        print(f"wrote {out / 'results.json'}, report.md, {', '.join(result_plots)}", file=sys.stderr)
    if a.json:
        print(json.dumps(result))
    else:
        print(report_md(result, argv))


__all__ = ["progress", "summarize", "write_out", "report_md", "plots", "inspector_fields", "METHODS", "FULL_BASELINE"]
