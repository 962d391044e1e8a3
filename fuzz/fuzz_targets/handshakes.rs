//! The handshakes (`transports/src/auth.rs`'s challenge-response): the peers' hello exchange on
//! both sides (`transports/src/tcp/mod.rs`) and the bootstrap store's on both sides
//! (`src/bootstrap/kv.rs`), each reading arbitrary bytes as what the other side sent. Besides
//! "no panic": a side that does not know the token never passes, and nothing keyed leaves a side
//! before the other proved itself (the connector and the store's client write only their hello
//! and, at most, a refusal; the listener and the store only their challenge, or a version notice).
#![no_main]

use ferrocomm::bootstrap::kv::fuzzing::{client_handshake, server_handshake};
use ferrocomm_transports::auth::{CHALLENGE_LEN, NONCE_LEN};
use ferrocomm_transports::fuzzing::{peer_accept, peer_connect};
use ferrocomm_transports::wire::{HEADER_LEN, Limits, TOKEN_LEN};
use libfuzzer_sys::fuzz_target;

const TOKEN: [u8; TOKEN_LEN] = [0x5a; TOKEN_LEN];
const LIMITS: Limits = Limits { world_size: 8, eager_limit: 1024, chunk: 4096, max_message: 1 << 20 };
/// The store's answer to a hello: magic, version, status (`src/bootstrap/kv.rs`).
const STORE_ANSWER: usize = 6;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    let (me, other) = (u32::from(which >> 2) % 8, u32::from(which >> 5) % 8);
    match which & 3 {
        0 => {
            let (verdict, wrote) = peer_accept(rest, me, &TOKEN, &LIMITS);
            assert!(verdict.is_err(), "a connector without the token was accepted: {verdict:?}");
            assert!(wrote.is_empty() || wrote.len() == HEADER_LEN + CHALLENGE_LEN, "{} bytes", wrote.len());
        }
        1 => {
            let (verdict, wrote) = peer_connect(rest, me, other, &TOKEN, &LIMITS);
            assert!(verdict.is_err(), "a listener without the token was believed: {verdict:?}");
            // The hello, then at most a refusal (a header alone): never a proof.
            assert!(
                wrote.len() == HEADER_LEN + NONCE_LEN || wrote.len() == 2 * HEADER_LEN + NONCE_LEN,
                "{}",
                wrote.len()
            );
        }
        2 => {
            let (verdict, wrote) = server_handshake(rest, TOKEN);
            assert!(verdict.is_err(), "a client without the token was accepted");
            assert!(matches!(wrote.len(), 0 | STORE_ANSWER | 70), "{} bytes", wrote.len());
            assert_eq!(STORE_ANSWER + CHALLENGE_LEN, 70);
        }
        _ => {
            let (verdict, wrote) = client_handshake(rest, TOKEN);
            assert!(!matches!(verdict, Ok(Ok(()))), "a store without the token was believed");
            // The hello (magic, version, nonce), then at most a refusal byte: never a proof.
            assert!(wrote.len() == 5 + NONCE_LEN || wrote.len() == 6 + NONCE_LEN, "{}", wrote.len());
        }
    }
});
