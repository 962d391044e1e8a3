//! Wire formats: the multicast datagram (anyone on the network can send one, so every field is
//! checked before it is used) and the control messages that travel over reliable point-to-point
//! (ACK, report, NACK, reliable data copies, ping acknowledgements).
//!
//! Datagram header, 36 bytes, big-endian:
//!
//! ```text
//! 0  magic u32 "FCMC"   4 version u8   5 kind u8   6 fragments u16
//! 8  job u64 (hash of the job token: datagrams of another job are refused)
//! 16 channel u32        20 root u32    24 seq u32 (ping: nonce)
//! 28 message length u32 32 fragment index u16     34 reserved u16
//! ```
//!
//! A tail probe is a header alone, with `seq` the root's next sequence number: a receiver that
//! lacks anything below it asks for it at once, instead of waiting for its collector's timeout
//! (the loss of a stream's last datagrams is seen by nothing else).

use bytes::{BufMut, Bytes, BytesMut};

pub use ferrocomm_transports::Rank;

/// "FCMC".
pub const MAGIC: u32 = 0x4643_4d43;
/// Version of the datagram format.
pub const VERSION: u8 = 1;
/// Bytes of header in front of every datagram's payload.
pub const HEADER: usize = 36;

ferrocomm_transports::wire_enum! {
    /// A datagram's kind byte.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum DatagramKind: u8 {
        Data = 1,
        Ping = 2,
        Tail = 3,
    }
}

/// Why a datagram was refused. None of these is fatal: the datagram is dropped and counted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatagramError {
    /// Fewer bytes than [`HEADER`].
    #[error("datagram of {len} bytes is shorter than the header")]
    TooShort {
        /// Bytes received.
        len: usize,
    },
    /// More bytes than the channel's datagram size.
    #[error("datagram of {len} bytes exceeds the datagram size {max}")]
    Oversize {
        /// Bytes received.
        len: usize,
        /// The channel's datagram size.
        max: usize,
    },
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// A format version other than [`VERSION`].
    #[error("unsupported version {0}")]
    BadVersion(u8),
    /// A kind byte that is not data, ping or tail probe.
    #[error("unknown datagram kind {0}")]
    BadKind(u8),
    /// The job hash is not this job's.
    #[error("datagram of another job")]
    WrongJob,
    /// The channel id is not this channel's.
    #[error("datagram of channel {0}, not this one")]
    OtherChannel(u32),
    /// The root is not a rank of the channel.
    #[error("root rank {rank} is not in the group of {size}")]
    UnknownRank {
        /// The root named by the datagram.
        rank: Rank,
        /// Ranks in the channel.
        size: u32,
    },
    /// The message length exceeds the channel's largest message.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    MessageTooLarge {
        /// The message length named by the datagram.
        len: usize,
        /// The channel's largest message.
        max: usize,
    },
    /// Fragment count, index and payload length do not agree with the message length.
    #[error("inconsistent fragment: {0}")]
    Inconsistent(&'static str),
}

/// A checked datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Datagram {
    /// Fragment `frag` of `frags` of message `seq` (of `len` bytes) from `root`.
    Data {
        /// The sending rank.
        root: Rank,
        /// The message's sequence number in `root`'s stream.
        seq: u32,
        /// The whole message's length in bytes.
        len: u32,
        /// This fragment's index.
        frag: u16,
        /// The message's fragment count.
        frags: u16,
        /// This fragment's bytes.
        payload: Bytes,
    },
    /// Tail probe: `root` has sent every message below `next` (a receiver lacking any asks).
    Tail {
        /// The sending rank.
        root: Rank,
        /// The root's next sequence number.
        next: u32,
    },
    /// The multicast test: answer with [`Control::PingAck`].
    Ping {
        /// The pinging rank.
        root: Rank,
        /// Echoed in the answer, to tell this test from earlier ones.
        nonce: u32,
    },
}

/// What a datagram must match to be accepted.
#[derive(Debug, Clone, Copy)]
pub struct Expect {
    /// Hash of the job token.
    pub job: u64,
    /// The channel id.
    pub channel: u32,
    /// Ranks in the channel: a root must be below it.
    pub size: u32,
    /// Largest datagram, header included.
    pub datagram: usize,
    /// Largest message.
    pub max_message: usize,
}

/// Fragment payload capacity for datagrams of `datagram` bytes.
pub fn fragment_payload(datagram: usize) -> usize {
    datagram.saturating_sub(HEADER).max(1)
}

/// Number of fragments of a message of `len` bytes (an empty message is one empty fragment).
pub fn fragments(len: usize, datagram: usize) -> usize {
    len.div_ceil(fragment_payload(datagram)).max(1)
}

#[allow(clippy::too_many_arguments)]
fn header(b: &mut BytesMut, kind: u8, frags: u16, job: u64, channel: u32, root: Rank, seq: u32, len: u32, frag: u16) {
    b.put_u32(MAGIC);
    b.put_u8(VERSION);
    b.put_u8(kind);
    b.put_u16(frags);
    b.put_u64(job);
    b.put_u32(channel);
    b.put_u32(root);
    b.put_u32(seq);
    b.put_u32(len);
    b.put_u16(frag);
    b.put_u16(0);
}

/// The datagrams that carry message `seq` of `root`.
pub fn encode_data(job: u64, channel: u32, root: Rank, seq: u32, data: &[u8], datagram: usize) -> Vec<Bytes> {
    let p = fragment_payload(datagram);
    let n = fragments(data.len(), datagram);
    (0..n)
        .map(|i| {
            let chunk = &data[(i * p).min(data.len())..((i + 1) * p).min(data.len())];
            let mut b = BytesMut::with_capacity(HEADER + chunk.len());
            header(&mut b, DatagramKind::Data as u8, n as u16, job, channel, root, seq, data.len() as u32, i as u16);
            b.put_slice(chunk);
            b.freeze()
        })
        .collect()
}

/// A ping datagram.
pub fn encode_ping(job: u64, channel: u32, root: Rank, nonce: u32) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER);
    header(&mut b, DatagramKind::Ping as u8, 1, job, channel, root, nonce, 0, 0);
    b.freeze()
}

/// A tail probe: `root` has sent every message below `next`.
pub fn encode_tail(job: u64, channel: u32, root: Rank, next: u32) -> Bytes {
    let mut b = BytesMut::with_capacity(HEADER);
    header(&mut b, DatagramKind::Tail as u8, 1, job, channel, root, next, 0, 0);
    b.freeze()
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}

/// The root a datagram's header names, read without checking anything else: `None` if it is
/// shorter than a header or lacks [`MAGIC`]. The driver drops its own datagrams, which come back
/// to its socket (IP_MULTICAST_LOOP), on this alone, before paying for their authentication and
/// a copy: a datagram that names this rank as its root is never used by it, whoever sent it.
pub fn peek_root(d: &[u8]) -> Option<Rank> {
    (d.len() >= HEADER && be32(d, 0) == MAGIC).then(|| be32(d, 20))
}

/// Checks and decodes a datagram.
pub fn decode(d: Bytes, e: &Expect) -> Result<Datagram, DatagramError> {
    if d.len() < HEADER {
        return Err(DatagramError::TooShort { len: d.len() });
    }
    if d.len() > e.datagram {
        return Err(DatagramError::Oversize { len: d.len(), max: e.datagram });
    }
    let magic = be32(&d, 0);
    if magic != MAGIC {
        return Err(DatagramError::BadMagic(magic));
    }
    if d[4] != VERSION {
        return Err(DatagramError::BadVersion(d[4]));
    }
    let kind = d[5];
    let frags = be16(&d, 6);
    if u64::from_be_bytes(d[8..16].try_into().expect("8 bytes")) != e.job {
        return Err(DatagramError::WrongJob);
    }
    let channel = be32(&d, 16);
    if channel != e.channel {
        return Err(DatagramError::OtherChannel(channel));
    }
    let root = be32(&d, 20);
    if root >= e.size {
        return Err(DatagramError::UnknownRank { rank: root, size: e.size });
    }
    let seq = be32(&d, 24);
    let len = be32(&d, 28);
    let frag = be16(&d, 32);
    match DatagramKind::from_repr(kind) {
        Some(DatagramKind::Ping) => Ok(Datagram::Ping { root, nonce: seq }),
        Some(DatagramKind::Tail) if d.len() != HEADER => {
            Err(DatagramError::Inconsistent("a tail probe with a payload"))
        }
        Some(DatagramKind::Tail) => Ok(Datagram::Tail { root, next: seq }),
        Some(DatagramKind::Data) => {
            if len as usize > e.max_message {
                return Err(DatagramError::MessageTooLarge { len: len as usize, max: e.max_message });
            }
            let p = fragment_payload(e.datagram);
            if frags as usize != fragments(len as usize, e.datagram) {
                return Err(DatagramError::Inconsistent("fragment count does not match the length"));
            }
            if frag >= frags {
                return Err(DatagramError::Inconsistent("fragment index beyond the count"));
            }
            let want = (len as usize).saturating_sub(frag as usize * p).min(p);
            if d.len() - HEADER != want {
                return Err(DatagramError::Inconsistent("payload length does not match the fragment"));
            }
            Ok(Datagram::Data { root, seq, len, frag, frags, payload: d.slice(HEADER..) })
        }
        None => Err(DatagramError::BadKind(kind)),
    }
}

/// A control message, carried over reliable point-to-point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Leaf to its collector (co-root or root): every message of `root` below `upto` is consumed.
    Ack {
        /// The stream's root.
        root: Rank,
        /// First sequence number not consumed.
        upto: u32,
    },
    /// Co-root to root: its whole sub-group (itself included) has every message below `upto`.
    Report {
        /// The stream's root.
        root: Rank,
        /// First sequence number the sub-group does not have.
        upto: u32,
    },
    /// Messages `from..to` of `root` are missing here.
    Nack {
        /// The stream's root.
        root: Rank,
        /// First missing sequence number.
        from: u32,
        /// End (exclusive) of the missing run.
        to: u32,
    },
    /// Message `seq` of `root` in full: the root's reliable copy to a co-root (`copy`), or a
    /// retransmission.
    Data {
        /// The stream's root.
        root: Rank,
        /// The message's sequence number.
        seq: u32,
        /// The root's copy to a co-root, rather than a retransmission.
        copy: bool,
        /// The whole message.
        data: Bytes,
    },
    /// Answer to a ping.
    PingAck {
        /// The pinging rank.
        root: Rank,
        /// The ping's nonce.
        nonce: u32,
    },
}

/// A control message that could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// Fewer bytes than the control header.
    #[error("control message of {0} bytes is too short")]
    TooShort(usize),
    /// A kind byte no [`Control`] variant has.
    #[error("unknown control kind {0}")]
    BadKind(u8),
    /// The root is not a rank of the channel.
    #[error("root rank {rank} is not in the group of {size}")]
    UnknownRank {
        /// The root named by the message.
        rank: Rank,
        /// Ranks in the channel.
        size: u32,
    },
}

const CONTROL_HEADER: usize = 16;

ferrocomm_transports::wire_enum! {
    /// A control message's kind byte.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum ControlKind: u8 {
        Ack = 1,
        Report = 2,
        Nack = 3,
        Data = 4,
        PingAck = 5,
    }
}

impl Control {
    /// The message's bytes: a 16-byte header (kind, root, two words), then any data.
    pub fn encode(&self) -> Bytes {
        let (kind, root, a, b, data) = match self {
            Control::Ack { root, upto } => (ControlKind::Ack, *root, *upto, 0, None),
            Control::Report { root, upto } => (ControlKind::Report, *root, *upto, 0, None),
            Control::Nack { root, from, to } => (ControlKind::Nack, *root, *from, *to, None),
            Control::Data { root, seq, copy, data } => (ControlKind::Data, *root, *seq, u32::from(*copy), Some(data)),
            Control::PingAck { root, nonce } => (ControlKind::PingAck, *root, *nonce, 0, None),
        };
        let mut m = BytesMut::with_capacity(CONTROL_HEADER + data.map_or(0, |d| d.len()));
        m.put_u8(kind as u8);
        m.put_bytes(0, 3);
        m.put_u32(root);
        m.put_u32(a);
        m.put_u32(b);
        if let Some(d) = data {
            m.put_slice(d);
        }
        m.freeze()
    }

    /// Checks and decodes a message of a channel of `size` ranks.
    pub fn decode(m: Bytes, size: u32) -> Result<Control, ControlError> {
        if m.len() < CONTROL_HEADER {
            return Err(ControlError::TooShort(m.len()));
        }
        let (root, a, b) = (be32(&m, 4), be32(&m, 8), be32(&m, 12));
        if root >= size {
            return Err(ControlError::UnknownRank { rank: root, size });
        }
        Ok(match ControlKind::from_repr(m[0]) {
            Some(ControlKind::Ack) => Control::Ack { root, upto: a },
            Some(ControlKind::Report) => Control::Report { root, upto: a },
            Some(ControlKind::Nack) => Control::Nack { root, from: a, to: b },
            Some(ControlKind::Data) => Control::Data { root, seq: a, copy: b != 0, data: m.slice(CONTROL_HEADER..) },
            Some(ControlKind::PingAck) => Control::PingAck { root, nonce: a },
            None => return Err(ControlError::BadKind(m[0])),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const E: Expect = Expect { job: 7, channel: 3, size: 4, datagram: 100, max_message: 1000 };

    #[test]
    fn peek_root_reads_the_root_of_every_kind_and_nothing_else() {
        for d in [encode_data(7, 3, 2, 9, b"abc", 100).remove(0), encode_ping(7, 3, 2, 1), encode_tail(7, 3, 2, 5)] {
            assert_eq!(peek_root(&d), Some(2));
        }
        let d = encode_tail(7, 3, 2, 5);
        assert_eq!(peek_root(&d[..HEADER - 1]), None);
        let mut bad = d.to_vec();
        bad[0] ^= 1;
        assert_eq!(peek_root(&bad), None);
    }

    #[test]
    fn data_round_trips_through_fragments() {
        let msg: Vec<u8> = (0..250u32).map(|i| i as u8).collect();
        let ds = encode_data(7, 3, 2, u32::MAX, &msg, 100);
        assert_eq!(ds.len(), fragments(250, 100));
        let mut out = vec![0u8; 250];
        for d in ds {
            match decode(d, &E).unwrap() {
                Datagram::Data { root: 2, seq: u32::MAX, len: 250, frag, payload, .. } => {
                    let at = frag as usize * fragment_payload(100);
                    out[at..at + payload.len()].copy_from_slice(&payload);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(out, msg);
        let empty = encode_data(7, 3, 1, 5, &[], 100);
        assert_eq!(empty.len(), 1);
        assert!(matches!(decode(empty[0].clone(), &E), Ok(Datagram::Data { len: 0, frags: 1, .. })));
    }

    #[test]
    fn every_bad_field_is_a_typed_error() {
        let good = encode_data(7, 3, 2, 1, &[1, 2, 3], 100).remove(0);
        let with = |at: usize, v: &[u8]| {
            let mut b = BytesMut::from(&good[..]);
            b[at..at + v.len()].copy_from_slice(v);
            decode(b.freeze(), &E)
        };
        assert_eq!(decode(good.slice(..10), &E), Err(DatagramError::TooShort { len: 10 }));
        assert!(matches!(with(0, b"XXXX"), Err(DatagramError::BadMagic(_))));
        assert_eq!(with(4, &[9]), Err(DatagramError::BadVersion(9)));
        assert_eq!(with(5, &[9]), Err(DatagramError::BadKind(9)));
        assert_eq!(with(8, &[1]), Err(DatagramError::WrongJob));
        assert_eq!(with(16, &[0, 0, 0, 4]), Err(DatagramError::OtherChannel(4)));
        assert_eq!(with(20, &[0, 0, 0, 4]), Err(DatagramError::UnknownRank { rank: 4, size: 4 }));
        assert!(matches!(with(28, &[0, 1, 0, 0]), Err(DatagramError::MessageTooLarge { .. })));
        assert!(matches!(with(28, &[0, 0, 0, 4]), Err(DatagramError::Inconsistent(_))));
        assert!(matches!(with(32, &[0, 1]), Err(DatagramError::Inconsistent(_))));
        let big = Bytes::from(vec![0u8; 101]);
        assert_eq!(decode(big, &E), Err(DatagramError::Oversize { len: 101, max: 100 }));
    }

    #[test]
    fn control_round_trips_and_rejects_garbage() {
        for c in [
            Control::Ack { root: 1, upto: 9 },
            Control::Report { root: 2, upto: u32::MAX },
            Control::Nack { root: 3, from: 4, to: 6 },
            Control::Data { root: 0, seq: 5, copy: true, data: Bytes::from_static(b"xyz") },
            Control::PingAck { root: 1, nonce: 77 },
        ] {
            assert_eq!(Control::decode(c.encode(), 4), Ok(c));
        }
        assert_eq!(Control::decode(Bytes::from_static(b"abc"), 4), Err(ControlError::TooShort(3)));
        let mut m = BytesMut::from(&Control::Ack { root: 1, upto: 2 }.encode()[..]);
        m[0] = 99;
        assert_eq!(Control::decode(m.freeze(), 4), Err(ControlError::BadKind(99)));
        assert!(matches!(
            Control::decode(Control::Ack { root: 9, upto: 2 }.encode(), 4),
            Err(ControlError::UnknownRank { .. })
        ));
    }
}
