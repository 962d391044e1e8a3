//! Collective operations on a [`Comm`]: the thin driver between the sans-IO machines of
//! `ferrocomm-collectives` and the point-to-point layer, plus communicator splitting.
//!
//! Every collective is planned when it is *called*: the algorithm is chosen and the call takes its
//! sequence number on the communicator right away, so several collectives may be outstanding on
//! one communicator (held, `join!`ed) and still pair up across ranks, as long as every rank calls
//! them in the same order. Collective traffic travels on the communicator's collective context
//! with tag `sequence << 16 | round`, so it never mixes with the application's messages or with
//! another call's.
//!
//! Cancellation: dropping a collective's future withdraws its pending receives and sends. Ranks
//! that still wait for this rank's part of that call do not complete it: they fail at their own
//! deadline ([`Error::Timeout`]) or are dropped in turn. The communicator stays usable: later calls
//! have later sequence numbers, and the cancelled call's stray messages are never matched (they stay
//! in the unexpected queue, bounded by that call's size, until the communicator's world ends).
//! Calls on the shared-memory board ([`shared`]) differ: they are described in full when made, so
//! a dropped call still does this rank's part whenever a later call of the communicator is driven,
//! and the other ranks complete it. Single-copy calls (large calls on one host,
//! [`board::Lending`]) read the other ranks' memory: dropping one withdraws what this rank lent,
//! and the others' call fails with `CollError::Withdrawn` rather than keep what it read.
//!
//! Failures: a loss of a member revokes the communicator, which fails every rank's pending and later
//! calls naming the lost rank, on every path (messages, board, multicast, node-leader); a departed
//! member fails only the steps that wait for what it never sent (see `docs/failure.md`).

mod all;
mod board;
mod choose;
mod hierarchy;
mod on_host;
mod owned;
mod pool;
mod rdma;
mod rooted;
mod run;
mod split;
mod state;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use ferrocomm_collectives::CollError;
use ferrocomm_collectives::select::Call;
use ferrocomm_collectives::shared::{Kind as BoardOp, Lent};
use ferrocomm_collectives::{Action, Algorithm, Blocks, Element, Machine, Operation, ReduceOp, ops};
use ferrocomm_reactor::Wait;
use ferrocomm_transports::Rank;
use smallvec::SmallVec;

use crate::api::world::{COLLECTIVE_BIT, Comm, Group, Message, Op, derive_context};
use crate::error::{Error, InvalidArgument, Result};
use crate::multicast::{Channel, TokenBarrier};
use crate::observe::coll::Observe;
use crate::p2p::Status;
use crate::p2p::driver::Driver;

use hierarchy::*;
use on_host::*;
use pool::*;

fn to_bytes<T: Element>(data: &[T]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(data))
}

fn to_vec<T: Element>(b: &Bytes) -> Result<Vec<T>> {
    if !b.len().is_multiple_of(size_of::<T>()) {
        return Err(InvalidArgument::PartialElement { len: b.len(), element: T::NAME }.into());
    }
    Ok(bytemuck::pod_collect_to_vec(b))
}

fn copy_into<T: Element>(out: &mut [T], b: &Bytes) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    if bytes.len() != b.len() {
        return Err(InvalidArgument::LengthMismatch { expected: b.len(), got: bytes.len() }.into());
    }
    bytes.copy_from_slice(b);
    Ok(())
}

/// Lays `parts` end to end into `out`, which must be exactly as long.
fn copy_parts<T: Element, P: AsRef<[u8]>>(out: &mut [T], parts: &[P]) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    let total: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    if total != bytes.len() {
        return Err(InvalidArgument::LengthMismatch { expected: total, got: bytes.len() }.into());
    }
    let mut at = 0;
    for p in parts {
        let p = p.as_ref();
        bytes[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    Ok(())
}

/// The future of a broadcast, all-reduce or barrier: on the board (a small call where the ranks
/// share a host), the call (in a reused box, see `board::BoxedCall`) and where its result goes;
/// on any other path, that path's future, boxed (and within it, the rare large paths boxed
/// again, so the common message path's box stays small). Why: the board serves the calls whose
/// latency is a few hundred nanoseconds, where a future holding every path's state (416-560
/// bytes, copied each time the future moves) costs a measurable share; the other paths cost
/// microseconds, which one allocation does not change. 48 bytes in all.
///
/// A board call complete when made (a broadcast's root, the last rank to arrive) has already
/// written its result into the caller's buffer when the call returns, before its future is
/// polled; dropping that future changes nothing (the other ranks have their results too).
enum Collective<'a> {
    /// Complete (or failed) when made: a broadcast's root, the last rank to arrive.
    Ready(Option<Result<()>>),
    /// A board call; its result is copied into `out` (nothing for a broadcast's root or a
    /// barrier), as `ranks` blocks (see [`deliver`]).
    Board {
        call: board::BoxedCall,
        out: Option<&'a mut [u8]>,
        ranks: u32,
    },
    Boxed(Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>),
}

impl<'a> Collective<'a> {
    fn board(call: Result<board::Made>, out: Option<&'a mut [u8]>) -> Collective<'a> {
        Collective::board_gathered(call, out, 1)
    }

    /// [`Collective::board`] for a call whose result is `ranks` blocks (an all-gather's).
    fn board_gathered(call: Result<board::Made>, out: Option<&'a mut [u8]>, ranks: u32) -> Collective<'a> {
        match call {
            Ok(board::Made::Done(result)) => Collective::Ready(Some(deliver(out, &[result], ranks))),
            Ok(board::Made::Waiting(call)) => Collective::Board { call: board::BoxedCall::new(call), out, ranks },
            Err(e) => Collective::Ready(Some(Err(e))),
        }
    }

    fn boxed(f: impl Future<Output = Result<()>> + Send + 'a) -> Collective<'a> {
        Collective::Boxed(Box::pin(f))
    }
}

/// A board call's result into the caller's buffer, if it has one there: its pieces end to end, or
/// for an all-gather of `ranks` ranks, laid out by rank ([`copy_gathered`]).
fn deliver(out: Option<&mut [u8]>, parts: &[ferrocomm_collectives::shared::Data], ranks: u32) -> Result<()> {
    match out {
        None => Ok(()),
        Some(out) if ranks > 1 => copy_gathered(out, parts, ranks as usize),
        Some(out) => copy_parts(out, parts),
    }
}

impl Future for Collective<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self.get_mut() {
            Collective::Board { call, out, ranks } => {
                let parts = std::task::ready!(Pin::new(call.get()).poll(cx))?;
                Poll::Ready(deliver(out.take(), &parts, *ranks))
            }
            Collective::Ready(r) => {
                Poll::Ready(r.take().unwrap_or_else(|| Err(InvalidArgument::PolledAfterCompletion.into())))
            }
            Collective::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

/// The future of a board call whose result is a vector of its own (a reduce-scatter's segment of
/// `count` elements): the result as made (a call complete when made), or the call in a reused
/// box (see `board::BoxedCall`), not the call's 120 bytes inline in an `async` block's state.
enum BoardVec<T> {
    Ready(Option<Result<Vec<T>>>),
    Waiting { call: board::BoxedCall, count: usize },
}

// Nothing in it is pinned: the call is boxed, and the vector is moved out only when ready.
impl<T> Unpin for BoardVec<T> {}

impl<T: Element> BoardVec<T> {
    fn new(call: Result<board::Made>, count: usize) -> BoardVec<T> {
        match call {
            Ok(board::Made::Done(result)) => BoardVec::Ready(Some(vec_of(&[result], count))),
            Ok(board::Made::Waiting(call)) => BoardVec::Waiting { call: board::BoxedCall::new(call), count },
            Err(e) => BoardVec::Ready(Some(Err(e))),
        }
    }
}

/// A board call's pieces end to end as a vector of `count` elements (no zero-filling first when
/// it came whole).
fn vec_of<T: Element>(parts: &[ferrocomm_collectives::shared::Data], count: usize) -> Result<Vec<T>> {
    match parts {
        [whole] if whole.len() == count * size_of::<T>() => Ok(bytemuck::pod_collect_to_vec(whole)),
        parts => {
            let mut out = vec![T::zeroed(); count];
            copy_parts(&mut out, parts)?;
            Ok(out)
        }
    }
}

impl<T: Element> Future for BoardVec<T> {
    type Output = Result<Vec<T>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Vec<T>>> {
        match self.get_mut() {
            BoardVec::Waiting { call, count } => {
                let parts = std::task::ready!(Pin::new(call.get()).poll(cx))?;
                Poll::Ready(vec_of(&parts, *count))
            }
            BoardVec::Ready(r) => {
                Poll::Ready(r.take().unwrap_or_else(|| Err(InvalidArgument::PolledAfterCompletion.into())))
            }
        }
    }
}

/// Lays out an all-gather that came in pieces: piece `k` holds every rank's `k`-th piece in rank
/// order; `out` gets every rank's whole part in rank order.
fn copy_gathered<T: Element, P: AsRef<[u8]>>(out: &mut [T], pieces: &[P], ranks: usize) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    let pieces = || pieces.iter().map(AsRef::as_ref);
    let total: usize = pieces().map(<[u8]>::len).sum();
    if total != bytes.len() || pieces().any(|p| !p.len().is_multiple_of(ranks)) {
        return Err(InvalidArgument::LengthMismatch { expected: total, got: bytes.len() }.into());
    }
    let block = total / ranks;
    let mut at = 0;
    for p in pieces().filter(|p| !p.is_empty()) {
        let len = p.len() / ranks;
        for (r, part) in p.chunks_exact(len).enumerate() {
            bytes[r * block + at..r * block + at + len].copy_from_slice(part);
        }
        at += len;
    }
    Ok(())
}

fn check_op<T: Element>(op: &ReduceOp<T>) -> Result<()> {
    if op.supported() {
        return Ok(());
    }
    let op = match op {
        ReduceOp::BitAnd => "BitAnd",
        ReduceOp::BitOr => "BitOr",
        ReduceOp::BitXor => "BitXor",
        _ => "this operator",
    };
    Err(InvalidArgument::UnsupportedOp { op, element: T::NAME }.into())
}

#[cfg(test)]
mod tests {
    /// The small collectives' future stays small: it is moved after a call complete when made has
    /// posted, and every word moved then may wait behind the post (see `board::BoxedCall`).
    #[test]
    fn the_small_collectives_future_stays_small() {
        assert!(size_of::<super::Collective<'static>>() <= 48, "{}", size_of::<super::Collective<'static>>());
        // Observed: one word more (the call's span and clock, boxed, only when it is timed).
        type Public = crate::observe::coll::Observed<super::Collective<'static>>;
        assert!(size_of::<Public>() <= 56, "{}", size_of::<Public>());
    }
}
