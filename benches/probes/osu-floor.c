/* OSU broadcast loop with nothing but its cache lines (session 13): what an 8-byte broadcast
 * from rank 0 followed by a barrier costs two processes on this machine when a library adds
 * nothing. Each broadcast is one line (the root stores data and a sequence number; the receiver
 * spins on the number), each barrier one line per rank (each stores, then spins on the other's);
 * each rank's mean time of the broadcast alone, timed with clock_gettime as the OSU loops are.
 * Build: gcc -O2 osu-floor.c (add -mclwb and CLWB=1 to write the root's line back after the
 * post, NOPAUSE=1 to spin without `pause`). Usage: ./a.out [iterations].
 * Measured, fast phases: root 0.023 us, receiver 0.117-0.124 us (with CLWB=1 0.131-0.134; with
 * NOPAUSE=1 0.155); slow phases: receiver 0.38-0.41 us. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SLOTS 8
typedef struct {
    _Alignas(64) atomic_ulong seq;
    unsigned long data;
} line_t;
typedef struct {
    line_t bc[SLOTS];
    line_t bar[2][SLOTS];
} board_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    int clwb = getenv("CLWB") != NULL, nopause = getenv("NOPAUSE") != NULL;
    (void)clwb; /* used only when built with -mclwb */
    board_t *b = mmap(0, sizeof(board_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int me = fork() == 0 ? 1 : 0;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(me, &s);
    sched_setaffinity(0, sizeof s, &s);
    double total = 0;
    unsigned long sink = 0;
    for (long i = 0; i < n; i++) {
        line_t *l = &b->bc[i % SLOTS];
        double t = now();
        if (me == 0) {
            l->data = i;
            atomic_store_explicit(&l->seq, i + 1, memory_order_release);
#ifdef __CLWB__
            if (clwb)
                __builtin_ia32_clwb((void *)l);
#endif
        } else {
            while (atomic_load_explicit(&l->seq, memory_order_acquire) != (unsigned long)i + 1)
                if (!nopause)
                    __builtin_ia32_pause();
            sink += l->data;
        }
        t = now() - t;
        if (i >= n / 10)
            total += t;
        atomic_store_explicit(&b->bar[me][i % SLOTS].seq, i + 1, memory_order_release);
        while (atomic_load_explicit(&b->bar[1 - me][i % SLOTS].seq, memory_order_acquire) < (unsigned long)i + 1)
            __builtin_ia32_pause();
    }
    printf("rank %d broadcast mean %.3f us (%lu)\n", me, total * 1e6 / (n - n / 10), sink & 1);
    if (me == 0)
        wait(NULL);
    return 0;
}
