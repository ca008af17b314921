/* LD_PRELOAD interposer: every malloc/calloc/realloc of >= 100 KiB and its free, with the
 * thread, the size, glibc's chunk header (bit 1: served by its own mmap) and 10 return
 * addresses, to MTRACE_DIR/<pid>.bin (records of 120 bytes), with /proc/self/maps beside it
 * (<pid>.maps) to resolve them. A diagnostic for docs/benchmarks.md (rss9): which code makes
 * the blocks of 128 KiB - 2 MiB that glibc's thread arenas keep, on which thread, for how long.
 *
 *   gcc -O2 -shared -fPIC -o /tmp/malloc_sites.so benchmarks/malloc_sites/malloc_sites.c -ldl
 *   MTRACE_DIR=/tmp/ms LD_PRELOAD=/tmp/malloc_sites.so python benchmarks/throughput.py \
 *       --loaders streamload --no-rss-sources --reps 1
 *   python benchmarks/malloc_sites/sites.py /tmp/ms/<pid of the 1-rank worker>
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MIN_SIZE (100 * 1024)
#define NBT 10
typedef struct { double t; int32_t tid; int32_t op; uint64_t ptr, size, hdr; void *bt[NBT]; } rec_t;

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_realloc)(void *, size_t);
static void *(*real_calloc)(size_t, size_t);
static int fd = -1;
static __thread int busy;
static char boot[65536]; static size_t boot_used;

static void init(void) {
    static int done;
    if (done) return;
    done = 1;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_free = dlsym(RTLD_NEXT, "free");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    const char *dir = getenv("MTRACE_DIR");
    if (dir) { char p[512]; snprintf(p, sizeof p, "%s/%d.bin", dir, getpid());
               fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644); }
}

static long nlog;
static void dump_maps(void) {
    const char *dir = getenv("MTRACE_DIR"); char p[512], buf[65536];
    snprintf(p, sizeof p, "%s/%d.maps", dir, getpid());
    int in = open("/proc/self/maps", O_RDONLY), out = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ssize_t k; while ((k = read(in, buf, sizeof buf)) > 0) write(out, buf, k);
    close(in); close(out);
}
static void log_op(int op, void *ptr, size_t size) {
    if (fd < 0 || busy) return;
    busy = 1;
    rec_t r; memset(&r, 0, sizeof r);
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    r.t = ts.tv_sec + ts.tv_nsec * 1e-9; r.tid = (int)syscall(SYS_gettid); r.op = op;
    r.ptr = (uint64_t)ptr; r.size = size; r.hdr = ptr ? ((uint64_t *)ptr)[-1] : 0;
    if (op != 0) backtrace(r.bt, NBT);
    write(fd, &r, sizeof r);
    if (++nlog % 1000 == 1) dump_maps();
    busy = 0;
}

void *malloc(size_t n) {
    if (!real_malloc) { init(); if (!real_malloc) { void *p = boot + boot_used; boot_used += (n + 15) & ~15; return p; } }
    void *p = real_malloc(n);
    if (n >= MIN_SIZE && p) log_op(1, p, n);
    return p;
}
void *calloc(size_t a, size_t b) {
    if (!real_calloc) { void *p = boot + boot_used; boot_used += (a * b + 15) & ~15; memset(p, 0, a*b); return p; }
    void *p = real_calloc(a, b);
    if (a * b >= MIN_SIZE && p) log_op(2, p, a * b);
    return p;
}
void free(void *p) {
    if (!p) return;
    if ((char *)p >= boot && (char *)p < boot + sizeof boot) return;
    if (!real_free) init();
    if (malloc_usable_size(p) >= MIN_SIZE - 64) log_op(0, p, malloc_usable_size(p));
    real_free(p);
}
void *realloc(void *p, size_t n) {
    if (!real_realloc) init();
    if (p && (char *)p >= boot && (char *)p < boot + sizeof boot) { void *q = real_malloc(n); memcpy(q, p, n); return q; }
    size_t old = p ? malloc_usable_size(p) : 0;
    if (p && old >= MIN_SIZE - 64) log_op(0, p, old);
    void *q = real_realloc(p, n);
    if (q && n >= MIN_SIZE) log_op(3, q, n);
    return q;
}
