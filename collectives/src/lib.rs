//! Collective operations as sans-IO schedules over point-to-point exchanges.
//!
//! A schedule says which exchanges a rank takes part in and in which order; it does no I/O, so the
//! same schedule runs on every transport and in simulation, and its round counts are checked
//! against the algorithm's formula in unit tests.

/// One round of a pairwise schedule: send to `to` and receive from `from`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Exchange {
    pub round: u32,
    pub to: u32,
    pub from: u32,
}

/// The dissemination barrier (Hensgen, Finkel and Manber): in round k, rank r signals
/// r + 2^k and waits for r - 2^k (mod n). ceil(log2 n) rounds for any n, no power of two needed.
#[derive(Clone, Debug)]
pub struct Dissemination {
    rank: u32,
    size: u32,
    round: u32,
}

impl Dissemination {
    /// The schedule of `rank` in a group of `size`.
    pub fn new(rank: u32, size: u32) -> Dissemination {
        assert!(rank < size, "rank {rank} outside a group of {size}");
        Dissemination { rank, size, round: 0 }
    }

    /// Number of rounds for a group of `size`: ceil(log2 size).
    pub fn rounds(size: u32) -> u32 {
        size.max(1).next_power_of_two().trailing_zeros()
    }
}

impl Iterator for Dissemination {
    type Item = Exchange;

    fn next(&mut self) -> Option<Exchange> {
        let dist = 1u64 << self.round;
        if dist >= self.size as u64 {
            return None;
        }
        let (n, r, d) = (self.size as u64, self.rank as u64, dist);
        let e = Exchange { round: self.round, to: ((r + d) % n) as u32, from: ((r + n - d) % n) as u32 };
        self.round += 1;
        Some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the barrier for every group size: nobody leaves before everybody entered, and the
    /// round count is ceil(log2 n).
    #[test]
    fn dissemination_synchronizes_everyone() {
        for n in 1..=64u32 {
            // knows[r] = set of ranks whose arrival r has (transitively) heard of.
            let mut knows: Vec<u128> = (0..n).map(|r| 1u128 << r).collect();
            let schedules: Vec<Vec<Exchange>> = (0..n).map(|r| Dissemination::new(r, n).collect()).collect();
            assert!(schedules.iter().all(|s| s.len() as u32 == Dissemination::rounds(n)));
            for round in 0..Dissemination::rounds(n) as usize {
                let before = knows.clone();
                for (r, schedule) in schedules.iter().enumerate() {
                    let e = schedule[round];
                    assert_eq!(schedules[e.to as usize][round].from, r as u32, "pairs agree");
                    knows[e.to as usize] |= before[r];
                }
            }
            let all = if n == 128 { u128::MAX } else { (1u128 << n) - 1 };
            assert!(knows.iter().all(|&k| k == all), "n = {n}");
        }
    }
}
