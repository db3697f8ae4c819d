/*
 * deltacr: LD_PRELOAD shim for CRIU < 4.2 on Linux >= 6.16.
 *
 * Linux 6.16 restricted SO_PASSCRED and SO_PASSSEC to unix, netlink and
 * bluetooth sockets: getsockopt/setsockopt of them on any other socket
 * fails with EOPNOTSUPP. CRIU 4.1.x reads both from every socket it dumps
 * and fails the whole dump ("Can't get 1:16 opt: Operation not supported";
 * criu issues #2705, #2718; fixed upstream in CRIU 4.2). For those sockets
 * the options cannot be on, so answering "off" (and accepting "set off")
 * is exact. Nothing else is touched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

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
