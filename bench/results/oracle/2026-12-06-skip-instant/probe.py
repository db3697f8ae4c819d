"""Replays one hand-made session with the new ops through bench.oracle and prints the FNs."""
import argparse, json, sys
from bench.oracle import Oracle, Outcome, Turn, AGENT_IN
a = argparse.Namespace(inspector="bpf", plant=False, serial=True, verbose=False, shrink_s=0)
o = Oracle(a)
o.start()
P = "/work/oracle-hold-w1"
turns = [
    Turn([["spawn", "w1", "holddel", "10000000", "100", "1", P], ["write", "/work/f0", "aa"]], ["bg:holddel"], 0),
    Turn([["heldfd", "w1", "append", "aabbcc"]], ["heldfd:append"], 0),
    Turn([["chattr", "/work/f0", "+A"]], ["fs:chattr"], 0),
    Turn([["heldfd", "w1", "truncate", "0005"]], ["heldfd:truncate"], 0),
    Turn([["chattr", "/work/f0", "-A"]], ["fs:chattr"], 0),
]
out = Outcome()
try:
    fns = o.run_session(turns, out, "probe")
    for f in fns:
        print(json.dumps({k: f.get(k) for k in ("turn", "plan", "differences", "reasons")}, default=str)[:1500])
    print("FN", len(fns), "plans", out.plans)
finally:
    o.close()
