//! [`MulticastTransport`] over an RDMA UD queue pair attached to a multicast group (cargo feature
//! `verbs`): one UD send reaches every member through the fabric, as a UDP datagram does through
//! an IP multicast route. The group, its receive pool and the loss injection for tests are in
//! [`ferrocomm_transports::verbs::ud`]; this is only the trait's mapping, so the reliability
//! protocol runs over UD unchanged.

use std::io;
use std::task::{Context, Poll};

pub use ferrocomm_transports::verbs::{UdConfig, UdMulticast, UdStats};

use crate::transport::{MulticastTransport, Received};

impl MulticastTransport for UdMulticast {
    fn name(&self) -> &'static str {
        "ud"
    }

    fn max_datagram(&self) -> usize {
        UdMulticast::max_datagram(self)
    }

    fn try_send(&self, datagram: &[u8]) -> io::Result<bool> {
        UdMulticast::try_send(self, datagram)
    }

    fn poll_send_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        UdMulticast::poll_send_ready(self, cx)
    }

    fn poll_recv(&self, cx: &mut Context<'_>, buf: &mut [u8]) -> Poll<io::Result<Received>> {
        UdMulticast::poll_recv(self, cx, buf).map_ok(Received::one)
    }
}
