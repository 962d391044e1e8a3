//! io_uring TCP backend (being written).
use super::*;
pub struct UringTcp;
impl UringTcp {
    #[allow(clippy::type_complexity)]
    pub fn new(
        conns: Vec<Option<std::net::TcpStream>>,
        _limits: Limits,
        _eager_limit: usize,
    ) -> Result<UringTcp, (std::io::Error, Vec<Option<std::net::TcpStream>>)> {
        Err((std::io::Error::new(std::io::ErrorKind::Unsupported, "not yet"), conns))
    }
}
impl Transport for UringTcp {
    fn name(&self) -> &'static str { "tcp-uring" }
    fn eager_limit(&self) -> usize { 0 }
    fn send(&mut self, _: Rank, _: Header, _: bytes::Bytes) {}
    fn progress(&mut self, _: &mut dyn crate::Sink) -> usize { 0 }
    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<()> { std::task::Poll::Pending }
    fn has_pending_output(&self) -> bool { false }
    fn disconnect(&mut self, _: Rank) {}
}
