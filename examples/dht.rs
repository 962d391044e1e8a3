//! A distributed hash table on one-sided operations: `cargo run --release --example dht [-- RANKS
//! OPS]` (defaults 4 ranks, 20000 operations per rank).
//!
//! Started by hand, it launches itself as RANKS local ranks. Every rank serves one shard of the
//! table, a published segment of 16-byte slots (key, value), and runs a client loop over the whole
//! table at once: lookups are one-sided gets of a key's probe window (four slots, one cache
//! line), inserts claim a slot with compare-and-swap on its key word and then put the value. No
//! shard owner takes part in any of it: over shared memory the clients work on the mapped shards
//! directly, over TCP the owners' progress tasks serve them.
//!
//! Half of the key space is loaded first, then each client mixes 80% lookups and 20% inserts of
//! random keys; rank 0 prints the hit rate and the operations per second, and checks that every
//! value found is the one its key was inserted with.

use std::time::{Duration, Instant};

use ferrocomm::{Access, Deadline, RemoteSegment, SegmentId, World};

/// Slots per probe window: a lookup reads them with one get.
const PROBE: usize = 4;
const SLOT: usize = 16;

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    /// Operations per rank in the timed loop.
    pub ops: u64,
    /// Keys are 1..=keys.
    pub keys: u64,
    /// Slots per shard (the table holds ranks x slots).
    pub slots: usize,
    /// Percentage of lookups in the loop (the rest are inserts).
    pub lookups: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options { ops: 20_000, keys: 8192, slots: 8192, lookups: 80 }
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The value a key is inserted with (never 0: 0 is "being inserted").
fn value_of(key: u64) -> u64 {
    splitmix(key ^ 0x5555) | 1
}

struct Table {
    shards: Vec<RemoteSegment>,
    slots: usize,
}

impl Table {
    /// (shard, byte offset of the first slot of the key's probe window).
    fn home(&self, key: u64) -> (usize, usize) {
        let h = splitmix(key);
        let n = self.shards.len() as u64;
        ((h % n) as usize, ((h / n) % self.slots as u64) as usize * SLOT)
    }

    /// One get of the probe window: the value if the key is there (0 while its insert is under way).
    async fn lookup(&self, w: &World, key: u64) -> ferrocomm::Result<Option<u64>> {
        let (shard, at) = self.home(key);
        let mut window = [0u8; PROBE * SLOT];
        w.get(&self.shards[shard], at, &mut window).await?;
        for s in window.chunks_exact(SLOT) {
            let k = u64::from_le_bytes(s[..8].try_into().unwrap());
            if k == key {
                return Ok(Some(u64::from_le_bytes(s[8..].try_into().unwrap())));
            }
            if k == 0 {
                break;
            }
        }
        Ok(None)
    }

    /// Claims a slot for `key` with compare-and-swap and puts its value; false if its window is full.
    async fn insert(&self, w: &World, key: u64) -> ferrocomm::Result<bool> {
        let (shard, at) = self.home(key);
        let seg = &self.shards[shard];
        for p in 0..PROBE {
            let slot = at + p * SLOT;
            let old = w.compare_and_swap(seg, slot, 0, key).await?;
            if old == 0 || old == key {
                w.put(seg, slot + 8, &value_of(key).to_le_bytes()).await?;
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// Runs the table on `world`; rank 0 gets the report.
pub(crate) async fn run(world: &World, o: &Options) -> ferrocomm::Result<Option<String>> {
    let (rank, n) = (world.rank(), world.size());
    let limit = Duration::from_secs(120);
    // The window of the last slots runs past the shard's end: room for it.
    let shard = world.publish((o.slots + PROBE) * SLOT, Access::GET | Access::PUT | Access::ATOMIC)?;
    let ids = world.allgather(&[shard.id().to_u64()]).timeout(limit).await?;
    let mut shards = Vec::new();
    for id in ids {
        shards.push(world.attach(SegmentId::from_u64(id)).timeout(limit).await?);
    }
    let mapped = shards.iter().filter(|s| s.is_mapped()).count();
    let table = Table { shards, slots: o.slots };

    // Load half of the key space, each rank its share.
    let mut full = 0u64;
    for key in (1..=o.keys / 2).filter(|k| k % u64::from(n) == u64::from(rank)) {
        full += u64::from(!table.insert(world, key).await?);
    }
    world.barrier().timeout(limit).await?;

    let (mut hits, mut lookups, mut inserts, mut wrong) = (0u64, 0u64, 0u64, 0u64);
    let mut rng = splitmix(u64::from(rank) + 1);
    let t0 = Instant::now();
    for _ in 0..o.ops {
        rng = splitmix(rng);
        let key = rng % o.keys + 1;
        if (rng >> 32) % 100 < o.lookups {
            lookups += 1;
            match table.lookup(world, key).await? {
                Some(v) if v == value_of(key) => hits += 1,
                Some(0) | None => {}
                Some(_) => wrong += 1,
            }
        } else {
            inserts += 1;
            full += u64::from(!table.insert(world, key).await?);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    world.barrier().timeout(limit).await?;
    let stats = [hits, lookups, inserts, wrong, full, (secs * 1e6) as u64, mapped as u64];
    let all = world.allgather(&stats).timeout(limit).await?;
    drop(table);
    shard.unpublish().timeout(limit).await?;
    if rank != 0 {
        return Ok(None);
    }
    let sum = |i: usize| all.chunks_exact(stats.len()).map(|c| c[i]).sum::<u64>();
    let slowest = all.chunks_exact(stats.len()).map(|c| c[5]).max().unwrap_or(1).max(1) as f64 / 1e6;
    let ops = o.ops * u64::from(n);
    Ok(Some(format!(
        "dht: {n} ranks ({mapped} of {n} shards mapped at rank 0), {ops} operations in {slowest:.3} s: {:.0} ops/s; \
         lookups {}, hit rate {:.1}%; inserts {}; full windows {}; wrong values {}",
        ops as f64 / slowest,
        sum(1),
        100.0 * sum(0) as f64 / sum(1).max(1) as f64,
        sum(2),
        sum(4),
        sum(3),
    )))
}

#[allow(dead_code)]
fn main() {
    // Outside a job: become the launcher of that many copies of ourselves (the first
    // argument, if it is a number).
    ferrorun::launch_self(std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(4)).expect("launch");
    let mut o = Options::default();
    if let Some(ops) = std::env::args().nth(2).and_then(|a| a.parse().ok()) {
        o.ops = ops;
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let res = rt.block_on(async {
        let world = ferrocomm::init().await?;
        let report = run(&world, &o).await?;
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
