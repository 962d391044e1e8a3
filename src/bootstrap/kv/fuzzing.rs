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

/// Decodes `reply` as the client reads the answer to a get.
pub fn get_reply(mut reply: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
    read_get_reply(&mut reply).now_or_never().expect("reading from memory never waits")
}
