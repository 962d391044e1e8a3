//! The Linux calls the shared-memory transport needs, wrapped safely.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

fn cvt(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r) }
}

/// Whether an error means "the kernel does not let us" (ptrace rules, seccomp, old kernel).
pub(crate) fn is_denied(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::ENOSYS))
}

/// A non-blocking eventfd.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned descriptor is owned by the caller.
    let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) } as libc::c_long)?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Adds one to an eventfd's counter. A full counter means the reader will wake anyway.
pub(crate) fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from a live u64.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd. `Ok(true)`: it had been signalled.
pub(crate) fn eventfd_drain(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a live u64.
    let r = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if r == 8 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock { Ok(false) } else { Err(e) }
}

/// A pidfd for `pid`: becomes readable when that process exits.
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned descriptor is owned by the caller.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Duplicates descriptor `fd` of the process behind `pidfd` into this process (close-on-exec).
pub(crate) fn pidfd_getfd(pidfd: BorrowedFd<'_>, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned descriptor is owned by the caller.
    let fd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) })?;
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether `fd` is an eventfd (so that writing 8 bytes to it cannot harm a file of the peer).
pub(crate) fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}

/// Indices of the pidfds whose process has exited (one `poll`, no waiting).
pub(crate) fn exited(fds: &[BorrowedFd<'_>]) -> Vec<usize> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|fd| libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `pfds` is a live array of `pfds.len()` pollfds.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 0) };
    if n <= 0 {
        return Vec::new();
    }
    pfds.iter().enumerate().filter(|(_, p)| p.revents != 0).map(|(i, _)| i).collect()
}

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (cross-memory attach).
pub(crate) fn read_remote(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let len = dst.len();
    copy_all(len, |done| {
        let local = libc::iovec { iov_base: dst[done..].as_mut_ptr().cast(), iov_len: len - done };
        let remote = libc::iovec { iov_base: (addr + done as u64) as *mut _, iov_len: len - done };
        // SAFETY: `local` describes writable memory we own; the remote side is checked by the kernel.
        unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) }
    })
}

/// Copies `src` into process `pid`'s memory at `addr` (`process_vm_writev`); the same kernel
/// permission as [`read_remote`].
pub(crate) fn write_remote(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    copy_all(src.len(), |done| {
        let local = libc::iovec { iov_base: src[done..].as_ptr() as *mut _, iov_len: src.len() - done };
        let remote = libc::iovec { iov_base: (addr + done as u64) as *mut _, iov_len: src.len() - done };
        // SAFETY: `local` describes memory we own (only read); the remote side is checked by the kernel.
        unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) }
    })
}

/// Repeats a cross-memory copy from byte `done` on until `len` bytes are copied.
fn copy_all(len: usize, mut copy: impl FnMut(usize) -> isize) -> io::Result<()> {
    let mut done = 0;
    while done < len {
        match copy(done) {
            n if n > 0 => done += n as usize,
            0 => return Err(io::Error::from_raw_os_error(libc::EFAULT)),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// When process `pid` started (clock ticks after boot), to tell it from a later one with the same
/// pid. `None` where /proc is not readable.
pub(crate) fn start_time(pid: &str) -> Option<u64> {
    let mut s = String::new();
    File::open(format!("/proc/{pid}/stat")).ok()?.read_to_string(&mut s).ok()?;
    // Field 22; the command name (field 2) is in parentheses and may contain anything.
    let rest = &s[s.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// 64 random bits.
pub(crate) fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into a live u64.
    let n = unsafe { libc::getrandom((&mut v as *mut u64).cast(), 8, 0) };
    if n != 8 {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        v = (t.as_nanos() as u64) ^ ((std::process::id() as u64) << 32);
    }
    v
}

/// The fallback doorbell where `pidfd_getfd` is not allowed: a datagram socket in the abstract
/// namespace (no file; it disappears with its process).
pub(crate) fn bell_socket(name: &str) -> io::Result<UnixDatagram> {
    let s = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// A socket connected to a peer's fallback doorbell.
pub(crate) fn bell_connect(name: &str) -> io::Result<UnixDatagram> {
    let s = UnixDatagram::unbound()?;
    s.connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// Rings a socket doorbell; a full queue means the reader will wake anyway.
pub(crate) fn socket_signal(s: &UnixDatagram) {
    let _ = s.send(&[1]);
}

/// Empties a socket doorbell. `Ok(true)`: it had been rung.
pub(crate) fn socket_drain(s: &UnixDatagram) -> io::Result<bool> {
    let mut rung = false;
    let mut b = [0u8; 16];
    loop {
        match s.recv(&mut b) {
            Ok(_) => rung = true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(rung),
            Err(e) => return Err(e),
        }
    }
}
