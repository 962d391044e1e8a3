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
//! Only the bytes used are written: an 8-byte eager message is a 72-byte write (96 when every
//! slot carried the extension), a credit update 16 bytes (88). Under Soft-RoCE every byte is
//! copied and checksummed in software; the transport's 8-byte one-way time went from 18.0-19.6
//! to 16.0-16.9 us in one boot (see `docs/performance-history.md`).
//!
//! Credits ([`Credits`]): every slot written uses one credit; `freed`, piggybacked on every slot,
//! is the receiver's monotonic count of slots it has emptied (wrapping u32, compared by
//! difference: a full ring and an empty one never look alike, unlike DCFA's mod-N offsets). The
//! receiver copies a slot out as soon as its completion is polled, independent of matching (the
//! engine's own credits bound unexpected messages), so slots are freed promptly. A `Credit` slot
//! is sent only when half the ring is freed and not yet advertised; the last slot is reserved
//! for it, so a credit update can always be sent (DCFA's SYNC needed a slot it might not have).

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError};

pub const PREFIX: usize = 16;
pub const EXT: usize = 24;
/// The most bytes before a slot's payload (a slot holds this plus the eager limit).
pub const SLOT_HEADER: usize = PREFIX + HEADER_LEN + EXT;

/// What a slot carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LinkKind {
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
}

impl LinkKind {
    fn from_u8(v: u8) -> Option<LinkKind> {
        Some(match v {
            1 => LinkKind::Frame,
            2 => LinkKind::Credit,
            3 => LinkKind::DataRead,
            4 => LinkKind::DataWritten,
            5 => LinkKind::CtsBuf,
            6 => LinkKind::ReadDone,
            _ => return None,
        })
    }

    fn has_header(self) -> bool {
        !matches!(self, LinkKind::Credit | LinkKind::ReadDone)
    }

    /// Whether the slot carries the extension (a remote buffer or a token).
    fn has_remote(self) -> bool {
        !matches!(self, LinkKind::Frame | LinkKind::Credit)
    }

    /// Where the slot's payload starts: after all that this kind carries.
    fn payload_at(self) -> usize {
        match self {
            LinkKind::Credit => PREFIX,
            LinkKind::Frame => PREFIX + HEADER_LEN,
            _ => SLOT_HEADER,
        }
    }
}

/// A range of remote memory, and the sender's token for a lent chunk (read offers and DONE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
    pub token: u32,
    pub len: u64,
}

/// A decoded slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packet {
    pub kind: LinkKind,
    /// The peer's count of our slots it has freed.
    pub freed: u32,
    pub header: Option<Header>,
    pub remote: Remote,
    /// Inline payload bytes, at [`LinkKind::payload_at`]: see [`Packet::payload`].
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
/// kinds that carry it, `header` only for those that carry one.
pub fn encode(
    slot: &mut [u8],
    kind: LinkKind,
    freed: u32,
    header: Option<&Header>,
    remote: Remote,
    payload: &[u8],
) -> usize {
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
    let kind = LinkKind::from_u8(slot[0]).ok_or(bad("unknown slot kind"))?;
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
            LinkKind::Credit | LinkKind::ReadDone => unreachable!(),
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
        let h = Header { src: 2, len: 5, tag: 9, ..Header::new(Kind::Eager) };
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
