// The phase probe of measurements.txt ("line"): one-way time of a message between two threads pinned to
// CPUs 0 and 1. m2: one atomic bounced (the cache-line ping-pong); m0, m1: a 40-byte stamped frame written
// by five 8-byte stores or one 32-byte store, then its stamp; p: the reader pauses in its spin.
// rustc -O -C target-cpu=native --edition 2024 floor2.rs; ./floor2 (prints four rounds).
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::Instant;
#[repr(C)] struct CpuSet { bits: [u64; 16] }
unsafe extern "C" { fn sched_setaffinity(pid: i32, len: usize, set: *const CpuSet) -> i32; }
fn pin(cpu: usize) { let mut s = CpuSet { bits: [0; 16] }; s.bits[0] = 1 << cpu; unsafe { sched_setaffinity(0, 128, &s); } }
#[repr(C, align(64))] struct Line([u64; 8]);
struct P(*mut Line); unsafe impl Send for P {}
// mode 0: five 8-byte stores then stamp; 1: one 32-byte store then stamp; 2: atomic only (stamp alone)
#[inline(never)]
fn send(l: *mut Line, seq: u64, mode: u32) {
    unsafe {
        let b = (*l).0.as_mut_ptr();
        match mode {
            0 => { for k in 1..5 { std::ptr::write_volatile(b.add(k), seq ^ k as u64); } }
            1 => { use std::arch::x86_64::*; let v = _mm256_set1_epi64x(seq as i64); _mm256_storeu_si256(b.add(1) as *mut __m256i, v); }
            _ => {}
        }
        (*(b as *const AtomicU64)).store(seq, Release);
    }
}
#[inline(never)]
fn recv(l: *mut Line, seq: u64, pause: bool) -> u64 {
    unsafe {
        let b = (*l).0.as_mut_ptr();
        while (*(b as *const AtomicU64)).load(Acquire) != seq { if pause { std::hint::spin_loop(); } }
        std::ptr::read_volatile(b.add(4))
    }
}
fn run(n: u64, mode: u32, pause: bool) -> f64 {
    let a = Box::into_raw(Box::new(Line([0; 8]))); let b = Box::into_raw(Box::new(Line([0; 8])));
    let (pa, pb) = (P(a), P(b));
    let t = std::thread::spawn(move || { let (pa, pb) = (pa, pb); pin(1);
        for s in 1..=n { recv(pa.0, s, pause); send(pb.0, s, mode); } });
    pin(0);
    let mut t0 = Instant::now();
    for s in 1..=n { if s == 1001 { t0 = Instant::now(); } send(a, s, mode); recv(b, s, pause); }
    let dt = t0.elapsed().as_secs_f64(); t.join().unwrap();
    dt / (n - 1000) as f64 / 2.0 * 1e6
}
fn main() {
    for _ in 0..4 {
        for (mode, pause) in [(2, false), (0, false), (1, false), (0, true), (1, true)] {
            print!("m{mode}{} {:.3}  ", if pause {"p"} else {""}, run(1_000_000, mode, pause));
        }
        println!();
    }
}
