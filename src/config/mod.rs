//! Settings: every tunable has a default, an environment variable, and a builder field.

mod rails;
mod routes;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

pub use ferrocomm_reactor::ProgressMode;
pub use ferrocomm_transports::tcp::Backend as TcpBackend;
pub use ferrocomm_transports::verbs::Eager as VerbsEager;
pub use ferrocomm_transports::verbs::Rendezvous as VerbsRendezvous;

use crate::error::{Error, Result};
pub use rails::{RailList, RailSettings};
pub(crate) use routes::PROBE_MAX;
pub use routes::RouteSettings;

/// Which transports a rank may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory to ranks on the same host (Linux), TCP to the others.
    Auto,
    /// TCP to every peer.
    Tcp,
    /// RDMA verbs to every peer, on this host too (needs the `verbs` cargo feature and an RDMA
    /// device; the bootstrap TCP connections stay open as liveness channels).
    Verbs,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "verbs" => Ok(TransportChoice::Verbs),
            _ => Err(format!("unknown transport choice {s:?} (auto, tcp, verbs)")),
        }
    }
}

/// How a rank runs. [`Settings::from_env`] reads the `FERROCOMM_*` variables named on each field;
/// [`Settings::builder`] sets them in code. Fields may be added in any release: outside this
/// crate, make settings with the builder (or [`Settings::default`] and assignments to the
/// fields), not with a struct literal.
///
/// ```
/// use ferrocomm::{ProgressMode, Settings, TransportChoice};
/// let s = Settings::builder().transports(TransportChoice::Tcp).progress(ProgressMode::BusyPoll).build();
/// assert_eq!(s.transports, TransportChoice::Tcp);
/// let eager = s.into_builder().eager_limit(16 << 10).build();
/// assert_eq!((eager.transports, eager.eager_limit), (TransportChoice::Tcp, 16 << 10));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Settings {
    /// `FERROCOMM_PROGRESS`: `busy`, `adaptive[:MICROSECONDS]` or `blocking`. Default adaptive, 50 us.
    pub progress: ProgressMode,
    /// `FERROCOMM_TRANSPORTS`: `auto` (shared memory to ranks on this host, TCP to the others),
    /// `tcp` (TCP to everyone) or `verbs` (RDMA verbs to everyone; cargo feature `verbs`).
    pub transports: TransportChoice,
    /// `FERROCOMM_TCP_BACKEND`: `auto` (io_uring where available), `uring` or `portable`.
    pub tcp_backend: TcpBackend,
    /// `FERROCOMM_EAGER_LIMIT`: largest message sent eagerly, bytes. Default 64 KiB: on TCP a copy
    /// of that size costs less than the rendezvous round trip (measured with ferrocomm-bench).
    pub eager_limit: usize,
    /// `FERROCOMM_SHM_NT_MIN`: message bodies of at least this many bytes are copied into the
    /// shared-memory ring with non-temporal stores, so the receiver reads them from memory rather
    /// than out of the sender's cache; 0: never. Default 8 KiB. It pays where CPUs are slow to hand
    /// each other fresh cache lines (across dies or sockets); between CPUs that share a cache an
    /// ordinary copy can be a little faster. Set to 0 at start-up on a host with more ranks than
    /// CPUs. Ranks may differ.
    pub shm_nt_min: usize,
    /// `FERROCOMM_MAX_CREDIT`: unmatched eager messages a sender may have at one receiver. Default 32
    /// (with the eager limit: at most 2 MiB of unexpected data per peer).
    pub max_credit: u32,
    /// `FERROCOMM_RNDV_CHUNK`: rendezvous data frame size, bytes. Default 512 KiB.
    pub rndv_chunk: usize,
    /// `FERROCOMM_MAX_MESSAGE`: largest message a receive without a buffer accepts. Default 1 GiB.
    pub max_message: usize,
    /// `FERROCOMM_PEER_TIMEOUT_MS`: a peer silent at the TCP level this long is declared lost.
    /// Default 10 s. (A crashed process is noticed at once: its kernel closes the connections.)
    pub peer_timeout: Duration,
    /// `FERROCOMM_CONNECT_TIMEOUT_MS`: how long bootstrap waits for the store and the peers. Default 60 s.
    pub connect_timeout: Duration,
    /// `FERROCOMM_BIND`: address the rank listens on, an IP address or a host name (resolved when
    /// the settings are read; an IPv4 address preferred). Default 0.0.0.0 (advertised as the
    /// address this host uses to reach the key-value store).
    pub bind: IpAddr,
    /// `FERROCOMM_COLL`: pins collectives to algorithms, e.g. `allreduce=ring,bcast=binomial`
    /// (names in [`ferrocomm_collectives::Algorithm`]). Default: the measured size/rank table.
    pub collectives: ferrocomm_collectives::Table,
    /// Reliable multicast (`FERROCOMM_MCAST_*`): see [`McastSettings`].
    pub multicast: McastSettings,
    /// Settings of the verbs transport (used with [`TransportChoice::Verbs`]).
    pub verbs: VerbsSettings,
    /// More TCP connections per peer over other interfaces (`FERROCOMM_RAILS`,
    /// `FERROCOMM_RAIL_*`): see [`RailSettings`] and docs/routes.md.
    pub rails: RailSettings,
    /// Routes through a proxy rank (`FERROCOMM_PROXY`, `FERROCOMM_ROUTE_COSTS`, ...): see
    /// [`RouteSettings`] and docs/routes.md.
    pub routes: RouteSettings,
}

/// Settings of the verbs transport. Fields may be added in any release: start from
/// [`VerbsSettings::default`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerbsSettings {
    /// `FERROCOMM_VERBS_DEVICE`: RDMA device name (`rxe0`, `mlx5_0`). Default: the first one.
    pub device: Option<String>,
    /// `FERROCOMM_VERBS_GID_INDEX`: GID table index. Default: the first RoCE v2 IPv4 entry.
    pub gid_index: Option<u8>,
    /// `FERROCOMM_VERBS_SLOTS`: eager slot credits (with rings: ring slots) per peer and
    /// direction (one kept for credit updates). Default 32, like the engine's credits.
    pub slots: u32,
    /// `FERROCOMM_VERBS_EAGER`: `ring` (RDMA write-with-immediate into a ring per peer) or `srq`
    /// (send-with-immediate into one shared receive queue's pool of buffers). Default `ring`.
    pub eager: VerbsEager,
    /// `FERROCOMM_VERBS_SRQ_BUFFERS`: buffers in the shared receive queue's pool (`srq` only);
    /// 0, the default, for `slots` per peer. Fewer bound the receive memory; a burst that finds
    /// the pool empty is held back by the device until buffers are reposted.
    pub srq_buffers: u32,
    /// `FERROCOMM_VERBS_RENDEZVOUS`: `write` (the receiver announces its buffer with the CTS and
    /// the sender RDMA-writes, one round trip less) or `read` (the receiver RDMA-reads the
    /// chunks the sender lends). Default `write`.
    pub rendezvous: VerbsRendezvous,
}

impl Default for VerbsSettings {
    fn default() -> Self {
        VerbsSettings {
            device: None,
            gid_index: None,
            slots: 32,
            eager: VerbsEager::Ring,
            srq_buffers: 0,
            rendezvous: VerbsRendezvous::Write,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            progress: ProgressMode::Adaptive(Duration::from_micros(50)),
            transports: TransportChoice::Auto,
            tcp_backend: TcpBackend::Auto,
            eager_limit: 64 * 1024,
            shm_nt_min: 8 * 1024,
            max_credit: 32,
            rndv_chunk: 512 * 1024,
            max_message: 1 << 30,
            peer_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(60),
            bind: IpAddr::from([0, 0, 0, 0]),
            collectives: Default::default(),
            multicast: Default::default(),
            verbs: VerbsSettings::default(),
            rails: RailSettings::default(),
            routes: RouteSettings::default(),
        }
    }
}

/// Builds [`Settings`]: the defaults (or the settings it started from) with the fields set by
/// its methods, one per field of [`Settings`]. [`SettingsBuilder::build`] does not check the
/// values; [`crate::init_with`] does (or [`Settings::validate`]).
#[derive(Clone, Debug)]
#[must_use]
pub struct SettingsBuilder(Settings);

macro_rules! setters {
    ($($(#[$doc:meta])* $field:ident: $ty:ty,)*) => {
        impl SettingsBuilder {
            $(
                $(#[$doc])*
                pub fn $field(mut self, value: $ty) -> Self {
                    self.0.$field = value;
                    self
                }
            )*
        }
    };
}

setters! {
    /// Sets [`Settings::progress`].
    progress: ProgressMode,
    /// Sets [`Settings::transports`].
    transports: TransportChoice,
    /// Sets [`Settings::tcp_backend`].
    tcp_backend: TcpBackend,
    /// Sets [`Settings::eager_limit`].
    eager_limit: usize,
    /// Sets [`Settings::shm_nt_min`].
    shm_nt_min: usize,
    /// Sets [`Settings::max_credit`].
    max_credit: u32,
    /// Sets [`Settings::rndv_chunk`].
    rndv_chunk: usize,
    /// Sets [`Settings::max_message`].
    max_message: usize,
    /// Sets [`Settings::peer_timeout`].
    peer_timeout: Duration,
    /// Sets [`Settings::connect_timeout`].
    connect_timeout: Duration,
    /// Sets [`Settings::bind`].
    bind: IpAddr,
    /// Sets [`Settings::collectives`].
    collectives: ferrocomm_collectives::Table,
    /// Sets [`Settings::multicast`].
    multicast: McastSettings,
    /// Sets [`Settings::verbs`].
    verbs: VerbsSettings,
    /// Sets [`Settings::rails`].
    rails: RailSettings,
    /// Sets [`Settings::routes`].
    routes: RouteSettings,
}

impl SettingsBuilder {
    /// The settings.
    pub fn build(self) -> Settings {
        self.0
    }
}

impl From<Settings> for SettingsBuilder {
    fn from(s: Settings) -> SettingsBuilder {
        SettingsBuilder(s)
    }
}

impl Settings {
    /// A builder starting from the defaults.
    pub fn builder() -> SettingsBuilder {
        SettingsBuilder(Settings::default())
    }

    /// A builder starting from these settings.
    pub fn into_builder(self) -> SettingsBuilder {
        SettingsBuilder(self)
    }
}

pub(crate) fn parse<T: std::str::FromStr>(
    name: &'static str,
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse().map(Some).map_err(|e| Error::Config { name, reason: format!("{v:?}: {e}") }),
    }
}

/// `FERROCOMM_BIND`'s value: an IP address, or a host name resolved to one (IPv4 first).
fn bind_address(value: &str) -> Result<IpAddr> {
    let v = value.trim();
    if let Ok(ip) = v.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return Ok(ip);
    }
    let bad = |reason: String| Error::Config { name: "FERROCOMM_BIND", reason: format!("{v:?}: {reason}") };
    let found: Vec<IpAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(v, 0))
        .map_err(|e| bad(format!("not an IP address, and cannot resolve it as a host name: {e}")))?
        .map(|a| a.ip())
        .collect();
    found
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(found.first())
        .copied()
        .ok_or_else(|| bad("the host name resolves to no address".to_string()))
}

impl Settings {
    /// Defaults overridden by the `FERROCOMM_*` environment variables.
    pub fn from_env() -> Result<Settings> {
        Settings::from_vars(|k| std::env::var(k).ok())
    }

    /// Defaults overridden by the variables `get` returns.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Settings> {
        let mut s = Settings::default();
        if let Some(v) = parse("FERROCOMM_PROGRESS", &get)? {
            s.progress = v;
        }
        if let Some(v) = parse("FERROCOMM_TRANSPORTS", &get)? {
            s.transports = v;
        }
        if let Some(v) = parse("FERROCOMM_TCP_BACKEND", &get)? {
            s.tcp_backend = v;
        }
        if let Some(v) = parse("FERROCOMM_EAGER_LIMIT", &get)? {
            s.eager_limit = v;
        }
        if let Some(v) = parse("FERROCOMM_SHM_NT_MIN", &get)? {
            s.shm_nt_min = v;
        }
        if let Some(v) = parse("FERROCOMM_MAX_CREDIT", &get)? {
            s.max_credit = v;
        }
        if let Some(v) = parse("FERROCOMM_RNDV_CHUNK", &get)? {
            s.rndv_chunk = v;
        }
        if let Some(v) = parse("FERROCOMM_MAX_MESSAGE", &get)? {
            s.max_message = v;
        }
        if let Some(v) = parse::<u64>("FERROCOMM_PEER_TIMEOUT_MS", &get)? {
            s.peer_timeout = Duration::from_millis(v);
        }
        if let Some(v) = parse::<u64>("FERROCOMM_CONNECT_TIMEOUT_MS", &get)? {
            s.connect_timeout = Duration::from_millis(v);
        }
        if let Some(v) = get("FERROCOMM_BIND") {
            s.bind = bind_address(&v)?;
        }
        if let Some(v) = get("FERROCOMM_COLL") {
            s.collectives =
                s.collectives.with_overrides(&v).map_err(|reason| Error::Config { name: "FERROCOMM_COLL", reason })?;
        }
        s.multicast = McastSettings::from_vars(&get)?;
        if let Some(v) = parse("FERROCOMM_VERBS_DEVICE", &get)? {
            s.verbs.device = Some(v);
        }
        if let Some(v) = parse("FERROCOMM_VERBS_GID_INDEX", &get)? {
            s.verbs.gid_index = Some(v);
        }
        if let Some(v) = parse("FERROCOMM_VERBS_SLOTS", &get)? {
            s.verbs.slots = v;
        }
        if let Some(v) = parse("FERROCOMM_VERBS_EAGER", &get)? {
            s.verbs.eager = v;
        }
        if let Some(v) = parse("FERROCOMM_VERBS_SRQ_BUFFERS", &get)? {
            s.verbs.srq_buffers = v;
        }
        if let Some(v) = parse("FERROCOMM_VERBS_RENDEZVOUS", &get)? {
            s.verbs.rendezvous = v;
        }
        s.rails = RailSettings::from_vars(&get)?;
        s.routes = RouteSettings::from_vars(&get)?;
        s.validate()?;
        Ok(s)
    }

    /// Checks that the values can work together.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason: &str| Err(Error::Config { name, reason: reason.to_string() });
        if self.eager_limit > (1 << 24) {
            return bad("eager_limit", "at most 16 MiB");
        }
        if self.max_credit == 0 {
            return bad("max_credit", "must be at least 1");
        }
        if self.rndv_chunk == 0 || self.rndv_chunk > (1 << 30) {
            return bad("rndv_chunk", "between 1 byte and 1 GiB");
        }
        self.multicast.validate()?;
        if self.verbs.slots < 2 || self.verbs.slots > (1 << 16) {
            return bad("verbs.slots", "between 2 and 65536");
        }
        if self.multicast.network == McastNet::Ud && !cfg!(feature = "verbs") {
            return bad("FERROCOMM_MCAST_NET", "ud needs ferrocomm built with the `verbs` cargo feature");
        }
        if self.transports == TransportChoice::Verbs && !cfg!(feature = "verbs") {
            return bad("FERROCOMM_TRANSPORTS", "verbs needs ferrocomm built with the `verbs` cargo feature");
        }
        Ok(())
    }
}

/// Which network carries reliable multicast's datagrams (`FERROCOMM_MCAST_NET`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum McastNet {
    /// A UD queue pair attached to a fabric multicast group when the job runs over verbs
    /// (`FERROCOMM_TRANSPORTS=verbs`) and that works; UDP/IPv4 multicast otherwise.
    Auto,
    /// UDP/IPv4 multicast.
    Udp,
    /// A UD queue pair (cargo feature `verbs`, an RDMA device with RoCE v2 over IPv4).
    Ud,
}

impl std::str::FromStr for McastNet {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(McastNet::Auto),
            "udp" => Ok(McastNet::Udp),
            "ud" => Ok(McastNet::Ud),
            _ => Err(format!("unknown multicast network {s:?} (auto, udp, ud)")),
        }
    }
}

/// Reliable multicast settings: every field has a `FERROCOMM_MCAST_*` variable. Fields may be
/// added in any release: start from [`McastSettings::default`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct McastSettings {
    /// `FERROCOMM_MCAST`: `on` (default) or `off` (point-to-point only, no socket).
    pub enabled: bool,
    /// `FERROCOMM_MCAST_NET`: `auto` (default), `udp` or `ud`; see [`McastNet`].
    pub network: McastNet,
    /// `FERROCOMM_MCAST_GROUP`: IPv4 group address. Default: 239.255.x.y derived from the job
    /// token and the channel, so that jobs and channels do not share groups.
    pub group: Option<Ipv4Addr>,
    /// `FERROCOMM_MCAST_PORT`: UDP port. Default derived like the group, in 20000..60000.
    pub port: Option<u16>,
    /// `FERROCOMM_MCAST_IF`: interface address to send and join on. Default: the address this
    /// rank listens on (127.0.0.1 for in-process clusters), else the kernel's choice.
    pub interface: Option<Ipv4Addr>,
    /// `FERROCOMM_MCAST_WINDOW`: W, messages a root may have unacknowledged. Default 64.
    pub window: usize,
    /// `FERROCOMM_MCAST_ACK_EVERY`: k, a receiver acknowledges every k messages. Default 8.
    pub ack_every: u32,
    /// `FERROCOMM_MCAST_ACK_DELAY_US`: T, or this long after the first unacknowledged message.
    /// Default 200 us.
    pub ack_delay: Duration,
    /// `FERROCOMM_MCAST_SUBGROUPS`: number of ACK sub-groups (root's plus one per co-root);
    /// 0 (default) = none up to [`crate::multicast::FLAT_RECEIVERS`] receivers, about
    /// sqrt(receivers) above; 1 = no co-roots.
    pub subgroups: usize,
    /// `FERROCOMM_MCAST_DATAGRAM`: datagram size, header and 16-byte tag included. Default 1400 (fits an
    /// Ethernet MTU: IP fragments would multiply the loss rate); up to 65000 on loopback.
    pub datagram: usize,
    /// `FERROCOMM_MCAST_MAX_MESSAGE`: largest multicast message. Default 4 MiB. Bounds memory:
    /// a receiver holds at most `window` messages per root.
    pub max_message: usize,
    /// `FERROCOMM_MCAST_CONFIRM_MS`: how long the multicast test may take before the group is
    /// declared unusable. Default 2000.
    pub confirm_timeout: Duration,
    /// `FERROCOMM_MCAST_BUFFER`: socket buffer size asked for. Default 4 MiB.
    pub buffer: usize,
    /// `FERROCOMM_MCAST_BARRIER_DEGREE`: fan-in of the token barrier's tree. Default 8.
    pub barrier_degree: u32,
    /// `FERROCOMM_MCAST_TEST_DROP`: probability of dropping each received datagram, to test
    /// loss recovery where iptables is not available. Default 0.
    pub test_drop: f64,
}

impl Default for McastSettings {
    fn default() -> Self {
        McastSettings {
            enabled: true,
            network: McastNet::Auto,
            group: None,
            port: None,
            interface: None,
            window: 64,
            ack_every: 8,
            ack_delay: Duration::from_micros(200),
            subgroups: 0,
            datagram: 1400,
            max_message: 4 << 20,
            confirm_timeout: Duration::from_secs(2),
            buffer: 4 << 20,
            barrier_degree: 8,
            test_drop: 0.0,
        }
    }
}

impl McastSettings {
    /// Defaults overridden by the `FERROCOMM_MCAST_*` variables `get` returns.
    pub fn from_vars(get: &impl Fn(&str) -> Option<String>) -> Result<McastSettings> {
        let mut s = McastSettings::default();
        if let Some(v) = parse::<String>("FERROCOMM_MCAST", get)? {
            s.enabled = match v.as_str() {
                "on" | "1" | "true" => true,
                "off" | "0" | "false" => false,
                _ => return Err(Error::Config { name: "FERROCOMM_MCAST", reason: format!("{v:?}: on or off") }),
            };
        }
        if let Some(v) = parse("FERROCOMM_MCAST_NET", get)? {
            s.network = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_GROUP", get)? {
            s.group = Some(v);
        }
        if let Some(v) = parse("FERROCOMM_MCAST_PORT", get)? {
            s.port = Some(v);
        }
        if let Some(v) = parse("FERROCOMM_MCAST_IF", get)? {
            s.interface = Some(v);
        }
        if let Some(v) = parse("FERROCOMM_MCAST_WINDOW", get)? {
            s.window = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_ACK_EVERY", get)? {
            s.ack_every = v;
        }
        if let Some(v) = parse::<u64>("FERROCOMM_MCAST_ACK_DELAY_US", get)? {
            s.ack_delay = Duration::from_micros(v);
        }
        if let Some(v) = parse("FERROCOMM_MCAST_SUBGROUPS", get)? {
            s.subgroups = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_DATAGRAM", get)? {
            s.datagram = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_MAX_MESSAGE", get)? {
            s.max_message = v;
        }
        if let Some(v) = parse::<u64>("FERROCOMM_MCAST_CONFIRM_MS", get)? {
            s.confirm_timeout = Duration::from_millis(v);
        }
        if let Some(v) = parse("FERROCOMM_MCAST_BUFFER", get)? {
            s.buffer = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_BARRIER_DEGREE", get)? {
            s.barrier_degree = v;
        }
        if let Some(v) = parse("FERROCOMM_MCAST_TEST_DROP", get)? {
            s.test_drop = v;
        }
        s.validate()?;
        Ok(s)
    }

    /// The datagram size the protocol core fragments into: the configured size less the tag.
    pub(crate) fn core_datagram(&self) -> usize {
        self.datagram - ferrocomm_transports::auth::TAG_LEN
    }

    /// Checks that the values can work together.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, reason: &str| Err(Error::Config { name, reason: reason.to_string() });
        if self.window == 0 || self.window > (1 << 20) {
            return bad("FERROCOMM_MCAST_WINDOW", "between 1 and 2^20");
        }
        if self.ack_every == 0 {
            return bad("FERROCOMM_MCAST_ACK_EVERY", "at least 1");
        }
        if self.datagram < ferrocomm_multicast::wire::HEADER + 64 || self.datagram > 65_000 {
            return bad("FERROCOMM_MCAST_DATAGRAM", "between 100 and 65000 bytes");
        }
        if ferrocomm_multicast::wire::fragments(self.max_message, self.core_datagram()) > usize::from(u16::MAX) {
            return bad("FERROCOMM_MCAST_MAX_MESSAGE", "at most 65535 datagrams per message");
        }
        if !(0.0..=1.0).contains(&self.test_drop) {
            return bad("FERROCOMM_MCAST_TEST_DROP", "a probability");
        }
        if self.group.is_some_and(|g| !g.is_multicast()) {
            return bad("FERROCOMM_MCAST_GROUP", "must be in 224.0.0.0/4");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_addresses_may_be_host_names() {
        let bind = |v: &str| Settings::from_vars(|k| (k == "FERROCOMM_BIND").then(|| v.to_string())).map(|s| s.bind);
        assert_eq!(bind("10.1.2.3").unwrap(), IpAddr::from([10, 1, 2, 3]));
        assert_eq!(bind("[::1]").unwrap(), "::1".parse::<IpAddr>().unwrap());
        // From /etc/hosts: no resolver is asked.
        assert!(bind("localhost").unwrap().is_loopback());
        // A NUL byte fails before any resolver is asked.
        let e = bind("bad\0name").unwrap_err();
        assert!(matches!(e, Error::Config { name: "FERROCOMM_BIND", .. }), "{e}");
        assert!(e.to_string().contains("host name"), "{e}");
    }

    #[test]
    fn variables_override_defaults_and_bad_values_are_named() {
        let s = Settings::from_vars(|k| match k {
            "FERROCOMM_PROGRESS" => Some("adaptive:20".into()),
            "FERROCOMM_TCP_BACKEND" => Some("portable".into()),
            "FERROCOMM_EAGER_LIMIT" => Some("4096".into()),
            "FERROCOMM_SHM_NT_MIN" => Some("0".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(s.shm_nt_min, 0);
        assert_eq!(s.progress, ProgressMode::Adaptive(Duration::from_micros(20)));
        assert_eq!(s.tcp_backend, TcpBackend::Portable);
        assert_eq!(s.eager_limit, 4096);
        let e = Settings::from_vars(|k| (k == "FERROCOMM_MAX_CREDIT").then(|| "lots".into())).unwrap_err();
        assert!(matches!(e, Error::Config { name: "FERROCOMM_MAX_CREDIT", .. }), "{e}");
        let s = Settings::from_vars(|k| match k {
            "FERROCOMM_VERBS_RENDEZVOUS" => Some("read".into()),
            "FERROCOMM_VERBS_SLOTS" => Some("8".into()),
            "FERROCOMM_VERBS_DEVICE" => Some("rxe0".into()),
            "FERROCOMM_VERBS_EAGER" => Some("srq".into()),
            "FERROCOMM_VERBS_SRQ_BUFFERS" => Some("64".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(
            s.verbs,
            VerbsSettings {
                device: Some("rxe0".into()),
                gid_index: None,
                slots: 8,
                eager: VerbsEager::SharedQueue,
                srq_buffers: 64,
                rendezvous: VerbsRendezvous::Read
            }
        );
        let e = Settings::from_vars(|k| (k == "FERROCOMM_VERBS_EAGER").then(|| "rings".into())).unwrap_err();
        assert!(matches!(e, Error::Config { name: "FERROCOMM_VERBS_EAGER", .. }), "{e}");
        let verbs = Settings::from_vars(|k| (k == "FERROCOMM_TRANSPORTS").then(|| "verbs".into()));
        assert_eq!(verbs.is_ok(), cfg!(feature = "verbs"), "{verbs:?}");
    }

    #[test]
    fn multicast_network_choice() {
        let net = |v: &str| Settings::from_vars(|k| (k == "FERROCOMM_MCAST_NET").then(|| v.to_string()));
        assert_eq!(Settings::default().multicast.network, McastNet::Auto);
        assert_eq!(net("udp").unwrap().multicast.network, McastNet::Udp);
        let ud = net("ud");
        assert_eq!(ud.is_ok(), cfg!(feature = "verbs"), "{ud:?}");
        let e = net("infiniband").unwrap_err();
        assert!(matches!(e, Error::Config { name: "FERROCOMM_MCAST_NET", .. }), "{e}");
    }
}
