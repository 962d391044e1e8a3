// Two threads pinned to CPUs 0 and 1 bounce a SIZE-byte message through a shared 256 KiB ring region:
// each copies the other's message out (memcpy) and its own in, the copy-in either by memcpy or by
// non-temporal stores (then sfence). Modes alternate every 100 ms; prints one-way us per window pair.
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
fn pin(cpu: usize) { unsafe { let mut s: CpuSet = std::mem::zeroed(); s.bits[cpu / 64] |= 1 << (cpu % 64); sched_setaffinity(0, std::mem::size_of::<CpuSet>(), &s); } }
#[repr(C)] struct CpuSet { bits: [u64; 16] }
unsafe extern "C" { fn sched_setaffinity(pid: i32, size: usize, set: *const CpuSet) -> i32; }
#[repr(C, align(64))] struct Line([u8; 64]);
struct Shared { flag: [AtomicU64; 2], mode: AtomicU64, buf: [*mut u8; 2] }
unsafe impl Sync for Shared {} unsafe impl Send for Shared {}
#[inline(never)]
unsafe fn copy_in(dst: *mut u8, src: *const u8, len: usize, nt: bool) {
    unsafe {
        if !nt { std::ptr::copy_nonoverlapping(src, dst, len); return; }
        let mut i = 0;
        while i + 64 <= len {
            for k in 0..4 {
                let a = _mm_loadu_si128(src.add(i + 16 * k) as *const __m128i);
                _mm_stream_si128(dst.add(i + 16 * k) as *mut __m128i, a);
            }
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}
fn main() {
    let size: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(65536);
    let secs: u64 = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(4);
    let alloc = || { let v: Vec<Line> = (0..(1 << 18) / 64).map(|_| Line([1; 64])).collect(); Box::leak(v.into_boxed_slice()).as_mut_ptr() as *mut u8 };
    let sh = Arc::new(Shared { flag: [AtomicU64::new(0), AtomicU64::new(0)], mode: AtomicU64::new(0), buf: [alloc(), alloc()] });
    let s2 = sh.clone();
    let stop = Arc::new(AtomicU64::new(0)); let st2 = stop.clone();
    let wrap = move |off: usize| (off + size + 64) % ((1 << 18) - size - 64) / 64 * 64;
    let t = std::thread::spawn(move || { pin(1); let mut mine = vec![0u8; size]; let mut n = 0u64; let mut off = 0usize;
        loop { while s2.flag[0].load(Ordering::Acquire) == n { if st2.load(Ordering::Relaxed) == 1 { return; } }
            n += 1; let nt = s2.mode.load(Ordering::Relaxed) == 1;
            unsafe { std::ptr::copy_nonoverlapping(s2.buf[0].add(off), mine.as_mut_ptr(), size); copy_in(s2.buf[1].add(off), mine.as_ptr(), size, nt); }
            off = wrap(off);
            s2.flag[1].store(n, Ordering::Release); } });
    pin(0);
    let mut mine = vec![7u8; size]; let mut n = 0u64; let mut off = 0usize;
    let end = Instant::now() + Duration::from_secs(secs);
    let mut win = Instant::now(); let mut count = 0u64; let mut out: [Vec<f64>; 2] = [vec![], vec![]];
    let mut mode = 0;
    while Instant::now() < end {
        unsafe { copy_in(sh.buf[0].add(off), mine.as_ptr(), size, mode == 1); }
        n += 1; sh.flag[0].store(n, Ordering::Release);
        while sh.flag[1].load(Ordering::Acquire) != n { }
        unsafe { std::ptr::copy_nonoverlapping(sh.buf[1].add(off), mine.as_mut_ptr(), size); }
        off = wrap(off);
        count += 1;
        if win.elapsed() >= Duration::from_millis(100) {
            out[mode].push(win.elapsed().as_secs_f64() * 1e6 / count as f64 / 2.0);
            mode ^= 1; sh.mode.store(mode as u64, Ordering::Relaxed);
            win = Instant::now(); count = 0;
        }
    }
    stop.store(1, Ordering::Relaxed); let _ = t.join();
    let f = |v: &Vec<f64>| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" ");
    println!("{size} B one way, memcpy in: {}", f(&out[0]));
    println!("{size} B one way, NT in:     {}", f(&out[1]));
}
