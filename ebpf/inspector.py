"""Command line of the BPF inspector.

    python -m ebpf.inspector --print-program        the generated BPF C program
    python -m ebpf.inspector --watch CGROUP_DIR     Effects and Plan per Enter key
"""

from __future__ import annotations

import argparse
import sys

from ebpf._events import program_text
from ebpf._inspector import Inspector


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ebpf.inspector", description="crabd BPF turn inspector")
    ap.add_argument("--print-program", action="store_true", help="print the generated BPF C program and exit")
    ap.add_argument("--follow-pids", action="store_true", help="the pid-following variant (no cgroup v2)")
    ap.add_argument("--no-write-counts", action="store_true", help="the variant without write-family counters")
    ap.add_argument("--watch", metavar="CGROUP", help="watch a cgroup v2 directory; print each turn on Enter")
    args = ap.parse_args(argv)
    if args.print_program:
        sys.stdout.write(program_text(args.follow_pids, not args.no_write_counts))
        return 0
    if args.watch:
        from ebpf.classifier import classify

        with Inspector() as insp:
            insp.watch("cli", args.watch)
            print("watching; press Enter to end a turn, Ctrl-D to stop", file=sys.stderr)
            for _ in sys.stdin:
                eff = insp.end_turn("cli")
                plan = classify(eff)
                print(eff.model_dump_json(indent=2, exclude_defaults=True))
                print(f"plan: {plan.kind.value}: " + "; ".join(plan.reasons))
        return 0
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
