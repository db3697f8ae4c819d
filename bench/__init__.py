"""crabd's benchmarks: one module per benchmark (`python -m bench.NAME`, or
`crabd bench NAME` from a source checkout), each with a `parser()` of its
options and a `main(argv)`.

Shared parts: `bench._stats` (the one percentile and median), `bench.harness`
(the daemon RSS sampler), and `crabd.testing` for what the tests share with the
benchmarks (a daemon, the busybox image, waiting until checkpoints settle).
Layering: bench imports crabd, deltafs, deltacr and ebpf; none of them imports
bench (the CLI's `crabd bench` loads a benchmark module only when asked).
"""

# name shown by `crabd bench` -> module of this package
COMMANDS = {
    "fs": "fs",
    "inspector": "inspector",
    "cr": "cr",
    "recovery": "recovery",
    "swebench": "swebench",
    "seals": "seals",
    "check-traces": "check_traces",
    "chaos": "chaos",
    "langgraph": "saver",
    "hostile": "hostile",
    "load": "load",
    "stall": "stall",
    "effects": "effects",
    "oracle": "oracle",
    "latency": "latency",
    "docker": "docker",
    "zdtm": "zdtm",
    "ui": "ui",
    "remote": "remote",
}
