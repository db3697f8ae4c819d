"""Plain CRIU 4.1.1 (no runc, no crabd) dumping a tree with a SIGSTOPped child,
the tree in a v1 freezer cgroup and in a cgroup of the unified (v2) hierarchy
of this hybrid host. Modes: v1 (--freeze-cgroup on the v1 freezer), v2
(--freeze-cgroup on the unified cgroup), none (no --freeze-cgroup)."""
import os, subprocess, sys, time, shutil
mode = sys.argv[1]
name = f"h15-stop-{mode}"
v1 = f"/sys/fs/cgroup/freezer/{name}"; v2 = f"/sys/fs/cgroup/unified/{name}"
for d in (v1, v2): os.makedirs(d, exist_ok=True)
def pre():
    os.setsid()
    for d in (v1, v2):
        with open(f"{d}/cgroup.procs", "w") as f: f.write(str(os.getpid()))
p = subprocess.Popen(["/bin/sh", "-c", "sleep 1000 & kill -STOP $!; echo $!; wait"], preexec_fn=pre,
                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
child = int(p.stdout.readline())
time.sleep(0.3)
st = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
print(f"mode={mode} tree={p.pid} stopped child={child} state={st}")
img = f"/tmp/h15/repro/img-{mode}"; shutil.rmtree(img, ignore_errors=True); os.makedirs(img)
argv = ["/usr/local/bin/criu", "dump", "-t", str(p.pid), "-D", img, "-o", "dump.log", "-v4", "--leave-running"]
if mode == "v1": argv += ["--freeze-cgroup", v1]
if mode == "v2": argv += ["--freeze-cgroup", v2]
t = time.monotonic()
try:
    r = subprocess.run(argv, timeout=20, capture_output=True)
    print(f"criu dump rc={r.returncode} in {time.monotonic()-t:.1f}s", r.stderr.decode()[-300:])
except subprocess.TimeoutExpired:
    print(f"criu dump HUNG: killed after 20 s")
log = open(f"{img}/dump.log").read().splitlines()
print("last log lines:", *log[-3:], sep="\n  ")
st = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
print(f"child state after: {st}; v1 freezer: {open(v1+'/freezer.state').read().strip()}; v2 frozen: {open(v2+'/cgroup.freeze').read().strip()}")
subprocess.run(["pkill", "-KILL", "-s", str(p.pid)]); 
with open(v1+"/freezer.state","w") as f: f.write("THAWED")
with open(v2+"/cgroup.freeze","w") as f: f.write("0")
p.wait()
time.sleep(0.5)
for d in (v1, v2):
    try: os.rmdir(d)
    except OSError as e: print("rmdir", d, e)
