//! Routes through a proxy rank: a peer with no direct connection is reached through a rank that
//! has one to both ends; a peer whose direct connection is slow gets its large messages' data
//! through the proxy when the planner ([`plan`]) says that path is faster.
//!
//! A relayed frame travels in an envelope: a `Data` frame with [`flags::RELAY`], `seq` = final
//! destination, payload = the frame's own header and payload. The proxy reads an envelope whole
//! into a staging buffer and, when it is complete, hands the same buffer on toward its
//! destination, so a message cut into pieces crosses in a pipeline: the proxy receives the next
//! piece while it sends the last. The destination checks the inner header like any frame from
//! the network ([`Header::decode`]) and delivers it as if it came straight from its source.
//!
//! What goes through the proxy: everything to a peer without a direct connection (in order, as
//! every frame to it takes the same path); to a peer with a slow direct connection, only the
//! rendezvous data of messages the plan sends staged, while the handshake (RTS, CTS) and every
//! small message keep the direct connection and its order. The message's length comes from its
//! RTS: the CTS that answers it names the receive the data frames are addressed to.
//!
//! A proxy's loss is the loss of every peer reached only through it; a peer that also has a
//! direct connection falls back to it.
//!
//! Every route through a proxy is flow-controlled ([`flow`]): a source keeps at most a window of
//! envelope bytes unacknowledged on it, the destination returns credit through the proxy, and the
//! proxy refuses a source that exceeds its window; so a forwarding rank holds at most a window per
//! (source, destination) pair, whatever its peers send. Credits are `Credit` frames with
//! [`flags::RELAY`]: `tag` 0 from the destination to the proxy (`seq` = the source), `tag` 1 from
//! the proxy to the source (`seq` = the destination); `aux` = bytes.

pub mod flow;
pub mod plan;

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError, flags};
use crate::{Sink, Transport, TransportError};
pub use plan::{Costs, Hop, PeerPlan, Planner, ProbeSample, Route};

/// How frames reach one peer.
#[derive(Clone, Debug, PartialEq)]
pub enum Way {
    /// This rank itself, or a peer over another transport.
    None,
    /// The direct connection only.
    Direct,
    /// Everything through this proxy (no direct connection).
    Via(Rank),
    /// Direct, except the data of messages `plan` sends staged.
    Split(PeerPlan),
}

impl Way {
    /// The proxy this way uses, for everything or for large messages' data.
    pub fn proxy_for_data(&self) -> Option<Rank> {
        match self {
            Way::Via(p) => Some(*p),
            Way::Split(plan) => plan.steps.iter().find_map(|s| match s.1 {
                Route::Via(p) => Some(p),
                Route::Direct => None,
            }),
            _ => None,
        }
    }
}

/// `tag` of a relay credit from a destination to its proxy.
const CREDIT_TO_PROXY: u64 = 0;
/// `tag` of a relay credit from a proxy to the source.
const CREDIT_TO_SOURCE: u64 = 1;

/// An envelope waiting for its route's window: the frame it carries (as sent directly), and the
/// envelope's payload (that frame's header, then its payload).
struct Envelope {
    inner: Header,
    body: Bytes,
}

/// A staging buffer for the envelope being read from one neighbour.
#[derive(Default)]
struct Staged {
    buf: Vec<u8>,
}

/// A transport that forwards envelopes and reaches peers through proxies.
pub struct Relayed {
    me: Rank,
    inner: Box<dyn Transport>,
    ways: Vec<Way>,
    piece: usize,
    limits: Limits,
    staging: Vec<Staged>,
    /// Envelopes received for others, to forward once the inner transport is free.
    forward: VecDeque<(Rank, Header, Bytes)>,
    /// Losses of relayed peers to report.
    lost: VecDeque<(Rank, TransportError)>,
    gone: Vec<bool>,
    /// Outgoing RTS lengths per (peer, message id), then per (peer, receive id) once its CTS came.
    rts_len: HashMap<(Rank, u64), usize>,
    data_len: HashMap<(Rank, u64), usize>,
    /// Messages sent staged, per peer: for tests and benchmarks.
    staged_messages: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Ranks this rank forwards for whose connection is still open.
    serving: Vec<bool>,
    /// Windows of the routes this rank sends through a proxy.
    flow: flow::Sender<Envelope>,
    /// Bytes this rank holds as a proxy, per (source, destination).
    ledger: flow::Ledger,
    /// Credit this rank owes the proxies that brought it envelopes.
    owed: flow::Owed,
    /// Peers that broke the relay protocol, to disconnect.
    violations: Vec<(Rank, WireError)>,
    /// Envelopes that waited on a lost proxy's routes: sent directly where there is a way.
    fallback: Vec<(Rank, Envelope)>,
}

/// A relay credit frame from `me`: `to` says to whom ([`CREDIT_TO_PROXY`] or
/// [`CREDIT_TO_SOURCE`]), `other` the route's other end.
fn credit(me: Rank, to: u64, other: Rank, bytes: usize) -> Header {
    Header {
        flags: flags::RELAY,
        src: me,
        tag: to,
        seq: u64::from(other),
        aux: bytes as u64,
        ..Header::new(Kind::Credit)
    }
}

impl Relayed {
    /// `ways[peer]` says how to reach each peer; pieces of `piece` bytes (at most the data chunk
    /// less a header) cross a proxy.
    pub fn new(me: Rank, inner: Box<dyn Transport>, ways: Vec<Way>, piece: usize, limits: Limits) -> Relayed {
        let piece = piece.clamp(1, limits.chunk.saturating_sub(HEADER_LEN).max(1));
        let n = ways.len();
        Relayed {
            me,
            inner,
            ways,
            piece,
            limits,
            staging: (0..n).map(|_| Staged::default()).collect(),
            forward: VecDeque::new(),
            lost: VecDeque::new(),
            gone: vec![false; n],
            rts_len: HashMap::new(),
            data_len: HashMap::new(),
            staged_messages: Default::default(),
            serving: vec![false; n],
            flow: flow::Sender::new(flow::window(&limits)),
            ledger: flow::Ledger::new(flow::window(&limits)),
            owed: flow::Owed::default(),
            violations: Vec::new(),
            fallback: Vec::new(),
        }
    }

    /// Bytes this rank holds as a proxy for envelopes from `src` to `dest` (at most a window).
    pub fn held(&self, src: Rank, dest: Rank) -> usize {
        self.ledger.held(src, dest)
    }

    /// The ranks this rank is a proxy for: until their connections close, it counts as having
    /// output pending (see [`Transport::has_pending_output`] below).
    pub fn serve(&mut self, ranks: impl IntoIterator<Item = Rank>) {
        for r in ranks {
            if let Some(s) = self.serving.get_mut(r as usize) {
                *s = true;
            }
        }
    }

    /// Counts the messages whose data this rank sent through a proxy.
    pub fn staged_counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.staged_messages.clone()
    }

    /// Sends `h` (with `payload`) to `dest` through `proxy`, in pieces if it is data, each as
    /// its route's window allows.
    fn relay(&mut self, proxy: Rank, dest: Rank, h: Header, payload: &[u8]) {
        let me = self.me;
        let flow = &mut self.flow;
        let mut wrap = |h: Header, body: &[u8]| {
            let inner = Header { src: me, len: body.len() as u32, ..h };
            let mut b = BytesMut::with_capacity(HEADER_LEN + body.len());
            b.put_slice(&inner.encode());
            b.put_slice(body);
            let body = b.freeze();
            flow.push(proxy, dest, body.len(), Envelope { inner, body });
        };
        if h.kind == Kind::Data {
            for (i, body) in payload.chunks(self.piece).enumerate() {
                wrap(Header { aux: h.aux + (i * self.piece) as u64, ..h }, body);
            }
        } else {
            wrap(h, payload);
        }
        self.drain();
    }

    /// Where frame `h` to `peer` goes: `None` for the direct connection, else the proxy.
    fn route(&mut self, peer: Rank, h: &Header) -> Option<Rank> {
        match &self.ways.get(peer as usize)? {
            Way::Via(p) => Some(*p),
            Way::Split(plan) => match h.kind {
                Kind::Rts => {
                    self.rts_len.insert((peer, h.seq), h.aux as usize);
                    None
                }
                Kind::Data => {
                    let total = *self.data_len.get(&(peer, h.seq))?;
                    if h.aux + u64::from(h.len) >= total as u64 {
                        self.data_len.remove(&(peer, h.seq));
                    }
                    match plan.route(total) {
                        Route::Via(p) => {
                            if h.aux == 0 {
                                self.staged_messages.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            Some(p)
                        }
                        Route::Direct => None,
                    }
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Writes what is due: forwarded envelopes, envelopes their windows let go, credits; and
    /// disconnects peers that broke the protocol.
    fn drain(&mut self) {
        while let Some((dest, h, payload)) = self.forward.pop_front() {
            self.inner.send(dest, h, payload);
        }
        while let Some((proxy, dest, env)) = self.flow.poll() {
            let outer = Header {
                flags: flags::RELAY,
                src: self.me,
                seq: u64::from(dest),
                len: env.body.len() as u32,
                ..Header::new(Kind::Data)
            };
            self.inner.send(proxy, outer, env.body);
        }
        for (proxy, src, bytes) in self.owed.drain() {
            if !self.gone[proxy as usize] {
                self.inner.send(proxy, credit(self.me, CREDIT_TO_PROXY, src, bytes), Bytes::new());
            }
        }
        for (peer, e) in std::mem::take(&mut self.violations) {
            tracing::warn!(peer, error = %e, "relay protocol broken; disconnecting");
            self.inner.disconnect(peer, TransportError::Wire(e));
        }
    }
}

impl Transport for Relayed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn name_for(&self, peer: Rank) -> &'static str {
        match self.ways.get(peer as usize) {
            Some(Way::Via(_)) => "tcp-proxy",
            _ => self.inner.name_for(peer),
        }
    }

    fn eager_limit(&self) -> usize {
        self.inner.eager_limit()
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        if self.gone.get(peer as usize).copied().unwrap_or(false) {
            return;
        }
        match self.route(peer, &header) {
            Some(p) => self.relay(p, peer, header, &payload),
            None => self.inner.send(peer, header, payload),
        }
    }

    fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
        if self.gone.get(peer as usize).copied().unwrap_or(false) {
            return;
        }
        match self.route(peer, &header) {
            Some(p) => self.relay(p, peer, header, payload),
            None => self.inner.send_copy(peer, header, payload),
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        let mut n = 0;
        while let Some((peer, why)) = self.lost.pop_front() {
            sink.peer_lost(peer, why);
            n += 1;
        }
        let mut rs = RelaySink {
            me: self.me,
            ways: &mut self.ways,
            limits: &self.limits,
            staging: &mut self.staging,
            forward: &mut self.forward,
            gone: &mut self.gone,
            data_len: &mut self.data_len,
            rts_len: &mut self.rts_len,
            serving: &mut self.serving,
            flow: &mut self.flow,
            ledger: &mut self.ledger,
            owed: &mut self.owed,
            violations: &mut self.violations,
            fallback: &mut self.fallback,
            up: sink,
        };
        n += self.inner.progress(&mut rs);
        for (dest, env) in std::mem::take(&mut self.fallback) {
            if matches!(self.ways.get(dest as usize), Some(Way::Direct)) && !self.gone[dest as usize] {
                self.inner.send(dest, env.inner, env.body.slice(HEADER_LEN..));
            }
        }
        self.drain();
        n
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.lost.is_empty() || !self.forward.is_empty() || !self.violations.is_empty() {
            return Poll::Ready(());
        }
        self.inner.poll_ready(cx)
    }

    fn awake(&mut self) {
        self.inner.awake()
    }

    fn stand_aside(&mut self) {
        self.inner.stand_aside()
    }

    /// Also true while a rank this one forwards for is still connected: the one caller, a rank's
    /// shutdown, then keeps flushing (and so forwarding) until the ranks that rely on this proxy
    /// have left, within its time limit, rather than cut them off mid-conversation.
    fn has_pending_output(&self) -> bool {
        !self.forward.is_empty()
            || self.flow.has_waiting()
            || self.inner.has_pending_output()
            || self.serving.contains(&true)
    }

    fn has_queued_output(&self) -> bool {
        !self.forward.is_empty() || self.flow.has_waiting() || self.inner.has_queued_output()
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        match self.ways.get(peer as usize) {
            Some(Way::Via(_)) => {
                if !std::mem::replace(&mut self.gone[peer as usize], true) {
                    self.lost.push_back((peer, reason));
                }
            }
            _ => self.inner.disconnect(peer, reason),
        }
    }
}

struct RelaySink<'a> {
    me: Rank,
    ways: &'a mut Vec<Way>,
    limits: &'a Limits,
    staging: &'a mut [Staged],
    forward: &'a mut VecDeque<(Rank, Header, Bytes)>,
    gone: &'a mut [bool],
    data_len: &'a mut HashMap<(Rank, u64), usize>,
    rts_len: &'a mut HashMap<(Rank, u64), usize>,
    serving: &'a mut [bool],
    flow: &'a mut flow::Sender<Envelope>,
    ledger: &'a mut flow::Ledger,
    owed: &'a mut flow::Owed,
    violations: &'a mut Vec<(Rank, WireError)>,
    fallback: &'a mut Vec<(Rank, Envelope)>,
    up: &'a mut dyn Sink,
}

impl RelaySink<'_> {
    /// A relay credit from `from`: as a proxy, passes it on to the source; as a source, opens the
    /// route's window.
    fn credit(&mut self, from: Rank, h: &Header) -> Result<(), WireError> {
        let other = Rank::try_from(h.seq).ok().filter(|&r| r < self.limits.world_size);
        let other = other.ok_or(WireError::UnknownRank { rank: u32::MAX, size: self.limits.world_size })?;
        let bytes = usize::try_from(h.aux).map_err(|_| WireError::Link("relay credit beyond the bytes forwarded"))?;
        match h.tag {
            CREDIT_TO_PROXY => {
                // `from` took envelopes from `other` that this rank forwarded.
                if let Err(e) = self.ledger.credit(other, from, bytes) {
                    let held = self.ledger.held(other, from);
                    tracing::warn!(src = other, dest = from, bytes, held, "relay credit beyond what this proxy holds");
                    return Err(e);
                }
                if !self.gone[other as usize] {
                    let c = credit(self.me, CREDIT_TO_SOURCE, from, bytes);
                    self.forward.push_back((other, c, Bytes::new()));
                }
                Ok(())
            }
            CREDIT_TO_SOURCE => self.flow.credit(from, other, bytes),
            _ => Err(WireError::Link("relay credit of an unknown kind")),
        }
    }

    /// Delivers envelope `env` (whole, from neighbour `from`) here, or queues it onward.
    fn envelope(&mut self, from: Rank, h: Header, env: Bytes) -> Result<(), WireError> {
        let dest = Rank::try_from(h.seq).ok().filter(|&d| d < self.limits.world_size);
        let dest = dest.ok_or(WireError::UnknownRank { rank: u32::MAX, size: self.limits.world_size })?;
        if dest != self.me {
            // Forward over the direct connection to `dest` (a proxy forwards, it never relays).
            if !matches!(self.ways.get(dest as usize), Some(Way::Direct | Way::Split(_))) {
                return Err(WireError::Link("envelope for a rank this proxy does not reach"));
            }
            // The credit for it comes back naming the frame's source: it must be the neighbour
            // whose window it counts against.
            let src = env.get(8..12).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
            if src != Some(from) {
                return Err(WireError::WrongSource { expected: from, got: src.unwrap_or(u32::MAX) });
            }
            if !self.gone[dest as usize] {
                self.ledger.take(from, dest, env.len())?;
                self.forward.push_back((dest, Header { src: self.me, ..h }, env));
            }
            return Ok(());
        }
        if env.len() < HEADER_LEN {
            return Err(WireError::Link("envelope shorter than a header"));
        }
        let inner = Header::decode(env[..HEADER_LEN].try_into().expect("header length"), self.limits)?;
        if inner.len as usize != env.len() - HEADER_LEN || inner.flags & flags::RELAY != 0 {
            return Err(WireError::Link("envelope length does not match its frame"));
        }
        let src = inner.src;
        if self.ways.get(src as usize).and_then(Way::proxy_for_data) != Some(from) {
            return Err(WireError::WrongSource { expected: from, got: src });
        }
        if self.gone[src as usize] {
            return Ok(());
        }
        self.owed.took(from, src, env.len());
        if inner.kind == Kind::Data {
            match self.up.data_dest(src, &inner)? {
                Some(d) if d.len() == env.len() - HEADER_LEN => {
                    d.copy_from_slice(&env[HEADER_LEN..]);
                    self.up.frame(src, inner, Bytes::new());
                }
                _ => return Err(WireError::Unexpected(Kind::Data)),
            }
        } else {
            self.up.frame(src, inner, env.slice(HEADER_LEN..));
        }
        Ok(())
    }
}

// SAFETY: a slice from `data_dest` is the upper sink's (for a frame then delivered through
// `frame`, or whose connection's loss is forwarded: its own contract), or the staging buffer of
// the neighbour, replaced only in `frame` once the envelope is whole or in `peer_lost`.
unsafe impl Sink for RelaySink<'_> {
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        if h.flags & flags::RELAY == 0 {
            return self.up.data_dest(peer, h);
        }
        let s = self.staging.get_mut(peer as usize).ok_or(WireError::Unexpected(Kind::Data))?;
        if s.buf.len() != h.len as usize {
            s.buf = vec![0; h.len as usize];
        }
        Ok(Some(&mut s.buf[..]))
    }

    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        if h.kind == Kind::Data && h.flags & flags::RELAY != 0 {
            let env = Bytes::from(std::mem::take(&mut self.staging[peer as usize].buf));
            if let Err(e) = self.envelope(peer, h, env) {
                self.violations.push((peer, e));
            }
            return;
        }
        if h.kind == Kind::Credit && h.flags & flags::RELAY != 0 {
            if let Err(e) = self.credit(peer, &h) {
                self.violations.push((peer, e));
            }
            return;
        }
        if h.kind == Kind::Cts
            && let Some(len) = self.rts_len.remove(&(peer, h.seq))
            && h.flags & flags::TRUNCATED == 0
        {
            self.data_len.insert((peer, h.aux), len);
        }
        self.up.frame(peer, h, payload)
    }

    fn frame_ref(&mut self, peer: Rank, h: Header, payload: &[u8]) {
        if h.kind == Kind::Cts || h.flags & flags::RELAY != 0 {
            self.frame(peer, h, Bytes::copy_from_slice(payload))
        } else {
            self.up.frame_ref(peer, h, payload)
        }
    }

    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        self.serving[peer as usize] = false;
        self.ledger.lost(peer);
        self.flow.dest_lost(peer);
        self.staging[peer as usize] = Staged::default();
        self.rts_len.retain(|k, _| k.0 != peer);
        self.data_len.retain(|k, _| k.0 != peer);
        self.up.peer_lost(peer, err.clone());
        for (c, way) in self.ways.iter_mut().enumerate() {
            match way {
                Way::Via(p) if *p == peer && !self.gone[c] => {
                    self.gone[c] = true;
                    self.up.peer_lost(c as Rank, TransportError::Reported { by: peer });
                }
                Way::Split(plan) if plan.steps.iter().any(|s| s.1 == Route::Via(peer)) => *way = Way::Direct,
                _ => {}
            }
        }
        // What waited for the lost proxy's windows goes directly where it can (`Way::Direct` by
        // now), else nowhere (the destination is lost with the proxy).
        self.fallback.extend(self.flow.proxy_lost(peer));
    }
}

#[cfg(test)]
mod tests {
    //! `Relayed` over a scripted inner transport: what a proxy holds, and what it forwards, as
    //! its neighbours send.
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Default)]
    struct Wire {
        /// Frames to hand to the sink on the next progress: (from, header, payload).
        incoming: VecDeque<(Rank, Header, Bytes)>,
        sent: Vec<(Rank, Header, Bytes)>,
        disconnected: Vec<Rank>,
    }

    struct Scripted(Arc<Mutex<Wire>>);

    impl Transport for Scripted {
        fn name(&self) -> &'static str {
            "tcp"
        }
        fn eager_limit(&self) -> usize {
            1024
        }
        fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
            self.0.lock().unwrap().sent.push((peer, header, payload));
        }
        fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
            self.send(peer, header, Bytes::copy_from_slice(payload))
        }
        fn progress(&mut self, sink: &mut dyn Sink) -> usize {
            let frames: Vec<_> = self.0.lock().unwrap().incoming.drain(..).collect();
            let n = frames.len();
            for (from, h, payload) in frames {
                hand_over(sink, from, h, payload);
            }
            n
        }
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<()> {
            Poll::Pending
        }
        fn awake(&mut self) {}
        fn has_pending_output(&self) -> bool {
            false
        }
        fn disconnect(&mut self, peer: Rank, _: TransportError) {
            self.0.lock().unwrap().disconnected.push(peer);
        }
    }

    /// Gives frame `h` from `from` to `sink` as a connection does: a data frame's payload into the
    /// sink's destination, then the frame.
    pub(super) fn hand_over(sink: &mut dyn Sink, from: Rank, h: Header, payload: Bytes) {
        if h.kind == Kind::Data {
            match sink.data_dest(from, &h) {
                Ok(Some(d)) => d.copy_from_slice(&payload),
                other => panic!("no destination from {from}: {:?}", other.map(|d| d.map(|d| d.len()))),
            }
            sink.frame(from, h, Bytes::new());
        } else {
            sink.frame(from, h, payload);
        }
    }

    /// Collects what reaches the engine.
    #[derive(Default)]
    struct Up {
        frames: Vec<(Rank, Header)>,
        buf: Vec<u8>,
        lost: Vec<Rank>,
    }

    // SAFETY: the buffer lent by `data_dest` lives as long as the sink and is only replaced by the
    // next `data_dest`, after the frame it was lent for.
    unsafe impl Sink for Up {
        fn data_dest(&mut self, _: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
            self.buf = vec![0; h.len as usize];
            Ok(Some(&mut self.buf))
        }
        fn frame(&mut self, peer: Rank, h: Header, _: Bytes) {
            self.frames.push((peer, h));
        }
        fn peer_lost(&mut self, peer: Rank, _: TransportError) {
            self.lost.push(peer);
        }
    }

    const LIMITS: Limits = Limits { world_size: 3, eager_limit: 1024, chunk: 64 << 10, max_message: 1 << 30 };

    /// An envelope from `src` for `dest` carrying a data frame of `len` bytes.
    fn envelope(src: Rank, dest: Rank, len: usize) -> (Header, Bytes) {
        let inner = Header { src, len: len as u32, ..Header::new(Kind::Data) };
        let mut b = BytesMut::new();
        b.put_slice(&inner.encode());
        b.put_slice(&vec![7u8; len]);
        let outer =
            Header { flags: flags::RELAY, src, seq: u64::from(dest), len: b.len() as u32, ..Header::new(Kind::Data) };
        (outer, b.freeze())
    }

    fn relayed(me: Rank, ways: Vec<Way>) -> (Relayed, Arc<Mutex<Wire>>) {
        let wire = Arc::new(Mutex::new(Wire::default()));
        (Relayed::new(me, Box::new(Scripted(wire.clone())), ways, 32 << 10, LIMITS), wire)
    }

    /// Rank 1 forwards for 0 -> 2. Rank 0 floods it beyond its window: the proxy forwards a
    /// window's worth, holds no more, and disconnects rank 0 at the first envelope beyond it.
    #[test]
    fn a_proxy_holds_one_window_and_refuses_a_flooding_source() {
        let (mut proxy, wire) = relayed(1, vec![Way::Direct, Way::None, Way::Direct]);
        let w = flow::window(&LIMITS);
        let (h, env) = envelope(0, 2, 32 << 10);
        let fit = w / env.len();
        for _ in 0..fit + 1 {
            wire.lock().unwrap().incoming.push_back((0, h, env.clone()));
        }
        let mut up = Up::default();
        proxy.progress(&mut up);
        let wire_now = wire.lock().unwrap();
        let forwarded = wire_now.sent.iter().filter(|s| s.0 == 2 && s.1.flags & flags::RELAY != 0).count();
        assert_eq!(forwarded, fit);
        assert!(proxy.held(0, 2) <= w, "{} > {w}", proxy.held(0, 2));
        assert_eq!(wire_now.disconnected, vec![0]);
        assert!(up.frames.is_empty(), "nothing for the proxy's own engine");
    }

    /// The destination's credit passes through the proxy to the source, which then sends what
    /// waited for its window; the proxy's ledger empties.
    #[test]
    fn credit_flows_back_through_the_proxy_and_opens_the_window() {
        // Source 0 reaches 2 only through 1.
        let (mut src, src_wire) = relayed(0, vec![Way::None, Way::Direct, Way::Via(1)]);
        let (mut proxy, proxy_wire) = relayed(1, vec![Way::Direct, Way::None, Way::Direct]);
        let (mut dest, dest_wire) = relayed(2, vec![Way::Via(1), Way::Direct, Way::None]);
        let w = flow::window(&LIMITS);
        // 3 MiB of data in 32 KiB pieces: three windows.
        let h = Header { src: 0, len: 3 << 20, ..Header::new(Kind::Data) };
        src.send(2, h, Bytes::from(vec![3u8; 3 << 20]));
        let mut delivered = 0usize;
        let mut max_held = 0;
        for _ in 0..100 {
            let mut up = Up::default();
            src.progress(&mut up);
            // Source -> proxy.
            let out: Vec<_> = src_wire.lock().unwrap().sent.drain(..).collect();
            for (to, h, p) in out {
                assert_eq!(to, 1, "everything to 2 goes through 1");
                proxy_wire.lock().unwrap().incoming.push_back((0, h, p));
            }
            proxy.progress(&mut Up::default());
            max_held = max_held.max(proxy.held(0, 2));
            let out: Vec<_> = proxy_wire.lock().unwrap().sent.drain(..).collect();
            for (to, h, p) in out {
                match to {
                    2 => dest_wire.lock().unwrap().incoming.push_back((1, h, p)),
                    0 => src_wire.lock().unwrap().incoming.push_back((1, h, p)),
                    _ => panic!("to {to}"),
                }
            }
            let mut up = Up::default();
            dest.progress(&mut up);
            delivered += up.frames.iter().filter(|(from, h)| *from == 0 && h.kind == Kind::Data).count();
            let out: Vec<_> = dest_wire.lock().unwrap().sent.drain(..).collect();
            for (to, h, p) in out {
                assert_eq!((to, h.kind, h.flags), (1, Kind::Credit, flags::RELAY));
                proxy_wire.lock().unwrap().incoming.push_back((2, h, p));
            }
            if delivered == 96 && proxy.held(0, 2) == 0 && !src.has_queued_output() {
                break;
            }
        }
        assert_eq!(delivered, 96, "every piece arrives");
        assert!(max_held > 0 && max_held <= w, "{max_held}");
        assert_eq!(proxy.held(0, 2), 0);
        for wire in [&src_wire, &proxy_wire, &dest_wire] {
            assert!(wire.lock().unwrap().disconnected.is_empty());
        }
    }

    /// A destination that returns more credit than it was sent is disconnected by the proxy.
    #[test]
    fn an_inflated_credit_is_a_violation() {
        let (mut proxy, wire) = relayed(1, vec![Way::Direct, Way::None, Way::Direct]);
        let (h, env) = envelope(0, 2, 100);
        wire.lock().unwrap().incoming.push_back((0, h, env.clone()));
        let c = credit(2, CREDIT_TO_PROXY, 0, env.len() + 1);
        wire.lock().unwrap().incoming.push_back((2, c, Bytes::new()));
        proxy.progress(&mut Up::default());
        assert_eq!(wire.lock().unwrap().disconnected, vec![2]);
        // A source that claims another rank's frames is refused too.
        let (h, env) = envelope(2, 2, 100);
        wire.lock().unwrap().incoming.push_back((0, Header { src: 0, ..h }, env));
        proxy.progress(&mut Up::default());
        assert_eq!(wire.lock().unwrap().disconnected, vec![2, 0]);
    }
}

#[cfg(test)]
mod interleavings {
    //! Two ends that reach each other only through a proxy send to each other at once, frames
    //! crossing each link in order but the links in any interleaving: no rank sees a breach of the
    //! relay protocol, every frame arrives in order, and the proxy's accounts end at zero.
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    use proptest::prelude::*;

    use super::*;

    /// A link's frames in flight, and what the transport was told to disconnect.
    #[derive(Default)]
    struct Net {
        /// (from, to) -> frames in flight, in order.
        links: HashMap<(Rank, Rank), VecDeque<(Header, Bytes)>>,
        disconnected: Vec<(Rank, Rank)>,
    }

    /// Rank `me`'s side of [`Net`]; `deliver` says how many frames of which link its next
    /// progress takes in.
    struct Port {
        me: Rank,
        net: Arc<Mutex<Net>>,
        deliver: Arc<Mutex<Vec<(Rank, usize)>>>,
    }

    impl Transport for Port {
        fn name(&self) -> &'static str {
            "tcp"
        }
        fn eager_limit(&self) -> usize {
            1024
        }
        fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
            self.net.lock().unwrap().links.entry((self.me, peer)).or_default().push_back((header, payload));
        }
        fn send_copy(&mut self, peer: Rank, header: Header, payload: &[u8]) {
            self.send(peer, header, Bytes::copy_from_slice(payload))
        }
        fn progress(&mut self, sink: &mut dyn Sink) -> usize {
            let mut n = 0;
            for (from, count) in std::mem::take(&mut *self.deliver.lock().unwrap()) {
                for _ in 0..count {
                    let frame = self.net.lock().unwrap().links.get_mut(&(from, self.me)).and_then(VecDeque::pop_front);
                    let Some((h, payload)) = frame else { break };
                    n += 1;
                    super::tests::hand_over(sink, from, h, payload);
                }
            }
            n
        }
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<()> {
            Poll::Pending
        }
        fn awake(&mut self) {}
        fn has_pending_output(&self) -> bool {
            false
        }
        fn disconnect(&mut self, peer: Rank, _: TransportError) {
            self.net.lock().unwrap().disconnected.push((self.me, peer));
        }
    }

    /// What reaches a rank's engine: data frames' bytes by (source, message), other frames' tags.
    #[derive(Default)]
    struct Engine {
        buf: Vec<u8>,
        data: HashMap<(Rank, u64), Vec<u8>>,
        eager: Vec<(Rank, u64)>,
    }

    // SAFETY: the buffer lent by `data_dest` lives as long as the sink and is replaced only by the
    // next `data_dest`, after the frame it was lent for.
    unsafe impl Sink for Engine {
        fn data_dest(&mut self, _: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
            self.buf = vec![0; h.len as usize];
            Ok(Some(&mut self.buf))
        }
        fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
            match h.kind {
                Kind::Data => {
                    let m = self.data.entry((peer, h.seq)).or_default();
                    assert_eq!(m.len() as u64, h.aux, "pieces of message {} from {peer} in order", h.seq);
                    m.extend_from_slice(&self.buf);
                }
                _ => {
                    assert!(payload.iter().all(|&b| b == h.tag as u8));
                    self.eager.push((peer, h.tag));
                }
            }
        }
        fn peer_lost(&mut self, peer: Rank, _: TransportError) {
            panic!("peer {peer} lost");
        }
    }

    const LIMITS: Limits = Limits { world_size: 3, eager_limit: 1024, chunk: 64 << 10, max_message: 1 << 30 };

    /// A rank: its relay, what its next progress takes in (see [`Port`]), its engine.
    type RankUnderTest = (Relayed, Arc<Mutex<Vec<(Rank, usize)>>>, Engine);

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn both_ends_at_once_through_one_proxy(
            sizes in proptest::collection::vec(1usize..300_000, 1..12),
            schedule in proptest::collection::vec((0u32..3, 0u32..3, 1usize..40, any::<bool>()), 1..400),
        ) {
            let net = Arc::new(Mutex::new(Net::default()));
            let ways = [
                vec![Way::None, Way::Direct, Way::Direct],
                vec![Way::Direct, Way::None, Way::Via(0)],
                vec![Way::Direct, Way::Via(0), Way::None],
            ];
            let mut ranks: Vec<RankUnderTest> = (0..3u32)
                .map(|me| {
                    let deliver = Arc::new(Mutex::new(Vec::new()));
                    let port = Port { me, net: net.clone(), deliver: deliver.clone() };
                    (Relayed::new(me, Box::new(port), ways[me as usize].clone(), 32 << 10, LIMITS), deliver, Engine::default())
                })
                .collect();
            // Each end sends every message, a small frame (tag = message) then its data, at the
            // schedule's steps that say so (the rest at the end), between deliveries.
            let mut next = [0usize; 3];
            let send = |ranks: &mut Vec<RankUnderTest>, me: u32, i: usize| {
                let (peer, tag, len) = (3 - me, i as u64, sizes[i]);
                let small = Header { src: me, tag, len: 8, ..Header::new(Kind::Eager) };
                ranks[me as usize].0.send(peer, small, Bytes::from(vec![tag as u8; 8]));
                let data = Header { src: me, seq: tag, len: len as u32, ..Header::new(Kind::Data) };
                ranks[me as usize].0.send(peer, data, Bytes::from(vec![me as u8 ^ tag as u8; len]));
            };
            let steps = schedule.into_iter().chain((0..10_000).map(|i| (i % 3, (i / 3) % 3, 1000, true)));
            for (at, from, count, send_next) in steps {
                let (at, from) = (at as usize, from as usize);
                if send_next && at > 0 && next[at] < sizes.len() {
                    send(&mut ranks, at as u32, next[at]);
                    next[at] += 1;
                }
                if from != at {
                    ranks[at].1.lock().unwrap().push((from as Rank, count));
                }
                let (relayed, _, engine) = &mut ranks[at];
                relayed.progress(engine);
                let n = net.lock().unwrap();
                prop_assert!(n.disconnected.is_empty(), "disconnected: {:?}", n.disconnected);
                if next[1..].iter().all(|&k| k == sizes.len())
                    && n.links.values().all(VecDeque::is_empty)
                    && ranks.iter().all(|r| !r.0.has_queued_output())
                {
                    break;
                }
            }
            for me in [1u32, 2] {
                let peer = 3 - me;
                let e = &ranks[me as usize].2;
                let want: Vec<_> = (0..sizes.len() as u64).map(|t| (peer, t)).collect();
                prop_assert_eq!(&e.eager, &want);
                for (i, &len) in sizes.iter().enumerate() {
                    let got = &e.data[&(peer, i as u64)];
                    prop_assert!(got.len() == len && got.iter().all(|&b| b == peer as u8 ^ i as u8));
                }
            }
            prop_assert_eq!(ranks[0].0.ledger.total(), 0);
        }
    }
}
