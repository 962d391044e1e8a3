//! Transfer geometries: which bytes of the local buffer go to (or come from) which bytes of the
//! remote segment.
//!
//! A transfer is a sequence of *runs* of `block` contiguous bytes: `count[0]` runs per row,
//! `count[1]` rows. Each side places run `(i, j)` at `offset + i * stride[0] + j * stride[1]`, with
//! strides of its own, so one call covers AOS's geometries: linear (one run), strided (separate
//! local and remote strides, "spaced remote, sparse local"), and 2-D and 3-D boxes inside larger
//! arrays ([`Geometry::sub_array`]). Bytes travel in run order (`i` fastest): the *stream*, in
//! which run `k = j * count[0] + i` occupies `k * block .. (k + 1) * block`. The emulated path
//! cuts the stream into messages and each side maps stream ranges back to its own offsets
//! (`Layout::pieces`).
//!
//! Everything is checked arithmetic: a geometry whose size or reach overflows is an error, never a
//! wrapped offset.

use std::ops::Range;

use super::RmaError;

/// One side of a transfer: where its first run starts and how far apart its runs are (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Side {
    /// Offset of run `(0, 0)`.
    pub offset: usize,
    /// Distance between consecutive runs of a row, and between consecutive rows.
    pub stride: [usize; 2],
}

impl Side {
    /// A side starting at `offset` whose runs are `stride` apart (one row).
    pub const fn at(offset: usize, stride: usize) -> Side {
        Side { offset, stride: [stride, 0] }
    }
}

/// The shape of a transfer and where it lies on each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Geometry {
    /// Contiguous bytes per run.
    pub block: usize,
    /// Runs per row, and rows.
    pub count: [usize; 2],
    /// Where the runs are in the local buffer.
    pub local: Side,
    /// Where the runs are in the remote segment.
    pub remote: Side,
}

/// A box inside a 3-D array of fixed-size elements (x varies fastest): the array's dimensions and
/// the box's first element. A 2-D array has `dims[2] == 1`, a 1-D array `dims[1] == dims[2] == 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArrayView {
    /// The array's extent in elements along x, y and z.
    pub dims: [usize; 3],
    /// The box's first element (x, y, z).
    pub origin: [usize; 3],
}

impl ArrayView {
    /// A 2-D array of `width` x `height` elements, the box starting at column `x`, row `y`.
    pub const fn plane(width: usize, height: usize, x: usize, y: usize) -> ArrayView {
        ArrayView { dims: [width, height, 1], origin: [x, y, 0] }
    }
}

fn bad(what: &str) -> RmaError {
    RmaError::Geometry(what.to_string())
}

impl Geometry {
    /// `len` contiguous bytes, from `local_offset` in the local buffer to (or from) `remote_offset`
    /// in the segment.
    pub const fn contiguous(local_offset: usize, remote_offset: usize, len: usize) -> Geometry {
        Geometry { block: len, count: [1, 1], local: Side::at(local_offset, 0), remote: Side::at(remote_offset, 0) }
    }

    /// `count` runs of `block` bytes, `local` and `remote` giving each side's first offset and
    /// stride.
    pub const fn strided(block: usize, count: usize, local: Side, remote: Side) -> Geometry {
        Geometry { block, count: [count, 1], local, remote }
    }

    /// A box of `extent` elements of `elem` bytes, located in a local array by `local` and in a
    /// remote array (the segment, from offset 0) by `remote`. The arrays may differ in size (a
    /// tile with its halo locally, the whole grid remotely).
    pub fn sub_array(
        elem: usize,
        extent: [usize; 3],
        local: ArrayView,
        remote: ArrayView,
    ) -> Result<Geometry, RmaError> {
        let side = |v: &ArrayView, name: &str| -> Result<Side, RmaError> {
            for (d, &e) in extent.iter().enumerate() {
                let end = v.origin[d].checked_add(e).ok_or_else(|| bad("box overflows"))?;
                if end > v.dims[d] {
                    return Err(RmaError::Geometry(format!(
                        "the box reaches {end} in dimension {d} of the {name} array of {:?}",
                        v.dims
                    )));
                }
            }
            let row = elem.checked_mul(v.dims[0]).ok_or_else(|| bad("array too large"))?;
            let plane = row.checked_mul(v.dims[1]).ok_or_else(|| bad("array too large"))?;
            let offset = v.origin[2]
                .checked_mul(plane)
                .and_then(|z| z.checked_add(v.origin[1].checked_mul(row)?))
                .and_then(|zy| zy.checked_add(v.origin[0].checked_mul(elem)?))
                .ok_or_else(|| bad("array too large"))?;
            Ok(Side { offset, stride: [row, plane] })
        };
        let block = elem.checked_mul(extent[0]).ok_or_else(|| bad("box too large"))?;
        let g = Geometry {
            block,
            count: [extent[1], extent[2]],
            local: side(&local, "local")?,
            remote: side(&remote, "remote")?,
        };
        g.bytes()?;
        Ok(g)
    }

    /// Bytes transferred.
    pub fn bytes(&self) -> Result<usize, RmaError> {
        self.remote_layout().bytes()
    }

    /// The runs as the local side lays them out.
    pub(crate) fn local_layout(&self) -> Layout {
        Layout { block: self.block, count: self.count, side: self.local }
    }

    /// The runs as the remote side lays them out.
    pub(crate) fn remote_layout(&self) -> Layout {
        Layout { block: self.block, count: self.count, side: self.remote }
    }

    /// Checks both sides' arithmetic and the local buffer (`local_len` bytes); returns the bytes
    /// transferred and the remote span (first byte, length) for the bounds check.
    pub(crate) fn check_local(&self, local_len: usize) -> Result<(usize, (usize, usize)), RmaError> {
        let bytes = self.bytes()?;
        let (lo, llen) = self.local_layout().span()?;
        if bytes > 0 && lo.checked_add(llen).is_none_or(|e| e > local_len) {
            return Err(RmaError::Geometry(format!(
                "the local side reaches {} bytes past {lo} in a buffer of {local_len}",
                llen
            )));
        }
        Ok((bytes, self.remote_layout().span()?))
    }

    /// (local offset, remote offset) of every run, in stream order.
    pub(crate) fn runs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (l, r) = (self.local_layout(), self.remote_layout());
        let runs = if self.block == 0 { 0 } else { self.count[0] * self.count[1] };
        (0..runs).map(move |k| (l.run(k), r.run(k)))
    }
}

/// One side's runs: enough to map stream ranges to offsets. The emulated path sends the remote
/// side's layout to the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub block: usize,
    pub count: [usize; 2],
    pub side: Side,
}

impl Layout {
    /// Contiguous bytes at `offset`.
    #[cfg(test)]
    pub(crate) fn contiguous(offset: usize, len: usize) -> Layout {
        Layout { block: len, count: [1, 1], side: Side::at(offset, 0) }
    }

    /// Bytes in the stream.
    pub(crate) fn bytes(&self) -> Result<usize, RmaError> {
        self.block
            .checked_mul(self.count[0])
            .and_then(|b| b.checked_mul(self.count[1]))
            .ok_or_else(|| bad("size overflows"))
    }

    /// First byte and length of the range the runs cover (`(offset, 0)` for an empty transfer);
    /// the end may overflow, which no bounds check passes.
    pub(crate) fn span(&self) -> Result<(usize, usize), RmaError> {
        if self.bytes()? == 0 {
            return Ok((self.side.offset, 0));
        }
        let [s0, s1] = self.side.stride;
        let reach = (self.count[0] - 1)
            .checked_mul(s0)
            .and_then(|a| a.checked_add((self.count[1] - 1).checked_mul(s1)?))
            .and_then(|a| a.checked_add(self.block))
            .ok_or_else(|| bad("reach overflows"))?;
        // An offset so large that the end overflows is out of bounds, which the bounds check
        // (checked too) says.
        Ok((self.side.offset, reach))
    }

    /// Offset of run `k` (which must exist in a layout whose span was checked).
    #[inline]
    fn run(&self, k: usize) -> usize {
        let (i, j) = (k % self.count[0], k / self.count[0]);
        self.side.offset + i * self.side.stride[0] + j * self.side.stride[1]
    }

    /// The pieces of stream range `stream` (inside `0..bytes()`): (offset on this side, offset in
    /// the stream, length), in stream order, each within one run.
    pub(crate) fn pieces(&self, stream: Range<usize>) -> Pieces {
        Pieces { layout: *self, at: stream.start, end: stream.end }
    }
}

/// Iterator of [`Layout::pieces`].
pub(crate) struct Pieces {
    layout: Layout,
    at: usize,
    end: usize,
}

impl Iterator for Pieces {
    type Item = (usize, usize, usize);
    fn next(&mut self) -> Option<(usize, usize, usize)> {
        if self.at >= self.end || self.layout.block == 0 {
            return None;
        }
        let b = self.layout.block;
        let (k, within) = (self.at / b, self.at % b);
        let len = (b - within).min(self.end - self.at);
        let piece = (self.layout.run(k) + within, self.at, len);
        self.at += len;
        Some(piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: byte by byte, run by run, straight from the definition.
    fn reference_put(g: &Geometry, src: &[u8], dst: &mut [u8]) {
        for j in 0..g.count[1] {
            for i in 0..g.count[0] {
                for b in 0..g.block {
                    let l = g.local.offset + i * g.local.stride[0] + j * g.local.stride[1] + b;
                    let r = g.remote.offset + i * g.remote.stride[0] + j * g.remote.stride[1] + b;
                    dst[r] = src[l];
                }
            }
        }
    }

    /// Through the stream, cut into `chunk`-byte messages as the emulated path does.
    fn streamed_put(g: &Geometry, src: &[u8], dst: &mut [u8], chunk: usize) {
        let bytes = g.bytes().unwrap();
        let mut at = 0;
        while at < bytes {
            let end = (at + chunk).min(bytes);
            let mut msg = vec![0u8; end - at];
            for (lo, so, len) in g.local_layout().pieces(at..end) {
                msg[so - at..so - at + len].copy_from_slice(&src[lo..lo + len]);
            }
            for (ro, so, len) in g.remote_layout().pieces(at..end) {
                dst[ro..ro + len].copy_from_slice(&msg[so - at..so - at + len]);
            }
            at = end;
        }
    }

    fn runs_put(g: &Geometry, src: &[u8], dst: &mut [u8]) {
        for (l, r) in g.runs() {
            dst[r..r + g.block].copy_from_slice(&src[l..l + g.block]);
        }
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn sub_array_3d_against_reference() {
        // A 3x4x2 box of 8-byte elements from a 5x6x4 local array at (1,2,1) into a 10x8x3 remote
        // array at (6,3,1).
        let local = ArrayView { dims: [5, 6, 4], origin: [1, 2, 1] };
        let remote = ArrayView { dims: [10, 8, 3], origin: [6, 3, 1] };
        let g = Geometry::sub_array(8, [3, 4, 2], local, remote).unwrap();
        assert_eq!(g.bytes().unwrap(), 3 * 4 * 2 * 8);
        let src = pattern(5 * 6 * 4 * 8);
        let mut want = vec![0u8; 10 * 8 * 3 * 8];
        // The definition in array coordinates.
        for z in 0..2 {
            for y in 0..4 {
                for x in 0..3 {
                    let l = (((1 + z) * 6 + (2 + y)) * 5 + (1 + x)) * 8;
                    let r = (((1 + z) * 8 + (3 + y)) * 10 + (6 + x)) * 8;
                    want[r..r + 8].copy_from_slice(&src[l..l + 8]);
                }
            }
        }
        let mut got = vec![0u8; want.len()];
        reference_put(&g, &src, &mut got);
        assert_eq!(got, want);
        for chunk in [1, 7, 24, 100, 1 << 20] {
            let mut s = vec![0u8; want.len()];
            streamed_put(&g, &src, &mut s, chunk);
            assert_eq!(s, want, "chunk {chunk}");
        }
        let (_, (start, len)) = g.check_local(src.len()).unwrap();
        assert!(start + len <= want.len());
        let (lstart, llen) = g.local_layout().span().unwrap();
        assert!(g.check_local(lstart + llen).is_ok());
        assert!(g.check_local(lstart + llen - 1).is_err(), "one byte short of the box's last element");
    }

    #[test]
    fn sub_array_rejects_boxes_outside_their_array() {
        let ok = ArrayView::plane(4, 4, 0, 0);
        assert!(Geometry::sub_array(1, [2, 2, 1], ok, ArrayView::plane(4, 4, 3, 0)).is_err());
        assert!(Geometry::sub_array(1, [2, 2, 1], ArrayView::plane(4, 4, 0, 3), ok).is_err());
        assert!(Geometry::sub_array(usize::MAX, [2, 1, 1], ok, ok).is_err());
        assert!(Geometry::sub_array(1, [1, 1, 2], ok, ok).is_err());
    }

    #[test]
    fn overflowing_layouts_are_errors() {
        let g = Geometry::strided(8, usize::MAX, Side::at(0, 8), Side::at(0, 8));
        assert!(g.bytes().is_err());
        let g = Geometry::strided(8, 4, Side::at(0, 8), Side::at(usize::MAX - 8, 8));
        let (start, len) = g.remote_layout().span().unwrap();
        let r = RmaError::check(crate::rma::Access::PUT, crate::rma::Access::WINDOW, start as u64, len as u64, 1 << 20);
        assert!(matches!(r, Err(RmaError::OutOfBounds { .. })));
        let g = Geometry::strided(8, 4, Side::at(0, 8), Side::at(0, usize::MAX / 2));
        assert!(g.remote_layout().span().is_err(), "the reach itself overflows");
        let g = Geometry::strided(8, 4, Side::at(0, usize::MAX / 2), Side::at(0, 8));
        assert!(g.check_local(1 << 20).is_err());
    }

    #[test]
    fn empty_transfers() {
        let g = Geometry::contiguous(5, 10, 0);
        assert_eq!(g.bytes().unwrap(), 0);
        assert_eq!(g.runs().count(), 0);
        assert_eq!(g.remote_layout().span().unwrap(), (10, 0));
        let g = Geometry::strided(0, 5, Side::at(0, 1), Side::at(0, 1));
        assert_eq!(g.remote_layout().pieces(0..0).count(), 0);
    }

    proptest! {
        /// Strided and 2-D/3-D geometries with separate local and remote strides (including
        /// strides shorter than the block, where later runs overwrite earlier ones, as at the
        /// target): whole runs and streamed pieces give the reference's result.
        #[test]
        fn geometries_match_the_reference(
            block in 0usize..20,
            c0 in 1usize..6,
            c1 in 1usize..4,
            lo in 0usize..16,
            ro in 0usize..16,
            ls in (0usize..30, 0usize..120),
            rs in (0usize..30, 0usize..120),
            chunk in 1usize..50,
        ) {
            let g = Geometry {
                block,
                count: [c0, c1],
                local: Side { offset: lo, stride: [ls.0, ls.1] },
                remote: Side { offset: ro, stride: [rs.0, rs.1] },
            };
            let (bytes, (rstart, rlen)) = g.check_local(2048).unwrap();
            prop_assert_eq!(bytes, block * c0 * c1);
            prop_assert_eq!(rstart, ro);
            let src = pattern(2048);
            let mut want = vec![0u8; rstart + rlen + 1];
            reference_put(&g, &src, &mut want);
            let mut a = vec![0u8; want.len()];
            runs_put(&g, &src, &mut a);
            prop_assert_eq!(&a, &want);
            let mut b = vec![0u8; want.len()];
            streamed_put(&g, &src, &mut b, chunk);
            prop_assert_eq!(&b, &want);
            // Every piece stays inside the span.
            for (off, _, len) in g.remote_layout().pieces(0..bytes) {
                prop_assert!(off >= rstart && off + len <= rstart + rlen);
            }
        }
    }
}
