//! Splitting a communicator by colour and key.

use super::*;

impl Comm {
    /// Splits the communicator: ranks passing the same `color` form a new communicator, ordered by
    /// `key` (then by rank here); `None` takes no part and gets `None`. Collective.
    pub async fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Comm>> {
        let n = self.coll().splits.fetch_add(1, Ordering::Relaxed);
        let mine = [color.map_or(u64::MAX, u64::from), u64::from(key)];
        let all = self.allgather_with(to_bytes(&mine), Algorithm::Bruck).await?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(u64, Rank)> = Vec::new();
        for (r, b) in all.iter().enumerate() {
            let v: Vec<u64> = to_vec(b)?;
            if v.len() != 2 {
                return Err(CollError::Malformed { from: r as u32, why: "a split request of another length" }.into());
            }
            if v[0] == u64::from(color) {
                members.push((v[1], r as Rank));
            }
        }
        members.sort();
        let world: Vec<Rank> = members.iter().map(|&(_, r)| self.world_rank(r)).collect();
        let context = derive_context(derive_context(self.context(), (1 << 30) | n), color);
        Ok(Some(self.with_members(context, world)))
    }
}
