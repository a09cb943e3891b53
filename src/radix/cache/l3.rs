//! The L3 tier of a [`HiCache`]: write plans (write-through when a host copy becomes Ready,
//! write-back when the host tier evicts), prefetch plans into host pages, and their
//! settlement. See [`super::storage`] for what the core keeps and what a backend does.

use crate::error::{Error, Result};
use crate::ids::PageId;
use crate::radix::storage::{
    page_keys, PageKey, PrefetchOp, PrefetchPlan, StorageTier, WritePlan, WritePolicy,
};
use crate::radix::tree::{HostCopy, NodeId};
use crate::radix::HiCache;

impl HiCache {
    /// Puts an L3 tier under the host tier: writes under `policy`, page keys salted with
    /// `salt` (model version, LoRA), up to `remember` stored keys remembered, and under
    /// write-back `write_ahead` (a share in [0, 1]) of the host tier kept clean.
    pub fn enable_storage(
        &mut self,
        policy: WritePolicy,
        salt: String,
        remember: usize,
        write_ahead: f64,
    ) -> Result<()> {
        if !(0.0..=1.0).contains(&write_ahead) {
            return Err(Error::config(
                "write_ahead",
                write_ahead,
                "a share of host pages in [0, 1]",
            ));
        }
        if self.copies.is_none() || self.host.is_none() {
            return Err(Error::config(
                "storage_backend",
                "set",
                "a HiCache with pools and a host tier (L3 stores host pages)",
            ));
        }
        if self.storage.is_some() {
            return Err(Error::config(
                "storage_backend",
                "set twice",
                "one L3 tier per cache",
            ));
        }
        self.storage = Some(StorageTier::new(policy, salt, remember, write_ahead));
        Ok(())
    }

    /// The L3 tier, if any.
    pub fn storage(&self) -> Option<&StorageTier> {
        self.storage.as_ref()
    }

    fn tier(&self) -> Result<&StorageTier> {
        self.storage
            .as_ref()
            .ok_or_else(|| Error::config("storage_backend", "None", "a HiCache with an L3 tier"))
    }

    fn tier_mut(&mut self) -> Result<&mut StorageTier> {
        self.storage
            .as_mut()
            .ok_or_else(|| Error::config("storage_backend", "None", "a HiCache with an L3 tier"))
    }

    /// The store keys of the whole pages of `tokens` in namespace `ns`.
    pub fn storage_keys(&self, ns: u32, tokens: &[u32]) -> Result<Vec<PageKey>> {
        let t = self.tier()?;
        Ok(page_keys(&t.salt, ns, tokens, self.tree.page_size()))
    }

    /// Turns the store on or off (unreachable). Off: no new plans, write-back evicts without
    /// writing; what is in flight still ends through the usual calls.
    pub fn set_storage_online(&mut self, on: bool) -> Result<()> {
        let t = self.tier_mut()?;
        if t.online && !on {
            t.totals.offline_events += 1;
        }
        if !t.online && on {
            t.clear_failed();
        }
        t.online = on;
        Ok(())
    }

    /// Keys of the pages of `node`, with its namespace.
    fn node_keys(&self, node: NodeId) -> Result<Vec<PageKey>> {
        let (ns, tokens) = self.tree.path_tokens(node)?;
        let t = self.tier()?;
        let keys = page_keys(&t.salt, ns, &tokens, self.tree.page_size());
        let k = self.tree.node_pages(node)?;
        Ok(keys[keys.len() - k..].to_vec())
    }

    /// Write-through: queues writes of the host-Ready pages on the path to `last` that the
    /// store lacks. No-op without an online write-through tier.
    pub(crate) fn write_through_path(&mut self, last: NodeId) -> Result<()> {
        let Some(t) = self.storage.as_ref() else {
            return Ok(());
        };
        if !t.online || t.policy != WritePolicy::WriteThrough {
            return Ok(());
        }
        let (ns, tokens) = self.tree.path_tokens(last)?;
        let keys = page_keys(&t.salt, ns, &tokens, self.tree.page_size());
        let mut at = 0;
        for (node, k) in self.tree.path_nodes(last)? {
            let node_keys = &keys[at..at + k];
            at += k;
            if self.tree.host_copy(node)? == HostCopy::Ready {
                self.queue_write(node, node_keys)?;
            }
        }
        Ok(())
    }

    /// Pins `node`'s host pages and plans a write of its pages the store lacks. Returns
    /// whether it did.
    fn queue_write(&mut self, node: NodeId, keys: &[PageKey]) -> Result<bool> {
        let t = self.storage.as_ref().expect("caller checked");
        // Keys whose write failed are not tried again until they leave (no livelock).
        let need: Vec<usize> = t
            .unstored(keys)
            .into_iter()
            .filter(|&i| !t.gave_up(&keys[i]))
            .collect();
        if need.is_empty() {
            return Ok(false);
        }
        let host = self.tree.host_pages_of(node)?;
        let pages: Vec<PageId> = need.iter().map(|&i| host[i]).collect();
        let keys: Vec<PageKey> = need.iter().map(|&i| keys[i]).collect();
        self.tree.pin_host(node)?;
        self.storage
            .as_mut()
            .expect("caller checked")
            .add_write(node, keys, pages);
        Ok(true)
    }

    /// Host eviction as the L3 policy wants it: under an online write-back tier a victim the
    /// store lacks is written first (pinned meanwhile) and leaves on a later eviction; the rest
    /// leave now. Returns the host pages freed from the tree (not yet given to the allocator).
    pub(crate) fn evict_host_tree(&mut self, n: usize) -> Result<Vec<PageId>> {
        let write_back = self
            .storage
            .as_ref()
            .is_some_and(|t| t.online && t.policy == WritePolicy::WriteBack);
        if !write_back {
            let freed = self.tree.evict_host(n);
            if let Some(t) = self.storage.as_mut() {
                if t.policy == WritePolicy::WriteBack {
                    t.totals.evicted_unstored += freed.len() as u64;
                }
            }
            return Ok(freed);
        }
        let mut freed = Vec::new();
        while freed.len() < n {
            let Some(v) = self.tree.host_victim() else {
                break;
            };
            let keys = self.node_keys(v)?;
            let t = self.storage.as_ref().expect("checked");
            let need: Vec<PageKey> = t
                .unstored(&keys)
                .into_iter()
                .map(|i| keys[i])
                .filter(|k| !t.gave_up(k))
                .collect();
            if need.is_empty() {
                let t = self.storage.as_mut().expect("checked");
                for k in &keys {
                    t.forget_failed(k);
                }
                freed.extend(self.tree.evict_host_node(v)?);
            } else {
                self.queue_write(v, &keys)?;
            }
        }
        Ok(freed)
    }

    /// Write-back ahead of need: while fewer than the tier's `write_ahead` share of host
    /// pages are free, plans writes for the least recently used host-evictable pages the store
    /// lacks, until the shortfall is stored or being written, so that host eviction finds
    /// clean victims instead of waiting for writes. Returns the pages planned.
    pub fn storage_write_ahead(&mut self) -> Result<usize> {
        let t = self.tier()?;
        if !t.online || t.policy != WritePolicy::WriteBack {
            return Ok(0);
        }
        let h = self.host.as_ref().expect("storage implies a host tier");
        let target = (t.write_ahead * h.capacity() as f64).ceil() as usize;
        let pages = target.saturating_sub(h.free_count());
        if pages == 0 {
            return Ok(0);
        }
        let mut covered = 0;
        let mut planned = 0;
        // Victims being written are locked and leave the LRU set: look a bounded way ahead.
        for v in self.tree.host_victims(pages) {
            if covered >= pages {
                break;
            }
            let keys = self.node_keys(v)?;
            covered += keys.len();
            let t = self.storage.as_ref().expect("checked");
            let need = t
                .unstored(&keys)
                .into_iter()
                .filter(|&i| !t.gave_up(&keys[i]))
                .count();
            if need > 0 && self.queue_write(v, &keys)? {
                planned += need;
            }
        }
        Ok(planned)
    }

    /// Write plans queued since the last call, for the backend to run.
    pub fn take_storage_writes(&mut self) -> Result<Vec<WritePlan>> {
        Ok(self.tier_mut()?.take_plans())
    }

    /// Ends write `id`: `ok[i]` says whether page i was stored. Unpins the node.
    pub fn storage_write_done(&mut self, id: u64, ok: &[bool]) -> Result<()> {
        let t = self.tier_mut()?;
        let pages = t
            .writes
            .get(&id)
            .ok_or(Error::UnknownTransfer { id })?
            .keys
            .len();
        if ok.len() != pages {
            return Err(Error::config(
                "ok",
                format!("{} entries", ok.len()),
                format!("{pages}: one per page of write {id}"),
            ));
        }
        let op = t.end_write(id, ok).expect("checked");
        self.tree.unpin_host(op.node)
    }

    /// Plans a prefetch of pages `start_page..start_page + n_pages` of `tokens` from the store
    /// into host pages (evicting host leaves as needed; fewer pages when the host tier cannot
    /// give them all). `None` when nothing can be fetched (store off, no host page).
    pub fn plan_prefetch(
        &mut self,
        ns: u32,
        tokens: &[u32],
        start_page: usize,
        n_pages: usize,
    ) -> Result<Option<PrefetchPlan>> {
        let ps = self.tree.page_size();
        if !self.tier()?.online || n_pages == 0 {
            return Ok(None);
        }
        let whole = tokens.len() / ps;
        if start_page + n_pages > whole {
            return Err(Error::config(
                "n_pages",
                n_pages,
                format!(
                    "at most {}: the whole pages of the tokens after page {start_page}",
                    whole.saturating_sub(start_page)
                ),
            ));
        }
        let free = self
            .host
            .as_ref()
            .expect("storage implies a host tier")
            .free_count();
        if free < n_pages {
            let freed = self.evict_host_tree(n_pages - free)?;
            self.release_host(freed);
        }
        let h = self.host.as_mut().expect("checked");
        let got = n_pages.min(h.free_count());
        if got == 0 {
            return Ok(None);
        }
        let host_pages = h.alloc(got)?;
        let end = (start_page + got) * ps;
        let t = self.storage.as_mut().expect("checked");
        let keys = page_keys(&t.salt, ns, &tokens[..end], ps)[start_page..].to_vec();
        let id = t.add_prefetch(PrefetchOp {
            ns,
            tokens: tokens[..end].to_vec(),
            start_page,
            keys: keys.clone(),
            host_pages: host_pages.clone(),
            committed: None,
        });
        Ok(Some(PrefetchPlan {
            id,
            keys,
            host_pages,
        }))
    }

    /// Inserts the first `arrived` pages of prefetch `id` (complete and verified) into the
    /// tree as host copies; pages the tree already holds are freed. Once per prefetch; the
    /// pages after `arrived` stay held (their reads may still run) until
    /// [`Self::prefetch_end`]. Returns the pages inserted.
    pub fn prefetch_commit(&mut self, id: u64, arrived: usize) -> Result<usize> {
        let ps = self.tree.page_size();
        let t = self.tier_mut()?;
        let op = t
            .prefetches
            .get_mut(&id)
            .ok_or(Error::UnknownTransfer { id })?;
        if op.committed.is_some() {
            return Err(Error::config(
                "prefetch",
                id,
                "a prefetch not committed yet (commit once, then end)",
            ));
        }
        let arrived = arrived.min(op.host_pages.len());
        let given: Vec<PageId> = op.host_pages.drain(..arrived).collect();
        op.committed = Some(arrived);
        let (ns, start) = (op.ns, op.start_page);
        let tokens = op.tokens[..(start + arrived) * ps].to_vec();
        let keys = op.keys[..arrived].to_vec();
        t.mark_stored(&keys);
        let (_, spare) = self.tree.insert_host(ns, &tokens, start, &given)?;
        let inserted = arrived - spare.len();
        let t = self.storage.as_mut().expect("checked");
        t.totals.pages_prefetched += inserted as u64;
        t.totals.prefetch_spare += spare.len() as u64;
        self.host
            .as_mut()
            .expect("checked")
            .free(&spare)
            .expect("prefetch pages are allocated");
        Ok(inserted)
    }

    /// Ends prefetch `id` once no read writes its pages any more: the pages not committed are
    /// freed (counted missed).
    pub fn prefetch_end(&mut self, id: u64) -> Result<()> {
        let t = self.tier_mut()?;
        let op = t.end_prefetch(id).ok_or(Error::UnknownTransfer { id })?;
        t.totals.prefetch_missed += op.host_pages.len() as u64;
        self.host
            .as_mut()
            .expect("storage implies a host tier")
            .free(&op.host_pages)
            .expect("prefetch pages are allocated");
        Ok(())
    }

    /// Host page byte ranges `(address, length)` of `page` in every pool, adjacent ranges
    /// merged: what a backend stores under the page's key, in order.
    pub fn host_segments(&self, page: PageId) -> Result<Vec<(u64, u64)>> {
        let h = self
            .host
            .as_ref()
            .ok_or_else(|| Error::config("host_pages", 0, "a HiCache with a host tier"))?;
        if !h.is_allocated(page) {
            return Err(Error::config(
                "page",
                page.raw(),
                "an allocated host page (from a storage plan)",
            ));
        }
        let mut out: Vec<(u64, u64)> = Vec::new();
        for p in self.copies.iter().flat_map(|c| &c.pools) {
            let b = &p.host;
            let len = b.page_bytes();
            let mut pool: Vec<(u64, u64)> = Vec::new();
            for plane in 0..b.plane_count() {
                let a = b.row_addr(plane, page.raw(), 0);
                match pool.last_mut() {
                    Some(last) if last.0 + last.1 == a => last.1 += len,
                    _ => pool.push((a, len)),
                }
            }
            out.extend(pool);
        }
        Ok(out)
    }

    /// Host pages the store's prefetches hold.
    pub(crate) fn storage_held_host(&self) -> usize {
        self.storage.as_ref().map_or(0, |t| t.held_host_pages())
    }
}
