//! Owned forms of the collectives: they take the buffer by value and give it back (or give a new
//! one), so their futures borrow nothing, neither the buffer nor the communicator, and are
//! `Send + 'static`. Why: a future that borrows a `&mut [T]` cannot be `tokio::spawn`ed, and
//! spawning is how async code overlaps communication with computation (a training loop's
//! bucketed gradient all-reduce during the backward pass).
//!
//! An owned call is planned when it is called, like every collective: it takes its sequence
//! number on the communicator at once, not when the spawned task first polls it. Calls keep the
//! order in which the program made them, however the runtime schedules the tasks.
//!
//! The all-reduce, broadcast and reduce work on the caller's memory where it is (the board and
//! single-copy paths read and write it in place), so their owned forms run the in-place form on
//! the vector's heap block, which the future owns: the block does not move when the future
//! moves, and it is handed back only after the in-place future is gone ([`Owning`]). The
//! reduce-scatter and the scan copy their input into the call anyway; their owned forms hand the
//! vector itself to the call as the message bytes, without a copy.
//!
//! A failed owned call does not cost the caller its buffer: the error ([`OwnedError`]) carries
//! it, so a loop can retry the call or reuse the memory.

use std::mem::ManuallyDrop;
use std::ptr::NonNull;

use super::*;
use crate::error::OwnedError;

/// A vector taken apart, so that no `Vec` (whose moves assert that it owns its block) exists
/// while a future borrows the block.
struct RawVec<T> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
}

impl<T> RawVec<T> {
    fn new(v: Vec<T>) -> RawVec<T> {
        let mut v = ManuallyDrop::new(v);
        // A vector's pointer is never null (dangling and aligned when nothing is allocated).
        let ptr = NonNull::new(v.as_mut_ptr()).expect("a vector's pointer is not null");
        RawVec { ptr, len: v.len(), cap: v.capacity() }
    }

    /// The vector again.
    ///
    /// # Safety
    /// No reference made by [`RawVec::slice`] may be alive, and this is called at most once.
    unsafe fn into_vec(self) -> Vec<T> {
        // SAFETY: the parts are those of a vector that `new` took apart and nothing freed; the
        // caller guarantees no other reference to the block remains and that it is rebuilt once.
        unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.cap) }
    }
}

/// The future of an in-place collective together with the vector it works on: the owned form of
/// that collective. Invariant: while `fut` is `Some`, it may hold the only reference to the
/// vector's block; the vector is rebuilt from `raw` only after `fut` was dropped in place (on
/// completion, or when this future is dropped).
struct Owning<T, F> {
    /// Structurally pinned: never moved out, only dropped in place (`Pin::set`).
    fut: Option<F>,
    raw: Option<RawVec<T>>,
}

// SAFETY: the raw parts are the vector's own, which is `Send` for `T: Send`; `fut` is `Send`; the
// block is reached only through `fut` or, once `fut` is gone, through the rebuilt vector.
unsafe impl<T: Send, F: Send> Send for Owning<T, F> {}

impl<T: 'static, F> Owning<T, F> {
    /// Starts `start` on the block of `v`, which the returned future owns until it completes.
    ///
    /// # Safety
    /// `start` must not keep the slice anywhere that outlives the future it returns: given a
    /// `&'a mut [T]`, it must return a future that holds it for `'a` at most, for any `'a`. Every
    /// collective of this crate is generic in that lifetime, which guarantees it.
    unsafe fn start(v: Vec<T>, start: impl FnOnce(&'static mut [T]) -> F) -> Owning<T, F> {
        let raw = RawVec::new(v);
        // SAFETY: the block is valid for `len` elements (a live vector's), and nothing else refers
        // to it until `fut` is dropped: the vector was taken apart, and `raw` is not touched
        // before then. `'static` stands for "as long as `fut`", which the caller guarantees is
        // all that `start` relies on.
        let slice = unsafe { std::slice::from_raw_parts_mut(raw.ptr.as_ptr(), raw.len) };
        Owning { fut: Some(start(slice)), raw: Some(raw) }
    }
}

impl<T, F> Owning<T, F> {
    /// Drops the in-place future (in place), then gives the vector back, once.
    fn finish(self: Pin<&mut Self>) -> Option<Vec<T>> {
        // SAFETY: `fut` is dropped in place through its pin (`Pin::set`), never moved; `raw` is
        // not structurally pinned (it is `Unpin` and moved out freely).
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: `fut` is pinned as part of `self` (see the field).
        unsafe { Pin::new_unchecked(&mut this.fut) }.set(None);
        // SAFETY: the in-place future, the only holder of the slice, is gone; `take` makes this
        // the only rebuild.
        this.raw.take().map(|raw| unsafe { raw.into_vec() })
    }
}

impl<T, R, F: Future<Output = Result<R>>> Future for Owning<T, F> {
    type Output = Result<(R, Vec<T>), OwnedError<T>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // SAFETY: `fut` is structurally pinned: it is never moved out of `self` (only dropped in
        // place, in `finish`).
        let fut = unsafe { self.as_mut().map_unchecked_mut(|s| &mut s.fut) }.as_pin_mut();
        let Some(fut) = fut else {
            let error = InvalidArgument::PolledAfterCompletion.into();
            return Poll::Ready(Err(OwnedError { error, buffer: Vec::new() }));
        };
        let r = std::task::ready!(fut.poll(cx));
        let buffer = self.finish().expect("the vector is given back once, with the future's result");
        Poll::Ready(match r {
            Ok(r) => Ok((r, buffer)),
            Err(error) => Err(OwnedError { error, buffer }),
        })
    }
}

impl<T, F> Drop for Owning<T, F> {
    fn drop(&mut self) {
        // SAFETY: a value being dropped is not used again; if it was pinned, it is dropped where
        // it was pinned, which is all that `finish` needs.
        let pinned = unsafe { Pin::new_unchecked(self) };
        drop(pinned.finish());
    }
}

/// A vector of elements as message bytes, without a copy.
struct VecBytes<T>(Vec<T>);

impl<T: Element> AsRef<[u8]> for VecBytes<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

pub(super) fn vec_bytes<T: Element>(v: Vec<T>) -> Bytes {
    Bytes::from_owner(VecBytes(v))
}

/// The buffer behind `bytes` (made by [`vec_bytes`]) for an [`OwnedError`]: a copy, since the
/// transport may still hold the bytes.
fn failed<T: Element>(error: Error, bytes: &Bytes) -> OwnedError<T> {
    OwnedError { error, buffer: bytemuck::pod_collect_to_vec(bytes) }
}

impl Comm {
    /// [`Comm::allreduce`] on an owned buffer: combines every rank's `buf` with `op` and returns
    /// it holding the result. The future borrows nothing (`Send + 'static`): it may be
    /// `tokio::spawn`ed to run while the caller computes. The call takes its place among the
    /// communicator's collectives when made, not when first polled. On failure the error
    /// carries `buf` back ([`OwnedError`]); `?` turns it into an [`Error`].
    ///
    /// ```no_run
    /// # async fn demo(comm: ferrocomm::Comm, other: Vec<f32>) -> ferrocomm::Result<()> {
    /// use ferrocomm::ReduceOp;
    /// let grads = vec![1.0f32; 1 << 20];
    /// let pending = tokio::spawn(comm.allreduce_owned(grads, ReduceOp::Sum));
    /// let more = comm.allreduce_owned(other, ReduceOp::Sum); // ordered after `grads` everywhere
    /// // ... compute meanwhile ...
    /// let summed = pending.await.expect("not cancelled")?;
    /// # let _ = (summed, more.await?); Ok(()) }
    /// ```
    pub fn allreduce_owned<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>, OwnedError<T>>> + Send + 'static + use<T> {
        // SAFETY: `allreduce` is generic in the buffer's lifetime.
        let call = unsafe { Owning::start(buf, |b| self.allreduce(b, op)) };
        async move { call.await.map(|((), v)| v) }
    }

    /// [`Comm::broadcast`] on an owned buffer: every rank passes a buffer of the same length (the
    /// root's holds the data) and gets it back holding the root's data. `Send + 'static`, planned
    /// when called, like [`Comm::allreduce_owned`].
    pub fn broadcast_owned<T: Element>(
        &self,
        root: Rank,
        buf: Vec<T>,
    ) -> impl Future<Output = Result<Vec<T>, OwnedError<T>>> + Send + 'static + use<T> {
        // SAFETY: `broadcast` is generic in the buffer's lifetime.
        let call = unsafe { Owning::start(buf, |b| self.broadcast(root, b)) };
        async move { call.await.map(|((), v)| v) }
    }

    /// [`Comm::reduce`] of an owned buffer: `Some(result)` at `root`, `None` elsewhere.
    /// `Send + 'static`, planned when called, like [`Comm::allreduce_owned`].
    pub fn reduce_owned<T: Element>(
        &self,
        root: Rank,
        data: Vec<T>,
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>, OwnedError<T>>> + Send + 'static + use<T> {
        // SAFETY: `reduce` is generic in the data's lifetime.
        let call = unsafe { Owning::start(data, |d| self.reduce(root, &*d, op)) };
        async move { call.await.map(|(out, _)| out) }
    }

    /// [`Comm::reduce_scatter`] of an owned buffer, which becomes the call's message bytes
    /// without a copy: rank i gets `counts[i]` elements of the reduction. `Send + 'static`,
    /// planned when called.
    pub fn reduce_scatter_owned<T: Element>(
        &self,
        data: Vec<T>,
        counts: &[usize],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>, OwnedError<T>>> + Send + 'static + use<T> {
        let len = data.len();
        let data = vec_bytes(data);
        let run = self.reduce_scatter_with(data.clone(), len, counts, op);
        async move { run.await.map_err(|e| failed(e, &data)) }
    }

    /// [`Comm::scan`] (inclusive prefix reduction) of an owned buffer, which becomes the call's
    /// message bytes without a copy: rank r gets `data_0 ⊕ ... ⊕ data_r`. `Send + 'static`,
    /// planned when called.
    pub fn scan_owned<T: Element>(
        &self,
        data: Vec<T>,
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>, OwnedError<T>>> + Send + 'static + use<T> {
        let data = vec_bytes(data);
        let run = self.scan_with(data.clone(), op, true);
        async move {
            let out =
                run.await.and_then(|out| out.ok_or(Error::Internal { what: "an inclusive scan produced no result" }));
            out.and_then(|out| to_vec(&out)).map_err(|e| failed(e, &data))
        }
    }
}
