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

pub mod plan;

use std::collections::{HashMap, VecDeque};
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError, flags};
use crate::{Sink, Transport, TransportError};
pub use plan::{Costs, Hop, PeerPlan, Planner, Route};

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
        }
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

    /// Sends `h` (with `payload`) to `dest` through `proxy`, in pieces if it is data.
    fn relay(&mut self, proxy: Rank, dest: Rank, h: Header, payload: &[u8]) {
        let mut wrap = |h: Header, body: &[u8]| {
            let inner = Header { src: self.me, len: body.len() as u32, ..h };
            let mut b = BytesMut::with_capacity(HEADER_LEN + body.len());
            b.put_slice(&inner.encode());
            b.put_slice(body);
            let outer = Header {
                flags: flags::RELAY,
                src: self.me,
                seq: u64::from(dest),
                len: b.len() as u32,
                ..Header::new(Kind::Data)
            };
            self.inner.send(proxy, outer, b.freeze());
        };
        if h.kind == Kind::Data {
            for (i, body) in payload.chunks(self.piece).enumerate() {
                wrap(Header { aux: h.aux + (i * self.piece) as u64, ..h }, body);
            }
        } else {
            wrap(h, payload);
        }
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

    fn drain(&mut self) {
        while let Some((dest, h, payload)) = self.forward.pop_front() {
            self.inner.send(dest, h, payload);
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
            up: sink,
        };
        n += self.inner.progress(&mut rs);
        self.drain();
        n
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.lost.is_empty() || !self.forward.is_empty() {
            return Poll::Ready(());
        }
        self.inner.poll_ready(cx)
    }

    fn awake(&mut self) {
        self.inner.awake()
    }

    /// Also true while a rank this one forwards for is still connected: the one caller, a rank's
    /// shutdown, then keeps flushing (and so forwarding) until the ranks that rely on this proxy
    /// have left, within its time limit, rather than cut them off mid-conversation.
    fn has_pending_output(&self) -> bool {
        !self.forward.is_empty() || self.inner.has_pending_output() || self.serving.contains(&true)
    }

    fn has_queued_output(&self) -> bool {
        !self.forward.is_empty() || self.inner.has_queued_output()
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
    up: &'a mut dyn Sink,
}

impl RelaySink<'_> {
    /// Delivers envelope `env` (whole, from neighbour `from`) here, or queues it onward.
    fn envelope(&mut self, from: Rank, h: Header, env: Bytes) -> Result<(), WireError> {
        let dest = Rank::try_from(h.seq).ok().filter(|&d| d < self.limits.world_size);
        let dest = dest.ok_or(WireError::UnknownRank { rank: u32::MAX, size: self.limits.world_size })?;
        if dest != self.me {
            // Forward over the direct connection to `dest` (a proxy forwards, it never relays).
            if !matches!(self.ways.get(dest as usize), Some(Way::Direct | Way::Split(_))) {
                return Err(WireError::Link("envelope for a rank this proxy does not reach"));
            }
            if !self.gone[dest as usize] {
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
                tracing::warn!(from = peer, error = %e, "bad envelope; disconnecting");
                self.up.peer_lost(peer, TransportError::Wire(e));
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
    }
}
