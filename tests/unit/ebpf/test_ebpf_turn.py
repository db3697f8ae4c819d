"""Pure helpers of the aggregation: path scopes, package managers, external tools."""

import pytest

from ebpf._turn import external_tool, package_manager, path_scope


@pytest.mark.parametrize("path,scope", [
    ("/dev/null", "device"), ("/dev/pts/3", "device"), ("/dev/tty", "device"), ("/dev/urandom", "device"),
    ("/dev/pts/../../etc/passwd", "rootfs"),
    ("/dev/stdout", "rootfs"), ("/dev/fd/1", "rootfs"),
    ("/dev/shm/x", "tmpfs"), ("/dev/newfile", "tmpfs"),
    ("/proc/self/oom_score_adj", "process"), ("/proc/thread-self/comm", "process"),
    ("/proc/self/fd/3", "rootfs"), ("/proc/12/cwd/x", "rootfs"), ("/proc/self/root/etc/x", "rootfs"),
    ("/proc/sys/vm/drop_caches", "kernel"), ("/sys/fs/cgroup/x", "kernel"), ("/proc/12/comm", "kernel"),
    ("/tmp/x", "rootfs"), ("/app/f", "rootfs"), ("f", "rootfs"), ("../dev/null", "rootfs"),
    ("//dev/null", "device"), ("/devices/x", "rootfs"),
])
def test_path_scope(path, scope):
    assert path_scope(path) == scope


@pytest.mark.parametrize("filename,argv,pm", [
    ("/usr/bin/apt-get", ["apt-get", "install", "x"], "apt"),
    ("/usr/bin/dpkg", ["dpkg", "-i", "x.deb"], "dpkg"),
    ("/usr/local/bin/pip3.11", ["pip3.11", "install", "."], "pip"),
    ("/usr/bin/python3", ["python3", "-m", "pip", "install", "w.whl"], "pip"),
    ("/usr/bin/npm", ["npm", "i"], "npm"),
    ("/root/.cargo/bin/cargo", ["cargo", "build"], "cargo"),
    ("/usr/local/go/bin/go", ["go", "build"], "go"),
    ("/usr/bin/gem", ["gem", "install", "x"], "gem"),
    ("/usr/bin/python3", ["python3", "-c", "print(1)"], None),
    ("/usr/bin/ls", ["ls"], None),
])
def test_package_manager(filename, argv, pm):
    assert package_manager(filename, argv) == pm


@pytest.mark.parametrize("filename,argv,ext", [
    ("/usr/bin/curl", ["curl", "https://x"], "curl"),
    ("/usr/bin/wget", ["wget", "x"], "wget"),
    ("/usr/bin/ssh", ["ssh", "host"], "ssh"),
    ("/usr/bin/git", ["git", "push", "origin", "main"], "git push"),
    ("/usr/bin/git", ["git", "-C", "repo", "push"], "git push"),
    ("/usr/bin/git", ["git", "commit", "-m", "x"], None),
    ("/usr/bin/git", ["git", "status"], None),
    ("/usr/bin/npm", ["npm", "publish"], "npm publish"),
    ("/usr/bin/cat", ["cat", "f"], None),
])
def test_external_tool(filename, argv, ext):
    assert external_tool(filename, argv) == ext


def test_an_open_the_kernel_saw_land_on_proc_is_kernel_state():
    from ebpf._events import Event, EventKind
    from ebpf._turn import TurnRecorder
    O_WRONLY = 1
    r = TurnRecorder()
    # relative path, but the kernel says: proc
    r.add(Event(EventKind.OPEN_WRITE, tag=1, pid=5, path="oom_score_adj", arg=O_WRONLY, fsmagic=0x9FA0, fsmode=0o100644))
    # a device node on a tmpfs: not state
    r.add(Event(EventKind.OPEN_WRITE, tag=1, pid=5, path="null", arg=O_WRONLY, fsmagic=0x01021994, fsmode=0o020666))
    # the root file system by the kernel's word too
    r.add(Event(EventKind.OPEN_WRITE, tag=1, pid=5, path="a.txt", arg=O_WRONLY, fsmagic=0xEF53, fsmode=0o100644))
    assert r.special["kernel"].count == 1 and "oom_score_adj (on kernel fs)" in r.special["kernel"].sample
    assert "tmpfs" not in r.special
    assert r.files["write"].count == 2  # null and a.txt: paths alone say rootfs
