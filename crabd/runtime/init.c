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
#include <sys/prctl.h>
#include <sys/syscall.h>
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

int main(int argc, char **argv) {
    if (argc >= 5 && strcmp(argv[1], "--run") == 0 && strcmp(argv[3], "--") == 0)
        return run(argv[2], 0, argv + 4);
    if (argc >= 6 && strcmp(argv[1], "--run") == 0 && strcmp(argv[3], "--time-ns") == 0 &&
        strcmp(argv[4], "--") == 0)
        return run(argv[2], 1, argv + 5);
    if (argc > 1) {
        fprintf(stderr, "usage: crabd-init | crabd-init --run STATUS_FIFO [--time-ns] -- ARGV...\n");
        return 2;
    }
    return init();
}
