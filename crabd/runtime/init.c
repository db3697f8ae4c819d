/*
 * crabd-init: PID 1 of every crabd sandbox, and the wrapper of every exec.
 *
 * crabd never relies on the image having an init (a busybox-only rootfs works
 * as well as Debian), so it bind-mounts this static binary read-only into the
 * sandbox's /dev and runs it as the container's process.
 *
 * Mode 1, no arguments: PID 1. Reap every zombie re-parented to it (agents
 * leave plenty: `cmd &` in a shell that exits) and idle. SIGTERM, SIGINT and
 * SIGHUP make it exit 0; everything else is ignored so that a stray signal
 * from inside the sandbox cannot end it. It holds no state worth
 * checkpointing, which keeps CRIU dumps small.
 *
 * Mode 2, `--run STATUS_FIFO -- ARGV...`: run ARGV and report how it ended
 * on STATUS_FIFO as one line: "X <exit code>", "S <signal>", or "E <errno>"
 * when ARGV could not be executed. crabd runs execs with `runc exec
 * --detach`, because a non-detached runc exec waits for end-of-file on the
 * command's output, which a background server started by the command holds
 * open forever; this line is how crabd learns that the command itself ended.
 *
 * `--run STATUS_FIFO --time-ns -- ARGV...`: first join PID 1's time
 * namespace, then run ARGV as above. CRIU restores a sandbox's processes in a
 * time namespace of their own (their clocks go on from the dump), but runc
 * 1.1 knows nothing of time namespaces and starts an exec in the host's; a
 * tree that spans two time namespaces dumps but never restores. crabd passes
 * this flag, and CAP_SYS_ADMIN for setns(2) (`runc exec --cap`), only when
 * PID 1 is in another time namespace; the capability is dropped from every
 * set, bounding and ambient included, before ARGV runs, and the command is
 * not run at all if that cannot be verified.
 *
 * Mode 3, `--channel NAME`: PID 1 as in mode 1, and the fast exec path
 * (crabd/runtime/channel.py has the other side): PID 1 listens on the
 * abstract unix stream socket "@NAME" of the sandbox's network namespace and
 * spawns commands on request, as its own children: in the sandbox's
 * namespaces, cgroups and time namespace (it is already in them, so no runc
 * exec, no setns, no capability to hand out and drop). One connection per
 * command. Request: a u32 length (little endian), then NUL-terminated
 * strings "crabd-exec-1", cwd, argc, argv..., env..., and with the first
 * bytes three descriptors (SCM_RIGHTS): the command's stdin, stdout and
 * stderr. Replies, one line each: "P <pid>" once it runs, then "X <code>" |
 * "S <signal>" when it ends; instead "E <errno>" (cannot be executed) |
 * "C <errno>" (cannot enter cwd) | "R <reason>" (request refused, nothing
 * started). A "K" line from crabd SIGKILLs the command's process tree.
 * Only a peer outside the sandbox's pid namespace (SO_PEERCRED pid 0:
 * crabd, which creates its socket in the sandbox's network namespace) with
 * uid 0 is served; a process of the sandbox that connects is closed
 * unanswered. Abstract, not a file in /dev/.crabd: CRIU restores a
 * listening socket bound on that bind mount into the wrong mount namespace
 * ("Can't setns .../mnt"), and a sandbox restored with a fresh init instead
 * of its processes loses them; an abstract socket lives in the network
 * namespace, which CRIU dumps and restores with it, and a hot standby
 * (its own network namespace) never collides with the live sandbox's name.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <dirent.h>
#include <poll.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

static int report(int fd, char kind, int value) {
    char line[32];
    int n = snprintf(line, sizeof line, "%c %d\n", kind, value);
    return write(fd, line, (size_t)n) == n ? 0 : -1;
}

/* Drop CAP_SYS_ADMIN from every capability set and check that it is gone. */
static int drop_sys_admin(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    const unsigned idx = CAP_SYS_ADMIN / 32, bit = 1u << (CAP_SYS_ADMIN % 32);

    if (prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0)
        return -1;
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_LOWER, CAP_SYS_ADMIN, 0, 0) != 0 && errno != EINVAL)
        return -1;
    if (syscall(SYS_capget, &hdr, data) != 0)
        return -1;
    data[idx].effective &= ~bit;
    data[idx].permitted &= ~bit;
    data[idx].inheritable &= ~bit;
    if (syscall(SYS_capset, &hdr, data) != 0 || syscall(SYS_capget, &hdr, data) != 0)
        return -1;
    if ((data[idx].effective | data[idx].permitted | data[idx].inheritable) & bit)
        return -1;
    return prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, 0, 0, 0) == 0 ? 0 : -1;
}

static int join_init_time_ns(void) {
    int ns = open("/proc/1/ns/time", O_RDONLY | O_CLOEXEC);
    if (ns < 0)
        return -1;
    int rc = setns(ns, CLONE_NEWTIME);
    close(ns);
    return rc;
}

static int run(const char *fifo, int time_ns, char **argv) {
    int fd = open(fifo, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        fprintf(stderr, "crabd-init: open %s: %s\n", fifo, strerror(errno));
        return 126;
    }
    if (time_ns) {
        if (join_init_time_ns() != 0) {
            int e = errno;
            fprintf(stderr, "crabd-init: joining PID 1's time namespace: %s\n", strerror(e));
            report(fd, 'E', e);
            return 126;
        }
        if (drop_sys_admin() != 0) {
            int e = errno ? errno : EPERM;
            fprintf(stderr, "crabd-init: could not drop CAP_SYS_ADMIN: %s\n", strerror(e));
            report(fd, 'E', e);
            return 126;
        }
    }
    pid_t child = fork();
    if (child < 0) {
        report(fd, 'E', errno);
        return 126;
    }
    if (child == 0) {
        execvp(argv[0], argv);
        report(fd, 'E', errno);
        _exit(127);
    }
    /* Signals meant for the command (crabd kills the whole tree) must not
     * leave the command orphaned without a report: ignore the polite ones. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    int status;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR)
            return 126;
    }
    if (WIFEXITED(status)) {
        /* After an exec failure the child's "E" line came first; crabd
         * reads the first line only. */
        report(fd, 'X', WEXITSTATUS(status));
        return WEXITSTATUS(status);
    }
    report(fd, 'S', WTERMSIG(status));
    return 128 + WTERMSIG(status);
}

static int init(void) {
    sigset_t all;
    int sig;

    if (getpid() != 1)
        fprintf(stderr, "crabd-init: not PID 1; reaping only own children\n");
    /* Handle signals synchronously: block them all, then wait for them. */
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    for (;;) {
        if (sigwait(&all, &sig) != 0)
            continue;
        if (sig == SIGCHLD) {
            /* Reap every exited child; several may share one SIGCHLD. */
            while (waitpid(-1, NULL, WNOHANG) > 0)
                ;
        } else if (sig == SIGTERM || sig == SIGINT || sig == SIGHUP) {
            return 0;
        }
    }
}

/* --- mode 3: the exec channel ------------------------------------------------ */

#define MAX_JOBS 256
#define REQ_MAX (16u << 20) /* argv + env of one command: ARG_MAX-sized commands fit */
#define MAX_PROCS 16384 /* of the sandbox's pid namespace, for a timeout's tree kill */

struct job {
    pid_t pid;  /* the command, a child of PID 1; 0: free slot */
    int conn;   /* crabd's connection for its reports; -1 once crabd hung up */
};

static struct job jobs[MAX_JOBS];
extern char **environ;

static int listen_on(const char *name) {
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    size_t len = strlen(name);
    if (len == 0 || len + 1 > sizeof a.sun_path)
        return -1;
    memcpy(a.sun_path + 1, name, len); /* sun_path[0] == 0: abstract */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + len)) != 0 ||
        listen(fd, 64) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static void say(int conn, char kind, long value) {
    char line[48];
    int n = snprintf(line, sizeof line, "%c %ld\n", kind, value);
    if (conn >= 0 && send(conn, line, (size_t)n, MSG_NOSIGNAL) != n)
        return; /* crabd gone: the command runs on, unreported, as with runc exec */
}

static int read_full(int fd, void *buf, size_t len) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = read(fd, (char *)buf + got, len - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return 0;
}

/* SIGKILL `root` and every descendant of it (like psutil's children(recursive)). */
static void kill_tree(pid_t root) {
    static pid_t pid[MAX_PROCS], ppid[MAX_PROCS];
    static char mark[MAX_PROCS];
    int n = 0;
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (d && n < MAX_PROCS && (e = readdir(d)) != NULL) {
        char path[300], buf[512];
        if (e->d_name[0] < '0' || e->d_name[0] > '9')
            continue;
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            continue;
        ssize_t r = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (r <= 0)
            continue;
        buf[r] = 0;
        char *paren = strrchr(buf, ')'); /* the comm field may hold spaces and ')' */
        if (!paren || paren[1] == 0)
            continue;
        pid[n] = (pid_t)atoi(e->d_name);
        ppid[n] = (pid_t)atoi(paren + 4); /* ") S <ppid>" */
        mark[n] = pid[n] == root;
        n++;
    }
    if (d)
        closedir(d);
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < n; i++) {
            if (mark[i])
                continue;
            for (int j = 0; j < n; j++) {
                if (mark[j] && ppid[i] == pid[j]) {
                    mark[i] = 1;
                    changed = 1;
                    break;
                }
            }
        }
    }
    kill(root, SIGKILL);
    for (int i = 0; i < n; i++)
        if (mark[i] && pid[i] != 1)
            kill(pid[i], SIGKILL);
}

/* One request on an accepted connection: spawn the command or refuse. */
static void serve(int conn) {
    struct ucred cred;
    socklen_t cl = sizeof cred;
    /* crabd is in the host's pid namespace, so its pid does not exist in
     * ours: the kernel reports 0. A process of the sandbox has a pid here. */
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.pid != 0 || cred.uid != 0) {
        close(conn);
        return;
    }
    struct timeval tv = {5, 0}; /* crabd sends the request at once; never hang PID 1 on it */
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint32_t len = 0;
    int fds[3] = {-1, -1, -1}, nfds = 0;
    char cbuf[CMSG_SPACE(sizeof fds)];
    struct iovec iov = {&len, sizeof len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t r = recvmsg(conn, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nfds < 3)
                    fds[nfds++] = fd;
                else
                    close(fd);
            }
        }
    }
    char *buf = NULL;
    const char *why = NULL;
    if (r != (ssize_t)sizeof len || nfds != 3 || (m.msg_flags & MSG_CTRUNC))
        why = "bad-header";
    else if (len == 0 || len > REQ_MAX)
        why = "bad-length";
    else if ((buf = malloc(len + 1)) == NULL)
        why = "no-memory";
    else if (read_full(conn, buf, len) != 0)
        why = "short-request";
    char *f[8];
    char **argv = NULL, **envp = NULL;
    if (!why) {
        buf[len] = 0;
        if (buf[len - 1] != 0)
            why = "unterminated";
    }
    size_t nstr = 0;
    if (!why) {
        for (uint32_t i = 0; i < len; i++)
            nstr += buf[i] == 0;
        char **all = calloc(nstr + 2, sizeof *all);
        if (!all) {
            why = "no-memory";
        } else {
            char *p = buf;
            for (size_t i = 0; i < nstr; i++, p += strlen(p) + 1)
                all[i] = p;
            long argc = nstr >= 3 ? atol(all[2]) : 0;
            if (nstr < 4 || strcmp(all[0], "crabd-exec-1") != 0 || argc < 1 || (size_t)argc > nstr - 3) {
                why = "bad-request";
                free(all);
            } else {
                f[0] = all[1]; /* cwd */
                /* argv: all[3..3+argc), NULL-terminated by moving env one slot on */
                argv = all + 3;
                size_t nenv = nstr - 3 - (size_t)argc;
                envp = calloc(nenv + 1, sizeof *envp);
                if (!envp) {
                    why = "no-memory";
                } else {
                    for (size_t i = 0; i < nenv; i++)
                        envp[i] = argv[argc + (long)i];
                    argv[argc] = NULL; /* env strings are in envp now */
                }
            }
        }
    }
    int slot = -1;
    for (int i = 0; !why && i < MAX_JOBS; i++)
        if (jobs[i].pid == 0) {
            slot = i;
            break;
        }
    if (!why && slot < 0)
        why = "too-many-commands";
    if (why) {
        char line[64];
        int n = snprintf(line, sizeof line, "R %s\n", why);
        send(conn, line, (size_t)n, MSG_NOSIGNAL);
        close(conn);
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        free(buf);
        if (argv)
            free(argv - 3);
        free(envp);
        return;
    }
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) != 0) {
        say(conn, 'E', errno);
        close(conn);
        goto out;
    }
    pid_t child = fork();
    if (child == 0) {
        /* The command gets a clean signal state (PID 1 blocks everything)
         * and a session of its own: `kill 0` in it never reaches PID 1's
         * group or another command. */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        for (int i = 0; i < 3; i++) {
            /* dup2 onto itself keeps close-on-exec: clear it by hand then */
            if (fds[i] == i ? fcntl(i, F_SETFD, 0) < 0 : dup2(fds[i], i) < 0)
                _exit(127);
        }
        int err[2];
        if (chdir(f[0]) != 0) {
            err[0] = 'C', err[1] = errno;
            (void)!write(ep[1], err, sizeof err);
            _exit(127);
        }
        environ = envp; /* execvp searches the command's PATH, as runc exec does */
        execvp(argv[0], argv);
        err[0] = 'E', err[1] = errno;
        (void)!write(ep[1], err, sizeof err);
        _exit(127);
    }
    close(ep[1]);
    if (child < 0) {
        say(conn, 'E', errno);
        close(conn);
    } else {
        int err[2];
        /* EOF at the exec (CLOEXEC), or why it failed; then it is reaped untracked */
        if (read_full(ep[0], err, sizeof err) == 0) {
            say(conn, (char)err[0], err[1]);
            close(conn);
        } else {
            say(conn, 'P', child);
            jobs[slot].pid = child;
            jobs[slot].conn = conn;
        }
    }
    close(ep[0]);
out:
    for (int i = 0; i < 3; i++)
        close(fds[i]); /* the command holds them now: end of file reaches crabd when it (and its children) close */
    free(buf);
    free(argv - 3);
    free(envp);
}

static void reap_all(void) {
    int status;
    pid_t p;
    while ((p = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_JOBS; i++) {
            if (jobs[i].pid != p)
                continue;
            if (WIFEXITED(status))
                say(jobs[i].conn, 'X', WEXITSTATUS(status));
            else
                say(jobs[i].conn, 'S', WTERMSIG(status));
            if (jobs[i].conn >= 0)
                close(jobs[i].conn);
            jobs[i].pid = 0;
            jobs[i].conn = -1;
        }
    }
}

static int init_with_channel(const char *name) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    /* Every signal is read (and all but these ignored), as mode 1's
     * sigwait(&all) does: one left pending (the SIGCONT of a standby's
     * promotion) would be in the next dump, and CRIU fails to restore it. */
    int sfd = signalfd(-1, &all, SFD_CLOEXEC | SFD_NONBLOCK);
    int lfd = listen_on(name);
    if (sfd < 0 || lfd < 0)
        fprintf(stderr, "crabd-init: exec channel @%s: %s (crabd falls back to runc exec)\n", name, strerror(errno));
    if (sfd < 0)
        return init();
    for (int i = 0; i < MAX_JOBS; i++)
        jobs[i].conn = -1;
    for (;;) {
        struct pollfd pf[2 + MAX_JOBS];
        int idx[2 + MAX_JOBS];
        int n = 0;
        pf[n].fd = sfd, pf[n].events = POLLIN, idx[n++] = -1;
        if (lfd >= 0)
            pf[n].fd = lfd, pf[n].events = POLLIN, idx[n++] = -2;
        for (int i = 0; i < MAX_JOBS; i++)
            if (jobs[i].pid && jobs[i].conn >= 0)
                pf[n].fd = jobs[i].conn, pf[n].events = POLLIN, idx[n++] = i;
        if (poll(pf, (nfds_t)n, -1) < 0)
            continue;
        for (int k = 0; k < n; k++) {
            if (!pf[k].revents)
                continue;
            if (idx[k] == -1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                    if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT || si.ssi_signo == SIGHUP)
                        return 0;
                }
                reap_all();
            } else if (idx[k] == -2) {
                int c;
                while ((c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) >= 0)
                    serve(c);
            } else {
                struct job *j = &jobs[idx[k]];
                char cmd[16];
                ssize_t r = recv(j->conn, cmd, sizeof cmd, MSG_DONTWAIT);
                if (r > 0 && cmd[0] == 'K') {
                    kill_tree(j->pid);
                } else if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                    close(j->conn); /* crabd hung up: the command runs on, unreported */
                    j->conn = -1;
                }
            }
        }
        reap_all(); /* a SIGCHLD may have been merged with another signal's read */
    }
}

int main(int argc, char **argv) {
    if (argc >= 5 && strcmp(argv[1], "--run") == 0 && strcmp(argv[3], "--") == 0)
        return run(argv[2], 0, argv + 4);
    if (argc >= 6 && strcmp(argv[1], "--run") == 0 && strcmp(argv[3], "--time-ns") == 0 &&
        strcmp(argv[4], "--") == 0)
        return run(argv[2], 1, argv + 5);
    if (argc == 3 && strcmp(argv[1], "--channel") == 0)
        return init_with_channel(argv[2]);
    if (argc > 1) {
        fprintf(stderr, "usage: crabd-init [--channel NAME] | crabd-init --run STATUS_FIFO [--time-ns] -- ARGV...\n");
        return 2;
    }
    return init();
}
