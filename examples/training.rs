//! Data-parallel training: `cargo run --release --example training [-- RANKS]` (default 3).
//!
//! Started by hand, it launches itself as RANKS local ranks. Every rank holds the same small
//! model, a multilayer perceptron (8 inputs, 32 tanh units, 1 output) initialised from one seed,
//! and trains it by stochastic gradient descent on generated data (a smooth function of the
//! inputs): each step takes one global batch of 96 samples, and each rank computes the gradient of
//! its share (every RANKS-th sample).
//!
//! The gradients are summed across ranks in buckets, as training frameworks do: the backward pass
//! runs from the output layer to the input layer, and as soon as a layer's gradient is complete
//! its bucket is all-reduced by a spawned task (`Comm::allreduce_owned`), while the backward pass
//! goes on with the layers below. Each rank then waits for its buckets and applies the same
//! update, so the replicas stay equal.
//!
//! At the end every rank trains the same model alone on the whole batches (the single-process
//! reference) and compares: the weights agree to within [`TOLERANCE`] (they differ only by the
//! order in which the floating-point sums were taken). Rank 0 prints the report.

use ferrocomm::{Comm, ReduceOp, World};

/// Inputs, hidden units.
const D: usize = 8;
const H: usize = 32;
/// Parameters: W1 (H x D), b1 (H), W2 (H), b2 (1), in this order in one vector.
const P: usize = H * D + H + H + 1;
const W1: std::ops::Range<usize> = 0..H * D;
const B1: std::ops::Range<usize> = H * D..H * D + H;
const W2: std::ops::Range<usize> = H * D + H..H * D + 2 * H;
const B2: usize = H * D + 2 * H;

/// The largest difference allowed between a weight trained on several ranks and the same weight
/// trained by one process. The two differ only by rounding in the order of the f32 sums
/// (a few units in the last place per step, 1e-7 relative): far below this.
pub(crate) const TOLERANCE: f32 = 1e-4;

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub steps: usize,
    pub batch: usize,
    pub samples: usize,
    pub rate: f32,
}

impl Default for Options {
    fn default() -> Self {
        Options { steps: 150, batch: 96, samples: 1536, rate: 0.05 }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A number in [-1, 1) from `seed`.
fn uniform(seed: u64) -> f32 {
    (splitmix(seed) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Sample `i`: its inputs and its target, a smooth function of them.
fn sample(i: usize) -> ([f32; D], f32) {
    let x: [f32; D] = std::array::from_fn(|k| uniform((i * D + k) as u64));
    let t = (0.7 * x[0] - 0.4 * x[3] + 0.2 * x[5]).sin() + 0.5 * x[1] * x[2];
    (x, t)
}

/// The initial weights (the same on every rank: one seed).
fn init() -> Vec<f32> {
    let mut p: Vec<f32> = (0..P).map(|i| 0.3 * uniform(1_000_000 + i as u64)).collect();
    p[B2] = 0.0;
    p
}

/// The activations of `x`'s hidden layer and the output.
fn forward(p: &[f32], x: &[f32; D]) -> ([f32; H], f32) {
    let mut a = [0f32; H];
    let mut y = p[B2];
    for j in 0..H {
        let row = &p[W1.start + j * D..W1.start + (j + 1) * D];
        let z = p[B1.start + j] + row.iter().zip(x).map(|(w, x)| w * x).sum::<f32>();
        a[j] = z.tanh();
        y += p[W2.start + j] * a[j];
    }
    (a, y)
}

/// One step on `samples` (indices): the summed (not averaged) gradient, computed layer by layer
/// from the output down. `ready(range, gradient)` is called as soon as the gradient of the
/// parameters in `range` is complete, with those values: the caller starts their reduction then.
/// Returns the summed loss.
fn backward(p: &[f32], samples: &[usize], mut ready: impl FnMut(std::ops::Range<usize>, Vec<f32>)) -> f32 {
    let fwd: Vec<_> = samples.iter().map(|&i| (sample(i), forward(p, &sample(i).0))).collect();
    let loss = fwd.iter().map(|((_, t), (_, y))| 0.5 * (y - t) * (y - t)).sum();
    // Output layer: W2 and b2, one bucket.
    let mut top = vec![0f32; H + 1];
    for ((_, t), (a, y)) in &fwd {
        let dy = y - t;
        top.iter_mut().zip(a).for_each(|(g, a)| *g += dy * a);
        top[H] += dy;
    }
    ready(W2.start..B2 + 1, top);
    // Hidden layer: b1, then W1 in two buckets (its first and second half of rows).
    let dz: Vec<[f32; H]> = fwd
        .iter()
        .map(|((_, t), (a, y))| std::array::from_fn(|j| (y - t) * p[W2.start + j] * (1.0 - a[j] * a[j])))
        .collect();
    let mut b1 = vec![0f32; H];
    dz.iter().for_each(|d| b1.iter_mut().zip(d).for_each(|(g, d)| *g += d));
    ready(B1, b1);
    for rows in [0..H / 2, H / 2..H] {
        let mut w1 = vec![0f32; rows.len() * D];
        for (((x, _), _), d) in fwd.iter().zip(&dz) {
            for (j, g) in rows.clone().zip(w1.chunks_exact_mut(D)) {
                g.iter_mut().zip(x).for_each(|(g, x)| *g += d[j] * x);
            }
        }
        ready(W1.start + rows.start * D..W1.start + rows.end * D, w1);
    }
    loss
}

/// The samples of step `s`'s global batch.
fn batch(o: &Options, s: usize) -> impl Iterator<Item = usize> + '_ {
    (0..o.batch).map(move |k| (s * o.batch + k) % o.samples)
}

/// Trains on one process: the reference.
fn train_alone(o: &Options) -> Vec<f32> {
    let mut p = init();
    for s in 0..o.steps {
        let samples: Vec<usize> = batch(o, s).collect();
        let mut grad = vec![0f32; P];
        backward(&p, &samples, |range, g| grad[range].copy_from_slice(&g));
        p.iter_mut().zip(&grad).for_each(|(w, g)| *w -= o.rate * g / o.batch as f32);
    }
    p
}

/// Trains on every rank of `comm`, each on its share of each batch, the buckets all-reduced by
/// spawned tasks during the backward pass. Returns the weights and the first and last step's
/// mean loss over the global batch.
async fn train(comm: &Comm, o: &Options) -> ferrocomm::Result<(Vec<f32>, f32, f32)> {
    let (r, n) = (comm.rank() as usize, comm.size() as usize);
    let mut p = init();
    let (mut first, mut last) = (0.0, 0.0);
    for s in 0..o.steps {
        let mine: Vec<usize> = batch(o, s).skip(r).step_by(n).collect();
        let mut pending = Vec::new();
        let loss = backward(&p, &mine, |range, g| {
            // In flight while the backward pass computes the next bucket.
            pending.push((range, tokio::spawn(comm.allreduce_owned(g, ReduceOp::Sum))));
        });
        // The loss rides along with the last bucket's wait: one more small all-reduce.
        let loss = comm.allreduce_owned(vec![loss], ReduceOp::Sum);
        let mut grad = vec![0f32; P];
        for (range, task) in pending {
            let g = task.await.expect("the all-reduce task ran")?;
            grad[range].copy_from_slice(&g);
        }
        let loss = loss.await?[0] / o.batch as f32;
        if s == 0 {
            first = loss;
        }
        last = loss;
        p.iter_mut().zip(&grad).for_each(|(w, g)| *w -= o.rate * g / o.batch as f32);
    }
    Ok((p, first, last))
}

/// The example on every rank of `world`; rank 0 returns the report.
pub(crate) async fn run(world: &World, o: &Options) -> ferrocomm::Result<Option<String>> {
    let (p, first, last) = train(world, o).await?;
    // Every rank checks itself against the reference; rank 0 reports the largest difference.
    let alone = train_alone(o);
    let diff = p.iter().zip(&alone).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let worst = world.reduce_owned(0, vec![diff], ReduceOp::Max).await?;
    Ok(worst.map(|w| {
        let verdict = if w[0] <= TOLERANCE { "within" } else { "OUTSIDE" };
        format!(
            "training: {} ranks, {} steps of {} samples, loss {first:.4} -> {last:.4}, 4 buckets per step; \
             max |w - w_single| {:.3e} over {P} weights, {verdict} tolerance {TOLERANCE:e}",
            world.size(),
            o.steps,
            o.batch,
            w[0],
        )
    }))
}

#[allow(dead_code)]
fn main() {
    // Outside a job: become the launcher of that many copies of ourselves (the first
    // argument, if it is a number).
    ferrorun::launch_self(std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(3)).expect("launch");
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let res = rt.block_on(async {
        let world = ferrocomm::init().await?;
        let report = run(&world, &Options::default()).await?;
        world.finalize().await?;
        Ok::<_, ferrocomm::Error>(report)
    });
    match res {
        Ok(Some(report)) => println!("{report}"),
        Ok(None) => {}
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
