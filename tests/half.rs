//! Half-precision elements (`f16`, `bf16`) through the API: all-reduce by every algorithm
//! (pinned in turn, the shared-memory board and single copy included), reduce, reduce-scatter
//! and scan, on several in-process ranks over shared memory and over TCP, against a sequential
//! `f64` reference.
//!
//! Tolerance, per element: `γ(n−1) · Σ|xᵢ|`, `γ(k) = k·u / (1 − k·u)`, `u = 2⁻¹¹` (`f16`) or
//! `2⁻⁸` (`bf16`): every pairwise step is one correctly rounded half operation, and any
//! combination order of `n` values has `n − 1` of them. Every rank's all-reduce result has the
//! same bits.

use std::time::Duration;

use ferrocomm::{Comm, Element, ProgressMode, ReduceOp, Settings, Table, TransportChoice, bf16, f16, testing};

trait Half: Element + std::fmt::Debug {
    /// Unit roundoff.
    const U: f64;
    fn of(v: f64) -> Self;
    fn f64(self) -> f64;
    fn bits(self) -> u16;
}

macro_rules! half {
    ($t:ident, $u:expr) => {
        impl Half for $t {
            const U: f64 = $u;
            fn of(v: f64) -> Self {
                $t::from_f64(v)
            }
            fn f64(self) -> f64 {
                self.to_f64()
            }
            fn bits(self) -> u16 {
                self.to_bits()
            }
        }
    };
}
half!(f16, 1.0 / 2048.0);
half!(bf16, 1.0 / 256.0);

/// Rank r's element i: in [−4, 4], both signs, fractional (sums round).
fn value(r: u32, i: usize) -> f64 {
    ((r as u64 * 7919 + i as u64 * 104_729) % 2001) as f64 / 250.0 - 4.0
}

fn input<T: Half>(r: u32, count: usize) -> Vec<T> {
    (0..count).map(|i| T::of(value(r, i))).collect()
}

/// Checks `got[i]` against the exact sum over `ranks` of their (rounded) inputs at `offset + i`.
fn check<T: Half>(got: &[T], ranks: std::ops::Range<u32>, offset: usize, what: &str) {
    let k = ranks.len().saturating_sub(1) as f64;
    let gamma = k * T::U / (1.0 - k * T::U);
    let inputs: Vec<Vec<T>> = ranks.map(|r| input(r, offset + got.len())).collect();
    for (i, g) in got.iter().enumerate() {
        let (exact, abs) = inputs.iter().fold((0.0, 0.0), |(s, a), x| {
            let v = x[offset + i].f64();
            (s + v, a + v.abs())
        });
        let tol = gamma * abs;
        assert!((g.f64() - exact).abs() <= tol, "{} {what} [{i}]: {g:?} vs exact {exact} (tolerance {tol})", T::NAME);
    }
}

/// Algorithms pinned in turn for the all-reduce (empty: the default table).
const PINS: [&str; 7] = [
    "",
    "allreduce=recursive-doubling",
    "allreduce=rabenseifner",
    "allreduce=ring",
    "allreduce=linear",
    "allreduce=shared-memory",
    "allreduce=single-copy",
];
/// Element counts: one, a few, past the board's 64 KiB per call (split into pieces), and past
/// the default table's switch points.
const COUNTS: [usize; 4] = [1, 37, 40_000, 150_001];

async fn all_operations<T: Half>(w: &Comm, pins: &[&str]) {
    let (r, n) = (w.rank(), w.size());
    for pin in pins {
        let c = if pin.is_empty() {
            w.clone()
        } else {
            w.with_collective_table(Table::default().with_overrides(pin).unwrap())
        };
        for count in COUNTS {
            let what = format!("allreduce [{pin}] n={n} count={count} rank {r}");
            let mut buf = input::<T>(r, count);
            c.allreduce(&mut buf, ReduceOp::Sum).await.unwrap();
            // Rank 0 checks the values; every rank has the same bits.
            if r == 0 {
                check(&buf, 0..n, 0, &what);
            }
            let bits: Vec<u16> = buf.iter().map(|v| v.bits()).collect();
            let all = c.allgather(&bits).await.unwrap();
            assert!(all.chunks(count).all(|b| b == bits), "{} {what}: ranks differ", T::NAME);
        }
    }
    let count = 1000;
    for root in [0, n - 1] {
        let got = w.reduce(root, &input::<T>(r, count), ReduceOp::Sum).await.unwrap();
        assert_eq!(got.is_some(), r == root);
        if let Some(got) = got {
            check(&got, 0..n, 0, &format!("reduce root {root} n={n}"));
        }
    }
    // Max is exact: the largest input.
    let mut m = input::<T>(r, count);
    w.allreduce(&mut m, ReduceOp::Max).await.unwrap();
    for (i, v) in m.iter().enumerate() {
        let want = (0..n).map(|q| T::of(value(q, i)).f64()).fold(f64::MIN, f64::max);
        assert_eq!(v.f64(), want, "{} max n={n} [{i}]", T::NAME);
    }
    let per = 250;
    let mine = w.reduce_scatter_block(&input::<T>(r, per * n as usize), ReduceOp::Sum).await.unwrap();
    assert_eq!(mine.len(), per);
    check(&mine, 0..n, per * r as usize, &format!("reduce_scatter n={n} rank {r}"));
    let mut prefix = input::<T>(r, count);
    w.scan(&mut prefix, ReduceOp::Sum).await.unwrap();
    check(&prefix, 0..r + 1, 0, &format!("scan n={n} rank {r}"));
    // Bitwise operators are not defined on floats: a typed error, not a wrong answer.
    assert!(w.allreduce(&mut input::<T>(r, 4), ReduceOp::BitXor).await.is_err());
}

async fn job(n: u32, settings: Settings, pins: &'static [&'static str]) {
    testing::run(n, settings, move |w| async move {
        all_operations::<f16>(&w, pins).await;
        all_operations::<bf16>(&w, pins).await;
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_reductions_over_shared_memory() {
    let shm = Settings::builder().progress(ProgressMode::Adaptive(Duration::from_micros(20))).build();
    for n in [2, 3, 4, 7] {
        job(n, shm.clone(), &PINS).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_precision_reductions_over_tcp() {
    let tcp = Settings::builder()
        .transports(TransportChoice::Tcp)
        .progress(ProgressMode::Adaptive(Duration::from_micros(20)))
        .build();
    job(3, tcp, &PINS[..5]).await;
}
