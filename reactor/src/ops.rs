//! The slab of in-flight operations.
//!
//! Each awaited operation owns one slot: the protocol core completes it by key, the awaiting future
//! takes the result by key. A future that is dropped before completion detaches its slot, and the
//! slot is freed when the completion arrives (or at once, if it already has).
//!
//! Its calls are `#[inline(always)]`: they sit on every operation's latency path. The slab is this
//! module's own (a vector and a list of free slots threaded through it), not the `slab` crate's:
//! that crate's `remove` and `insert` are generic functions that an application's build without
//! LTO compiled as calls, one of them between a message's arrival and the reply.

use std::task::{Context, Poll, Waker};

/// Key of an in-flight operation.
pub type OpKey = usize;

enum Slot<T> {
    Waiting(Option<Waker>),
    Done(T),
    Detached,
    /// Unused; the next unused slot (the vector's length: none).
    Free(usize),
}

/// In-flight operations with results of type `T`.
pub struct Ops<T> {
    slots: Vec<Slot<T>>,
    /// The first unused slot; the vector's length if none.
    free: usize,
    /// Slots in use.
    len: usize,
}

impl<T> Default for Ops<T> {
    fn default() -> Self {
        Ops { slots: Vec::new(), free: 0, len: 0 }
    }
}

impl<T> Ops<T> {
    /// Starts tracking a new operation.
    #[inline(always)]
    pub fn insert(&mut self) -> OpKey {
        let key = self.free;
        match self.slots.get_mut(key) {
            Some(slot) => {
                let Slot::Free(next) = *slot else { unreachable!("the free list holds a slot in use") };
                *slot = Slot::Waiting(None);
                self.free = next;
            }
            None => {
                self.slots.push(Slot::Waiting(None));
                self.free = self.slots.len();
            }
        }
        self.len += 1;
        key
    }

    /// Frees the slot `key` holds (in use).
    #[inline(always)]
    fn release(&mut self, key: OpKey) -> Slot<T> {
        let slot = std::mem::replace(&mut self.slots[key], Slot::Free(self.free));
        self.free = key;
        self.len -= 1;
        slot
    }

    /// Records the result of `key` and wakes its waiter. Unknown keys are ignored.
    /// Returns false if the operation had been detached (nobody wants the result).
    #[inline(always)]
    pub fn complete(&mut self, key: OpKey, result: T) -> bool {
        match self.slots.get_mut(key) {
            Some(slot @ Slot::Waiting(_)) => {
                // In place: no second look-up of the key, nothing left behind to drop.
                if let Slot::Waiting(Some(w)) = std::mem::replace(slot, Slot::Done(result)) {
                    w.wake();
                }
                true
            }
            Some(Slot::Detached) => {
                self.release(key);
                false
            }
            Some(Slot::Done(_) | Slot::Free(_)) | None => false,
        }
    }

    /// True if `key` has a result waiting.
    pub fn is_done(&self, key: OpKey) -> bool {
        matches!(self.slots.get(key), Some(Slot::Done(_)))
    }

    /// Takes the result of `key` if there is one; otherwise registers `cx` (when given) to be woken.
    #[inline(always)]
    pub fn poll(&mut self, key: OpKey, cx: Option<&mut Context<'_>>) -> Poll<T> {
        match self.slots.get_mut(key) {
            Some(Slot::Done(_)) => match self.release(key) {
                Slot::Done(v) => Poll::Ready(v),
                _ => unreachable!(),
            },
            Some(Slot::Waiting(w)) => {
                if let Some(cx) = cx {
                    match w {
                        Some(old) if old.will_wake(cx.waker()) => {}
                        _ => *w = Some(cx.waker().clone()),
                    }
                }
                Poll::Pending
            }
            Some(Slot::Detached | Slot::Free(_)) | None => Poll::Pending,
        }
    }

    /// The awaiting future is gone: free the slot now if done, else when the result arrives.
    /// Returns true if the operation was still in flight.
    pub fn detach(&mut self, key: OpKey) -> bool {
        match self.slots.get_mut(key) {
            Some(slot @ Slot::Waiting(_)) => {
                *slot = Slot::Detached;
                true
            }
            Some(Slot::Done(_) | Slot::Detached) => {
                self.release(key);
                false
            }
            Some(Slot::Free(_)) | None => false,
        }
    }

    /// Number of slots in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if no operation is tracked.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn complete_wakes_and_poll_takes() {
        let mut ops = Ops::default();
        let k = ops.insert();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(ops.poll(k, Some(&mut cx)).is_pending());
        assert!(ops.complete(k, 7));
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(ops.poll(k, None), Poll::Ready(7));
        assert!(ops.is_empty());
    }

    #[test]
    fn detach_frees_on_completion_and_keys_are_not_confused() {
        let mut ops = Ops::default();
        let a = ops.insert();
        assert!(ops.detach(a));
        assert_eq!(ops.len(), 1);
        assert!(!ops.complete(a, 1));
        assert!(ops.is_empty());
        let b = ops.insert();
        ops.complete(b, 2);
        assert!(!ops.detach(b));
        assert!(ops.is_empty());
    }

    #[test]
    fn freed_slots_are_used_again_and_unknown_keys_ignored() {
        let mut ops = Ops::default();
        let keys: Vec<OpKey> = (0..4).map(|_| ops.insert()).collect();
        assert_eq!(keys, [0, 1, 2, 3]);
        for &k in &[1, 3] {
            assert!(ops.complete(k, k));
            assert_eq!(ops.poll(k, None), Poll::Ready(k));
        }
        assert_eq!(ops.len(), 2);
        // A freed or unknown key is nobody's: nothing completes, nothing is taken.
        assert!(!ops.complete(3, 9));
        assert!(!ops.complete(17, 9));
        assert!(ops.poll(1, None).is_pending());
        assert!(!ops.detach(1));
        assert_eq!(ops.len(), 2);
        // The last freed first, then the one before, then new slots.
        assert_eq!([ops.insert(), ops.insert(), ops.insert()], [3, 1, 4]);
        assert_eq!(ops.len(), 5);
        assert!(ops.complete(0, 10));
        assert!(ops.is_done(0));
        assert_eq!(ops.poll(0, None), Poll::Ready(10));
        assert!(!ops.is_done(0));
        assert_eq!(ops.insert(), 0);
    }
}
