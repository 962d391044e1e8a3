use std::hint::black_box;
extern "C" { #[link_name = "getppid"] fn gp() -> i32; }
fn time<F: FnMut()>(name: &str, n: u64, mut f: F) {
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t0 = std::time::Instant::now();
        for _ in 0..n { f(); }
        best = best.min(t0.elapsed().as_nanos() as f64 / n as f64);
    }
    println!("{name:40} {best:9.1} ns/op");
}
fn main() {
    let pages: Vec<Box<[u8; 4096]>> = (0..64).map(|_| Box::new([1u8; 4096])).collect();
    let mut x = 0u64;
    for np in [0usize, 4, 16, 32] {
        time(&format!("syscall + loads from {np} pages"), 5000, || {
            x ^= unsafe { gp() } as u64;
            for p in 0..np { x = x.wrapping_add(black_box(&pages[p])[p * 64] as u64); }
        });
        time(&format!("no syscall, loads from {np} pages"), 5000, || {
            for p in 0..np { x = x.wrapping_add(black_box(&pages[p])[p * 64] as u64); }
        });
    }
    black_box(x);
}
