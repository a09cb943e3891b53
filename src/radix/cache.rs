//! `HiCache`: the prefix tree driven over a device and a host tier.
//!
//! # What it owns
//! The tree, the page allocators of both tiers (one page index addresses every pool of the
//! group on a tier), the pool bindings, the copy engine, and the transfers in flight.
//!
//! # Workflow
//! - `alloc_device` hands pages to a request (evicting LRU device leaves if needed);
//! - `insert` puts the request's pages in the tree, frees duplicates, and queues a
//!   write-through backup of every device node without a host copy;
//! - `match_prefix` returns the device part and the host part of a cached prefix;
//!   `load_back` queues a restore of the host part into fresh device pages of every pool
//!   (KV, Indexer-K and draft: every page; SWA: the pages of its window), all or nothing;
//! - `flush` submits everything queued in this scheduling step as at most two transfers, one
//!   backup group and one load group, each with one event per layer;
//! - `poll` settles finished transfers: host copies become hit sources, loaded pages become
//!   readable; a failed copy's pages are freed only then, when it can no longer write them.

use super::storage::StorageTier;
use super::tree::{InsertResult, MatchResult, NodeId, RadixTree};
use crate::alloc::{Expect, Holder, PageAllocator, Stamp};
use crate::config::HitPolicy;
use crate::error::{Error, Result};
use crate::ids::PageId;
use crate::transfer::binding::{check_disjoint, check_same_rows};
use crate::transfer::{
    CopyEngine, Direction, Granularity, LayerStatus, PageTransferBinding, PageTransferGroup,
    PageTransferMap, PreparedPageTransfer, TransferEvents,
};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// One pool of the group on both tiers.
#[derive(Debug, Clone)]
pub struct PoolPair {
    /// The device buffer (layer-first); `None` for a pool kept on host only, whose pages a
    /// step scheduler loads layer by layer as selections pick them (main KV under sparse
    /// attention, the joined mode).
    pub device: Option<PageTransferBinding>,
    /// The host buffer.
    pub host: PageTransferBinding,
    /// ALL_PAGES, or WINDOW(w) for SWA.
    pub hit: HitPolicy,
}

/// Sizes and policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HiCacheConfig {
    /// Tokens per page.
    pub page_size: usize,
    /// Device pages (reserve included).
    pub device_pages: u32,
    /// Device pages never handed out.
    pub device_reserve: u32,
    /// Host pages (reserve included); 0 for a device-only cache.
    pub host_pages: u32,
    /// Host pages never handed out.
    pub host_reserve: u32,
    /// Evicting a device node that has no host copy drops it (else it is skipped until its
    /// backup completes).
    pub drop_unbacked: bool,
}

/// A planned load-back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadBack {
    /// The load transfer these pages are in (submitted at the next `flush`); `None` when
    /// nothing needed loading.
    pub transfer: Option<u64>,
    /// Tokens restored or being restored by this and joined transfers.
    pub tokens: usize,
    /// Loads already in flight that cover part of the prefix.
    pub joined: Vec<u64>,
}

#[derive(Debug)]
struct Pending {
    id: u64,
    /// (host page, device page) per page; the SWA subset separately.
    pairs: Vec<(u32, u32)>,
    window_pairs: Vec<(u32, u32)>,
}

#[derive(Debug)]
struct InFlight {
    load: bool,
    events: Option<Arc<TransferEvents>>,
}

/// Cumulative counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheTotals {
    /// Matches.
    pub matches: u64,
    /// Tokens matched on the device.
    pub device_hit_tokens: u64,
    /// Tokens matched on host only.
    pub host_hit_tokens: u64,
    /// Tokens asked for in matches.
    pub match_tokens: u64,
    /// Pages backed up.
    pub pages_backed_up: u64,
    /// Backups not made for lack of host pages.
    pub backups_skipped: u64,
    /// Pages loaded back.
    pub pages_loaded: u64,
    /// Load-backs refused for lack of device pages (the request recomputes).
    pub loads_refused: u64,
    /// Transfers that failed.
    pub failed_transfers: u64,
    /// Device pages evicted.
    pub device_evicted: u64,
    /// Host pages evicted.
    pub host_evicted: u64,
}

/// What moves a cache's pages: its pools (at least one) and the copy engine.
struct Copies {
    pools: Vec<PoolPair>,
    engine: Arc<dyn CopyEngine>,
}

/// The hierarchical prefix cache.
pub struct HiCache {
    tree: RadixTree,
    device: PageAllocator,
    host: Option<PageAllocator>,
    /// The pools the tiers copy between and the engine that copies; none for a cache whose
    /// host pages are counts only (or that has none).
    copies: Option<Copies>,
    drop_unbacked: bool,
    pending_backup: Option<Pending>,
    pending_load: Option<Pending>,
    inflight: FxHashMap<u64, InFlight>,
    /// The transfer ids this cache issued (an id of another cache is unknown here).
    transfer_ids: crate::ids::IdSpace,
    outstanding: usize,
    totals: CacheTotals,
    /// Fault injection: this many coming device allocations fail.
    failing_allocs: u32,
    /// Host pages handed to callers by `alloc_host` and not yet inserted or freed.
    outstanding_host: usize,
    /// Host pages the tree let go (evicted, failed backup, dropped namespace), kept for the
    /// owner of per-layer objects at those pages when `log_freed_host` is on.
    freed_host: Vec<PageId>,
    log_freed_host: bool,
    /// The L3 tier, when enabled.
    pub(crate) storage: Option<StorageTier>,
    /// Nodes whose backup found no host page, retried at the next flush.
    skipped_backups: Vec<NodeId>,
}

mod l3;

impl HiCache {
    /// A cache over `pools` moved by `engine`. With no pools (and no engine) it is a
    /// device-only prefix cache.
    pub fn new(
        cfg: HiCacheConfig,
        pools: Vec<PoolPair>,
        engine: Option<Arc<dyn CopyEngine>>,
    ) -> Result<Self> {
        let tree = RadixTree::new(cfg.page_size)?;
        let device = PageAllocator::new(cfg.device_pages, cfg.device_reserve)?;
        let host = if cfg.host_pages > 0 {
            Some(PageAllocator::new(cfg.host_pages, cfg.host_reserve)?)
        } else {
            None
        };
        if pools.is_empty() && !cfg.drop_unbacked {
            return Err(Error::config(
                "drop_unbacked",
                "False",
                "True for a cache without pools: with no host copy to keep, no page could \
                 ever leave the device",
            ));
        }
        if !pools.is_empty() && host.is_none() {
            return Err(Error::config(
                "host_pages",
                0,
                "host pages when pools are given",
            ));
        }
        let names: Vec<[String; 2]> = (0..pools.len())
            .map(|i| [format!("pools[{i}][0]"), format!("pools[{i}][1]")])
            .collect();
        let mut all = Vec::new();
        for (p, [d, h]) in pools.iter().zip(&names) {
            all.extend(p.device.iter().map(|dev| (d.as_str(), dev)));
            all.push((h.as_str(), &p.host));
        }
        check_disjoint(&all)?;
        for (p, [d, h]) in pools.iter().zip(&names) {
            if let Some(dev) = &p.device {
                check_same_rows((d, dev), (h, &p.host))?;
            }
        }
        for (i, p) in pools.iter().enumerate() {
            let dev_ps = p
                .device
                .as_ref()
                .map_or(p.host.page_size(), |d| d.page_size());
            if dev_ps as usize != cfg.page_size || p.host.page_size() as usize != cfg.page_size {
                return Err(Error::config(
                    format!("pools[{i}].page_size"),
                    dev_ps,
                    format!("{}", cfg.page_size),
                ));
            }
            let dev_pages = p.device.as_ref().map_or(cfg.device_pages, |d| d.pages());
            if dev_pages != cfg.device_pages || p.host.pages() != cfg.host_pages {
                return Err(Error::config(
                    format!("pools[{i}].pages"),
                    format!("{}/{}", dev_pages, p.host.pages()),
                    format!(
                        "{}/{}: the group's device/host page counts",
                        cfg.device_pages, cfg.host_pages
                    ),
                ));
            }
        }
        let copies = match (pools.is_empty(), engine) {
            (true, _) => None,
            (false, Some(engine)) => Some(Copies { pools, engine }),
            (false, None) => {
                return Err(Error::config(
                    "engine",
                    "None",
                    "a copy engine when pools are given",
                ))
            }
        };
        Ok(HiCache {
            tree,
            device,
            host,
            copies,
            drop_unbacked: cfg.drop_unbacked,
            pending_backup: None,
            pending_load: None,
            inflight: FxHashMap::default(),
            transfer_ids: crate::ids::IdSpace::default(),
            outstanding: 0,
            totals: CacheTotals::default(),
            failing_allocs: 0,
            outstanding_host: 0,
            freed_host: Vec::new(),
            log_freed_host: false,
            storage: None,
            skipped_backups: Vec::new(),
        })
    }

    /// The tree, for inspection.
    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    /// Counters.
    pub fn totals(&self) -> CacheTotals {
        self.totals
    }

    /// Device pages free now.
    pub fn device_free(&self) -> usize {
        self.device.free_count()
    }

    /// Usable device pages.
    pub fn device_capacity(&self) -> usize {
        self.device.capacity()
    }

    /// (free, capacity) of the host tier.
    pub fn host_free_capacity(&self) -> (usize, usize) {
        self.host
            .as_ref()
            .map_or((0, 0), |h| (h.free_count(), h.capacity()))
    }

    /// Device pages eviction could free now.
    pub fn evictable_device_pages(&self) -> usize {
        self.tree.evictable_device_pages_now(self.drop_unbacked)
    }

    /// Transfers submitted and not yet settled.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Device pages handed to callers and not yet inserted or freed.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Fault injection for tests: the next `count` device allocations fail with
    /// `OutOfPages`, as a full device would.
    pub fn inject_alloc_failures(&mut self, count: u32) {
        self.failing_allocs = count;
    }

    /// `n` device pages for a request, evicting LRU device leaves if needed; all or nothing.
    pub fn alloc_device(&mut self, n: usize) -> Result<Vec<PageId>> {
        let mut pages = Vec::new();
        self.alloc_device_into(n, &mut pages)?;
        Ok(pages)
    }

    /// [`Self::alloc_device`], appending the pages to `out` (a match's own pages: no second
    /// array); on an error `out` is as it was. Returns the allocation's receipt: an insert or
    /// free that names it takes only these pages.
    pub fn alloc_device_into(&mut self, n: usize, out: &mut Vec<PageId>) -> Result<Holder> {
        let receipt = Holder::fresh();
        self.alloc_device_as(n, out, receipt)?;
        Ok(receipt)
    }

    /// [`Self::alloc_device_into`] for `holder` (the tree's own restores take
    /// [`Holder::OWNER`]).
    fn alloc_device_as(&mut self, n: usize, out: &mut Vec<PageId>, holder: Holder) -> Result<()> {
        if self.failing_allocs > 0 {
            self.failing_allocs -= 1;
            return Err(Error::OutOfPages {
                requested: n,
                free: 0,
                capacity: self.device.capacity(),
            });
        }
        if n > self.device.capacity() {
            // No eviction can help: refuse before evicting anything.
            return Err(Error::OutOfPages {
                requested: n,
                free: self.device.free_count(),
                capacity: self.device.capacity(),
            });
        }
        if self.device.free_count() < n {
            // Evicts LRU leaves (cascading to parents that become leaves), as SGLang's
            // scheduler does before it allocates; the allocation may still fail when locks
            // leave too little, and what was evicted stays evicted.
            let mut freed = self
                .tree
                .evict_device(n - self.device.free_count(), self.drop_unbacked);
            self.totals.device_evicted += freed.len() as u64;
            if freed.len() + self.device.free_count() >= n {
                // The evicted pages go straight to the caller: they stay allocated, so
                // neither their flags nor the free list are written twice (a page-1 prompt
                // moves thousands). Only what the caller does not need is freed.
                let k = freed.len().min(n);
                let spare = freed.split_off(k);
                self.device.free(&spare).expect("tree pages are allocated");
                self.device.hand_over(&freed, holder);
                out.extend_from_slice(&freed);
                self.device
                    .alloc_as(n - k, out, holder)
                    .expect("checked: enough pages free");
                self.outstanding += n;
                return Ok(());
            }
            self.device.free(&freed).expect("tree pages are allocated");
        }
        self.device.alloc_as(n, out, holder)?;
        self.outstanding += n;
        Ok(())
    }

    /// Returns pages from `alloc_device` that were not inserted (any allocation's).
    pub fn free_device(&mut self, pages: &[PageId]) -> Result<()> {
        self.free_device_held(pages, Expect::AnyCaller)
    }

    /// [`Self::free_device`] of pages `expect` accepts (an allocation's, by its receipt).
    pub fn free_device_held(&mut self, pages: &[PageId], expect: Expect) -> Result<()> {
        if pages.len() > self.outstanding {
            return Err(Error::config(
                "pages",
                pages.len(),
                format!(
                    "at most the {} pages handed out and not inserted",
                    self.outstanding
                ),
            ));
        }
        self.device.free_held(pages, expect, "pages")?;
        self.outstanding -= pages.len();
        Ok(())
    }

    /// Keeps a log of the host pages the tree lets go, for [`Self::take_freed_host`].
    pub fn set_host_log(&mut self, on: bool) {
        self.log_freed_host = on;
    }

    fn log_freed(&mut self, pages: Vec<PageId>) {
        if self.log_freed_host {
            self.freed_host.extend(pages);
        }
    }

    /// Host pages the tree let go since the last call (with the log on): whoever keeps
    /// objects at those pages drops them before the pages are handed out again.
    pub fn take_freed_host(&mut self) -> Vec<PageId> {
        std::mem::take(&mut self.freed_host)
    }

    /// `n` host pages for a request that writes its pages through itself (the joined mode),
    /// evicting LRU host-only leaves if needed; all or nothing.
    pub fn alloc_host(&mut self, n: usize) -> Result<Vec<PageId>> {
        let Some(h) = self.host.as_ref() else {
            return Err(Error::config("host_pages", 0, "a HiCache with a host tier"));
        };
        if n > h.capacity() {
            return Err(Error::OutOfPages {
                requested: n,
                free: h.free_count(),
                capacity: h.capacity(),
            });
        }
        let short = n.saturating_sub(h.free_count());
        if short > 0 {
            let freed = self.evict_host_tree(short)?;
            self.release_host(freed);
        }
        let h = self.host.as_mut().expect("checked");
        let receipt = Holder::fresh();
        let mut pages = Vec::with_capacity(n);
        h.alloc_as(n, &mut pages, receipt)?;
        self.outstanding_host += n;
        Ok(pages)
    }

    /// Returns host pages from `alloc_host` that were not inserted.
    pub fn free_host(&mut self, pages: &[PageId]) -> Result<()> {
        if pages.len() > self.outstanding_host {
            return Err(Error::config(
                "host_pages",
                pages.len(),
                format!(
                    "at most the {} host pages handed out and not inserted",
                    self.outstanding_host
                ),
            ));
        }
        self.host
            .as_mut()
            .expect("outstanding pages imply a host tier")
            .free_held(pages, Expect::AnyCaller, "host_pages")?;
        self.outstanding_host -= pages.len();
        Ok(())
    }

    /// Host pages handed out by `alloc_host` and not yet inserted or freed.
    pub fn outstanding_host(&self) -> usize {
        self.outstanding_host
    }

    /// Inserts a request's pages whose host copies it wrote itself: device pages (from
    /// `alloc_device` or the matched path) and host pages (from `alloc_host` or the matched
    /// path), one of each per whole page. Nothing is queued for backup. Returns the insert
    /// and the host pages the tree did not take; the device duplicates are freed here, the
    /// spare host pages are the caller's to free (after dropping what it keeps at them).
    pub fn insert_with_host(
        &mut self,
        ns: u32,
        tokens: &[u32],
        pages: &[PageId],
        host_pages: &[PageId],
    ) -> Result<(InsertResult, Vec<PageId>)> {
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| Error::config("host_pages", 0, "a HiCache with a host tier"))?;
        if let Some(&p) = host_pages.iter().find(|&&p| !host.is_allocated(p)) {
            return Err(host.not_held("host_pages", p, Expect::AnyCaller));
        }
        let device = &mut self.device;
        let (r, spare, taken) =
            self.tree
                .insert_with_host(ns, tokens, pages, host_pages, |path, leaf| {
                    device.claim(&[path, leaf], Expect::AnyCaller, "device_pages")
                })?;
        self.outstanding = self.outstanding.saturating_sub(pages.len() - r.own);
        self.outstanding_host -= taken.len();
        self.host
            .as_mut()
            .expect("checked")
            .hand_over(&taken, Holder::OWNER);
        self.device
            .free(&r.duplicates)
            .expect("duplicates were allocated");
        self.write_through_path(r.last_node)?;
        Ok((r, spare))
    }

    /// Evicts at least `n` device pages if it can; returns how many.
    pub fn evict_device(&mut self, n: usize) -> usize {
        let freed = self.tree.evict_device(n, self.drop_unbacked);
        self.device.free(&freed).expect("tree pages are allocated");
        self.totals.device_evicted += freed.len() as u64;
        freed.len()
    }

    /// Evicts at least `n` host pages if it can; returns how many. Under an L3 write-back
    /// tier, victims the store lacks are written first and leave on a later call.
    pub fn evict_host(&mut self, n: usize) -> Result<usize> {
        let freed = self.evict_host_tree(n)?;
        let n = freed.len();
        self.release_host(freed);
        Ok(n)
    }

    /// Gives host pages the tree let go back to the allocator.
    pub(crate) fn release_host(&mut self, freed: Vec<PageId>) {
        if let Some(h) = self.host.as_mut() {
            h.free(&freed).expect("tree pages are allocated");
        }
        self.totals.host_evicted += freed.len() as u64;
        self.log_freed(freed);
    }

    /// The longest cached prefix of `tokens`.
    pub fn match_prefix<T: super::tree::TokenId>(&mut self, ns: u32, tokens: &[T]) -> MatchResult {
        let m = self.tree.match_prefix(ns, tokens);
        self.totals.matches += 1;
        self.totals.match_tokens += tokens.len() as u64;
        self.totals.device_hit_tokens += m.device_len as u64;
        self.totals.host_hit_tokens += m.host_len as u64;
        m
    }

    /// Inserts a request's tokens with its device pages (from `alloc_device`); frees the
    /// duplicates and queues the write-through backup.
    pub fn insert<T: super::tree::TokenId>(
        &mut self,
        ns: u32,
        tokens: &[T],
        pages: &[PageId],
    ) -> Result<InsertResult> {
        self.insert_held(ns, tokens, pages, Expect::AnyCaller, None, false)
    }

    /// The device allocator's stamp: read after an allocation, it lets
    /// [`Self::insert_held`] take that allocation's pages unread while it holds.
    pub fn device_stamp(&self) -> Stamp {
        self.device.stamp()
    }

    /// [`Self::insert`] where every given page the tree does not already hold at its position
    /// must be held as `expect` says (an allocation's receipt): a page the tree holds
    /// elsewhere, a free page or another allocation's is [`Error::NotHeld`], before anything
    /// changes. With `fresh = (stamp, first)`, `pages[first..]` are the pages the allocation
    /// named by `expect` was given, and `stamp` was read after it: while the stamp holds, those
    /// of them that make the new leaf are taken unread. With `lock`, the inserted path comes
    /// back locked (as `lock(last_node)`; not locked on an error).
    pub fn insert_held<T: super::tree::TokenId>(
        &mut self,
        ns: u32,
        tokens: &[T],
        pages: &[PageId],
        expect: Expect,
        fresh: Option<(Stamp, usize)>,
        lock: bool,
    ) -> Result<InsertResult> {
        let device = &mut self.device;
        let n = pages.len();
        let r = self
            .tree
            .insert_claimed(ns, tokens, pages, lock, |path, leaf| {
                match (expect, fresh) {
                    (Expect::Holder(r), Some((stamp, first))) if n - leaf.len() >= first => {
                        device.claim_fresh(path, leaf, r, stamp, "device_pages")
                    }
                    _ => device.claim(&[path, leaf], expect, "device_pages"),
                }
            })?;
        self.outstanding = self.outstanding.saturating_sub(pages.len() - r.own);
        self.device
            .free(&r.duplicates)
            .expect("duplicates were allocated");
        if self.copies.is_some() {
            for &node in &r.needs_backup {
                if let Err(e) = self.queue_backup(node) {
                    if lock {
                        self.tree.unlock(r.last_node)?;
                    }
                    return Err(e);
                }
            }
        }
        Ok(r)
    }

    fn queue_backup(&mut self, node: NodeId) -> Result<()> {
        let n = self.tree.node_pages(node)?;
        let host = self.host.as_mut().expect("pools imply a host tier");
        if host.free_count() < n {
            let short = n - host.free_count();
            let freed = self.evict_host_tree(short)?;
            self.release_host(freed);
        }
        let host = self.host.as_mut().expect("checked");
        let Ok(hpages) = host.alloc(n) else {
            // Retried at the next flush: a node left without a host copy could never leave
            // the device (drop_unbacked off), and under L3 write-back host pages free up only
            // once their writes land.
            self.totals.backups_skipped += 1;
            self.skipped_backups.push(node);
            return Ok(());
        };
        let id = match &self.pending_backup {
            Some(p) => p.id,
            None => {
                let id = self.transfer_ids.issue();
                self.pending_backup = Some(Pending {
                    id,
                    pairs: Vec::new(),
                    window_pairs: Vec::new(),
                });
                id
            }
        };
        let dev = self.tree.device_pages_of(node)?.to_vec();
        let p = self.pending_backup.as_mut().expect("just set");
        p.pairs
            .extend(dev.iter().zip(&hpages).map(|(d, h)| (d.raw(), h.raw())));
        self.tree.begin_backup(node, hpages, id)?;
        self.totals.pages_backed_up += n as u64;
        Ok(())
    }

    /// Queues a restore of the host part of the prefix ending at `node` into fresh device
    /// pages of every pool. All or nothing: `Ok(None)` when device pages cannot be found even
    /// after eviction (the request recomputes instead).
    pub fn load_back(&mut self, node: NodeId) -> Result<Option<LoadBack>> {
        let Some(copies) = &self.copies else {
            return Err(Error::config(
                "pools",
                "none",
                "a HiCache with host pools (load_back moves pages)",
            ));
        };
        let window = copies
            .pools
            .iter()
            .filter_map(|p| match p.hit {
                HitPolicy::Window(w) => Some(w as usize),
                HitPolicy::AllPages => None,
            })
            .max();
        let (todo, joined) = self.tree.restorable(node)?;
        let need: usize = todo
            .iter()
            .map(|&n| self.tree.node_pages(n))
            .sum::<Result<usize>>()?;
        let joined_tokens: usize = joined
            .iter()
            .map(|&(n, _)| self.tree.node_pages(n))
            .sum::<Result<usize>>()?
            * self.tree.page_size();
        // Keep the prefix from eviction while we make room for it.
        self.tree.lock(node)?;
        let mut fresh = Vec::with_capacity(need);
        let got = self
            .alloc_device_as(need, &mut fresh, Holder::OWNER)
            .map(|()| fresh);
        self.tree.unlock(node)?;
        let pages = match got {
            Ok(p) => p,
            Err(Error::OutOfPages { .. }) => {
                self.totals.loads_refused += 1;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.outstanding -= pages.len(); // owned by the tree from here on
        let mut joined_ids: Vec<u64> = joined.iter().map(|&(_, t)| t).collect();
        joined_ids.dedup();
        if todo.is_empty() {
            return Ok(Some(LoadBack {
                transfer: None,
                tokens: joined_tokens,
                joined: joined_ids,
            }));
        }
        let id = match &self.pending_load {
            Some(p) => p.id,
            None => {
                let id = self.transfer_ids.issue();
                self.pending_load = Some(Pending {
                    id,
                    pairs: Vec::new(),
                    window_pairs: Vec::new(),
                });
                id
            }
        };
        let ps = self.tree.page_size();
        let end = self.tree.depth_tokens(node)?;
        let mut at = 0;
        let mut tokens = joined_tokens;
        for &n in &todo {
            let k = self.tree.node_pages(n)?;
            let start = self.tree.depth_tokens(n)? - k * ps;
            let host = self.tree.host_pages_of(n)?.to_vec();
            let dev = pages[at..at + k].to_vec();
            let p = self.pending_load.as_mut().expect("set above");
            for (i, (h, d)) in host.iter().zip(&dev).enumerate() {
                p.pairs.push((h.raw(), d.raw()));
                let page_end = start + (i + 1) * ps;
                if window.is_some_and(|w| page_end + w > end) {
                    p.window_pairs.push((h.raw(), d.raw()));
                }
            }
            self.tree.begin_load(n, dev, id)?;
            at += k;
            tokens += k * ps;
        }
        self.totals.pages_loaded += need as u64;
        Ok(Some(LoadBack {
            transfer: Some(id),
            tokens,
            joined: joined_ids,
        }))
    }

    /// The copies of `p` (loads or backups) for every pool that has them, with the engine that
    /// makes them; none when no pool has a copy to make.
    fn group(
        &self,
        p: &Pending,
        load: bool,
    ) -> Result<Option<(PageTransferGroup, Arc<dyn CopyEngine>)>> {
        let Some(copies) = &self.copies else {
            return Ok(None);
        };
        let mut members = Vec::new();
        for pool in &copies.pools {
            let Some(device) = pool.device.as_ref() else {
                continue; // host only: loaded per layer by the step scheduler
            };
            let pairs = match pool.hit {
                HitPolicy::AllPages => &p.pairs,
                HitPolicy::Window(_) if load => &p.window_pairs,
                HitPolicy::Window(_) => &p.pairs,
            };
            if pairs.is_empty() {
                continue;
            }
            let (src, dst): (Vec<u64>, Vec<u64>) = if load {
                pairs
                    .iter()
                    .map(|&(h, d)| (u64::from(h), u64::from(d)))
                    .unzip()
            } else {
                pairs
                    .iter()
                    .map(|&(d, h)| (u64::from(d), u64::from(h)))
                    .unzip()
            };
            let map = PageTransferMap::new(Granularity::Page, &src, &dst)?;
            let (s, d) = if load {
                (&pool.host, device)
            } else {
                (device, &pool.host)
            };
            members.push(PreparedPageTransfer::new(
                s.clone(),
                d.clone(),
                map,
                if load {
                    Direction::Load
                } else {
                    Direction::Backup
                },
            )?);
        }
        if members.is_empty() {
            return Ok(None);
        }
        Ok(Some((
            PageTransferGroup::new(members)?,
            copies.engine.clone(),
        )))
    }

    /// Submits the step's queued backups and loads: at most one transfer each. Returns the
    /// ids submitted.
    pub fn flush(&mut self) -> Result<Vec<u64>> {
        self.retry_skipped_backups()?;
        let mut ids = Vec::new();
        for load in [true, false] {
            let pending = if load {
                self.pending_load.take()
            } else {
                self.pending_backup.take()
            };
            let Some(p) = pending else { continue };
            let submitted = self.group(&p, load).and_then(|g| match g {
                Some((g, engine)) => engine.submit(Arc::new(g), None).map(Some),
                None => Ok(None),
            });
            match submitted {
                Ok(events) => {
                    self.inflight.insert(p.id, InFlight { load, events });
                    ids.push(p.id);
                }
                Err(e) => {
                    // Nothing was submitted, so nothing writes the pages: undo at once.
                    self.settle(p.id, load, false)?;
                    return Err(e);
                }
            }
        }
        Ok(ids)
    }

    /// Queues again the backups skipped for want of host pages, for nodes still on the device
    /// without a host copy (the others went away or got one meanwhile).
    fn retry_skipped_backups(&mut self) -> Result<()> {
        if self.skipped_backups.is_empty() || self.copies.is_none() {
            return Ok(());
        }
        let nodes = std::mem::take(&mut self.skipped_backups);
        for node in nodes {
            let still = self.tree.host_copy(node).ok() == Some(super::tree::HostCopy::None)
                && self.tree.device_pages_of(node).is_ok_and(|d| !d.is_empty());
            if still {
                self.queue_backup(node)?;
            }
        }
        Ok(())
    }

    /// The per-layer events of submitted transfer `id`.
    pub fn events(&self, id: u64) -> Option<Arc<TransferEvents>> {
        self.inflight.get(&id).and_then(|f| f.events.clone())
    }

    /// What a wait for transfer `id` waits on: its events while it is in flight, `None` once
    /// it settled. A transfer queued and not yet flushed is [`Error::TransferState`] (waiting
    /// would end before its copy began); an id this cache never issued is
    /// [`Error::UnknownTransfer`].
    pub fn wait_target(&self, id: u64) -> Result<Option<Arc<TransferEvents>>> {
        let queued = [&self.pending_load, &self.pending_backup]
            .iter()
            .any(|p| p.as_ref().is_some_and(|p| p.id == id));
        if queued {
            return Err(Error::TransferState {
                op: "wait for",
                id,
                state: "queued: it is submitted at the next flush".into(),
            });
        }
        if let Some(f) = self.inflight.get(&id) {
            return Ok(f.events.clone());
        }
        if self.transfer_ids.issued(id) {
            return Ok(None);
        }
        Err(Error::UnknownTransfer { id })
    }

    /// Settles every finished transfer; returns how many.
    pub fn poll(&mut self) -> Result<usize> {
        let done: Vec<(u64, bool, bool)> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.events.as_ref().is_none_or(|e| e.is_finished()))
            .map(|(&id, f)| {
                let ok = f.events.as_ref().is_none_or(|e| {
                    e.layers()
                        .iter()
                        .all(|&l| e.status(l).map(|s| s == LayerStatus::Done).unwrap_or(false))
                });
                (id, f.load, ok)
            })
            .collect();
        for &(id, load, ok) in &done {
            self.settle(id, load, ok)?;
        }
        Ok(done.len())
    }

    /// Settles transfer `id` as finished; its copies can no longer write, so failed pages are
    /// freed now.
    fn settle(&mut self, id: u64, load: bool, ok: bool) -> Result<()> {
        self.inflight.remove(&id);
        if !ok {
            self.totals.failed_transfers += 1;
        }
        for node in self.tree.nodes_of_transfer(id) {
            if load {
                let freed = self.tree.finish_load(node, id, ok)?;
                self.device
                    .free(&freed)
                    .expect("loading pages are allocated");
            } else {
                let freed = self.tree.finish_backup(node, id, ok)?;
                if let Some(h) = self.host.as_mut() {
                    h.free(&freed).expect("writing pages are allocated");
                }
                self.log_freed(freed);
                if ok {
                    self.write_through_path(node)?;
                }
            }
        }
        Ok(())
    }

    /// Blocks until every submitted transfer has finished, then settles them all.
    pub fn drain(&mut self) -> Result<()> {
        for f in self.inflight.values() {
            if let Some(e) = &f.events {
                let _ = e.wait_all(None);
            }
        }
        self.poll().map(|_| ())
    }

    /// Removes namespace `ns` (e.g. a retired model version) and frees its pages on both
    /// tiers. Refused while a node of it is locked or in flight.
    pub fn drop_namespace(&mut self, ns: u32) -> Result<usize> {
        let (dev, host) = self.tree.drop_namespace(ns)?;
        self.device.free(&dev).expect("tree pages are allocated");
        if let Some(h) = self.host.as_mut() {
            h.free(&host).expect("tree pages are allocated");
        }
        let n = dev.len() + host.len();
        self.log_freed(host);
        Ok(n)
    }

    /// Locks the path to `node`.
    pub fn lock(&mut self, node: NodeId) -> Result<()> {
        self.tree.lock(node)
    }

    /// Unlocks the path to `node`.
    pub fn unlock(&mut self, node: NodeId) -> Result<()> {
        self.tree.unlock(node)
    }

    /// Checks the tree and page conservation on both tiers.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.tree.validate()?;
        self.device.validate()?;
        if self.device.used_count() != self.tree.device_pages() + self.outstanding {
            return Err(format!(
                "device: used {} != tree {} + outstanding {}",
                self.device.used_count(),
                self.tree.device_pages(),
                self.outstanding
            ));
        }
        if let Some(h) = &self.host {
            h.validate()?;
            let held = self.storage_held_host();
            if h.used_count() != self.tree.host_pages() + self.outstanding_host + held {
                return Err(format!(
                    "host: used {} != tree {} + outstanding {} + prefetching {held}",
                    h.used_count(),
                    self.tree.host_pages(),
                    self.outstanding_host
                ));
            }
        }
        Ok(())
    }
}
