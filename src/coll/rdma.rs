//! All-gather and all-to-all by RDMA writes ([`Algorithm::Rdma`]), when every member is reached
//! over verbs: each rank RDMA-writes its blocks from the caller's send buffer straight into the
//! peers' result buffers (the caller's memory, registered with the device; nothing is staged or
//! copied out), then sends each peer a completion flag (an empty message on the call's tag). A
//! rank's result is in place once every peer's flag has arrived: a flag is sent only after that
//! peer's write completed (RC: the responder has placed the data).
//!
//! * **Ready, and the exchange.** A peer may write into a rank's result buffer only while the
//!   rank is inside the call (before, the caller may still be reading the previous result; after,
//!   the memory is the caller's again), so each rank first sends every peer a ready message. The
//!   first one on a communicator, and the first after the caller passes another result buffer,
//!   carries the buffer's address, length and key (the exchange); while the same buffer comes
//!   back, the registration is kept (per communicator) and the ready message carries only its
//!   generation, which the peer checks against the exchange it holds.
//! * **A kept registration can go stale.** If the program frees a result buffer and a new one
//!   takes the same addresses with other pages, the kept registration still points at the old
//!   pages. So a call that reuses a registration first writes a random canary word into every
//!   page of the peers' blocks (which the peers overwrite): a canary still seen after the flags
//!   means the device wrote elsewhere; those blocks are then read back through the registration
//!   (the device's loopback connection) and the registration is dropped. A buffer whose blocks do
//!   not fall on 8-byte boundaries is registered for the one call only.
//! * **Send buffers** are registered for the one call (all-to-all: the caller's data where it is
//!   when the future borrows it, else the call's copy; all-gather: the own block, which the
//!   caller's result buffer holds already): the device reads them, and a stale read could not be
//!   detected by the sender.
//! * **Order.** A communicator's RDMA calls run one at a time, in call order (each waits for the
//!   previous one to finish or be dropped): they share the kept registration. Calls held together
//!   must all be polled (`join!`): awaiting a later call alone, before an earlier one ran, waits.
//! * **Failures.** A lost peer fails the writes to it and the waits for its messages; a revoked
//!   communicator fails the call when made, as on every path. A call dropped before its end
//!   deregisters its result buffer at once (a peer's late write then fails on its side instead of
//!   landing in memory the caller owns again).

use std::sync::Arc;

use ferrocomm_transports::one_sided::RemoteKey;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::run::Slot;
use super::*;
use crate::World;

/// Canaries are checked per page of this size (a larger page holds several: checked alike).
const PAGE: usize = 4096;

/// What a call does with the source: the same block to every peer (all-gather) or block `j` to
/// peer `j` (all-to-all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Allgather,
    Alltoall,
}

/// Where an all-to-all's blocks come from.
pub(super) enum Source {
    /// All-gather: the own block, in the result buffer already.
    OwnBlock,
    /// The caller's data, borrowed by the call's future for its whole life.
    Borrowed(Lent),
    /// A copy the call owns (the future does not borrow the caller's data).
    Owned(Bytes),
}

/// The caller's data, borrowed for the call: its future holds the borrow until it ends
/// (`lending_in_place`).
pub(super) struct Lent {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a shared borrow of plain bytes, held by the future that carries this.
unsafe impl Send for Lent {}

impl Lent {
    /// # Safety
    /// `data` stays borrowed (unchanged, allocated) for as long as the call's future lives.
    pub(super) unsafe fn new(data: &[u8]) -> Lent {
        Lent { ptr: data.as_ptr(), len: data.len() }
    }
}

/// A communicator's RDMA tier: its kept registration, the peers' exchanges and the order of its
/// calls.
#[derive(Default)]
pub(crate) struct RdmaState {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// Calls made so far and the previous call's end.
    order: Mutex<(u64, Option<oneshot::Receiver<()>>)>,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// This rank's result buffer's registration, kept between calls while the buffer is reused.
    recv: Option<Registration>,
    /// Generations handed out (a new registration takes the next).
    generations: u64,
    /// What each member (by communicator rank) announced last.
    peers: Vec<Option<Announced>>,
}

/// A member's result buffer, as it announced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Announced {
    generation: u64,
    key: RemoteKey,
    len: usize,
}

/// Memory of the caller's registered with the device; deregistered when dropped.
struct Registration {
    world: World,
    handle: u64,
    key: RemoteKey,
    addr: usize,
    len: usize,
    generation: u64,
    /// Every member has this registration's exchange.
    announced: bool,
}

impl Registration {
    /// # Safety
    /// The memory stays allocated while the registration exists.
    unsafe fn new(world: &World, ptr: *mut u8, len: usize, remote: bool) -> Result<Registration> {
        // SAFETY: the caller keeps the memory allocated while the registration exists (its drop
        // deregisters).
        let Some((handle, key)) = (unsafe { world.device_register(ptr, len, remote) }) else {
            return Err(CollError::Invalid("the device refused to register an RDMA collective's buffer".into()).into());
        };
        Ok(Registration { world: world.clone(), handle, key, addr: ptr as usize, len, generation: 0, announced: false })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.world.device_deregister(self.handle);
    }
}

/// A call's place in the RDMA order, taken when the call is made.
pub(super) struct Turn {
    prev: Option<oneshot::Receiver<()>>,
    /// Dropped when the call ends (or is dropped): the next call may go.
    _done: oneshot::Sender<()>,
    shared: Arc<Shared>,
}

impl RdmaState {
    /// The next call's turn.
    pub(super) fn turn(&self) -> Turn {
        let (tx, rx) = oneshot::channel();
        let mut order = self.shared.order.lock();
        order.0 += 1;
        let prev = order.1.replace(rx);
        Turn { prev, _done: tx, shared: self.shared.clone() }
    }
}

/// The ready message: the generation alone, or with the buffer's address, key and length.
fn ready(reg: &Registration) -> Bytes {
    let mut m = Vec::with_capacity(28);
    m.extend_from_slice(&reg.generation.to_le_bytes());
    if !reg.announced {
        m.extend_from_slice(&reg.key.addr.to_le_bytes());
        m.extend_from_slice(&reg.key.rkey.to_le_bytes());
        m.extend_from_slice(&(reg.len as u64).to_le_bytes());
    }
    Bytes::from(m)
}

/// Decodes peer `from`'s ready message against what it announced before.
fn read_ready(from: u32, m: &[u8], before: Option<Announced>) -> Result<Announced> {
    let word = |k: usize, w: usize| m.get(k..k + w).map(|b| b.iter().rev().fold(0u64, |a, &x| (a << 8) | x as u64));
    let bad = |why| -> Error { CollError::Malformed { from, why }.into() };
    match m.len() {
        8 => {
            let generation = word(0, 8).expect("8 bytes");
            before.filter(|b| b.generation == generation).ok_or_else(|| bad("RDMA ready for a buffer never announced"))
        }
        28 => {
            let (generation, addr, rkey, len) =
                (word(0, 8).expect("28"), word(8, 8).expect("28"), word(16, 4).expect("28"), word(20, 8).expect("28"));
            let len = usize::try_from(len).map_err(|_| bad("RDMA buffer length"))?;
            Ok(Announced { generation, key: RemoteKey { addr, rkey: rkey as u32 }, len })
        }
        _ => Err(bad("RDMA ready message")),
    }
}

/// The page pieces of the peers' blocks in a buffer at `base` (absolute address) of `n` blocks of
/// `block` bytes: (offset in the buffer, length).
fn pieces(base: usize, n: usize, r: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n).filter(move |&j| j != r).flat_map(move |j| {
        let (start, end) = (j * block, (j + 1) * block);
        let mut at = start;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let next_page = ((base + at) / PAGE + 1) * PAGE - base;
                let piece = (at, next_page.min(end) - at);
                at = next_page.min(end);
                piece
            })
        })
    })
}

/// A random word (not zero).
fn canary() -> u64 {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    u64::from_ne_bytes(b) | 1
}

/// Runs one call: every peer's block lands at `out[j * block..]` (this rank's own block is
/// there already: the caller placed it). All-to-all: `src` holds the `n` blocks in rank order.
pub(super) async fn run(slot: Slot, turn: Turn, shape: Shape, src: Source, block: usize, out: &mut [u8]) -> Result<()> {
    let Slot { comm, seq, refused, .. } = slot;
    if let Some(e) = refused.or_else(|| comm.revoked()) {
        return Err(e);
    }
    let Turn { prev, _done, shared } = turn;
    if let Some(prev) = prev {
        // Either way the previous call is over (ended, or dropped).
        let _ = prev.await;
    }
    let (r, n) = (comm.rank() as usize, comm.size() as usize);
    if block == 0 || n < 2 {
        return Ok(());
    }
    let tag = |round: u64| (seq << 16) | round;
    let world = comm.world();
    // Addresses as numbers: the future holds no raw pointer across its awaits.
    let (base, len) = (out.as_mut_ptr() as usize, out.len());
    // Kept across calls only where every page piece of a peer's block holds a canary word.
    let keepable = base.is_multiple_of(8) && block.is_multiple_of(8);

    // This rank's result buffer: the kept registration if the caller passed the same one.
    let (mut recv, reused) = {
        let mut kept = shared.kept.lock();
        kept.peers.resize(n, None);
        match kept.recv.take() {
            Some(k) if k.addr == base && k.len == len => (k, true),
            old => {
                drop(old);
                kept.generations += 1;
                // SAFETY: `out` is borrowed by this future; the registration is dropped (the
                // memory deregistered) before the borrow ends, unless the call completes, after
                // which it is kept only as long as the canaries vouch for it and no peer writes
                // into it outside a call of this rank's.
                let mut reg = unsafe { Registration::new(&world, base as *mut u8, len, true)? };
                reg.generation = kept.generations;
                (reg, false)
            }
        }
    };
    let guard = if reused && keepable { canary() } else { 0 };
    if guard != 0 {
        for (at, _) in pieces(base, n, r, block) {
            out[at..at + 8].copy_from_slice(&guard.to_ne_bytes());
        }
    }

    // The send side, registered for this call.
    let owned;
    // (address, length) of the send side; block `j` sits at `j * block` in it (all-to-all), or
    // it is the one block (all-gather).
    let (sptr, slen) = match (&src, shape) {
        (Source::OwnBlock, _) => (base + r * block, block),
        (Source::Borrowed(l), Shape::Alltoall) => (l.ptr as usize, l.len),
        (Source::Owned(b), Shape::Alltoall) => (b.as_ptr() as usize, b.len()),
        _ => return Err(CollError::Invalid("an RDMA all-gather sends its own block from the result".into()).into()),
    };
    if shape == Shape::Alltoall && slen < n * block {
        return Err(CollError::Invalid("an RDMA all-to-all with fewer bytes than blocks".into()).into());
    }
    // SAFETY: the source is borrowed (or owned: `src`) by this future and outlives `send`, which
    // is declared after it and so dropped first. A read-only source (which the device may refuse
    // with local write access) falls back to a copy.
    let send = match unsafe { Registration::new(&world, sptr as *mut u8, slen, false) } {
        Ok(s) => s,
        Err(_) => {
            owned = Bytes::copy_from_slice(
                // SAFETY: as above: `slen` bytes at `sptr`, borrowed for the call.
                unsafe { std::slice::from_raw_parts(sptr as *const u8, slen) },
            );
            // SAFETY: `owned` lives until the end of this function, after `send`.
            unsafe { Registration::new(&world, owned.as_ptr().cast_mut(), owned.len(), false)? }
        }
    };

    // Ready to every peer; each peer's block goes once its ready arrived, then its flag.
    let hello = ready(&recv);
    let peers = || (0..n).filter(move |&j| j != r);
    let readies: Vec<_> = peers().map(|j| comm.send(j as Rank, tag(1), hello.clone())).collect();
    let (world_ref, send_ref, kept_ref) = (&world, &send, &shared.kept);
    let writes: Vec<_> = peers()
        .map(|j| {
            let comm = comm.clone();
            async move {
                let m = comm.recv(j as Rank, tag(1)).await?;
                let before = kept_ref.lock().peers[j];
                let a = read_ready(j as u32, &m.data, before)?;
                kept_ref.lock().peers[j] = Some(a);
                if a.len < (r + 1) * block {
                    return Err(
                        CollError::Malformed { from: j as u32, why: "RDMA buffer shorter than the call" }.into()
                    );
                }
                let Some(addr) = a.key.addr.checked_add((r * block) as u64) else {
                    return Err(CollError::Malformed { from: j as u32, why: "RDMA buffer address overflows" }.into());
                };
                let to = RemoteKey { addr, rkey: a.key.rkey };
                let off = if shape == Shape::Alltoall { j * block } else { 0 };
                world_ref.device_write(comm.world_rank(j as Rank), send_ref.handle, off, block, to).await?;
                comm.send(j as Rank, tag(2), Bytes::new()).await?;
                Ok::<_, Error>(())
            }
        })
        .collect();
    let flags: Vec<_> = peers().map(|j| comm.recv(j as Rank, tag(2))).collect();
    futures::future::try_join3(
        futures::future::try_join_all(readies),
        futures::future::try_join_all(writes),
        futures::future::try_join_all(flags),
    )
    .await?;
    drop(send);
    recv.announced = true;

    // A kept registration the device no longer shares the pages of: read back what the peers
    // wrote into the old pages, and do not keep it.
    let mut keep = keepable;
    if guard != 0 {
        let stale: Vec<(usize, usize)> =
            pieces(base, n, r, block).filter(|&(at, _)| out[at..at + 8] == guard.to_ne_bytes()).collect();
        if !stale.is_empty() {
            tracing::debug!(pages = stale.len(), "an RDMA collective's kept registration was stale; re-reading");
            keep = false;
            for (at, piece) in stale {
                let key = RemoteKey { addr: recv.key.addr + at as u64, rkey: recv.key.rkey };
                let got = world.device_read_own(key, piece).await?;
                out[at..at + piece].copy_from_slice(&got);
            }
        }
    }
    if keep {
        shared.kept.lock().recv = Some(recv);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_peer_blocks_at_pages() {
        // Buffer at 4000 (absolute), 3 blocks of 200 bytes, rank 1: blocks 0 and 2.
        let p: Vec<_> = pieces(4000, 3, 1, 200).collect();
        assert_eq!(p, vec![(0, 96), (96, 104), (400, 200)]);
        // Every byte of the peers' blocks is in exactly one piece.
        let p: Vec<_> = pieces(PAGE - 8, 4, 2, 3 * PAGE).collect();
        let total: usize = p.iter().map(|&(_, l)| l).sum();
        assert_eq!(total, 3 * 3 * PAGE);
        assert!(p.iter().all(|&(at, l)| l > 0 && (PAGE - 8 + at) / PAGE == (PAGE - 8 + at + l - 1) / PAGE));
    }

    #[test]
    fn ready_messages_decode_and_check() {
        let a = Announced { generation: 7, key: RemoteKey { addr: 0x1234_5678_9abc, rkey: 0xdead_beef }, len: 1 << 20 };
        let mut m = Vec::new();
        m.extend_from_slice(&7u64.to_le_bytes());
        m.extend_from_slice(&a.key.addr.to_le_bytes());
        m.extend_from_slice(&a.key.rkey.to_le_bytes());
        m.extend_from_slice(&(1u64 << 20).to_le_bytes());
        assert_eq!(read_ready(3, &m, None).unwrap(), a);
        // The short form: only for the generation announced before.
        assert_eq!(read_ready(3, &7u64.to_le_bytes(), Some(a)).unwrap(), a);
        assert!(read_ready(3, &8u64.to_le_bytes(), Some(a)).is_err());
        assert!(read_ready(3, &7u64.to_le_bytes(), None).is_err());
        assert!(read_ready(3, &m[..20], None).is_err());
    }
}
