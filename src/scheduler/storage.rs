//! L3 under the joined scheduler: the prefix cache's L3 tier (file store, Mooncake Store)
//! spans the decode runtime's prefix tier too. The cache plans writes and prefetches of host
//! pages as it does for any `HiCache` user; a controller runs them (`sparsetier.l3`). What the
//! scheduler adds: every call into the cache is followed by dropping the objects of the host
//! pages it let go (a prefetch plan may evict host pages and hand them out again in the same
//! call), so no directory object outlives its home.

use super::core::StepScheduler;
use super::PrefixTier;
use crate::error::Result;
use crate::radix::{HiCache, PrefetchPlan};

impl StepScheduler<PrefixTier> {
    /// Runs `f` on the prefix cache (its L3 side), then drops the objects of the host pages it
    /// let go, before anything can reuse them.
    pub fn with_cache<R>(&mut self, f: impl FnOnce(&mut HiCache) -> Result<R>) -> Result<R> {
        let out = f(&mut self.tier.cache);
        let dir = self.dir.clone();
        self.tier.drop_freed(&dir)?;
        out
    }

    /// Frees up to `n` host pages ahead of a prefetch from the store: host-only prefix leaves
    /// first, then the Indexer-K device pages of unlocked prefixes (so that their host pages
    /// can go too), as `alloc_host` does. Returns the host pages free.
    pub fn make_host_room(&mut self, n: usize) -> Result<usize> {
        let dir = self.dir.clone();
        let p = &mut self.tier;
        let mut tried_device = false;
        loop {
            let (free, capacity) = p.cache.host_free_capacity();
            if free >= n.min(capacity) {
                return Ok(free);
            }
            let freed = p.cache.evict_host(n - free)?;
            p.drop_freed(&dir)?;
            if freed > 0 {
                continue;
            }
            // Nothing host-only left to evict: once, the device part of as many prefix pages
            // as are missing goes, so that their host pages can (no more: under write-back an
            // eviction may only queue writes).
            if tried_device || p.cache.evict_device(n - free) == 0 {
                return Ok(free);
            }
            tried_device = true;
        }
    }

    /// Plans a prefetch from the store of pages `start..start + n` of `tokens` into host
    /// pages (`HiCache::plan_prefetch`), after making host room for them; the cached prefix of
    /// those tokens is locked meanwhile, so the room made is never its own pages.
    pub fn plan_l3_prefetch(
        &mut self,
        ns: u32,
        tokens: &[u32],
        start: usize,
        n: usize,
    ) -> Result<Option<PrefetchPlan>> {
        let before = (start * self.cfg.page_size as usize).min(tokens.len());
        let node = self.with_cache(|c| {
            let m = c.match_prefix(ns, &tokens[..before]);
            if m.device_len + m.host_len == 0 {
                return Ok(None);
            }
            c.lock(m.last_node)?;
            Ok(Some(m.last_node))
        })?;
        let plan = self
            .make_host_room(n)
            .and_then(|_| self.with_cache(|c| c.plan_prefetch(ns, tokens, start, n)));
        if let Some(node) = node {
            self.with_cache(|c| c.unlock(node))?;
        }
        plan
    }

    /// Reads the prefix cache.
    pub fn cache(&self) -> &HiCache {
        &self.tier.cache
    }
}
