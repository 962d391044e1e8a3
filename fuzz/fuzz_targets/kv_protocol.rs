//! The bootstrap key-value store's protocol (`src/bootstrap/kv.rs`): the requests a server reads
//! from a connection after the handshake, the answer a client reads to a get, and the report a
//! watch reads. Any bytes give requests and values within the store's limits, or a typed error;
//! never a panic, and never an allocation the limits do not allow.
#![no_main]

use ferrocomm::bootstrap::kv::fuzzing::{Decoded, get_reply, server_requests, watch_report};
use ferrocomm::bootstrap::kv::{MAX_KEY_LEN, MAX_VALUE_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else { return };
    if which & 1 == 0 {
        let (requests, _end) = server_requests(rest);
        let mut used = 0;
        for r in &requests {
            match r {
                Decoded::Put { key, value_len } => {
                    assert!(key.len() <= MAX_KEY_LEN && *value_len <= MAX_VALUE_LEN);
                    used += 1 + 2 + key.len() + 4 + value_len;
                }
                Decoded::Get { key, wait_ms } => {
                    assert!(key.len() <= MAX_KEY_LEN && *wait_ms <= u64::from(u32::MAX));
                    used += 1 + 2 + key.len() + 4;
                }
            }
        }
        assert!(used <= rest.len(), "requests decoded from bytes that were not there");
    } else if which & 2 == 0 {
        if let Ok(Some(value)) = get_reply(rest) {
            assert!(value.len() <= MAX_VALUE_LEN && 5 + value.len() <= rest.len());
        }
    } else if let Ok(report) = watch_report(rest) {
        assert!(report.len() <= MAX_VALUE_LEN && 4 + report.len() <= rest.len());
    }
});
