// process_vm_readv of data the other process just wrote (dirty in its cache) vs process_vm_writev
// by the writer itself into the other's buffer; and with clean data. Two processes pinned to CPUs 0/1.
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <stdatomic.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static void pin(int c) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); sched_setaffinity(0, sizeof s, &s); }
int main(int argc, char **argv) {
    size_t len = argc > 1 ? atol(argv[1]) : 32768;
    int iters = 20000;
    // shared control page: turn counter
    volatile _Atomic long *ctl = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *src = aligned_alloc(4096, len); // in parent (sender)
    char *dst = aligned_alloc(4096, len); // in child (receiver), same address in both after fork
    memset(src, 1, len); memset(dst, 0, len);
    pid_t parent = getpid();
    pid_t child = fork();
    for (int mode = 0; mode < 4; mode++) {
        // mode 0: child reads (readv) clean src; 1: child reads dirty src; 2: parent writes (writev) dirty src into child's dst; 3: parent memcpy-equivalent? (writev clean)
        if (child == 0) {
            pin(1);
            double t = 0;
            for (int i = 0; i < iters; i++) {
                while (atomic_load(ctl) != 2 * i + 1) ;
                if (mode <= 1) {
                    double t0 = now();
                    struct iovec l = { dst, len }, r = { src, len };
                    if (process_vm_readv(parent, &l, 1, &r, 1, 0) != (ssize_t)len) { perror("readv"); exit(1); }
                    t += now() - t0;
                }
                atomic_store(ctl, 2 * i + 2);
            }
            if (mode <= 1) printf("len %zu mode %s: %.2f us per copy\n", len, mode == 0 ? "readv clean" : "readv dirty", t / iters / 1e3);
            fflush(stdout);
        } else {
            pin(0);
            double t = 0;
            for (int i = 0; i < iters; i++) {
                if (mode == 1 || mode == 2) memset(src, i, len);
                if (mode >= 2) {
                    double t0 = now();
                    struct iovec l = { src, len }, r = { dst, len };
                    if (process_vm_writev(child, &l, 1, &r, 1, 0) != (ssize_t)len) { perror("writev"); exit(1); }
                    t += now() - t0;
                }
                atomic_store(ctl, 2 * i + 1);
                while (atomic_load(ctl) != 2 * i + 2) ;
            }
            if (mode >= 2) printf("len %zu mode %s: %.2f us per copy\n", len, mode == 2 ? "writev dirty" : "writev clean", t / iters / 1e3);
            fflush(stdout);
            atomic_store(ctl, 0);
        }
        // resync between modes
        if (child == 0) { while (atomic_load(ctl) != 0) ; usleep(1000); } else usleep(2000);
    }
    if (child) wait(0);
    return 0;
}
