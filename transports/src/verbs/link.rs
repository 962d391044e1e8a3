//! The link protocol between two verbs endpoints: slot format and slot credits. Sans-IO.
//!
//! Each direction of a connection has a ring of `slots` fixed-size slots in the receiver's
//! registered memory (the eager ring of DCFA, thesis 000). The sender fills a slot by one RDMA
//! write-with-immediate; the immediate is the slot index. The receiver learns of the slot from
//! the receive completion, which the device raises only once the whole write has been placed,
//! so nothing depends on the last byte landing last (no tail marker to poll).
//!
//! A slot holds a 16-byte link prefix, then what its kind needs: an engine [`Header`] and a
//! 24-byte extension naming a remote buffer or a token (the rendezvous kinds), an engine header
//! and an eager payload (a frame), or nothing more (a credit update):
//!
//! ```text
//! 0    kind u8 | 3 zero bytes | freed u32 | total u32 | 4 zero bytes
//! 16   engine header (48 bytes; zero for a DONE)       frame: 16 engine header
//! 64   addr u64 | rkey u32 | token u32 | len u64              64 payload (eager data)
//! 88   (end)
//! ```
//!
//! An eager message, the common small frame, has a compact slot of its own ([`LinkKind::Eager`]):
//! its header's other fields are zero and its source is the connection's peer, so it carries only
//! what differs from message to message:
//!
//! ```text
//! 0    kind u8 | payload length u24 | freed u32 | context u32 | credit u32 | tag u64
//! 24   payload
//! ```
//!
//! Only the bytes used are written: an 8-byte eager message is a 32-byte write (72 as a full
//! frame), a credit update 16 bytes: less for Soft-RoCE to copy and checksum in software (though
//! below about 100 bytes the size moves `ib_send_lat` by under a microsecond there), and less to
//! cross PCIe inline on a real device.
//!
//! Credits ([`Credits`]): every slot written uses one credit; `freed`, piggybacked on every slot,
//! is the receiver's monotonic count of slots it has emptied (wrapping u32, compared by
//! difference: a full ring and an empty one never look alike, unlike DCFA's mod-N offsets). The
//! receiver copies a slot out as soon as its completion is polled, independent of matching (the
//! engine's own credits bound unexpected messages), so slots are freed promptly. A `Credit` slot
//! is sent only when half the ring is freed and not yet advertised; the last slot is reserved
//! for it, so a credit update can always be sent (DCFA's SYNC needed a slot it might not have).

use std::collections::VecDeque;

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError};

/// Bytes of the link prefix every slot starts with.
pub const PREFIX: usize = 16;
/// Bytes of the extension naming a remote buffer or a token.
pub const EXT: usize = 24;
/// The most bytes before a slot's payload (a slot holds this plus the eager limit).
pub const SLOT_HEADER: usize = PREFIX + HEADER_LEN + EXT;
/// Where a compact eager slot's payload starts.
pub const EAGER_AT: usize = 24;

crate::wire_enum! {
    /// What a slot carries.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum LinkKind: u8 {
        /// An engine frame with its payload inline (eager, RTS, plain CTS, credit, bye).
        Frame = 1,
        /// A slot credit update only.
        Credit = 2,
        /// A rendezvous `Data` frame whose payload the receiver must RDMA-read from `remote`.
        DataRead = 3,
        /// A rendezvous `Data` frame whose payload the sender has already RDMA-written into the
        /// buffer the receiver announced (this slot, written after the data on the same queue pair,
        /// is the DONE).
        DataWritten = 4,
        /// A CTS carrying the receiver's buffer (`remote`): the sender writes into it (DCFA's RTR).
        CtsBuf = 5,
        /// The receiver finished reading the chunk lent under `remote.token` (DONE).
        ReadDone = 6,
        /// An eager frame in the compact form (see the module docs): [`encode`] writes every eager
        /// header whose flags, `seq` and `aux` are zero this way.
        Eager = 7,
    }
}

impl LinkKind {
    fn has_header(self) -> bool {
        !matches!(self, LinkKind::Credit | LinkKind::ReadDone)
    }

    /// Whether the slot carries the extension (a remote buffer or a token).
    fn has_remote(self) -> bool {
        !matches!(self, LinkKind::Frame | LinkKind::Credit | LinkKind::Eager)
    }

    /// Where the slot's payload starts: after all that this kind carries.
    fn payload_at(self) -> usize {
        match self {
            LinkKind::Credit => PREFIX,
            LinkKind::Frame => PREFIX + HEADER_LEN,
            LinkKind::Eager => EAGER_AT,
            _ => SLOT_HEADER,
        }
    }
}

/// A range of remote memory, and the sender's token for a lent chunk (read offers and DONE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    /// The buffer's address in the peer's memory.
    pub addr: u64,
    /// The remote key of its registration.
    pub rkey: u32,
    /// The sender's token for the lent chunk.
    pub token: u32,
    /// The buffer's length in bytes.
    pub len: u64,
}

/// A decoded slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    /// What the slot carries.
    pub kind: LinkKind,
    /// The peer's count of our slots it has freed.
    pub freed: u32,
    /// The engine header, for the kinds that carry one.
    pub header: Option<Header>,
    /// The extension (zero for the kinds without one).
    pub remote: Remote,
    /// Inline payload bytes, at `LinkKind::payload_at`: see [`Packet::payload`].
    pub payload_len: usize,
}

impl Packet {
    /// The inline payload within `slot`, the slot this packet was decoded from.
    pub fn payload<'s>(&self, slot: &'s [u8]) -> &'s [u8] {
        let at = self.kind.payload_at();
        &slot[at..at + self.payload_len]
    }
}

/// Writes a slot; returns the bytes used (the prefix, what `kind` carries, the payload): at most
/// [`SLOT_HEADER`] `+ payload.len()`, which `slot` must hold. `remote` is written only for the
/// kinds that carry it, `header` only for those that carry one. The slot is of kind
/// [`slot_kind`]`(kind, header, payload.len())`: a [`LinkKind::Frame`] that [`compact`] allows is
/// written as a [`LinkKind::Eager`] slot.
pub fn encode(
    slot: &mut [u8],
    kind: LinkKind,
    freed: u32,
    header: Option<&Header>,
    remote: Remote,
    payload: &[u8],
) -> usize {
    let kind = slot_kind(kind, header, payload.len());
    if let (LinkKind::Eager, Some(h)) = (kind, header) {
        debug_assert!(compact(h, payload.len()), "an eager slot needs a header that `compact` allows");
        return encode_eager(slot, freed, h, payload);
    }
    let at = kind.payload_at();
    let total = at + payload.len();
    slot[..at].fill(0);
    slot[0] = kind as u8;
    slot[4..8].copy_from_slice(&freed.to_le_bytes());
    slot[8..12].copy_from_slice(&(total as u32).to_le_bytes());
    if let Some(h) = header.filter(|_| kind.has_header()) {
        slot[PREFIX..PREFIX + HEADER_LEN].copy_from_slice(&h.encode());
    }
    if kind.has_remote() {
        let e = PREFIX + HEADER_LEN;
        slot[e..e + 8].copy_from_slice(&remote.addr.to_le_bytes());
        slot[e + 8..e + 12].copy_from_slice(&remote.rkey.to_le_bytes());
        slot[e + 12..e + 16].copy_from_slice(&remote.token.to_le_bytes());
        slot[e + 16..e + 24].copy_from_slice(&remote.len.to_le_bytes());
    }
    slot[at..total].copy_from_slice(payload);
    total
}

/// The kind of slot [`encode`] writes for `kind`, `header` and `len` payload bytes: the compact
/// [`LinkKind::Eager`] for a [`LinkKind::Frame`] that [`compact`] allows, else `kind` itself.
/// (A caller that must know, as the transport does to post eager slots unsignaled, resolves it
/// once and passes the result on.)
pub fn slot_kind(kind: LinkKind, header: Option<&Header>, len: usize) -> LinkKind {
    match header {
        Some(h) if kind == LinkKind::Frame && compact(h, len) => LinkKind::Eager,
        _ => kind,
    }
}

/// Whether frame `h` with `len` payload bytes fits a compact eager slot: an eager frame whose
/// fields outside that slot are zero, so that [`decode`] gives back the very same header.
pub fn compact(h: &Header, len: usize) -> bool {
    h.kind == Kind::Eager && h.flags == 0 && h.seq == 0 && h.aux == 0 && h.len as usize == len && len < 1 << 24
}

fn encode_eager(slot: &mut [u8], freed: u32, h: &Header, payload: &[u8]) -> usize {
    let total = EAGER_AT + payload.len();
    slot[0..4].copy_from_slice(&(LinkKind::Eager as u32 | (payload.len() as u32) << 8).to_le_bytes());
    slot[4..8].copy_from_slice(&freed.to_le_bytes());
    slot[8..12].copy_from_slice(&h.context.to_le_bytes());
    slot[12..16].copy_from_slice(&h.credit.to_le_bytes());
    slot[16..24].copy_from_slice(&h.tag.to_le_bytes());
    slot[EAGER_AT..total].copy_from_slice(payload);
    total
}

fn bad(what: &'static str) -> WireError {
    WireError::Link(what)
}

/// Reads and validates a slot written by `peer`. Never trusts a length it has not checked.
pub fn decode(slot: &[u8], peer: Rank, limits: &Limits) -> Result<Packet, WireError> {
    if slot.len() < PREFIX {
        return Err(bad("slot smaller than its header"));
    }
    let u32_at = |i: usize| u32::from_le_bytes(slot[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(slot[i..i + 8].try_into().unwrap());
    let kind = LinkKind::from_repr(slot[0]).ok_or(bad("unknown slot kind"))?;
    if kind == LinkKind::Eager {
        return decode_eager(slot, peer, limits);
    }
    let freed = u32_at(4);
    let total = u32_at(8) as usize;
    let at = kind.payload_at();
    if total < at || total > slot.len() {
        return Err(bad("slot length out of range"));
    }
    let e = PREFIX + HEADER_LEN;
    let remote = match kind.has_remote() {
        true => Remote { addr: u64_at(e), rkey: u32_at(e + 8), token: u32_at(e + 12), len: u64_at(e + 16) },
        false => Remote::default(),
    };
    let payload_len = total - at;
    let header = if kind.has_header() {
        let h = Header::decode(slot[PREFIX..e].try_into().unwrap(), limits)?;
        if h.src != peer {
            return Err(WireError::WrongSource { expected: peer, got: h.src });
        }
        let ok = match kind {
            LinkKind::Frame => !matches!(h.kind, Kind::Data | Kind::Hello) && payload_len == h.len as usize,
            LinkKind::DataRead => h.kind == Kind::Data && payload_len == 0 && remote.len == u64::from(h.len),
            LinkKind::DataWritten => h.kind == Kind::Data && payload_len == 0,
            LinkKind::CtsBuf => h.kind == Kind::Cts && payload_len == 0,
            LinkKind::Credit | LinkKind::ReadDone | LinkKind::Eager => unreachable!(),
        };
        if !ok {
            return Err(WireError::Unexpected(h.kind));
        }
        Some(h)
    } else if payload_len != 0 {
        return Err(bad("payload on a link-only slot"));
    } else {
        None
    };
    Ok(Packet { kind, freed, header, remote, payload_len })
}

fn decode_eager(slot: &[u8], peer: Rank, limits: &Limits) -> Result<Packet, WireError> {
    if slot.len() < EAGER_AT {
        return Err(bad("slot smaller than its header"));
    }
    let u32_at = |i: usize| u32::from_le_bytes(slot[i..i + 4].try_into().unwrap());
    let len = u32_at(0) >> 8;
    let max = limits.max_payload(Kind::Eager);
    if len as usize > max {
        return Err(WireError::Oversize { kind: Kind::Eager, len: u64::from(len), max: max as u64 });
    }
    if EAGER_AT + len as usize > slot.len() {
        return Err(bad("slot length out of range"));
    }
    let header = Header {
        src: peer,
        context: u32_at(8),
        credit: u32_at(12),
        tag: u64::from_le_bytes(slot[16..24].try_into().unwrap()),
        len,
        ..Header::new(Kind::Eager)
    };
    Ok(Packet {
        kind: LinkKind::Eager,
        freed: u32_at(4),
        header: Some(header),
        remote: Remote::default(),
        payload_len: len as usize,
    })
}

/// Slot credits of one connection, both directions.
#[derive(Clone, Debug)]
pub struct Credits {
    slots: u32,
    /// Slots we have written to the peer.
    sent: u64,
    /// The peer's count of our slots it has freed (reconstructed to 64 bits).
    peer_freed: u64,
    /// Slots the peer has written to us, and how many we have freed.
    received: u64,
    freed: u64,
    /// The `freed` value the peer last heard.
    advertised: u64,
}

impl Credits {
    /// `slots` per direction (at least 2: one is reserved for credit updates).
    pub fn new(slots: u32) -> Credits {
        assert!(slots >= 2, "a ring needs at least 2 slots");
        Credits { slots, sent: 0, peer_freed: 0, received: 0, freed: 0, advertised: 0 }
    }

    /// Slots per direction.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Whether a slot may be written now: the last free slot is kept for credit updates.
    pub fn can_send(&self, credit_only: bool) -> bool {
        let out = self.sent - self.peer_freed;
        out < u64::from(self.slots) - u64::from(!credit_only)
    }

    /// Takes the next slot (check [`Credits::can_send`] first): its index and the `freed` value
    /// to write into it.
    pub fn take(&mut self) -> (u32, u32) {
        let slot = (self.sent % u64::from(self.slots)) as u32;
        self.sent += 1;
        self.advertised = self.freed;
        (slot, self.freed as u32)
    }

    /// A slot arrived with immediate `imm`: it must be the next slot in order.
    pub fn arrive(&mut self, imm: u32) -> Result<u32, WireError> {
        let expect = (self.received % u64::from(self.slots)) as u32;
        if imm != expect {
            return Err(bad("slot written out of order"));
        }
        if self.received - self.freed >= u64::from(self.slots) {
            return Err(bad("peer wrote beyond its slot credits"));
        }
        self.received += 1;
        Ok(expect)
    }

    /// The peer reports `freed` of our slots freed (monotonic, wrapping).
    pub fn on_freed(&mut self, freed: u32) -> Result<(), WireError> {
        let delta = u64::from(freed.wrapping_sub(self.peer_freed as u32));
        if self.peer_freed + delta > self.sent {
            return Err(bad("peer freed slots never written"));
        }
        self.peer_freed += delta;
        Ok(())
    }

    /// We emptied one received slot.
    pub fn release(&mut self) {
        debug_assert!(self.freed < self.received);
        self.freed += 1;
    }

    /// Whether the peer should get an explicit credit update (nothing else is going its way).
    pub fn wants_update(&self) -> bool {
        self.freed - self.advertised >= u64::from(self.slots / 2).max(1)
    }

    /// Slots written to the peer and not yet freed by it.
    pub fn outstanding(&self) -> u64 {
        self.sent - self.peer_freed
    }
}

/// Eager slots are posted unsignaled, all but one in this many: the device then raises no
/// completion for them (on Soft-RoCE, kernel work and a completion to poll per message), and
/// the next signaled request's completion retires them (`ib_send_lat` signals one send in 100).
/// Every other request (rendezvous, credits, goodbye) is signaled.
pub const SIGNAL_EVERY: u32 = 16;

/// One queue pair's send queue under selective signaling: which requests to post unsignaled,
/// and how many are known complete.
///
/// The device completes a queue pair's send requests in posting order, and raises a completion
/// for a signaled one (success or failure) and for an unsignaled one only when it fails. So
/// the completion of a signaled request retires it and every unsignaled one posted before it.
/// Unsignaled requests posted after the last signaled one are known complete only once a later
/// signaled one completes; nothing but staging slots (which live as long as the queue pair) may
/// be read by them, so a connection is settled, for buffer lifetimes and for shutdown, when no
/// signaled request is outstanding.
#[derive(Clone, Debug, Default)]
pub struct SendQueue {
    /// Requests posted and not yet known complete.
    used: u32,
    /// Signaled requests outstanding, oldest first, each with how many requests its
    /// completion retires: itself and the unsignaled ones just before it.
    signaled: VecDeque<u32>,
    /// Unsignaled requests posted since the last signaled one.
    quiet: u32,
}

impl SendQueue {
    /// Requests posted and not yet known complete (what the queue's depth bounds).
    pub fn used(&self) -> u32 {
        self.used
    }

    /// Requests that a signaled completion still to come will confirm.
    pub fn confirmable(&self) -> u32 {
        self.used - self.quiet
    }

    /// Whether the next request goes unsignaled: one that `may_be_quiet` (an eager slot), unless
    /// it is the [`SIGNAL_EVERY`]th since the last signaled one.
    pub fn quiet_next(&self, may_be_quiet: bool) -> bool {
        may_be_quiet && self.quiet + 1 < SIGNAL_EVERY
    }

    /// A request was posted (`quiet`: unsignaled).
    pub fn posted(&mut self, quiet: bool) {
        self.used += 1;
        if quiet {
            self.quiet += 1;
        } else {
            self.signaled.push_back(self.quiet + 1);
            self.quiet = 0;
        }
    }

    /// The oldest signaled request completed, or was flushed: it retires, with the unsignaled
    /// ones before it.
    pub fn retire(&mut self) {
        if let Some(n) = self.signaled.pop_front() {
            self.used -= n;
        }
    }

    /// No signaled request is outstanding.
    pub fn settled(&self) -> bool {
        self.signaled.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits() -> Limits {
        Limits { world_size: 4, eager_limit: 1024, chunk: 1 << 20, max_message: 1 << 30 }
    }

    #[test]
    fn slots_round_trip_and_bad_ones_are_typed_errors() {
        let mut buf = vec![0u8; SLOT_HEADER + 1024];
        // An eager frame with a field the compact slot has no room for (a `seq`): a full frame.
        let h = Header { src: 2, len: 5, tag: 9, seq: 1, ..Header::new(Kind::Eager) };
        let n = encode(&mut buf, LinkKind::Frame, 77, Some(&h), Remote::default(), b"hello");
        assert_eq!(n, PREFIX + HEADER_LEN + 5, "a frame carries no extension");
        let p = decode(&buf[..n], 2, &limits()).unwrap();
        assert_eq!((p.kind, p.freed, p.header, p.payload_len), (LinkKind::Frame, 77, Some(h), 5));
        assert_eq!(p.payload(&buf[..n]), b"hello");
        // A credit update is its prefix alone.
        let n = encode(&mut buf, LinkKind::Credit, 9, None, Remote::default(), &[]);
        assert_eq!(n, PREFIX);
        let p = decode(&buf[..n], 2, &limits()).unwrap();
        assert_eq!((p.kind, p.freed, p.header, p.payload_len), (LinkKind::Credit, 9, None, 0));
        // Slots shorter than their kind's layout.
        let n = encode(&mut buf, LinkKind::ReadDone, 0, None, Remote { token: 4, ..Remote::default() }, &[]);
        assert_eq!(n, SLOT_HEADER);
        assert_eq!(decode(&buf[..n], 2, &limits()).unwrap().remote.token, 4);
        assert_eq!(decode(&buf[..n - 1], 2, &limits()), Err(WireError::Link("slot length out of range")));
        assert_eq!(decode(&buf[..PREFIX - 1], 2, &limits()), Err(WireError::Link("slot smaller than its header")));
        // A length field shorter than what the slot's kind carries.
        for (kind, at) in [
            (LinkKind::Frame, PREFIX + HEADER_LEN),
            (LinkKind::DataRead, SLOT_HEADER),
            (LinkKind::ReadDone, SLOT_HEADER),
        ] {
            let n = encode(&mut buf, kind, 0, Some(&h), Remote::default(), &[]);
            assert_eq!(n, at, "{kind:?}");
            let mut b = buf.clone();
            b[8..12].copy_from_slice(&(at as u32 - 1).to_le_bytes());
            assert_eq!(decode(&b, 2, &limits()), Err(WireError::Link("slot length out of range")), "{kind:?}");
        }
        // A frame's length field one short of its payload.
        let n = encode(&mut buf, LinkKind::Frame, 77, Some(&h), Remote::default(), b"hello");
        let mut b = buf.clone();
        b[8..12].copy_from_slice(&(n as u32 - 1).to_le_bytes());
        assert_eq!(decode(&b[..n], 2, &limits()), Err(WireError::Unexpected(Kind::Eager)), "4 bytes of 5");
        // From another rank than the connection's.
        assert!(matches!(decode(&buf[..n], 1, &limits()), Err(WireError::WrongSource { .. })));
        // Length field beyond the slot.
        let mut b = buf.clone();
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b, 2, &limits()), Err(WireError::Link("slot length out of range")));
        // A data frame must travel by RDMA, never inline.
        let d = Header { src: 2, len: 5, ..Header::new(Kind::Data) };
        let n = encode(&mut buf, LinkKind::Frame, 0, Some(&d), Remote::default(), b"12345");
        assert_eq!(decode(&buf[..n], 2, &limits()), Err(WireError::Unexpected(Kind::Data)));
        // A read descriptor must describe exactly the frame's bytes.
        let d = Header { src: 2, len: 4096, ..Header::new(Kind::Data) };
        let r = Remote { addr: 1, rkey: 2, token: 3, len: 4095 };
        let n = encode(&mut buf, LinkKind::DataRead, 0, Some(&d), r, &[]);
        assert!(decode(&buf[..n], 2, &limits()).is_err());
        let n = encode(&mut buf, LinkKind::DataRead, 0, Some(&d), Remote { len: 4096, ..r }, &[]);
        assert_eq!(decode(&buf[..n], 2, &limits()).unwrap().remote, Remote { len: 4096, ..r });
        buf[0] = 99;
        assert_eq!(decode(&buf, 2, &limits()), Err(WireError::Link("unknown slot kind")));
    }

    #[test]
    fn eager_frames_take_compact_slots_and_bad_ones_are_typed_errors() {
        let mut buf = vec![0u8; SLOT_HEADER + 1024];
        let h = Header { src: 2, context: 3, tag: 9, len: 8, credit: 41, ..Header::new(Kind::Eager) };
        let n = encode(&mut buf, LinkKind::Frame, 77, Some(&h), Remote::default(), b"8 bytes!");
        assert_eq!(n, EAGER_AT + 8, "an 8-byte message is a 32-byte write");
        let p = decode(&buf[..n], 2, &limits()).unwrap();
        assert_eq!((p.kind, p.freed, p.header, p.payload_len), (LinkKind::Eager, 77, Some(h), 8));
        assert_eq!(p.payload(&buf[..n]), b"8 bytes!");
        // Cut short: within the fixed part, and within the payload.
        assert_eq!(decode(&buf[..EAGER_AT - 1], 2, &limits()), Err(WireError::Link("slot smaller than its header")));
        assert_eq!(decode(&buf[..n - 1], 2, &limits()), Err(WireError::Link("slot length out of range")));
        // A length beyond the eager limit, or beyond the slot.
        let mut b = buf.clone();
        b[1..4].copy_from_slice(&[0x01, 0x04, 0]);
        assert_eq!(decode(&b, 2, &limits()), Err(WireError::Oversize { kind: Kind::Eager, len: 1025, max: 1024 }));
        b[1..4].copy_from_slice(&[0x00, 0x04, 0]);
        assert_eq!(decode(&b[..EAGER_AT + 1023], 2, &limits()), Err(WireError::Link("slot length out of range")));
        assert_eq!(decode(&b, 2, &limits()).unwrap().payload_len, 1024);
        // The source is the connection's peer, whatever rank the sender put in its header.
        assert_eq!(decode(&buf[..n], 1, &limits()).unwrap().header.unwrap().src, 1);
        // What a compact slot cannot carry goes as a full frame.
        for other in [
            Header { flags: 1, ..h },
            Header { seq: 1, ..h },
            Header { aux: 1, ..h },
            Header { kind: Kind::Bye, len: 0, ..h },
        ] {
            let payload = &b"8 bytes!"[..other.len as usize];
            let n = encode(&mut buf, LinkKind::Frame, 0, Some(&other), Remote::default(), payload);
            let p = decode(&buf[..n], 2, &limits()).unwrap();
            assert_eq!((p.kind, p.header), (LinkKind::Frame, Some(other)), "{other:?}");
        }
    }

    proptest! {
        /// Any eager frame the compact slot allows comes back as the same header and payload, and
        /// any bytes at all decode to an error or to a slot within its bounds.
        #[test]
        fn compact_slots_round_trip(ctx: u32, tag: u64, credit: u32, freed: u32, len in 0usize..=1024) {
            let mut buf = vec![0u8; SLOT_HEADER + 1024];
            let data: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let h = Header { src: 3, context: ctx, tag, credit, len: len as u32, ..Header::new(Kind::Eager) };
            let n = encode(&mut buf, LinkKind::Frame, freed, Some(&h), Remote::default(), &data);
            prop_assert_eq!(n, EAGER_AT + len);
            let p = decode(&buf[..n], 3, &limits()).unwrap();
            prop_assert_eq!((p.kind, p.freed, p.header), (LinkKind::Eager, freed, Some(h)));
            prop_assert_eq!(p.payload(&buf[..n]), &data[..]);
        }

        #[test]
        fn random_slots_decode_within_bounds(bytes in proptest::collection::vec(any::<u8>(), 0..200), kind in 1u8..8) {
            let mut bytes = bytes;
            if let Some(b) = bytes.first_mut() { *b = kind; }
            if let Ok(p) = decode(&bytes, 2, &limits()) {
                prop_assert!(p.kind.payload_at() + p.payload_len <= bytes.len());
                prop_assert!(p.header.is_none_or(|h| h.src == 2));
            }
        }
    }

    #[test]
    fn eager_slots_go_unsignaled_but_one_in_signal_every() {
        let mut q = SendQueue::default();
        let mut signaled = 0;
        for _ in 0..SIGNAL_EVERY * 3 {
            let quiet = q.quiet_next(true);
            signaled += u32::from(!quiet);
            q.posted(quiet);
        }
        assert_eq!((signaled, q.used()), (3, SIGNAL_EVERY * 3));
        assert!(!q.quiet_next(false), "only eager slots may go unsignaled");
        q.posted(true);
        assert_eq!(q.confirmable(), SIGNAL_EVERY * 3, "the last one waits for a signaled successor");
        for left in [2, 1, 0] {
            q.retire();
            assert_eq!(q.used(), SIGNAL_EVERY * left + 1);
        }
        assert!(q.settled(), "nothing signaled outstanding: a connection may be reaped");
        assert_eq!(q.confirmable(), 0);
    }

    proptest! {
        /// A device model: requests complete in order, at any time; a completion is seen for each
        /// signaled one. The queue's count is then exactly the requests not known complete, and
        /// fewer than SIGNAL_EVERY unsignaled ones ever wait for a signaled successor.
        #[test]
        fn send_queue_counts_what_is_not_known_complete(ops in proptest::collection::vec(0u8..4, 1..400)) {
            let mut q = SendQueue::default();
            let mut device: VecDeque<bool> = VecDeque::new(); // posted, not complete: signaled?
            let (mut posted, mut known_complete, mut done_unseen) = (0u64, 0u64, 0u64);
            for op in ops {
                match op {
                    0 | 1 => {
                        let quiet = q.quiet_next(op == 0);
                        q.posted(quiet);
                        device.push_back(!quiet);
                        posted += 1;
                    }
                    _ => if let Some(signaled) = device.pop_front() {
                        if signaled {
                            q.retire();
                            known_complete += done_unseen + 1;
                            done_unseen = 0;
                        } else {
                            done_unseen += 1;
                        }
                    },
                }
                prop_assert_eq!(u64::from(q.used()), posted - known_complete);
                prop_assert!(q.quiet < SIGNAL_EVERY);
                prop_assert_eq!(q.settled(), !device.iter().any(|&s| s));
            }
        }
    }

    #[test]
    fn credits_reserve_the_last_slot_for_updates() {
        let mut c = Credits::new(4);
        for _ in 0..3 {
            assert!(c.can_send(false));
            c.take();
        }
        assert!(!c.can_send(false), "the last slot is reserved");
        assert!(c.can_send(true));
        let (slot, _) = c.take();
        assert_eq!(slot, 3);
        assert!(!c.can_send(true));
        c.on_freed(4).unwrap();
        assert!(c.can_send(false));
        assert!(c.on_freed(5).is_err(), "cannot free what was never sent");
    }

    proptest! {
        /// Two endpoints exchanging slots in any interleaving: never more in flight than slots,
        /// slot order respected, credit counters wrap without confusion, no deadlock when both
        /// keep reading.
        #[test]
        fn credit_flow_never_overruns(ops in proptest::collection::vec(0u8..4, 1..400), start in any::<u32>()) {
            let slots = 4u32;
            let mut a = Credits::new(slots);
            let mut b = Credits::new(slots);
            // Start both near the u32 wrap.
            for c in [&mut a, &mut b] {
                c.sent = u64::from(start); c.peer_freed = c.sent; c.received = c.sent; c.freed = c.sent; c.advertised = c.sent;
            }
            let mut a_to_b = std::collections::VecDeque::new();
            let mut b_to_a = std::collections::VecDeque::new();
            for op in ops {
                match op {
                    0 if a.can_send(false) => a_to_b.push_back(a.take()),
                    1 if b.can_send(false) => b_to_a.push_back(b.take()),
                    2 => if let Some((slot, freed)) = a_to_b.pop_front() {
                        prop_assert_eq!(b.arrive(slot).unwrap(), slot);
                        b.on_freed(freed).unwrap();
                        b.release();
                        if b.wants_update() && b.can_send(true) { b_to_a.push_back(b.take()); }
                    },
                    _ => if let Some((slot, freed)) = b_to_a.pop_front() {
                        prop_assert_eq!(a.arrive(slot).unwrap(), slot);
                        a.on_freed(freed).unwrap();
                        a.release();
                        if a.wants_update() && a.can_send(true) { a_to_b.push_back(a.take()); }
                    },
                }
                prop_assert!(a.outstanding() <= u64::from(slots) && b.outstanding() <= u64::from(slots));
            }
        }
    }
}
