//! Job authentication: both ends of a connection prove they hold the job token without sending
//! it, and the job's multicast datagrams carry a tag that only holders of the token can make.
//! Sans-IO: the key-value store (`ferrocomm::bootstrap::kv`), the peers' TCP handshake
//! ([`crate::tcp`]) and the multicast driver move the bytes this module makes and checks.
//!
//! # Keys
//!
//! The 32-byte job token is only ever a key. Each purpose gets its own sub-key, HKDF-Expand
//! (RFC 5869) over HMAC-SHA-256 with the token as the pseudo-random key (the token is uniformly
//! random, so the extract step adds nothing) and a label per purpose ([`JobSecret`]): the store's
//! handshake, the peers' handshake, the multicast datagram tags, and two names that are public by
//! nature: the job id in datagram headers and the prefix of the job's shared-memory files. HMAC is
//! a pseudo-random function, so knowing one derived value (a public name, a proof) tells nothing
//! about the token or another sub-key.
//!
//! # Handshake
//!
//! ```text
//! connector -> listener   hello      nonce_c (32 fresh random bytes), who it is, whom it wants
//! listener  -> connector  challenge  nonce_l (32 fresh random bytes),
//!                                    proof_l = HMAC(k, "listener" ends nonce_c nonce_l)
//! connector -> listener   proof      proof_c = HMAC(k, "connector" ends nonce_c nonce_l)
//!                      or refuse     (proof_l did not verify: the connector stops here)
//! ```
//!
//! `k` is the protocol's sub-key, `ends` the connector's and the listener's ranks. Why this order
//! and these inputs:
//!
//! * The listener proves itself first, so the connector sends nothing keyed to a listener that
//!   has not. A fake listener (a process that bound the coordinator's port before the store did,
//!   or sits at an address a rank was given) learns a random nonce and a refusal: nothing that
//!   depends on the token, so nothing it can replay or test token guesses against.
//! * The listener answers any stranger's hello with a proof, but that proof covers the stranger's
//!   nonce and the listener's own fresh one under the label "listener": it is no connector's
//!   proof (other label), no proof on another connection (the other side's nonce is fresh there),
//!   for another protocol (other sub-key) or between other ranks (other `ends`). A stranger gets a
//!   MAC oracle for listener proofs only, which opens nothing.
//! * Proofs are compared in constant time (`Mac::verify_slice`).
//! * A wrong token fails on both sides with a clear error: the connector finds the listener's
//!   proof wrong ([`HandshakeError::BadProof`]) and says so with a refusal, which the listener
//!   reports as [`HandshakeError::Refused`].
//!
//! What this does not cover: the frames after the handshake carry neither a MAC nor encryption. A
//! party on the network path that relays both directions of a handshake between two real ranks
//! (it must reach the real listener, so it did not merely take its port) is left in the middle of
//! an authenticated connection, and anyone on the path reads the data. Binding the stream to the
//! handshake would mean a MAC on every frame.
//!
//! # Datagram tags
//!
//! [`DatagramKey`]: keyed BLAKE3 (its MAC mode) over the whole datagram, truncated to its first
//! [`TAG_LEN`] = 16 bytes (a forgery passes with probability 2^-128 per try), checked in constant
//! time; the 32-byte key is derived from the job token like the handshake keys. BLAKE3 rather than
//! HMAC-SHA-256 because every byte of every multicast datagram is tagged once by its root and
//! checked by every receiver: in `perf record -a` over `ferrocomm-bench multicast --stream-only
//! --transports tcp` (8 receivers, 2 CPUs), HMAC-SHA-256's compression takes 22% of the bench's
//! CPU time, keyed BLAKE3 (its SIMD paths) 11%. A tag says
//! "made by a holder of this job's token", not "new": a replayed datagram passes it, and the
//! multicast protocol's sequence numbers then drop it as a duplicate.

use std::fmt;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Length of the job token.
pub const TOKEN_LEN: usize = 32;
/// Length of a handshake nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a handshake proof (a whole HMAC-SHA-256).
pub const PROOF_LEN: usize = 32;
/// Length of a challenge: the listener's nonce, then its proof.
pub const CHALLENGE_LEN: usize = NONCE_LEN + PROOF_LEN;
/// Length of a multicast datagram's tag.
pub const TAG_LEN: usize = 16;

/// Prefix of every label, with the version of this key schedule.
const DOMAIN: &[u8] = b"ferrocomm/1 ";

fn keyed(key: &[u8]) -> HmacSha256 {
    // HMAC takes a key of any length, so this cannot fail.
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC accepts keys of any length")
}

fn to_array(out: &[u8]) -> [u8; 32] {
    let mut a = [0u8; 32];
    a.copy_from_slice(&out[..32]);
    a
}

/// Why a handshake failed, or could not start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The other side's proof does not verify.
    #[error(
        "the other side did not prove it holds the job token: the two sides hold different tokens \
         (another job's, or a mistyped FERROCOMM_TOKEN), or it is not part of this job"
    )]
    BadProof,
    /// The other side refused this side's proof (it found it wrong).
    #[error(
        "the other side refused this side's proof of the job token: the two sides hold different \
         tokens (another job's, or a mistyped FERROCOMM_TOKEN)"
    )]
    Refused,
    /// The other side speaks another version of the handshake.
    #[error("handshake version {theirs} on the other side, this build speaks {ours}")]
    WrongVersion {
        /// This build's version.
        ours: u8,
        /// The other side's.
        theirs: u8,
    },
    /// The bytes are not this handshake.
    #[error("not a ferrocomm handshake: {0}")]
    Malformed(&'static str),
    /// The connector wants another rank than the one it reached (a stale address).
    #[error("the connection is meant for rank {wanted}, but this is rank {me}")]
    WrongListener {
        /// The rank the connector wants.
        wanted: u64,
        /// This rank.
        me: u32,
    },
    /// No random nonce could be drawn from the operating system.
    #[error("cannot draw a random nonce: {0}")]
    Random(String),
}

/// The handshakes, each with its own sub-key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// A rank (or anything else of the job) connecting to the key-value store.
    Store,
    /// Two ranks connecting their point-to-point connection.
    Peers,
}

impl Protocol {
    fn label(self) -> &'static [u8] {
        match self {
            Protocol::Store => b"store handshake",
            Protocol::Peers => b"peer handshake",
        }
    }
}

/// The two ends of one connection, as both ends see them: the connecting rank and the listening
/// one (the store's handshake names no ranks: [`Ends::STORE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ends {
    /// The connecting rank.
    pub connector: u32,
    /// The listening rank.
    pub listener: u32,
}

impl Ends {
    /// The ends of a connection to the key-value store.
    pub const STORE: Ends = Ends { connector: u32::MAX, listener: u32::MAX };
}

/// The job token and what is derived from it. `Debug` never shows it.
#[derive(Clone)]
pub struct JobSecret {
    token: [u8; TOKEN_LEN],
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobSecret(<redacted>)")
    }
}

impl JobSecret {
    /// The secret of a job whose token is `token`.
    pub fn new(token: [u8; TOKEN_LEN]) -> JobSecret {
        JobSecret { token }
    }

    /// HKDF-Expand(token, "ferrocomm/1 " label, 32): one block, so HMAC(token, info || 0x01).
    fn derive(&self, label: &[u8]) -> [u8; 32] {
        let mut m = keyed(&self.token);
        m.update(DOMAIN);
        m.update(label);
        m.update(&[1]);
        to_array(&m.finalize().into_bytes())
    }

    /// The sub-key of a handshake.
    pub fn handshake_key(&self, protocol: Protocol) -> HandshakeKey {
        HandshakeKey { key: self.derive(protocol.label()), protocol }
    }

    /// The key of the job's multicast datagram tags.
    pub fn datagram_key(&self) -> DatagramKey {
        DatagramKey { key: self.derive(b"multicast datagram tag") }
    }

    /// The job id multicast datagrams carry in the clear (tells jobs apart; the tag authenticates).
    pub fn job_id(&self) -> u64 {
        let d = self.derive(b"job id");
        u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
    }

    /// The name of the job's shared-memory files: 16 hex digits, visible in /dev/shm to every user.
    pub fn shm_name(&self) -> String {
        self.derive(b"shared-memory name")[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A handshake's sub-key.
#[derive(Clone)]
pub struct HandshakeKey {
    key: [u8; 32],
    protocol: Protocol,
}

impl fmt::Debug for HandshakeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandshakeKey({:?}, <redacted>)", self.protocol)
    }
}

/// Which side a proof comes from.
#[derive(Clone, Copy)]
enum Side {
    Connector,
    Listener,
}

impl HandshakeKey {
    /// The MAC of a proof, ready for `finalize` or `verify_slice`.
    fn proof(&self, side: Side, ends: Ends, nonce_c: &[u8; NONCE_LEN], nonce_l: &[u8; NONCE_LEN]) -> HmacSha256 {
        let mut m = keyed(&self.key);
        m.update(DOMAIN);
        m.update(b"proof\0");
        m.update(self.protocol.label());
        m.update(match side {
            Side::Connector => b"\0connector\0",
            Side::Listener => b"\0listener\0\0",
        });
        m.update(&ends.connector.to_le_bytes());
        m.update(&ends.listener.to_le_bytes());
        m.update(nonce_c);
        m.update(nonce_l);
        m
    }
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| HandshakeError::Random(e.to_string()))?;
    Ok(n)
}

/// The listener's answer to a hello: its nonce and its proof.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// The listener's fresh nonce.
    pub nonce: [u8; NONCE_LEN],
    /// The listener's proof over both nonces and the ends.
    pub proof: [u8; PROOF_LEN],
}

impl Challenge {
    /// Its bytes on the wire: the nonce, then the proof.
    pub fn to_bytes(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[..NONCE_LEN].copy_from_slice(&self.nonce);
        b[NONCE_LEN..].copy_from_slice(&self.proof);
        b
    }

    /// The challenge in `b` (any bytes are a challenge; the proof is checked by [`Connector::answer`]).
    pub fn from_bytes(b: &[u8; CHALLENGE_LEN]) -> Challenge {
        Challenge { nonce: to_array(&b[..NONCE_LEN]), proof: to_array(&b[NONCE_LEN..]) }
    }
}

/// The connecting side of a handshake: send [`Connector::hello`], feed the challenge to
/// [`Connector::answer`], send the proof it returns (or a refusal if it fails).
pub struct Connector {
    key: HandshakeKey,
    ends: Ends,
    nonce: [u8; NONCE_LEN],
}

impl Connector {
    /// A handshake of the connection `ends`, with a fresh nonce.
    pub fn new(key: HandshakeKey, ends: Ends) -> Result<Connector, HandshakeError> {
        Ok(Connector { key, ends, nonce: fresh_nonce()? })
    }

    /// The nonce to send first; it depends on nothing secret.
    pub fn hello(&self) -> &[u8; NONCE_LEN] {
        &self.nonce
    }

    /// Checks the listener's proof; if it holds, this side's proof to send.
    pub fn answer(&self, challenge: &Challenge) -> Result<[u8; PROOF_LEN], HandshakeError> {
        self.key
            .proof(Side::Listener, self.ends, &self.nonce, &challenge.nonce)
            .verify_slice(&challenge.proof)
            .map_err(|_| HandshakeError::BadProof)?;
        let mine = self.key.proof(Side::Connector, self.ends, &self.nonce, &challenge.nonce);
        Ok(to_array(&mine.finalize().into_bytes()))
    }
}

/// The listening side: [`Listener::new`] on a hello gives the challenge to send;
/// [`Listener::check`] the connector's proof.
pub struct Listener {
    key: HandshakeKey,
    ends: Ends,
    theirs: [u8; NONCE_LEN],
    nonce: [u8; NONCE_LEN],
}

impl Listener {
    /// Answers the connector's `hello` on the connection `ends`: the listener, and the challenge
    /// to send back.
    pub fn new(
        key: HandshakeKey,
        ends: Ends,
        hello: &[u8; NONCE_LEN],
    ) -> Result<(Listener, Challenge), HandshakeError> {
        let nonce = fresh_nonce()?;
        let proof = to_array(&key.proof(Side::Listener, ends, hello, &nonce).finalize().into_bytes());
        Ok((Listener { key, ends, theirs: *hello, nonce }, Challenge { nonce, proof }))
    }

    /// Checks the connector's proof.
    pub fn check(&self, proof: &[u8]) -> Result<(), HandshakeError> {
        self.key
            .proof(Side::Connector, self.ends, &self.theirs, &self.nonce)
            .verify_slice(proof)
            .map_err(|_| HandshakeError::BadProof)
    }
}

/// Why a datagram's tag was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TagError {
    /// The datagram is shorter than a tag.
    #[error("datagram of {0} bytes is too short to carry a tag")]
    Missing(usize),
    /// The tag is not the job key's tag of the datagram.
    #[error("datagram tag does not verify (not from this job, or altered)")]
    Bad,
}

/// The key of the job's multicast datagram tags (keyed BLAKE3).
#[derive(Clone)]
pub struct DatagramKey {
    key: [u8; 32],
}

impl fmt::Debug for DatagramKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DatagramKey(<redacted>)")
    }
}

impl DatagramKey {
    /// The tag that follows `datagram` on the wire.
    pub fn tag(&self, datagram: &[u8]) -> [u8; TAG_LEN] {
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&blake3::keyed_hash(&self.key, datagram).as_bytes()[..TAG_LEN]);
        t
    }

    /// `datagram` followed by its tag.
    pub fn seal(&self, datagram: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(datagram.len() + TAG_LEN);
        v.extend_from_slice(datagram);
        v.extend_from_slice(&self.tag(datagram));
        v
    }

    /// The datagram inside `sealed` (what [`DatagramKey::seal`] made), if its tag verifies.
    pub fn open<'a>(&self, sealed: &'a [u8]) -> Result<&'a [u8], TagError> {
        let Some(split) = sealed.len().checked_sub(TAG_LEN) else { return Err(TagError::Missing(sealed.len())) };
        let (datagram, tag) = sealed.split_at(split);
        let want = self.tag(datagram);
        // Constant time: the comparison does not tell how many leading bytes matched.
        let diff = want.iter().zip(tag).fold(0u8, |d, (a, b)| d | (a ^ b));
        if std::hint::black_box(diff) != 0 {
            return Err(TagError::Bad);
        }
        Ok(datagram)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: [u8; TOKEN_LEN] = [7; TOKEN_LEN];
    const ENDS: Ends = Ends { connector: 3, listener: 1 };

    fn key(token: [u8; TOKEN_LEN], p: Protocol) -> HandshakeKey {
        JobSecret::new(token).handshake_key(p)
    }

    /// Runs a handshake between holders of two tokens: (connector's result, listener's result).
    fn run(
        c_token: [u8; TOKEN_LEN],
        l_token: [u8; TOKEN_LEN],
    ) -> (Result<[u8; PROOF_LEN], HandshakeError>, Result<(), HandshakeError>) {
        let c = Connector::new(key(c_token, Protocol::Peers), ENDS).unwrap();
        let (l, ch) = Listener::new(key(l_token, Protocol::Peers), ENDS, c.hello()).unwrap();
        let answer = c.answer(&ch);
        let checked = match &answer {
            Ok(proof) => l.check(proof),
            Err(_) => Err(HandshakeError::Refused),
        };
        (answer, checked)
    }

    #[test]
    fn same_token_passes_both_ways() {
        let (a, l) = run(TOKEN, TOKEN);
        assert!(a.is_ok());
        assert_eq!(l, Ok(()));
    }

    #[test]
    fn wrong_token_fails_on_both_sides() {
        let mut other = TOKEN;
        other[31] ^= 1;
        for (c, l) in [(TOKEN, other), (other, TOKEN)] {
            let (a, checked) = run(c, l);
            assert_eq!(a, Err(HandshakeError::BadProof));
            assert_eq!(checked, Err(HandshakeError::Refused));
        }
    }

    #[test]
    fn nothing_the_connector_sends_first_depends_on_the_token() {
        // The hello is the nonce alone: two connectors with different tokens draw from the same
        // distribution, and the hello verifies as no proof.
        let c = Connector::new(key(TOKEN, Protocol::Peers), ENDS).unwrap();
        let (l, _) = Listener::new(key(TOKEN, Protocol::Peers), ENDS, c.hello()).unwrap();
        assert_eq!(l.check(c.hello()), Err(HandshakeError::BadProof));
        assert!(!c.hello().windows(8).any(|w| TOKEN.windows(8).any(|t| t == w)));
    }

    #[test]
    fn a_proof_does_not_replay_into_another_context() {
        let c = Connector::new(key(TOKEN, Protocol::Peers), ENDS).unwrap();
        let (l, ch) = Listener::new(key(TOKEN, Protocol::Peers), ENDS, c.hello()).unwrap();
        let proof = c.answer(&ch).unwrap();
        assert_eq!(l.check(&proof), Ok(()));
        // The listener's own proof is no connector's proof (reflection).
        assert_eq!(l.check(&ch.proof), Err(HandshakeError::BadProof));
        // A fresh challenge for the same hello: the recorded proof does not verify.
        let (l2, _) = Listener::new(key(TOKEN, Protocol::Peers), ENDS, c.hello()).unwrap();
        assert_eq!(l2.check(&proof), Err(HandshakeError::BadProof));
        // Same nonces, other ends, other protocol.
        let swapped = Ends { connector: 1, listener: 3 };
        let other_ends =
            Listener { key: key(TOKEN, Protocol::Peers), ends: swapped, theirs: *c.hello(), nonce: ch.nonce };
        assert_eq!(other_ends.check(&proof), Err(HandshakeError::BadProof));
        let store = Listener { key: key(TOKEN, Protocol::Store), ends: ENDS, theirs: *c.hello(), nonce: ch.nonce };
        assert_eq!(store.check(&proof), Err(HandshakeError::BadProof));
        // A listener's proof for other ends does not pass at the connector.
        let c2 = Connector { key: key(TOKEN, Protocol::Peers), ends: swapped, nonce: *c.hello() };
        assert_eq!(c2.answer(&ch), Err(HandshakeError::BadProof));
        // Truncated or empty proofs are refused, not compared on a prefix.
        assert_eq!(l.check(&proof[..16]), Err(HandshakeError::BadProof));
        assert_eq!(l.check(&[]), Err(HandshakeError::BadProof));
    }

    #[test]
    fn nonces_are_fresh() {
        let a = Connector::new(key(TOKEN, Protocol::Store), Ends::STORE).unwrap();
        let b = Connector::new(key(TOKEN, Protocol::Store), Ends::STORE).unwrap();
        assert_ne!(a.hello(), b.hello());
    }

    #[test]
    fn sub_keys_and_names_differ_and_hide_the_token() {
        let s = JobSecret::new(TOKEN);
        let (k1, k2) = (s.handshake_key(Protocol::Store).key, s.handshake_key(Protocol::Peers).key);
        assert_ne!(k1, k2);
        assert_ne!(k1, TOKEN);
        assert_eq!(s.shm_name().len(), 16);
        assert_ne!(s.shm_name(), TOKEN[..8].iter().map(|b| format!("{b:02x}")).collect::<String>());
        assert_eq!(s.job_id(), JobSecret::new(TOKEN).job_id(), "the same at every rank");
        let mut other = TOKEN;
        other[0] ^= 1;
        assert_ne!(s.job_id(), JobSecret::new(other).job_id());
        let shown = format!("{s:?} {:?} {:?}", s.datagram_key(), s.handshake_key(Protocol::Peers));
        assert!(!shown.contains("7, 7") && shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn datagram_tags() {
        let k = JobSecret::new(TOKEN).datagram_key();
        let d = b"a multicast datagram".to_vec();
        let sealed = k.seal(&d);
        assert_eq!(sealed.len(), d.len() + TAG_LEN);
        assert_eq!(k.open(&sealed), Ok(&d[..]));
        assert_eq!(k.open(&d[..10]), Err(TagError::Missing(10)));
        assert_eq!(k.open(&[0u8; 3]), Err(TagError::Missing(3)));
        // Any changed bit, in the datagram or in the tag, is refused.
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x10;
            assert_eq!(k.open(&bad), Err(TagError::Bad), "bit flipped at {i}");
        }
        // Untagged, or tagged by another job.
        assert_eq!(k.open(&d), Err(TagError::Bad));
        let mut other = TOKEN;
        other[5] ^= 1;
        assert_eq!(k.open(&JobSecret::new(other).datagram_key().seal(&d)), Err(TagError::Bad));
        // An empty datagram still carries a tag.
        assert_eq!(k.open(&k.seal(&[])), Ok(&[][..]));
    }
}
