/*
 * osu_coll: OSU-method latency of MPI collectives, the MPI side of `ferrocomm-bench collectives`.
 *
 * For each operation and message size: `warmup` untimed iterations, then `iters` timed ones; each
 * iteration times the collective alone (MPI_Wtime around the call) and is followed by an untimed
 * MPI_Barrier, as the OSU micro-benchmarks do (osu_barrier times the barrier itself, back to back).
 * Each rank's average latency is combined over ranks with MPI_Reduce (min, max, sum), and rank 0
 * prints one line per measurement:
 *
 *     result <op> <bytes> <iterations> <avg_us> <min_us> <max_us>
 *
 * avg is the mean over ranks of each rank's mean latency; min and max are over ranks. Sizes are
 * bytes per rank: the broadcast buffer; the vector of reduce, all-reduce and scan (MPI_FLOAT,
 * MPI_SUM, bytes / 4 elements); one rank's block of gather, scatter and all-gather; one all-to-all
 * block per destination (MPI_CHAR); one rank's block of the reduce-scatter result
 * (MPI_Reduce_scatter_block, MPI_FLOAT, MPI_SUM: the vector is n times bytes).
 *
 * usage: osu_coll [-o op,op,...] [-s size,size,...] [-i iters] [-w warmup] [-I iters_large]
 *                 [-W warmup_large] [-L large_bytes] [-p cpu,cpu,...]
 *   ops: barrier, bcast, allreduce, allgather, alltoall (the default set); also reduce (f32 sum
 *        at rank 0), gather and scatter (root 0), reduce_scatter, scan (f32 sum, inclusive) and
 *        sendrecv, the point-to-point baseline: MPI_Sendrecv of `bytes` with rank r^1
 *   sizes above large_bytes (default 8192) use the _large counts (defaults 1000/200, 100/10, OSU's)
 *   -p pins rank r to the (r mod count)-th CPU of the list, as the ferrocomm ranks pin themselves.
 *
 * Built by ferrocomm-bench with mpicc.openmpi and mpicc.mpich (-O2) under the target directory.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIST 64

struct options {
    const char *ops;
    long sizes[MAX_LIST];
    int nsizes;
    long iters, warmup, iters_large, warmup_large, large;
    int cpus[MAX_LIST];
    int ncpus;
};

static int parse_list(const char *s, long *out, int max) {
    int n = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t && n < max; t = strtok_r(NULL, ",", &save))
        out[n++] = strtol(t, NULL, 10);
    free(copy);
    return n;
}

static int has_op(const char *ops, const char *op) {
    size_t len = strlen(op);
    for (const char *p = ops; (p = strstr(p, op)) != NULL; p += len) {
        int start = p == ops || p[-1] == ',';
        int end = p[len] == '\0' || p[len] == ',';
        if (start && end)
            return 1;
    }
    return 0;
}

static void report(const char *op, long bytes, long iters, double total, MPI_Comm comm) {
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    double mine = total * 1e6 / (double)iters, lo, hi, sum;
    MPI_Reduce(&mine, &lo, 1, MPI_DOUBLE, MPI_MIN, 0, comm);
    MPI_Reduce(&mine, &hi, 1, MPI_DOUBLE, MPI_MAX, 0, comm);
    MPI_Reduce(&mine, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, comm);
    if (rank == 0) {
        printf("result %s %ld %ld %.4f %.4f %.4f\n", op, bytes, iters, sum / size, lo, hi);
        fflush(stdout);
    }
}

/* One timed batch of `op` at `bytes`; returns this rank's total time of the timed iterations. */
static double run(const char *op, long bytes, long iters, long warmup, char *a, char *b) {
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    double total = 0.0;
    for (long i = 0; i < warmup + iters; i++) {
        double t = MPI_Wtime();
        if (!strcmp(op, "bcast"))
            MPI_Bcast(a, (int)bytes, MPI_CHAR, 0, MPI_COMM_WORLD);
        else if (!strcmp(op, "allreduce"))
            MPI_Allreduce(a, b, (int)(bytes / sizeof(float)), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else if (!strcmp(op, "reduce"))
            MPI_Reduce(a, b, (int)(bytes / sizeof(float)), MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
        else if (!strcmp(op, "gather"))
            MPI_Gather(a, (int)bytes, MPI_CHAR, b, (int)bytes, MPI_CHAR, 0, MPI_COMM_WORLD);
        else if (!strcmp(op, "scatter"))
            MPI_Scatter(a, (int)bytes, MPI_CHAR, b, (int)bytes, MPI_CHAR, 0, MPI_COMM_WORLD);
        else if (!strcmp(op, "reduce_scatter"))
            MPI_Reduce_scatter_block(a, b, (int)(bytes / sizeof(float)), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else if (!strcmp(op, "scan"))
            MPI_Scan(a, b, (int)(bytes / sizeof(float)), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        else if (!strcmp(op, "allgather"))
            MPI_Allgather(a, (int)bytes, MPI_CHAR, b, (int)bytes, MPI_CHAR, MPI_COMM_WORLD);
        else if (!strcmp(op, "alltoall"))
            MPI_Alltoall(a, (int)bytes, MPI_CHAR, b, (int)bytes, MPI_CHAR, MPI_COMM_WORLD);
        else if (!strcmp(op, "sendrecv") && (rank ^ 1) < n)
            MPI_Sendrecv(a, (int)bytes, MPI_CHAR, rank ^ 1, 1, b, (int)bytes, MPI_CHAR, rank ^ 1, 1, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
        t = MPI_Wtime() - t;
        if (i >= warmup)
            total += t;
        MPI_Barrier(MPI_COMM_WORLD);
    }
    return total;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);

    struct options o = {"barrier,bcast,allreduce,allgather,alltoall", {8, 1048576}, 2, 1000, 200, 100, 10, 8192,
                        {0}, 0};
    long tmp[MAX_LIST];
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (!strcmp(f, "-o"))
            o.ops = v;
        else if (!strcmp(f, "-s"))
            o.nsizes = parse_list(v, o.sizes, MAX_LIST);
        else if (!strcmp(f, "-i"))
            o.iters = atol(v);
        else if (!strcmp(f, "-w"))
            o.warmup = atol(v);
        else if (!strcmp(f, "-I"))
            o.iters_large = atol(v);
        else if (!strcmp(f, "-W"))
            o.warmup_large = atol(v);
        else if (!strcmp(f, "-L"))
            o.large = atol(v);
        else if (!strcmp(f, "-p")) {
            o.ncpus = parse_list(v, tmp, MAX_LIST);
            for (int c = 0; c < o.ncpus; c++)
                o.cpus[c] = (int)tmp[c];
        } else {
            if (rank == 0)
                fprintf(stderr, "osu_coll: unknown option %s\n", f);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (o.ncpus > 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(o.cpus[rank % o.ncpus], &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0)
            perror("osu_coll: sched_setaffinity");
    }

    long largest = 0;
    for (int s = 0; s < o.nsizes; s++)
        largest = o.sizes[s] > largest ? o.sizes[s] : largest;
    /* Enough for a gather, scatter, all-gather, all-to-all or reduce-scatter of the largest block
     * over every rank. */
    size_t cap = (size_t)largest * (size_t)n;
    char *a = malloc(cap), *b = malloc(cap);
    if (!a || !b)
        MPI_Abort(MPI_COMM_WORLD, 3);
    float *f = (float *)a;
    for (size_t k = 0; k < cap / sizeof(float); k++)
        f[k] = (float)(k % 7);
    memset(b, 0, cap);

    if (rank == 0) {
        printf("# osu_coll: %d ranks, iterations %ld (warm-up %ld), above %ld B %ld (warm-up %ld)\n", n, o.iters,
               o.warmup, o.large, o.iters_large, o.warmup_large);
        fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);

    if (has_op(o.ops, "barrier")) {
        for (long i = 0; i < o.warmup; i++)
            MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        for (long i = 0; i < o.iters; i++)
            MPI_Barrier(MPI_COMM_WORLD);
        report("barrier", 0, o.iters, MPI_Wtime() - t, MPI_COMM_WORLD);
    }
    const char *sized[] = {"bcast",     "reduce",   "allreduce",      "gather", "scatter",
                           "allgather", "alltoall", "reduce_scatter", "scan",   "sendrecv"};
    for (int k = 0; k < (int)(sizeof sized / sizeof sized[0]); k++) {
        if (!has_op(o.ops, sized[k]))
            continue;
        for (int s = 0; s < o.nsizes; s++) {
            long bytes = o.sizes[s];
            int big = bytes > o.large;
            long iters = big ? o.iters_large : o.iters, warmup = big ? o.warmup_large : o.warmup;
            MPI_Barrier(MPI_COMM_WORLD);
            double total = run(sized[k], bytes, iters, warmup, a, b);
            report(sized[k], bytes, iters, total, MPI_COMM_WORLD);
        }
    }
    free(a);
    free(b);
    MPI_Finalize();
    return 0;
}
