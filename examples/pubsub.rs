//! Publish/subscribe over reliable multicast: `cargo run --release --example pubsub [-- RANKS]`
//! (default 4).
//!
//! Started by hand, it launches itself as RANKS local ranks. There are three topics, each with
//! one publisher (topic t is published by rank t mod RANKS) and a set of subscribers (rank r
//! subscribes to topic t unless 3 divides r + t). A topic is a communicator of its publisher and its
//! subscribers, made by `Comm::split`, and a reliable multicast `Channel` on it: the publisher's
//! messages go out once, as UDP multicast datagrams where the network carries them (point-to-point
//! where it does not: the channel tests the group and falls back by itself), and reach only that
//! topic's members, each exactly once and in order, lost datagrams recovered.
//!
//! Each publisher sends its topic's messages (a sequence number and a payload of varying length
//! that depends on it), then flushes (waits until every subscriber has them). Each subscriber
//! reads every topic it is on concurrently and checks each message's number and payload. Rank 0
//! gathers every rank's counts and prints the report.

use bytes::Bytes;
use ferrocomm::multicast::Channel;
use ferrocomm::{Comm, World};

const TOPICS: [&str; 3] = ["prices", "news", "weather"];

/// What to run.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    /// Messages per topic.
    pub messages: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options { messages: 300 }
    }
}

fn publisher(t: usize, n: u32) -> u32 {
    t as u32 % n
}

fn subscribes(r: u32, t: usize) -> bool {
    !(r as usize + t).is_multiple_of(3)
}

/// Message `seq` of topic `t`: its number, then 10 to 3009 bytes that depend on both.
fn message(t: usize, seq: u32) -> Bytes {
    let len = 10 + (seq as usize * 7919 + t * 31) % 3000;
    let mut b = Vec::with_capacity(4 + len);
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend((0..len).map(|i| (i as u32 ^ seq.wrapping_mul(2_654_435_761) ^ t as u32) as u8));
    b.into()
}

/// What one rank did on one topic.
#[derive(Default)]
struct Counts {
    published: u32,
    received: u32,
    wrong: u32,
    multicast: bool,
}

/// One topic at this rank, a member of it: publishes, or reads and checks everything published.
async fn topic(t: usize, comm: Comm, o: &Options, publisher: u32) -> ferrocomm::Result<Counts> {
    let chan = Channel::new(&comm).await?;
    let mut c = Counts::default();
    if comm.rank() == publisher {
        for seq in 0..o.messages {
            chan.send(message(t, seq)).await?;
            c.published += 1;
        }
        chan.flush().await?;
    } else {
        for seq in 0..o.messages {
            let m = chan.recv(publisher).await?;
            c.received += 1;
            if m != message(t, seq) {
                c.wrong += 1;
            }
        }
    }
    // The subscribers keep their channel (and acknowledge what they read) until the publisher's
    // flush has seen every acknowledgement.
    comm.barrier().await?;
    c.multicast = chan.confirmed();
    Ok(c)
}

/// The example on every rank of `world`; rank 0 returns the report.
pub(crate) async fn run(world: &World, o: &Options) -> ferrocomm::Result<Option<String>> {
    let (r, n) = (world.rank(), world.size());
    // One communicator per topic, its publisher first (rank 0 of it): every rank takes part in
    // every split, in the same order (split is collective), and stays out of the topics it has
    // nothing to do with.
    let mut mine = Vec::new();
    for t in 0..TOPICS.len() {
        let p = publisher(t, n);
        let member = r == p || subscribes(r, t);
        if let Some(comm) = world.split(member.then_some(t as u32), if r == p { 0 } else { 1 + r }).await? {
            mine.push((t, comm));
        }
    }
    let runs = mine.into_iter().map(|(t, comm)| async move { topic(t, comm, o, 0).await.map(|c| (t, c)) });
    let done = futures::future::try_join_all(runs).await?;
    // Per rank and topic: [published, received, wrong, multicast] (zeros where not a member).
    let mut row = vec![0u32; TOPICS.len() * 4];
    for (t, c) in &done {
        row[t * 4..t * 4 + 4].copy_from_slice(&[c.published, c.received, c.wrong, c.multicast as u32]);
    }
    let all = world.gather(0, &row).await?;
    world.barrier().await?;
    Ok(all.map(|all| {
        let rows: Vec<&[u32]> = all.chunks_exact(TOPICS.len() * 4).collect();
        let mut lines = vec![format!("pubsub: {n} ranks, {} topics, {} messages per topic", TOPICS.len(), o.messages)];
        for (t, name) in TOPICS.iter().enumerate() {
            let subs: Vec<u32> = (0..n).filter(|&q| q != publisher(t, n) && subscribes(q, t)).collect();
            let got: u32 = subs.iter().map(|&q| rows[q as usize][t * 4 + 1]).sum();
            let wrong: u32 = rows.iter().map(|row| row[t * 4 + 2]).sum();
            let stray: u32 = (0..n)
                .filter(|q| !subs.contains(q) && *q != publisher(t, n))
                .map(|q| rows[q as usize][t * 4 + 1])
                .sum();
            let by = if rows[publisher(t, n) as usize][t * 4 + 3] == 1 { "multicast" } else { "point-to-point" };
            lines.push(format!(
                "topic {name}: published {} by rank {}, {} subscribers received {got} of {} ({wrong} wrong, {stray} \
                 outside the topic), by {by}",
                rows[publisher(t, n) as usize][t * 4],
                publisher(t, n),
                subs.len(),
                subs.len() as u32 * o.messages,
            ));
        }
        lines.join("\n")
    }))
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
