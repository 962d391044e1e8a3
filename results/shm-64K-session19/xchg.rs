//! Temporary experiment (not committed): why 2-rank collectives at 16-64 KiB are slower by rendezvous.
use std::time::Instant;
use bytes::{Bytes, BytesMut};
use ferrocomm::ReduceOp;

fn main() {
    if std::env::var_os("FERROCOMM_RANK").is_none() {
        let exe = std::env::current_exe().unwrap();
        let args: Vec<_> = std::env::args_os().skip(1).collect();
        std::process::exit(ferrocomm::launch::run_local(2, &exe, &args, &Default::default()).unwrap());
    }
    let rank: usize = std::env::var("FERROCOMM_RANK").unwrap().parse().unwrap();
    unsafe {
        let mut s: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(rank, &mut s);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &s);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let w = ferrocomm::init().await.unwrap();
        let peer = 1 - w.rank();
        let len: usize = std::env::var("LEN").map(|v| v.parse().unwrap()).unwrap_or(32768);
        let fixed = Bytes::from(vec![1u8; len]);
        let input = vec![1u8; len];
        let mut buf = Some(BytesMut::zeroed(len));
        let mut floats = vec![1f32; len / 4];
        const N: usize = 3000;
        let mut dirty = vec![0u8; len + 4096];
        let off = dirty.as_ptr().align_offset(4096);
        let dptr = unsafe { dirty.as_mut_ptr().add(off) };
        for variant in ["fixed-recvfirst", "dirty-recvfirst", "fresh-recvfirst", "fixed-recvfirst", "dirty-recvfirst", "fresh-recvfirst"] {
            let mut times = Vec::new();
            for i in 0..N + 200 {
                w.barrier().await.unwrap();
                let t = Instant::now();
                match variant {
                    "allreduce" => w.allreduce(&mut floats, ReduceOp::Sum).await.unwrap(),
                    _ => {
                        let data = if variant.starts_with("fresh") {
                            Bytes::copy_from_slice(&input)
                        } else if variant.starts_with("dirty") {
                            unsafe { std::ptr::write_bytes(dptr, i as u8, len); Bytes::from_static(std::slice::from_raw_parts(dptr, len)) }
                        } else { fixed.clone() };
                        let into = buf.take().unwrap();
                        if variant.ends_with("recvfirst") {
                            let r = w.recv_into(peer, 1u64, into);
                            w.send(peer, 1, data).await.unwrap();
                            buf = Some(r.await.unwrap().0);
                        } else {
                            let s = w.send(peer, 1, data);
                            let r = w.recv_into(peer, 1u64, into);
                            let (s, r) = futures::join!(s, r);
                            s.unwrap();
                            buf = Some(r.unwrap().0);
                        }
                    }
                }
                if i >= 200 { times.push(t.elapsed().as_secs_f64() * 1e6); }
            }
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            if w.rank() == 0 {
                println!("{variant:16} len {len}: median {:.2} us, p10 {:.2}, p90 {:.2}", times[N / 2], times[N / 10], times[N * 9 / 10]);
            }
        }
        w.finalize().await.unwrap();
    });
}
