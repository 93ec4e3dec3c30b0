/* An LD_PRELOAD shim for the benches only: counts fsync/fdatasync calls
 * of a process (SQLite's included, which Python cannot see) and can delay each one after the real
 * call returns, to simulate a slow flush (an SD card's ~1.6 ms) without touching the agent's code.
 *   SSP_FSYNC_DELAY_US=1600      delay after every fsync/fdatasync
 *   SSP_FSYNC_COUNT_FILE=PATH    at exit, append "pid fsyncs fdatasyncs" to PATH
 * Built by bench/fsyncshim.py with the system C compiler. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static atomic_long n_fsync, n_fdatasync;
static long delay_ns = -1;

static void slow_flush(void) {
    if (delay_ns < 0) {
        const char *e = getenv("SSP_FSYNC_DELAY_US");
        delay_ns = e ? atol(e) * 1000L : 0;
    }
    if (delay_ns > 0) {
        struct timespec ts = {delay_ns / 1000000000L, delay_ns % 1000000000L};
        while (nanosleep(&ts, &ts) != 0) {}
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int r = real(fd);
    atomic_fetch_add(&n_fsync, 1);
    slow_flush();
    return r;
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int r = real(fd);
    atomic_fetch_add(&n_fdatasync, 1);
    slow_flush();
    return r;
}

__attribute__((destructor)) static void report(void) {
    const char *path = getenv("SSP_FSYNC_COUNT_FILE");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%d %ld %ld\n", (int)getpid(), atomic_load(&n_fsync), atomic_load(&n_fdatasync));
    fclose(f);
}
