//! Copies into a ring that bypass the writer's cache (non-temporal stores).
//!
//! Why: a large body copied into the ring with ordinary stores sits dirty in the writer's cache,
//! and the reader pulls every line of it from there. How fast one CPU takes a dirty line from
//! another depends on where the two sit (across dies or sockets, or on a virtual machine whose
//! CPUs drift apart, it can cost 3-4x more). Non-temporal stores write whole lines toward memory
//! (no ownership of the ring's lines to take from the reader first), and the reader then finds
//! the body in memory, not in the other CPU's cache: a 64 KiB body moves at the same speed
//! wherever the CPUs sit, as fast as an ordinary copy between CPUs that share a cache, several
//! times faster between CPUs slow to hand lines over. At 8 KiB the two copies are even, below it
//! the ordinary copy wins, hence [`MIN`]. Compare
//! `FERROCOMM_SHM_NT_MIN=0 ferrocomm-bench pingpong --transport shm --max 64K --no-peer` with the
//! default. Ranks that share a CPU (more ranks than CPUs) read faster from the cache: bootstrap
//! turns this off for them.

/// Bodies of at least this many bytes are written with non-temporal stores.
pub(crate) const MIN: usize = 8 * 1024;

/// Copies `len` bytes from `src` to `dst`: with `nt`, the whole cache lines of `dst` by
/// non-temporal stores where the CPU has them (x86-64: SSE2, always), then `sfence`, so a release
/// store that publishes the bytes still comes after them; without, `ptr::copy_nonoverlapping`.
///
/// # Safety
/// As for `ptr::copy_nonoverlapping`.
#[inline]
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize, nt: bool) {
    #[cfg(target_arch = "x86_64")]
    if nt {
        // SAFETY: the caller's contract; every store stays inside `dst[..len]`, and the streamed
        // ones are 16-byte aligned (inside 64-byte aligned lines).
        unsafe { copy_streaming(dst, src, len) };
        return;
    }
    let _ = nt;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// The non-temporal copy of [`copy`].
#[cfg(target_arch = "x86_64")]
#[inline(never)]
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // SAFETY: see `copy`.
    unsafe {
        let head = dst.align_offset(64).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        while i + 64 <= len {
            for k in (0..64).step_by(16) {
                let v = _mm_loadu_si128(src.add(i + k).cast::<__m128i>());
                _mm_stream_si128(dst.add(i + k).cast::<__m128i>(), v);
            }
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 3200];
        for len in [0, 1, 15, 16, 63, 64, 65, 127, 128, 129, 1000, 2999] {
            for (from, to) in [(0, 0), (1, 0), (0, 1), (5, 37), (17, 64)] {
                let len = len.min(src.len() - from);
                dst.fill(0);
                // SAFETY: both ranges are inside their vectors and do not overlap.
                unsafe { super::copy(dst.as_mut_ptr().add(to), src.as_ptr().add(from), len, true) };
                assert_eq!(&dst[to..to + len], &src[from..from + len], "len {len} from {from} to {to}");
                assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0), "len {len}: outside");
            }
        }
    }
}
