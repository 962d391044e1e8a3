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
//!   communicator fails the call when made, as on every path.
//! * **Refusals.** A rank whose part cannot start (the device refuses its buffers, its buffers do
//!   not fit the call) sends every peer a refusal in place of its ready message, and a rank that
//!   leaves a call after its ready went out (its future dropped, or the call failed there: a peer
//!   refused, a write failed) sends each peer it has not flagged a flag that says so, naming the
//!   rank whose refusal ended the call (itself when dropped). A rank whose blocks are of another
//!   length than a peer's is refused by that peer (the ready message carries the block length).
//!   So every member's call fails at once with `CollError::Refused` naming the rank at fault,
//!   instead of waiting for messages that never come; the wire forms are [`Ready`] and [`flag`].
//! * **Early ends leave the connections sound.** Peers write into a result buffer only after its
//!   ready message and before its flags are all in, so a call that ends early after its ready
//!   went out may still receive writes: its registration is not deregistered then (a write to a
//!   dead key would fail the writer's queue pair, and the connection with it) but retired, with
//!   the call's own memory (an owned call's result vector, the send copy), and released when a
//!   later call of the communicator completes. By then every peer's writes for the earlier call
//!   have landed: a peer posts a call's writes before the next call's on the same connection
//!   (calls run in order), RC delivers them in order, and the later call's flags come after its
//!   writes. The send registration goes at once: the transport keeps it until the writes posted
//!   from it complete. A late write therefore lands only in memory the call lent: a result
//!   buffer of the caller's (`allgather_into`, `alltoall_into`) whose call was dropped may take
//!   the peers' writes for that call until the next RDMA call completes, and the next call's
//!   result is right (its writes land after them). Between completed calls no peer has a write
//!   left to make: the kept registration stays writable, to the members only (its key goes to
//!   them alone), whom the job trusts as it trusts their messages.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    /// Result buffers' registrations of calls that ended early (dropped or failed) after their
    /// ready messages went out, and memory of such calls that the device or a peer may still
    /// use: kept until a later call completes (see the module documentation).
    retired: Vec<Registration>,
    retired_memory: Vec<Box<dyn Send>>,
}

/// A member's result buffer, as it announced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Announced {
    generation: u64,
    key: RemoteKey,
    len: usize,
}

/// Memory of the caller's registered with the device; deregistered when dropped (the transport
/// keeps it until the writes posted from it complete).
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
    unsafe fn new(world: &World, ptr: *mut u8, len: usize, remote: bool) -> Option<Registration> {
        // SAFETY: the caller keeps the memory allocated while the registration exists (its drop
        // deregisters).
        let (handle, key) = unsafe { world.device_register(ptr, len, remote) }?;
        Some(Registration {
            world: world.clone(),
            handle,
            key,
            addr: ptr as usize,
            len,
            generation: 0,
            announced: false,
        })
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

    /// Holds an owned call's result vector (`allgather`, `alltoall` by RDMA): if the call ends
    /// early, the vector is retired with the call's registration instead of freed, so that a
    /// peer's late write for it lands in memory nobody uses.
    pub(super) fn hold<T: Send + 'static>(&self, v: Vec<T>) -> HeldResult<T> {
        HeldResult { v: Some(v), shared: Some(self.shared.clone()) }
    }
}

/// An owned result vector ([`RdmaState::hold`]), or a plain one (`shared` `None`).
pub(super) struct HeldResult<T: Send + 'static> {
    v: Option<Vec<T>>,
    shared: Option<Arc<Shared>>,
}

impl<T: Send + 'static> HeldResult<T> {
    /// A vector of a call that does not go by RDMA: freed as usual.
    pub(super) fn plain(v: Vec<T>) -> HeldResult<T> {
        HeldResult { v: Some(v), shared: None }
    }

    /// The vector, once its call has completed.
    pub(super) fn into_inner(mut self) -> Vec<T> {
        self.v.take().expect("held until taken")
    }

    pub(super) fn get(&mut self) -> &mut Vec<T> {
        self.v.as_mut().expect("held until taken")
    }
}

impl<T: Send + 'static> Drop for HeldResult<T> {
    fn drop(&mut self) {
        if let (Some(v), Some(shared)) = (self.v.take(), &self.shared) {
            shared.kept.lock().retired_memory.push(Box::new(v));
        }
    }
}

/// Why a rank cannot take part in a call, as its refusal carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// The device refused to register its buffers.
    Register = 1,
    /// Its buffers do not fit the call (a length or count mismatch).
    Length = 2,
    /// It left the call: its future was dropped, or the call failed at its side.
    Left = 3,
    /// Its blocks are of another length than the reporting rank's.
    OtherLength = 4,
}

impl Refusal {
    fn from_code(code: u8) -> Option<Refusal> {
        match code {
            1 => Some(Refusal::Register),
            2 => Some(Refusal::Length),
            3 => Some(Refusal::Left),
            4 => Some(Refusal::OtherLength),
            _ => None,
        }
    }

    fn why(self) -> &'static str {
        match self {
            Refusal::Register => "the device refused to register its buffers",
            Refusal::Length => "its buffers do not fit the call",
            Refusal::Left => "it left the call (its future was dropped, or the call failed there)",
            Refusal::OtherLength => "its blocks are of another length than this rank's",
        }
    }

    fn error(self, rank: u32) -> CollError {
        CollError::Refused { rank, why: self.why() }
    }

    /// The refusal behind a call's error, with the rank it names.
    fn behind(e: &Error) -> Option<(u32, Refusal)> {
        let Error::Collective(CollError::Refused { rank, why }) = e else { return None };
        let all = [Refusal::Register, Refusal::Length, Refusal::Left, Refusal::OtherLength];
        all.into_iter().find(|r| r.why() == *why).map(|r| (*rank, r))
    }
}

/// A rank's ready message (round 1 of a call), on the wire: a kind byte, then little-endian
/// fields. Refusal: `[0, code]`; known buffer: `[1, generation u64, block u64]`; exchange:
/// `[2, generation u64, block u64, addr u64, rkey u32, len u64]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ready {
    /// The sender cannot take part.
    Refuse(Refusal),
    /// The sender's result buffer is the one it announced with `generation`.
    Known { generation: u64, block: u64 },
    /// The sender's result buffer, announced anew.
    Exchange { generation: u64, block: u64, key: RemoteKey, len: u64 },
}

impl Ready {
    const KNOWN_LEN: usize = 17;
    const EXCHANGE_LEN: usize = 37;

    fn encode(self) -> Bytes {
        let mut m = Vec::with_capacity(Ready::EXCHANGE_LEN);
        match self {
            Ready::Refuse(why) => m.extend_from_slice(&[0, why as u8]),
            Ready::Known { generation, block } => {
                m.push(1);
                m.extend_from_slice(&generation.to_le_bytes());
                m.extend_from_slice(&block.to_le_bytes());
            }
            Ready::Exchange { generation, block, key, len } => {
                m.push(2);
                m.extend_from_slice(&generation.to_le_bytes());
                m.extend_from_slice(&block.to_le_bytes());
                m.extend_from_slice(&key.addr.to_le_bytes());
                m.extend_from_slice(&key.rkey.to_le_bytes());
                m.extend_from_slice(&len.to_le_bytes());
            }
        }
        Bytes::from(m)
    }

    /// Decodes peer `from`'s ready message: anything but one of the three forms, exactly, is
    /// malformed.
    fn decode(from: u32, m: &[u8]) -> std::result::Result<Ready, CollError> {
        let bad = |why| CollError::Malformed { from, why };
        let u64_at = |k: usize| m.get(k..k + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        match (m.first(), m.len()) {
            (Some(0), 2) => Refusal::from_code(m[1]).map(Ready::Refuse).ok_or(bad("RDMA refusal of unknown reason")),
            (Some(1), Ready::KNOWN_LEN) => {
                let (Some(generation), Some(block)) = (u64_at(1), u64_at(9)) else { unreachable!("17 bytes") };
                Ok(Ready::Known { generation, block })
            }
            (Some(2), Ready::EXCHANGE_LEN) => {
                let (Some(generation), Some(block), Some(addr), Some(len)) =
                    (u64_at(1), u64_at(9), u64_at(17), u64_at(29))
                else {
                    unreachable!("37 bytes")
                };
                let rkey = u32::from_le_bytes(m[25..29].try_into().expect("4 bytes"));
                Ok(Ready::Exchange { generation, block, key: RemoteKey { addr, rkey }, len })
            }
            (Some(0..=2), _) => Err(bad("RDMA ready message of the wrong length")),
            _ => Err(bad("RDMA ready message of unknown kind")),
        }
    }
}

/// This rank's ready message for its result buffer's registration.
fn ready(reg: &Registration, block: usize) -> Ready {
    let (generation, block) = (reg.generation, block as u64);
    if reg.announced {
        Ready::Known { generation, block }
    } else {
        Ready::Exchange { generation, block, key: reg.key, len: reg.len as u64 }
    }
}

/// Where this rank (`me`) writes its block of `block` bytes for peer `from`, from that peer's
/// ready message `m` and what it announced before; with what the peer holds announced now.
fn target(
    from: usize,
    m: &[u8],
    before: Option<Announced>,
    me: usize,
    block: usize,
) -> std::result::Result<(RemoteKey, Announced), CollError> {
    let bad = |why| CollError::Malformed { from: from as u32, why };
    let (a, theirs) = match Ready::decode(from as u32, m)? {
        Ready::Refuse(why) => return Err(why.error(from as u32)),
        Ready::Known { generation, block } => {
            let a =
                before.filter(|b| b.generation == generation).ok_or(bad("RDMA ready for a buffer never announced"))?;
            (a, block)
        }
        Ready::Exchange { generation, block, key, len } => {
            let len = usize::try_from(len).map_err(|_| bad("RDMA buffer length"))?;
            (Announced { generation, key, len }, block)
        }
    };
    if theirs != block as u64 {
        return Err(Refusal::OtherLength.error(from as u32));
    }
    if me.checked_add(1).and_then(|k| k.checked_mul(block)).is_none_or(|end| a.len < end) {
        return Err(bad("RDMA buffer shorter than the call"));
    }
    let addr = a.key.addr.checked_add((me * block) as u64).ok_or(bad("RDMA buffer address overflows"))?;
    Ok((RemoteKey { addr, rkey: a.key.rkey }, a))
}

/// A flag that says the sender left the call: the refusal that made it leave and the rank that
/// refused (itself, when its future was dropped), `[code, rank u32]`.
fn left_flag(cause: (u32, Refusal)) -> Bytes {
    let mut m = vec![cause.1 as u8];
    m.extend_from_slice(&cause.0.to_le_bytes());
    Bytes::from(m)
}

/// A peer's completion flag (round 2 of a call) in a call of `n` ranks: empty when its write
/// into this rank's buffer is done; a refusal and the rank it names when it left the call
/// instead ([`left_flag`]).
fn flag(from: usize, m: &[u8], n: usize) -> std::result::Result<(), CollError> {
    let bad = |why| CollError::Malformed { from: from as u32, why };
    match m {
        [] => Ok(()),
        [code, rank @ ..] if rank.len() == 4 => {
            let why = Refusal::from_code(*code).ok_or(bad("RDMA completion flag of unknown reason"))?;
            let rank = u32::from_le_bytes(rank.try_into().expect("4 bytes"));
            if rank as usize >= n {
                return Err(bad("RDMA completion flag naming no member"));
            }
            Err(why.error(rank))
        }
        _ => Err(bad("RDMA completion flag")),
    }
}

/// What a call that ends early (dropped, failed or refused) owes its peers and leaves behind.
/// Before its ready messages went out it sends every peer a refusal (`why`) in their place; after,
/// it sends every peer it has not flagged a flag that says it left, naming the rank whose refusal
/// made it leave (itself when dropped); either way each peer's call fails at once with
/// [`CollError::Refused`] instead of waiting for it. After the ready messages, the result
/// buffer's registration and the call's own memory are retired (kept until a later call
/// completes): peers may still write into them, and the device read from them.
struct Leftovers {
    comm: Arc<Comm>,
    shared: Arc<Shared>,
    seq: u64,
    /// The refusal sent in place of the ready messages.
    why: Refusal,
    /// What the flags of an early end say: the refusal that ended the call, and whose.
    cause: Option<(u32, Refusal)>,
    /// The ready messages went out.
    exposed: bool,
    /// By peer: this rank's flag went to it.
    flagged: Vec<AtomicBool>,
    recv: Option<Registration>,
    memory: Vec<Box<dyn Send>>,
    /// The call completed: nothing is owed.
    finished: bool,
}

impl Leftovers {
    /// A call's state before its ready messages go out: nothing exposed, flagged or kept yet.
    fn new(comm: Arc<Comm>, shared: Arc<Shared>, seq: u64, why: Refusal) -> Leftovers {
        let n = comm.size() as usize;
        Leftovers {
            comm,
            shared,
            seq,
            why,
            cause: None,
            exposed: false,
            flagged: (0..n).map(|_| AtomicBool::new(false)).collect(),
            recv: None,
            memory: Vec::new(),
            finished: false,
        }
    }

    /// Ends the call early with `e`, the peers told `why`.
    fn fail(mut self, why: Refusal, e: Error) -> Result<()> {
        self.why = why;
        Err(e)
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let (r, n) = (self.comm.rank() as usize, self.comm.size() as usize);
        let me = (self.comm.rank(), Refusal::Left);
        let (round, m) =
            if self.exposed { (2, left_flag(self.cause.unwrap_or(me))) } else { (1, Ready::Refuse(self.why).encode()) };
        for j in (0..n).filter(|&j| j != r && !self.flagged.get(j).is_some_and(|f| f.load(Ordering::Acquire))) {
            // Sent in the background: a message that goes at once completes without its future.
            drop(self.comm.send(j as Rank, (self.seq << 16) | round, m.clone()));
        }
        // Before the ready messages nothing was posted against them: dropped with `self`.
        if self.exposed {
            let mut kept = self.shared.kept.lock();
            kept.retired.extend(self.recv.take());
            kept.retired_memory.append(&mut self.memory);
        }
    }
}

/// Refuses a call whose set-up failed before it ran (buffers that do not fit it): its peers fail
/// with [`CollError::Refused`] naming this rank; this rank's call fails with `e`.
pub(super) async fn refuse(slot: Slot, turn: Turn, why: Refusal, e: Error) -> Result<()> {
    let Slot { comm, seq, .. } = slot;
    let Turn { prev, _done, shared } = turn;
    let left = Leftovers::new(comm, shared, seq, why);
    // The refusals go now; the next call still waits for the one before this.
    let refused = left.fail(why, e);
    if let Some(prev) = prev {
        let _ = prev.await;
    }
    refused
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
    let (r, n) = (comm.rank() as usize, comm.size() as usize);
    let Turn { prev, _done, shared } = turn;
    if block == 0 || n < 2 {
        if let Some(prev) = prev {
            let _ = prev.await;
        }
        return Ok(());
    }
    // From here, an early end (a drop included) tells the peers.
    let mut left = Leftovers::new(comm.clone(), shared.clone(), seq, Refusal::Left);
    if let Some(prev) = prev {
        // Either way the previous call is over (ended, or dropped).
        let _ = prev.await;
    }
    let tag = |round: u64| (seq << 16) | round;
    let world = comm.world();
    // Addresses as numbers: the future holds no raw pointer across its awaits.
    let (base, len) = (out.as_mut_ptr() as usize, out.len());
    // Kept across calls only where every page piece of a peer's block holds a canary word.
    let keepable = base.is_multiple_of(8) && block.is_multiple_of(8);
    let refused_device =
        || Error::from(CollError::Invalid("the device refused to register an RDMA collective's buffer".into()));

    // (address, length) of the send side; block `j` sits at `j * block` in it (all-to-all), or
    // it is the one block (all-gather).
    let (sptr, slen) = match (&src, shape) {
        (Source::OwnBlock, _) => (base + r * block, block),
        (Source::Borrowed(l), Shape::Alltoall) => (l.ptr as usize, l.len),
        (Source::Owned(b), Shape::Alltoall) => (b.as_ptr() as usize, b.len()),
        _ => {
            let e = CollError::Invalid("an RDMA all-gather sends its own block from the result".into());
            return left.fail(Refusal::Length, e.into());
        }
    };
    let fits = |need: Option<usize>, have: usize| need.is_some_and(|need| need <= have);
    if !fits(n.checked_mul(block), len) || (shape == Shape::Alltoall && !fits(n.checked_mul(block), slen)) {
        let e = CollError::Invalid("an RDMA collective's buffers are shorter than its blocks".into());
        return left.fail(Refusal::Length, e.into());
    }
    if let Source::Owned(b) = src {
        // The device may read it after an early end: retired with the call then.
        left.memory.push(Box::new(b));
    }

    // This rank's result buffer: the kept registration if the caller passed the same one.
    let (recv, reused) = {
        let mut kept = shared.kept.lock();
        kept.peers.resize(n, None);
        match kept.recv.take() {
            Some(k) if k.addr == base && k.len == len => (Some(k), true),
            old => {
                drop(old);
                kept.generations += 1;
                // SAFETY: `out` is borrowed by this future; the registration is retired (kept
                // with the communicator until a later call completes) if the call ends early
                // after the peers learnt of it, deregistered before the borrow ends otherwise,
                // and kept after a completed call only as long as the canaries vouch for it.
                let reg = unsafe { Registration::new(&world, base as *mut u8, len, true) };
                (reg.map(|mut reg| (reg.generation = kept.generations, reg).1), false)
            }
        }
    };
    let Some(recv) = recv else { return left.fail(Refusal::Register, refused_device()) };
    let guard = if reused && keepable { canary() } else { 0 };
    if guard != 0 {
        for (at, _) in pieces(base, n, r, block) {
            out[at..at + 8].copy_from_slice(&guard.to_ne_bytes());
        }
    }

    // The send side, registered for this call. SAFETY: the source is borrowed (or owned: in
    // `left`) by this future; the device only reads it, and the transport keeps the registration
    // (which pins its pages) until the writes from it complete. A read-only source (which the
    // device may refuse with local write access) falls back to a copy.
    let send = match unsafe { Registration::new(&world, sptr as *mut u8, slen, false) } {
        Some(s) => s,
        None => {
            let owned = Bytes::copy_from_slice(
                // SAFETY: as above: `slen` bytes at `sptr`, borrowed for the call.
                unsafe { std::slice::from_raw_parts(sptr as *const u8, slen) },
            );
            // SAFETY: `owned` lives in `left` until the call completes, or is retired with it.
            let s = unsafe { Registration::new(&world, owned.as_ptr().cast_mut(), owned.len(), false) };
            left.memory.push(Box::new(owned));
            match s {
                Some(s) => s,
                None => {
                    left.recv = Some(recv);
                    return left.fail(Refusal::Register, refused_device());
                }
            }
        }
    };

    // Ready to every peer; each peer's block goes once its ready arrived, then its flag.
    let hello = ready(&recv, block).encode();
    let recv_key = recv.key;
    left.recv = Some(recv);
    let peers = || (0..n).filter(move |&j| j != r);
    let readies: Vec<_> = peers().map(|j| comm.send(j as Rank, tag(1), hello.clone())).collect();
    left.exposed = true;
    let (world_ref, send_ref, kept_ref, flagged) = (&world, &send, &shared.kept, &left.flagged);
    let writes: Vec<_> = peers()
        .map(|j| {
            let comm = comm.clone();
            async move {
                let m = comm.recv(j as Rank, tag(1)).await?;
                let before = kept_ref.lock().peers[j];
                let (to, a) = target(j, &m.data, before, r, block)?;
                kept_ref.lock().peers[j] = Some(a);
                let off = if shape == Shape::Alltoall { j * block } else { 0 };
                world_ref.device_write(comm.world_rank(j as Rank), send_ref.handle, off, block, to).await?;
                let done = comm.send(j as Rank, tag(2), Bytes::new());
                flagged[j].store(true, Ordering::Release);
                done.await?;
                Ok::<_, Error>(())
            }
        })
        .collect();
    let flags: Vec<_> = peers()
        .map(|j| {
            let comm = comm.clone();
            async move { Ok::<_, Error>(flag(j, &comm.recv(j as Rank, tag(2)).await?.data, n)?) }
        })
        .collect();
    let all = futures::future::try_join3(
        futures::future::try_join_all(readies),
        futures::future::try_join_all(writes),
        futures::future::try_join_all(flags),
    );
    if let Err(e) = all.await {
        // The peers learn what ended it: a refusal names its rank; anything else, this one.
        left.cause = Refusal::behind(&e);
        return Err(e);
    }
    drop(send);

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
                let key = RemoteKey { addr: recv_key.addr + at as u64, rkey: recv_key.rkey };
                let got = world.device_read_own(key, piece).await?;
                out[at..at + piece].copy_from_slice(&got);
            }
        }
    }

    // Completed: every peer's writes into this rank's buffers, this call's and any earlier
    // call's (each connection delivers in order, and a peer writes for a call only after its
    // earlier calls), are in; the retired registrations and memory can go.
    left.finished = true;
    let mut recv = left.recv.take().expect("registered");
    recv.announced = true;
    let memory = std::mem::take(&mut left.memory);
    let (retired, retired_memory) = {
        let mut kept = shared.kept.lock();
        if keep {
            kept.recv = Some(recv);
        } else {
            // Deregistered outside the lock (below).
            kept.retired.push(recv);
        }
        (std::mem::take(&mut kept.retired), std::mem::take(&mut kept.retired_memory))
    };
    drop((retired, retired_memory, memory));
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

    fn exchange(generation: u64, block: u64) -> Ready {
        Ready::Exchange {
            generation,
            block,
            key: RemoteKey { addr: 0x1234_5678_9abc, rkey: 0xdead_beef },
            len: 1 << 20,
        }
    }

    #[test]
    fn ready_messages_round_trip() {
        for m in [
            Ready::Refuse(Refusal::Register),
            Ready::Refuse(Refusal::Length),
            Ready::Refuse(Refusal::Left),
            Ready::Refuse(Refusal::OtherLength),
            Ready::Known { generation: 7, block: 4096 },
            exchange(7, 4096),
        ] {
            assert_eq!(Ready::decode(3, &m.encode()), Ok(m));
        }
    }

    #[test]
    fn malformed_ready_messages_are_typed_errors() {
        let malformed = |m: &[u8]| matches!(Ready::decode(3, m), Err(CollError::Malformed { from: 3, .. }));
        let (known, full) = (Ready::Known { generation: 7, block: 8 }.encode(), exchange(7, 8).encode());
        assert!(malformed(&[]));
        assert!(malformed(&[9]), "unknown kind");
        assert!(malformed(&[0]), "a refusal without its reason");
        assert!(malformed(&[0, 0]) && malformed(&[0, 99]), "unknown reasons");
        assert!(malformed(&[0, 1, 0]));
        for m in [&known, &full] {
            assert!(malformed(&m[..m.len() - 1]), "one byte short");
            let mut long = m.to_vec();
            long.push(0);
            assert!(malformed(&long), "one byte over");
        }
        // The kinds' lengths are not interchangeable.
        let mut k = known.to_vec();
        k[0] = 2;
        assert!(malformed(&k));
        let mut f = full.to_vec();
        f[0] = 1;
        assert!(malformed(&f));
        // Every prefix of a valid message is rejected, never a panic.
        for i in 0..full.len() {
            assert!(Ready::decode(3, &full[..i]).is_err());
        }
    }

    #[test]
    fn targets_check_the_call() {
        let a = Announced { generation: 7, key: RemoteKey { addr: 0x1234_5678_9abc, rkey: 0xdead_beef }, len: 1 << 20 };
        let block = 4096;
        // An exchange: this rank (2) writes at its block of the peer's buffer.
        let (to, got) = target(3, &exchange(7, block as u64).encode(), None, 2, block).unwrap();
        assert_eq!(got, a);
        assert_eq!(to, RemoteKey { addr: a.key.addr + 2 * 4096, rkey: a.key.rkey });
        // The short form: only for the generation announced before.
        let known = |g: u64| Ready::Known { generation: g, block: block as u64 }.encode();
        assert_eq!(target(3, &known(7), Some(a), 2, block).unwrap().1, a);
        assert!(matches!(target(3, &known(8), Some(a), 2, block), Err(CollError::Malformed { from: 3, .. })));
        assert!(matches!(target(3, &known(7), None, 2, block), Err(CollError::Malformed { from: 3, .. })));
        // A refusal, and blocks of another length, name the peer.
        let refused = Ready::Refuse(Refusal::Length).encode();
        assert_eq!(target(3, &refused, Some(a), 2, block), Err(Refusal::Length.error(3)));
        assert_eq!(target(3, &exchange(7, 4104).encode(), None, 2, block), Err(Refusal::OtherLength.error(3)));
        // A buffer too short for this rank's block, or whose address overflows.
        let short = Ready::Exchange { generation: 1, block: 4096, key: a.key, len: 3 * 4096 - 1 };
        assert!(matches!(target(3, &short.encode(), None, 2, block), Err(CollError::Malformed { from: 3, .. })));
        let high = Ready::Exchange {
            generation: 1,
            block: 4096,
            key: RemoteKey { addr: u64::MAX - 10, rkey: 1 },
            len: 1 << 20,
        };
        assert!(matches!(target(3, &high.encode(), None, 2, block), Err(CollError::Malformed { from: 3, .. })));
        let huge = Ready::Exchange { generation: 1, block: u64::MAX / 2, key: a.key, len: u64::MAX };
        assert!(target(3, &huge.encode(), None, 2, usize::MAX / 2).is_err(), "an overflowing end is no fit");
    }

    #[test]
    fn flags_say_done_or_who_refused() {
        assert_eq!(flag(1, &[], 4), Ok(()));
        assert_eq!(flag(1, &left_flag((2, Refusal::Length)), 4), Err(Refusal::Length.error(2)));
        assert_eq!(flag(1, &left_flag((1, Refusal::Left)), 4), Err(Refusal::Left.error(1)));
        let malformed = |m: &[u8]| matches!(flag(1, m, 4), Err(CollError::Malformed { from: 1, .. }));
        assert!(malformed(&left_flag((4, Refusal::Left))), "a rank outside the call");
        assert!(malformed(&[3]) && malformed(&[3, 0, 0, 0]) && malformed(&[3, 0, 0, 0, 0, 0]));
        let mut unknown = left_flag((0, Refusal::Left)).to_vec();
        unknown[0] = 77;
        assert!(malformed(&unknown));
        // The error a refusal becomes tells which refusal it was (what a leaving rank passes on).
        for r in [Refusal::Register, Refusal::Length, Refusal::Left, Refusal::OtherLength] {
            assert_eq!(Refusal::behind(&Error::Collective(r.error(5))), Some((5, r)));
        }
        assert_eq!(Refusal::behind(&Error::Collective(CollError::Withdrawn { rank: 5 })), None);
    }
}
