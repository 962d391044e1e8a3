//! A parameter server: `cargo run --release --example param_server [-- RANKS]` (default 4).
//!
//! Started by hand, it launches itself as RANKS local ranks. Rank 0 is the server: it holds the
//! parameters of a model and serves the other ranks, the workers, in whatever order their
//! requests come, with one wildcard receive (any source, any tag) whose tag says what the
//! message is. A worker repeatedly pulls the current parameters, computes a gradient on its own
//! data from them, and pushes it; the server applies each push as it arrives (asynchronous SGD:
//! a worker's gradient may be a few versions stale, and the server counts how stale).
//!
//! Tags: the low byte is the kind (pull, push, done); a pull carries the worker's iteration in the
//! rest of the tag, and the server answers it with the parameters tagged with that iteration, so
//! a worker receives exactly the reply to its own request (`TagMatch::Exact`).
//!
//! The model is a least-squares fit: worker w's data pull the parameters toward its own target
//! vector, and the optimum of all the workers' data together is the mean of the targets. The
//! server's step size is 1/(v+1) at version v, so that fresh gradients make the parameters the
//! running mean of what the workers pushed toward. The
//! server reports how far it ended from that optimum, and the count of pulls and pushes, which
//! must be exactly what the workers made.

use bytes::Bytes;
use ferrocomm::{Deadline, Source, TagMatch, World};

/// Parameters.
const DIM: usize = 64;

const PULL: u64 = 1;
const PUSH: u64 = 2;
const DONE: u64 = 3;
const PARAMS: u64 = 4;

/// What the example fails with: ferrocomm's errors, and breaches of its own protocol.
#[derive(Debug)]
pub(crate) enum PsError {
    /// A communication failed.
    Comm(ferrocomm::Error),
    /// One server and at least one worker are needed.
    TooFewRanks(u32),
    /// A message of a kind this protocol does not have.
    UnknownKind {
        /// The sender.
        rank: u32,
        /// The kind (the tag's low byte).
        kind: u64,
    },
}

impl From<ferrocomm::Error> for PsError {
    fn from(e: ferrocomm::Error) -> PsError {
        PsError::Comm(e)
    }
}

impl std::fmt::Display for PsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PsError::Comm(e) => write!(f, "{e}"),
            PsError::TooFewRanks(n) => write!(f, "a parameter server needs at least 2 ranks, not {n}"),
            PsError::UnknownKind { rank, kind } => write!(f, "rank {rank} sent an unknown kind {kind}"),
        }
    }
}

impl std::error::Error for PsError {}

fn tag(kind: u64, iteration: u64) -> u64 {
    (iteration << 8) | kind
}

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    /// Pull-compute-push rounds per worker.
    pub iterations: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options { iterations: 200 }
    }
}

/// How far from the optimum the server may end: stale gradients perturb the running mean a
/// little (a few hundredths with gradients up to 8 versions stale; the parameters' norm is
/// about 17).
pub(crate) const TOLERANCE: f64 = 0.25;

/// Worker `w`'s target: its data's optimum.
fn target(w: u32) -> Vec<f64> {
    (0..DIM).map(|i| ((w as f64 + 1.0) * 0.37 * (i as f64 + 1.0)).sin() * 3.0).collect()
}

fn encode(v: &[f64], version: u64) -> Bytes {
    let mut b = Vec::with_capacity(8 + v.len() * 8);
    b.extend_from_slice(&version.to_le_bytes());
    v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
    b.into()
}

fn decode(b: &[u8]) -> (Vec<f64>, u64) {
    let version = u64::from_le_bytes(b[..8].try_into().unwrap());
    let v = b[8..].chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
    (v, version)
}

/// The server's loop. Returns its report.
async fn serve(world: &World, o: &Options) -> Result<String, PsError> {
    let workers = world.size() - 1;
    let mut params = vec![0f64; DIM];
    let mut version = 0u64;
    let (mut pulls, mut pushes) = (vec![0u64; world.size() as usize], vec![0u64; world.size() as usize]);
    let (mut done, mut stalest) = (0, 0u64);
    let mut replies = Vec::new();
    while done < workers {
        // Whoever comes first, whatever it asks.
        let m = world.recv(Source::Any, TagMatch::Any).timeout(std::time::Duration::from_secs(60)).await?;
        match m.tag & 0xff {
            PULL => {
                pulls[m.source as usize] += 1;
                let reply = tag(PARAMS, m.tag >> 8);
                replies.push(world.send(m.source, reply, encode(&params, version)));
            }
            PUSH => {
                pushes[m.source as usize] += 1;
                let (grad, based_on) = decode(&m.data);
                stalest = stalest.max(version - based_on);
                // Step 1/(v+1): with fresh gradients, the running mean of the pushed targets.
                let rate = 1.0 / (version + 1) as f64;
                params.iter_mut().zip(&grad).for_each(|(p, g)| *p -= rate * g);
                version += 1;
            }
            DONE => done += 1,
            other => {
                return Err(PsError::UnknownKind { rank: m.source, kind: other });
            }
        }
    }
    for r in replies {
        r.await?;
    }
    let optimum: Vec<f64> =
        (0..DIM).map(|i| (1..=workers).map(|w| target(w)[i]).sum::<f64>() / workers as f64).collect();
    let distance = params.iter().zip(&optimum).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
    let verdict = if distance <= TOLERANCE { "within" } else { "OUTSIDE" };
    let uneven = (1..=workers as usize).filter(|&w| pulls[w] != o.iterations || pushes[w] != o.iterations).count();
    Ok(format!(
        "param-server: 1 server, {workers} workers, {} pulls, {} pushes, {} versions, {uneven} workers with a \
         count other than {}, stalest push {stalest} versions behind, distance to the optimum {distance:.6} ({verdict} tolerance \
         {TOLERANCE})",
        pulls.iter().sum::<u64>(),
        pushes.iter().sum::<u64>(),
        version,
        o.iterations,
    ))
}

/// A worker's loop.
async fn work(world: &World, o: &Options) -> ferrocomm::Result<()> {
    let goal = target(world.rank());
    for k in 0..o.iterations {
        // Post the receive of the reply first, then ask.
        let reply = world.recv(0, TagMatch::Exact(tag(PARAMS, k)));
        world.send(0, tag(PULL, k), Bytes::new()).await?;
        let (params, version) = decode(&reply.await?.data);
        // Gradient of 0.5 |p - goal|^2 on this worker's data.
        let grad: Vec<f64> = params.iter().zip(&goal).map(|(p, g)| p - g).collect();
        world.send(0, tag(PUSH, k), encode(&grad, version)).await?;
    }
    world.send(0, tag(DONE, 0), Bytes::new()).await
}

/// The example on every rank of `world` (at least 2); rank 0 returns the report.
pub(crate) async fn run(world: &World, o: &Options) -> Result<Option<String>, PsError> {
    if world.size() < 2 {
        return Err(PsError::TooFewRanks(world.size()));
    }
    let report = if world.rank() == 0 { Some(serve(world, o).await?) } else { work(world, o).await.map(|()| None)? };
    world.barrier().await?;
    Ok(report)
}

#[allow(dead_code)]
fn main() {
    // Outside a job: become the launcher of that many copies of ourselves (the first
    // argument, if it is a number).
    ferrorun::launch_self(std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4)).expect("launch");
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let res = rt.block_on(async {
        let world = ferrocomm::init().await?;
        let report = run(&world, &Options::default()).await?;
        world.finalize().await?;
        Ok::<_, PsError>(report)
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
