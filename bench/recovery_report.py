"""The recovery benchmark's output: progress on stderr, the per-method summary
(the JSON of `crabd bench recovery`), report.md and PNG plots."""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from recovery import METHODS, RunRecord, pct, record_dict


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
    return {"p50": pct(xs, 0.5), "p99": pct(xs, 0.99)}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def overhead(clean: list[RunRecord], refs: list[RunRecord]) -> dict[str, Any]:
    """End-to-end overhead of a method's fault-free runs against the bare
    reference runs: per trace the median over rounds (--reps), summed over
    traces. `overhead_reps` pairs each round's runs (one figure per round; their
    spread is the noise), `overhead_by_trace` splits it per trace, and
    `command_s`/`stall_s` say where the time went (median per trace, summed):
    the turns' commands as the agent saw them, and how long they waited for
    the previous capture."""
    traces = sorted({r.trace for r in clean})

    def med(rs: list[RunRecord], f: Callable[[RunRecord], float]) -> float:
        return _median([f(r) for r in rs])

    by_trace, base, mine = {}, 0.0, 0.0
    cmd = {"bare": 0.0, "method": 0.0}
    stall = 0.0
    for t in traces:
        m_runs = [r for r in clean if r.trace == t]
        r_runs = [r for r in refs if r.trace == t]
        b, x = med(r_runs, lambda r: r.seconds), med(m_runs, lambda r: r.seconds)
        by_trace[t] = round((x - b) / b * 100, 2)
        base, mine = base + b, mine + x
        cmd["bare"] += med(r_runs, lambda r: sum(r.durations))
        cmd["method"] += med(m_runs, lambda r: sum(r.durations))
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
            "bytes_vs_full_pct": None,
            "overhead_pct": None,
            "ckpt_ms": _q([x for r in clean for x in r.ckpt_ms]),
            "stall_ms": _q([x for r in clean for x in r.stall_ms]),
            "rollback_ms": _q([r.rollback_ms for r in faulted if r.rollback_ms is not None]),
            "skip_fraction": round(plans.count("SKIP") / len(plans), 3) if plans else None,
            "fault_free_correct": all(bool(r.correct) for r in clean) if clean else None,
            "wrong": [f"{r.trace} {r.fault}@{r.k}" for r in faulted if not r.correct],
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
    out.update(traces=[t.name for t in traces], quick=a.quick, faults=faults, time_scale=a.time_scale,
               reps=reps,
               inspector=a.inspector,
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
        lines += [f"traces: {', '.join(result.get('traces', []))}; LLM waits × {result.get('time_scale')}", "",
                  "| method | correct | " + " | ".join(faults) + (" | " if faults else "") +
                  "bytes (% of full) | overhead | ckpt p50/p99 ms | stall p50/p99 ms | recovery p50/p99 ms | SKIP |",
                  "|---|---|" + "---|" * len(faults) + "---|---|---|---|---|---|"]
        for m, r in result["methods"].items():
            bf = " | ".join("–" if r["correct_by_fault"].get(f) is None else f"{r['correct_by_fault'][f]} %"
                            for f in faults)
            full = "" if r["bytes_vs_full_pct"] is None else f" ({r['bytes_vs_full_pct']} %)"
            corr = "–" if r["correct_pct"] is None else f"{r['correct_pct']} % of {r['runs']}"
            ovh = "–" if r["overhead_pct"] is None else f"{r['overhead_pct']:+.1f} %"
            skip = "–" if r["skip_fraction"] is None else f"{100 * r['skip_fraction']:.0f} %"
            lines.append(f"| {m} | {corr} | {bf}{' | ' if faults else ''}{r['bytes'] / 1e6:.1f} MB{full} | {ovh} | "
                         f"{_fmt_ms(r['ckpt_ms'])} | {_fmt_ms(r['stall_ms'])} | {_fmt_ms(r['rollback_ms'])} | {skip} |")
        ovh = {m: r for m, r in result["methods"].items() if r.get("overhead_by_trace")}
        if ovh:
            lines += ["", f"Overhead of the fault-free runs (median of {result.get('reps', 1)} round(s) per trace; "
                      "turns and LLM waits, against the bare runtime):", "",
                      "| method | overhead | per round | per trace | turns s (bare → method) | "
                      "commands s (bare → method) | stall s |", "|---|---|---|---|---|---|---|"]
            for m, r in ovh.items():
                per_trace = ", ".join(f"{t} {v:+.1f} %" for t, v in r["overhead_by_trace"].items())
                rounds = ", ".join(f"{v:+.1f} %" for v in r["overhead_reps"])
                lines.append(f"| {m} | {r['overhead_pct']:+.2f} % | {rounds} | {per_trace} | "
                             f"{r['turns_s']['bare']} → {r['turns_s']['method']} | "
                             f"{r['command_s']['bare']} → {r['command_s']['method']} | {r['stall_s']} |")
        wrong = [(m, r["wrong"]) for m, r in result["methods"].items() if r["wrong"]]
        if wrong:
            lines += ["", "Wrong recoveries:", ""] + [f"- {m}: {', '.join(w)}" for m, w in wrong]
        notes = [f"- {r['method']} {r['trace']} {r['fault']}@{r['k']}: {r['note']}"
                 for r in result.get("runs", []) if r.get("note")]
        if notes:
            lines += ["", "Notes:", ""] + notes
    if result.get("chain"):
        from recovery_chain import report_lines
        lines += [f"traces: {', '.join(result.get('traces', []))}; LLM waits × {result.get('time_scale')}"]
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


__all__ = ["progress", "summarize", "write_out", "report_md", "plots", "METHODS"]
