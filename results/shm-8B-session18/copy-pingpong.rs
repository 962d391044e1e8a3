// Two threads pinned to CPUs 0 and 1 bounce a SIZE-byte message through a shared buffer: each copies
// the other's message out and its own in (as an eager ring does). Prints the one-way time per 200 ms window.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
fn pin(cpu: usize) { unsafe { let mut s: libc_cpu_set = std::mem::zeroed(); s.bits[cpu / 64] |= 1 << (cpu % 64); sched_setaffinity(0, std::mem::size_of::<libc_cpu_set>(), &s); } }
#[repr(C)] struct libc_cpu_set { bits: [u64; 16] }
extern "C" { fn sched_setaffinity(pid: i32, size: usize, set: *const libc_cpu_set) -> i32; }
struct Shared { flag: [AtomicU64; 2], buf: Vec<std::cell::UnsafeCell<Vec<u8>>> }
unsafe impl Sync for Shared {}
fn main() {
    let size: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(4096);
    let secs: u64 = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(10);
    let sh = Arc::new(Shared { flag: [AtomicU64::new(0), AtomicU64::new(0)], buf: (0..2).map(|_| std::cell::UnsafeCell::new(vec![1u8; 1 << 20])).collect() });
    let s2 = sh.clone();
    let stop = Arc::new(AtomicU64::new(0)); let st2 = stop.clone();
    let t = std::thread::spawn(move || { pin(1); let mut mine = vec![0u8; size]; let mut n = 0u64; let mut off = 0usize;
        loop { while s2.flag[0].load(Ordering::Acquire) == n { if st2.load(Ordering::Relaxed) == 1 { return; } std::hint::spin_loop(); }
            n += 1; unsafe { let b = &*s2.buf[0].get(); mine.copy_from_slice(&b[off..off + size]); let c = &mut *s2.buf[1].get(); c[off..off + size].copy_from_slice(&mine); }
            off = (off + size + 64) % ((1 << 18) - size - 64) / 64 * 64;
            s2.flag[1].store(n, Ordering::Release); } });
    pin(0);
    let mut mine = vec![7u8; size]; let mut n = 0u64; let mut off = 0usize;
    let end = Instant::now() + Duration::from_secs(secs);
    let mut win = Instant::now(); let mut count = 0u64; let mut out = vec![];
    while Instant::now() < end {
        unsafe { let b = &mut *sh.buf[0].get(); b[off..off + size].copy_from_slice(&mine); }
        n += 1; sh.flag[0].store(n, Ordering::Release);
        while sh.flag[1].load(Ordering::Acquire) != n { std::hint::spin_loop(); }
        unsafe { let c = &*sh.buf[1].get(); mine.copy_from_slice(&c[off..off + size]); }
        off = (off + size + 64) % ((1 << 18) - size - 64) / 64 * 64;
        count += 1;
        if win.elapsed() >= Duration::from_millis(200) { out.push(win.elapsed().as_secs_f64() * 1e6 / count as f64 / 2.0); win = Instant::now(); count = 0; }
    }
    stop.store(1, Ordering::Relaxed); let _ = t.join();
    let s: Vec<String> = out.iter().map(|x| format!("{x:.2}")).collect();
    println!("{size} B one-way us per 200 ms window: {}", s.join(" "));
}
