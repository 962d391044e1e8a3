//! The system calls behind segment memory: an anonymous shared file (a memfd on Linux, so nothing
//! is ever named in /dev/shm and nothing outlives the last process that maps it), and fetching a
//! peer's descriptor of one (`pidfd_getfd`) to map it.

use std::fs::File;
use std::io;

/// A new anonymous file of `len` zero bytes that can be mapped shared.
#[cfg(target_os = "linux")]
pub(crate) fn shared_file(len: usize) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: the name is a valid C string; the descriptor returned is owned by nobody else.
    let fd = unsafe { libc::memfd_create(c"ferrocomm-rma".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is fresh and owned here.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len as u64)?;
    Ok(file)
}

/// A new anonymous file of `len` zero bytes that can be mapped shared: created and unlinked at
/// once in the temporary directory (no memfd outside Linux).
#[cfg(not(target_os = "linux"))]
pub(crate) fn shared_file(len: usize) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).map_err(io::Error::other)?;
    let path = std::env::temp_dir().join(format!("ferrocomm-rma-{:016x}", u64::from_le_bytes(nonce)));
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
    let _ = std::fs::remove_file(&path);
    file.set_len(len as u64)?;
    Ok(file)
}

/// Descriptor `fd` of process `pid`, duplicated into this process (`pidfd_open` + `pidfd_getfd`,
/// which need the right to ptrace the process: the same user under Yama's default scope).
#[cfg(target_os = "linux")]
pub(crate) fn fetch_fd(pid: i32, fd: i32) -> io::Result<File> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let cvt = |r: libc::c_long| if r < 0 { Err(io::Error::last_os_error()) } else { Ok(r as i32) };
    // SAFETY: plain system calls; each returned descriptor is fresh and owned here.
    let pidfd = unsafe { OwnedFd::from_raw_fd(cvt(libc::syscall(libc::SYS_pidfd_open, pid, 0))?) };
    use std::os::fd::AsRawFd;
    // SAFETY: as above.
    let got = cvt(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) })?;
    // SAFETY: `got` is fresh and owned here.
    Ok(unsafe { File::from_raw_fd(got) })
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn fetch_fd(_pid: i32, _fd: i32) -> io::Result<File> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "pidfd_getfd is Linux-only"))
}
