//! The messages of the emulated path. They travel as point-to-point messages on a reserved
//! context, so framing, credits and large-message rendezvous are the engine's; this module only
//! encodes and checks their content.
//!
//! The message tag carries its kind; the payload starts with a version byte, then fixed
//! little-endian fields, then (put, data, enqueue) the bytes. Decoding checks every length and
//! value and reports what is wrong; a request whose id could be read gets a `Fail` reply.

use bytes::{BufMut, Bytes, BytesMut};
use ferrocomm_transports::one_sided::RemoteKey;

use super::geometry::{Layout, Side};
use super::memory::{AtomicOp, SegmentKind, queue_shape_ok};
use super::{Access, RmaError, SegmentId};

/// 2: attach answers carry the segment's RDMA address and key; revoke and released.
const VERSION: u8 = 2;

/// Kinds, as tags.
const ATTACH: u64 = 1;
const PUT: u64 = 2;
const GET: u64 = 3;
const ATOMIC: u64 = 4;
const NOTIFY: u64 = 5;
const ENQUEUE: u64 = 6;
const WAKE: u64 = 7;
const REVOKE: u64 = 8;
const RELEASED: u64 = 9;
const ACK: u64 = 16;
const DATA: u64 = 17;
const VALUE: u64 = 18;
const ATTACHED: u64 = 19;
const FAIL: u64 = 20;

/// Largest piece of a transfer in one message (each is a point-to-point message: large ones go
/// by rendezvous, and the target copies each as it lands); a get asking for more is refused.
pub(crate) const MAX_CHUNK: usize = 1 << 20;

/// Bytes of a put or data message before its data (the largest fixed part), for cutting
/// transfers to the message limit.
pub(crate) const OVERHEAD: usize = 128;

/// What the owner tells an attaching peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttachInfo {
    pub len: usize,
    pub access: Access,
    pub kind: SegmentKind,
    /// The owner's process and its descriptor of the segment's memory (for a mapping peer).
    pub pid: i32,
    pub fd: i32,
    pub nonce: u64,
    /// The largest message the owner receives (puts are cut to it).
    pub max_message: usize,
    /// Where the device reaches the segment's data (RDMA verbs), if the owner registered it
    /// (`rkey` 0: not registered).
    pub rdma: RemoteKey,
}

/// One message of the emulated path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    Attach {
        req: u64,
        serial: u32,
    },
    /// Stream bytes `start..start + data.len()` of the remote `layout`; with `notify`, the
    /// segment's notification counter is bumped once they are written.
    Put {
        req: u64,
        serial: u32,
        notify: bool,
        layout: Layout,
        start: usize,
        data: Bytes,
    },
    Get {
        req: u64,
        serial: u32,
        layout: Layout,
        start: usize,
        len: usize,
    },
    Atomic {
        req: u64,
        serial: u32,
        op: AtomicOp,
        off: usize,
    },
    Notify {
        req: u64,
        serial: u32,
        n: u64,
    },
    Enqueue {
        req: u64,
        serial: u32,
        record: Bytes,
    },
    /// A peer wrote through its mapping and the owner sleeps: wake it (no reply).
    Wake {
        serial: u32,
    },
    /// Owner to an attached peer: the segment is unpublished; operate on it no more, and say
    /// `Released` once the operations already posted through the device are over (no reply).
    Revoke {
        serial: u32,
    },
    /// Peer to owner, after `Revoke`: none of its device operations on the segment is in flight.
    Released {
        serial: u32,
    },
    Ack {
        req: u64,
    },
    Data {
        req: u64,
        start: usize,
        data: Bytes,
    },
    Value {
        req: u64,
        value: u64,
    },
    Attached {
        req: u64,
        info: AttachInfo,
    },
    Fail {
        req: u64,
        error: RmaError,
    },
}

impl Msg {
    /// The request id of a reply (`None` for requests).
    pub(crate) fn reply_to(&self) -> Option<u64> {
        match self {
            Msg::Ack { req } | Msg::Data { req, .. } | Msg::Value { req, .. } => Some(*req),
            Msg::Attached { req, .. } | Msg::Fail { req, .. } => Some(*req),
            _ => None,
        }
    }

    /// (tag, payload) to send.
    pub(crate) fn encode(&self) -> (u64, Bytes) {
        let mut b = BytesMut::with_capacity(OVERHEAD);
        b.put_u8(VERSION);
        let tag = match self {
            Msg::Attach { req, serial } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                ATTACH
            }
            Msg::Put { req, serial, notify, layout, start, data } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                b.put_u8(*notify as u8);
                put_layout(&mut b, layout);
                b.put_u64_le(*start as u64);
                b.reserve(data.len());
                b.put_slice(data);
                PUT
            }
            Msg::Get { req, serial, layout, start, len } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                put_layout(&mut b, layout);
                b.put_u64_le(*start as u64);
                b.put_u64_le(*len as u64);
                GET
            }
            Msg::Atomic { req, serial, op, off } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                let (code, a, c) = match *op {
                    AtomicOp::FetchAdd(v) => (1, v, 0),
                    AtomicOp::CompareSwap { current, new } => (2, current, new),
                    AtomicOp::Swap(v) => (3, v, 0),
                };
                b.put_u8(code);
                b.put_u64_le(*off as u64);
                b.put_u64_le(a);
                b.put_u64_le(c);
                ATOMIC
            }
            Msg::Notify { req, serial, n } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                b.put_u64_le(*n);
                NOTIFY
            }
            Msg::Enqueue { req, serial, record } => {
                b.put_u64_le(*req);
                b.put_u32_le(*serial);
                b.put_slice(record);
                ENQUEUE
            }
            Msg::Wake { serial } => {
                b.put_u32_le(*serial);
                WAKE
            }
            Msg::Revoke { serial } => {
                b.put_u32_le(*serial);
                REVOKE
            }
            Msg::Released { serial } => {
                b.put_u32_le(*serial);
                RELEASED
            }
            Msg::Ack { req } => {
                b.put_u64_le(*req);
                ACK
            }
            Msg::Data { req, start, data } => {
                b.put_u64_le(*req);
                b.put_u64_le(*start as u64);
                b.reserve(data.len());
                b.put_slice(data);
                DATA
            }
            Msg::Value { req, value } => {
                b.put_u64_le(*req);
                b.put_u64_le(*value);
                VALUE
            }
            Msg::Attached { req, info } => {
                b.put_u64_le(*req);
                b.put_u64_le(info.len as u64);
                b.put_u8(info.access.bits());
                let (kind, record, capacity) = match info.kind {
                    SegmentKind::Window => (0, 0, 0),
                    SegmentKind::Queue { record, capacity } => (1, record, capacity),
                };
                b.put_u8(kind);
                b.put_u64_le(record as u64);
                b.put_u64_le(capacity as u64);
                b.put_i32_le(info.pid);
                b.put_i32_le(info.fd);
                b.put_u64_le(info.nonce);
                b.put_u64_le(info.max_message as u64);
                b.put_u64_le(info.rdma.addr);
                b.put_u32_le(info.rdma.rkey);
                ATTACHED
            }
            Msg::Fail { req, error } => {
                b.put_u64_le(*req);
                let (code, x, y, z) = encode_error(error);
                b.put_u8(code);
                b.put_u64_le(x);
                b.put_u64_le(y);
                b.put_u64_le(z);
                FAIL
            }
        };
        (tag, b.freeze())
    }

    /// Decodes a message of kind `tag` from a peer. On error: the request id, if it could be
    /// read (so that the requester can be told), and what is wrong.
    pub(crate) fn decode(tag: u64, payload: Bytes) -> Result<Msg, (Option<u64>, &'static str)> {
        let mut r = Reader { b: &payload, at: 0 };
        if r.u8().map_err(|e| (None, e))? != VERSION {
            return Err((None, "unknown version"));
        }
        if matches!(tag, WAKE | REVOKE | RELEASED) {
            let serial = r.u32().map_err(|e| (None, e))?;
            let m = match tag {
                WAKE => Msg::Wake { serial },
                REVOKE => Msg::Revoke { serial },
                _ => Msg::Released { serial },
            };
            return r.end().map(|()| m).map_err(|e| (None, e));
        }
        let req = r.u64().map_err(|e| (None, e))?;
        let fail = |e| (Some(req), e);
        let msg = (|| -> Result<Msg, &'static str> {
            Ok(match tag {
                ATTACH => Msg::Attach { req, serial: r.u32()? },
                PUT => {
                    let serial = r.u32()?;
                    let notify = match r.u8()? {
                        0 => false,
                        1 => true,
                        _ => return Err("bad put flags"),
                    };
                    let layout = r.layout()?;
                    let start = r.usize()?;
                    let data = payload.slice(r.at..);
                    r.at = payload.len();
                    Msg::Put { req, serial, notify, layout, start, data }
                }
                GET => Msg::Get { req, serial: r.u32()?, layout: r.layout()?, start: r.usize()?, len: r.usize()? },
                ATOMIC => {
                    let serial = r.u32()?;
                    let code = r.u8()?;
                    let (off, a, c) = (r.usize()?, r.u64()?, r.u64()?);
                    let op = match code {
                        1 => AtomicOp::FetchAdd(a),
                        2 => AtomicOp::CompareSwap { current: a, new: c },
                        3 => AtomicOp::Swap(a),
                        _ => return Err("unknown atomic operation"),
                    };
                    Msg::Atomic { req, serial, op, off }
                }
                NOTIFY => Msg::Notify { req, serial: r.u32()?, n: r.u64()? },
                ENQUEUE => {
                    let serial = r.u32()?;
                    let record = payload.slice(r.at..);
                    r.at = payload.len();
                    Msg::Enqueue { req, serial, record }
                }
                ACK => Msg::Ack { req },
                DATA => {
                    let start = r.usize()?;
                    let data = payload.slice(r.at..);
                    r.at = payload.len();
                    Msg::Data { req, start, data }
                }
                VALUE => Msg::Value { req, value: r.u64()? },
                ATTACHED => {
                    let len = r.usize()?;
                    let access = Access::from_bits(r.u8()?).ok_or("unknown access flags")?;
                    let (kind, record, capacity) = (r.u8()?, r.usize()?, r.usize()?);
                    let kind = match kind {
                        0 => SegmentKind::Window,
                        1 if queue_shape_ok(record, capacity) => SegmentKind::Queue { record, capacity },
                        _ => return Err("bad segment kind"),
                    };
                    let (pid, fd, nonce, max_message) = (r.i32()?, r.i32()?, r.u64()?, r.usize()?);
                    let rdma = RemoteKey { addr: r.u64()?, rkey: r.u32()? };
                    Msg::Attached { req, info: AttachInfo { len, access, kind, pid, fd, nonce, max_message, rdma } }
                }
                FAIL => {
                    let code = r.u8()?;
                    let (x, y, z) = (r.u64()?, r.u64()?, r.u64()?);
                    Msg::Fail { req, error: decode_error(code, x, y, z)? }
                }
                _ => return Err("unknown message kind"),
            })
        })()
        .map_err(fail)?;
        r.end().map_err(fail)?;
        Ok(msg)
    }
}

fn put_layout(b: &mut BytesMut, l: &Layout) {
    for v in [l.block, l.count[0], l.count[1], l.side.offset, l.side.stride[0], l.side.stride[1]] {
        b.put_u64_le(v as u64);
    }
}

fn encode_error(e: &RmaError) -> (u8, u64, u64, u64) {
    match *e {
        RmaError::OutOfBounds { offset, len, segment_len } => (1, offset, len, segment_len),
        RmaError::NotPermitted { needed, granted } => (2, needed.bits() as u64, granted.bits() as u64, 0),
        RmaError::Misaligned { offset } => (3, offset, 0, 0),
        RmaError::UnknownSegment { id } => (4, id.to_u64(), 0, 0),
        RmaError::Unpublished { id } => (5, id.to_u64(), 0, 0),
        RmaError::QueueFull { id } => (6, id.to_u64(), 0, 0),
        RmaError::RecordSize { len, record } => (7, len, record, 0),
        RmaError::Geometry(_) => (8, 0, 0, 0),
        RmaError::Malformed { .. } => (9, 0, 0, 0),
    }
}

fn decode_error(code: u8, x: u64, y: u64, z: u64) -> Result<RmaError, &'static str> {
    let access = |v: u64| u8::try_from(v).ok().and_then(Access::from_bits).ok_or("unknown access flags");
    Ok(match code {
        1 => RmaError::OutOfBounds { offset: x, len: y, segment_len: z },
        2 => RmaError::NotPermitted { needed: access(x)?, granted: access(y)? },
        3 => RmaError::Misaligned { offset: x },
        4 => RmaError::UnknownSegment { id: SegmentId::from_u64(x) },
        5 => RmaError::Unpublished { id: SegmentId::from_u64(x) },
        6 => RmaError::QueueFull { id: SegmentId::from_u64(x) },
        7 => RmaError::RecordSize { len: x, record: y },
        8 => RmaError::Geometry("refused by the target".into()),
        // The rank is filled in by the receiver, which knows who sent the reply.
        9 => RmaError::Malformed { rank: 0, what: "the target could not parse the request" },
        _ => return Err("unknown error code"),
    })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], &'static str> {
        let s = self.b.get(self.at..self.at + N).ok_or("message too short")?;
        self.at += N;
        Ok(s.try_into().unwrap())
    }
    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn i32(&mut self) -> Result<i32, &'static str> {
        Ok(i32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn usize(&mut self) -> Result<usize, &'static str> {
        usize::try_from(self.u64()?).map_err(|_| "value too large")
    }
    fn layout(&mut self) -> Result<Layout, &'static str> {
        let (block, c0, c1) = (self.usize()?, self.usize()?, self.usize()?);
        let (offset, s0, s1) = (self.usize()?, self.usize()?, self.usize()?);
        Ok(Layout { block, count: [c0, c1], side: Side { offset, stride: [s0, s1] } })
    }
    fn end(&self) -> Result<(), &'static str> {
        if self.at == self.b.len() { Ok(()) } else { Err("trailing bytes") }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<Msg> {
        let layout = Layout { block: 8, count: [3, 2], side: Side { offset: 16, stride: [24, 100] } };
        vec![
            Msg::Attach { req: 1, serial: 2 },
            Msg::Put { req: 3, serial: 4, notify: true, layout, start: 5, data: Bytes::from_static(b"abcdef") },
            Msg::Put { req: 3, serial: 4, notify: false, layout, start: 0, data: Bytes::new() },
            Msg::Get { req: 6, serial: 7, layout, start: 8, len: 40 },
            Msg::Atomic { req: 9, serial: 1, op: AtomicOp::FetchAdd(5), off: 8 },
            Msg::Atomic { req: 9, serial: 1, op: AtomicOp::CompareSwap { current: 1, new: 2 }, off: 16 },
            Msg::Atomic { req: 9, serial: 1, op: AtomicOp::Swap(u64::MAX), off: 0 },
            Msg::Notify { req: 10, serial: 3, n: 1 },
            Msg::Enqueue { req: 11, serial: 5, record: Bytes::from_static(&[1; 32]) },
            Msg::Wake { serial: 12 },
            Msg::Ack { req: u64::MAX },
            Msg::Data { req: 13, start: 99, data: Bytes::from_static(b"xyz") },
            Msg::Value { req: 14, value: 42 },
            Msg::Attached {
                req: 15,
                info: AttachInfo {
                    len: 4096,
                    access: Access::GET | Access::PUT,
                    kind: SegmentKind::Queue { record: 24, capacity: 64 },
                    pid: 1234,
                    fd: 7,
                    nonce: 0xdead_beef,
                    max_message: 1 << 30,
                    rdma: RemoteKey { addr: 0x7f00_0000_1000, rkey: 0x1234 },
                },
            },
            Msg::Revoke { serial: 21 },
            Msg::Released { serial: 22 },
            Msg::Fail { req: 16, error: RmaError::OutOfBounds { offset: 1, len: 2, segment_len: 3 } },
            Msg::Fail {
                req: 17,
                error: RmaError::NotPermitted { needed: Access::ATOMIC, granted: Access::GET | Access::PUT },
            },
            Msg::Fail { req: 18, error: RmaError::Unpublished { id: SegmentId::new(3, 9) } },
            Msg::Fail { req: 18, error: RmaError::QueueFull { id: SegmentId::new(3, 9) } },
            Msg::Fail { req: 19, error: RmaError::RecordSize { len: 3, record: 8 } },
        ]
    }

    #[test]
    fn round_trip() {
        for m in samples() {
            let (tag, payload) = m.encode();
            assert_eq!(Msg::decode(tag, payload), Ok(m.clone()), "{m:?}");
        }
    }

    #[test]
    fn every_truncation_and_extension_is_an_error() {
        for m in samples() {
            let (tag, payload) = m.encode();
            // Puts, data and enqueues carry their bytes to the end: shortening them only shortens
            // the data. Every other message must be exact.
            let open_ended = matches!(m, Msg::Put { .. } | Msg::Data { .. } | Msg::Enqueue { .. });
            let fixed = match &m {
                Msg::Put { data, .. } | Msg::Data { data, .. } => payload.len() - data.len(),
                Msg::Enqueue { record, .. } => payload.len() - record.len(),
                _ => payload.len(),
            };
            for cut in 0..fixed {
                assert!(Msg::decode(tag, payload.slice(..cut)).is_err(), "{m:?} cut to {cut}");
            }
            if !open_ended {
                let mut longer = payload.to_vec();
                longer.push(0);
                assert!(Msg::decode(tag, longer.into()).is_err(), "{m:?} with a trailing byte");
            }
        }
    }

    #[test]
    fn bad_values_are_errors_naming_the_request() {
        let (_, p) = Msg::Ack { req: 5 }.encode();
        assert_eq!(Msg::decode(99, p.clone()), Err((Some(5), "unknown message kind")));
        let mut v = p.to_vec();
        v[0] = VERSION + 1;
        assert_eq!(Msg::decode(ACK, v.into()), Err((None, "unknown version")));
        let (tag, p) = Msg::Atomic { req: 7, serial: 1, op: AtomicOp::Swap(1), off: 0 }.encode();
        let mut v = p.to_vec();
        v[13] = 77;
        assert_eq!(Msg::decode(tag, v.into()), Err((Some(7), "unknown atomic operation")));
        let (tag, p) = Msg::Attached {
            req: 8,
            info: AttachInfo {
                len: 0,
                access: Access::QUEUE,
                kind: SegmentKind::Queue { record: 8, capacity: 3 },
                pid: 1,
                fd: 1,
                nonce: 1,
                max_message: 1,
                rdma: RemoteKey::default(),
            },
        }
        .encode();
        assert_eq!(Msg::decode(tag, p), Err((Some(8), "bad segment kind")), "capacity not a power of two");
    }
}
