use std::sync::atomic::{AtomicU64, Ordering};
use std::hint::black_box;
fn rdtsc() -> u64 { unsafe { core::arch::x86_64::_rdtsc() } }
#[inline(never)] fn f1(x: u64) -> u64 { x.wrapping_mul(3).wrapping_add(1) }
#[inline(never)] fn f2(x: u64) -> u64 { x ^ 0x55 }
fn time<F: FnMut()>(name: &str, n: u64, mut f: F) {
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t0 = std::time::Instant::now();
        for _ in 0..n { f(); }
        let ns = t0.elapsed().as_nanos() as f64 / n as f64;
        best = best.min(ns);
    }
    println!("{name:30} {best:8.2} ns/op");
}
fn main() {
    let n = 200_000;
    let mut x = 1u64;
    time("empty loop+black_box", n, || { x = black_box(x.wrapping_add(1)); });
    time("10 dependent adds", n, || { let mut y = x; for _ in 0..10 { y = y.wrapping_mul(3) ^ 7; } x = black_box(y); });
    let a = AtomicU64::new(0);
    time("atomic fetch_add (lock xadd)", n, || { a.fetch_add(1, Ordering::Relaxed); });
    time("atomic cmpxchg", n, || { let v = a.load(Ordering::Relaxed); let _ = a.compare_exchange(v, v + 1, Ordering::AcqRel, Ordering::Relaxed); });
    time("atomic store SeqCst (xchg)", n, || { a.store(x, Ordering::SeqCst); });
    time("mfence", n, || { std::sync::atomic::fence(Ordering::SeqCst); });
    time("direct call (no inline)", n, || { x = black_box(f1(black_box(x))); });
    let fs: [fn(u64) -> u64; 2] = [f1, f2];
    let mut i = 0usize;
    time("indirect call", n, || { i ^= 1; x = black_box((black_box(fs)[i])(x)); });
    let pages: Vec<Box<[u8; 4096]>> = (0..512).map(|_| Box::new([1u8; 4096])).collect();
    let mut k = 0usize;
    time("load from 512 pages round-robin", n, || { k = (k + 1) & 511; x = x.wrapping_add(black_box(&pages[k])[k * 7 & 4095] as u64); });
    time("load same page", n, || { x = x.wrapping_add(black_box(&pages[0])[x as usize & 4095] as u64); });
    time("rdtsc", n, || { x ^= rdtsc(); });
    time("syscall getppid", 20_000, || { x ^= unsafe { libc_getppid() } as u64; });
    time("Instant::now", 2_000, || { black_box(std::time::Instant::now()); });
    time("pause", 20_000, || { std::hint::spin_loop(); });
    time("sched_yield", 2_000, || { std::thread::yield_now(); });
    black_box(x);
}
extern "C" { #[link_name = "getppid"] fn libc_getppid() -> i32; }
