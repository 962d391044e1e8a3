/*
 * mpi_pingpong: two-rank MPI ping-pong with ferrocomm's batch schedule, a peer of
 * `ferrocomm-bench pingpong` (over TCP it runs on Open MPI's TCP BTL: `--mca btl tcp,self`).
 *
 * First, at the first size, a warm-up of about 50 ms (connections and first-touch page faults),
 * as the ferrocomm ranks warm up each job. Then for each size, in the order given: a warm-up batch meant to last about 5 ms (its length is
 * guessed from the previous size's round trip, 1 ms for the first), then a timed batch meant to
 * last `-t` milliseconds (at least 10 and at most 2,000,000 round trips), as the ferrocomm ranks
 * do. Rank 0 decides each batch's count and tells rank 1 with MPI_Bcast before the batch (outside
 * the timing). Rank 0 sends with MPI_Send and receives with MPI_Recv into one reused buffer; rank
 * 1 echoes. Rank 0 prints one line per size:
 *
 *     result <bytes> <iterations> <one_way_seconds>
 *
 * the batch's mean round trip halved.
 *
 * usage: mpi_pingpong -s size,size,... [-t target_ms] [-p cpu0,cpu1]
 *   -p pins rank r to the r-th CPU of the list, as the ferrocomm ranks pin themselves.
 *
 * Built by ferrocomm-bench with mpicc.openmpi (-O2) under the target directory.
 */
#define _GNU_SOURCE
#include <mpi.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIST 256
#define MIN_ITERATIONS 10
#define MAX_ITERATIONS 2000000L
#define MIN_WARMUP 2

static int parse_list(const char *s, long *out, int max) {
    int n = 0;
    char *copy = strdup(s), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t && n < max; t = strtok_r(NULL, ",", &save))
        out[n++] = strtol(t, NULL, 10);
    free(copy);
    return n;
}

/* Round trips for a batch lasting `target` seconds when one takes `round_trip`. */
static long iterations(double round_trip, double target, long min) {
    double n = target / (round_trip > 1e-9 ? round_trip : 1e-9) + 0.5;
    if (n > (double)MAX_ITERATIONS)
        n = (double)MAX_ITERATIONS;
    return n < (double)min ? min : (long)n;
}

/* One batch of `count` round trips of `bytes` (rank 0 pings, rank 1 echoes); rank 0's seconds. */
static double batch(int rank, long bytes, long count, char *buf) {
    MPI_Bcast(&count, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    for (long i = 0; i < count; i++) {
        if (rank == 0) {
            MPI_Send(buf, (int)bytes, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
            MPI_Recv(buf, (int)bytes, MPI_CHAR, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
            MPI_Recv(buf, (int)bytes, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Send(buf, (int)bytes, MPI_CHAR, 0, 1, MPI_COMM_WORLD);
        }
    }
    return MPI_Wtime() - t;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (n != 2) {
        if (rank == 0)
            fprintf(stderr, "mpi_pingpong: runs on exactly 2 ranks, not %d\n", n);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    long sizes[MAX_LIST], cpus[MAX_LIST];
    int nsizes = 0, ncpus = 0;
    double target = 0.030;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *f = argv[i], *v = argv[i + 1];
        if (!strcmp(f, "-s"))
            nsizes = parse_list(v, sizes, MAX_LIST);
        else if (!strcmp(f, "-t"))
            target = atof(v) / 1000.0;
        else if (!strcmp(f, "-p"))
            ncpus = parse_list(v, cpus, MAX_LIST);
        else {
            if (rank == 0)
                fprintf(stderr, "mpi_pingpong: unknown option %s\n", f);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    if (ncpus > 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET((int)cpus[rank % ncpus], &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0)
            perror("mpi_pingpong: sched_setaffinity");
    }
    long largest = 1;
    for (int s = 0; s < nsizes; s++)
        largest = sizes[s] > largest ? sizes[s] : largest;
    char *buf = malloc((size_t)largest);
    if (!buf)
        MPI_Abort(MPI_COMM_WORLD, 3);
    memset(buf, 7, (size_t)largest);

    double round_trip = 1e-3;
    if (nsizes > 0) {
        long n = iterations(round_trip, 0.005, MIN_WARMUP);
        round_trip = batch(rank, sizes[0], n, buf) / (double)n;
        n = iterations(round_trip, 0.050, MIN_WARMUP);
        round_trip = batch(rank, sizes[0], n, buf) / (double)n;
    }
    for (int s = 0; s < nsizes; s++) {
        long bytes = sizes[s];
        long warmup = iterations(round_trip, 0.005, MIN_WARMUP);
        round_trip = batch(rank, bytes, warmup, buf) / (double)warmup;
        long count = iterations(round_trip, target, MIN_ITERATIONS);
        double t = batch(rank, bytes, count, buf);
        round_trip = t / (double)count;
        if (rank == 0) {
            printf("result %ld %ld %.9e\n", bytes, count, round_trip / 2.0);
            fflush(stdout);
        }
    }
    free(buf);
    MPI_Finalize();
    return 0;
}
