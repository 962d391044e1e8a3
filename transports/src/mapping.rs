//! Shared files of a job in /dev/shm and their read-write mappings: the memory the shared-memory
//! transport's rings and the collectives' board live in. Every such file is named by
//! [`shared_file_name`], the pattern `shm::remove_leftovers` cleans up after a crash.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use crate::wire::Rank;

/// The name of a shared file of job `job` owned by (or named after) rank `rank`; `nonce` tells a
/// rank's files apart. Also the shared-memory transport's fallback doorbell name.
pub fn shared_file_name(job: &str, rank: Rank, nonce: u64) -> String {
    format!("ferrocomm-{job}-{rank}-{nonce:016x}")
}

/// The path of [`shared_file_name`] in /dev/shm.
pub fn shared_file_path(job: &str, rank: Rank, nonce: u64) -> PathBuf {
    PathBuf::from(format!("/dev/shm/{}", shared_file_name(job, rank, nonce)))
}

/// A shared, read-write mapping of a whole file; unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the protocol of
// whoever reads and writes through `ptr` (the rings, the collectives' board).
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: `&Mapping` only hands out the pointer and length; every access through
// the pointer is `unsafe` and synchronised by that protocol.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `file`, shared and read-write (the file must be that long).
    pub fn new(file: &File, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh mapping of `len` bytes of `file`; nothing else refers to that range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    /// The first byte of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pre-faults `off..off + len` for writing, so the first pass through a ring takes no page
    /// faults (best effort: older kernels lack it).
    #[cfg(target_os = "linux")]
    pub fn populate(&self, off: usize, len: usize) {
        let page = 4096;
        let start = off / page * page;
        let end = (off + len).min(self.len);
        // SAFETY: the range lies inside the mapping; the advice does not change its contents.
        unsafe { libc::madvise(self.ptr.add(start).cast(), end - start, libc::MADV_POPULATE_WRITE) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; the owner keeps no reference past this point.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
