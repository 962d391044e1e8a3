//! Thin owning wrappers over the rdma-core calls the transport needs, through `ibverbs-sys` (the
//! bindgen output of rdma-core's `verbs.h` that the `ibverbs` crate itself uses as `ffi`).
//!
//! Why the raw bindings and not the `ibverbs` crate's safe types: its safe API (0.9.2) has
//! two-sided send/receive only (no RDMA read, write or write-with-immediate), allocates the
//! registered memory itself (no registration of a caller's buffer, which zero-copy rendezvous
//! needs), has no completion channel (needed to sleep), and ties every object to a borrowed
//! context by lifetime, which cannot live inside a long-lived transport. The bindings link the
//! system `libibverbs.so.1` (the crate builds its vendored rdma-core only to generate them); the
//! handful of calls below are wrapped here, each object freed exactly once on drop, and nothing
//! else in the transport calls the library. The `static inline` calls of `verbs.h` (post, poll,
//! notify) go through the provider's ops table, as `verbs.h` itself does.

use std::ffi::CStr;
use std::io;
use std::os::fd::RawFd;
use std::ptr;

use ibverbs_sys as ffi;

/// The port every QP uses (single-port devices such as rxe).
pub(super) const PORT: u8 = 1;

/// UD queue pairs and multicast (reliable multicast's fabric transport, `super::ud`).
pub(super) mod udqp;

fn last_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn check(rc: i32, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        // Verbs calls return an errno value (positive) or -1 with errno set.
        let e = if rc > 0 { io::Error::from_raw_os_error(rc) } else { io::Error::last_os_error() };
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

/// Names of the RDMA devices present (empty when there are none or no provider library).
pub fn device_names() -> Vec<String> {
    let mut n = 0;
    // SAFETY: plain library call; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let names = (0..n.max(0) as usize)
        .map(|i| {
            // SAFETY: `list` has `n` valid entries; the name is a NUL-terminated static string.
            unsafe { CStr::from_ptr(ffi::ibv_get_device_name(*list.add(i))) }.to_string_lossy().into_owned()
        })
        .collect();
    // SAFETY: the list came from ibv_get_device_list and is not used after this.
    unsafe { ffi::ibv_free_device_list(list) };
    names
}

/// An open device with its protection domain, completion channel and one completion queue.
pub(super) struct Device {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    channel: *mut ffi::ibv_comp_channel,
    cq: *mut ffi::ibv_cq,
    /// Completion events taken from the channel but not yet acknowledged.
    unacked: u32,
    pub name: String,
    pub lid: u16,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// Ethernet link layer (RoCE): addressing by GID.
    pub roce: bool,
    pub active_mtu: u32,
}

// SAFETY: verbs objects may be used from any thread; the transport is used by one thread at a time.
unsafe impl Send for Device {}

impl Device {
    /// Opens device `name` (the first one when `None`), port 1, and picks the GID: `gid_index`,
    /// or the first RoCE v2 entry with an IPv4-mapped address, or the first RoCE v2 entry, or 0.
    pub(super) fn open(name: Option<&str>, gid_index: Option<u8>, cq_entries: i32) -> io::Result<Device> {
        let mut n = 0;
        // SAFETY: plain library call; the list is freed before returning.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(last_err("ibv_get_device_list"));
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: `list` has `n` entries.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a valid device has a NUL-terminated name.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if name.is_none_or(|want| want == dn) {
                found = Some((dev, dn));
                break;
            }
        }
        let Some((dev, dn)) = found else {
            // SAFETY: from ibv_get_device_list, not used after.
            unsafe { ffi::ibv_free_device_list(list) };
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "no RDMA device{} (is rdma_rxe loaded and rxe0 added?)",
                    name.map(|n| format!(" {n}")).unwrap_or_default()
                ),
            ));
        };
        // SAFETY: `dev` is from the list, which stays alive until the device is opened.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        // SAFETY: the opened context does not need the list any more.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(last_err("ibv_open_device"));
        }
        let mut d = Device {
            ctx,
            pd: ptr::null_mut(),
            channel: ptr::null_mut(),
            cq: ptr::null_mut(),
            unacked: 0,
            name: dn,
            lid: 0,
            gid: [0; 16],
            gid_index: 0,
            roce: false,
            active_mtu: ffi::IBV_MTU_1024,
        };
        let mut attr = ffi::ibv_port_attr::default();
        check(
            // SAFETY: `attr` is the full port attribute struct the compat entry point fills.
            unsafe { ffi::ibv_query_port(ctx, PORT, &mut attr as *mut ffi::ibv_port_attr as *mut _) },
            "ibv_query_port",
        )?;
        if attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(io::Error::other(format!("port {PORT} of {} is not active (state {})", d.name, attr.state)));
        }
        d.lid = attr.lid;
        d.roce = u32::from(attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
        d.active_mtu = attr.active_mtu;
        let mut table = vec![ffi::ibv_gid_entry::default(); attr.gid_tbl_len.max(0) as usize];
        // SAFETY: `table` has room for `table.len()` entries of the size given.
        let got = unsafe {
            ffi::_ibv_query_gid_table(ctx, table.as_mut_ptr(), table.len(), 0, size_of::<ffi::ibv_gid_entry>())
        };
        table.truncate(got.max(0) as usize);
        // SAFETY: reading the raw bytes of a GID union is always valid.
        let raw = |e: &ffi::ibv_gid_entry| unsafe { e.gid.raw };
        let v4 = |e: &ffi::ibv_gid_entry| raw(e)[..12] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];
        let v2 = |e: &ffi::ibv_gid_entry| e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2;
        let pick = match gid_index {
            Some(i) => table.iter().find(|e| e.gid_index == u32::from(i)),
            None => table.iter().find(|e| v2(e) && v4(e)).or_else(|| table.iter().find(|e| v2(e))).or(table.first()),
        };
        match pick {
            Some(e) => {
                d.gid = raw(e);
                d.gid_index = e.gid_index as u8;
            }
            None if d.roce => return Err(io::Error::other(format!("{}: no usable GID (index {gid_index:?})", d.name))),
            None => {}
        }
        // SAFETY: valid context.
        d.pd = unsafe { ffi::ibv_alloc_pd(ctx) };
        if d.pd.is_null() {
            return Err(last_err("ibv_alloc_pd"));
        }
        // SAFETY: valid context.
        d.channel = unsafe { ffi::ibv_create_comp_channel(ctx) };
        if d.channel.is_null() {
            return Err(last_err("ibv_create_comp_channel"));
        }
        // The channel is read without blocking, from tokio's reactor.
        // SAFETY: the channel's fd is open for the channel's lifetime.
        let fd = unsafe { (*d.channel).fd };
        // SAFETY: fcntl on an open descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(last_err("fcntl(completion channel)"));
        }
        // SAFETY: valid context and channel.
        d.cq = unsafe { ffi::ibv_create_cq(ctx, cq_entries, ptr::null_mut(), d.channel, 0) };
        if d.cq.is_null() {
            return Err(last_err("ibv_create_cq"));
        }
        Ok(d)
    }

    /// The completion channel's descriptor (readable when an armed CQ got a completion).
    pub(super) fn channel_fd(&self) -> RawFd {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.channel).fd }
    }

    /// Polls up to `out.len()` completions; returns how many were written.
    pub(super) fn poll(&mut self, out: &mut [ffi::ibv_wc]) -> io::Result<usize> {
        // SAFETY: the CQ is valid; `out` has room for `out.len()` completions.
        let n = unsafe {
            let poll = (*(*self.cq).context).ops.poll_cq.expect("provider has poll_cq");
            poll(self.cq, out.len() as i32, out.as_mut_ptr())
        };
        if n < 0 { Err(io::Error::other("ibv_poll_cq failed")) } else { Ok(n as usize) }
    }

    /// Asks for a channel event on the next completion.
    pub(super) fn arm(&mut self) -> io::Result<()> {
        // SAFETY: the CQ is valid.
        let rc = unsafe {
            let notify = (*(*self.cq).context).ops.req_notify_cq.expect("provider has req_notify_cq");
            notify(self.cq, 0)
        };
        check(rc, "ibv_req_notify_cq")
    }

    /// Takes every pending event off the channel (non-blocking); true if there was one.
    pub(super) fn drain_events(&mut self) -> bool {
        let mut any = false;
        loop {
            let mut cq = ptr::null_mut();
            let mut cq_ctx = ptr::null_mut();
            // SAFETY: the channel is non-blocking; the out pointers are valid.
            if unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                break;
            }
            any = true;
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            self.ack();
        }
        any
    }

    fn ack(&mut self) {
        if self.unacked > 0 {
            // SAFETY: the CQ is valid; exactly `unacked` events were taken.
            unsafe { ffi::ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
    }

    /// Registers `len` bytes at `addr` with `access` (`ffi::ibv_access_flags` bits).
    ///
    /// # Safety
    /// The memory must stay allocated until the returned region is dropped.
    pub(super) unsafe fn register(&self, addr: *mut u8, len: usize, access: u32) -> io::Result<Mr> {
        // SAFETY: the caller keeps the memory alive; the PD is valid.
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, addr.cast(), len.max(1), access as i32) };
        if mr.is_null() {
            return Err(last_err("ibv_reg_mr"));
        }
        Ok(Mr { mr })
    }

    /// The most receive requests a shared receive queue of this device may hold.
    pub(super) fn max_srq_wr(&self) -> io::Result<u32> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: valid context; `attr` is the struct the call fills.
        check(unsafe { ffi::ibv_query_device(self.ctx, &mut attr) }, "ibv_query_device")?;
        Ok(attr.max_srq_wr.max(0) as u32)
    }

    /// Creates a shared receive queue for `max_wr` receives of one buffer each.
    pub(super) fn create_srq(&self, max_wr: u32) -> io::Result<Srq> {
        let mut attr = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr { max_wr, max_sge: 1, srq_limit: 0 },
        };
        // SAFETY: valid PD; the attributes are read (and written back) during the call only.
        let srq = unsafe { ffi::ibv_create_srq(self.pd, &mut attr) };
        if srq.is_null() {
            return Err(last_err("ibv_create_srq"));
        }
        Ok(Srq { srq })
    }

    /// Creates an RC queue pair on this device's CQ, with room for `inline` bytes of inline
    /// data per send if the device allows it (none otherwise). With `srq`, its receives come
    /// from that shared queue (and `recv_wr` is ignored).
    pub(super) fn create_qp(&self, send_wr: u32, recv_wr: u32, inline: u32, srq: Option<&Srq>) -> io::Result<Qp> {
        match self.try_create_qp(send_wr, recv_wr, inline, srq) {
            Err(_) if inline > 0 => self.try_create_qp(send_wr, recv_wr, 0, srq),
            r => r,
        }
    }

    fn try_create_qp(&self, send_wr: u32, recv_wr: u32, inline: u32, srq: Option<&Srq>) -> io::Result<Qp> {
        let mut attr = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: self.cq,
            recv_cq: self.cq,
            srq: srq.map_or(ptr::null_mut(), |s| s.srq),
            cap: ffi::ibv_qp_cap {
                max_send_wr: send_wr,
                max_recv_wr: if srq.is_some() { 0 } else { recv_wr },
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: inline,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: valid PD and CQ.
        let qp = unsafe { ffi::ibv_create_qp(self.pd, &mut attr) };
        if qp.is_null() {
            return Err(last_err("ibv_create_qp"));
        }
        // The call wrote back what the device granted.
        Ok(Qp { qp, max_inline: attr.cap.max_inline_data })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.ack();
        // SAFETY: each object was created here, is destroyed once, children first. The owner
        // drops every QP and MR before the device.
        unsafe {
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            if !self.channel.is_null() {
                ffi::ibv_destroy_comp_channel(self.channel);
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

/// A registered memory region; deregistered on drop.
pub(super) struct Mr {
    mr: *mut ffi::ibv_mr,
}

// SAFETY: a memory region handle may move between threads.
unsafe impl Send for Mr {}

impl Mr {
    pub(super) fn lkey(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.mr).lkey }
    }
    pub(super) fn rkey(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by `Device::register`, deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// Where a peer's queue pair is (exchanged through the bootstrap store).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct QpAddr {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

/// One operation for [`Qp::post_send`].
pub(super) enum Op {
    /// RDMA write with immediate from local (addr, len, lkey) to remote (addr, rkey).
    WriteImm {
        imm: u32,
    },
    /// Send with immediate from local (addr, len, lkey) into the peer's next receive buffer
    /// (remote address and key unused).
    SendImm {
        imm: u32,
    },
    Write,
    Read,
}

/// An RC queue pair; destroyed on drop.
pub(super) struct Qp {
    qp: *mut ffi::ibv_qp,
    /// Largest send whose data is copied into the work request at posting (`IBV_SEND_INLINE`).
    max_inline: u32,
}

// SAFETY: see `Device`.
unsafe impl Send for Qp {}

impl Qp {
    /// Largest write that goes inline (its bytes copied into the work request at posting).
    pub(super) fn max_inline(&self) -> u32 {
        self.max_inline
    }

    pub(super) fn qpn(&self) -> u32 {
        // SAFETY: valid until drop.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, what: &str) -> io::Result<()> {
        // SAFETY: valid QP and attribute struct.
        check(unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) }, what)
    }

    /// INIT -> RTR -> RTS toward `remote`; remote reads and writes allowed (the rings and the
    /// rendezvous buffers are protected by their own keys).
    pub(super) fn connect(&self, dev: &Device, my_psn: u32, remote: &QpAddr, rd_atomic: u8) -> io::Result<()> {
        use ffi::ibv_access_flags as A;
        use ffi::ibv_qp_attr_mask as M;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: (A::IBV_ACCESS_REMOTE_WRITE
                | A::IBV_ACCESS_REMOTE_READ
                | A::IBV_ACCESS_REMOTE_ATOMIC
                | A::IBV_ACCESS_LOCAL_WRITE)
                .0,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "QP to INIT",
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: dev.active_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: rd_atomic,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr { dlid: remote.lid, port_num: PORT, ..Default::default() },
            ..Default::default()
        };
        if dev.roce {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.hop_limit = 1;
            a.ah_attr.grh.sgid_index = dev.gid_index;
        }
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "QP to RTR",
        )?;
        let mut a = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: my_psn,
            // 4.096 us * 2^14 = 67 ms per try, 7 tries: a silent peer fails work in about 0.5 s.
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: rd_atomic,
            ..Default::default()
        };
        self.modify(
            &mut a,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "QP to RTS",
        )
    }

    /// Moves the QP to the error state: outstanding work completes with flush errors, and the
    /// peer can no longer reach our memory through it.
    pub(super) fn set_error(&self) {
        let mut a = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        let _ = self.modify(&mut a, ffi::ibv_qp_attr_mask::IBV_QP_STATE, "QP to ERR");
    }

    /// Posts one receive without a buffer (write-with-immediate only consumes it).
    pub(super) fn post_recv(&self, wr_id: u64) -> io::Result<()> {
        let mut wr = ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the WR is read during the call only.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_recv.expect("provider has post_recv");
            post(self.qp, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_recv")
    }

    /// Posts one work request moving `len` bytes between local `(laddr, lkey)` and remote
    /// `(raddr, rkey)`; `signaled`: whether its success raises a completion (a failure always
    /// does, and a signaled completion also tells that every earlier request has completed).
    /// Writes of at most the QP's inline size go inline: the library copies the bytes into the
    /// work request, so the device need not read them from the registered buffer (what
    /// `ib_send_lat` does for small messages too).
    ///
    /// # Safety
    /// The local memory must stay valid (and, for reads, unaliased) until the request is known
    /// complete (its completion, or a later signaled one's, has been polled) or the QP has been
    /// flushed; for a send that goes inline (not a read, `len` at most [`Qp::max_inline`]), during
    /// the call only (`lkey` is not used then).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn post_send(
        &self,
        wr_id: u64,
        op: Op,
        laddr: u64,
        len: u32,
        lkey: u32,
        raddr: u64,
        rkey: u32,
        signaled: bool,
    ) -> io::Result<()> {
        let mut sge = ffi::ibv_sge { addr: laddr, length: len, lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: if len == 0 { 0 } else { 1 },
            opcode: match op {
                Op::WriteImm { .. } => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                Op::SendImm { .. } => ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
                Op::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                Op::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            },
            send_flags: if signaled { ffi::ibv_send_flags::IBV_SEND_SIGNALED.0 } else { 0 },
            ..Default::default()
        };
        if !matches!(op, Op::Read) && len <= self.max_inline {
            wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        if let Op::WriteImm { imm } | Op::SendImm { imm } = op {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: raddr, rkey };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the WR and SGE are read during the call only; the caller keeps the
        // local memory valid.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_send.expect("provider has post_send");
            post(self.qp, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_send")
    }
}

impl Qp {
    /// Posts one signaled atomic on the 8-byte word at remote `(raddr, rkey)`: fetch-and-add of
    /// `add` (`compare` is `None`) or compare-and-swap (`add` is the new value); the previous
    /// value lands in the local 8-byte word `(laddr, lkey)`.
    ///
    /// # Safety
    /// The local word must stay valid and registered until the request's completion has been
    /// polled or the QP has been flushed.
    pub(super) unsafe fn post_atomic(
        &self,
        wr_id: u64,
        (laddr, lkey): (u64, u32),
        (raddr, rkey): (u64, u32),
        compare: Option<u64>,
        add: u64,
    ) -> io::Result<()> {
        let mut sge = ffi::ibv_sge { addr: laddr, length: 8, lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: match compare {
                None => ffi::ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
                Some(_) => ffi::ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP,
            },
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: raddr,
            compare_add: compare.unwrap_or(add),
            swap: add,
            rkey,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: valid QP; the WR and SGE are read during the call only; the caller keeps the
        // local word valid.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_send.expect("provider has post_send");
            post(self.qp, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_send (atomic)")
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by `Device::create_qp`, destroyed once.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
    }
}

/// A shared receive queue; destroyed on drop (after every QP that uses it).
pub(super) struct Srq {
    srq: *mut ffi::ibv_srq,
}

// SAFETY: see `Device`.
unsafe impl Send for Srq {}

impl Srq {
    /// Posts one receive into local `(addr, len, lkey)`.
    ///
    /// # Safety
    /// The buffer must stay valid, registered and otherwise untouched until its completion has
    /// been polled or the queue has been destroyed.
    pub(super) unsafe fn post_recv(&self, wr_id: u64, addr: u64, len: u32, lkey: u32) -> io::Result<()> {
        let mut sge = ffi::ibv_sge { addr, length: len, lkey };
        let mut wr = ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        // SAFETY: valid SRQ; the WR and SGE are read during the call only.
        let rc = unsafe {
            let post = (*(*self.srq).context).ops.post_srq_recv.expect("provider has post_srq_recv");
            post(self.srq, &mut wr, &mut bad)
        };
        check(rc, "ibv_post_srq_recv")
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: created by `Device::create_srq`, destroyed once, after its QPs (owner's order).
        unsafe { ffi::ibv_destroy_srq(self.srq) };
    }
}

/// A zeroed completion array for [`Device::poll`].
pub(super) fn wc_array<const N: usize>() -> [ffi::ibv_wc; N] {
    // SAFETY: `ibv_wc` is plain data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Access bits.
pub(super) mod access {
    use ibverbs_sys::ibv_access_flags as A;
    pub(crate) const LOCAL: u32 = A::IBV_ACCESS_LOCAL_WRITE.0;
    pub(crate) const REMOTE_READ: u32 = A::IBV_ACCESS_REMOTE_READ.0;
    pub(crate) const REMOTE_WRITE: u32 = A::IBV_ACCESS_REMOTE_WRITE.0 | A::IBV_ACCESS_LOCAL_WRITE.0;
}
