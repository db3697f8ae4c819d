/*
 * deltacr: LD_PRELOAD shim for CRIU < 4.2 on Linux >= 6.16.
 *
 * Linux 6.16 restricted SO_PASSCRED and SO_PASSSEC to unix, netlink and
 * bluetooth sockets: getsockopt/setsockopt of them on any other socket
 * fails with EOPNOTSUPP. CRIU 4.1.x reads both from every socket it dumps
 * and fails the whole dump ("Can't get 1:16 opt: Operation not supported";
 * criu issues #2705, #2718; fixed upstream in CRIU 4.2). For those sockets
 * the options cannot be on, so answering "off" (and accepting "set off")
 * is exact.
 *
 * Also for hosts without CAP_SYS_RESOURCE (these: the capability is not in
 * the bounding set): CRIU reads each dumped task's rlimits with
 * prlimit64(pid, res, NULL, &old), which the kernel refuses (EPERM) for a
 * task whose uids or gids differ from CRIU's unless the caller has
 * CAP_SYS_RESOURCE -- so any process running as another user (www-data,
 * postgres, nobody) made the whole dump fail ("Can't get rlimit 0").
 * /proc/PID/limits holds the same values (read under the same lock by the
 * kernel) and is world-readable: on that EPERM, and only for a read, the
 * answer comes from there. Nothing else is touched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>

#ifndef SO_PASSSEC
#define SO_PASSSEC 34
#endif

typedef int (*getsockopt_fn)(int, int, int, void *, socklen_t *);
typedef int (*setsockopt_fn)(int, int, int, const void *, socklen_t);

static int is_pass_opt(int level, int name) {
    return level == SOL_SOCKET && (name == SO_PASSCRED || name == SO_PASSSEC);
}

int getsockopt(int fd, int level, int name, void *val, socklen_t *len) {
    static getsockopt_fn real;
    if (!real)
        real = (getsockopt_fn)dlsym(RTLD_NEXT, "getsockopt");
    int ret = real(fd, level, name, val, len);
    if (ret < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val && len && *len >= sizeof(int)) {
        memset(val, 0, sizeof(int));
        *len = sizeof(int);
        errno = 0;
        return 0;
    }
    return ret;
}

int setsockopt(int fd, int level, int name, const void *val, socklen_t len) {
    static setsockopt_fn real;
    if (!real)
        real = (setsockopt_fn)dlsym(RTLD_NEXT, "setsockopt");
    int ret = real(fd, level, name, val, len);
    if (ret < 0 && errno == EOPNOTSUPP && is_pass_opt(level, name) && val && len >= (socklen_t)sizeof(int)
        && *(const int *)val == 0) {
        errno = 0;
        return 0;
    }
    return ret;
}

/* Soft and hard limit of resource `res` of task `pid` from /proc/PID/limits:
 * one line per resource, in resource order after a header, printed as
 * "%-25s %-20s %-20s %-10s" with "unlimited" for RLIM_INFINITY. */
static int limits_from_proc(long pid, long res, struct rlimit *out) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%ld/limits", pid);
    FILE *f = fopen(path, "re");
    if (!f)
        return -1;
    int ok = -1;
    for (long i = -1; fgets(line, sizeof line, f); i++) {
        if (i != res)
            continue;
        if (strlen(line) < 47)
            break;
        const char *soft = line + 26, *hard = line + 47;
        out->rlim_cur = strncmp(soft, "unlimited", 9) == 0 ? RLIM_INFINITY : strtoull(soft, NULL, 10);
        out->rlim_max = strncmp(hard, "unlimited", 9) == 0 ? RLIM_INFINITY : strtoull(hard, NULL, 10);
        ok = 0;
        break;
    }
    fclose(f);
    return ok;
}

typedef long (*syscall_fn)(long, ...);

long syscall(long nr, ...) {
    static syscall_fn real;
    if (!real)
        real = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    va_list ap;
    va_start(ap, nr);
    long a1 = va_arg(ap, long), a2 = va_arg(ap, long), a3 = va_arg(ap, long);
    long a4 = va_arg(ap, long), a5 = va_arg(ap, long), a6 = va_arg(ap, long);
    va_end(ap);
    long ret = real(nr, a1, a2, a3, a4, a5, a6);
    if (ret == -1 && errno == EPERM && nr == SYS_prlimit64 && a1 > 0 && a3 == 0 && a4 != 0) {
        struct rlimit lim;
        if (limits_from_proc(a1, a2, &lim) == 0) {
            memcpy((void *)a4, &lim, sizeof lim);  /* struct rlimit64 on x86_64 and arm64 */
            errno = 0;
            return 0;
        }
        errno = EPERM;
    }
    return ret;
}
