//! N ranks inside one process, for tests and examples: each rank has its own reactor thread and
//! real TCP connections on loopback, exactly as separate processes would.

use std::future::Future;

use crate::api::world::World;
use crate::bootstrap::{self, kv::KvServer};
use crate::config::Settings;
use crate::error::{Error, Result};

/// Starts `n` ranks in this process and returns their worlds (index = rank).
pub async fn cluster(n: u32, settings: Settings) -> Result<Vec<World>> {
    let mut token = [0u8; 32];
    getrandom::fill(&mut token).map_err(Error::system("a job token"))?;
    let store = KvServer::start("127.0.0.1:0".parse().unwrap(), token)
        .await
        .map_err(Error::bootstrap("starting the key-value store"))?;
    let coord = store.addr().to_string();
    let settings = Settings { bind: [127, 0, 0, 1].into(), ..settings };
    let joins = (0..n).map(|rank| {
        let (coord, settings) = (coord.clone(), settings.clone());
        tokio::spawn(async move { bootstrap::join(rank, n, &coord, token, None, settings).await })
    });
    let worlds = futures::future::join_all(joins).await;
    drop(store);
    worlds.into_iter().map(|w| w.map_err(Error::bootstrap("joining the in-process job"))?).collect()
}

/// Runs `f` on each of `n` in-process ranks concurrently (each as its own tokio task) and returns
/// the results in rank order.
pub async fn run<T, F, Fut>(n: u32, settings: Settings, f: F) -> Result<Vec<T>>
where
    F: Fn(World) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let worlds = cluster(n, settings).await?;
    let tasks: Vec<_> = worlds.into_iter().map(|w| tokio::spawn(f(w))).collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.map_err(Error::bootstrap("running a rank"))?);
    }
    Ok(out)
}
