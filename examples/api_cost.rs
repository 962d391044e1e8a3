//! Instruction counts of the point-to-point API, for callgrind (not a timing): one rank posts a
//! `recv_into` from itself, sends 8 B to itself and awaits the receive, `N` times. With
//! `API_COST_RECORDER=1` a metrics recorder is installed first, as a service exporting metrics
//! would have.
//!
//! valgrind --tool=callgrind target/release/examples/api_cost 20000
use bytes::{Bytes, BytesMut};
use ferrocomm::{ProgressMode, Settings};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    if std::env::var("API_COST_RECORDER").is_ok() {
        let recorder = metrics_util::debugging::DebuggingRecorder::new();
        recorder.install().unwrap();
    }
    let settings = Settings::builder().progress(ProgressMode::BusyPoll).build();
    let w = ferrocomm::testing::cluster(1, settings).await.unwrap().remove(0);
    let data = Bytes::from(vec![7u8; 8]);
    let mut buf = Some(BytesMut::zeroed(8));
    let t = std::time::Instant::now();
    for _ in 0..n {
        let mut b = buf.take().unwrap();
        b.resize(8, 0);
        let op = w.recv_into(0u32, 5u64, b);
        w.send(0, 5, data.clone()).await.unwrap();
        let (b, _) = op.await.unwrap();
        buf = Some(b);
    }
    eprintln!("{:.1} ns per pair", t.elapsed().as_nanos() as f64 / n as f64);
    w.finalize().await.unwrap();
}
