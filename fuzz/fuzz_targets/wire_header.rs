//! The frame header every transport carries (`transports/src/wire.rs`): any 48 bytes under any
//! limits decode to a header within those limits or to a typed error, and what decodes encodes
//! back to the same bytes.
#![no_main]

use ferrocomm_transports::wire::{HEADER_LEN, Header, Kind, Limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: ([u8; HEADER_LEN], u32, u32, u32, u32)| {
    let (bytes, world_size, eager, chunk, max_message) = input;
    let limits =
        Limits { world_size, eager_limit: eager as usize, chunk: chunk as usize, max_message: max_message as usize };
    let Ok(h) = Header::decode(&bytes, &limits) else { return };
    assert!(h.src < limits.world_size);
    assert!(h.len as usize <= limits.max_payload(h.kind));
    if h.kind == Kind::Rts {
        assert!(h.aux <= limits.max_message as u64);
    }
    assert_eq!(h.encode(), bytes, "a decoded header encodes back to its bytes");
});
