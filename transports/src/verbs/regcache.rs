//! Registration cache for buffers the transport lends to the device (rendezvous sources).
//!
//! Registering memory pins its pages and costs a system call (tens of microseconds for large
//! buffers), so a sender that sends the same buffer again should find it registered. The classic
//! danger (001, section 3) is staleness: the program frees a registered buffer, the allocator
//! hands the same virtual addresses out again backed by other pages, and a cache keyed by address
//! serves the old registration, through which the device reads the *old* pages.
//!
//! Here a registration's lifetime is tied to the buffer's ownership: each entry owns a clone of
//! the [`Bytes`] it covers, so the memory cannot be freed while the registration exists, and no
//! other buffer can ever occupy its addresses meanwhile. When the program drops its last handle
//! (the entry's clone is then [`Bytes::is_unique`]), the buffer counts as freed: the entry is
//! invalidated (deregistered, then the memory released) at the next [`RegCache::acquire`] or
//! [`RegCache::sweep`]. Entries are keyed by address range (a lookup finds any entry covering
//! the requested range with the needed access), evicted least recently used when the cache is
//! over its entry or byte budget, and never while in use (pinned by an in-flight operation).
//!
//! A message cut into chunks is registered once: the first chunk's entry covers the whole
//! message ([`RegCache::acquire_extent`]), owned by that chunk (all chunks share one buffer).
//!
//! Receive buffers are not cached: the engine owns them and hands the transport only a slice,
//! so their lifetime cannot be tied to a registration; they are registered for one operation
//! and deregistered before the frame that completes it is delivered.

use std::collections::BTreeMap;
use std::io;

use bytes::Bytes;
use slab::Slab;

/// Makes registrations. The cache keeps the memory alive for as long as a region exists.
pub trait Registrar {
    /// Deregisters on drop.
    type Region;
    /// Registers `len` bytes at `addr` with the verbs `access` flags.
    fn register(&mut self, addr: *const u8, len: usize, access: u32) -> io::Result<Self::Region>;
}

struct Entry<R> {
    start: usize,
    len: usize,
    access: u32,
    in_use: u32,
    last_used: u64,
    /// Dropped (deregistered) before `owner`: fields drop in declaration order.
    region: R,
    owner: Bytes,
}

/// An in-use entry; give it back with [`RegCache::release`].
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub struct Pin(usize);

/// Counters (for tests and tuning).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups served by an entry already registered.
    pub hits: u64,
    /// Lookups that made a new registration.
    pub misses: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
    /// Entries dropped because the program freed their buffer.
    pub invalidations: u64,
}

/// See the module documentation.
pub struct RegCache<R> {
    entries: Slab<Entry<R>>,
    /// (start address, entry key).
    by_start: BTreeMap<(usize, usize), ()>,
    tick: u64,
    max_entries: usize,
    max_bytes: usize,
    bytes: usize,
    stats: CacheStats,
}

impl<R> RegCache<R> {
    /// An empty cache; it evicts entries not in use while it holds more than `max_entries`
    /// registrations or more than `max_bytes` bytes.
    pub fn new(max_entries: usize, max_bytes: usize) -> RegCache<R> {
        RegCache {
            entries: Slab::new(),
            by_start: BTreeMap::new(),
            tick: 0,
            max_entries: max_entries.max(1),
            max_bytes,
            bytes: 0,
            stats: CacheStats::default(),
        }
    }

    /// A registration covering all of `data` with at least `access`, pinned until released.
    pub fn acquire<G: Registrar<Region = R>>(&mut self, reg: &mut G, data: &Bytes, access: u32) -> io::Result<Pin> {
        self.acquire_extent(reg, data, data.len(), access)
    }

    /// Like [`RegCache::acquire`], but on a miss registers `extent` bytes from `data`'s start,
    /// so that the following pieces of a larger buffer hit.
    ///
    /// The caller vouches that the `extent` bytes lie in the same allocation as `data` (the
    /// chunks of one message are slices of one buffer): the entry owns a clone of `data`, which
    /// keeps that whole allocation alive. `extent` is at least `data.len()`.
    pub fn acquire_extent<G: Registrar<Region = R>>(
        &mut self,
        reg: &mut G,
        data: &Bytes,
        extent: usize,
        access: u32,
    ) -> io::Result<Pin> {
        self.sweep();
        self.tick += 1;
        let (start, len) = (data.as_ptr() as usize, data.len());
        let hit = self.by_start.range(..=(start, usize::MAX)).rev().map(|(&(_, k), _)| k).find(|&k| {
            let e = &self.entries[k];
            e.start + e.len >= start + len && e.access & access == access
        });
        let key = match hit {
            Some(k) => {
                self.stats.hits += 1;
                k
            }
            None => {
                self.stats.misses += 1;
                let len = extent.max(len);
                let region = reg.register(data.as_ptr(), len, access)?;
                let e = Entry { start, len, access, in_use: 0, last_used: 0, region, owner: data.clone() };
                let k = self.entries.insert(e);
                self.by_start.insert((start, k), ());
                self.bytes += len;
                k
            }
        };
        let e = &mut self.entries[key];
        e.in_use += 1;
        e.last_used = self.tick;
        self.evict();
        Ok(Pin(key))
    }

    /// The region of a pinned entry.
    pub fn region(&self, pin: &Pin) -> &R {
        &self.entries[pin.0].region
    }

    /// The operation that pinned the entry is over.
    pub fn release(&mut self, pin: Pin) {
        let e = &mut self.entries[pin.0];
        e.in_use -= 1;
        self.evict();
    }

    /// Invalidates entries whose buffer the program has freed (the cache holds the last handle).
    pub fn sweep(&mut self) {
        let freed: Vec<usize> =
            self.entries.iter().filter(|(_, e)| e.in_use == 0 && e.owner.is_unique()).map(|(k, _)| k).collect();
        for k in freed {
            self.remove(k);
            self.stats.invalidations += 1;
        }
    }

    fn evict(&mut self) {
        while self.entries.len() > self.max_entries || self.bytes > self.max_bytes {
            let lru =
                self.entries.iter().filter(|(_, e)| e.in_use == 0).min_by_key(|(_, e)| e.last_used).map(|(k, _)| k);
            let Some(k) = lru else { break };
            self.remove(k);
            self.stats.evictions += 1;
        }
    }

    fn remove(&mut self, k: usize) {
        let e = self.entries.remove(k);
        self.by_start.remove(&(e.start, k));
        self.bytes -= e.len;
        drop(e); // region first, then the memory
    }

    /// Its counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Records registrations and deregistrations; a region remembers the bytes it covered when
    /// made, and checks on drop that its memory still holds them (i.e. was not freed and reused
    /// while registered).
    #[derive(Default)]
    struct Fake {
        log: Rc<RefCell<Vec<String>>>,
        next: u32,
    }

    struct Region {
        id: u32,
        addr: *const u8,
        snapshot: Vec<u8>,
        log: Rc<RefCell<Vec<String>>>,
    }

    impl Drop for Region {
        fn drop(&mut self) {
            // SAFETY: the region was made for `snapshot.len()` bytes at `addr`, and the cache keeps
            // the buffer that owns them alive until after the region drops (an entry drops
            // `region` before `owner`); that guarantee is what this test checks.
            let now = unsafe { std::slice::from_raw_parts(self.addr, self.snapshot.len()) };
            assert_eq!(now, &self.snapshot[..], "registration {} outlived its memory", self.id);
            self.log.borrow_mut().push(format!("dereg {}", self.id));
        }
    }

    impl Registrar for Fake {
        type Region = Region;
        fn register(&mut self, addr: *const u8, len: usize, _access: u32) -> io::Result<Region> {
            self.next += 1;
            self.log.borrow_mut().push(format!("reg {}", self.next));
            // SAFETY: the cache passes memory it keeps alive.
            let snapshot = unsafe { std::slice::from_raw_parts(addr, len) }.to_vec();
            Ok(Region { id: self.next, addr, snapshot, log: self.log.clone() })
        }
    }

    fn buf(len: usize, fill: u8) -> Bytes {
        Bytes::from(vec![fill; len])
    }

    #[test]
    fn hits_cover_sub_ranges_and_need_the_access() {
        let mut f = Fake::default();
        let mut c = RegCache::new(8, 1 << 30);
        let a = buf(4096, 1);
        let p = c.acquire(&mut f, &a, 4).unwrap();
        c.release(p);
        let p = c.acquire(&mut f, &a.slice(100..200), 4).unwrap();
        assert_eq!(c.region(&p).id, 1, "a sub-range hits");
        c.release(p);
        let p = c.acquire(&mut f, &a, 4 | 2).unwrap();
        assert_eq!(c.region(&p).id, 2, "more access needs a new registration");
        c.release(p);
        assert_eq!(c.stats().hits, 1);
    }

    #[test]
    fn chunks_of_one_buffer_share_one_registration_and_free_together() {
        let mut f = Fake::default();
        let mut c = RegCache::new(8, 1 << 30);
        let whole = buf(3000, 5);
        let chunks: Vec<Bytes> = (0..3).map(|i| whole.slice(i * 1000..(i + 1) * 1000)).collect();
        drop(whole);
        let p = c.acquire_extent(&mut f, &chunks[0], 3000, 0).unwrap();
        let q = c.acquire(&mut f, &chunks[2], 0).unwrap();
        assert_eq!((c.region(&p).id, c.region(&q).id), (1, 1));
        c.release(p);
        c.release(q);
        drop(chunks);
        c.sweep();
        assert!(c.is_empty(), "the program freed every chunk: the entry goes");
        assert_eq!(c.stats().invalidations, 1);
    }

    #[test]
    fn lru_eviction_never_takes_an_entry_in_use() {
        let mut f = Fake::default();
        let mut c = RegCache::new(2, 1 << 30);
        let bufs: Vec<Bytes> = (0..4).map(|i| buf(100, i)).collect();
        let p0 = c.acquire(&mut f, &bufs[0], 0).unwrap(); // in use throughout
        let p1 = c.acquire(&mut f, &bufs[1], 0).unwrap();
        c.release(p1);
        let p2 = c.acquire(&mut f, &bufs[2], 0).unwrap(); // evicts 1 (LRU, free), not 0
        assert_eq!(c.len(), 2);
        let p3 = c.acquire(&mut f, &bufs[3], 0).unwrap(); // all in use: over budget for now
        assert_eq!(c.len(), 3);
        assert!(f.log.borrow().contains(&"dereg 2".to_string()));
        assert!(!f.log.borrow().contains(&"dereg 1".to_string()), "entry in use was evicted");
        c.release(p2);
        c.release(p3);
        assert_eq!(c.len(), 2, "back within budget once entries are free");
        let p = c.acquire(&mut f, &bufs[0], 0).unwrap();
        assert_eq!(c.region(&p).id, 1, "the in-use entry survived");
        c.release(p);
        c.release(p0);
    }

    /// A buffer freed while registered is never read through the stale registration: the cache
    /// keeps the memory until it deregisters, and a new buffer (even at the same address, which
    /// the allocator commonly returns) gets a new registration with its own contents.
    #[test]
    fn freed_buffer_is_invalidated_never_served_stale() {
        let mut f = Fake::default();
        let mut c = RegCache::new(64, 1 << 30);
        let mut reused = 0;
        for round in 0..50u8 {
            let a = buf(1 << 20, round);
            let addr = a.as_ptr();
            let p = c.acquire(&mut f, &a, 4).unwrap();
            assert_eq!(c.region(&p).snapshot[0], round);
            c.release(p);
            drop(a); // the program frees its buffer while it is registered
            if round % 2 == 0 {
                // Invalidate now, so the allocator may hand the same addresses to `b`.
                c.sweep();
            }
            let b = buf(1 << 20, round.wrapping_add(100));
            reused += usize::from(b.as_ptr() == addr);
            let p = c.acquire(&mut f, &b, 4).unwrap();
            // The registration used for `b` covers `b`'s bytes, not the freed buffer's.
            assert_eq!(c.region(&p).snapshot[0], round.wrapping_add(100));
            assert_eq!(c.region(&p).addr, b.as_ptr());
            c.release(p);
            drop(b);
        }
        c.sweep();
        assert_eq!(c.stats().invalidations, 100, "{:?}", c.stats());
        assert!(c.is_empty());
        // Deregistration always came before the memory went (checked in Region::drop).
        println!("new buffer at the freed buffer's address in {reused} of 50 rounds");
    }
}
