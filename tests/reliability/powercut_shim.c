/* Power-loss trace shim (docs/reliability.md "The harness").
 *
 * LD_PRELOADed into every process of a workload, it records each operation that changes what a
 * power cut could leave on disk, for files under the traced roots (the node's home, its clock
 * witness directory): open (with O_CREAT / O_TRUNC), write / pwrite (with the bytes), ftruncate,
 * fallocate, fsync / fdatasync (of files and of directories), rename, unlink, mkdir, close, dup.
 * tests/reliability/powercut.py replays the log into a model of the page cache and the disk, and
 * reconstructs what a power cut at any point would leave.
 *
 * Environment:
 *   SSP_POWERCUT_LOG        the log file (appended; one binary record per operation)
 *   SSP_POWERCUT_ROOTS      colon-separated absolute directories whose files are traced
 *   SSP_POWERCUT_MARK       a file whose writes are logged as workload markers (acknowledgements)
 *   SSP_POWERCUT_DROP_SYNC  negative control: an fsync/fdatasync of a traced file whose path contains
 *                           this string is NOT performed; it is logged as "skipped", so the harness
 *                           knows where the code believed the data durable
 *
 * SQLite's -shm file is not traced: it is a memory-mapped index that SQLite rebuilds after a crash
 * (the first connection truncates it), so a power cut can leave anything there.
 *
 * Record layout (little-endian): u32 total_len, u8 op, u8 flag, u16 0, i32 pid, i32 fd, i64 a,
 * i64 b, i64 realtime_ns, u32 path_len, u32 path2_len, u32 data_len, then path, path2, data. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { OP_OPEN = 1, OP_WRITE, OP_TRUNC, OP_SYNC, OP_RENAME, OP_UNLINK, OP_CLOSE, OP_MARK, OP_MKDIR,
       OP_FALLOC, OP_TRUNCPATH, OP_UNSUPPORTED, OP_DUP };

#define MAXFD 65536
#define MAXROOTS 8

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inited = 0, log_fd = -1, owner_pid = 0, nroots = 0;
static char *roots[MAXROOTS];
static size_t root_len[MAXROOTS];
static char *mark_path = NULL, *drop_sync = NULL;
static char *fd_path[MAXFD];   /* traced fd -> its path; NULL when not traced */
static char fd_mark[MAXFD];    /* the marker file */

static int (*r_open)(const char *, int, ...);
static int (*r_open64)(const char *, int, ...);
static int (*r_openat)(int, const char *, int, ...);
static int (*r_openat64)(int, const char *, int, ...);
static int (*r_creat)(const char *, mode_t);
static int (*r_creat64)(const char *, mode_t);
static ssize_t (*r_write)(int, const void *, size_t);
static ssize_t (*r_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*r_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*r_writev)(int, const struct iovec *, int);
static ssize_t (*r_pwritev)(int, const struct iovec *, int, off_t);
static int (*r_ftruncate)(int, off_t);
static int (*r_ftruncate64)(int, off_t);
static int (*r_truncate)(const char *, off_t);
static int (*r_truncate64)(const char *, off_t);
static int (*r_fsync)(int);
static int (*r_fdatasync)(int);
static int (*r_syncfs)(int);
static int (*r_rename)(const char *, const char *);
static int (*r_renameat)(int, const char *, int, const char *);
static int (*r_renameat2)(int, const char *, int, const char *, unsigned int);
static int (*r_unlink)(const char *);
static int (*r_unlinkat)(int, const char *, int);
static int (*r_rmdir)(const char *);
static int (*r_mkdir)(const char *, mode_t);
static int (*r_mkdirat)(int, const char *, mode_t);
static int (*r_close)(int);
static int (*r_dup)(int);
static int (*r_dup2)(int, int);
static int (*r_dup3)(int, int, int);
static int (*r_fallocate)(int, int, off_t, off_t);
static int (*r_fallocate64)(int, int, off_t, off_t);
static int (*r_posix_fallocate)(int, off_t, off_t);
static int (*r_posix_fallocate64)(int, off_t, off_t);

#define RESOLVE(name) r_##name = dlsym(RTLD_NEXT, #name)

static void after_fork_child(void) { owner_pid = getpid(); }

static void init(void) {
    if (inited) return;
    RESOLVE(open); RESOLVE(open64); RESOLVE(openat); RESOLVE(openat64); RESOLVE(creat); RESOLVE(creat64);
    RESOLVE(write); RESOLVE(pwrite); RESOLVE(pwrite64); RESOLVE(writev); RESOLVE(pwritev);
    RESOLVE(ftruncate); RESOLVE(ftruncate64); RESOLVE(truncate); RESOLVE(truncate64);
    RESOLVE(fsync); RESOLVE(fdatasync); RESOLVE(syncfs);
    RESOLVE(rename); RESOLVE(renameat); RESOLVE(renameat2); RESOLVE(unlink); RESOLVE(unlinkat); RESOLVE(rmdir);
    RESOLVE(mkdir); RESOLVE(mkdirat); RESOLVE(close); RESOLVE(dup); RESOLVE(dup2); RESOLVE(dup3);
    RESOLVE(fallocate); RESOLVE(fallocate64); RESOLVE(posix_fallocate); RESOLVE(posix_fallocate64);
    owner_pid = getpid();
    const char *lp = getenv("SSP_POWERCUT_LOG");
    const char *rs = getenv("SSP_POWERCUT_ROOTS");
    const char *mp = getenv("SSP_POWERCUT_MARK");
    const char *ds = getenv("SSP_POWERCUT_DROP_SYNC");
    if (mp && *mp) mark_path = strdup(mp);
    if (ds && *ds) drop_sync = strdup(ds);
    if (rs) {
        char *copy = strdup(rs), *save = NULL;
        for (char *t = strtok_r(copy, ":", &save); t && nroots < MAXROOTS; t = strtok_r(NULL, ":", &save)) {
            size_t n = strlen(t);
            while (n > 1 && t[n - 1] == '/') t[--n] = 0;
            roots[nroots] = strdup(t);
            root_len[nroots++] = n;
        }
        free(copy);
    }
    inited = 1;   /* before opening the log: r_open does not come back here */
    if (lp && *lp) {
        log_fd = r_open(lp, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
        if (log_fd >= 0 && log_fd < MAXFD) { fd_path[log_fd] = NULL; }
    }
    pthread_atfork(NULL, NULL, after_fork_child);
}

__attribute__((constructor)) static void ctor(void) { init(); }

static int active(void) {
    if (!inited) init();
    /* a vfork child shares our memory: it must not change the parent's tables, nor log */
    return log_fd >= 0 && getpid() == owner_pid;
}

/* absolute, lexically normalised path ("//", "/./", "/x/../" removed) into out[PATH_MAX] */
static int normalise(int dirfd, const char *path, char *out) {
    char buf[2 * PATH_MAX];
    if (!path) return -1;
    if (path[0] == '/') {
        if (strlen(path) >= sizeof buf) return -1;
        strcpy(buf, path);
    } else {
        char base[PATH_MAX];
        if (dirfd == AT_FDCWD) {
            if (!getcwd(base, sizeof base)) return -1;
        } else if (dirfd >= 0 && dirfd < MAXFD && fd_path[dirfd]) {
            snprintf(base, sizeof base, "%s", fd_path[dirfd]);
        } else {
            char proc[64];
            snprintf(proc, sizeof proc, "/proc/self/fd/%d", dirfd);
            ssize_t n = readlink(proc, base, sizeof base - 1);
            if (n < 0) return -1;
            base[n] = 0;
        }
        if (snprintf(buf, sizeof buf, "%s/%s", base, path) >= (int)sizeof buf) return -1;
    }
    /* split and rebuild */
    char *parts[PATH_MAX / 2];
    int np = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, "/", &save); t; t = strtok_r(NULL, "/", &save)) {
        if (!strcmp(t, ".")) continue;
        if (!strcmp(t, "..")) { if (np) np--; continue; }
        parts[np++] = t;
    }
    size_t len = 0;
    out[0] = 0;
    for (int i = 0; i < np; i++) {
        size_t l = strlen(parts[i]);
        if (len + l + 2 >= PATH_MAX) return -1;
        out[len++] = '/';
        memcpy(out + len, parts[i], l);
        len += l;
        out[len] = 0;
    }
    if (!len) strcpy(out, "/");
    return 0;
}

static int traced(const char *abs) {
    size_t n = strlen(abs);
    if (n > 4 && !strcmp(abs + n - 4, "-shm")) return 0;
    for (int i = 0; i < nroots; i++)
        if (!strncmp(abs, roots[i], root_len[i]) && (abs[root_len[i]] == 0 || abs[root_len[i]] == '/')) return 1;
    return 0;
}

static void emit(int op, int flag, int fd, int64_t a, int64_t b, const char *p1, const char *p2,
                 const void *data, size_t dlen) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint32_t l1 = p1 ? strlen(p1) : 0, l2 = p2 ? strlen(p2) : 0, ld = dlen;
    uint32_t total = 4 + 4 + 4 + 4 + 8 + 8 + 8 + 12 + l1 + l2 + ld;
    char *buf = malloc(total);
    if (!buf) abort();
    char *q = buf;
    int32_t pid = getpid(), fd32 = fd;
    int64_t now = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    memcpy(q, &total, 4); q += 4;
    q[0] = op; q[1] = flag; q[2] = 0; q[3] = 0; q += 4;
    memcpy(q, &pid, 4); q += 4;
    memcpy(q, &fd32, 4); q += 4;
    memcpy(q, &a, 8); q += 8;
    memcpy(q, &b, 8); q += 8;
    memcpy(q, &now, 8); q += 8;
    memcpy(q, &l1, 4); q += 4;
    memcpy(q, &l2, 4); q += 4;
    memcpy(q, &ld, 4); q += 4;
    if (l1) { memcpy(q, p1, l1); q += l1; }
    if (l2) { memcpy(q, p2, l2); q += l2; }
    if (ld) { memcpy(q, data, ld); q += ld; }
    size_t off = 0;
    while (off < total) {   /* one O_APPEND write; a short one only on a full log disk */
        ssize_t w = r_write(log_fd, buf + off, total - off);
        if (w <= 0) { if (errno == EINTR) continue; abort(); }
        off += w;
    }
    free(buf);
}

static int do_open(int dirfd, const char *path, int flags, mode_t mode, int which) {
    char abs[PATH_MAX];
    int is_traced = 0, is_mark = 0, existed = 1;
    if (active() && normalise(dirfd, path, abs) == 0) {
        is_mark = mark_path && !strcmp(abs, mark_path);
        is_traced = !is_mark && traced(abs);
    }
    if (!is_traced && !is_mark) {
        switch (which) {
        case 0: return r_open(path, flags, mode);
        case 1: return r_open64(path, flags, mode);
        case 2: return r_openat(dirfd, path, flags, mode);
        default: return r_openat64(dirfd, path, flags, mode);
        }
    }
    pthread_mutex_lock(&mu);
    if (is_traced && (flags & O_CREAT)) {
        struct stat st;
        existed = stat(abs, &st) == 0;
    }
    int fd;
    switch (which) {
    case 0: fd = r_open(path, flags, mode); break;
    case 1: fd = r_open64(path, flags, mode); break;
    case 2: fd = r_openat(dirfd, path, flags, mode); break;
    default: fd = r_openat64(dirfd, path, flags, mode); break;
    }
    int saved = errno;
    if (fd >= 0 && fd < MAXFD && (is_traced || is_mark)) {
        if (is_mark) {
            fd_mark[fd] = 1;
        } else {
            struct stat st;
            int is_dir = fstat(fd, &st) == 0 && S_ISDIR(st.st_mode);
            free(fd_path[fd]);
            fd_path[fd] = strdup(abs);
            /* flag: bit0 created, bit1 truncated, bit2 directory, bit3 append */
            int flag = (!existed ? 1 : 0) | ((flags & O_TRUNC) ? 2 : 0) | (is_dir ? 4 : 0) | ((flags & O_APPEND) ? 8 : 0);
            emit(OP_OPEN, flag, fd, flags, 0, abs, NULL, NULL, 0);
        }
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return fd;
}

#define MODE_ARG mode_t mode = 0; if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); }
int open(const char *path, int flags, ...) { init(); MODE_ARG return do_open(AT_FDCWD, path, flags, mode, 0); }
int open64(const char *path, int flags, ...) { init(); MODE_ARG return do_open(AT_FDCWD, path, flags, mode, 1); }
int openat(int d, const char *path, int flags, ...) { init(); MODE_ARG return do_open(d, path, flags, mode, 2); }
int openat64(int d, const char *path, int flags, ...) { init(); MODE_ARG return do_open(d, path, flags, mode, 3); }
int creat(const char *path, mode_t mode) { init(); return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 0); }
int creat64(const char *path, mode_t mode) { init(); return do_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC, mode, 1); }

static int is_tr(int fd) { return fd >= 0 && fd < MAXFD && (fd_path[fd] || fd_mark[fd]) && active(); }

static ssize_t do_write(int fd, const void *buf, size_t n, off_t off, int positional, int which) {
    if (!is_tr(fd)) {
        switch (which) {
        case 0: return r_write(fd, buf, n);
        case 1: return r_pwrite(fd, buf, n, off);
        default: return r_pwrite64(fd, buf, n, off);
        }
    }
    pthread_mutex_lock(&mu);
    off_t at = off;
    if (!positional) {
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0 && (fl & O_APPEND)) { struct stat st; fstat(fd, &st); at = st.st_size; }
        else at = lseek(fd, 0, SEEK_CUR);
    }
    ssize_t w;
    switch (which) {
    case 0: w = r_write(fd, buf, n); break;
    case 1: w = r_pwrite(fd, buf, n, off); break;
    default: w = r_pwrite64(fd, buf, n, off); break;
    }
    int saved = errno;
    if (w > 0) {
        if (fd_mark[fd]) emit(OP_MARK, 0, fd, 0, 0, NULL, NULL, buf, w);
        else emit(OP_WRITE, 0, fd, at, w, NULL, NULL, buf, w);
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return w;
}

ssize_t write(int fd, const void *b, size_t n) { init(); return do_write(fd, b, n, 0, 0, 0); }
ssize_t pwrite(int fd, const void *b, size_t n, off_t o) { init(); return do_write(fd, b, n, o, 1, 1); }
ssize_t pwrite64(int fd, const void *b, size_t n, off_t o) { init(); return do_write(fd, b, n, o, 1, 2); }

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    init();
    if (is_tr(fd)) { pthread_mutex_lock(&mu); emit(OP_UNSUPPORTED, 0, fd, 0, 0, "writev", NULL, NULL, 0); pthread_mutex_unlock(&mu); }
    return r_writev(fd, iov, cnt);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t o) {
    init();
    if (is_tr(fd)) { pthread_mutex_lock(&mu); emit(OP_UNSUPPORTED, 0, fd, 0, 0, "pwritev", NULL, NULL, 0); pthread_mutex_unlock(&mu); }
    return r_pwritev(fd, iov, cnt, o);
}

static int do_trunc(int fd, off_t len, int which) {
    if (!is_tr(fd)) return which ? r_ftruncate64(fd, len) : r_ftruncate(fd, len);
    pthread_mutex_lock(&mu);
    int r = which ? r_ftruncate64(fd, len) : r_ftruncate(fd, len);
    int saved = errno;
    if (r == 0) emit(OP_TRUNC, 0, fd, len, 0, NULL, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int ftruncate(int fd, off_t len) { init(); return do_trunc(fd, len, 0); }
int ftruncate64(int fd, off_t len) { init(); return do_trunc(fd, len, 1); }

static int do_truncpath(const char *path, off_t len, int which) {
    char abs[PATH_MAX];
    int tr = active() && normalise(AT_FDCWD, path, abs) == 0 && traced(abs);
    pthread_mutex_lock(&mu);
    int r = which ? r_truncate64(path, len) : r_truncate(path, len);
    int saved = errno;
    if (r == 0 && tr) emit(OP_TRUNCPATH, 0, -1, len, 0, abs, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int truncate(const char *p, off_t len) { init(); return do_truncpath(p, len, 0); }
int truncate64(const char *p, off_t len) { init(); return do_truncpath(p, len, 1); }

static int do_sync(int fd, int data_only) {
    if (!is_tr(fd) || fd_mark[fd]) return data_only ? r_fdatasync(fd) : r_fsync(fd);
    pthread_mutex_lock(&mu);
    int skip = drop_sync && strstr(fd_path[fd], drop_sync) != NULL;
    int r = skip ? 0 : (data_only ? r_fdatasync(fd) : r_fsync(fd));
    int saved = errno;
    /* flag: bit0 fdatasync, bit1 skipped by the negative control (the code asked; nothing done) */
    if (r == 0) emit(OP_SYNC, (data_only ? 1 : 0) | (skip ? 2 : 0), fd, 0, 0, NULL, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int fsync(int fd) { init(); return do_sync(fd, 0); }
int fdatasync(int fd) { init(); return do_sync(fd, 1); }
int syncfs(int fd) {
    init();
    if (active()) { pthread_mutex_lock(&mu); emit(OP_UNSUPPORTED, 0, fd, 0, 0, "syncfs", NULL, NULL, 0); pthread_mutex_unlock(&mu); }
    return r_syncfs(fd);
}

static int do_rename(int d1, const char *a, int d2, const char *b, unsigned flags, int which) {
    char A[PATH_MAX], B[PATH_MAX];
    int tr = active() && normalise(d1, a, A) == 0 && normalise(d2, b, B) == 0 && (traced(A) || traced(B));
    pthread_mutex_lock(&mu);
    int r = which == 0 ? r_rename(a, b) : which == 1 ? r_renameat(d1, a, d2, b) : r_renameat2(d1, a, d2, b, flags);
    int saved = errno;
    if (r == 0 && tr) {
        if (flags) emit(OP_UNSUPPORTED, 0, -1, flags, 0, "renameat2 flags", NULL, NULL, 0);
        emit(OP_RENAME, 0, -1, 0, 0, A, B, NULL, 0);
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int rename(const char *a, const char *b) { init(); return do_rename(AT_FDCWD, a, AT_FDCWD, b, 0, 0); }
int renameat(int d1, const char *a, int d2, const char *b) { init(); return do_rename(d1, a, d2, b, 0, 1); }
int renameat2(int d1, const char *a, int d2, const char *b, unsigned f) { init(); return do_rename(d1, a, d2, b, f, 2); }

static int do_unlink(int d, const char *p, int flags, int which) {
    char A[PATH_MAX];
    int tr = active() && normalise(d, p, A) == 0 && traced(A);
    pthread_mutex_lock(&mu);
    int r = which == 0 ? r_unlink(p) : which == 1 ? r_unlinkat(d, p, flags) : r_rmdir(p);
    int saved = errno;
    if (r == 0 && tr) emit(OP_UNLINK, (which == 2 || (flags & AT_REMOVEDIR)) ? 1 : 0, -1, 0, 0, A, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int unlink(const char *p) { init(); return do_unlink(AT_FDCWD, p, 0, 0); }
int unlinkat(int d, const char *p, int f) { init(); return do_unlink(d, p, f, 1); }
int rmdir(const char *p) { init(); return do_unlink(AT_FDCWD, p, 0, 2); }

static int do_mkdir(int d, const char *p, mode_t m, int which) {
    char A[PATH_MAX];
    int tr = active() && normalise(d, p, A) == 0 && traced(A);
    pthread_mutex_lock(&mu);
    int r = which ? r_mkdirat(d, p, m) : r_mkdir(p, m);
    int saved = errno;
    if (r == 0 && tr) emit(OP_MKDIR, 0, -1, 0, 0, A, NULL, NULL, 0);
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int mkdir(const char *p, mode_t m) { init(); return do_mkdir(AT_FDCWD, p, m, 0); }
int mkdirat(int d, const char *p, mode_t m) { init(); return do_mkdir(d, p, m, 1); }

int close(int fd) {
    init();
    if (!is_tr(fd)) return r_close(fd);
    pthread_mutex_lock(&mu);
    if (fd_path[fd]) emit(OP_CLOSE, 0, fd, 0, 0, NULL, NULL, NULL, 0);
    free(fd_path[fd]);
    fd_path[fd] = NULL;
    fd_mark[fd] = 0;
    int r = r_close(fd);
    int saved = errno;
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}

static int note_dup(int fd, int nfd) {
    if (nfd >= 0 && nfd < MAXFD && fd != nfd) {
        pthread_mutex_lock(&mu);
        if (fd_path[nfd]) emit(OP_CLOSE, 0, nfd, 0, 0, NULL, NULL, NULL, 0);
        free(fd_path[nfd]);
        fd_path[nfd] = fd_path[fd] ? strdup(fd_path[fd]) : NULL;
        fd_mark[nfd] = fd_mark[fd];
        if (fd_path[fd]) emit(OP_DUP, 0, fd, nfd, 0, NULL, NULL, NULL, 0);
        pthread_mutex_unlock(&mu);
    }
    return nfd;
}
int dup(int fd) { init(); int n = r_dup(fd); return is_tr(fd) ? note_dup(fd, n) : n; }
int dup2(int fd, int n2) { init(); int n = r_dup2(fd, n2); return is_tr(fd) ? note_dup(fd, n) : n; }
int dup3(int fd, int n2, int fl) { init(); int n = r_dup3(fd, n2, fl); return is_tr(fd) ? note_dup(fd, n) : n; }

static int do_falloc(int fd, int mode, off_t off, off_t len, int which) {
    int r;
    pthread_mutex_lock(&mu);
    switch (which) {
    case 0: r = r_fallocate(fd, mode, off, len); break;
    case 1: r = r_fallocate64(fd, mode, off, len); break;
    case 2: r = r_posix_fallocate(fd, off, len); break;
    default: r = r_posix_fallocate64(fd, off, len); break;
    }
    int saved = errno;
    if (r == 0 && is_tr(fd)) {
        if (mode & ~1) emit(OP_UNSUPPORTED, 0, fd, mode, 0, "fallocate mode", NULL, NULL, 0);
        emit(OP_FALLOC, (mode & 1) ? 1 : 0, fd, off, len, NULL, NULL, NULL, 0);
    }
    pthread_mutex_unlock(&mu);
    errno = saved;
    return r;
}
int fallocate(int fd, int m, off_t o, off_t l) { init(); return do_falloc(fd, m, o, l, 0); }
int fallocate64(int fd, int m, off_t o, off_t l) { init(); return do_falloc(fd, m, o, l, 1); }
int posix_fallocate(int fd, off_t o, off_t l) { init(); return do_falloc(fd, 0, o, l, 2); }
int posix_fallocate64(int fd, off_t o, off_t l) { init(); return do_falloc(fd, 0, o, l, 3); }
