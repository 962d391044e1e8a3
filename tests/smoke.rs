use bytes::Bytes;
use ferrocomm::{Settings, Source, TagMatch, TcpBackend, testing};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke() {
    for backend in [TcpBackend::Portable, TcpBackend::Uring] {
        let s = Settings { tcp_backend: backend, ..Settings::default() };
        let out = testing::run(4, s, |w| async move {
            let (r, n) = (w.rank(), w.size());
            w.send((r + 1) % n, 1, Bytes::from(vec![r as u8; 10])).await.unwrap();
            let m = w.recv((r + n - 1) % n, 1u64).await.unwrap();
            assert_eq!(m.data[0] as u32, (r + n - 1) % n);
            let big = Bytes::from(vec![7u8; 1 << 20]);
            w.send((r + 1) % n, 2, big.clone()).await.unwrap();
            let m = w.recv(Source::Any, TagMatch::Any).await.unwrap();
            assert_eq!(m.data, big);
            w.barrier().await.unwrap();
            w.transport_name()
        })
        .await
        .unwrap();
        println!("{out:?}");
    }
}
