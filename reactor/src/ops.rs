//! The slab of in-flight operations.
//!
//! Each awaited operation owns one slot: the protocol core completes it by key, the awaiting future
//! takes the result by key. A future that is dropped before completion detaches its slot, and the
//! slot is freed when the completion arrives (or at once, if it already has).
//!
//! Its calls are `#[inline(always)]`: they sit on every operation's latency path.

use std::task::{Context, Poll, Waker};

use slab::Slab;

/// Key of an in-flight operation.
pub type OpKey = usize;

enum Slot<T> {
    Waiting(Option<Waker>),
    Done(T),
    Detached,
}

/// In-flight operations with results of type `T`.
pub struct Ops<T> {
    slab: Slab<Slot<T>>,
}

impl<T> Default for Ops<T> {
    fn default() -> Self {
        Ops { slab: Slab::new() }
    }
}

impl<T> Ops<T> {
    /// Starts tracking a new operation.
    #[inline(always)]
    pub fn insert(&mut self) -> OpKey {
        self.slab.insert(Slot::Waiting(None))
    }

    /// Records the result of `key` and wakes its waiter. Unknown keys are ignored.
    /// Returns false if the operation had been detached (nobody wants the result).
    #[inline(always)]
    pub fn complete(&mut self, key: OpKey, result: T) -> bool {
        match self.slab.get_mut(key) {
            Some(slot @ Slot::Waiting(_)) => {
                // In place: no second look-up of the key, nothing left behind to drop.
                if let Slot::Waiting(Some(w)) = std::mem::replace(slot, Slot::Done(result)) {
                    w.wake();
                }
                true
            }
            Some(Slot::Detached) => {
                self.slab.remove(key);
                false
            }
            Some(Slot::Done(_)) | None => false,
        }
    }

    /// True if `key` has a result waiting.
    pub fn is_done(&self, key: OpKey) -> bool {
        matches!(self.slab.get(key), Some(Slot::Done(_)))
    }

    /// Takes the result of `key` if there is one; otherwise registers `cx` (when given) to be woken.
    #[inline(always)]
    pub fn poll(&mut self, key: OpKey, cx: Option<&mut Context<'_>>) -> Poll<T> {
        match self.slab.get_mut(key) {
            Some(Slot::Done(_)) => match self.slab.remove(key) {
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
            Some(Slot::Detached) | None => Poll::Pending,
        }
    }

    /// The awaiting future is gone: free the slot now if done, else when the result arrives.
    /// Returns true if the operation was still in flight.
    pub fn detach(&mut self, key: OpKey) -> bool {
        match self.slab.get(key) {
            Some(Slot::Waiting(_)) => {
                self.slab[key] = Slot::Detached;
                true
            }
            Some(_) => {
                self.slab.remove(key);
                false
            }
            None => false,
        }
    }

    /// Number of slots in use.
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    /// True if no operation is tracked.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
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
}
