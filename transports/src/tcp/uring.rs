//! The io_uring TCP backend (Linux).
//!
//! Why io_uring rather than readiness + `recv`:
//! * **Zero-copy receive into posted buffers.** Each connection keeps one `recv` in flight whose
//!   destination is whatever `Reader::target` says, which for rendezvous data is the receiver's
//!   posted buffer: the kernel copies socket data straight to its final place.
//! * **Batched submissions.** One `io_uring_enter` per [`Transport::progress`] submits every
//!   connection's `recv` and vectored `sendmsg` (up to `BATCH` frames each) at once; a `recv`
//!   re-armed right after a completion waits one round for the reply's `sendmsg` (`submit_now`).
//! * **An eventfd to sleep on, signalled only for sleepers.** Tokio watches the ring's eventfd, so
//!   [`Transport::poll_ready`] can park the progress loop; the ring signals it only between
//!   `poll_ready` and [`Transport::awake`] (the completion queue's `EVENTFD_DISABLED` flag, set
//!   and cleared in shared memory, without a system call), so completions reaped by a spinning
//!   caller do not wake the reactor thread.
//!
//! Memory rule: the kernel may write into (recv) or read from (send) a buffer until that
//! operation's completion is reaped. A connection that ends (EOF, error, protocol violation,
//! [`Transport::disconnect`]) is therefore shut down, which makes its in-flight operations complete
//! promptly, and is only freed and reported through [`Sink::peer_lost`] once its completions are
//! in. `Drop` waits for them.
//!
//! Completions of socket operations run as task work of the thread that submitted them; when that
//! thread exits the kernel cancels them (`-ECANCELED`). Such operations are simply re-armed.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use io_uring::{IoUring, opcode, types};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::framing::{Reader, Writer};
use crate::wire::{Header, Limits, Rank};
use crate::{Sink, Transport, TransportError};

/// Most frames moved into one `sendmsg`.
const BATCH: usize = 64;
/// How long `Drop` waits for the in-flight operations of its shut-down sockets.
const WAIT_LIMIT: Duration = Duration::from_secs(5);

/// A `sendmsg` in flight: the frames, their iovecs and the msghdr, all at stable addresses.
struct Batch {
    frames: Writer,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
}

// SAFETY: the raw pointers in `iov` and `msg` point only into the batch's own heap memory.
unsafe impl Send for Batch {}

impl Batch {
    /// Moves the front of `queue` into the batch and points the msghdr at it.
    fn load(&mut self, queue: &mut Writer) -> *const libc::msghdr {
        queue.move_front(BATCH, &mut self.frames);
        let Batch { frames, iov, msg } = self;
        iov.clear();
        frames.each_slice(usize::MAX, |s| iov.push(libc::iovec { iov_base: s.as_ptr() as *mut _, iov_len: s.len() }));
        // SAFETY: all-zero is a valid msghdr.
        *msg = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        msg
    }
}

struct Conn {
    stream: TcpStream,
    reader: Reader,
    writer: Writer,
    batch: Box<Batch>,
    recv_busy: bool,
    send_busy: bool,
    /// Why the connection ended (set once); it is freed and reported when no operation is in
    /// flight any more.
    ended: Option<TransportError>,
    /// Why a send failed (set once): nothing more is sent, but the connection is read until its
    /// read side ends too, so that what the peer sent before it went (a goodbye, a loss notice) is
    /// not thrown away; then it ends for this reason. A socket whose send failed is reset or
    /// timed out, so its read side ends once the bytes already received are read.
    write_failed: Option<TransportError>,
}

impl Conn {
    fn end(&mut self, why: TransportError) {
        if self.ended.is_none() {
            if self.recv_busy || self.send_busy {
                // Completes the in-flight operations (recv -> 0, send -> EPIPE).
                let _ = self.stream.shutdown(Shutdown::Both);
            }
            self.ended = Some(why);
            self.writer = Writer::default();
        }
    }

    /// A send failed: stop sending, keep reading (see `write_failed`).
    fn fail_write(&mut self, why: TransportError) {
        if self.ended.is_none() && self.write_failed.is_none() {
            self.write_failed = Some(why);
            self.writer = Writer::default();
        }
    }

    /// The read side ended (EOF or an error): the connection ends, for the send's failure if
    /// one came first.
    fn end_read(&mut self, why: TransportError) {
        let why = self.write_failed.take().unwrap_or(why);
        self.end(why);
    }

    fn idle(&self) -> bool {
        !self.recv_busy && !self.send_busy
    }

    /// A live connection with an operation to submit.
    fn wants_submit(&self) -> bool {
        self.ended.is_none() && (!self.recv_busy || (!self.send_busy && !self.writer.is_empty()))
    }
}

/// Failures that say "try again", not "the connection is broken".
fn transient(errno: i32) -> bool {
    matches!(errno, libc::ECANCELED | libc::EINTR | libc::EAGAIN)
}

/// TCP over one io_uring; one connection per peer.
pub struct UringTcp {
    ring: IoUring,
    eventfd: AsyncFd<OwnedFd>,
    conns: Vec<Option<Conn>>,
    /// Reaped completions (kept to reuse the allocation).
    cqes: Vec<(u64, i32)>,
    eager_limit: usize,
}

impl UringTcp {
    /// Takes over connected, authenticated sockets (`conns[r]` is the socket to rank `r`). Must be
    /// called inside the tokio runtime that runs the progress loop. On failure (io_uring missing or
    /// disabled, no runtime) the sockets are handed back untouched.
    #[allow(clippy::type_complexity)]
    pub fn new(
        conns: Vec<Option<TcpStream>>,
        limits: Limits,
        eager_limit: usize,
    ) -> Result<UringTcp, (io::Error, Vec<Option<TcpStream>>)> {
        let (ring, eventfd) = match setup(conns.len()) {
            Ok(r) => r,
            Err(e) => return Err((e, conns)),
        };
        // io_uring arms its own poll for blocking sockets; on an O_NONBLOCK socket an operation
        // punted to its worker threads can still complete with -EAGAIN.
        if let Some(e) = conns.iter().flatten().find_map(|s| s.set_nonblocking(false).err()) {
            return Err((e, conns));
        }
        let conns = conns
            .into_iter()
            .enumerate()
            .map(|(peer, s)| {
                s.map(|stream| Conn {
                    stream,
                    reader: Reader::new(peer as Rank, limits),
                    writer: Writer::default(),
                    batch: Box::new(Batch {
                        frames: Writer::default(),
                        iov: Vec::new(),
                        // SAFETY: all-zero is a valid msghdr.
                        msg: unsafe { std::mem::zeroed() },
                    }),
                    recv_busy: false,
                    send_busy: false,
                    ended: None,
                    write_failed: None,
                })
            })
            .collect();
        Ok(UringTcp { ring, eventfd, conns, cqes: Vec::new(), eager_limit })
    }

    /// Applies one completion; returns the number of frames it delivered.
    fn complete(&mut self, user_data: u64, res: i32, sink: &mut dyn Sink) -> usize {
        let Some(c) = self.conns.get_mut((user_data / 2) as usize).and_then(Option::as_mut) else {
            return 0;
        };
        let err = || TransportError::Io(io::Error::from_raw_os_error(-res).kind());
        if user_data & 1 == 0 {
            c.recv_busy = false;
            if c.ended.is_some() {
                return 0;
            }
            match res {
                0 => c.end_read(TransportError::Closed),
                n if n > 0 => match c.reader.advance(n as usize, sink) {
                    Ok(frames) => return frames,
                    Err(e) => c.end(e),
                },
                _ if transient(-res) => {}
                _ => c.end_read(err()),
            }
        } else {
            c.send_busy = false;
            if c.ended.is_some() {
                c.batch.frames = Writer::default();
            } else if res >= 0 || transient(-res) {
                c.batch.frames.advance(res.max(0) as usize);
                c.writer.put_back(&mut c.batch.frames);
            } else {
                c.batch.frames = Writer::default();
                c.fail_write(err());
            }
        }
        0
    }

    /// Pushes a recv for every live connection without one and a sendmsg for every one with
    /// queued output and none in flight. Returns how many entries were pushed, and whether a
    /// sendmsg is among them.
    fn arm(&mut self, sink: &mut dyn Sink) -> (usize, bool) {
        let mut sq = self.ring.submission();
        let mut pushed = 0;
        let mut pushed_send = false;
        for (peer, slot) in self.conns.iter_mut().enumerate() {
            let Some(c) = slot.as_mut().filter(|c| c.wants_submit()) else { continue };
            let fd = types::Fd(c.stream.as_raw_fd());
            // A reader holding a data frame back for its receive reads on next round (`progress`).
            if !c.recv_busy && !c.reader.held() && !sq.is_full() {
                match c.reader.target(sink) {
                    Ok(t) => {
                        let len = u32::try_from(t.len).unwrap_or(u32::MAX);
                        // A data frame's bytes are all due: one completion for the whole of them
                        // (the kernel retries partial receives) instead of a progress round each.
                        let flags = if t.whole { libc::MSG_WAITALL } else { 0 };
                        let e = opcode::Recv::new(fd, t.ptr, len).flags(flags).build().user_data(peer as u64 * 2);
                        // SAFETY: the target stays valid until the completion is reaped: it is the
                        // reader's own boxed buffer, kept until then, or the sink's buffer, which
                        // the `Sink` contract keeps until the frame or `peer_lost` (reported only
                        // once the connection is idle).
                        unsafe { sq.push(&e).expect("checked not full") };
                        c.recv_busy = true;
                        pushed += 1;
                    }
                    Err(e) => {
                        c.end(e);
                        continue;
                    }
                }
            }
            if !c.send_busy && !c.writer.is_empty() && !sq.is_full() {
                let msg = c.batch.load(&mut c.writer);
                // All of the batch is due: the kernel retries a partial send itself (stream
                // sockets, `MSG_WAITALL`) instead of completing it short, for a progress round
                // to re-arm each time the socket's buffer fills.
                let e = opcode::SendMsg::new(fd, msg)
                    .flags((libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32)
                    .build()
                    .user_data(peer as u64 * 2 + 1);
                // SAFETY: the batch (boxed, with its frames, iovecs and msghdr) is left untouched
                // until the completion is reaped.
                unsafe { sq.push(&e).expect("checked not full") };
                c.send_busy = true;
                pushed += 1;
                pushed_send = true;
            }
        }
        (pushed, pushed_send)
    }

    /// Whether [`Transport::progress`] has something to do without waiting for the kernel.
    fn has_work(&mut self) -> bool {
        !self.ring.completion().is_empty()
            || !self.ring.submission().is_empty()
            || self.conns.iter().flatten().any(|c| c.wants_submit() || (c.ended.is_some() && c.idle()))
    }

    /// Submits what is queued and reaps (discarding) `pending` completions; false if that took
    /// longer than [`WAIT_LIMIT`] or failed.
    fn reap_all(&mut self, mut pending: usize) -> bool {
        let deadline = Instant::now() + WAIT_LIMIT;
        let ts = types::Timespec::new().nsec(100_000_000);
        let args = types::SubmitArgs::new().timespec(&ts);
        while pending > 0 {
            if Instant::now() > deadline {
                return false;
            }
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => {
                    tracing::error!("io_uring wait failed: {e}");
                    return false;
                }
            }
            pending = pending.saturating_sub(self.ring.completion().count());
        }
        true
    }
}

/// Whether a progress round enters the kernel to submit what it pushed, or leaves it queued for
/// the next entry (the next round's, or the one that sends the reply).
///
/// A receive re-armed right after a receive completed is left queued once: the caller most often
/// answers the message it just got, so the next round pushes a `sendmsg` and one entry carries
/// both; and a receive submitted after its bytes arrived completes inline, without the deferred
/// task work and the extra entry that a receive waiting in the kernel costs. A round that pushed
/// a `sendmsg`, or finds entries left by an earlier round, submits at once: output never waits,
/// and a receive waits for at most one round.
fn submit_now(pushed_send: bool, reaped_recv: bool, left_before: bool) -> bool {
    pushed_send || left_before || !reaped_recv
}

fn setup(n: usize) -> io::Result<(IoUring, AsyncFd<OwnedFd>)> {
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(io::Error::other("the io_uring TCP backend needs a tokio runtime"));
    }
    // At most two operations per connection are in flight, so the completion queue (twice the
    // submission queue) never overflows.
    // Cooperative task running: a completion's deferred work waits for the submitting thread's
    // next kernel entry instead of interrupting it (a sleeping thread is still woken), and the
    // taskrun flag tells a busy-polling caller when to enter. Measured: 8 B ping-pong latency
    // 25-29 us without, 19-23 us with (ferrocomm-bench pingpong --backend uring).
    let mut ring = IoUring::builder()
        .setup_coop_taskrun()
        .setup_taskrun_flag()
        .build((2 * n).next_power_of_two().clamp(256, 32768) as u32)?;
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    ring.submitter().register_eventfd(fd.as_raw_fd())?;
    // Signalled only while a sleeper waits on it (`poll_ready` to `awake`): a spinning caller
    // reaps completions itself, and a signal per completion would wake the reactor thread for
    // nothing, onto the CPU of a spinning rank.
    ring.completion().disable_eventfd();
    // SAFETY: the `OwnedFd` keeps the descriptor open, unchanged, for the `AsyncFd`'s lifetime.
    let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
    Ok((ring, fd))
}

impl Transport for UringTcp {
    fn name(&self) -> &'static str {
        "tcp-uring"
    }

    fn eager_limit(&self) -> usize {
        self.eager_limit
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        if let Some(c) = self.conns.get_mut(peer as usize).and_then(Option::as_mut)
            && c.ended.is_none()
            && c.write_failed.is_none()
        {
            c.writer.push(&header, payload);
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        // Run deferred completion work the kernel left for us (see `setup`).
        if self.ring.completion().is_empty() && self.ring.submission().taskrun() {
            let _ = self.ring.submitter().submit();
        }
        // Data frames held back for their receive (see `framing`) get one look per round; their
        // connections have no receive in flight meanwhile, so `has_work` keeps the rounds coming.
        let mut work = 0;
        for c in self.conns.iter_mut().flatten().filter(|c| c.reader.held() && c.ended.is_none()) {
            match c.reader.resume(sink) {
                Ok(frames) => work += frames,
                Err(e) => c.end(e),
            }
        }
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        work += cqes.len();
        let reaped_recv = cqes.iter().any(|&(user_data, _)| user_data & 1 == 0);
        for (user_data, res) in cqes.drain(..) {
            work += self.complete(user_data, res, sink);
        }
        self.cqes = cqes;

        for (peer, slot) in self.conns.iter_mut().enumerate() {
            if slot.as_ref().is_some_and(|c| c.ended.is_some() && c.idle()) {
                if let Some(err) = slot.take().and_then(|c| c.ended) {
                    tracing::debug!(peer, %err, "tcp-uring: peer lost");
                    sink.peer_lost(peer as Rank, err);
                }
                work += 1;
            }
        }

        let left_before = !self.ring.submission().is_empty();
        let (pushed, pushed_send) = self.arm(sink);
        if (pushed > 0 || left_before) && submit_now(pushed_send, reaped_recv, left_before) {
            match self.ring.submitter().submit() {
                Ok(_) => {}
                // Entries stay queued and are submitted by the next call.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => tracing::error!("io_uring submit failed: {e}"),
            }
        }
        work + pushed
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.has_work() {
                return Poll::Ready(());
            }
            if self.ring.completion().eventfd_disabled() {
                // Announce the sleep, then look once more: a completion posted before the kernel
                // saw the flag cleared rang no bell (store, full fence, load on both sides).
                self.ring.completion().enable_eventfd();
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                continue;
            }
            let mut guard = match self.eventfd.poll_read_ready(cx) {
                Poll::Ready(Ok(guard)) => guard,
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            };
            // Drain the counter; `try_io` clears tokio's readiness only on `WouldBlock`, and the
            // loop re-checks the completion queue after every drain, so no wake-up is lost.
            let _ = guard.try_io(|fd| {
                let mut counter = [0u8; 8];
                // SAFETY: reads 8 bytes into a local buffer of 8 bytes.
                let r = unsafe { libc::read(fd.as_raw_fd(), counter.as_mut_ptr().cast(), 8) };
                if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
            });
        }
    }

    fn awake(&mut self) {
        // Nobody sleeps on the eventfd any more: completions stop signalling it (and waking the
        // reactor thread) until the next sleep.
        self.ring.completion().disable_eventfd();
    }

    fn has_pending_output(&self) -> bool {
        self.conns.iter().flatten().any(|c| c.ended.is_none() && (c.send_busy || !c.writer.is_empty()))
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        // Reported by `progress` once the in-flight operations are reaped.
        if let Some(c) = self.conns.get_mut(peer as usize).and_then(Option::as_mut) {
            c.end(reason);
        }
    }
}

impl Drop for UringTcp {
    fn drop(&mut self) {
        let mut busy = 0;
        for c in self.conns.iter_mut().flatten() {
            c.end(TransportError::Closed);
            busy += c.recv_busy as usize + c.send_busy as usize;
        }
        // Closing the ring cancels its requests only asynchronously, so wait for every completion
        // before the buffers go; if that fails, leak the connections rather than risk the kernel
        // writing into freed memory.
        busy = busy.saturating_sub(self.ring.completion().count());
        if !self.reap_all(busy) {
            tracing::error!("tcp-uring: operations still in flight at drop; leaking their buffers");
            std::mem::forget(std::mem::take(&mut self.conns));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::submit_now;

    #[test]
    fn a_receive_rearmed_after_a_completion_waits_one_round_and_output_never() {
        // (pushed a sendmsg, reaped a receive, entries left by an earlier round) -> submit now
        let cases = [
            ((false, true, false), false), // re-armed receive only: left for the reply's entry
            ((true, true, false), true),   // the reply came in the same round
            ((false, true, true), true),   // left once already
            ((false, false, false), true), // first arming, or after a cancelled receive
            ((true, false, false), true),
            ((true, false, true), true),
            ((false, false, true), true),
            ((true, true, true), true),
        ];
        for ((send, recv, left), want) in cases {
            assert_eq!(submit_now(send, recv, left), want, "send {send}, recv {recv}, left {left}");
        }
    }
}
