//! The verbs link protocol (`transports/src/verbs/link.rs`, plain Rust, built without
//! libibverbs): a slot the peer wrote into our memory decodes to a packet whose payload lies
//! inside the slot, within the limits, or to a typed error; what decodes encodes to a slot that
//! decodes the same. And slot credits driven by arbitrary immediates and `freed` counts from the
//! peer refuse what breaks the rules instead of losing count.
#![no_main]

use arbitrary::Arbitrary;
use ferrocomm_transports::verbs::link::{self, Credits, LinkKind, SLOT_HEADER};
use ferrocomm_transports::wire::{Kind, Limits};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum CreditOp {
    /// A slot arrived from the peer with this immediate (then maybe freed at once).
    Arrive { imm: u32, free: bool },
    /// The peer says it freed this many of ours.
    Freed(u32),
    /// We write a slot, if the credits allow.
    Take { credit_only: bool },
    /// We empty the oldest slot we hold.
    Release,
}

#[derive(Arbitrary, Debug)]
struct Input {
    world: u8,
    peer: u8,
    eager: u16,
    chunk: u32,
    max_message: u32,
    slot: Vec<u8>,
    slots: u8,
    credits: Vec<CreditOp>,
}

fuzz_target!(|input: Input| {
    let world = u32::from(input.world % 8) + 1;
    let peer = u32::from(input.peer) % world;
    let limits = Limits {
        world_size: world,
        eager_limit: usize::from(input.eager),
        chunk: input.chunk as usize,
        max_message: input.max_message as usize,
    };
    if let Ok(p) = link::decode(&input.slot, peer, &limits) {
        let payload = p.payload(&input.slot);
        if let Some(h) = &p.header {
            assert_eq!(h.src, peer);
            assert!(h.len as usize <= limits.max_payload(h.kind));
        }
        if p.kind == LinkKind::Eager || p.kind == LinkKind::Frame {
            assert_eq!(payload.len(), p.header.unwrap().len as usize);
        }
        let mut again = vec![0u8; SLOT_HEADER + payload.len()];
        let n = link::encode(&mut again, p.kind, p.freed, p.header.as_ref(), p.remote, payload);
        let q = link::decode(&again[..n], peer, &limits).expect("an encoded slot decodes");
        assert_eq!((q.freed, q.header, q.remote, q.payload(&again[..n])), (p.freed, p.header, p.remote, payload));
        // A frame that fits the compact form is written compact: the kind is all that may change.
        assert!(q.kind == p.kind || (p.kind == LinkKind::Frame && q.kind == LinkKind::Eager));
        if q.kind == LinkKind::Eager {
            assert_eq!(q.header.unwrap().kind, Kind::Eager);
        }
    }

    let slots = u32::from(input.slots).max(2);
    let mut c = Credits::new(slots);
    let mut held = 0u64;
    let mut next_imm = 0u32;
    for op in input.credits.iter().take(4096) {
        match *op {
            CreditOp::Arrive { imm, free } => {
                // Half the time the slot the peer should write next, so that arrivals go deep.
                let imm = if free { next_imm } else { imm };
                if let Ok(slot) = c.arrive(imm) {
                    assert_eq!(slot, next_imm);
                    next_imm = (next_imm + 1) % slots;
                    held += 1;
                    assert!(held <= u64::from(slots), "more slots held than the ring has");
                }
            }
            CreditOp::Freed(f) => {
                let _ = c.on_freed(f);
            }
            CreditOp::Take { credit_only } => {
                if c.can_send(credit_only) {
                    let (slot, _) = c.take();
                    assert!(slot < slots);
                }
            }
            CreditOp::Release => {
                if held > 0 {
                    c.release();
                    held -= 1;
                }
            }
        }
        assert!(c.outstanding() <= u64::from(slots), "more slots written than the peer has");
        let _ = c.wants_update();
    }
});
