/*
 * crabd ebpf inspector: what a sandbox's processes do to the OS, per turn.
 *
 * Tracepoints only (no kprobes on the hosts here). A task belongs to a
 * sandbox when its cgroup v2 id, or the id of one of its ancestors at a
 * registered level, is in `watched` (the value is the sandbox's tag, >= 1).
 * With FOLLOW_PIDS=1 (hosts without a unified hierarchy) membership is by
 * tgid instead, inherited on fork from a registered init.
 *
 * File changes are recorded at syscall exit and only when the call
 * succeeded: the arguments are stashed per thread at entry (`pending`), the
 * user strings are read at exit (they are still mapped: same syscall).
 * exec, network, mount and kernel-object calls are recorded at entry,
 * whatever their outcome: an attempt is enough to be unsure.
 * The write family is only counted (per-CPU counters per tag).
 *
 * Every event that cannot be recorded (ring buffer full, `pending` full)
 * increments `dropped[tag]`; userspace then assumes the worst for the turn.
 * Events are submitted without waking the reader (BPF_RB_NO_WAKEUP): it
 * polls every few milliseconds and drains at every turn end anyway, and a
 * wakeup per event would cost the traced process more than the event.
 *
 * The Python side prepends the constants (EV_*, MAX_TAGS, ...) generated from
 * ebpf/_events.py, the single source of truth for the event layout:
 * `python -m ebpf.inspector --print-program` shows the whole program.
 */
#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

/* The tracepoint formats come from the running kernel, the headers may be
 * older (6.12 headers on 6.18 here): 6.18's pwritev2 format names rwf_t,
 * which 6.12's linux/types.h does not define. A macro, not a typedef, so that
 * headers that do define it still compile. */
#define rwf_t int

struct event {
    u64 ts;            /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    u32 tag;
    u32 kind;          /* EV_* */
    u32 pid;           /* tgid, host pid namespace */
    u32 tid;
    s64 ret;           /* syscall result where known, else 0 */
    s64 arg;           /* flags / mode / child pid / request / backlog */
    s32 dfd;           /* directory fd of path (AT_FDCWD_ = none) */
    s32 dfd2;          /* directory fd of path2 */
    u16 family;        /* sockaddr family (net events) */
    u16 port;          /* host byte order */
    u32 nargs;         /* exec: number of argv slots filled */
    u32 fsmagic;       /* open for write: s_magic of the file system the file is on, 0 = unknown */
    u32 fsmode;        /* open for write: the opened inode's i_mode */
    u8 addr[16];
    char comm[16];
    char path[PATH_LEN];
    char path2[PATH_LEN];  /* second path, or exec argv: ARGV_SLOTS x ARG_LEN */
};

struct pending {
    u32 kind;
    u32 tag;
    s32 dfd;
    s32 dfd2;
    s64 arg;
    u64 path;    /* user pointers */
    u64 path2;
    u64 hash;    /* of the path string, when dedup applies */
    u32 dedup;
    u32 special; /* a path is under /dev, /proc or /sys */
    s32 keydfd;  /* dfd in the dedup key: AT_FDCWD_ for an absolute path */
    u32 pad;
};

/* Repeats within a turn: a process that opens (chmods, ...) the same path
 * again in the same turn adds nothing to the plan, but a syscall storm of
 * them would flood the ring buffer. The first *successful* call per
 * (sandbox, process, kind, dirfd, path) and turn is recorded; `epochs[tag]`
 * is the turn number, bumped by userspace at every turn end. Deletions are
 * never deduplicated, and a successful deletion forgets the path's
 * create/mkdir entries, so that create-delete pairs (which userspace may
 * cancel out) are always seen whole. */
struct seen_key {
    u32 tag;
    u32 tgid;
    s32 dfd;
    u32 kind;
    u64 hash;
};

struct pathbuf {
    char s[PATH_LEN];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_HASH(watched, u64, u32, MAX_TAGS);             /* cgroup id -> tag */
BPF_ARRAY(levels, u32, MAX_LEVELS);                /* ancestor levels to test, 0 = end */
BPF_HASH(watched_pids, u32, u32, MAX_PIDS);        /* tgid -> tag (FOLLOW_PIDS) */
BPF_HASH(pending, u64, struct pending, MAX_PENDING);
BPF_PERCPU_ARRAY(writes, u64, MAX_TAGS);
BPF_PERCPU_ARRAY(dropped, u64, MAX_TAGS);
BPF_ARRAY(epochs, u64, MAX_TAGS);
BPF_TABLE("lru_hash", struct seen_key, u64, seen, MAX_SEEN);
BPF_PERCPU_ARRAY(scratch, struct pathbuf, 1);

/* Past FILE_EMIT_LIMIT file events per CPU in a turn, plain file changes
 * (not under /dev, /proc, /sys) are only counted, per kind, in
 * `suppressed[tag * FILE_KINDS_MAX + kind]`: the turn is a file-system turn
 * whatever they are, and an untar of a big tree must not flood the ring.
 * Writes to /dev, /proc and /sys are always emitted: userspace needs their
 * paths to tell /dev/null from real state. */
struct emit_count {
    u64 epoch;
    u64 n;
};
BPF_PERCPU_ARRAY(emitted, struct emit_count, MAX_TAGS);
BPF_PERCPU_ARRAY(suppressed, u64, MAX_TAGS * FILE_KINDS_MAX);

/* --- crabd's own pause of a sandbox -------------------------------------------------
 * crabd freezes a sandbox for each capture, CRIU (for a process image) seizes
 * its threads with ptrace and runs parasite code in them, then everything is
 * thawed. What the parasite does is not the sandbox's: while a pause is armed
 * (`pauses[tag]`, set by userspace around it), a thread the host seized
 * (PTRACE_SEIZE/ATTACH by a task outside every sandbox) is not a member.
 * The freeze wakes tasks out of some calls (-ERESTART*, -EINTR at exit: a
 * `woke.restart` credit); after the thaw, a thread that only re-enters that
 * call, or restart_syscall, did nothing. Any other system call entry a
 * member makes while the pause is armed is counted (`woke.other`): that
 * thread did work, after the thaw or just before the freeze, and its process
 * belongs to the next turn. The raw_syscalls programs run for every system
 * call of the host: userspace attaches them only while a pause is armed
 * (`pausing` counts armed tags, and guards them too). */
struct woke {
    u32 tgid;
    u32 tag;
    s64 restart; /* the call an interruption allows to re-enter once, -1 = none */
    u64 other;   /* other system call entries */
};
BPF_ARRAY(pauses, u64, MAX_TAGS);                  /* tag -> 1 while a pause is armed */
BPF_ARRAY(pausing, u64, 1);                        /* number of armed tags */
BPF_TABLE("lru_hash", u32, u32, seized, MAX_PIDS); /* tids ptrace-seized from the host */
BPF_TABLE("lru_hash", u32, struct woke, woken, MAX_PIDS);

static __always_inline int pausing_now(void)
{
    int z = 0;
    u64 *n = pausing.lookup(&z);
    return n && *n;
}

static __always_inline u32 member_tag(void)
{
#if FOLLOW_PIDS
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *t = watched_pids.lookup(&tgid);
    return t ? *t : 0;
#else
    u64 id = bpf_get_current_cgroup_id();
    u32 *t = watched.lookup(&id);
    if (t)
        return *t;
    /* A sandbox may create cgroups below its own: test its ancestors at
     * the levels where sandbox cgroups live. */
#pragma unroll
    for (int i = 0; i < MAX_LEVELS; i++) {
        int k = i;
        u32 *lvl = levels.lookup(&k);
        if (!lvl || *lvl == 0)
            return 0;
        u64 anc = bpf_get_current_ancestor_cgroup_id(*lvl);
        t = watched.lookup(&anc);
        if (t)
            return *t;
    }
    return 0;
#endif
}

static __always_inline u32 sandbox_tag(void)
{
    u32 tag = member_tag();
    if (tag && pausing_now()) {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        if (seized.lookup(&tid))
            return 0; /* CRIU's parasite at work in it */
    }
    return tag;
}

/* --- where a path landed, from the kernel's side ----------------------------------
 * A path names a file the way the caller sees it: relative to a cwd or a
 * directory fd, through symlinks. Which file system the file is on is only
 * certain after the kernel resolved it: at the exit of an open, from the new
 * fd's struct file (fd_fs), or for a relative path, which directory it is
 * relative to (dir_id, part of the dedup key: the same relative name in
 * another directory is another file). The struct offsets come from the
 * running kernel's BTF (ebpf/_btf.py); without them (FD_FS = 0) both report
 * nothing and the path rules alone apply. */
static __always_inline void *kread_ptr(void *base, long off)
{
    void *v = 0;
    if (base)
        bpf_probe_read_kernel(&v, sizeof(v), (char *)base + off);
    return v;
}

static __always_inline void *fd_file(long fd)
{
#if FD_FS
    void *task = (void *)bpf_get_current_task();
    void *fdt = kread_ptr(kread_ptr(task, OFF_TASK_FILES), OFF_FILES_FDT);
    if (!fdt || fd < 0)
        return 0;
    u32 max = 0;
    bpf_probe_read_kernel(&max, sizeof(max), (char *)fdt + OFF_FDT_MAX_FDS);
    if ((u64)fd >= max)
        return 0;
    void **arr = kread_ptr(fdt, OFF_FDT_FD);
    return kread_ptr(arr, fd * sizeof(void *));
#else
    return 0;
#endif
}

static __always_inline void fd_fs(long fd, u32 *magic, u32 *mode)
{
#if FD_FS
    void *inode = kread_ptr(fd_file(fd), OFF_FILE_INODE);
    if (!inode)
        return;
    u16 m = 0;
    unsigned long mg = 0;
    bpf_probe_read_kernel(&m, sizeof(m), (char *)inode + OFF_INODE_MODE);
    bpf_probe_read_kernel(&mg, sizeof(mg), (char *)kread_ptr(inode, OFF_INODE_SB) + OFF_SB_MAGIC);
    u32 nlink = 1;
    bpf_probe_read_kernel(&nlink, sizeof(nlink), (char *)inode + OFF_INODE_NLINK);
    /* a regular file with no name left (deleted while a process holds it
     * open, reached again through /proc/PID/fd/N): only that process's
     * image holds its content (ebpf._events.FS_UNLINKED) */
    *mode = m | ((m & 0170000) == 0100000 && nlink == 0 ? FS_UNLINKED : 0);
    *magic = (u32)mg;
#endif
}

/* The directory a relative path starts from: the cwd's dentry, or the
 * dirfd's struct file; 0 when unknown. */
static __always_inline u64 dir_id(s32 dfd)
{
#if FD_FS
    if (dfd == AT_FDCWD_) {
        void *task = (void *)bpf_get_current_task();
        return (u64)kread_ptr(kread_ptr(task, OFF_TASK_FS), OFF_FS_PWD + OFF_PATH_DENTRY);
    }
    return (u64)fd_file(dfd);
#else
    return 0;
#endif
}

/* Does an open that landed on (magic, mode) change state a file-system
 * snapshot does not hold? A deleted file does; device nodes do not (whatever fs holds the node);
 * proc, sysfs, cgroup fs, memory file systems do: the magics are
 * ebpf._events.LANDED_SCOPE, generated into LANDS_SPECIAL_CASES. */
static __always_inline u32 lands_special(u32 magic, u32 mode)
{
    u32 fmt = mode & 0170000;
    if (mode & FS_UNLINKED)
        return 1;
    if (!magic || fmt == 0020000 || fmt == 0060000) /* unknown, chr, blk */
        return 0;
    switch (magic) {
    LANDS_SPECIAL_CASES
        return 1;
    }
    return 0;
}

static __always_inline void count_drop(u32 tag)
{
    int k = tag;
    u64 *c = dropped.lookup(&k);
    if (c)
        *c += 1;
}

static __always_inline struct event *new_event(u32 tag, u32 kind)
{
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        count_drop(tag);
        return 0;
    }
    u64 pt = bpf_get_current_pid_tgid();
    e->ts = bpf_ktime_get_ns();
    e->tag = tag;
    e->kind = kind;
    e->pid = pt >> 32;
    e->tid = (u32)pt;
    e->ret = 0;
    e->arg = 0;
    e->dfd = AT_FDCWD_;
    e->dfd2 = AT_FDCWD_;
    e->family = 0;
    e->port = 0;
    e->nargs = 0;
    e->fsmagic = 0;
    e->fsmode = 0;
    __builtin_memset(e->addr, 0, sizeof(e->addr));
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    e->path[0] = 0;
    e->path2[0] = 0;
    return e;
}

/* --- file changes: stash at entry, record at exit if it succeeded ---------- */

/* FNV-1a of a user string; 0 when it cannot be read. */
static __always_inline u64 path_hash(const void *upath)
{
    int z = 0;
    struct pathbuf *b = scratch.lookup(&z);
    if (!b)
        return 0;
    b->s[0] = 0;
    if (!upath)
        return 0;
    long n = bpf_probe_read_user_str(b->s, sizeof(b->s), upath);
    if (n <= 0) {
        b->s[0] = 0;
        return 0;
    }
    u64 h = 14695981039346656037ULL;
    for (int i = 0; i < PATH_LEN; i++) {
        if (i >= n)
            break;
        h ^= (u8)b->s[i];
        h *= 1099511628211ULL;
    }
    return h | 1; /* never 0 */
}

/* The directory fd as part of a dedup key: irrelevant for an absolute path
 * (so that a deletion by another dirfd forgets the same entry). Reads the
 * string path_hash() just left in `scratch`. */
static __always_inline s32 key_dfd(s32 dfd)
{
    int z = 0;
    struct pathbuf *b = scratch.lookup(&z);
    if (b && b->s[0] == '/')
        return AT_FDCWD_;
    return dfd;
}

static __always_inline u64 epoch_of(u32 tag)
{
    int k = tag;
    u64 *ep = epochs.lookup(&k);
    return ep ? *ep : 0;
}

/* Is the user string an absolute path under /dev, /proc or /sys? */
static __always_inline u32 is_special(const void *upath)
{
    char b[8] = {};
    if (!upath || bpf_probe_read_user_str(b, sizeof(b), upath) <= 0 || b[0] != '/')
        return 0;
    if (b[1] == 'd' && b[2] == 'e' && b[3] == 'v' && (b[4] == '/' || b[4] == 0))
        return 1;
    if (b[1] == 'p' && b[2] == 'r' && b[3] == 'o' && b[4] == 'c' && (b[5] == '/' || b[5] == 0))
        return 1;
    if (b[1] == 's' && b[2] == 'y' && b[3] == 's' && (b[4] == '/' || b[4] == 0))
        return 1;
    /* "//dev", "/./dev", ...: not worth parsing here, let userspace decide */
    if (b[1] == '/' || b[1] == '.')
        return 1;
    return 0;
}

/* May one more plain file event of this turn go to the ring buffer? */
static __always_inline int may_emit(u32 tag, u32 kind)
{
    int k = tag;
    struct emit_count *c = emitted.lookup(&k);
    if (!c)
        return 1;
    u64 epoch = epoch_of(tag);
    if (c->epoch != epoch) {
        c->epoch = epoch;
        c->n = 0;
    }
    if (c->n < FILE_EMIT_LIMIT) {
        c->n += 1;
        return 1;
    }
    int idx = tag * FILE_KINDS_MAX + (kind & (FILE_KINDS_MAX - 1));
    u64 *s = suppressed.lookup(&idx);
    if (s)
        *s += 1;
    return 0;
}

/* A relative path's hash also names its starting directory (see dir_id).
 * Reads the string path_hash() just left in `scratch`. */
static __always_inline u64 rel_hash(u64 h, s32 dfd)
{
    int z = 0;
    struct pathbuf *b = scratch.lookup(&z);
    if (!h || !b || b->s[0] == '/')
        return h;
    return (h ^ (dir_id(dfd) * 1099511628211ULL)) | 1;
}

static __always_inline int stash(u32 kind, s32 dfd, const void *path,
                                 s32 dfd2, const void *path2, s64 arg)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    struct pending p = {};
    u64 pt = bpf_get_current_pid_tgid();
    if (kind != EV_UNLINK && kind != EV_RMDIR && !path2) {
        p.hash = rel_hash(path_hash(path), dfd);
        struct seen_key k = {tag, (u32)(pt >> 32), key_dfd(dfd), kind, p.hash};
        u64 *v = seen.lookup(&k);
        if (v && *v == epoch_of(tag))
            return 0; /* already recorded this turn */
        p.dedup = 1;
    } else if (kind == EV_UNLINK || kind == EV_RMDIR) {
        p.hash = rel_hash(path_hash(path), dfd);
    }
    p.special = is_special(path) || is_special(path2);
    p.keydfd = p.hash ? key_dfd(dfd) : dfd;
    p.kind = kind;
    p.tag = tag;
    p.dfd = dfd;
    p.dfd2 = dfd2;
    p.arg = arg;
    p.path = (u64)path;
    p.path2 = (u64)path2;
    if (pending.update(&pt, &p) != 0)
        count_drop(tag);
    return 0;
}

static __always_inline int finish(long ret)
{
    u64 tid = bpf_get_current_pid_tgid();
    struct pending *p = pending.lookup(&tid);
    if (!p)
        return 0;
    struct pending q = *p;
    pending.delete(&tid);
    if (ret < 0)
        return 0;
    struct seen_key k = {q.tag, (u32)(tid >> 32), q.keydfd, q.kind, q.hash};
    if (q.dedup) {
        u64 epoch = epoch_of(q.tag);
        seen.update(&k, &epoch);
    } else if (q.hash) {
        /* a deletion: the path's next create must be seen again */
        k.kind = EV_OPEN_WRITE;
        seen.delete(&k);
        k.kind = EV_MKDIR;
        seen.delete(&k);
    }
    u32 magic = 0, mode = 0;
    if (q.kind == EV_OPEN_WRITE) {
        fd_fs(ret, &magic, &mode);
        if ((q.arg & O_TMPFILE_) == O_TMPFILE_)
            mode &= ~FS_UNLINKED; /* unnamed by design: a LINK names it later */
    } else if (q.kind == EV_ATTR) {
        fd_fs(q.dfd, &magic, &mode); /* flags set on a memory file system: see ebpf._turn */
    }
    if (!q.special && !lands_special(magic, mode) && !may_emit(q.tag, q.kind))
        return 0;
    struct event *e = new_event(q.tag, q.kind);
    if (!e)
        return 0;
    e->fsmagic = magic;
    e->fsmode = mode;
    e->ret = ret;
    e->arg = q.arg;
    e->dfd = q.dfd;
    e->dfd2 = q.dfd2;
    if (q.path)
        bpf_probe_read_user_str(e->path, sizeof(e->path), (void *)q.path);
    if (q.path2)
        bpf_probe_read_user_str(e->path2, sizeof(e->path2), (void *)q.path2);
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

/* FILE_OP(syscall, kind, dfd, path, dfd2, path2, arg): expressions over the
 * tracepoint's `args`. Map calls may not appear inside macros (bcc), hence
 * the helpers. */
#define FILE_OP(name, kind, DFD, PATH, DFD2, PATH2, ARG)                       \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name)                               \
    {                                                                          \
        return stash(kind, (s32)(DFD), (const void *)(PATH), (s32)(DFD2),      \
                     (const void *)(PATH2), (s64)(ARG));                       \
    }                                                                          \
    TRACEPOINT_PROBE(syscalls, sys_exit_##name) { return finish(args->ret); }

/* open family: only opens that can change the file are stashed. */
static __always_inline int open_op(s32 dfd, const void *path, u64 flags)
{
    if (!(flags & OPEN_WRITE_FLAGS))
        return 0;
    return stash(EV_OPEN_WRITE, dfd, path, AT_FDCWD_, 0, (s64)flags);
}
TRACEPOINT_PROBE(syscalls, sys_enter_open) { return open_op(AT_FDCWD_, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_open) { return finish(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_openat) { return open_op(args->dfd, args->filename, args->flags); }
TRACEPOINT_PROBE(syscalls, sys_exit_openat) { return finish(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    u64 flags = 0;
    /* struct open_how starts with u64 flags */
    bpf_probe_read_user(&flags, sizeof(flags), (void *)args->how);
    return open_op(args->dfd, args->filename, flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_openat2) { return finish(args->ret); }
TRACEPOINT_PROBE(syscalls, sys_enter_open_by_handle_at)
{
    return open_op(args->mountdirfd, 0, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_exit_open_by_handle_at) { return finish(args->ret); }

FILE_OP(creat, EV_OPEN_WRITE, AT_FDCWD_, args->pathname, AT_FDCWD_, 0, O_CREAT_ | O_TRUNC_ | 1)
FILE_OP(unlink, EV_UNLINK, AT_FDCWD_, args->pathname, AT_FDCWD_, 0, 0)
FILE_OP(unlinkat, EV_UNLINK, args->dfd, args->pathname, AT_FDCWD_, 0, args->flag)
FILE_OP(rmdir, EV_RMDIR, AT_FDCWD_, args->pathname, AT_FDCWD_, 0, 0)
FILE_OP(rename, EV_RENAME, AT_FDCWD_, args->oldname, AT_FDCWD_, args->newname, 0)
FILE_OP(renameat, EV_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname, 0)
FILE_OP(renameat2, EV_RENAME, args->olddfd, args->oldname, args->newdfd, args->newname, args->flags)
FILE_OP(mkdir, EV_MKDIR, AT_FDCWD_, args->pathname, AT_FDCWD_, 0, args->mode)
FILE_OP(mkdirat, EV_MKDIR, args->dfd, args->pathname, AT_FDCWD_, 0, args->mode)
FILE_OP(link, EV_LINK, AT_FDCWD_, args->oldname, AT_FDCWD_, args->newname, 0)
FILE_OP(linkat, EV_LINK, args->olddfd, args->oldname, args->newdfd, args->newname, args->flags)
/* symlink: path = link created, path2 = its target text */
FILE_OP(symlink, EV_SYMLINK, AT_FDCWD_, args->newname, AT_FDCWD_, args->oldname, 0)
FILE_OP(symlinkat, EV_SYMLINK, args->newdfd, args->newname, AT_FDCWD_, args->oldname, 0)
FILE_OP(chmod, EV_CHMOD, AT_FDCWD_, args->filename, AT_FDCWD_, 0, args->mode)
FILE_OP(fchmod, EV_CHMOD, args->fd, 0, AT_FDCWD_, 0, args->mode)
FILE_OP(fchmodat, EV_CHMOD, args->dfd, args->filename, AT_FDCWD_, 0, args->mode)
FILE_OP(fchmodat2, EV_CHMOD, args->dfd, args->filename, AT_FDCWD_, 0, args->mode)
FILE_OP(chown, EV_CHOWN, AT_FDCWD_, args->filename, AT_FDCWD_, 0, 0)
FILE_OP(lchown, EV_CHOWN, AT_FDCWD_, args->filename, AT_FDCWD_, 0, 0)
FILE_OP(fchown, EV_CHOWN, args->fd, 0, AT_FDCWD_, 0, 0)
FILE_OP(fchownat, EV_CHOWN, args->dfd, args->filename, AT_FDCWD_, 0, args->flag)
FILE_OP(truncate, EV_TRUNCATE, AT_FDCWD_, args->path, AT_FDCWD_, 0, args->length)
FILE_OP(ftruncate, EV_TRUNCATE, args->fd, 0, AT_FDCWD_, 0, args->length)
FILE_OP(setxattr, EV_XATTR, AT_FDCWD_, args->pathname, AT_FDCWD_, args->name, 0)
FILE_OP(lsetxattr, EV_XATTR, AT_FDCWD_, args->pathname, AT_FDCWD_, args->name, 0)
FILE_OP(fsetxattr, EV_XATTR, args->fd, 0, AT_FDCWD_, args->name, 0)
FILE_OP(setxattrat, EV_XATTR, args->dfd, args->pathname, AT_FDCWD_, args->name, 0)
FILE_OP(removexattr, EV_XATTR, AT_FDCWD_, args->pathname, AT_FDCWD_, args->name, 1)
FILE_OP(lremovexattr, EV_XATTR, AT_FDCWD_, args->pathname, AT_FDCWD_, args->name, 1)
FILE_OP(fremovexattr, EV_XATTR, args->fd, 0, AT_FDCWD_, args->name, 1)
FILE_OP(removexattrat, EV_XATTR, args->dfd, args->pathname, AT_FDCWD_, args->name, 1)
FILE_OP(mknod, EV_MKNOD, AT_FDCWD_, args->filename, AT_FDCWD_, 0, args->mode)
FILE_OP(mknodat, EV_MKNOD, args->dfd, args->filename, AT_FDCWD_, 0, args->mode)
FILE_OP(utimensat, EV_UTIMES, args->dfd, args->filename, AT_FDCWD_, 0, args->flags)
FILE_OP(utime, EV_UTIMES, AT_FDCWD_, args->filename, AT_FDCWD_, 0, 0)
FILE_OP(utimes, EV_UTIMES, AT_FDCWD_, args->filename, AT_FDCWD_, 0, 0)
FILE_OP(futimesat, EV_UTIMES, args->dfd, args->filename, AT_FDCWD_, 0, 0)

/* Inode attributes set by ioctl on a descriptor (chattr, xfs_io): no write
 * opens the file (chattr opens it read-only), yet the snapshot must hold the
 * flags. Only these commands are stashed; every other ioctl costs a compare. */
TRACEPOINT_PROBE(syscalls, sys_enter_ioctl)
{
    u32 cmd = (u32)args->cmd;
    if (cmd != FS_IOC_SETFLAGS_ && cmd != FS_IOC32_SETFLAGS_ && cmd != FS_IOC_FSSETXATTR_)
        return 0;
    return stash(EV_ATTR, (s32)args->fd, 0, AT_FDCWD_, 0, (s64)cmd);
}
TRACEPOINT_PROBE(syscalls, sys_exit_ioctl) { return finish(args->ret); }

/* --- write family: counters only ---------------------------------------------
 * No decision depends on them (a write needs an fd opened for writing, which
 * was an event, or it comes from an older process, which then ran), and they
 * are ~30 % of the programs' cost in a syscall storm: COUNT_WRITES=0 drops
 * them (Effects.write_syscalls is then 0). */

static __always_inline int count_write(void)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    int k = tag;
    u64 *c = writes.lookup(&k);
    if (c)
        *c += 1;
    return 0;
}
#if COUNT_WRITES
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev2) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_copy_file_range) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_splice) { return count_write(); }
TRACEPOINT_PROBE(syscalls, sys_enter_fallocate) { return count_write(); }
#endif

/* --- events recorded at entry ------------------------------------------------- */

static __always_inline int simple_event(u32 kind, s32 dfd, const void *path,
                                        const void *path2, s64 arg)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    struct event *e = new_event(tag, kind);
    if (!e)
        return 0;
    e->dfd = dfd;
    e->arg = arg;
    if (path)
        bpf_probe_read_user_str(e->path, sizeof(e->path), path);
    if (path2)
        bpf_probe_read_user_str(e->path2, sizeof(e->path2), path2);
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mount)
{
    return simple_event(EV_MOUNT, AT_FDCWD_, args->dir_name, args->type, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_enter_umount)
{
    return simple_event(EV_UMOUNT, AT_FDCWD_, args->name, 0, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_enter_move_mount)
{
    return simple_event(EV_MOUNT, args->to_dfd, args->to_pathname, 0, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_enter_fsmount)
{
    return simple_event(EV_MOUNT, AT_FDCWD_, 0, 0, args->flags);
}
TRACEPOINT_PROBE(syscalls, sys_enter_mount_setattr)
{
    return simple_event(EV_MOUNT, args->dfd, args->path, 0, args->flags);
}

/* Kernel objects that outlive their creator and live in neither the file
 * system snapshot nor a process: System V IPC, POSIX message queues.
 * KERNEL_OBJECT(syscall, kind, name): an event of `kind` (the numbers
 * ebpf/_turn.py's _KOBJ names) with the object's name, a user string or 0. */
#define KOBJ_SHM 1
#define KOBJ_MSG 2
#define KOBJ_SEM 3
#define KOBJ_MQ 4
#define KERNEL_OBJECT(name, kind, NAME)                                        \
    TRACEPOINT_PROBE(syscalls, sys_enter_##name)                               \
    {                                                                          \
        return simple_event(EV_KERNEL_OBJECT, AT_FDCWD_, (const void *)(NAME), \
                            0, kind);                                          \
    }
KERNEL_OBJECT(shmget, KOBJ_SHM, 0)
KERNEL_OBJECT(msgget, KOBJ_MSG, 0)
KERNEL_OBJECT(semget, KOBJ_SEM, 0)
/* Any open of a queue: one opened without O_CREAT can still be sent to,
 * received from (a message consumed) or have its attributes set. */
KERNEL_OBJECT(mq_open, KOBJ_MQ, args->u_name)
/* ... and every operation on such an object: its id needs no *get call in
 * the same turn (ids are small integers, listed by /proc/sysvipc and
 * `ipcs`; `ipcrm -q ID` removes a queue with msgctl alone), and a message
 * received or a semaphore taken changes it as much as one sent. */
KERNEL_OBJECT(shmat, KOBJ_SHM, 0)
KERNEL_OBJECT(shmctl, KOBJ_SHM, 0)
KERNEL_OBJECT(msgsnd, KOBJ_MSG, 0)
KERNEL_OBJECT(msgrcv, KOBJ_MSG, 0)
KERNEL_OBJECT(msgctl, KOBJ_MSG, 0)
KERNEL_OBJECT(semop, KOBJ_SEM, 0)
KERNEL_OBJECT(semtimedop, KOBJ_SEM, 0)
KERNEL_OBJECT(semctl, KOBJ_SEM, 0)
KERNEL_OBJECT(mq_timedsend, KOBJ_MQ, 0)
KERNEL_OBJECT(mq_timedreceive, KOBJ_MQ, 0)
KERNEL_OBJECT(mq_getsetattr, KOBJ_MQ, 0)
KERNEL_OBJECT(mq_notify, KOBJ_MQ, 0)
KERNEL_OBJECT(mq_unlink, KOBJ_MQ, args->u_name)

/* Effects we cannot see through: io_uring submissions, writes into another
 * process's memory, a file description taken from another process,
 * another process's scheduling or limits. */
TRACEPOINT_PROBE(syscalls, sys_enter_io_uring_setup) { return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_URING_SETUP); }

/* io_uring work after the setup: a ring set up in an earlier turn submits
 * through io_uring_enter, or with SQPOLL through no system call at all (the
 * kernel's iou-sqp thread takes the entries), and a linked chain submitted
 * once runs its later requests in task work that interrupts whatever the
 * process sleeps in (which then resumes, like after crabd's own freeze) or
 * in an iou-wrk thread. These tracepoints fire for each of them in a thread
 * of the ring's owner (iou-sqp and iou-wrk threads belong to its thread
 * group and cgroup); a process that did any makes the turn it lands in, or
 * the next one when it lands in crabd's pause, save everything. Once per
 * process and turn (the `seen` table): a busy ring must not flood the
 * buffer. member_tag(), not sandbox_tag(): task work runs in a thread CRIU
 * may hold seized, and CRIU's parasite never uses io_uring. */
static __always_inline int uring_work(s64 opcode)
{
    u32 tag = member_tag();
    if (!tag)
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    struct seen_key k = {tag, (u32)(pt >> 32), AT_FDCWD_, EV_OPAQUE, OPAQUE_URING_WORK};
    u64 epoch = epoch_of(tag);
    u64 *v = seen.lookup(&k);
    if (v && *v == epoch)
        return 0;
    struct event *e = new_event(tag, EV_OPAQUE);
    if (!e)
        return 0;
    seen.update(&k, &epoch);
    e->arg = OPAQUE_URING_WORK;
    e->ret = opcode;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
TRACEPOINT_PROBE(io_uring, io_uring_submit_req) { return uring_work(args->opcode); }
TRACEPOINT_PROBE(io_uring, io_uring_queue_async_work) { return uring_work(args->opcode); }
TRACEPOINT_PROBE(io_uring, io_uring_complete) { return uring_work(-1); }
/* an SQPOLL thread runs its (empty) task work at every poll: count 0 is no work */
TRACEPOINT_PROBE(io_uring, io_uring_task_work_run) { return args->count ? uring_work(-1) : 0; }
TRACEPOINT_PROBE(io_uring, io_uring_local_work_run) { return args->count > 0 ? uring_work(-1) : 0; }
TRACEPOINT_PROBE(syscalls, sys_enter_process_vm_writev)
{
    return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_VM_WRITE);
}
/* A file description taken out of another process: writes through it
 * need no open in this turn (the open was in an older turn, by an older
 * process that does not run now). */
TRACEPOINT_PROBE(syscalls, sys_enter_pidfd_getfd) { return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_FD_TAKEN); }
/* Another process's scheduling, I/O priority or limits changed without it
 * running (renice -p, chrt -p, prlimit --pid, ionice -p, setpriority of a
 * group or a user): CRIU saves them. A pid of 0 is the caller itself, a
 * process of this turn; a pid naming the caller is counted too (the pid is
 * in the sandbox's pid namespace: telling it apart is not worth a miss). */
TRACEPOINT_PROBE(syscalls, sys_enter_setpriority)
{
    if (args->which == 0 && args->who == 0) /* PRIO_PROCESS, self */
        return 0;
    return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS);
}
TRACEPOINT_PROBE(syscalls, sys_enter_ioprio_set)
{
    if (args->which == 1 && args->who == 0) /* IOPRIO_WHO_PROCESS, self */
        return 0;
    return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS);
}
TRACEPOINT_PROBE(syscalls, sys_enter_prlimit64)
{
    if (args->pid == 0 || args->new_rlim == 0)
        return 0;
    return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS);
}
TRACEPOINT_PROBE(syscalls, sys_enter_sched_setscheduler)
{
    return args->pid ? simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS) : 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sched_setparam)
{
    return args->pid ? simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS) : 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sched_setattr)
{
    return args->pid ? simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS) : 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sched_setaffinity)
{
    return args->pid ? simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_OTHER_PROCESS) : 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_ptrace)
{
    long r = args->request;
    u32 target = args->pid;
    if ((r == 16 || r == 0x4206) && pausing_now() && !member_tag()) { /* ATTACH, SEIZE */
        u32 one = 1;
        seized.update(&target, &one);
    } else if (r == 17) { /* DETACH */
        seized.delete(&target);
    }
    /* POKETEXT, POKEDATA, POKEUSER, SETREGS, SETFPREGS, SETREGSET, SETSIGINFO */
    if (r == 4 || r == 5 || r == 6 || r == 13 || r == 15 || r == 0x4205 || r == 0x4203)
        return simple_event(EV_OPAQUE, AT_FDCWD_, 0, 0, OPAQUE_PTRACE_POKE);
    return 0;
}

/* --- network ---------------------------------------------------------------------- */

static __always_inline int sock_event(u32 kind, const void *sa, s64 arg)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    struct event *e = new_event(tag, kind);
    if (!e)
        return 0;
    e->arg = arg;
    if (sa) {
        bpf_probe_read_user(&e->family, sizeof(e->family), sa);
        u16 port = 0;
        if (e->family == AF_INET_) {
            bpf_probe_read_user(&port, 2, sa + 2);
            bpf_probe_read_user(e->addr, 4, sa + 4);
        } else if (e->family == AF_INET6_) {
            bpf_probe_read_user(&port, 2, sa + 2);
            bpf_probe_read_user(e->addr, 16, sa + 8);
        } else if (e->family == AF_UNIX_) {
            /* abstract names start with NUL: path[0] == 0, flagged by arg */
            bpf_probe_read_user(e->path, 108, sa + 2);
        }
        e->port = (port >> 8) | ((port & 0xff) << 8);
    }
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_connect) { return sock_event(EV_CONNECT, args->uservaddr, args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_bind) { return sock_event(EV_BIND, args->umyaddr, args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_listen) { return sock_event(EV_LISTEN, 0, args->fd); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto)
{
    if (!args->addr)
        return 0;
    return sock_event(EV_SEND, args->addr, args->fd);
}
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg)
{
    u64 name = 0;
    bpf_probe_read_user(&name, sizeof(name), (void *)args->msg); /* msg_name */
    if (!name)
        return 0;
    return sock_event(EV_SEND, (const void *)name, args->fd);
}
TRACEPOINT_PROBE(syscalls, sys_enter_sendmmsg)
{
    u64 name = 0;
    bpf_probe_read_user(&name, sizeof(name), (void *)args->mmsg); /* first msg_name */
    if (!name)
        return 0;
    return sock_event(EV_SEND, (const void *)name, args->fd);
}

/* --- processes ------------------------------------------------------------------------ */

/* execve attempts carry argv (read now: the old image is gone at exit);
 * sched_process_exec then confirms the ones that succeeded. */
static __always_inline int exec_attempt(s32 dfd, const char *filename, const char *const *argv)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    struct event *e = new_event(tag, EV_EXEC_ARGS);
    if (!e)
        return 0;
    e->dfd = dfd;
    bpf_probe_read_user_str(e->path, sizeof(e->path), filename);
#pragma unroll
    for (int i = 0; i < ARGV_SLOTS; i++) {
        const char *a = 0;
        bpf_probe_read_user(&a, sizeof(a), &argv[i]);
        if (!a)
            break;
        bpf_probe_read_user_str(&e->path2[i * ARG_LEN], ARG_LEN, a);
        e->nargs = i + 1;
    }
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_execve)
{
    return exec_attempt(AT_FDCWD_, args->filename, (const char *const *)args->argv);
}
TRACEPOINT_PROBE(syscalls, sys_enter_execveat)
{
    return exec_attempt(args->fd, args->filename, (const char *const *)args->argv);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    struct event *e = new_event(tag, EV_EXEC);
    if (!e)
        return 0;
    e->arg = args->old_pid;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
    u32 child = args->child_pid;
#if FOLLOW_PIDS
    /* threads share the tgid entry; only processes need their own */
    watched_pids.update(&child, &tag);
#endif
    struct event *e = new_event(tag, EV_FORK);
    if (!e)
        return 0;
    e->arg = child;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 pt = bpf_get_current_pid_tgid();
    if ((u32)pt != (u32)(pt >> 32))
        return 0; /* a thread, not the process */
    u32 tag = sandbox_tag();
    if (!tag)
        return 0;
#if FOLLOW_PIDS
    u32 tgid = pt >> 32;
    watched_pids.delete(&tgid);
#endif
    struct event *e = new_event(tag, EV_EXIT);
    if (!e)
        return 0;
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}

static __always_inline int armed(u32 tag)
{
    int k = tag;
    u64 *a = pauses.lookup(&k);
    return a && *a;
}

TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{
    if (!pausing_now())
        return 0;
    u32 tag = sandbox_tag();
    if (!tag || !armed(tag))
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    u32 tid = (u32)pt;
    long nr = args->id;
    struct woke *w = woken.lookup(&tid);
    if (!w) {
        /* no interrupted call before it: the thread ran user code */
        struct woke nw = {.tgid = pt >> 32, .tag = tag, .restart = -1, .other = nr != RESTART_SYSCALL_NR};
        woken.update(&tid, &nw);
        return 0;
    }
    if (nr == RESTART_SYSCALL_NR || nr == w->restart) {
        w->restart = -1; /* the interrupted call, resumed */
        return 0;
    }
    w->restart = -1;
    w->other += 1;
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_exit)
{
    if (!pausing_now())
        return 0;
    long ret = args->ret;
    long nr = args->id;
    /* -EINTR, -ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND, -ERESTART_RESTARTBLOCK;
     * nr -1: a return to user space that is no system call's (a sigreturn) */
    if (nr < 0 || (ret != -4 && (ret < -516 || ret > -512)))
        return 0;
    u32 tag = member_tag(); /* seized too: CRIU's seize interrupts the call */
    if (!tag || !armed(tag))
        return 0;
    u64 pt = bpf_get_current_pid_tgid();
    u32 tid = (u32)pt;
    struct woke *w = woken.lookup(&tid);
    if (w) {
        /* in a seized thread, the first interruption is of the thread's
         * own call; later ones are the parasite's */
        if (w->restart < 0 || !seized.lookup(&tid))
            w->restart = nr;
    } else {
        struct woke nw = {.tgid = pt >> 32, .tag = tag, .restart = nr, .other = 0};
        woken.update(&tid, &nw);
    }
    return 0;
}
