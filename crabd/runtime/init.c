/*
 * crabd-init: PID 1 of every crabd sandbox.
 *
 * crabd never relies on the image having an init (a busybox-only rootfs works
 * as well as Debian), so it bind-mounts this static binary read-only into the
 * sandbox's /dev and runs it as the container's process. It does the two jobs
 * of a container init and nothing else: reap every zombie re-parented to it
 * (agents leave plenty: `cmd &` in a shell that exits), and idle until it is
 * told to stop. SIGTERM, SIGINT and SIGHUP make it exit 0; everything else is
 * ignored so that a stray signal from inside the sandbox cannot end it.
 *
 * It holds no state worth checkpointing, which keeps CRIU dumps of a sandbox
 * small, and it is restored by CRIU like any other process.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    sigset_t all;
    int sig;

    (void)argc;
    (void)argv;
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
