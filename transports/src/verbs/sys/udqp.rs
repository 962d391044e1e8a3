//! The rdma-core calls UD multicast needs, beside the RC ones of the parent module: a UD queue
//! pair, multicast attach and detach, an address handle for the group, and a second completion
//! queue with its own completion channel (so that waiting for room to send and waiting for a
//! datagram are two separate readiness sources for tokio).
//!
//! A child of `sys` so that it reaches the device's context and protection domain without the
//! parent exposing them; every object is freed exactly once on drop, as there.

use std::io;
use std::os::fd::RawFd;
use std::ptr;

use super::{Device, PORT, check, ffi, last_err};

/// The destination QP number of every multicast send (IBA 10.8: "all QPs attached").
pub(in crate::verbs) const MULTICAST_QPN: u32 = 0xFF_FFFF;
/// Bytes of the global route header a UD receive buffer starts with, before the payload.
pub(in crate::verbs) const GRH: usize = 40;

/// A completion queue with a completion channel of its own, on a device's context.
pub(in crate::verbs) struct CompQueue {
    channel: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    unacked: u32,
}

// SAFETY: verbs objects may be used from any thread; the owner serializes use behind a lock.
unsafe impl Send for CompQueue {}

impl CompQueue {
    /// A queue of `entries` completions whose channel is read without blocking.
    pub(in crate::verbs) fn new(dev: &Device, entries: i32) -> io::Result<CompQueue> {
        // SAFETY: valid context.
        let channel = unsafe { ffi::ibv_create_comp_channel(dev.ctx) };
        if channel.is_null() {
            return Err(last_err("ibv_create_comp_channel"));
        }
        let mut q = CompQueue { channel, cq: ptr::null_mut(), unacked: 0 };
        let fd = q.fd();
        // SAFETY: fcntl on the channel's open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(last_err("fcntl(completion channel)"));
        }
        // SAFETY: valid context and channel.
        q.cq = unsafe { ffi::ibv_create_cq(dev.ctx, entries, ptr::null_mut(), q.channel, 0) };
        if q.cq.is_null() {
            return Err(last_err("ibv_create_cq"));
        }
        Ok(q)
    }

    /// The channel's descriptor (readable when the armed queue got a completion).
    pub(in crate::verbs) fn fd(&self) -> RawFd {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.channel).fd }
    }

    /// Polls up to `out.len()` completions; returns how many were written.
    pub(in crate::verbs) fn poll(&mut self, out: &mut [ffi::ibv_wc]) -> io::Result<usize> {
        // SAFETY: the CQ is valid; `out` has room for `out.len()` completions.
        let n = unsafe {
            let poll = (*(*self.cq).context).ops.poll_cq.expect("provider has poll_cq");
            poll(self.cq, out.len() as i32, out.as_mut_ptr())
        };
        if n < 0 { Err(io::Error::other("ibv_poll_cq failed")) } else { Ok(n as usize) }
    }

    /// Asks for a channel event on the next completion.
    pub(in crate::verbs) fn arm(&mut self) -> io::Result<()> {
        // SAFETY: the CQ is valid.
        let rc = unsafe {
            let notify = (*(*self.cq).context).ops.req_notify_cq.expect("provider has req_notify_cq");
            notify(self.cq, 0)
        };
        check(rc, "ibv_req_notify_cq")
    }

    /// Takes every pending event off the channel (non-blocking).
    pub(in crate::verbs) fn drain_events(&mut self) {
        loop {
            let mut cq = ptr::null_mut();
            let mut cq_ctx = ptr::null_mut();
            // SAFETY: the channel is non-blocking; the out pointers are valid.
            if unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            self.ack();
        }
    }

    fn ack(&mut self) {
        if self.unacked > 0 && !self.cq.is_null() {
            // SAFETY: the CQ is valid; exactly `unacked` events were taken.
            unsafe { ffi::ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
    }
}

impl Drop for CompQueue {
    fn drop(&mut self) {
        self.ack();
        // SAFETY: created here, destroyed once, the CQ before its channel; the owner destroys
        // every QP using the CQ first.
        unsafe {
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            ffi::ibv_destroy_comp_channel(self.channel);
        }
    }
}

/// A UD queue pair in RTS: sends go to its send queue's CQ, receives to the device's CQ.
/// Detaches from its groups and is destroyed on drop.
pub(in crate::verbs) struct UdQp {
    qp: *mut ffi::ibv_qp,
    qkey: u32,
    attached: Vec<[u8; 16]>,
}

// SAFETY: see `CompQueue`.
unsafe impl Send for UdQp {}

impl Device {
    /// Creates a UD queue pair with receive completions on this device's CQ and send completions
    /// on `send_cq`, brought to RTS with `qkey` (which every sender to it must use).
    pub(in crate::verbs) fn create_ud_qp(
        &self,
        send_cq: &CompQueue,
        send_wr: u32,
        recv_wr: u32,
        qkey: u32,
    ) -> io::Result<UdQp> {
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.cq,
            recv_cq: self.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: send_wr,
                max_recv_wr: recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_UD,
            // Each send says whether it completes with a completion entry (`post_send`).
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and CQs.
        let qp = unsafe { ffi::ibv_create_qp(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(last_err("ibv_create_qp(UD)"));
        }
        let q = UdQp { qp, qkey, attached: Vec::new() };
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qkey,
            ..Default::default()
        };
        q.modify(&mut a, M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_QKEY, "UD QP to INIT")?;
        let mut a = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_RTR, ..Default::default() };
        q.modify(&mut a, M::IBV_QP_STATE, "UD QP to RTR")?;
        let mut a = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_RTS, sq_psn: 0, ..Default::default() };
        q.modify(&mut a, M::IBV_QP_STATE | M::IBV_QP_SQ_PSN, "UD QP to RTS")?;
        Ok(q)
    }

    /// An address handle toward global identifier `dgid` (a multicast GID for a group), sent
    /// from this device's chosen GID with a hop limit of 1 (the subnet only).
    pub(in crate::verbs) fn create_ah(&self, dgid: [u8; 16]) -> io::Result<Ah> {
        let mut attr = ffi::ibv_ah_attr {
            grh: ffi::ibv_global_route {
                dgid: ffi::ibv_gid { raw: dgid },
                flow_label: 0,
                sgid_index: self.gid_index,
                hop_limit: 1,
                traffic_class: 0,
            },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: PORT,
        };
        // SAFETY: valid PD; the attributes are read during the call only.
        let ah = unsafe { ffi::ibv_create_ah(self.pd, &mut attr) };
        if ah.is_null() {
            return Err(last_err("ibv_create_ah"));
        }
        Ok(Ah { ah })
    }
}

impl UdQp {
    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, what: &str) -> io::Result<()> {
        // SAFETY: valid QP and attribute struct.
        check(unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) }, what)
    }

    /// Attaches to multicast group `gid` (RoCE: no LID).
    pub(in crate::verbs) fn attach(&mut self, gid: [u8; 16]) -> io::Result<()> {
        let g = ffi::ibv_gid { raw: gid };
        // SAFETY: valid UD QP; the GID is read during the call only.
        check(unsafe { ffi::ibv_attach_mcast(self.qp, &g, 0) }, "ibv_attach_mcast")?;
        self.attached.push(gid);
        Ok(())
    }

    /// Posts one receive into local `(addr, len, lkey)`.
    ///
    /// # Safety
    /// The buffer must stay valid, registered and otherwise untouched until its completion has
    /// been polled or the QP has been destroyed.
    pub(in crate::verbs) unsafe fn post_recv(&self, wr_id: u64, addr: u64, len: u32, lkey: u32) -> io::Result<()> {
        let mut sge = ffi::ibv_sge { addr, length: len, lkey };
        let mut wr = ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the WR and SGE are read during the call only; the caller keeps the
        // buffer valid.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_recv.expect("provider has post_recv");
            post(self.qp, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_recv(UD)")
    }

    /// Sends `len` bytes at local `(addr, lkey)` to every QP attached to the group of `ah`;
    /// `signaled`: with a completion entry (an unsignaled send is known done once a later
    /// signaled one completes: a send queue completes in order).
    ///
    /// # Safety
    /// The local memory must stay valid and unmodified until the send is known complete, or the
    /// QP has been destroyed.
    pub(in crate::verbs) unsafe fn post_send(
        &self,
        wr_id: u64,
        ah: &Ah,
        (addr, len, lkey): (u64, u32, u32),
        signaled: bool,
    ) -> io::Result<()> {
        let mut sge = ffi::ibv_sge { addr, length: len, lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
            send_flags: if signaled { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 },
            ..Default::default()
        };
        wr.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
            ah: ah.ah,
            remote_qpn: MULTICAST_QPN,
            remote_qkey: self.qkey,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP and AH; the WR and SGE are read during the call only; the caller
        // keeps the local memory valid.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_send.expect("provider has post_send");
            post(self.qp, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_send(UD)")
    }
}

impl UdQp {
    /// The queue pair's number (the source QP of the datagrams it sends).
    pub(in crate::verbs) fn qpn(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.qp).qp_num }
    }
}

impl Drop for UdQp {
    fn drop(&mut self) {
        // Some providers (rxe) refuse to destroy a QP still attached to a group.
        for gid in &self.attached {
            let g = ffi::ibv_gid { raw: *gid };
            // SAFETY: valid QP, attached to `gid` by `attach`.
            unsafe { ffi::ibv_detach_mcast(self.qp, &g, 0) };
        }
        // SAFETY: created by `Device::create_ud_qp`, destroyed once, before its CQs.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}

/// An address handle; destroyed on drop (after the QP whose sends use it).
pub(in crate::verbs) struct Ah {
    ah: *mut ffi::ibv_ah,
}

// SAFETY: see `CompQueue`.
unsafe impl Send for Ah {}

impl Drop for Ah {
    fn drop(&mut self) {
        // SAFETY: created by `Device::create_ah`, destroyed once.
        unsafe { ffi::ibv_destroy_ah(self.ah) };
    }
}
