//! A tiny TCP key-value store for address exchange.
//!
//! Before ranks can talk to each other they must learn each other's
//! addresses. Each rank puts its own under a key and gets the others'; a get
//! waits until some rank has put the key. One process runs a [`KvServer`]
//! (`ferrorun`, or rank 0 under `mpirun`/`srun`); every rank connects with a
//! [`KvClient`].
//!
//! The store may be reachable by other users of the machine, so it trusts
//! nothing it reads:
//!
//! * every connection first passes the challenge-response handshake of
//!   [`ferrocomm_transports::auth`]: the store proves it holds the job token,
//!   then the client does, each with an HMAC over both sides' fresh nonces
//!   (checked in constant time). The token itself never travels, and a
//!   client sends nothing keyed to a store that has not proven itself; a
//!   wrong token fails on both sides with a clear error;
//! * keys are at most [`MAX_KEY_LEN`] bytes, values at most
//!   [`MAX_VALUE_LEN`], the store holds at most [`MAX_ENTRIES`] keys, and a
//!   length field is checked before anything is allocated for it;
//! * a malformed request closes that connection with a `tracing::warn!`
//!   naming the peer and the reason, and the server keeps serving the rest.
//!
//! Wire format (all integers little-endian):
//!
//! ```text
//! handshake  client: "FCKV" version:u8=2 nonce:[u8;32]
//!            server: "FCKV" version:u8=2 0u8 nonce:[u8;32] proof:[u8;32]
//!                  | "FCKV" version:u8=2 1u8 (the client's version is not spoken here; closes)
//!            client: 0u8 proof:[u8;32] | 1u8 (the store's proof is wrong; closes)
//!            server: 0u8 (accepted) | closes (the client's proof is wrong)
//! put        client: 1u8 key_len:u16 key value_len:u32 value
//!            server: 0u8 (stored) | 2u8 (store full)
//! get        client: 2u8 key_len:u16 key wait_ms:u32
//!            server: 0u8 value_len:u32 value | 1u8 (not put within wait_ms)
//! watch      client: 3u8 rank:u32
//!            server: 0u8, later (at most once) report_len:u32 report
//!            client: 4u8 (goodbye), or the connection closes
//! ```
//!
//! A *watch* is a rank's lifeline to the store, held for the whole job: the store sends the report
//! of a dead rank down it once one is known (the value of `notices::FAILED_KEY`), and a watch that
//! ends without the rank's goodbye (its process died, so its kernel closed the connection) makes
//! the store report that rank itself, unless a report is there already. So the store host sees
//! every rank's end the way a launcher sees its processes end, whoever hosts the store (`ferrorun`,
//! or rank 0 under `mpirun`, `srun` or by hand).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferrocomm_transports::auth::{
    CHALLENGE_LEN, Challenge, Connector, Ends, HandshakeError, HandshakeKey, JobSecret, Listener, NONCE_LEN, PROOF_LEN,
    Protocol,
};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep, sleep_until, timeout};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 64 * 1024;
/// Most keys the store holds.
pub const MAX_ENTRIES: usize = 1 << 20;

const MAGIC: &[u8; 4] = b"FCKV";
const VERSION: u8 = 3;
/// The client's hello: magic, version, nonce.
const HELLO_LEN: usize = 4 + 1 + NONCE_LEN;
/// The start of the store's answer: magic, version, status.
const ANSWER_LEN: usize = 4 + 1 + 1;

const HS_CHALLENGE: u8 = 0;
const HS_WRONG_VERSION: u8 = 1;
const HS_PROOF: u8 = 0;
const HS_REFUSE: u8 = 1;

const OP_PUT: u8 = 1;
const OP_GET: u8 = 2;
const OP_WATCH: u8 = 3;
const OP_BYE: u8 = 4;

const ST_OK: u8 = 0;
const ST_NOT_FOUND: u8 = 1;
const ST_FULL: u8 = 2;

/// How long a new connection may take to complete the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the rest of a request may take once its first byte arrived.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra time a client allows the server beyond the wait it asked for.
const REPLY_SLACK: Duration = Duration::from_secs(5);
/// How long a watch waits for a report before it waits again (its wait has no end).
const WATCH_WAIT: Duration = Duration::from_secs(3600);

/// Errors of [`KvClient`].
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KvError {
    /// The store's address could not be connected to, and retrying would
    /// not help.
    #[error("cannot connect to the key-value store at {addr}: {source}")]
    Connect {
        /// The store's address.
        addr: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Nothing accepted the connection before the timeout.
    #[error("the key-value store at {addr} did not accept a connection within {waited:?} (last error: {last})")]
    ConnectTimeout {
        /// The store's address.
        addr: String,
        /// How long the client tried.
        waited: Duration,
        /// The last attempt's error.
        last: String,
    },
    /// The peer closed the connection during the handshake: not a ferrocomm
    /// store, or it refused this client's proof of the token.
    #[error(
        "the key-value store at {addr} closed the connection during the handshake: not a ferrocomm store of this \
         version, or it refused this client's proof of the job token"
    )]
    Rejected {
        /// The store's address.
        addr: String,
    },
    /// The handshake failed: the store did not prove the job token (wrong
    /// token on one side, or a stranger at the store's address), or speaks
    /// another version.
    #[error("handshake with the key-value store at {addr}: {source}")]
    Handshake {
        /// The store's address.
        addr: String,
        /// The underlying error.
        #[source]
        source: HandshakeError,
    },
    /// No rank put the key before the timeout.
    #[error("timed out after {waited:?} waiting for key {key:?} in the key-value store")]
    Timeout {
        /// The key.
        key: String,
        /// How long the client tried.
        waited: Duration,
    },
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("key of {len} bytes is longer than the {MAX_KEY_LEN}-byte limit")]
    KeyTooLong {
        /// Its length, in bytes.
        len: usize,
    },
    /// The value is larger than [`MAX_VALUE_LEN`].
    #[error("value of {len} bytes is larger than the {MAX_VALUE_LEN}-byte limit")]
    ValueTooLarge {
        /// Its length, in bytes.
        len: usize,
    },
    /// The store holds [`MAX_ENTRIES`] keys already.
    #[error("the key-value store is full ({MAX_ENTRIES} keys)")]
    StoreFull,
    /// The connection failed.
    #[error("connection to the key-value store failed: {0}")]
    Io(#[from] io::Error),
    /// The store answered something this client does not understand.
    #[error("unexpected reply from the key-value store: {0}")]
    Protocol(String),
    /// An earlier operation was cancelled midway, so the connection's
    /// framing is lost.
    #[error("an earlier key-value operation on this connection was cancelled midway; reconnect")]
    Broken,
}

// ---------------------------------------------------------------- server --

#[derive(Default)]
struct Store {
    map: HashMap<Box<[u8]>, Arc<[u8]>>,
    /// Keys someone is waiting for, with the waiters' wake-up.
    waiters: HashMap<Box<[u8]>, Arc<Notify>>,
}

struct Shared {
    key: HandshakeKey,
    max_entries: usize,
    store: Mutex<Store>,
    /// Watches not yet sent the report (see [`KvServer::settle`]).
    untold: std::sync::atomic::AtomicUsize,
    /// The ranks that made a watch.
    watched: Mutex<std::collections::HashSet<u32>>,
}

/// Counts a watch among the untold until it is told or ends.
struct Untold<'a>(Option<&'a Shared>);

impl Untold<'_> {
    fn told(&mut self) {
        if let Some(s) = self.0.take() {
            s.untold.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}

impl Drop for Untold<'_> {
    fn drop(&mut self) {
        self.told();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock cannot leave the maps half-updated
        // (every update is a single insert/remove), so poisoning is ignored.
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `value`; false when the store is full.
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.put_if(key, value, true)
    }

    /// Stores `value` unless `key` holds one and `replace` is false; false when the store is full
    /// (or the key was kept).
    fn put_if(&self, key: Vec<u8>, value: Vec<u8>, replace: bool) -> bool {
        let mut s = self.lock();
        let there = s.map.contains_key(key.as_slice());
        if (there && !replace) || (!there && s.map.len() >= self.max_entries) {
            return false;
        }
        if let Some(n) = s.waiters.remove(key.as_slice()) {
            n.notify_waiters();
        }
        s.map.insert(key.into_boxed_slice(), value.into());
        true
    }

    /// The value of `key`, waiting until `deadline` for someone to put it.
    async fn get(&self, key: &[u8], deadline: Instant) -> Option<Arc<[u8]>> {
        loop {
            let notify = {
                let mut s = self.lock();
                if let Some(v) = s.map.get(key) {
                    return Some(v.clone());
                }
                s.waiters.entry(key.into()).or_default().clone()
            };
            let notified = notify.notified();
            tokio::pin!(notified);
            // Registered before the re-check, so a put in between still
            // wakes us.
            notified.as_mut().enable();
            if let Some(v) = self.lock().map.get(key) {
                return Some(v.clone());
            }
            tokio::select! {
                _ = &mut notified => continue,
                _ = sleep_until(deadline) => {
                    let mut s = self.lock();
                    if let Some(v) = s.map.get(key) {
                        return Some(v.clone());
                    }
                    // Forget the waiter entry unless another waiter holds it
                    // (the map's reference plus ours make two).
                    if s.waiters.get(key).is_some_and(|n| Arc::ptr_eq(n, &notify))
                        && Arc::strong_count(&notify) == 2
                    {
                        s.waiters.remove(key);
                    }
                    return None;
                }
            }
        }
    }
}

/// The key-value store. It serves until dropped.
pub struct KvServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
    shared: Arc<Shared>,
}

impl KvServer {
    /// Binds `bind` (port 0 picks a free port) and serves clients that
    /// present `token`.
    pub async fn start(bind: SocketAddr, token: [u8; 32]) -> io::Result<KvServer> {
        Self::start_with(bind, token, MAX_ENTRIES).await
    }

    async fn start_with(bind: SocketAddr, token: [u8; 32], max_entries: usize) -> io::Result<KvServer> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let key = JobSecret::new(token).handshake_key(Protocol::Store);
        let shared = Arc::new(Shared {
            key,
            max_entries,
            store: Mutex::new(Store::default()),
            untold: 0.into(),
            watched: Default::default(),
        });
        let task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(KvServer { addr, task, shared })
    }

    /// The address the store listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stores `value` under `key` from the process that runs the store, as a client's put would
    /// (a launcher telling the ranks something). False when the store is full.
    pub fn put(&self, key: &str, value: &[u8]) -> bool {
        self.shared.put(key.as_bytes().to_vec(), value.to_vec())
    }

    /// Reports rank `rank` dead (its process ended, `how`) to every rank's watch: what a launcher
    /// that hosts the store says when it sees a rank's process end before its goodbye. Replaces
    /// an earlier report in the store (watches already told keep the first).
    pub fn report_dead(&self, rank: u32, how: &str) {
        use super::notices::{FAILED_KEY, encode};
        self.shared.put(FAILED_KEY.as_bytes().to_vec(), encode(rank, how));
    }

    /// Before the store goes (this thread blocks): puts `report` under `key` unless a report is
    /// there already; then, if one is, waits until every watch was sent it or ended, for at most
    /// `limit`. Its connections are served on the runtime that started it: where that runtime's
    /// only thread is the one that waits here, the wait lasts the whole `limit` and the report
    /// may not go.
    pub(crate) fn tell_before_leaving(&self, key: &str, report: Option<Vec<u8>>, limit: Duration) {
        if let Some(value) = report {
            self.shared.put_if(key.as_bytes().to_vec(), value, false);
        }
        if !self.shared.lock().map.contains_key(key.as_bytes()) {
            return;
        }
        let deadline = std::time::Instant::now() + limit;
        while self.shared.untold.load(std::sync::atomic::Ordering::Acquire) > 0 && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Once `report` (the watches' report key) holds a value, waits until each of the ranks
    /// `0..size` made a watch and every watch was sent the report or ended, for at most `limit`:
    /// a store about to go lets its report reach every rank first, also ranks that come late.
    pub(crate) async fn settle(&self, report: &str, size: u32, limit: Duration) {
        let deadline = Instant::now() + limit;
        let all_watched = || self.shared.watched.lock().unwrap_or_else(|e| e.into_inner()).len() >= size as usize;
        while self.shared.lock().map.contains_key(report.as_bytes())
            && (!all_watched() || self.shared.untold.load(std::sync::atomic::Ordering::Acquire) > 0)
            && Instant::now() < deadline
        {
            sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        // Dropping the accept task drops its JoinSet, which aborts every
        // connection task.
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    conns.spawn(serve_conn(stream, peer, shared.clone()));
                }
                Err(e) => {
                    // Typically out of file descriptors: back off, go on.
                    tracing::warn!("kv store: accept failed: {e}");
                    sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

/// Why a connection ended.
enum End {
    /// The client closed it between requests.
    Closed,
    /// The client broke the protocol; worth a warning.
    Bad(String),
    /// The connection failed.
    Io(io::Error),
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            End::Bad("connection closed in the middle of a message".into())
        } else {
            End::Io(e)
        }
    }
}

async fn serve_conn(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    match serve(stream, &shared).await {
        End::Closed => tracing::debug!("kv store: {peer} disconnected"),
        End::Bad(reason) => tracing::warn!("kv store: closing connection from {peer}: {reason}"),
        End::Io(e) => tracing::debug!("kv store: connection from {peer} failed: {e}"),
    }
}

async fn serve(stream: TcpStream, shared: &Shared) -> End {
    let mut conn = BufReader::new(stream);
    match timeout(HANDSHAKE_TIMEOUT, handshake(&mut conn, &shared.key)).await {
        Err(_) => return End::Bad(format!("handshake not completed within {HANDSHAKE_TIMEOUT:?}")),
        Ok(Err(end)) => return end,
        Ok(Ok(())) => {}
    }

    loop {
        let op = match conn.read_u8().await {
            Ok(op) => op,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return End::Closed,
            Err(e) => return End::Io(e),
        };
        let request = match op {
            OP_PUT | OP_GET => timeout(REQUEST_TIMEOUT, read_request(&mut conn, op)).await,
            OP_WATCH => {
                return match timeout(REQUEST_TIMEOUT, conn.read_u32_le()).await {
                    Err(_) => End::Bad(format!("request not completed within {REQUEST_TIMEOUT:?}")),
                    Ok(Err(e)) => e.into(),
                    Ok(Ok(rank)) => watch(conn, shared, rank).await,
                };
            }
            other => return End::Bad(format!("unknown request type {other:#04x}")),
        };
        let reply = match request {
            Err(_) => return End::Bad(format!("request not completed within {REQUEST_TIMEOUT:?}")),
            Ok(Err(end)) => return end,
            Ok(Ok(Request::Put { key, value })) => {
                vec![if shared.put(key, value) { ST_OK } else { ST_FULL }]
            }
            Ok(Ok(Request::Get { key, wait })) => {
                match shared.get(&key, Instant::now() + wait).await {
                    Some(v) => {
                        let mut r = Vec::with_capacity(5 + v.len());
                        r.push(ST_OK);
                        // v.len() <= MAX_VALUE_LEN, which fits in u32.
                        r.extend_from_slice(&(v.len() as u32).to_le_bytes());
                        r.extend_from_slice(&v);
                        r
                    }
                    None => vec![ST_NOT_FOUND],
                }
            }
        };
        if let Err(e) = conn.write_all(&reply).await {
            return e.into();
        }
    }
}

/// Serves rank `rank`'s watch until its goodbye or the end of its connection; the latter reports
/// the rank as dead (see the module doc).
async fn watch(mut conn: BufReader<TcpStream>, shared: &Shared, rank: u32) -> End {
    use super::notices::{FAILED_KEY, encode};
    let lost = |how: &str| {
        tracing::warn!(rank, "kv store: rank {rank}'s connection {how}");
        // The first report stands: a rank that fails because of an earlier loss is no news.
        shared.put_if(FAILED_KEY.as_bytes().to_vec(), encode(rank, how), false);
    };
    shared.untold.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    shared.watched.lock().unwrap_or_else(|e| e.into_inner()).insert(rank);
    let mut untold = Untold(Some(shared));
    if let Err(e) = conn.write_all(&[ST_OK]).await {
        lost("failed");
        return e.into();
    }
    let mut told = false;
    loop {
        tokio::select! {
            // Cancel safe: a one-byte read either took the byte or did not.
            byte = conn.read_u8() => return match byte {
                Ok(OP_BYE) => End::Closed,
                Ok(other) => {
                    lost("broke the protocol");
                    End::Bad(format!("byte {other:#04x} on rank {rank}'s watch"))
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    lost("closed without a goodbye");
                    End::Closed
                }
                Err(e) => {
                    lost("failed");
                    End::Io(e)
                }
            },
            report = shared.get(FAILED_KEY.as_bytes(), Instant::now() + WATCH_WAIT), if !told => {
                let Some(report) = report else { continue };
                told = true;
                // A report's value is at most MAX_VALUE_LEN, which fits in u32.
                let msg = [&(report.len() as u32).to_le_bytes()[..], &report].concat();
                if let Err(e) = conn.write_all(&msg).await {
                    lost("failed");
                    return e.into();
                }
                untold.told();
            }
        }
    }
}

enum Request {
    Put {
        /// The key.
        key: Vec<u8>,
        /// The value.
        value: Vec<u8>,
    },
    Get {
        key: Vec<u8>,
        wait: Duration,
    },
}

async fn read_request<R: AsyncRead + Unpin>(conn: &mut R, op: u8) -> Result<Request, End> {
    let key_len = usize::from(conn.read_u16_le().await?);
    if key_len > MAX_KEY_LEN {
        return Err(End::Bad(format!("key length {key_len} exceeds {MAX_KEY_LEN}")));
    }
    let mut key = vec![0u8; key_len];
    conn.read_exact(&mut key).await?;
    if op == OP_PUT {
        let value_len = conn.read_u32_le().await? as usize;
        if value_len > MAX_VALUE_LEN {
            return Err(End::Bad(format!("value length {value_len} exceeds {MAX_VALUE_LEN}")));
        }
        let mut value = vec![0u8; value_len];
        conn.read_exact(&mut value).await?;
        Ok(Request::Put { key, value })
    } else {
        let wait_ms = conn.read_u32_le().await?;
        Ok(Request::Get { key, wait: Duration::from_millis(u64::from(wait_ms)) })
    }
}

/// The store's side of the handshake: answers a hello with a challenge, then checks the client's
/// proof. Every read is of a fixed size.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(conn: &mut S, key: &HandshakeKey) -> Result<(), End> {
    let mut hello = [0u8; HELLO_LEN];
    conn.read_exact(&mut hello).await?;
    if &hello[..4] != MAGIC {
        return Err(End::Bad("not a ferrocomm key-value client (bad magic)".into()));
    }
    if hello[4] != VERSION {
        // Say which version this store speaks, so the client can name the mismatch.
        conn.write_all(&[&MAGIC[..], &[VERSION, HS_WRONG_VERSION]].concat()).await?;
        return Err(End::Bad(format!("protocol version {} (this store speaks {VERSION})", hello[4])));
    }
    let nonce = hello[5..].try_into().expect("nonce length");
    let (listener, challenge) = Listener::new(key.clone(), Ends::STORE, nonce).map_err(|e| End::Bad(e.to_string()))?;
    conn.write_all(&[&MAGIC[..], &[VERSION, HS_CHALLENGE], &challenge.to_bytes()].concat()).await?;
    match conn.read_u8().await? {
        HS_PROOF => {
            let mut proof = [0u8; PROOF_LEN];
            conn.read_exact(&mut proof).await?;
            listener.check(&proof).map_err(|e| End::Bad(format!("wrong token: {e}")))?;
        }
        HS_REFUSE => return Err(End::Bad(format!("wrong token: {}", HandshakeError::Refused))),
        other => return Err(End::Bad(format!("unknown handshake step {other:#04x}"))),
    }
    conn.write_all(&[ST_OK]).await?;
    Ok(())
}

// ---------------------------------------------------------------- client --

/// The client's side of the handshake over `stream` (a socket; generic for the fuzz targets):
/// the outer error is the connection's, the inner one the handshake's verdict.
async fn client_handshake<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    addr: &str,
    token: &[u8; 32],
) -> io::Result<Result<(), KvError>> {
    let failed = |source| KvError::Handshake { addr: addr.to_string(), source };
    let key = JobSecret::new(*token).handshake_key(Protocol::Store);
    let connector = match Connector::new(key, Ends::STORE) {
        Ok(c) => c,
        Err(e) => return Ok(Err(failed(e))),
    };
    stream.write_all(&[&MAGIC[..], &[VERSION], connector.hello()].concat()).await?;
    let mut answer = [0u8; ANSWER_LEN];
    stream.read_exact(&mut answer).await?;
    if &answer[..4] != MAGIC {
        return Ok(Err(failed(HandshakeError::Malformed("not a ferrocomm key-value store (bad magic)"))));
    }
    match answer[5] {
        HS_CHALLENGE if answer[4] == VERSION => {}
        HS_WRONG_VERSION => {
            return Ok(Err(failed(HandshakeError::WrongVersion { ours: VERSION, theirs: answer[4] })));
        }
        _ => return Ok(Err(failed(HandshakeError::Malformed("unknown answer to the hello")))),
    }
    let mut challenge = [0u8; CHALLENGE_LEN];
    stream.read_exact(&mut challenge).await?;
    match connector.answer(&Challenge::from_bytes(&challenge)) {
        Ok(proof) => stream.write_all(&[&[HS_PROOF][..], &proof].concat()).await?,
        Err(e) => {
            // Nothing keyed goes to a store that did not prove itself; tell it why we go.
            let _ = stream.write_all(&[HS_REFUSE]).await;
            return Ok(Err(failed(e)));
        }
    }
    stream.read_u8().await.map(|status| match status {
        ST_OK => Ok(()),
        other => Err(KvError::Protocol(format!("handshake answered with {other:#04x}"))),
    })
}

/// A connection to the store.
pub struct KvClient {
    stream: TcpStream,
    /// Set while an operation is under way; still set if it was cancelled.
    in_flight: bool,
}

impl KvClient {
    /// Connects to `addr` (`host:port`) and presents `token`. The store may
    /// not be up yet: refused connections are retried until `timeout`.
    pub async fn connect(addr: &str, token: &[u8; 32], timeout: Duration) -> Result<KvClient, KvError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(10);
        let mut last;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let attempt = tokio::time::timeout(remaining, TcpStream::connect(addr)).await;
            match attempt {
                Ok(Ok(stream)) => {
                    let _ = stream.set_nodelay(true);
                    return Self::handshake(stream, addr, token, deadline, timeout).await;
                }
                Ok(Err(e)) if retryable(&e) => last = e.to_string(),
                Ok(Err(e)) => {
                    return Err(KvError::Connect { addr: addr.to_string(), source: e });
                }
                Err(_) => last = "connection attempt timed out".to_string(),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(KvError::ConnectTimeout { addr: addr.to_string(), waited: timeout, last });
            }
            sleep(backoff.min(deadline - now)).await;
            backoff = (backoff * 2).min(Duration::from_millis(250));
        }
    }

    async fn handshake(
        mut stream: TcpStream,
        addr: &str,
        token: &[u8; 32],
        deadline: Instant,
        waited: Duration,
    ) -> Result<KvClient, KvError> {
        let exchange = client_handshake(&mut stream, addr, token);
        match tokio::time::timeout_at(deadline, exchange).await {
            Err(_) => Err(KvError::ConnectTimeout {
                addr: addr.to_string(),
                waited,
                last: "no answer to the handshake".to_string(),
            }),
            Ok(Ok(Ok(()))) => Ok(KvClient { stream, in_flight: false }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                ) =>
            {
                Err(KvError::Rejected { addr: addr.to_string() })
            }
            Ok(Err(e)) => Err(KvError::Io(e)),
        }
    }

    /// Stores `value` under `key`, replacing any earlier value.
    pub async fn put(&mut self, key: &str, value: &[u8]) -> Result<(), KvError> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(KvError::ValueTooLarge { len: value.len() });
        }
        self.begin()?;
        let mut req = Vec::with_capacity(7 + key.len() + value.len());
        req.push(OP_PUT);
        req.extend_from_slice(&(key.len() as u16).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&(value.len() as u32).to_le_bytes());
        req.extend_from_slice(value);
        self.stream.write_all(&req).await?;
        let status = self.stream.read_u8().await?;
        self.in_flight = false;
        match status {
            ST_OK => Ok(()),
            ST_FULL => Err(KvError::StoreFull),
            other => {
                self.in_flight = true; // framing unknown from here on
                Err(KvError::Protocol(format!("put answered with {other:#04x}")))
            }
        }
    }

    /// The value of `key`, waiting up to `timeout` for some rank to put it.
    pub async fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, KvError> {
        check_key(key)?;
        self.begin()?;
        let wait_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let mut req = Vec::with_capacity(7 + key.len());
        req.push(OP_GET);
        req.extend_from_slice(&(key.len() as u16).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(&wait_ms.to_le_bytes());
        let timed_out = || KvError::Timeout { key: key.to_string(), waited: timeout };
        let stream = &mut self.stream;
        let exchange = async {
            stream.write_all(&req).await?;
            read_get_reply(stream).await
        };
        // The server answers by itself after `timeout`; the slack only
        // guards against a store that hangs. Past it the reply may still
        // come, so the connection stays marked as broken.
        match tokio::time::timeout(timeout.saturating_add(REPLY_SLACK), exchange).await {
            Err(_) => Err(timed_out()),
            Ok(Err(e)) => Err(e),
            Ok(Ok(found)) => {
                self.in_flight = false;
                found.ok_or_else(timed_out)
            }
        }
    }

    /// Turns this connection into rank `rank`'s watch (see the module doc): from now on the store
    /// takes the connection's end without [`KvWatch::goodbye`] for the rank's death.
    pub async fn watch(mut self, rank: u32) -> Result<KvWatch, KvError> {
        self.begin()?;
        self.stream.write_all(&[&[OP_WATCH][..], &rank.to_le_bytes()].concat()).await?;
        match self.stream.read_u8().await? {
            ST_OK => Ok(KvWatch { stream: self.stream }),
            other => Err(KvError::Protocol(format!("watch answered with {other:#04x}"))),
        }
    }

    fn begin(&mut self) -> Result<(), KvError> {
        if self.in_flight {
            return Err(KvError::Broken);
        }
        self.in_flight = true;
        Ok(())
    }
}

/// A rank's watch in the store ([`KvClient::watch`]).
pub struct KvWatch {
    stream: TcpStream,
}

impl KvWatch {
    /// Waits for the store's report of a dead rank (sent at most once). Cancel safe until the
    /// report's first byte arrives.
    pub async fn report(&mut self) -> Result<Vec<u8>, KvError> {
        read_report(&mut self.stream).await
    }

    /// A second handle on the connection, for [`KvWatch::goodbye`] from where no runtime runs
    /// (the world's shutdown). It keeps the connection open as long as it lives.
    pub fn goodbye_handle(&self) -> io::Result<std::net::TcpStream> {
        use std::os::fd::{AsFd, OwnedFd};
        let fd: OwnedFd = self.stream.as_fd().try_clone_to_owned()?;
        Ok(std::net::TcpStream::from(fd))
    }

    /// Says goodbye through `handle` ([`KvWatch::goodbye_handle`]): the rank leaves in order, so
    /// the end of its connection is no death. A single byte on an otherwise silent connection: it
    /// fits in the socket buffer, so the write does not block (an error means the store is gone,
    /// and then there is nobody to tell).
    pub fn goodbye(handle: &std::net::TcpStream) {
        use std::io::Write;
        let _ = (&*handle).write(&[OP_BYE]);
    }
}

/// A watch's report: its length, then the value.
async fn read_report<R: AsyncRead + Unpin>(stream: &mut R) -> Result<Vec<u8>, KvError> {
    let len = stream.read_u32_le().await? as usize;
    if len > MAX_VALUE_LEN {
        return Err(KvError::Protocol(format!("report length {len} exceeds {MAX_VALUE_LEN}")));
    }
    let mut value = vec![0u8; len];
    stream.read_exact(&mut value).await?;
    Ok(value)
}

/// The store's answer to a get: the value, or `None` if nobody put the key in time.
async fn read_get_reply<R: AsyncRead + Unpin>(stream: &mut R) -> Result<Option<Vec<u8>>, KvError> {
    match stream.read_u8().await? {
        ST_OK => {
            let len = stream.read_u32_le().await? as usize;
            if len > MAX_VALUE_LEN {
                return Err(KvError::Protocol(format!("value length {len} exceeds {MAX_VALUE_LEN}")));
            }
            let mut value = vec![0u8; len];
            stream.read_exact(&mut value).await?;
            Ok(Some(value))
        }
        ST_NOT_FOUND => Ok(None),
        other => Err(KvError::Protocol(format!("get answered with {other:#04x}"))),
    }
}

fn check_key(key: &str) -> Result<(), KvError> {
    if key.len() > MAX_KEY_LEN {
        return Err(KvError::KeyTooLong { len: key.len() });
    }
    Ok(())
}

/// Errors worth another connection attempt: the store is not up (yet).
fn retryable(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionReset | ConnectionAborted | TimedOut | HostUnreachable | NetworkUnreachable
    )
}

#[doc(hidden)]
pub mod fuzzing;

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{Ipv4Addr, TcpListener as StdListener};

    const TOKEN: [u8; 32] = [7u8; 32];
    const T: Duration = Duration::from_secs(5);

    fn loopback() -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
    }

    async fn server() -> (KvServer, String) {
        let s = KvServer::start(loopback(), TOKEN).await.unwrap();
        let a = s.addr().to_string();
        (s, a)
    }

    /// A raw connection that has passed the handshake.
    async fn raw_authenticated(addr: &str) -> TcpStream {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let c = Connector::new(JobSecret::new(TOKEN).handshake_key(Protocol::Store), Ends::STORE).unwrap();
        s.write_all(&[&MAGIC[..], &[VERSION], c.hello()].concat()).await.unwrap();
        let mut answer = [0u8; ANSWER_LEN + CHALLENGE_LEN];
        s.read_exact(&mut answer).await.unwrap();
        assert_eq!(answer[..ANSWER_LEN], [b'F', b'C', b'K', b'V', VERSION, HS_CHALLENGE]);
        let proof = c.answer(&Challenge::from_bytes(answer[ANSWER_LEN..].try_into().unwrap())).unwrap();
        s.write_all(&[&[HS_PROOF][..], &proof].concat()).await.unwrap();
        assert_eq!(s.read_u8().await.unwrap(), ST_OK);
        s
    }

    /// True when the server closes `s` (EOF or reset) instead of answering.
    async fn closed_by_server(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 16];
        match tokio::time::timeout(T, s.read(&mut buf)).await {
            Ok(Ok(0)) => true,
            Ok(Err(e)) => e.kind() == io::ErrorKind::ConnectionReset,
            _ => false,
        }
    }

    /// Everything the server sends until it closes `s`.
    async fn rest_until_closed(s: &mut TcpStream) -> Vec<u8> {
        let mut got = Vec::new();
        match tokio::time::timeout(T, s.read_to_end(&mut got)).await {
            Ok(Ok(_)) => got,
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionReset => got,
            other => panic!("not closed: {other:?}"),
        }
    }

    async fn still_serves(addr: &str) {
        let mut c = KvClient::connect(addr, &TOKEN, T).await.unwrap();
        c.put("alive", b"yes").await.unwrap();
        assert_eq!(c.get("alive", T).await.unwrap(), b"yes");
    }

    /// Captures tracing output of the current thread.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    impl Captured {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
        }
        fn install(&self) -> tracing::subscriber::DefaultGuard {
            let me = self.clone();
            let sub = tracing_subscriber::fmt()
                .with_writer(move || me.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::WARN)
                .finish();
            tracing::subscriber::set_default(sub)
        }
    }

    #[tokio::test]
    async fn put_get_across_clients() {
        let (_s, addr) = server().await;
        let mut a = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let mut b = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        a.put("rank/0", b"10.0.0.1:5000").await.unwrap();
        b.put("rank/1", b"").await.unwrap();
        assert_eq!(b.get("rank/0", T).await.unwrap(), b"10.0.0.1:5000");
        assert_eq!(a.get("rank/1", T).await.unwrap(), b"");
        a.put("rank/0", b"replaced").await.unwrap();
        assert_eq!(b.get("rank/0", T).await.unwrap(), b"replaced");
        let big = vec![0xabu8; MAX_VALUE_LEN];
        let long_key = "k".repeat(MAX_KEY_LEN);
        a.put(&long_key, &big).await.unwrap();
        assert_eq!(b.get(&long_key, T).await.unwrap(), big);
    }

    #[tokio::test]
    async fn get_waits_for_a_later_put() {
        let (_s, addr) = server().await;
        let mut waiter = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let mut putter = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let started = Instant::now();
        let get = tokio::spawn(async move { waiter.get("late", T).await });
        sleep(Duration::from_millis(200)).await;
        putter.put("late", b"here").await.unwrap();
        assert_eq!(get.await.unwrap().unwrap(), b"here");
        assert!(started.elapsed() >= Duration::from_millis(200));
    }

    #[tokio::test]
    async fn many_waiters_on_one_key() {
        let (_s, addr) = server().await;
        let mut gets = Vec::new();
        for _ in 0..8 {
            let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
            gets.push(tokio::spawn(async move { c.get("k", T).await }));
        }
        sleep(Duration::from_millis(100)).await;
        let mut p = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        p.put("k", b"v").await.unwrap();
        for g in gets {
            assert_eq!(g.await.unwrap().unwrap(), b"v");
        }
    }

    #[tokio::test]
    async fn get_times_out_naming_the_key_and_connection_stays_usable() {
        let (_s, addr) = server().await;
        let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let err = c.get("never", Duration::from_millis(100)).await.unwrap_err();
        assert!(matches!(&err, KvError::Timeout { key, .. } if key == "never"), "{err}");
        assert!(err.to_string().contains("\"never\""));
        c.put("never", b"now").await.unwrap();
        assert_eq!(c.get("never", Duration::ZERO).await.unwrap(), b"now");
    }

    fn handshake_error(r: Result<KvClient, KvError>) -> HandshakeError {
        match r {
            Err(KvError::Handshake { source, .. }) => source,
            Err(e) => panic!("not a handshake error: {e}"),
            Ok(_) => panic!("connected"),
        }
    }

    #[tokio::test]
    async fn wrong_token_is_refused_on_both_sides_while_others_continue() {
        let log = Captured::default();
        let _guard = log.install();
        let (_s, addr) = server().await;
        let mut good = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        good.put("a", b"1").await.unwrap();

        // The client holds the wrong token.
        let mut bad_token = TOKEN;
        bad_token[31] ^= 1;
        let err = KvClient::connect(&addr, &bad_token, T).await;
        let e = handshake_error(err);
        assert_eq!(e, HandshakeError::BadProof);
        assert!(e.to_string().contains("different tokens"), "{e}");

        // The store holds the wrong token.
        let wrong = KvServer::start(loopback(), bad_token).await.unwrap();
        let e = handshake_error(KvClient::connect(&wrong.addr().to_string(), &TOKEN, T).await);
        assert_eq!(e, HandshakeError::BadProof);

        // A client that skips checking the store's proof and sends a guess.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&[&MAGIC[..], &[VERSION], &[3u8; NONCE_LEN]].concat()).await.unwrap();
        let mut answer = [0u8; ANSWER_LEN + CHALLENGE_LEN];
        s.read_exact(&mut answer).await.unwrap();
        s.write_all(&[&[HS_PROOF][..], &[0u8; PROOF_LEN]].concat()).await.unwrap();
        assert!(rest_until_closed(&mut s).await.is_empty(), "accepted a wrong proof");

        assert_eq!(good.get("a", T).await.unwrap(), b"1");
        still_serves(&addr).await;
        let text = log.text();
        assert_eq!(text.matches("wrong token").count(), 3, "{text}");
        assert!(text.contains("refused this side's proof"), "the refusal is reported: {text}");
        assert!(text.contains("did not prove it holds the job token"), "{text}");
        assert!(text.contains("127.0.0.1:"), "peer not named: {text}");
        assert!(text.contains("WARN"), "{text}");
    }

    /// A fake store (it bound the address first) records everything a client sends, answering
    /// with a challenge it cannot make right. The recording holds no part of the token and
    /// nothing that opens a real store: replayed there, it is refused.
    #[tokio::test]
    async fn a_fake_store_learns_nothing_it_can_replay() {
        let fake = TcpListener::bind(loopback()).await.unwrap();
        let fake_addr = fake.local_addr().unwrap().to_string();
        let recorder = tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            // The best a stranger can do: a well-formed challenge with a made-up proof.
            s.write_all(&[&MAGIC[..], &[VERSION, HS_CHALLENGE], &[0x5a; CHALLENGE_LEN]].concat()).await.unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
            [&hello[..], &rest].concat()
        });
        let e = handshake_error(KvClient::connect(&fake_addr, &TOKEN, T).await);
        assert_eq!(e, HandshakeError::BadProof);
        let recorded = recorder.await.unwrap();
        assert_eq!(recorded.len(), HELLO_LEN + 1, "hello and refusal only");
        assert_eq!(recorded[HELLO_LEN], HS_REFUSE);
        assert!(!recorded.windows(4).any(|w| TOKEN.windows(4).any(|t| t == w)), "token bytes sent");

        // Replayed to the real store: it answers with a fresh challenge, the recording holds no
        // proof for it, and no request is served.
        let log = Captured::default();
        let _guard = log.install();
        let (_s, addr) = server().await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&recorded).await.unwrap();
        s.write_all(&[OP_GET, 1, 0, b'k', 0, 0, 0, 0]).await.ok();
        let answer = rest_until_closed(&mut s).await;
        assert_eq!(answer.len(), ANSWER_LEN + CHALLENGE_LEN, "challenge, then closed: {answer:?}");
        assert!(log.text().contains("wrong token"), "{}", log.text());
    }

    #[tokio::test]
    async fn oversize_lengths_are_refused() {
        let (_s, addr) = server().await;
        // Key length over the limit.
        let mut s = raw_authenticated(&addr).await;
        let mut req = vec![OP_PUT];
        req.extend_from_slice(&u16::MAX.to_le_bytes());
        s.write_all(&req).await.unwrap();
        assert!(closed_by_server(&mut s).await);

        // Value length of 4 GiB: refused without waiting for (or allocating)
        // the body.
        let mut s = raw_authenticated(&addr).await;
        let mut req = vec![OP_PUT];
        req.extend_from_slice(&1u16.to_le_bytes());
        req.push(b'k');
        req.extend_from_slice(&u32::MAX.to_le_bytes());
        s.write_all(&req).await.unwrap();
        assert!(closed_by_server(&mut s).await);

        still_serves(&addr).await;
    }

    #[tokio::test]
    async fn garbage_is_refused() {
        let log = Captured::default();
        let _guard = log.install();
        let (_s, addr) = server().await;
        let mut good = KvClient::connect(&addr, &TOKEN, T).await.unwrap();

        // Not even a handshake.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n-----------------").await.unwrap();
        assert!(closed_by_server(&mut s).await);

        // A handshake of the wrong version: told which version the store speaks.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let mut hello = MAGIC.to_vec();
        hello.push(99);
        hello.extend_from_slice(&[0; NONCE_LEN]);
        s.write_all(&hello).await.unwrap();
        assert_eq!(rest_until_closed(&mut s).await, [&MAGIC[..], &[VERSION, HS_WRONG_VERSION]].concat());

        // An unknown handshake step after the challenge.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&[&MAGIC[..], &[VERSION], &[0; NONCE_LEN]].concat()).await.unwrap();
        s.write_all(&[0x77; 40]).await.unwrap();
        assert_eq!(rest_until_closed(&mut s).await.len(), ANSWER_LEN + CHALLENGE_LEN);

        // An unknown request after a good handshake.
        let mut s = raw_authenticated(&addr).await;
        s.write_all(&[0xee, 1, 2, 3]).await.unwrap();
        assert!(closed_by_server(&mut s).await);

        // A request cut short.
        let mut s = raw_authenticated(&addr).await;
        s.write_all(&[OP_GET, 10, 0, b'a']).await.unwrap();
        s.shutdown().await.unwrap();
        assert!(closed_by_server(&mut s).await);

        good.put("x", b"y").await.unwrap();
        assert_eq!(good.get("x", T).await.unwrap(), b"y");
        let text = log.text();
        assert!(text.contains("bad magic"), "{text}");
        assert!(text.contains("protocol version 99"), "{text}");
        assert!(text.contains("unknown handshake step"), "{text}");
        assert!(text.contains("unknown request type"), "{text}");
        assert!(text.contains("middle of a message"), "{text}");
    }

    #[tokio::test]
    async fn client_side_limits() {
        let (_s, addr) = server().await;
        let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(c.put(&long, b"").await, Err(KvError::KeyTooLong { .. })));
        assert!(matches!(c.get(&long, T).await, Err(KvError::KeyTooLong { .. })));
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        assert!(matches!(c.put("k", &big).await, Err(KvError::ValueTooLarge { .. })));
        // Nothing was sent, so the connection still works.
        c.put("k", b"v").await.unwrap();
    }

    #[tokio::test]
    async fn store_full() {
        let s = KvServer::start_with(loopback(), TOKEN, 2).await.unwrap();
        let addr = s.addr().to_string();
        let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        c.put("a", b"1").await.unwrap();
        c.put("b", b"2").await.unwrap();
        assert!(matches!(c.put("c", b"3").await, Err(KvError::StoreFull)));
        c.put("a", b"again").await.unwrap(); // replacing is fine
        assert_eq!(c.get("a", T).await.unwrap(), b"again");
    }

    #[tokio::test]
    async fn connect_waits_for_a_late_store() {
        let free = StdListener::bind(loopback()).unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        let a = addr.to_string();
        let client = tokio::spawn(async move { KvClient::connect(&a, &TOKEN, T).await });
        sleep(Duration::from_millis(300)).await;
        let _s = KvServer::start(addr, TOKEN).await.unwrap();
        let mut c = client.await.unwrap().unwrap();
        c.put("k", b"v").await.unwrap();
    }

    #[tokio::test]
    async fn connect_gives_up_after_timeout() {
        let free = StdListener::bind(loopback()).unwrap();
        let addr = free.local_addr().unwrap().to_string();
        drop(free);
        let started = Instant::now();
        let err = match KvClient::connect(&addr, &TOKEN, Duration::from_millis(300)).await {
            Err(e) => e,
            Ok(_) => panic!("connected to nothing"),
        };
        assert!(matches!(err, KvError::ConnectTimeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    #[tokio::test]
    async fn bad_address_fails_fast() {
        let err = match KvClient::connect("not an address", &TOKEN, T).await {
            Err(e) => e,
            Ok(_) => panic!("connected"),
        };
        assert!(matches!(err, KvError::Connect { .. }), "{err}");
    }

    #[tokio::test]
    async fn dropping_the_server_stops_it() {
        let (s, addr) = server().await;
        let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        c.put("k", b"v").await.unwrap();
        drop(s);
        sleep(Duration::from_millis(50)).await;
        // The open connection is closed and no new one is accepted.
        assert!(c.get("k", T).await.is_err());
        let r = KvClient::connect(&addr, &TOKEN, Duration::from_millis(200)).await;
        assert!(r.is_err());
    }

    #[tokio::test]
    async fn cancelled_operation_marks_the_connection_broken() {
        let (_s, addr) = server().await;
        let mut c = KvClient::connect(&addr, &TOKEN, T).await.unwrap();
        let _ = tokio::time::timeout(Duration::from_millis(50), c.get("missing", T)).await;
        assert!(matches!(c.put("k", b"v").await, Err(KvError::Broken)));
    }

    /// A store of another version: the client names both versions.
    #[tokio::test]
    async fn another_version_is_named() {
        let fake = TcpListener::bind(loopback()).await.unwrap();
        let addr = fake.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&[&MAGIC[..], &[7, HS_WRONG_VERSION]].concat()).await.unwrap();
        });
        let e = handshake_error(KvClient::connect(&addr, &TOKEN, T).await);
        assert_eq!(e, HandshakeError::WrongVersion { ours: VERSION, theirs: 7 });
    }

    /// Something else at the address: a clear error, no allocation sized by it.
    #[tokio::test]
    async fn not_a_store_is_named() {
        let fake = TcpListener::bind(loopback()).await.unwrap();
        let addr = fake.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n").await.unwrap();
            let _ = s.read(&mut [0u8; 64]).await;
        });
        let e = handshake_error(KvClient::connect(&addr, &TOKEN, T).await);
        assert!(matches!(e, HandshakeError::Malformed(_)), "{e}");
    }

    /// A watch that ends after its goodbye is no death; one that ends without it is reported
    /// (once: the first report stands) down every other watch, also one made later.
    #[tokio::test]
    async fn watches_report_a_rank_whose_connection_ends_without_a_goodbye() {
        use crate::bootstrap::notices::FAILED_KEY;
        let (server, addr) = server().await;
        let watch = |rank| {
            let addr = addr.clone();
            async move { KvClient::connect(&addr, &TOKEN, T).await.unwrap().watch(rank).await.unwrap() }
        };
        let mut w0 = watch(0).await;
        let leaving = watch(1).await;
        let handle = leaving.goodbye_handle().unwrap();
        KvWatch::goodbye(&handle);
        drop((leaving, handle));
        let dying = watch(2).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!server.shared.lock().map.contains_key(FAILED_KEY.as_bytes()), "a goodbye is no death");
        drop(dying);
        let report = tokio::time::timeout(T, w0.report()).await.unwrap().unwrap();
        assert_eq!(report, crate::bootstrap::notices::encode(2, "closed without a goodbye"));
        // A later death does not replace the first report; a later watch is told at once.
        drop(watch(3).await);
        let mut late = watch(4).await;
        assert_eq!(tokio::time::timeout(T, late.report()).await.unwrap().unwrap(), report);
    }

    /// A store that goes after a loss its host knows of first sends the report down every
    /// watch, so that each reads the report before the store's end; without a report it goes at
    /// once, and the watches see only its end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_goes_after_a_loss_tells_every_watch_first() {
        use crate::bootstrap::notices::{FAILED_KEY, encode};
        for lost in [true, false] {
            let (server, addr) = server().await;
            let mut watches = Vec::new();
            for rank in 1..4 {
                watches.push(KvClient::connect(&addr, &TOKEN, T).await.unwrap().watch(rank).await.unwrap());
            }
            let report = encode(2, "was lost (connection closed by peer), as rank 0 saw");
            let told = lost.then(|| report.clone());
            tokio::task::spawn_blocking(move || {
                server.tell_before_leaving(FAILED_KEY, told, T);
                drop(server);
            })
            .await
            .unwrap();
            for w in &mut watches {
                let got = tokio::time::timeout(T, w.report()).await.unwrap();
                if lost {
                    assert_eq!(got.unwrap(), report);
                } else {
                    assert!(got.is_err(), "no report, the store's end: {got:?}");
                }
            }
        }
    }
}
