//! The one versioned frame header every transport carries.
//!
//! A frame is a fixed 48-byte little-endian header followed by `len` payload bytes. Everything read
//! from the network goes through [`Header::decode`], which checks magic, version, kind, the source
//! rank and the payload length against [`Limits`] before anything is allocated: a peer can never
//! make us allocate more than the limits say.

use std::fmt;

/// `"FCOM"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FCOM");
/// Wire version; bumped on any incompatible change (2: the challenge-response `Hello`).
pub const VERSION: u8 = 2;
/// Size of an encoded [`Header`].
pub const HEADER_LEN: usize = 48;
pub use crate::auth::TOKEN_LEN;
/// Largest `Hello` payload: the listener's challenge.
pub const HELLO_MAX: usize = crate::auth::CHALLENGE_LEN;

/// A rank (process index) inside a job.
pub type Rank = u32;

/// Declares a field-less enum whose variants are the values of an integer on the wire (a frame's
/// kind byte, a state word in shared memory), with `#[repr]` of that integer, so that
/// `Variant as u8` encodes, and `from_repr`, which decodes: the variant of a value, `None` for a
/// value no variant has:
///
/// ```
/// ferrocomm_transports::wire_enum! {
///     /// What a message is.
///     #[derive(Clone, Copy, Debug, PartialEq, Eq)]
///     pub enum Code: u8 {
///         /// A request.
///         Request = 1,
///         /// Its answer.
///         Reply = 2,
///     }
/// }
/// assert_eq!(Code::from_repr(Code::Reply as u8), Some(Code::Reply));
/// assert_eq!(Code::from_repr(0), None);
/// ```
#[macro_export]
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $($(#[$vmeta:meta])* $variant:ident = $value:literal),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        $vis enum $name {
            $($(#[$vmeta])* $variant = $value),+
        }

        impl $name {
            /// The variant whose value is `v`; `None` for a value no variant has.
            // Some enums are only ever encoded in the crate that declares them.
            #[allow(dead_code)]
            $vis const fn from_repr(v: $repr) -> Option<Self> {
                match v {
                    $($value => Some(Self::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

wire_enum! {
    /// What a frame is.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub enum Kind: u8 {
        /// Connection set-up, the handshake of [`crate::auth`]; `src` is the sender's rank, `aux` the
        /// rank it wants at the other end, [`flags`] tell the step.
        Hello = 1,
        /// A whole small message: `tag`, `context`, payload = data.
        Eager = 2,
        /// Rendezvous request-to-send: `seq` = sender's message id, `aux` = total length.
        Rts = 3,
        /// Receiver is ready (clear-to-send) for message `seq`; `aux` = receiver's operation id.
        /// With [`flags::TRUNCATED`] the receiver refuses the data (its buffer is too small).
        Cts = 4,
        /// A chunk of rendezvous data for receiver operation `seq`, at byte offset `aux` (with
        /// [`flags::PUSH`], `seq` is the sender's message id).
        Data = 5,
        /// Credit update only (the piggybacked `credit` field is the content).
        Credit = 6,
        /// Orderly goodbye: the peer is leaving and will send nothing more.
        Bye = 7,
        /// Failure notice: rank `aux` is lost (the sender saw it, heard of it, or, when `aux` is the
        /// sender itself, is aborting). No payload.
        Lost = 8,
    }
}

/// Header flag bits.
pub mod flags {
    /// On `Cts`: the receive buffer is too small; the sender must not send data.
    pub const TRUNCATED: u16 = 1;
    /// On `Hello`: the listener's challenge (its nonce and proof). No flag: the connector's hello.
    pub const CHALLENGE: u16 = 2;
    /// On `Hello`: the connector's proof.
    pub const PROOF: u16 = 4;
    /// On `Hello`: the connector refuses the listener's proof (no payload).
    pub const REFUSE: u16 = 8;
    /// On `Data`: one part of a frame striped across rails ([`crate::rails`]); `tag` is the
    /// part's id among the parts sent to that peer.
    pub const RAIL_PART: u16 = 16;
    /// On `Credit`: a rail's own frame ([`crate::rails::stripe`]), by `tag`: an acknowledgement
    /// of parts (`seq` counts the parts received on the connection it travels back on), of
    /// control frames (`seq` counts those delivered), or a mark (`seq` numbers the control frames
    /// that follow on its connection).
    pub const RAIL_ACK: u16 = 32;
    /// On `Data`: an envelope to be forwarded ([`crate::relay`]); `seq` is the final
    /// destination, the payload the whole frame (header, then payload) it carries.
    pub const RELAY: u16 = 64;
    /// On `Rts`: the data follows at once, without waiting for a `Cts` (a pushed rendezvous).
    /// On `Data`: a chunk of such a message; `seq` is then the sender's message id, and the
    /// chunks follow their `Rts` in order, at consecutive offsets, before any other pushed `Rts`.
    pub const PUSH: u16 = 128;
    /// On `Cts` for a pushed message: the pushed data lands in the matched receive, nothing is to
    /// be sent again.
    pub const TAKEN: u16 = 256;
}

/// The decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// Bits of [`flags`].
    pub flags: u16,
    /// Sending rank.
    pub src: Rank,
    /// Communicator context id.
    pub context: u32,
    /// Message tag (64-bit).
    pub tag: u64,
    /// Message or operation id (meaning depends on `kind`).
    pub seq: u64,
    /// Payload length in bytes.
    pub len: u32,
    /// Piggybacked credit: the total number of credit-consuming frames the sender of this header
    /// has freed from its peer so far (monotonic, wrapping).
    pub credit: u32,
    /// Kind-specific extra word (total length, offset, operation id).
    pub aux: u64,
}

impl Header {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: Kind) -> Header {
        Header { kind, flags: 0, src: 0, context: 0, tag: 0, seq: 0, len: 0, credit: 0, aux: 0 }
    }

    /// Encodes into exactly [`HEADER_LEN`] bytes. Inlined (as is [`Header::decode`]): it is on
    /// every message's path, from other crates and other codegen units of this one.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.src.to_le_bytes());
        b[12..16].copy_from_slice(&self.context.to_le_bytes());
        b[16..24].copy_from_slice(&self.tag.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..36].copy_from_slice(&self.len.to_le_bytes());
        b[36..40].copy_from_slice(&self.credit.to_le_bytes());
        b[40..48].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Decodes and validates a header read from the network.
    #[inline]
    pub fn decode(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<Header, WireError> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(WireError::BadVersion(b[4]));
        }
        let kind = Kind::from_repr(b[5]).ok_or(WireError::UnknownKind(b[5]))?;
        let h = Header {
            kind,
            flags: u16::from_le_bytes([b[6], b[7]]),
            src: u32_at(8),
            context: u32_at(12),
            tag: u64_at(16),
            seq: u64_at(24),
            len: u32_at(32),
            credit: u32_at(36),
            aux: u64_at(40),
        };
        if h.src >= limits.world_size {
            return Err(WireError::UnknownRank { rank: h.src, size: limits.world_size });
        }
        let max = limits.max_payload(kind);
        if h.len as usize > max {
            return Err(WireError::Oversize { kind, len: h.len as u64, max: max as u64 });
        }
        if kind == Kind::Rts && h.aux > limits.max_message as u64 {
            return Err(WireError::Oversize { kind, len: h.aux, max: limits.max_message as u64 });
        }
        Ok(h)
    }
}

/// What a connection accepts from its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Number of ranks in the job: any `src` at or above it is unknown.
    pub world_size: u32,
    /// Largest eager payload.
    pub eager_limit: usize,
    /// Largest rendezvous data chunk.
    pub chunk: usize,
    /// Largest whole message (announced in an RTS).
    pub max_message: usize,
}

impl Limits {
    /// Largest payload a frame of `kind` may carry.
    #[inline]
    pub fn max_payload(&self, kind: Kind) -> usize {
        match kind {
            Kind::Hello => HELLO_MAX,
            Kind::Eager => self.eager_limit,
            Kind::Data => self.chunk,
            Kind::Rts | Kind::Cts | Kind::Credit | Kind::Bye | Kind::Lost => 0,
        }
    }
}

/// A frame that breaks the wire rules. The connection it arrived on is closed; nothing else is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A wire version other than [`VERSION`].
    #[error("unsupported wire version {0} (this build speaks {VERSION})")]
    BadVersion(u8),
    /// A kind byte no [`Kind`] has.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// A payload (or announced length) beyond the [`Limits`] for its kind.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    Oversize {
        /// The frame's kind.
        kind: Kind,
        /// The length it carries or announces.
        len: u64,
        /// The limit for that kind.
        max: u64,
    },
    /// A rank outside the job.
    #[error("rank {rank} is not in this job of {size} ranks")]
    UnknownRank {
        /// The rank named.
        rank: Rank,
        /// Ranks in the job.
        size: u32,
    },
    /// A source rank other than the connection's peer.
    #[error("frame claims source rank {got} on the connection of rank {expected}")]
    WrongSource {
        /// The connection's peer.
        expected: Rank,
        /// The source the frame names.
        got: Rank,
    },
    /// A frame of a kind not allowed at this point of the connection.
    #[error("unexpected {0:?} frame")]
    Unexpected(Kind),
    /// A transport's own framing around the header is broken (verbs slots).
    #[error("link protocol: {0}")]
    Link(&'static str),
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn limits() -> Limits {
        Limits { world_size: 4, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 }
    }

    #[test]
    fn round_trip() {
        let h = Header {
            kind: Kind::Rts,
            flags: 3,
            src: 2,
            context: 7,
            tag: u64::MAX,
            seq: 99,
            len: 0,
            credit: 5,
            aux: 12345,
        };
        assert_eq!(Header::decode(&h.encode(), &limits()), Ok(h));
    }

    #[test]
    fn rejects_each_bad_field() {
        let good = Header::new(Kind::Eager);
        let mut b = good.encode();
        b[0] ^= 1;
        assert!(matches!(Header::decode(&b, &limits()), Err(WireError::BadMagic(_))));
        let mut b = good.encode();
        b[4] = 9;
        assert_eq!(Header::decode(&b, &limits()), Err(WireError::BadVersion(9)));
        let mut b = good.encode();
        b[5] = 200;
        assert_eq!(Header::decode(&b, &limits()), Err(WireError::UnknownKind(200)));
        let h = Header { src: 4, ..good };
        assert!(matches!(Header::decode(&h.encode(), &limits()), Err(WireError::UnknownRank { .. })));
        let h = Header { len: 1025, ..good };
        assert!(matches!(Header::decode(&h.encode(), &limits()), Err(WireError::Oversize { .. })));
        let h = Header { kind: Kind::Rts, aux: 1 << 40, ..good };
        assert!(matches!(Header::decode(&h.encode(), &limits()), Err(WireError::Oversize { .. })));
        let h = Header { kind: Kind::Credit, len: 1, ..good };
        assert!(matches!(Header::decode(&h.encode(), &limits()), Err(WireError::Oversize { .. })));
    }

    proptest! {
        /// Random bytes never panic the decoder, and whatever it accepts respects the limits.
        #[test]
        fn random_bytes_are_safe(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let b: [u8; HEADER_LEN] = bytes.try_into().unwrap();
            if let Ok(h) = Header::decode(&b, &limits()) {
                prop_assert!((h.len as usize) <= limits().max_payload(h.kind));
                prop_assert!(h.src < 4);
            }
        }

        #[test]
        fn any_valid_header_round_trips(src in 0u32..4, ctx: u32, tag: u64, seq: u64, len in 0u32..=1024,
                                        credit: u32, aux in 0u64..1000, flags: u16) {
            let h = Header { kind: Kind::Eager, flags, src, context: ctx, tag, seq, len, credit, aux };
            prop_assert_eq!(Header::decode(&h.encode(), &limits()), Ok(h));
        }
    }
}
