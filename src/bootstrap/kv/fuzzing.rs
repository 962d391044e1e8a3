//! The store's decoders, reachable from the fuzz targets in `fuzz/` (not a stable API; hidden
//! from the docs). They run the very functions the server and the client read the network
//! with, over bytes in memory instead of a socket.

use futures::FutureExt;

use super::{End, KvError, OP_GET, OP_PUT, Request, read_get_reply, read_request};

/// A request the server decoded: the lengths it read (the bytes themselves are not needed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded {
    Put { key: Vec<u8>, value_len: usize },
    Get { key: Vec<u8>, wait_ms: u64 },
}

/// Decodes `stream` as the server reads a connection after its handshake: the requests, in
/// order, and why it stopped (`None`: the stream ended cleanly between requests).
pub fn server_requests(mut stream: &[u8]) -> (Vec<Decoded>, Option<String>) {
    let mut out = Vec::new();
    loop {
        let Some(&op) = stream.first() else { return (out, None) };
        stream = &stream[1..];
        if op != OP_PUT && op != OP_GET {
            return (out, Some(format!("unknown request type {op:#04x}")));
        }
        let read = read_request(&mut stream, op).now_or_never().expect("reading from memory never waits");
        match read {
            Ok(Request::Put { key, value }) => out.push(Decoded::Put { key, value_len: value.len() }),
            Ok(Request::Get { key, wait }) => out.push(Decoded::Get { key, wait_ms: wait.as_millis() as u64 }),
            Err(End::Bad(why)) => return (out, Some(why)),
            Err(End::Io(e)) => return (out, Some(e.to_string())),
            Err(End::Closed) => return (out, Some("closed".into())),
        }
    }
}

/// Decodes `report` as a watch reads the store's report of a dead rank.
pub fn watch_report(mut report: &[u8]) -> Result<Vec<u8>, KvError> {
    super::read_report(&mut report).now_or_never().expect("reading from memory never waits")
}

/// Decodes `reply` as the client reads the answer to a get.
pub fn get_reply(mut reply: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
    read_get_reply(&mut reply).now_or_never().expect("reading from memory never waits")
}

/// The store's side of the handshake with `token`, reading `from_client` as what the client sent.
/// Returns whether the client was accepted (or why not) and what the store wrote.
pub fn server_handshake(from_client: &[u8], token: [u8; 32]) -> (Result<(), String>, Vec<u8>) {
    let key = super::JobSecret::new(token).handshake_key(super::Protocol::Store);
    let mut conn = tokio::io::join(from_client, Vec::new());
    let verdict = super::handshake(&mut conn, &key).now_or_never().expect("reading from memory never waits");
    let verdict = verdict.map_err(|end| match end {
        End::Bad(why) => why,
        End::Io(e) => e.to_string(),
        End::Closed => "closed".into(),
    });
    (verdict, conn.into_inner().1)
}

/// The client's side of the handshake with `token`, reading `from_store` as what the store sent.
/// Returns the verdict (the outer error is the connection's) and what the client wrote.
pub fn client_handshake(from_store: &[u8], token: [u8; 32]) -> (Result<Result<(), KvError>, std::io::Error>, Vec<u8>) {
    let mut conn = tokio::io::join(from_store, Vec::new());
    let verdict =
        super::client_handshake(&mut conn, "fuzz", &token).now_or_never().expect("reading from memory never waits");
    (verdict, conn.into_inner().1)
}
