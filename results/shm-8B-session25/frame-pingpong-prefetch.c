/* Frame ping-pong: K dependent steps between polls; after a frame's arrival, S1 dependent steps,
   then (F=1) a prefetchw of the reply's line (its address depends on the chain), then S2 steps,
   then the reply. One chain throughout: arrival -> S1 -> prefetch -> S2 -> reply. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <time.h>
#define N 2000000
static int LINES=4096, W=3, K, S1, S2, F, P;
typedef struct { _Alignas(64) atomic_long w[8]; } line_t;
static line_t *ab, *ba;
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static inline void put(line_t *r, long i, long dep){ line_t *l=&r[(i+dep)%LINES]; for(int k=0;k<W-1;k++) atomic_store_explicit(&l->w[k+1], i+k, memory_order_relaxed); atomic_store_explicit(&l->w[0], i, memory_order_release);}
static inline long zero(long x){ __asm__ volatile("and $0, %0" : "+r"(x)); return x; }
static inline long chain(long s, int n){ for(int k=0;k<n;k++) { s = s*3+1; __asm__ volatile("" : "+r"(s)); } return s; }
/* Returns a zero that depends on the whole chain. */
static inline long get(line_t *r, long i, line_t *reply){ line_t *l=&r[i%LINES]; long x=1; while(atomic_load_explicit(&l->w[0],memory_order_acquire)!=i) { x = chain(x, K); }
  long s=0; for(int k=0;k<W-1;k++) s+=atomic_load_explicit(&l->w[k+1],memory_order_relaxed);
  s = chain(s, S1);
  if (F) __builtin_prefetch(&reply[(i + zero(s))%LINES], 1, 3);
  s = chain(s, S2);
  return zero(s) + zero(x);}
static void* echo(void*a){pin(1); for(long i=1;i<=N;i++){long d=get(ab,i,ba); put(ba,i,d); d=chain(d,P);} return 0;}
int main(int c,char**v){K=atoi(v[1]); S1=atoi(v[2]); S2=atoi(v[3]); F=atoi(v[4]); P=c>5?atoi(v[5]):0;
 ab=aligned_alloc(4096,sizeof(line_t)*LINES); ba=aligned_alloc(4096,sizeof(line_t)*LINES);
 for(int i=0;i<LINES;i++)for(int k=0;k<8;k++){ab[i].w[k]=0;ba[i].w[k]=0;}
 pthread_t t;pthread_create(&t,0,echo,0);pin(0);
 struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0); long d=0;
 for(long i=1;i<=N;i++){put(ab,i,d); d=zero(chain(d,P)); d=get(ba,i+d,ab+1);}
 clock_gettime(CLOCK_MONOTONIC,&t1); pthread_join(t,0);
 double ns=(t1.tv_sec-t0.tv_sec)*1e9+(t1.tv_nsec-t0.tv_nsec);
 printf("P=%d K=%d S1=%d S2=%d F=%d one-way %.1f ns\n",P,K,S1,S2,F,ns/N/2);}
