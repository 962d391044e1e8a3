//! One-sided operations carried out by the device (RDMA verbs): a segment published on a rank
//! whose transport has the one-sided capability is registered with the device, its address and
//! key travel in the attach answer, and peers reached over verbs turn puts and gets into RDMA
//! writes and reads (one work request per contiguous run of a geometry) and fetch-add and
//! compare-and-swap into RDMA atomics. The owner's own atomics on a registered segment go through
//! the device too (its loopback connection): RDMA atomics are atomic only among themselves.
//!
//! An unpublished registered segment stays registered, with its memory, until every rank that
//! attached to it has been told (`Revoke`) and has answered that none of its device operations
//! on it is in flight (`Released`), or is lost: a late write lands in memory that is still there,
//! and no peer's operation meets a key that is gone (which would break its connection).

use std::sync::Arc;

use ferrocomm_reactor::Progress;

use ferrocomm_transports::one_sided::{RemoteAccess, Run};
use smallvec::SmallVec;

use super::Access;
use super::geometry::Geometry;
use super::memory::{SegMem, SegmentKind};
use super::service::Service;
use crate::p2p::driver::Driver;

/// Registers `mem` with the device if the transport has one (windows with data only); a segment
/// the device refuses is served by requests.
pub(super) fn register(d: &mut Driver, service: impl FnOnce(&mut Driver) -> &mut Service, mem: &Arc<SegMem>) {
    if !matches!(mem.kind, SegmentKind::Window) || mem.len == 0 {
        return;
    }
    let Some(os) = d.transport.one_sided() else { return };
    let ptr = mem.data_ptr();
    let access = RemoteAccess {
        read: mem.access.contains(Access::GET),
        write: mem.access.contains(Access::PUT),
        // The device's atomics need 8-byte aligned words: so does the API, from an aligned base.
        atomic: mem.access.contains(Access::ATOMIC) && (ptr as usize).is_multiple_of(8),
    };
    // SAFETY: the memory stays mapped while the service holds `mem`: among its segments until
    // unpublished, then among its retired ones until the registration is ended (and the
    // transport, which ends every registration when dropped, goes before the service).
    match unsafe { os.register(ptr, mem.len, access) } {
        Ok((handle, key)) => service(d).registered(mem.id.serial(), handle, key),
        Err(e) => tracing::warn!(id = %mem.id, error = %e, "cannot register a segment with the device; using requests"),
    }
}

/// The runs of `g` in the remote segment whose data starts at `base`, in stream order (a
/// contiguous transfer's one run stays on the stack).
pub(super) fn runs(g: &Geometry, base: u64) -> SmallVec<[Run; 1]> {
    let block = g.remote_layout().block;
    g.runs().enumerate().map(|(k, (_, r))| Run { stream: k * block, addr: base + r as u64, len: block }).collect()
}

/// After an operation was posted, with the driver still locked: one round of progress as a
/// spinning caller makes it, which collects what the device has completed already. A software
/// device may carry out the operation within the posting call (Soft-RoCE: the request, the
/// target's side and the acknowledgement of an RDMA write or atomic run in the poster's system
/// call when both ends are on the same device), and an operation found complete here completes
/// in its call, without a waiting future, a second taking of the lock or a wakeup. Otherwise the
/// completion comes later, and this cost one progress round. The caller holds the lock as an
/// inline spin ([`ferrocomm_reactor::Reactor::with_spinning`]), so the reactor's background
/// task stays aside (rather than waking at each completion) while the caller issues operations.
pub(super) fn collect(d: &mut Driver) {
    d.progress();
}
