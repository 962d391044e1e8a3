//! Multicast datagrams and the control messages of reliable multicast
//! (`multicast/src/wire.rs`). A datagram can come from anyone on the network: any bytes under any
//! expectations decode to a datagram that meets them or to a typed error, and a data fragment's
//! payload is exactly the share of the message its index names. Control messages decode to a
//! message naming a rank of the group, and what decodes encodes back to the same bytes.
#![no_main]

use arbitrary::Arbitrary;
use bytes::Bytes;
use ferrocomm_multicast::wire::{self, Control, Datagram, Expect, HEADER};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    control: bool,
    job: u64,
    channel: u32,
    size: u32,
    datagram: u16,
    max_message: u32,
    bytes: Vec<u8>,
}

fuzz_target!(|input: Input| {
    let bytes = Bytes::from(input.bytes);
    if input.control {
        if let Ok(c) = Control::decode(bytes.clone(), input.size) {
            let root = match &c {
                Control::Ack { root, .. }
                | Control::Report { root, .. }
                | Control::Nack { root, .. }
                | Control::Data { root, .. }
                | Control::PingAck { root, .. } => *root,
            };
            assert!(root < input.size);
            // The encoding is canonical but for the padding and a copy flag other than 1.
            let again = Control::decode(c.encode(), input.size).expect("an encoded message decodes");
            assert_eq!(again, c);
        }
        return;
    }
    let e = Expect {
        job: input.job,
        channel: input.channel,
        size: input.size,
        datagram: usize::from(input.datagram),
        max_message: input.max_message as usize,
    };
    match wire::decode(bytes.clone(), &e) {
        Ok(Datagram::Ping { root, .. } | Datagram::Tail { root, .. }) => assert!(root < e.size),
        Ok(Datagram::Data { root, seq, len, frag, frags, payload }) => {
            assert!(root < e.size && (len as usize) <= e.max_message && frag < frags);
            assert_eq!(usize::from(frags), wire::fragments(len as usize, e.datagram));
            assert!(bytes.len() <= e.datagram && payload.len() + HEADER == bytes.len());
            // Re-encoding the message this fragment belongs to gives the same fragment back
            // (when the message is small enough to build here).
            if len <= 1 << 16 {
                let p = wire::fragment_payload(e.datagram);
                let mut msg = vec![0u8; len as usize];
                let at = usize::from(frag) * p;
                msg[at..at + payload.len()].copy_from_slice(&payload);
                let all = wire::encode_data(e.job, e.channel, root, seq, &msg, e.datagram);
                let again = &all[usize::from(frag)];
                // Equal but for the reserved field, which the decoder ignores.
                assert_eq!((&again[..34], &again[36..]), (&bytes[..34], &bytes[36..]));
            }
        }
        Err(_) => {}
    }
});
