//! The segment file of one receiving rank, and the descriptor that tells its peers how to find it.
//!
//! Each rank owns one segment holding the rings its local peers write into (one per peer, in the
//! order of its sorted peer list), its "sleeping" flag and an attach counter. Peers learn about it
//! from the descriptor the rank publishes; everything read from a descriptor or from a peer's
//! segment header is checked before use and reported as a [`ShmError`].

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;

use super::ring::{Line, RING_HDR_LEN, Ring, RingHdr, Std};
use crate::mapping::{Mapping, shared_file_path as segment_path};
use crate::wire::Rank;

/// Why set-up failed; carried inside the `io::Error` the set-up calls return.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShmError {
    /// The job id cannot name a file in /dev/shm.
    #[error("job id {0:?}: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    BadJobId(String),
    /// A peer's descriptor does not decode.
    #[error("descriptor of rank {rank}: {what}")]
    BadDescriptor {
        /// The peer.
        rank: Rank,
        /// What is wrong with it.
        what: &'static str,
    },
    /// A local peer gave no descriptor.
    #[error("no descriptor for local peer {0}")]
    MissingPeer(Rank),
    /// A descriptor for a rank that is not on this host.
    #[error("descriptor for rank {0}, which is not a local peer")]
    UnexpectedPeer(Rank),
    /// Two descriptors for one rank.
    #[error("two descriptors for rank {0}")]
    DuplicatePeer(Rank),
    /// A peer's segment does not hold what its descriptor says.
    #[error("segment of rank {rank} does not match its descriptor: {what}")]
    BadSegment {
        /// The peer.
        rank: Rank,
        /// What does not match.
        what: &'static str,
    },
    /// A peer's process exited during set-up.
    #[error("rank {0} is not running any more")]
    PeerGone(Rank),
    /// Set-up was called outside a tokio runtime.
    #[error("the shared-memory transport must be connected inside a tokio runtime")]
    NoRuntime,
}

impl From<ShmError> for io::Error {
    fn from(e: ShmError) -> io::Error {
        let kind = match e {
            ShmError::BadJobId(_) => io::ErrorKind::InvalidInput,
            ShmError::MissingPeer(_) | ShmError::PeerGone(_) => io::ErrorKind::NotFound,
            ShmError::NoRuntime => io::ErrorKind::Other,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// Smallest and largest ring capacity.
pub(crate) const MIN_CAPACITY: usize = 4096;
pub(crate) const MAX_CAPACITY: usize = 1 << 30;

/// Checks a job id: it becomes part of file and socket names.
pub(crate) fn check_job_id(job: &str) -> Result<(), ShmError> {
    let ok = (1..=64).contains(&job.len())
        && job.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && !job.starts_with('.');
    if ok { Ok(()) } else { Err(ShmError::BadJobId(job.to_owned())) }
}

/// What a rank publishes about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Desc {
    pub rank: Rank,
    pub pid: i32,
    /// The eventfd number in the publishing process.
    pub eventfd: i32,
    pub capacity: usize,
    pub nonce: u64,
    /// Process start time (0: unknown).
    pub start_time: u64,
    /// Address and content of 16 bytes in the publisher's memory: the single-copy probe.
    pub probe_addr: u64,
    pub probe: [u64; 2],
    /// The publisher's local peers (sorted); ring `k` of its segment is written by `slots[k]`.
    pub slots: Vec<Rank>,
}

const DESC_MAGIC: [u8; 8] = *b"FCSHMDSC";
const DESC_VERSION: u32 = 1;
const DESC_FIXED: usize = 80;

impl Desc {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(DESC_FIXED + 4 * self.slots.len());
        b.extend_from_slice(&DESC_MAGIC);
        for v in [DESC_VERSION, self.rank, self.pid as u32, self.eventfd as u32, self.slots.len() as u32, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.capacity as u64, self.nonce, self.start_time, self.probe_addr, self.probe[0], self.probe[1]] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for r in &self.slots {
            b.extend_from_slice(&r.to_le_bytes());
        }
        b
    }

    /// Decodes and checks the descriptor of `rank` as seen by rank `me` in a job of `world` ranks.
    pub(super) fn decode(rank: Rank, b: &[u8], me: Rank, world: u32) -> Result<Desc, ShmError> {
        let bad = |what| ShmError::BadDescriptor { rank, what };
        if b.len() < DESC_FIXED {
            return Err(bad("too short"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        if b[..8] != DESC_MAGIC {
            return Err(bad("not a shared-memory descriptor"));
        }
        if u32_at(8) != DESC_VERSION {
            return Err(bad("unsupported version"));
        }
        if u32_at(12) != rank {
            return Err(bad("published under another rank"));
        }
        let (pid, eventfd, n) = (u32_at(16), u32_at(20), u32_at(24) as usize);
        if pid == 0 || pid > i32::MAX as u32 || eventfd > i32::MAX as u32 {
            return Err(bad("pid or eventfd out of range"));
        }
        if n == 0 || n >= world as usize || b.len() != DESC_FIXED + 4 * n {
            return Err(bad("wrong length or peer count"));
        }
        let capacity = u64_at(32);
        if !capacity.is_power_of_two() || !(MIN_CAPACITY as u64..=MAX_CAPACITY as u64).contains(&capacity) {
            return Err(bad("ring capacity"));
        }
        let slots: Vec<Rank> = (0..n).map(|k| u32_at(DESC_FIXED + 4 * k)).collect();
        if !slots.windows(2).all(|w| w[0] < w[1]) || slots[n - 1] >= world || slots.contains(&rank) {
            return Err(bad("peer list not sorted, out of range or listing itself"));
        }
        if slots.binary_search(&me).is_err() {
            return Err(bad("does not list this rank as a local peer"));
        }
        Ok(Desc {
            rank,
            pid: pid as i32,
            eventfd: eventfd as i32,
            capacity: capacity as usize,
            nonce: u64_at(40),
            start_time: u64_at(48),
            probe_addr: u64_at(56),
            probe: [u64_at(64), u64_at(72)],
            slots,
        })
    }
}

/// Written once by the owner at creation.
#[repr(C, align(128))]
struct Info {
    magic: u64,
    version: u32,
    rank: u32,
    pid: u32,
    n_slots: u32,
    capacity: u64,
    nonce: u64,
}

#[repr(C)]
struct SegHdr {
    info: Info,
    /// The owner sleeps: producers ring its doorbell after publishing.
    sleeping: Line<AtomicU64>,
    /// Peers that have mapped the segment; the one completing the count unlinks the file.
    attached: Line<AtomicU64>,
}

const SEG_MAGIC: u64 = u64::from_le_bytes(*b"FCSHMSEG");
const SEG_VERSION: u32 = 2;
const SEG_HDR_LEN: usize = std::mem::size_of::<SegHdr>();
const _: () = assert!(SEG_HDR_LEN == 384);

/// Where things are in a segment of `n` rings of `cap` bytes.
#[derive(Clone, Copy)]
struct Layout {
    n: usize,
    cap: usize,
    rings: usize,
    total: usize,
}

impl Layout {
    fn new(n: usize, cap: usize) -> Option<Layout> {
        let rings = (SEG_HDR_LEN + 4 * n).div_ceil(128) * 128;
        let total = (RING_HDR_LEN + cap).checked_mul(n)?.checked_add(rings)?;
        Some(Layout { n, cap, rings, total })
    }

    fn ring(&self, k: usize) -> usize {
        self.rings + k * (RING_HDR_LEN + self.cap)
    }
}

/// A mapped segment (ours or a peer's).
pub(crate) struct Segment {
    map: Mapping,
    layout: Layout,
    pub path: PathBuf,
}

impl Segment {
    /// Creates, sizes, maps and initialises this rank's segment.
    pub(super) fn create(path: PathBuf, me: Rank, slots: &[Rank], cap: usize, nonce: u64) -> io::Result<Segment> {
        let layout = Layout::new(slots.len(), cap).ok_or(io::ErrorKind::InvalidInput)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        let seg = (|| {
            file.set_len(layout.total as u64)?;
            let map = Mapping::new(&file, layout.total)?;
            map.populate(0, layout.total);
            Ok::<_, io::Error>(Segment { map, layout, path: path.clone() })
        })();
        let seg = match seg {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let info = Info {
            magic: SEG_MAGIC,
            version: SEG_VERSION,
            rank: me,
            pid: std::process::id(),
            n_slots: slots.len() as u32,
            capacity: cap as u64,
            nonce,
        };
        // SAFETY: the mapping is ours alone until the descriptor is published; the header and the
        // slot table lie inside it (layout) and are suitably aligned (page-aligned mapping).
        unsafe {
            std::ptr::write(seg.map.ptr().cast::<Info>(), info);
            let table = seg.map.ptr().add(SEG_HDR_LEN).cast::<u32>();
            for (k, r) in slots.iter().enumerate() {
                table.add(k).write(*r);
            }
        }
        Ok(seg)
    }

    /// Opens and maps the segment `desc` describes, checking that it is the one described.
    pub(super) fn open(job: &str, desc: &Desc) -> io::Result<Segment> {
        let bad = |what| io::Error::from(ShmError::BadSegment { rank: desc.rank, what });
        let layout = Layout::new(desc.slots.len(), desc.capacity).ok_or_else(|| bad("size"))?;
        let path = segment_path(job, desc.rank, desc.nonce);
        let file: File = OpenOptions::new().read(true).write(true).custom_flags(libc::O_NOFOLLOW).open(&path).map_err(
            |e| match e.kind() {
                io::ErrorKind::NotFound => bad("segment file not found"),
                _ => e,
            },
        )?;
        let meta = file.metadata()?;
        // SAFETY: geteuid has no preconditions.
        if !meta.is_file() || meta.uid() != unsafe { libc::geteuid() } {
            return Err(bad("not a regular file of this user"));
        }
        if meta.len() != layout.total as u64 {
            return Err(bad("size"));
        }
        let map = Mapping::new(&file, layout.total)?;
        // SAFETY: the header lies inside the mapping; `Info` is plain data, written before the
        // descriptor was published.
        let info = unsafe { std::ptr::read_volatile(map.ptr().cast::<Info>()) };
        let want = (SEG_MAGIC, SEG_VERSION, desc.rank, desc.pid as u32, desc.slots.len() as u32);
        if (info.magic, info.version, info.rank, info.pid, info.n_slots) != want
            || info.capacity != desc.capacity as u64
            || info.nonce != desc.nonce
        {
            return Err(bad("header"));
        }
        let seg = Segment { map, layout, path };
        if (0..layout.n).any(|k| seg.slot_rank(k) != desc.slots[k]) {
            return Err(bad("peer table"));
        }
        Ok(seg)
    }

    fn hdr(&self) -> &SegHdr {
        // SAFETY: the mapping starts with a `SegHdr` and lives as long as `self`.
        unsafe { &*self.map.ptr().cast::<SegHdr>() }
    }

    fn slot_rank(&self, k: usize) -> Rank {
        // SAFETY: the slot table lies inside the mapping (layout); it is never written after creation.
        unsafe { std::ptr::read_volatile(self.map.ptr().add(SEG_HDR_LEN).cast::<u32>().add(k)) }
    }

    /// The owner's sleeping flag.
    pub(super) fn sleeping(&self) -> &AtomicU64 {
        &self.hdr().sleeping.0
    }

    /// Counts one more peer as attached; true when that completes the set.
    pub(super) fn attach(&self) -> bool {
        let n = self.hdr().attached.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
        n == self.layout.n as u64
    }

    /// Whether every peer has attached.
    pub(super) fn all_attached(&self) -> bool {
        self.hdr().attached.0.load(std::sync::atomic::Ordering::Acquire) >= self.layout.n as u64
    }

    /// Ring `k` (written by the segment owner's `k`-th peer).
    pub(super) fn ring(&self, k: usize) -> Ring<Std> {
        assert!(k < self.layout.n);
        let off = self.layout.ring(k);
        // SAFETY: header and data lie inside the mapping, which outlives every `Ring` taken from
        // it (the owner of the `Segment` drops the rings first).
        unsafe {
            let base = self.map.ptr().add(off);
            let data = base.add(RING_HDR_LEN);
            // The data is 8-byte aligned (page-aligned mapping, 512-byte header), so its words
            // are the ring's atomic words.
            Ring::new(base.cast::<RingHdr<AtomicU64>>(), data, data.cast::<AtomicU64>(), self.layout.cap)
        }
    }

    /// Pre-faults ring `k` for writing.
    pub(super) fn populate_ring(&self, k: usize) {
        self.map.populate(self.layout.ring(k), RING_HDR_LEN + self.layout.cap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> Desc {
        Desc {
            rank: 1,
            pid: 42,
            eventfd: 7,
            capacity: 1 << 16,
            nonce: 99,
            start_time: 5,
            probe_addr: 0x1000,
            probe: [1, 2],
            slots: vec![0, 2, 3],
        }
    }

    #[test]
    fn descriptor_round_trips() {
        let d = desc();
        assert_eq!(Desc::decode(1, &d.encode(), 0, 4), Ok(d));
    }

    #[test]
    fn bad_descriptors_are_typed_errors() {
        let good = desc().encode();
        let bad = |b: &[u8], rank, me, world| Desc::decode(rank, b, me, world).unwrap_err();
        assert!(matches!(bad(&good[..10], 1, 0, 4), ShmError::BadDescriptor { what: "too short", .. }));
        assert!(matches!(bad(&good, 2, 0, 4), ShmError::BadDescriptor { .. }), "wrong rank");
        assert!(matches!(bad(&good, 1, 1, 4), ShmError::BadDescriptor { .. }), "does not list me");
        assert!(matches!(bad(&good, 1, 0, 3), ShmError::BadDescriptor { .. }), "slot out of range");
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(bad(&b, 1, 0, 4), ShmError::BadDescriptor { .. }), "length");
        let mut b = good.clone();
        b[32] = 3;
        assert!(matches!(bad(&b, 1, 0, 4), ShmError::BadDescriptor { what: "ring capacity", .. }));
        let d = Desc { slots: vec![2, 0, 3], ..desc() };
        assert!(matches!(bad(&d.encode(), 1, 0, 4), ShmError::BadDescriptor { .. }), "unsorted");
        // Random bytes never panic.
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in 0..400 {
            let v: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = Desc::decode(1, &v, 0, 4);
            let mut w = good.clone();
            let i = (x as usize) % w.len();
            w[i] ^= (x >> 8) as u8 | 1;
            let _ = Desc::decode(1, &w, 0, 4);
        }
    }

    #[test]
    fn job_ids() {
        assert!(check_job_id("job-1.a_B").is_ok());
        for bad in ["", "a/b", "..", ".hidden", "a b", &"x".repeat(65)] {
            assert!(check_job_id(bad).is_err(), "{bad:?}");
        }
    }
}
