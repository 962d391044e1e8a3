//! The portable backend's doorbell on Linux: its sockets sit in an epoll set of their own, each
//! armed one-shot, and only a sleeper arms them.
//!
//! Why not tokio's own registration: tokio watches a socket edge-triggered for as long as it
//! lives, so every segment that arrives wakes the reactor thread, also while a caller spins on the
//! socket and reads the segment itself; on a busy-polling rank that thread then takes the CPU of
//! the spinning caller once per message. Here a socket is armed one-shot (`EPOLLONESHOT`) by
//! [`Bell::arm`], only when the progress loop goes to sleep ([`crate::Transport::poll_ready`]);
//! tokio watches the one epoll descriptor. One-shot ends with the event's *report*, not its
//! arrival: a socket that fired and was not yet taken ([`Bell::take_fired`]) wakes tokio's epoll
//! again at every segment. So when the progress loop stands aside for spinning callers
//! ([`crate::Transport::stand_aside`]) it takes what fired and disarms the rest ([`Bell::disarm`]).
//! A sleep re-arms only the sockets that are not armed (one `epoll_ctl` each).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::task::{Context, Poll};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Events a socket is armed for: readable (data or end), and writable while output waits.
fn events(output: bool) -> u32 {
    let read = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
    if output { read | libc::EPOLLOUT as u32 } else { read }
}

/// One epoll set; sockets are keyed by their index (the peer's rank).
pub(crate) struct Bell {
    epoll: AsyncFd<OwnedFd>,
    /// What each key is armed for now (0: not armed; it fired, or was never armed).
    armed: Vec<u32>,
    events: Vec<libc::epoll_event>,
}

impl Bell {
    /// An empty set for keys `0..n`. Call inside the tokio runtime that runs the progress loop.
    pub(crate) fn new(n: usize) -> io::Result<Bell> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: the `OwnedFd` keeps the descriptor open, unchanged, for the `AsyncFd`'s lifetime.
        let epoll = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(Bell { epoll, armed: vec![0; n], events: Vec::with_capacity(n.clamp(1, 256)) })
    }

    /// Adds socket `fd` as `key`, not armed.
    pub(crate) fn add(&mut self, key: usize, fd: RawFd) -> io::Result<()> {
        // One-shot with no event of its own: until armed it reports only what epoll always
        // reports (an error or a hang-up), once.
        self.ctl(libc::EPOLL_CTL_ADD, key, fd, 0)?;
        self.armed[key] = 0;
        Ok(())
    }

    /// Arms `key` (socket `fd`) for reading, and writing if `output`, unless it is armed for
    /// that already. A socket that is ready already reports at once.
    pub(crate) fn arm(&mut self, key: usize, fd: RawFd, output: bool) -> io::Result<()> {
        let want = events(output);
        if self.armed[key] != want {
            self.ctl(libc::EPOLL_CTL_MOD, key, fd, want)?;
            self.armed[key] = want;
        }
        Ok(())
    }

    /// Whether `key` is armed (it may have fired since: [`Bell::take_fired`] says).
    pub(crate) fn is_armed(&self, key: usize) -> bool {
        self.armed.get(key).is_some_and(|&a| a != 0)
    }

    /// Disarms `key` (socket `fd`): it reports nothing until armed again.
    pub(crate) fn disarm(&mut self, key: usize, fd: RawFd) -> io::Result<()> {
        if self.is_armed(key) {
            self.ctl(libc::EPOLL_CTL_MOD, key, fd, 0)?;
            self.armed[key] = 0;
        }
        Ok(())
    }

    /// Takes the keys that fired since the last call (each is disarmed by firing); returns how
    /// many did.
    pub(crate) fn take_fired(&mut self) -> usize {
        let mut fired = 0;
        loop {
            self.events.clear();
            let cap = self.events.capacity();
            // SAFETY: the kernel writes at most `cap` events into the vector's spare capacity;
            // timeout 0: never blocks.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), self.events.as_mut_ptr(), cap as i32, 0) };
            if n <= 0 {
                return fired;
            }
            // SAFETY: the kernel initialised the first `n` events.
            unsafe { self.events.set_len(n as usize) };
            for e in &self.events {
                if let Some(a) = self.armed.get_mut(e.u64 as usize) {
                    *a = 0;
                }
            }
            fired += n as usize;
            if (n as usize) < cap {
                return fired;
            }
        }
    }

    /// `Ready` if a key fired (taken as by [`Bell::take_fired`]); otherwise registers `cx` to be
    /// woken when one does.
    pub(crate) fn poll_fired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.take_fired() > 0 {
                return Poll::Ready(());
            }
            match self.epoll.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(mut guard)) => {
                    // Nothing was pending a moment ago; clear tokio's readiness and look again, so
                    // that an event that came in between is not lost.
                    guard.clear_ready();
                }
            }
        }
    }

    fn ctl(&self, op: i32, key: usize, fd: RawFd, events: u32) -> io::Result<()> {
        let mut e = libc::epoll_event { events: events | libc::EPOLLONESHOT as u32, u64: key as u64 };
        // SAFETY: plain syscall on descriptors we hold; `e` is a valid epoll_event.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), op, fd, &mut e) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (a, l.accept().unwrap().0)
    }

    /// Waits until `fd` is readable (data or end arrived; loopback delivery may be deferred to
    /// a kernel thread on a loaded machine), without reading it.
    fn arrived(fd: RawFd) {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut p, 1, 60_000) };
        assert_eq!(n, 1, "nothing arrived on fd {fd} within a minute");
    }

    fn noop() -> Context<'static> {
        Context::from_waker(std::task::Waker::noop())
    }

    /// One-shot ends with the report: a socket that fired and was not taken makes the bell's own
    /// descriptor signal again at its next segment (tokio's reactor thread woke at every message
    /// so while callers spun); disarmed, it signals nothing, and armed again it reports at once
    /// what came meanwhile.
    #[test]
    fn a_fired_socket_rings_until_taken_and_a_disarmed_one_never() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let (mut a, b) = pair();
        let mut bell = Bell::new(1).unwrap();
        bell.add(0, b.as_raw_fd()).unwrap();
        // An edge-triggered watcher of the bell's descriptor, as tokio's reactor is.
        // SAFETY: plain syscalls; the descriptor is owned at once.
        let outer = unsafe { OwnedFd::from_raw_fd(libc::epoll_create1(libc::EPOLL_CLOEXEC)) };
        let mut e = libc::epoll_event { events: (libc::EPOLLIN | libc::EPOLLET) as u32, u64: 0 };
        // SAFETY: valid descriptors and event.
        let added = unsafe { libc::epoll_ctl(outer.as_raw_fd(), libc::EPOLL_CTL_ADD, bell.epoll.as_raw_fd(), &mut e) };
        assert_eq!(added, 0);
        let signals = || {
            let mut ev = [libc::epoll_event { events: 0, u64: 0 }; 4];
            // SAFETY: room for 4 events; timeout 0.
            unsafe { libc::epoll_wait(outer.as_raw_fd(), ev.as_mut_ptr(), 4, 0) }
        };
        let mut x = [0u8; 1];

        bell.arm(0, b.as_raw_fd(), false).unwrap();
        assert_eq!(signals(), 0);
        a.write_all(b"1").unwrap();
        arrived(b.as_raw_fd());
        assert_eq!(signals(), 1);
        // A spinning caller reads the socket itself; the bell is not taken.
        (&b).read_exact(&mut x).unwrap();
        a.write_all(b"2").unwrap();
        arrived(b.as_raw_fd());
        assert_eq!(signals(), 1, "a fired socket not taken rings at the next segment too");
        (&b).read_exact(&mut x).unwrap();

        bell.disarm(0, b.as_raw_fd()).unwrap();
        assert!(!bell.is_armed(0));
        a.write_all(b"3").unwrap();
        arrived(b.as_raw_fd());
        assert_eq!(signals(), 0, "a disarmed socket rang");
        assert_eq!(bell.take_fired(), 0);

        bell.arm(0, b.as_raw_fd(), false).unwrap();
        assert_eq!(bell.take_fired(), 1, "armed again with data waiting, it reports at once");
    }

    #[test]
    fn a_socket_rings_once_per_arming_and_never_unarmed() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _g = rt.enter();
        let (mut a, b) = pair();
        let (mut c, d) = pair();
        let mut bell = Bell::new(2).unwrap();
        bell.add(0, b.as_raw_fd()).unwrap();
        bell.add(1, d.as_raw_fd()).unwrap();

        // Not armed: data arriving rings nothing.
        a.write_all(b"x").unwrap();
        arrived(b.as_raw_fd());
        assert_eq!(bell.take_fired(), 0);

        // Armed while data waits: rings at once, once.
        bell.arm(0, b.as_raw_fd(), false).unwrap();
        bell.arm(1, d.as_raw_fd(), false).unwrap();
        assert_eq!(bell.take_fired(), 1);
        assert_eq!(bell.armed, [0, events(false)]);
        let mut x = [0u8; 1];
        (&b).read_exact(&mut x).unwrap();
        a.write_all(b"y").unwrap();
        arrived(b.as_raw_fd());
        assert_eq!(bell.take_fired(), 0, "fired twice for one arming");

        // The armed, idle one rings when its data comes; arming it again costs nothing.
        bell.arm(1, d.as_raw_fd(), false).unwrap();
        c.write_all(b"z").unwrap();
        arrived(d.as_raw_fd());
        assert!(rt.block_on(std::future::poll_fn(|cx| Poll::Ready(bell.poll_fired(cx)))).is_ready());
        assert_eq!(bell.armed, [0, 0]);

        // Writable: armed for output, an idle connection's socket reports at once.
        let mut cx = noop();
        assert!(bell.poll_fired(&mut cx).is_pending());
        bell.arm(1, d.as_raw_fd(), true).unwrap();
        assert_eq!(bell.take_fired(), 1);

        // A peer that hangs up rings an armed, idle socket.
        let mut z = [0u8; 1];
        (&d).read_exact(&mut z).unwrap();
        assert_eq!(&z, b"z");
        bell.arm(1, d.as_raw_fd(), false).unwrap();
        assert_eq!(bell.take_fired(), 0);
        drop(c);
        arrived(d.as_raw_fd());
        assert_eq!(bell.take_fired(), 1);
    }
}
