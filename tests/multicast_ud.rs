//! Reliable multicast over an RDMA UD multicast group (cargo feature `verbs`; run over Soft-RoCE
//! by scripts/verbs-vm.sh): ranks as processes under `ferrorun` with `FERROCOMM_TRANSPORTS=verbs`,
//! so each channel's datagrams go by one UD send to the group (`Channel::network() == "ud"`) and
//! its ACKs, NACKs, co-root copies and retransmissions over the verbs RC connections.
//!
//! * **stream**: two roots each multicast 100 messages of 0 to 10 kB (up to 11 datagrams each at
//!   rxe's 1024-byte MTU; 40 messages with loss, where nearly every message needs a repair and the
//!   emulated VM makes each one slow) while `FERROCOMM_MCAST_TEST_DROP` drops that fraction of the
//!   UD datagrams each member receives, in the transport's receive path; every other rank must get
//!   every message exactly once and in order, and with loss the protocol must have retransmitted.
//! * **kill**: a receiver aborts half-way through a root's stream; the others' channel calls fail
//!   with `Error::PeerLost` naming it instead of hanging.
//!
//! The ranks are this test binary, re-run by `ferrorun` with `--exact rank_process` and the
//! scenario in `FERROCOMM_TEST_SCENARIO`; without that variable `rank_process` does nothing.
//! Without an RDMA device the tests say so and pass, unless `FERROCOMM_REQUIRE_VERBS` is set (the
//! VM run sets it).

mod common;

use std::time::Duration;

use bytes::Bytes;
use ferrocomm::multicast::Channel;
use ferrocomm::{Deadline, Error};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const SCENARIO: &str = "FERROCOMM_TEST_SCENARIO";
const MESSAGES: usize = 100;
/// Messages per root in the stream with loss (`FERROCOMM_TEST_MESSAGES` tells the ranks).
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
const MESSAGES_WITH_LOSS: usize = 40;
const MESSAGES_VAR: &str = "FERROCOMM_TEST_MESSAGES";
const ROOTS: [u32; 2] = [0, 2];
/// The receiver the kill scenario aborts, and after how many messages of root 0.
const VICTIM: u32 = 3;
const KILL_AFTER: usize = 40;

fn payload(root: u32, i: usize) -> Bytes {
    let len = (i * 7919 + root as usize * 131) % 10_000;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(2_654_435_761) ^ root) as u8).collect::<Vec<u8>>().into()
}

#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
fn launch(n: u32, scenario: &str, env: &[&str]) -> (Option<i32>, String, Duration) {
    // Blocking progress: ranks that sleep while they wait leave the VM's two (emulated) CPUs to
    // the others and to the kernel's Soft-RoCE work.
    // The group test may take long in an emulated VM: given 30 s rather than 2 s, so that a
    // busy moment does not send the channel to point-to-point (the test demands the UD group).
    let env: Vec<&str> = ["FERROCOMM_PROGRESS=blocking", "FERROCOMM_MCAST_CONFIRM_MS=30000"]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    common::Job { ferrorun: FERRORUN, rank_test: "rank_process", scenario_var: SCENARIO, grace_s: 5 }
        .run(n, scenario, "verbs", &env)
}

/// The value of `key=` on rank `r`'s result line.
#[cfg_attr(not(feature = "verbs"), allow(dead_code))]
fn field(text: &str, r: u32, key: &str) -> u64 {
    text.lines()
        .filter(|l| l.contains(&format!("MCAST-UD-OK rank={r} ")))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(&format!("{key}="))))
        .next_back()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= for rank {r} in:\n{text}"))
}

/// Exactly once and in order at every member over UD, at 0% and 20% injected receive loss with 4
/// ranks.
#[cfg(feature = "verbs")]
#[test]
fn exactly_once_in_order_over_ud_with_loss() {
    if !common::verbs_here("exactly_once_in_order_over_ud_with_loss") {
        return;
    }
    for (n, loss, messages) in [(4, 0.0, MESSAGES), (4, 0.2, MESSAGES_WITH_LOSS)] {
        let drop = format!("FERROCOMM_MCAST_TEST_DROP={loss}");
        let count = format!("{MESSAGES_VAR}={messages}");
        let (code, text, took) = launch(n, "stream", &[&drop, &count]);
        assert_eq!(code, Some(0), "{n} ranks, loss {loss}:\n{text}");
        let sum = |k: &str| (0..n).map(|r| field(&text, r, k)).sum::<u64>();
        for r in 0..n {
            assert_eq!(field(&text, r, "confirmed"), 1, "rank {r}: the UD group was not confirmed:\n{text}");
        }
        println!(
            "multicast over UD, {n} ranks, loss {:>2.0}%: {messages} messages from each of {:?} exactly once in \
             order at every rank in {took:?}; datagrams {}, NACKs {}, retransmissions {} (false {}), \
             ACKs at roots {} / co-roots {}, window stalls {}",
            loss * 100.0,
            &ROOTS[..],
            sum("datagrams"),
            sum("nacks"),
            sum("retx"),
            sum("false_retx"),
            sum("acks_root"),
            sum("acks_coroot"),
            sum("stalls"),
        );
        if loss > 0.0 {
            assert!(sum("retx") > 0, "loss {loss} needed retransmissions:\n{text}");
        }
    }
}

/// A member killed in the middle of a root's window: the others' channel calls fail with a typed
/// peer-lost error naming it, and the job ends (no hang).
#[cfg(feature = "verbs")]
#[test]
fn member_killed_mid_window_over_ud() {
    if !common::verbs_here("member_killed_mid_window_over_ud") {
        return;
    }
    let (code, text, took) = launch(4, "kill", &[]);
    assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
    for r in (0..4).filter(|&r| r != VICTIM) {
        assert!(text.contains(&format!("MCAST-UD-LOST-OK rank={r} ")), "rank {r}:\n{text}");
    }
    println!("multicast over UD, rank {VICTIM} killed mid-window: the 3 others report its loss; job {took:?}");
}

/// One rank of a scenario, when run by the tests above under `ferrorun`.
#[test]
fn rank_process() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let t = Duration::from_secs(300);
        let w = ferrocomm::init().await.unwrap();
        let me = w.rank();
        let chan = Channel::new(w.comm()).await.unwrap();
        assert_eq!(chan.network(), "ud", "rank {me}: the channel is not on a UD group");
        let confirmed = chan.wait_group(Duration::from_secs(60)).await;
        w.barrier().timeout(t).await.unwrap();
        match scenario.as_str() {
            "stream" => {
                let messages: usize = std::env::var(MESSAGES_VAR).ok().and_then(|v| v.parse().ok()).unwrap_or(MESSAGES);
                let sending = async {
                    if ROOTS.contains(&me) {
                        for i in 0..messages {
                            chan.send(payload(me, i)).timeout(t).await.unwrap();
                        }
                    }
                };
                let receiving = async {
                    for root in ROOTS.into_iter().filter(|&r| r != me) {
                        for i in 0..messages {
                            let m = chan.recv(root).timeout(t).await.unwrap();
                            assert!(
                                m == payload(root, i),
                                "rank {me}: message {i} of root {root} altered or out of order"
                            );
                        }
                    }
                };
                futures::join!(sending, receiving);
                chan.flush().timeout(t).await.unwrap();
                w.barrier().timeout(t).await.unwrap();
                // Exactly once: nothing more is left in any stream.
                for root in ROOTS.into_iter().filter(|&r| r != me) {
                    let extra = chan.recv(root).timeout(Duration::from_millis(200)).await;
                    assert!(matches!(extra, Err(Error::Timeout)), "rank {me}: extra message from {root}: {extra:?}");
                }
                let s = chan.stats();
                println!(
                    "MCAST-UD-OK rank={me} confirmed={} datagrams={} nacks={} retx={} false_retx={} acks_root={} \
                     acks_coroot={} stalls={}",
                    u8::from(confirmed),
                    s.datagrams_sent,
                    s.nacks_sent,
                    s.retransmissions,
                    s.false_retransmissions,
                    s.acks_at_root,
                    s.acks_at_coroot,
                    s.window_stalls
                );
                w.barrier().timeout(t).await.unwrap();
                drop(chan);
                w.finalize().await.unwrap();
            }
            "kill" => {
                let outcome: Result<(), Error> = async {
                    if me == 0 {
                        for i in 0..MESSAGES {
                            chan.send(payload(me, i)).timeout(t).await?;
                        }
                        chan.flush().timeout(t).await?;
                    } else {
                        for i in 0..MESSAGES {
                            if me == VICTIM && i == KILL_AFTER {
                                println!("rank {me}: aborting after {i} messages");
                                std::process::abort();
                            }
                            let m = chan.recv(0).timeout(t).await?;
                            assert!(m == payload(0, i), "rank {me}: message {i} altered or out of order");
                        }
                    }
                    // Everyone meets again: fails at once on the revoked communicator.
                    w.barrier().timeout(t).await
                }
                .await;
                match outcome {
                    Err(Error::PeerLost { rank, .. }) if rank == VICTIM => {
                        println!("MCAST-UD-LOST-OK rank={me} lost={rank}");
                    }
                    other => panic!("rank {me}: expected the loss of rank {VICTIM}, got {other:?}"),
                }
            }
            other => panic!("unknown scenario {other}"),
        }
    });
}
