/* Store-buffer probe (session 12): W stores to a line that R spins on, then K stores to its own
 * memory; prints W's cycles from the first store to after the K-th. Build: gcc -O2 -pthread.
 * Usage: ./a.out K.  Measured in a slow phase: K=0 24, 16 27, 32 46, 48 66, 64 90, 96 348, 128 377. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <x86intrin.h>
static _Alignas(64) atomic_long L;     /* written by W, spun on by R */
static _Alignas(64) atomic_long ack;   /* written by R */
static int K;
#define N 100000
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static void* reader(void*a){pin(1);for(long i=1;i<=N;i++){while(atomic_load_explicit(&L,memory_order_acquire)!=i);atomic_store_explicit(&ack,i,memory_order_release);}return 0;}
int main(int c,char**v){K=atoi(v[1]);pthread_t t;pthread_create(&t,0,reader,0);pin(0);
 volatile long sink[256]; unsigned long long tot=0;
 for(long i=1;i<=N;i++){
   while(atomic_load_explicit(&ack,memory_order_acquire)!=i-1);
   for(volatile int d=0;d<200;d++);           /* let R start spinning on L */
   unsigned long long t0=__rdtsc();
   atomic_store_explicit(&L,i,memory_order_release);
   for(int k=0;k<K;k++) sink[k]=k;
   unsigned long long t1=__rdtsc(); _mm_lfence();
   tot+=t1-t0;}
 pthread_join(t,0);printf("K=%d %llu cycles\n",K,tot/N);}
