/* Frame ping-pong with K dependent-ALU "work" iterations between two polls of the stamp. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <time.h>
#define N 2000000
static int LINES=4096, W=7, K, P;
typedef struct { _Alignas(64) atomic_long w[8]; } line_t;
static line_t *ab, *ba;
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static inline void put(line_t *r, long i){ line_t *l=&r[i%LINES]; for(int k=0;k<W-1;k++) atomic_store_explicit(&l->w[k+1], i+k, memory_order_relaxed); atomic_store_explicit(&l->w[0], i, memory_order_release);}
static __thread volatile long sinkv;
static inline long get(line_t *r, long i){ line_t *l=&r[i%LINES]; long x=1; while(atomic_load_explicit(&l->w[0],memory_order_acquire)!=i) { for(int k=0;k<K;k++) { x = x*3+1; __asm__ volatile("" : "+r"(x)); } if (P) __builtin_ia32_pause(); } sinkv=x; long s=0; for(int k=0;k<W-1;k++) s+=atomic_load_explicit(&l->w[k+1],memory_order_relaxed); return s;}
static void* echo(void*a){pin(1); long s=0; for(long i=1;i<=N;i++){s+=get(ab,i); put(ba,i);} return (void*)s;}
int main(int c,char**v){K=atoi(v[1]); P=atoi(v[2]);
 ab=aligned_alloc(4096,sizeof(line_t)*LINES); ba=aligned_alloc(4096,sizeof(line_t)*LINES);
 for(int i=0;i<LINES;i++)for(int k=0;k<8;k++){ab[i].w[k]=0;ba[i].w[k]=0;}
 pthread_t t;pthread_create(&t,0,echo,0);pin(0);
 struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0); long s=0;
 for(long i=1;i<=N;i++){put(ab,i); s+=get(ba,i);}
 clock_gettime(CLOCK_MONOTONIC,&t1); pthread_join(t,0);
 double ns=(t1.tv_sec-t0.tv_sec)*1e9+(t1.tv_nsec-t0.tv_nsec);
 printf("K=%d one-way %.1f ns\n",K,ns/N/2);}
