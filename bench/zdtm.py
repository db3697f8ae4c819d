#!/usr/bin/env python3
"""zdtm conformance: CRIU's own static tests, each run through crabd.

Size: one benchmark driver (source fetch and verification, the static build,
the test image, five variants per test, the report); its pure parts (the
catalogue, .desc parsing) are unit-tested from here.

    python -m bench.zdtm [--quick] [--tests a,b,c] [--json] [--out DIR] [--jobs N]
                         [--variants native,dump_continue,auto_recovery,rollback,fork] [--share]
    python -m bench.zdtm --build-only [--tests a,b,c]
    (or: crabd bench zdtm ...)

CRIU's maintainers test checkpoint/restore with zdtm: small programs that
each set up one kind of process state (pipes, sockets, timers, signals,
locks, mappings, ...), daemonize, wait for SIGTERM, then check that state and
write PASS or FAIL to their output file. That is an oracle for "a process
came back exactly as it was" that no one here wrote, run the way containerd
runs one conformance suite against every snapshotter.

Source: the release tarball of the CRIU crabd runs (4.1.1, Debian 13's
`criu_4.1.1.orig.tar.xz`), fetched by `apt-get source --download-only`
through an apt configuration of its own (like setup-host's CRIU: the host's
apt never sees trixie), its SHA-256 checked against the signed Sources
index. The zdtm library and the static tests are built once with upstream's
own Makefiles as static binaries (USERCFLAGS=-Wno-error, LDFLAGS=-static),
cached under /var/cache/crabd-zdtm (CRABD_ZDTM_CACHE) by the tarball's
digest; a test that does not build here (a missing library or header) is
listed in `host_limited` with the compiler's message. The binaries and .desc
files are baked into a copy of the `debian-py` test image (`zdtm-<key>`,
cached in /var/lib/crabd-test), imported into the bench's own daemon.

Each test runs as upstream's Makefile starts it (its arguments:
--pidfile/--outfile, plus --filename/--dirname/... by its Makefile group),
as uid 18943 unless its .desc says `suid`, in a fresh sandbox per variant:

    native         start (one exec turn), SIGTERM, verdict
    dump_continue  start, a `true` turn (its checkpoint holds a CRIU image of
                   the test, dumped with the sandbox left running), SIGTERM
    auto_recovery  start, `true`, SIGKILL of every process of the sandbox from
                   the host (its cgroup), crabd's automatic recovery
                   (sandbox.died -> sandbox.rolled_back), SIGTERM
    rollback       start, `true`, a turn that SIGKILLs the test, rollback to
                   the `true` turn's checkpoint, SIGTERM
    fork           start, `true`, fork of the `true` checkpoint, SIGTERM in
                   the fork

With --share (CI: tests/integration/test_zdtm.py), fork, dump_continue
and rollback run in that order on one sandbox, each with its own verdict:
start, `true`, fork (SIGTERM in the fork), SIGTERM in the sandbox
(dump_continue), rollback to the `true` checkpoint and SIGTERM.

A variant passes when the verdict is PASS and the process really came back
(the checkpoint holds a process image; the rollback reply says `fs+proc`).
The reason of a failure is taken from the checkpoint's reasons (CRIU's
error), the recovery events, or the test's output file. Only the tests that
pass natively run the other variants: the pass counts are over them.

Not run (in `host_limited` with the reason): tests upstream runs only by hand
(`noauto`), tests that expect CRIU to fail (`crfail`), tests needing CRIU
features `criu check --feature` denies here, other architectures, a .desc
that is not a literal, a build failure, and tests that fail natively in a
crabd sandbox (what the sandbox lacks: capabilities, mounts, cgroups...).

Output (--json): {"tests", "native_pass", "variants": {"dump_continue":
{"pass"}, "auto_recovery": {"pass"}, "rollback": {"pass"}, "fork": {"pass"}},
"failures": [{"test", "variant", "reason"}], "host_limited": [{"test",
"reason"}], "results": [...every run...], "criu", "source", "seconds"}.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from crabd.errors import CommandFailed, CrabdError, FailedPrecondition

ROOT = Path(__file__).resolve().parent.parent

CRIU_VERSION = "4.1.1"
CRIU_SOURCE = f"criu_{CRIU_VERSION}.orig.tar.xz"
CACHE = Path(os.environ.get("CRABD_ZDTM_CACHE", "/var/cache/crabd-zdtm"))
TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
MIRROR = os.environ.get("CRABD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_IMAGE = "debian-py"
VARIANTS = ("native", "dump_continue", "auto_recovery", "rollback", "fork")
# Where the tests live in the image, and where they run (writable by uid 18943).
IMAGE_DIR = "/zdtm"
RUN_DIR = "/zdtm-run"
# Writable by every uid, as zdtm.py makes its test dir (`| 0o222`), and not
# sticky: a `suid` test starts as root, creates its output file, drops to
# uid 18943 (mlock_setuid) and renames that file at exit, which a sticky
# dir refuses to a uid that owns neither the file nor the dir.
RUN_DIR_MODE = 0o777
# zdtm.py's ids for non-suid tests ("numbers should match those in criu").
UNPRIVILEGED_ENV = {"ZDTM_UID": "18943", "ZDTM_GID": "58467", "ZDTM_GROUPS": "27495 48244"}
# Why tests run as root by default: CRIU reads every task's rlimits with
# prlimit(2), which for a task of another uid needs CAP_SYS_RESOURCE; these
# hosts deny it ("Can't get rlimit 0: Operation not permitted", issue 15's
# pid00), so under upstream's uid every dump fails for a host reason.
UPSTREAM_UID_NOTE = "--upstream-uid: every dump fails here on prlimit (no CAP_SYS_RESOURCE on these hosts)"
# Per-step hang guards (s): one hung test must not hang the run. Each is
# scaled by `load_factor` when the step starts: a CPU-bound test step takes
# longer in proportion to the load (socket-tcpbuf6 fills 100 MiB socket
# buffers 17 bytes per write: 17-27 s a variant at load 10-15, over the 90 s
# guard at load 27-37, bench/results/zdtm/2026-12-06-full/SUMMARY.md).
STEP_TIMEOUT = 90.0
VERDICT_WAIT = 30.0
MAX_LOAD_FACTOR = 6.0
# Tests whose own verdict needs the whole variant (start, checkpoint,
# restore, SIGTERM) inside a window they set from the environment, scaled
# like the guards: poll's child fails when its 5 s poll() (ZDTM_DELTA) times
# out a second time before the SIGTERM (its start time is never reset), which
# happens at load 27-37 (the bench's steps take 20-40 s there).
LOAD_SCALED_ENV = {"poll": ("ZDTM_DELTA", 5)}


def load_factor(load1: float | None = None, cpus: int | None = None) -> float:
    """How much longer than on an idle host a CPU-bound step may take:
    the 1-minute load per CPU, at least 1, at most MAX_LOAD_FACTOR (a real
    hang still ends). Pure given its arguments (default: this host's now)."""
    if load1 is None:
        load1 = os.getloadavg()[0]
    n = cpus or os.cpu_count() or 1
    return min(MAX_LOAD_FACTOR, max(1.0, load1 / n))


def guard(seconds: float, factor: float | None = None) -> float:
    """A hang guard of `seconds` on an idle host, scaled by the load."""
    return seconds * (load_factor() if factor is None else factor)


def load_env(name: str, factor: float | None = None) -> dict[str, str]:
    """The environment a test gets for its own time window (LOAD_SCALED_ENV)."""
    if name not in LOAD_SCALED_ENV:
        return {}
    var, base = LOAD_SCALED_ENV[name]
    return {var: str(math.ceil(base * (load_factor() if factor is None else factor)))}
# --share: these variants run one after the other on one sandbox (CI).
SHARED = ("fork", "dump_continue", "rollback")

# --quick: pipes, unix sockets, timers, signals, mappings, fds, a zombie.
# The failures issue 15 reports (point 2 fixes them).
ISSUE_15_FAILURES = ("stopped", "socket_udp", "socket-tcp", "socket-tcp-local", "file_locks00", "file_locks01",
                     "file_lease00", "pid00")
QUICK = ("pipe00", "sockets00", "socket_listen", "timers", "posix_timers", "sigpending", "maps04",
         "mprotect00", "zombie00", "fifo", "eventfs00", "write_read00")


# --- the test list, from upstream's Makefile and .desc files (pure) ------------------------------
@dataclass
class ZdtmTest:
    name: str
    args: list[str]                       # after the binary: --pidfile=... --outfile=... ...
    desc: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None               # why it does not run here (host_limited)

    @property
    def flags(self) -> list[str]:
        return str(self.desc.get("flags", "")).split()

    @property
    def criu_opts(self) -> list[str]:
        """CRIU options upstream passes for this test (crabd passes its own)."""
        return " ".join(str(self.desc.get(k, "")) for k in ("opts", "dopts", "ropts")).split()

    def env(self, upstream_uid: bool = False) -> dict[str, str]:
        """zdtm.py drops non-`suid` tests to uid 18943; by default they run
        as the sandbox's root here (see UPSTREAM_UID_NOTE)."""
        return dict(UNPRIVILEGED_ENV) if upstream_uid and "suid" not in self.flags else {}


def parse_desc(text: str) -> dict[str, Any]:
    """A test's .desc: a Python dict literal (upstream eval()s it; a literal
    is all we accept). Empty file = {}. Raises ValueError."""
    text = text.strip()
    if not text:
        return {}
    try:
        d = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"not a literal: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("not a dict")
    return d


def _make_lists(makefile: str) -> dict[str, list[str]]:
    """Upstream's `TST_X := a b \\ c` groups (the first assignment of each;
    the `+=` under ifeq are other architectures or optional libraries).
    A commented-out line inside a list drops that name. Pure."""
    text = re.sub(r"^#.*\n", "", makefile, flags=re.M).replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"^(TST_[A-Z_]+|TST)\s*:?=(.*)$", text, re.M):
        out.setdefault(m.group(1), m.group(2).split())
    return out


def _make_special_args(makefile: str) -> dict[str, str]:
    """`name.pid: name` rules with their own arguments (env00, umask00, ...)."""
    out = {}
    for m in re.finditer(r"^([\w+-]+)\.pid:\s*([\w+-]+)\s*\n\t\$\(<D\)/\$\(<F\)\s+(.*)$", makefile, re.M):
        out[m.group(1)] = m.group(3)
    return out


def test_args(name: str, group: str, special: str | None = None) -> list[str]:
    """The arguments upstream's Makefile starts a test with. Pure."""
    if special is not None:
        return special.replace("$@", f"{name}.pid").replace("$<", name).split()
    base = [f"--pidfile={name}.pid", f"--outfile={name}.out"]
    extra = {"TST_NOFILE": [], "TST_FILE": [f"--filename={name}.test"], "TST_DIR": [f"--dirname={name}.test"],
             "TST_DIR_FILE": [f"--dirname={name}.dir.test", f"--filename={name}.test"]}[group]
    return base + extra


# Makefile groups that run here: the rest (TST_DIR) are mostly mount, cgroup
# and mount-namespace tests.
GROUPS = ("TST_NOFILE", "TST_FILE")


def select_tests(makefile: str, descs: dict[str, str | None], *, arch: str = "x86_64",
                 features: Callable[[str], bool] = lambda f: True) -> list[ZdtmTest]:
    """Every test of GROUPS plus the ones with their own start rule, with the
    reason it does not run here (None: it runs). `descs`: name -> .desc text
    (None: no .desc). Pure but for `features` (criu check --feature). """
    lists = _make_lists(makefile)
    special = _make_special_args(makefile)
    tests: list[ZdtmTest] = []
    seen: set[str] = set()
    for group in GROUPS:
        for name in lists.get(group, []):
            if name not in seen:
                seen.add(name)
                tests.append(ZdtmTest(name, test_args(name, group, special.get(name))))
    for name, sp in special.items():
        if name not in seen and name in lists.get("TST", []):
            seen.add(name)
            tests.append(ZdtmTest(name, test_args(name, "TST_NOFILE", sp)))
    for t in tests:
        text = descs.get(t.name)
        try:
            t.desc = parse_desc(text) if text else {}
        except ValueError as e:
            t.skip = f".desc is not a literal ({e})"
            continue
        t.skip = skip_reason(t, arch, features)
    return tests


def skip_reason(t: ZdtmTest, arch: str, features: Callable[[str], bool]) -> str | None:
    """Why upstream's runner would not run `t` here either. Pure."""
    if arch not in str(t.desc.get("arch", arch)).split():  # one or several, e.g. rtc's "x86_64 aarch64 ..."
        return f"arch {t.desc['arch']} only"
    if "noauto" in t.flags:
        return "noauto: upstream runs it only by hand"
    if "crfail" in t.flags:
        return "crfail: upstream expects CRIU to refuse to dump it"
    if "crlib" in t.flags:
        return "crlib: needs a CRIU plugin library"
    for f in str(t.desc.get("feature", "")).split():
        if not features(f):
            return f"criu check --feature {f} fails on this host"
    return None


def verdict(out: str | None) -> tuple[bool, str]:
    """A test's output file -> (PASS?, reason). Upstream: PASS among the words
    of the last line. The reason is the last FAIL/error line otherwise."""
    if out is None:
        return False, "no output file (the test process is gone: it was not restored, or died)"
    lines = [x.strip() for x in out.splitlines() if x.strip()]
    if lines and "PASS" in lines[-1].split():
        return True, "PASS"
    if not lines:
        return False, "empty output file"
    bad = [x for x in lines if re.search(r"FAIL|ERR|rror|fail", x)]
    return False, (bad[-1] if bad else lines[-1])[:300]


def start_failure(out: str) -> str:
    """The reason in a start's `@@nostart exit N` output. Pure."""
    head, _, rest = out.partition("\n")
    lines = [x.strip() for x in rest.splitlines() if x.strip()]
    return f"did not start ({head[len('@@nostart '):].strip()}): {' | '.join(lines) or 'no message'}"[:400]


def read_verdict(out: str) -> tuple[bool, str]:
    """The verdict step's output -> (PASS?, reason). Pure."""
    if out.startswith("@@gone"):
        rest = out[len("@@gone"):].strip()
        return False, "the test process is gone (not restored)" + (f"; its log: {rest[-200:]}" if rest else "")
    if out.startswith("@@noout"):
        head, _, log = out.partition("\n")
        waited = head[len("@@noout"):].strip()
        return False, f"no verdict {waited or VERDICT_WAIT} s after SIGTERM; log: {log.strip()[-200:]}"
    return verdict(out)


# --- results and summary (pure) -----------------------------------------------------------------
@dataclass
class Outcome:
    test: str
    variant: str
    ok: bool
    reason: str = ""
    restored: str | None = None     # rollback/recovery: "fs+proc", "fs+proc (hot standby)", "fs"
    seconds: float = 0.0


def native_failure(t: ZdtmTest, reason: str) -> str:
    """The host_limited reason of a test that fails natively. Pure. A
    `reqrst` test is one upstream runs only with a dump and restore, with
    its own CRIU options (socket-tcp-close0: `--tcp-close`, which closes the
    connections crabd restores open): its check may need them."""
    if "reqrst" in t.flags:
        opts = " ".join(t.criu_opts) or "none"
        return (f"reqrst: upstream runs it only with a restore, with its CRIU options ({opts}); "
                f"natively it fails: {reason}")
    return f"fails natively in a crabd sandbox: {reason}"


def summarize(tests: list[ZdtmTest], outcomes: list[Outcome]) -> dict[str, Any]:
    """The JSON of `crabd bench zdtm --json`; pass counts are over the tests
    that pass natively. A test that fails natively is host_limited (the
    sandbox lacks what it needs), not a checkpoint failure."""
    by = {(o.test, o.variant): o for o in outcomes}
    ran = [t for t in tests if t.skip is None]
    limited = [{"test": t.name, "reason": t.skip} for t in tests if t.skip is not None]
    native_ok = []
    for t in ran:
        o = by.get((t.name, "native"))
        if o is None:
            continue
        if o.ok:
            native_ok.append(t.name)
        else:
            limited.append({"test": t.name, "reason": native_failure(t, o.reason)})
    variants = {v: {"pass": sum(1 for n in native_ok if (o := by.get((n, v))) is not None and o.ok),
                    "run": sum(1 for n in native_ok if (n, v) in by)} for v in VARIANTS[1:]}
    failures = [{"test": o.test, "variant": o.variant, "reason": o.reason}
                for o in outcomes if o.variant != "native" and not o.ok and o.test in native_ok]
    return {"tests": len([t for t in ran if (t.name, "native") in by]), "native_pass": len(native_ok),
            "variants": variants, "failures": failures, "host_limited": limited,
            "results": [asdict(o) for o in outcomes]}


def table_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the printed summary. Pure."""
    n = summary["native_pass"]
    rows = [("tests run", str(summary["tests"])), ("pass natively", str(n))]
    for v, d in summary["variants"].items():
        rows.append((v, f"{d['pass']} / {n}"))
    rows.append(("host-limited (not run or fail natively)", str(len(summary["host_limited"]))))
    if summary.get("not_run"):
        rows.append(("not run (the run was interrupted)", str(len(summary["not_run"]))))
    return rows


# --- source, build and image (root, network on a cold cache) ----------------------------------------
def _run(argv: list[str], timeout: float, what: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise FailedPrecondition(f"{what}: {argv[0]} timed out after {timeout} s",
                                 fix="check the host's load and network, then re-run") from None
    return p


def _apt_opts(a: Path) -> list[str]:
    return ["-o", f"Dir::Etc::SourceList={a}/sources.list", "-o", "Dir::Etc::SourceParts=/nonexistent",
            "-o", f"Dir::State::Lists={a}/lists", "-o", f"Dir::Cache={a}/cache", "-o", f"Dir::State::status={a}/status",
            "-o", "Dir::Etc::Preferences=/nonexistent", "-o", "Dir::Etc::PreferencesParts=/nonexistent",
            "-o", "Debug::NoLocking=1"]


def _sources_sha256(showsrc: str, filename: str) -> str | None:
    """The SHA-256 of `filename` in `apt-cache showsrc` output. Pure."""
    m = re.search(r"^\s([0-9a-f]{64})\s+\d+\s+" + re.escape(filename) + r"$", showsrc, re.M)
    return m.group(1) if m else None


def fetch_source(log: Callable[[str], None] = print) -> Path:
    """criu_<ver>.orig.tar.xz of trixie in CACHE/src, through apt (cached)."""
    src = CACHE / "src"
    tarball = src / CRIU_SOURCE
    digest_file = src / f"{CRIU_SOURCE}.sha256"
    if tarball.is_file() and digest_file.is_file():
        return tarball
    a = CACHE / "apt"
    for d in (a / "lists" / "partial", a / "cache" / "archives" / "partial", src):
        d.mkdir(parents=True, exist_ok=True)
    (a / "sources.list").write_text(
        f"deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {MIRROR} trixie main\n")
    (a / "status").touch()
    opts = _apt_opts(a)
    log("zdtm: apt-get update of a private trixie deb-src list")
    p = _run(["apt-get", *opts, "update"], 600, "apt-get update")
    if p.returncode != 0:
        raise FailedPrecondition(f"apt-get update of trixie sources failed: {p.stderr.strip()[-400:]}",
                                 fix=f"check access to {MIRROR}")
    show = _run(["apt-cache", *opts, "showsrc", "criu"], 60, "apt-cache showsrc").stdout
    want = _sources_sha256(show, CRIU_SOURCE)
    if want is None:
        raise FailedPrecondition(f"trixie's Sources has no {CRIU_SOURCE}", fix="check the mirror's trixie suite")
    log(f"zdtm: apt-get source --download-only criu={CRIU_VERSION}-1")
    # apt fetches the .dsc, the orig tarball and the Debian diff; only the
    # tarball is needed (some mirrors here answer 404 for the .dsc: apt then
    # exits non-zero with the tarball downloaded and verified).
    p = _run(["apt-get", *opts, "source", "--download-only", f"criu={CRIU_VERSION}-1"], 600,
             "apt-get source", cwd=src)
    if not tarball.is_file():
        raise FailedPrecondition(f"apt-get source did not fetch {CRIU_SOURCE}: {p.stderr.strip()[-400:]}",
                                 fix=f"check access to {MIRROR}")
    got = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if got != want:
        tarball.unlink()
        raise FailedPrecondition(f"{CRIU_SOURCE}: sha256 {got} is not {want} (trixie Sources)",
                                 fix="re-run; if it persists the mirror serves a wrong file")
    digest_file.write_text(got + "\n")
    return tarball


def source_tree(log: Callable[[str], None] = print) -> Path:
    """The unpacked source, CACHE/criu-<ver>-<sha12>/ (unpacked once)."""
    tarball = fetch_source(log)
    sha = (tarball.parent / f"{CRIU_SOURCE}.sha256").read_text().strip()
    tree = CACHE / f"criu-{CRIU_VERSION}-{sha[:12]}"
    if (tree / "test" / "zdtm" / "static" / "Makefile").is_file():
        return tree
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=CACHE))
    try:
        p = _run(["tar", "-xJf", str(tarball), "-C", str(tmp)], 300, "tar")
        if p.returncode != 0:
            raise FailedPrecondition(f"unpacking {tarball}: {p.stderr.strip()}", fix=f"rm {tarball} and re-run")
        inner = next(tmp.iterdir())
        shutil.rmtree(tree, ignore_errors=True)
        os.rename(inner, tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def load_tests(tree: Path) -> list[ZdtmTest]:
    static = tree / "test" / "zdtm" / "static"
    makefile = (static / "Makefile").read_text()
    names = set(_make_lists(makefile).get("TST", [])) | {n for g in GROUPS for n in _make_lists(makefile).get(g, [])}
    descs = {n: ((static / f"{n}.desc").read_text() if (static / f"{n}.desc").is_file() else None) for n in names}
    return select_tests(makefile, descs, arch=os.uname().machine, features=criu_feature)


_FEATURES: dict[str, bool] = {}


def criu_feature(name: str) -> bool:
    if name not in _FEATURES:
        p = _run(["criu", "check", "--feature", name], 60, "criu check")
        _FEATURES[name] = p.returncode == 0
    return _FEATURES[name]


def _build_env() -> dict[str, str]:
    # Upstream's CFLAGS carry -Werror (newer-gcc warnings are not our test);
    # LDFLAGS from the environment: the Makefile's per-test `+= -pthread`
    # still appends to it, which a command-line LDFLAGS would override.
    return {**os.environ, "USERCFLAGS": "-Wno-error", "LDFLAGS": "-static", "V": ""}


def build(tree: Path, names: Iterable[str], log: Callable[[str], None] = print,
          jobs: int = 2) -> dict[str, str | None]:
    """Build the zdtm library and `names` (static); name -> None if built,
    else the compiler's reason. Idempotent: make skips what is up to date,
    and a failure is remembered (build-failures.json) and not retried."""
    static = tree / "test" / "zdtm" / "static"
    failed_file = tree / "build-failures.json"
    failed: dict[str, str] = json.loads(failed_file.read_text()) if failed_file.is_file() else {}
    names = list(names)
    todo = [n for n in names if n not in failed and not (static / n).is_file()]
    if todo:
        t0 = time.monotonic()
        log(f"zdtm: building {len(todo)} test(s) static ({jobs} jobs)")
        lib = _run(["make", "-C", str(tree / "test" / "zdtm" / "lib"), f"-j{jobs}", "libzdtmtst.a"], 900,
                   "make lib", env=_build_env())
        if lib.returncode != 0:
            raise FailedPrecondition(f"building the zdtm library failed: {lib.stderr.strip()[-600:]}",
                                     fix="apt-get install gcc libc6-dev make, then re-run")
        _run(["make", "-C", str(static), "-k", f"-j{jobs}", *todo], 3600, "make tests", env=_build_env())
        for n in todo:
            if not (static / n).is_file():
                failed[n] = _build_error(static, n)
        failed_file.write_text(json.dumps(failed, indent=1, sort_keys=True))
        log(f"zdtm: built in {time.monotonic() - t0:.0f} s ({len([n for n in todo if n not in failed])} ok, "
            f"{len([n for n in todo if n in failed])} failed)")
    return {n: failed.get(n) for n in names}


def _build_error(static: Path, name: str) -> str:
    """The first error line of building `name` alone."""
    p = _run(["make", "-C", str(static), name], 300, "make", env=_build_env())
    lines = (p.stderr + p.stdout).splitlines()
    err = [x for x in lines if "error" in x or "cannot find" in x]
    return "does not build here: " + (err[0].strip() if err else (lines[-1].strip() if lines else "make failed"))[:240]


IMAGE_RECIPE = "3"  # bump when ensure_image puts something else in the image


def _image_key(static: Path, names: list[str]) -> str:
    h = hashlib.sha256(IMAGE_RECIPE.encode())
    for n in sorted(names):
        st = (static / n).stat()
        h.update(f"{n}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def ensure_image(tree: Path, names: list[str], log: Callable[[str], None] = print) -> str:
    """A `zdtm-<key>` image (debian-py + /zdtm/<test> and .desc) in the test
    image store, made once per set of binaries. Returns its name."""
    from crabd.runtime import Runtime
    static = tree / "test" / "zdtm" / "static"
    name = f"zdtm-{_image_key(static, names)}"
    images = Runtime(TEST_STATE).images
    if images.exists(name):
        return name
    if not images.exists(BASE_IMAGE):
        raise FailedPrecondition(f"the {BASE_IMAGE} test image is missing from {TEST_STATE}",
                                 fix="run the integration tests once (they build it), or wait for scripts/setup-host")
    log(f"zdtm: making image {name} ({BASE_IMAGE} + {len(names)} tests)")
    stage = Path(tempfile.mkdtemp(prefix="zdtm-image-", dir="/var/tmp"))
    try:
        root = stage / "rootfs"
        p = _run(["cp", "-a", "--reflink=auto", images.get(BASE_IMAGE).path, str(root)], 900, "cp")
        if p.returncode != 0:
            raise CommandFailed(["cp"], p.returncode, p.stderr, context="copy of the debian-py image")
        (root / IMAGE_DIR.lstrip("/")).mkdir()
        for n in names:
            shutil.copy2(static / n, root / IMAGE_DIR.lstrip("/") / n)
            if (static / f"{n}.desc").is_file():
                shutil.copy2(static / f"{n}.desc", root / IMAGE_DIR.lstrip("/") / f"{n}.desc")
        # Debug info is most of each binary and nothing a test needs; every
        # daemon's import copies the image.
        _run(["strip", "--strip-debug", *[str(root / IMAGE_DIR.lstrip("/") / n) for n in names]], 300, "strip")
        run = root / RUN_DIR.lstrip("/")
        run.mkdir()
        os.chmod(run, RUN_DIR_MODE)
        images.import_path(str(root), name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    for old in images.list():  # older sets of binaries
        if old.name.startswith("zdtm-") and old.name != name:
            try:
                images.remove(old.name)
            except CrabdError:
                pass
    return name


def prepare(names: list[str] | None, log: Callable[[str], None] = print,
            jobs: int = 2) -> tuple[list[ZdtmTest], str, Path]:
    """Source, build and image for `names` (None: every test that applies).
    Returns (tests, image name, source tree); tests that do not build get
    their `skip` reason."""
    tree = source_tree(log)
    tests = load_tests(tree)
    if names is not None:
        known = {t.name for t in tests}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise FailedPrecondition(f"unknown zdtm test(s): {', '.join(unknown)}",
                                     fix="pick names of test/zdtm/static tests (TST_NOFILE, TST_FILE groups)")
        tests = [t for t in tests if t.name in names]
    runnable = [t for t in tests if t.skip is None]
    built = build(tree, [t.name for t in runnable], log, jobs)
    for t in runnable:
        if built[t.name] is not None:
            t.skip = built[t.name]
    # The image holds every binary built so far (a subset run after the
    # full build reuses the full image).
    static = tree / "test" / "zdtm" / "static"
    present = sorted(t.name for t in load_tests(tree) if t.skip is None and (static / t.name).is_file())
    image = ensure_image(tree, present, log) if present else BASE_IMAGE
    return tests, image, tree


# --- one test in one sandbox per variant (root, a running daemon) ---------------------------------
class Suite:
    """The tests run against one daemon; each variant in a fresh sandbox."""

    def __init__(self, daemon: Any, image: str, stop: threading.Event, upstream_uid: bool = False,
                 share: bool = False) -> None:
        from crabd.runtime import Runtime
        self.upstream_uid = upstream_uid
        self.share = share
        self.daemon = daemon
        self.image = image
        self.rt = Runtime(daemon.state)
        self.stop = stop

    def client(self) -> Any:
        from crabd.client import Client
        # A turn that stalls (CRIU hung on a stopped task) must not hang the run.
        return Client(self.daemon.socket, timeout=STEP_TIMEOUT * 3 * MAX_LOAD_FACTOR)

    def run_test(self, t: ZdtmTest, variants: Iterable[str]) -> list[Outcome]:
        out: list[Outcome] = []
        variants = list(variants)
        shared = [v for v in SHARED if v in variants] if self.share else []
        with self.client() as c:
            for v in [v for v in variants if v not in shared] + (["shared"] if shared else []):
                if self.stop.is_set():
                    break
                if v == "shared":
                    out.extend(self.shared(c, t, shared))
                    continue
                o = self._timed(t, v, lambda: self.native(c, t) if v == "native" else self.checkpointed(c, t, v))
                out.append(o)
                if v == "native" and not o.ok:
                    break  # the other variants count only over tests that pass natively
        return out

    def _timed(self, t: ZdtmTest, v: str, step: Callable[[], Outcome]) -> Outcome:
        t0 = time.monotonic()
        try:
            o = step()
        except Exception as e:  # crabd errors, hang guards, httpx timeouts: one test, not the run
            o = Outcome(t.name, v, False, f"{type(e).__name__}: {e}"[:400])
        o.seconds = round(time.monotonic() - t0, 2)
        return o

    # -- steps -------------------------------------------------------------------------------
    def _sandbox(self, c: Any) -> str:
        if self.stop.is_set():  # interrupted: make nothing the cleanup could miss
            raise InterruptedError("the run is stopping")
        return c.create_sandbox(self.image)["id"]

    def _drop(self, c: Any, *sids: str) -> None:
        for sid in sids:
            try:
                c.delete_sandbox(sid)
            except Exception:
                pass  # the daemon's shutdown deletes what is left

    def _start_sh(self, t: ZdtmTest) -> str:
        """Upstream's `make T.pid`: the test daemonizes, writes its pidfile
        once its state is set up, and its launcher exits 0; else the shell
        prints @@nostart and the test's own messages (its output file,
        renamed from .inprogress when it exits, then its stderr)."""
        argv = " ".join(shlex.quote(a) for a in [f"{IMAGE_DIR}/{t.name}", *t.args])
        n = shlex.quote(t.name)
        # stdout/stderr into a file, as a daemon's should be: a pipe back to
        # crabd's exec would be a descriptor CRIU cannot dump.
        return (f"{argv} >{n}.log 2>&1 || {{ echo \"@@nostart exit $?\"; "
                f"cat {n}.out {n}.out.inprogress {n}.log 2>/dev/null | tail -n 4; exit 0; }}")

    def _verdict_sh(self, t: ZdtmTest) -> str:
        """SIGTERM the test, wait for its output file, print it (@@gone: no
        such process; @@noout: no verdict in time)."""
        n = shlex.quote(t.name)
        wait = round(guard(VERDICT_WAIT))
        return (f"p=$(cat {n}.pid 2>/dev/null); "
                f"if [ -z \"$p\" ] || ! kill -0 \"$p\" 2>/dev/null; then echo @@gone; "
                f"tail -n 3 {n}.out.inprogress 2>/dev/null; exit 0; fi; kill -TERM \"$p\"; i=0; "
                f"while [ ! -e {n}.out ] && [ $i -lt {wait * 10} ]; do sleep 0.1; i=$((i+1)); done; "
                f"if [ -e {n}.out ]; then cat {n}.out; else echo @@noout {wait}; "
                f"tail -n 3 {n}.out.inprogress 2>/dev/null; fi")

    def _sh(self, c: Any, sid: str, t: ZdtmTest, script: str) -> str:
        return c.exec(sid, ["/bin/sh", "-c", script], cwd=RUN_DIR,
                      env={"TMPDIR": "/tmp", **t.env(self.upstream_uid), **load_env(t.name)},
                      timeout=guard(STEP_TIMEOUT))["stdout"]

    def _start(self, c: Any, sid: str, t: ZdtmTest) -> None:
        out = self._sh(c, sid, t, self._start_sh(t))
        if out.startswith("@@nostart"):
            raise AssertionError(start_failure(out))

    def _verdict(self, c: Any, sid: str, t: ZdtmTest) -> tuple[bool, str]:
        return read_verdict(self._sh(c, sid, t, self._verdict_sh(t)))

    def _committed(self, c: Any, cid: str) -> dict[str, Any]:
        from crabd.testing import wait_until
        return wait_until(lambda: (k := c.checkpoint(cid))["state"] == "committed" and k,  # type: ignore[return-value]
                          f"commit of checkpoint {cid}", guard(STEP_TIMEOUT), interval=0.1)

    def _proc_missing(self, c: Any, sid: str, ck: dict[str, Any]) -> str | None:
        """None if `ck` holds a process image; else why not (CRIU's error
        from the checkpoint's reasons, here or in the one it inherits from)."""
        if ck.get("proc_image"):
            return None
        why = [r for k in c.checkpoints(sid) for r in (k.get("reasons") or []) if "process image not captured" in r]
        if why:
            return why[-1][:400]
        return f"checkpoint {ck['id']} (plan {ck['plan']}) holds no process image: {ck.get('reasons')}"[:400]

    def _start_and_true(self, c: Any, sid: str, t: ZdtmTest) -> dict[str, Any]:
        self._start(c, sid, t)
        r = c.exec(sid, ["true"], timeout=guard(STEP_TIMEOUT))
        return self._committed(c, r["checkpoint"])

    def _events(self, c: Any, sid: str, since: int) -> list[dict[str, Any]]:
        return c.events(since=since, sandbox=sid)

    # -- variants ----------------------------------------------------------------------------
    def native(self, c: Any, t: ZdtmTest) -> Outcome:
        sid = self._sandbox(c)
        try:
            # Start and SIGTERM in one turn: crabd checkpoints at the turn's
            # end, so nothing is dumped while the test runs.
            out = self._sh(c, sid, t, f"{self._start_sh(t)}; {self._verdict_sh(t)}")
            if out.startswith("@@nostart"):
                return Outcome(t.name, "native", False, start_failure(out))
            ok, why = read_verdict(out)
            return Outcome(t.name, "native", ok, why)
        finally:
            self._drop(c, sid)

    def checkpointed(self, c: Any, t: ZdtmTest, variant: str) -> Outcome:
        """The start of every variant but native: a fresh sandbox, the test
        started, a `true` turn whose checkpoint must hold a process image;
        then the variant's own steps on (sandbox, checkpoint)."""
        sid = self._sandbox(c)
        made: list[str] = []   # sandboxes the variant makes (forks), dropped too
        try:
            ck = self._start_and_true(c, sid, t)
            missing = self._proc_missing(c, sid, ck)
            if missing:
                return Outcome(t.name, variant, False, missing)
            ok, why, restored = getattr(self, variant)(c, t, sid, ck, made)
            return Outcome(t.name, variant, ok, why, restored)
        finally:
            self._drop(c, *made, sid)

    def shared(self, c: Any, t: ZdtmTest, variants: list[str]) -> list[Outcome]:
        """--share: `variants` (of SHARED, in its order) on one sandbox, each
        with its own verdict: start, `true` (checkpoint ck); a fork of ck,
        SIGTERM in the fork (fork); SIGTERM in the sandbox, dumped and left
        running (dump_continue); rollback to ck, SIGTERM (rollback: its kill
        turn finds the test already ended by that SIGTERM). Two sandboxes
        fewer per test than one per variant; a variant that breaks the
        sandbox can fail the ones after it."""
        sid = self._sandbox(c)
        made: list[str] = []
        t0 = time.monotonic()
        try:
            try:
                ck = self._start_and_true(c, sid, t)
                missing = self._proc_missing(c, sid, ck)
            except Exception as e:  # as _timed: one test, not the run
                missing = f"{type(e).__name__}: {e}"[:400]
            if missing:
                return [Outcome(t.name, v, False, missing, seconds=round(time.monotonic() - t0, 2)) for v in variants]
            return [self._timed(t, v, lambda v=v: Outcome(t.name, v, *getattr(self, v)(c, t, sid, ck, made)))
                    for v in variants]
        finally:
            self._drop(c, *made, sid)

    def dump_continue(self, c: Any, t: ZdtmTest, sid: str, ck: dict[str, Any],
                      made: list[str]) -> tuple[bool, str, str | None]:
        return (*self._verdict(c, sid, t), None)

    def auto_recovery(self, c: Any, t: ZdtmTest, sid: str, ck: dict[str, Any],
                      made: list[str]) -> tuple[bool, str, str | None]:
        from crabd.testing import wait_until
        since = max([e["seq"] for e in self._events(c, sid, 0)] or [0])
        for pid in self.rt.pids(sid):  # as the OOM killer or a crash would
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        done = ("sandbox.rolled_back", "sandbox.recovery_failed")
        evs = wait_until(lambda: (e := self._events(c, sid, since)) and any(x["kind"] in done for x in e) and e,
                         f"automatic recovery of {sid}", guard(STEP_TIMEOUT), interval=0.1)
        kinds = {e["kind"]: e for e in evs}  # type: ignore[union-attr]
        if "sandbox.recovery_failed" in kinds:
            return False, f"recovery failed: {kinds['sandbox.recovery_failed']['data'].get('error')}"[:400], None
        if "sandbox.restore_failed" in kinds:
            return False, f"restore failed: {kinds['sandbox.restore_failed']['data'].get('error')}"[:400], "fs"
        return (*self._verdict(c, sid, t), "fs+proc")

    def rollback(self, c: Any, t: ZdtmTest, sid: str, ck: dict[str, Any],
                 made: list[str]) -> tuple[bool, str, str | None]:
        c.exec(sid, ["/bin/sh", "-c", f"kill -KILL $(cat {t.name}.pid)"], cwd=RUN_DIR, timeout=guard(STEP_TIMEOUT))
        restored = c.rollback(sid, ck["id"]).get("restored")
        if not str(restored).startswith("fs+proc"):
            err = self._restore_errors(c, sid)
            why = f"processes not restored ({restored}): {err[-1] if err else 'no restore_failed event'}"
            return False, why[:400], restored
        return (*self._verdict(c, sid, t), restored)

    def fork(self, c: Any, t: ZdtmTest, sid: str, ck: dict[str, Any],
             made: list[str]) -> tuple[bool, str, str | None]:
        if self.stop.is_set():
            raise InterruptedError("the run is stopping")
        made.extend(c.fork(ck["id"])["sandboxes"])
        err = self._restore_errors(c, made[0])
        if err:
            return False, f"restore into the fork failed: {err[-1]}"[:400], "fs"
        return (*self._verdict(c, made[0], t), "fs+proc")

    def _restore_errors(self, c: Any, sid: str) -> list[str]:
        return [str(e["data"].get("error")) for e in self._events(c, sid, 0) if e["kind"] == "sandbox.restore_failed"]


# --- the run -----------------------------------------------------------------------------------------
def complete(outs: list[Outcome], variants: list[str]) -> bool:
    """A test's outcomes are a result: it failed natively, or every variant ran. Pure."""
    done = {o.variant for o in outs}
    return any(o.variant == "native" and not o.ok for o in outs) or set(variants) <= done


def order(tests: list[ZdtmTest]) -> list[ZdtmTest]:
    """Issue 15's failures and the quick set first (an interrupted run has
    them), then upstream's order. Pure."""
    first = {n: i for i, n in enumerate((*ISSUE_15_FAILURES, *QUICK))}
    return sorted(tests, key=lambda t: first.get(t.name, len(first)))


def run(tests: list[ZdtmTest], image: str, variants: list[str], jobs: int,
        progress: Callable[[Outcome], None] = lambda o: None,
        upstream_uid: bool = False, share: bool = False) -> tuple[list[Outcome], bool]:
    """Start a daemon on a temp state dir, run every runnable test, clean up.
    Returns (outcomes, interrupted): on SIGTERM or ^C the tests finished so
    far are the result, the ones in flight are dropped."""
    from crabd.runtime import Runtime
    from crabd.testing import DaemonHandle, cleanup_state_dir
    state = Path(tempfile.mkdtemp(prefix="crabd-zdtm-", dir="/var/tmp"))
    stop = threading.Event()
    def interrupt(*_: object) -> None:
        if not stop.is_set():  # once: a second SIGTERM must not cut the cleanup short
            stop.set()
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    daemon = DaemonHandle(state)
    outcomes: list[Outcome] = []
    interrupted = False
    lock = threading.Lock()

    def one(suite: Suite, t: ZdtmTest) -> None:
        outs = suite.run_test(t, variants)
        with lock:
            if stop.is_set() or not complete(outs, variants):
                return  # cut short by the interruption (the daemon going away), not a result
            outcomes.extend(outs)
        for o in outs:
            progress(o)

    try:
        Runtime(state).images.import_path(Runtime(TEST_STATE).images.get(image).path, image)
        daemon.start()
        suite = Suite(daemon, image, stop, upstream_uid, share)
        runnable = order([t for t in tests if t.skip is None])
        # `excl` tests (upstream: never beside another test) run alone, after the rest.
        shared = [t for t in runnable if "excl" not in t.flags]
        alone = [t for t in runnable if "excl" in t.flags]
        pool = ThreadPoolExecutor(max(1, jobs))
        try:
            list(pool.map(lambda t: one(suite, t), shared))
            for t in alone:
                one(suite, t)
        except KeyboardInterrupt:
            interrupted = True
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        finally:
            # No new variant or sandbox starts; the ones in flight end and
            # drop their sandboxes before the daemon's shutdown lists what is
            # left (a sandbox made after that list would outlive the daemon).
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        stop.set()
        signal.signal(signal.SIGTERM, old)
        daemon.shutdown()
        cleanup_state_dir(state)
    rank = {v: i for i, v in enumerate(VARIANTS)}
    with lock:
        return sorted(outcomes, key=lambda o: (o.test, rank.get(o.variant, 9))), interrupted


def report_md(summary: dict[str, Any], argv: list[str]) -> str:
    """The saved table (bench/results/zdtm/zdtm.md). Pure."""
    lines = [f"`{' '.join(argv)}`", "", "| | pass |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in table_rows(summary)]
    if summary["failures"]:
        lines += ["", "| test | variant | reason |", "|---|---|---|"]
        lines += [f"| {f['test']} | {f['variant']} | {f['reason'].replace('|', '/')} |" for f in summary["failures"]]
    if summary["host_limited"]:
        lines += ["", "| host-limited test | reason |", "|---|---|"]
        lines += [f"| {h['test']} | {h['reason'].replace('|', '/')} |" for h in summary["host_limited"]]
    return "\n".join(lines) + "\n"


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console()
    t = Table(title=f"zdtm through crabd (CRIU {CRIU_VERSION} static tests)")
    t.add_column("")
    t.add_column("pass", justify="right")
    for k, v in table_rows(summary):
        t.add_row(k, v)
    con.print(t)
    if summary["failures"]:
        f = Table(title="failures")
        for col in ("test", "variant", "reason"):
            f.add_column(col, overflow="fold")
        for x in summary["failures"]:
            f.add_row(x["test"], x["variant"], x["reason"])
        con.print(f)
    con.print(f"host-limited: {', '.join(h['test'] for h in summary['host_limited'])}")


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--tests", help="comma-separated test names")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--jobs", type=int, default=2, help="tests run at once (and make -j)")
    ap.add_argument("--upstream-uid", action="store_true",
                    help="run non-suid tests as uid 18943 like zdtm.py (" + UPSTREAM_UID_NOTE.split(": ", 1)[1] + ")")
    ap.add_argument("--share", action="store_true",
                    help=f"run {', '.join(SHARED)} one after the other on one sandbox per test (fewer sandboxes, "
                         "for CI; one variant that breaks the sandbox can fail the next)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="write zdtm.json and zdtm.md there")
    ap.add_argument("--build-only", action="store_true", help="fetch, build and make the image, run nothing")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("crabd bench zdtm needs root (runc, CRIU)", file=sys.stderr)
        return 2
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "native" not in variants:
        print(f"--variants: native plus any of {', '.join(VARIANTS[1:])}", file=sys.stderr)
        return 2
    names = a.tests.split(",") if a.tests else (list(QUICK) if a.quick else None)
    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        tests, image, tree = prepare(names, log, a.jobs)
    except CrabdError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    built_s = time.monotonic() - t0
    if a.build_only:
        log(f"zdtm: image {image}, {len([t for t in tests if t.skip is None])} tests ready in {built_s:.0f} s")
        return 0

    def progress(o: Outcome) -> None:
        log(f"{o.test:28} {o.variant:14} {'PASS' if o.ok else 'FAIL'} {o.seconds:6.1f}s"
            + ("" if o.ok else f"  {o.reason[:150]}"))

    load_start = os.getloadavg()
    outcomes, interrupted = run(tests, image, variants, a.jobs, progress, a.upstream_uid, a.share)
    if interrupted:
        log("zdtm: interrupted; sandboxes and the daemon were cleaned up; the tests finished so far follow")
    s = summarize(tests, outcomes)
    finished = {o.test for o in outcomes}
    s["complete"] = not interrupted
    s["not_run"] = [t.name for t in tests if t.skip is None and t.name not in finished]
    crv = _run(["criu", "--version"], 30, "criu").stdout.split("\n")[0]
    s.update(criu=crv, source=f"{CRIU_SOURCE} (Debian trixie), sha256 "
             f"{(CACHE / 'src' / f'{CRIU_SOURCE}.sha256').read_text().strip()}",
             image=image, prepare_seconds=round(built_s, 1), seconds=round(time.monotonic() - t0, 1),
             variants_run=variants, upstream_uid=a.upstream_uid, share=a.share,
             load_start=[round(x, 2) for x in load_start], load_end=[round(x, 2) for x in os.getloadavg()],
             guards={"step_s": STEP_TIMEOUT, "verdict_s": VERDICT_WAIT,
                     "scaled_by": f"1-min load per CPU at the step's start, 1 to {MAX_LOAD_FACTOR:g}",
                     "load_scaled_env": {k: f"{v}={b} s, scaled" for k, (v, b) in LOAD_SCALED_ENV.items()}})
    cmd = ["crabd", "bench", "zdtm", *(argv if argv is not None else sys.argv[1:])]
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "zdtm.json").write_text(json.dumps(s, indent=1) + "\n")
        (a.out / "zdtm.md").write_text(report_md(s, cmd))
        log(f"wrote {a.out / 'zdtm.json'}, zdtm.md")
    if a.json:
        print(json.dumps(s))
    else:
        print_table(s)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
