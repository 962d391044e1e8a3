//! Large buffers reused across a communicator's collective calls.

use super::*;

/// Large buffers reused across the collective calls of a communicator. A fresh multi-megabyte
/// allocation is zeroed and faults in a page per 4 KiB on first touch, which dominated large
/// collectives (a 1 MiB broadcast into fresh buffers runs at a fraction of the transport's speed:
/// `ferrocomm-bench collectives --ops bcast --no-mpi`). Bounded in count and bytes; small buffers are not kept.
#[derive(Default)]
pub(crate) struct Pool {
    bufs: parking_lot::Mutex<Vec<BytesMut>>,
}

impl Pool {
    /// Buffers below this size come from the allocator.
    pub(super) const MIN: usize = 32 << 10;
    pub(super) const MAX_BUFFERS: usize = 16;
    pub(super) const MAX_BYTES: usize = 256 << 20;

    /// A buffer of `len` initialized bytes (contents unspecified).
    pub(super) fn take(&self, len: usize) -> BytesMut {
        if len >= Pool::MIN {
            let mut bufs = self.bufs.lock();
            // The smallest buffer that fits, if it is not absurdly larger.
            let best = (bufs.iter().enumerate())
                .filter(|(_, b)| b.len() >= len && b.len() <= len.saturating_mul(4))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let mut b = bufs.remove(i);
                b.truncate(len);
                return b;
            }
        }
        BytesMut::zeroed(len)
    }

    pub(super) fn give(&self, buf: BytesMut) {
        if buf.len() < Pool::MIN {
            return;
        }
        let mut bufs = self.bufs.lock();
        // Full: make room by dropping the oldest buffers (the sizes in use drift with the workload).
        while !bufs.is_empty()
            && (bufs.len() >= Pool::MAX_BUFFERS
                || bufs.iter().map(BytesMut::len).sum::<usize>() + buf.len() > Pool::MAX_BYTES)
        {
            bufs.remove(0);
        }
        if buf.len() <= Pool::MAX_BYTES {
            bufs.push(buf);
        }
    }

    /// `data` copied into a pooled buffer.
    pub(super) fn copy<T: Element>(&self, data: &[T]) -> Bytes {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut b = self.take(bytes.len());
        b.copy_from_slice(bytes);
        b.freeze()
    }

    /// Takes back the blocks of a finished collective that nothing else holds.
    pub(super) fn recycle(&self, blocks: Blocks) {
        blocks.into_values().filter_map(|b| b.try_into_mut().ok()).for_each(|b| self.give(b));
    }
}
