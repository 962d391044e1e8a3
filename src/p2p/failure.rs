//! What a rank knows of the other ranks' fate, and which communicators that ends. Sans-IO: the
//! engine feeds it events and asks it questions (see `engine/revoke.rs` for what the engine does
//! with the answers, and `docs/failure.md` for the semantics users see).
//!
//! Every rank is *alive*, *departed* or *lost*:
//! * **departed**: it said goodbye (`Bye`, sent by finalize or by dropping the world). An orderly
//!   end: it sent everything it meant to before, so nothing it owed is missing. Only what needs
//!   it from now on fails: operations naming it, and collectives started on communicators that
//!   contain it. Its connection closing afterwards, or its process exiting, is no loss.
//! * **lost**: its connection failed, it stayed silent past the peer timeout, the launcher saw its
//!   process end, or another rank reported it lost. Final, like a departure.
//!
//! A loss *revokes* every communicator context whose [`Watch`] holds the lost rank: every pending
//! and later operation on it fails, naming the first rank this rank learnt lost among those the
//! context watches (so an error always names a rank that was lost, never one that merely passed
//! the news on or gave up because of it). A context is registered with the watch of the
//! communicator it serves: a user's communicator watches its members; the contexts a communicator
//! makes for its own use (collective traffic, node and leader groups, multicast channels) watch
//! their parent's members, since a collective of the parent needs all of them. A context nobody
//! registered watches every rank.
//!
//! Knowledge spreads by one flood per loss: the first time a rank learns of a loss, by any path,
//! it tells every rank it still believes alive ([`Failures::lose`] says when); a report of a
//! loss already known is not passed on. So every live rank hears of a loss one hop after the
//! first rank that noticed it, whether or not it ever talks to the lost rank.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use ferrocomm_transports::{Rank, TransportError};

use crate::error::Error;

/// What became of a rank, as far as this rank knows.
#[derive(Clone, Debug, PartialEq)]
pub enum Fate {
    Alive,
    /// It said goodbye.
    Departed,
    /// It is gone, for this reason (the first one this rank learnt).
    Lost(TransportError),
}

/// Which ranks' loss revokes a context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Watch {
    /// Every rank of the job.
    All,
    /// These world ranks (sorted, no duplicates).
    Ranks(Arc<[Rank]>),
}

impl Watch {
    /// The watch of `ranks` (any order, duplicates allowed).
    pub fn ranks(ranks: impl IntoIterator<Item = Rank>) -> Watch {
        let mut v: Vec<Rank> = ranks.into_iter().collect();
        v.sort_unstable();
        v.dedup();
        Watch::Ranks(v.into())
    }

    /// Whether the loss of `r` concerns this watch.
    pub fn holds(&self, r: Rank) -> bool {
        match self {
            Watch::All => true,
            Watch::Ranks(v) => v.binary_search(&r).is_ok(),
        }
    }
}

/// The fate of every rank of a job, the losses in the order learnt, and the contexts' watches.
pub struct Failures {
    fates: Vec<Fate>,
    /// Lost ranks, in the order this rank learnt of them.
    lost: Vec<Rank>,
    departed: usize,
    watches: HashMap<u32, Watch>,
    /// Departures and losses so far, readable without the engine's lock: callers that would ask
    /// [`Failures::gate`] on every call (the shared-memory board's) skip the question while it
    /// reads zero.
    changes: Arc<AtomicU32>,
}

impl Failures {
    /// Every rank of a job of `size` ranks alive, no context registered.
    pub fn new(size: u32) -> Failures {
        Failures {
            fates: vec![Fate::Alive; size as usize],
            lost: Vec::new(),
            departed: 0,
            watches: HashMap::new(),
            changes: Arc::new(AtomicU32::new(0)),
        }
    }

    /// The fate of rank `r` (which must be a rank of the job).
    pub fn fate(&self, r: Rank) -> &Fate {
        &self.fates[r as usize]
    }

    /// Whether rank `r` is believed alive.
    pub fn is_alive(&self, r: Rank) -> bool {
        matches!(self.fates.get(r as usize), Some(Fate::Alive))
    }

    /// Whether any rank was lost.
    #[inline(always)]
    pub fn any_lost(&self) -> bool {
        !self.lost.is_empty()
    }

    /// Whether any rank departed or was lost.
    #[inline(always)]
    pub fn any_change(&self) -> bool {
        self.departed > 0 || self.any_lost()
    }

    /// The lost ranks, in the order learnt.
    pub fn lost(&self) -> &[Rank] {
        &self.lost
    }

    /// The count of departures and losses, shared (see the field).
    pub fn changes(&self) -> Arc<AtomicU32> {
        self.changes.clone()
    }

    /// Rank `r` said goodbye. True if that is news (it was alive).
    pub fn depart(&mut self, r: Rank) -> bool {
        match self.fates.get_mut(r as usize) {
            Some(f @ Fate::Alive) => {
                *f = Fate::Departed;
                self.departed += 1;
                self.changes.fetch_add(1, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// Rank `r` is lost, for `reason`. True if that is news (it was alive): the caller then fails
    /// what the loss ends and tells the ranks still alive, once. A departed rank stays departed.
    pub fn lose(&mut self, r: Rank, reason: TransportError) -> bool {
        match self.fates.get_mut(r as usize) {
            Some(f @ Fate::Alive) => {
                *f = Fate::Lost(reason);
                self.lost.push(r);
                self.changes.fetch_add(1, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// Registers the watch of `context` (replacing an earlier one).
    pub fn watch(&mut self, context: u32, watch: Watch) {
        self.watches.insert(context, watch);
    }

    /// Whether `context` was registered (its watch is known, not assumed).
    pub fn registered(&self, context: u32) -> bool {
        self.watches.contains_key(&context)
    }

    /// Whether the loss of `r` revokes `context`.
    pub fn watches(&self, context: u32, r: Rank) -> bool {
        self.watches.get(&context).is_none_or(|w| w.holds(r))
    }

    /// The rank whose loss revoked `context`, if it is revoked: the first learnt lost among those
    /// it watches.
    #[inline]
    pub fn revoked(&self, context: u32) -> Option<Rank> {
        if self.lost.is_empty() {
            return None;
        }
        self.lost.iter().copied().find(|&r| self.watches(context, r))
    }

    /// Why a collective on `context` cannot run: the rank whose loss revoked it. A departure
    /// refuses no call up front: the departed rank sent everything it meant to before it left,
    /// and a rank that finished a collective (a broadcast's root, the first ranks of a scan) may
    /// leave before a slower rank has even called it. What still needs a message from the
    /// departed rank fails where it waits for it (a receive naming it, a board word it never
    /// posted).
    pub fn gate(&self, context: u32) -> Option<Rank> {
        self.revoked(context)
    }

    /// The error that names rank `r`'s fate (`None` while it is alive).
    pub fn error(&self, r: Rank) -> Option<Error> {
        match self.fates.get(r as usize)? {
            Fate::Alive => None,
            Fate::Departed => Some(Error::PeerLost { rank: r, reason: TransportError::Left }),
            Fate::Lost(reason) => Some(Error::PeerLost { rank: r, reason: reason.clone() }),
        }
    }

    /// The ranks to tell of the loss of `lost`: every rank believed alive but `me` and `lost`.
    pub fn to_tell(&self, me: Rank, lost: Rank) -> impl Iterator<Item = Rank> + '_ {
        (0..self.fates.len() as Rank).filter(move |&r| r != me && r != lost && self.is_alive(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(v: &[Rank]) -> Watch {
        Watch::ranks(v.iter().copied())
    }

    #[test]
    fn a_loss_is_recorded_once_and_a_departure_stays_one() {
        let mut f = Failures::new(4);
        assert!(!f.any_change());
        assert!(f.lose(2, TransportError::Closed));
        assert!(!f.lose(2, TransportError::Reported { by: 1 }), "the second report is no news");
        assert!(matches!(f.fate(2), Fate::Lost(TransportError::Closed)), "the first reason stays");
        assert!(f.depart(1));
        assert!(!f.depart(1));
        assert!(!f.lose(1, TransportError::Closed), "a connection closing after the goodbye");
        assert!(!f.depart(2), "a goodbye after the loss changes nothing");
        assert_eq!(f.fate(1), &Fate::Departed);
        assert_eq!(f.lost(), &[2]);
        assert_eq!(f.changes().load(Ordering::Acquire), 2);
        assert!(matches!(f.error(2), Some(Error::PeerLost { rank: 2, reason: TransportError::Closed })));
        assert!(matches!(f.error(1), Some(Error::PeerLost { rank: 1, reason: TransportError::Left })));
        assert!(f.error(0).is_none());
        assert!(!f.lose(9, TransportError::Closed), "not a rank of the job");
    }

    #[test]
    fn contexts_are_revoked_by_the_first_loss_they_watch() {
        let mut f = Failures::new(6);
        f.watch(1, Watch::All);
        f.watch(2, watch(&[0, 1, 2]));
        f.watch(3, watch(&[3, 4, 5]));
        assert_eq!((f.revoked(1), f.revoked(2), f.revoked(3), f.revoked(99)), (None, None, None, None));
        f.lose(4, TransportError::Closed);
        assert_eq!(f.revoked(1), Some(4));
        assert_eq!(f.revoked(2), None, "a communicator without the lost rank goes on");
        assert_eq!(f.revoked(3), Some(4));
        assert_eq!(f.revoked(99), Some(4), "an unregistered context watches everyone");
        f.lose(1, TransportError::Closed);
        assert_eq!(f.revoked(1), Some(4), "named after the first loss, not the latest");
        assert_eq!(f.revoked(2), Some(1));
        assert!(f.watches(2, 1) && !f.watches(2, 4) && f.watches(99, 5));
        // A later registration decides for itself.
        f.watch(4, watch(&[0, 2]));
        assert_eq!(f.revoked(4), None);
        assert!(f.registered(4) && !f.registered(99));
    }

    #[test]
    fn collectives_stop_at_losses_not_departures() {
        let mut f = Failures::new(4);
        f.watch(1, Watch::All);
        f.watch(2, watch(&[0, 1]));
        f.depart(3);
        assert_eq!(f.revoked(1), None, "a departure revokes nothing");
        assert_eq!(f.gate(1), None, "nor refuses a collective up front");
        f.lose(0, TransportError::Closed);
        assert_eq!(f.gate(1), Some(0));
        assert_eq!(f.gate(2), Some(0));
    }

    #[test]
    fn news_goes_to_every_rank_believed_alive() {
        let mut f = Failures::new(5);
        f.depart(4);
        f.lose(1, TransportError::Closed);
        assert_eq!(f.to_tell(0, 2).collect::<Vec<_>>(), [3]);
        assert_eq!(f.to_tell(3, 1).collect::<Vec<_>>(), [0, 2]);
    }
}
