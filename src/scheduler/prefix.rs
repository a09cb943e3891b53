//! The joined mode's prefix tier: the radix prefix cache ([`HiCache`]) as the one owner of
//! host pages, under the step scheduler's per-layer residency.
//!
//! # What it owns
//! The prefix cache (tree, host page allocator, whole-page device allocator for the sidecars:
//! Indexer-K, SWA, draft), the sidecar bindings, a generation per host page, the Indexer-K
//! restores running requests wait on, and the requests that ended but whose pages are not yet
//! settled (`Finishing`).
//!
//! # Addressing
//! A host page `h` holds every layer of one token page in every pool of the group. The main-KV
//! object of layer `l` of that page is the directory key `(HOST_NS + h, gen[h], page h, layer
//! l)`, and its home on host is layer `l` of page `h` in the group's KV host pool (numbered by
//! the pool's layer-flattened view, for either host layout). So one host page is both a prefix
//! tree page and the host copy the directory loads selected blocks from: nothing is held
//! twice. `gen[h]` changes each time `h` is let go, so a reused page names new objects.
//!
//! # Invariants
//! - the cache's own (tree, page conservation on both tiers, locks);
//! - a host page is handed out again only after every object at it is removed from the
//!   directory (the prefix cache logs what it lets go; `drop_freed` drops it first);
//! - a request's pages enter the tree only once their main KV is host-Ready in the directory
//!   and their Indexer-K write-through landed; pages it frees wait until no transfer touches
//!   objects at them (`Directory::lingering`).

use crate::config::HitPolicy;
use crate::directory::{Directory, LayerGroup, Namespace, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, PageId, RequestId};
use crate::radix::{HiCache, NodeId, PoolPair};
use crate::transfer::{
    CopyEngine, Direction, Granularity, LayerPageOrder, PageTransferGroup, PageTransferMap,
    PreparedPageTransfer, TransferEvents,
};
use std::sync::Arc;

/// Namespaces of objects at host pages start here (request namespaces stay below).
pub const HOST_NS: u64 = 1 << 48;

/// What admitting a request found in the prefix cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// Whole pages matched (device part first, then the part restored from host).
    pub matched_pages: u32,
    /// Of those, pages whose Indexer-K was already on the device.
    pub device_pages: u32,
    /// Pages whose Indexer-K is being restored from host (the request waits per layer).
    pub restored_pages: u32,
    /// Main-KV objects of those pages a full restore started loading (0: the restore policy
    /// chose Indexer-K only; `restore_policy.rs`).
    pub full_restore_objects: u64,
}

/// Cumulative prefix-tier counters: the bytes a prefix hit moved, against a full restore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixTotals {
    /// Requests admitted.
    pub requests: u64,
    /// Requests that matched at least one page.
    pub hits: u64,
    /// Tokens matched, device part.
    pub device_hit_tokens: u64,
    /// Tokens matched, restored from host.
    pub host_hit_tokens: u64,
    /// Indexer-K (and other sidecar: draft every page, SWA its window) bytes restored for
    /// matched host pages.
    pub sidecar_bytes_restored: u64,
    /// Main-KV bytes loaded for matched pages restored from host while their requests ran
    /// (selected blocks; every load, re-loads after eviction included).
    pub prefix_kv_bytes_loaded: u64,
    /// Of those, the first load of each (page, layer) in its request: the bytes of those
    /// pages the request needed at all.
    pub prefix_kv_bytes_first: u64,
    /// Main-KV bytes loaded for matched pages whose Indexer-K was on the device (a
    /// whole-prefix cache would have kept their KV on the device too).
    pub device_part_kv_bytes_loaded: u64,
    /// What restoring every matched host page in every pool would have moved (a
    /// whole-prefix restore, as SGLang's HiCache does: SWA its window only).
    pub full_restore_bytes: u64,
    /// Load-backs refused for lack of device pages (the request used the device part only).
    pub restores_refused: u64,
    /// Restores that failed (their requests were failed).
    pub restores_failed: u64,
    /// Pages inserted into the tree by finished requests.
    pub pages_inserted: u64,
    /// Sidecar write-throughs that failed (retried at the next step).
    pub writes_failed: u64,
    /// Restore decisions (`restore_policy.rs`) for Indexer-K only.
    pub restores_indexer_only: u64,
    /// Restore decisions for a full restore.
    pub restores_full: u64,
    /// Restore decisions for the predicted pages.
    pub restores_predicted: u64,
    /// Bulk restores (full or predicted) cut short for want of device slots (the rest loads
    /// on demand).
    pub restores_partial: u64,
    /// Of the requests that ended with their pages inserted and a decision the model made
    /// with a sample: objects it predicted they would load.
    pub restore_objects_predicted: u64,
    /// Objects those requests loaded (each once).
    pub restore_objects_loaded: u64,
    /// The sum of |predicted - loaded| over those requests.
    pub restore_model_abs_error: u64,
    /// Over every decision checked (a request that ended with its pages inserted): what each
    /// choice would have loaded, in objects (a full restore: exact; the others: the model's
    /// prediction, where it had one).
    pub restore_objects_if_indexer: u64,
    /// (See `restore_objects_if_indexer`.)
    pub restore_objects_if_full: u64,
    /// (See `restore_objects_if_indexer`.)
    pub restore_objects_if_predicted: u64,
}

/// A request that ended and whose pages wait to settle before they are inserted or freed.
#[derive(Debug)]
pub(crate) struct Finishing {
    pub id: RequestId,
    /// Tokens of its whole pages (empty when not inserted).
    pub tokens: Vec<u32>,
    /// Per page: (host page, generation).
    pub homes: Vec<(u32, u32)>,
    /// Per page: Indexer-K device page.
    pub idx_pages: Vec<u32>,
    /// Pages that came from the match (the tree's own).
    pub matched: u32,
    /// Whole pages (inserted when `insert`).
    pub full: u32,
    pub node: Option<NodeId>,
    pub insert: bool,
    /// The sidecar write-through of its own whole pages, once submitted.
    pub write: Option<Arc<TransferEvents>>,
    pub written: bool,
}

/// Pages let go by a request, freed once no transfer touches objects at them.
#[derive(Debug)]
struct Limbo {
    host: u32,
    ns: Namespace,
}

/// What a copy's fixed cost is worth in the restore policy's cost model, in bytes, where the
/// engine is not known: the cpu engine's (`restore_policy::default_copy_overhead`).
pub const DEFAULT_COPY_OVERHEAD: u64 = 16 << 10;

/// The prefix tier of a joined step scheduler.
pub struct PrefixTier {
    pub(crate) cache: HiCache,
    sidecars: Vec<PoolPair>,
    order: LayerPageOrder,
    gens: Vec<u32>,
    layers: u16,
    page_size: u32,
    kv_page_bytes: u64,
    pub(crate) finishing: Vec<Finishing>,
    limbo: Vec<Limbo>,
    pub(crate) totals: PrefixTotals,
    /// The device resolver's link, once enabled (`device_step.rs`).
    pub(crate) device: Option<super::device_step::DeviceLink>,
    /// What a prefix hit restores of the main KV (`restore_policy.rs`).
    pub(crate) policy: super::restore_policy::RestorePolicy,
    /// Restores armed to fail (fault injection).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) restore_faults: u32,
}

impl std::fmt::Debug for PrefixTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTier")
            .field("host_pages", &self.gens.len())
            .field("finishing", &self.finishing.len())
            .finish()
    }
}

impl PrefixTier {
    /// A tier over `cache` (whose pools are the host-only KV pool first, then `sidecars`),
    /// with host pages numbered in the KV pool's flattened view by `order`.
    pub(crate) fn new(
        mut cache: HiCache,
        sidecars: Vec<PoolPair>,
        order: LayerPageOrder,
        host_pages: u32,
        layers: u16,
        page_size: u32,
        kv_page_bytes: u64,
    ) -> Self {
        cache.set_host_log(true);
        PrefixTier {
            cache,
            sidecars,
            order,
            gens: vec![0; host_pages as usize],
            layers,
            page_size,
            kv_page_bytes,
            finishing: Vec::new(),
            limbo: Vec::new(),
            totals: PrefixTotals::default(),
            device: None,
            policy: super::restore_policy::RestorePolicy::new(
                super::restore_policy::RestoreMode::Auto,
                DEFAULT_COPY_OVERHEAD,
            ),
            #[cfg(any(test, feature = "testing"))]
            restore_faults: 0,
        }
    }

    /// The directory namespace of objects at host page `h` now.
    #[inline]
    pub fn namespace(&self, h: u32) -> Namespace {
        Namespace {
            id: HOST_NS + u64::from(h),
            version: self.gens[h as usize],
        }
    }

    /// How the KV host pool's layer-flattened view numbers page `h` of a layer.
    pub(crate) fn order(&self) -> LayerPageOrder {
        self.order
    }

    /// The key of the live object of host page `h` at `layer` (its current generation).
    pub(crate) fn key_at(&self, h: u32, layer: u16) -> ObjectKey {
        Self::key(h, self.gens[h as usize], layer)
    }

    /// The key of layer `layer` of host page `h` at generation `gen`.
    #[inline]
    pub fn key(h: u32, gen: u32, layer: u16) -> ObjectKey {
        ObjectKey::new(HOST_NS + u64::from(h), gen, h, LayerGroup::Layer(layer))
    }

    /// Where layer `layer` of host page `h` lives in the flattened KV host pool.
    #[inline]
    pub fn home(&self, h: u32, layer: u16) -> HostSlotId {
        HostSlotId::new(self.order.flat(h, layer))
    }

    /// (host page, generation) of pages.
    pub fn homes_of(&self, pages: &[PageId]) -> Vec<(u32, u32)> {
        pages
            .iter()
            .map(|p| (p.raw(), self.gens[p.raw() as usize]))
            .collect()
    }

    /// Keys and homes of every layer of `homes`, layer-major.
    pub fn keys_of(&self, homes: &[(u32, u32)]) -> (Vec<ObjectKey>, Vec<HostSlotId>) {
        let n = homes.len() * self.layers as usize;
        let (mut keys, mut at) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for l in 0..self.layers {
            for &(h, g) in homes {
                keys.push(Self::key(h, g, l));
                at.push(self.home(h, l));
            }
        }
        (keys, at)
    }

    /// Drops the objects at host pages the cache let go, before those pages are reused.
    pub fn drop_freed(&mut self, dir: &Directory) -> Result<()> {
        for p in self.cache.take_freed_host() {
            let ns = self.namespace(p.raw());
            dir.drop_namespace(ns)?;
            self.bump(p.raw());
        }
        Ok(())
    }

    /// A new generation for host page `h`: the objects at it are another page's from now on
    /// (the device resolver's mirror entries of `h` are brought up to date at its next grant).
    fn bump(&mut self, h: u32) {
        self.gens[h as usize] += 1;
        if let Some(link) = self.device.as_mut() {
            link.bumped.push(h);
        }
    }

    /// Host pages for `n` new token pages, with the objects at reused pages dropped first.
    /// Host eviction takes only pages whose Indexer-K left the device: when that is too few,
    /// the Indexer-K device pages of unlocked prefixes go first (a later hit restores them
    /// from host).
    pub fn alloc_host(&mut self, dir: &Directory, n: usize) -> Result<Vec<PageId>> {
        let mut pages = self.cache.alloc_host(n);
        let mut last_free = None;
        // Each round lets go the device part of as many prefix pages as are missing; it stops
        // when the host could never hold `n`, or a round made no host page free (under L3
        // write-back, eviction may only queue writes).
        while let Err(Error::OutOfPages { free, capacity, .. }) = pages {
            if n > capacity || last_free.is_some_and(|f| free <= f) {
                break;
            }
            last_free = Some(free);
            if self.cache.evict_device(n - free) == 0 {
                break;
            }
            self.drop_freed(dir)?;
            pages = self.cache.alloc_host(n);
        }
        self.drop_freed(dir)?;
        pages
    }

    /// Bytes of main KV of one page, every layer.
    pub fn kv_page_bytes(&self) -> u64 {
        self.kv_page_bytes * u64::from(self.layers)
    }

    /// Sidecar bytes a restore of pages `pages` of a `matched`-page prefix moves: every page
    /// of an ALL_PAGES pool (Indexer-K, draft), the pages of a WINDOW(w) pool (SWA) that hold
    /// one of the prefix's last `w` tokens.
    pub fn sidecar_restore_bytes(&self, pages: std::ops::Range<u32>, matched: u32) -> u64 {
        let ps = u64::from(self.page_size);
        let end = u64::from(matched) * ps;
        self.sidecars
            .iter()
            .map(|p| {
                let bytes = p.host.page_bytes() * p.host.plane_count() as u64;
                let n = match p.hit {
                    HitPolicy::AllPages => pages.len() as u64,
                    HitPolicy::Window(w) => pages
                        .clone()
                        .filter(|&i| (u64::from(i) + 1) * ps + u64::from(w) > end)
                        .count() as u64,
                };
                n * bytes
            })
            .sum()
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Waits until layer `layer` of every restore in `restores` is readable (or, with a
    /// stream, makes the stream wait). A failed restore is an error naming it.
    pub fn wait_restore(
        engine: &Arc<dyn CopyEngine>,
        restores: &[Arc<TransferEvents>],
        layer: u16,
        stream: Option<u64>,
    ) -> Result<()> {
        for ev in restores {
            let l = usize::from(layer);
            match stream {
                Some(s) if !ev.is_finished() => {
                    let i = ev.layers().iter().position(|&x| x == l).unwrap_or(l);
                    engine.stream_wait(ev, i, s)?
                }
                _ => ev.wait_layer(l, None)?,
            }
        }
        Ok(())
    }

    /// Submits the sidecar write-through (device page -> host page, every layer) of
    /// `pairs`; `None` when there is nothing to write.
    pub fn write_through(
        &self,
        engine: &Arc<dyn CopyEngine>,
        pairs: &[(u32, u32)],
    ) -> Result<Option<Arc<TransferEvents>>> {
        if pairs.is_empty() || self.sidecars.is_empty() {
            return Ok(None);
        }
        let (src, dst): (Vec<u64>, Vec<u64>) = pairs
            .iter()
            .map(|&(d, h)| (u64::from(d), u64::from(h)))
            .unzip();
        let mut members = Vec::new();
        for p in &self.sidecars {
            let device = p.device.as_ref().expect("sidecars live on the device");
            let map = PageTransferMap::new(Granularity::Page, &src, &dst)?;
            members.push(PreparedPageTransfer::new(
                device.clone(),
                p.host.clone(),
                map,
                Direction::Backup,
            )?);
        }
        engine
            .submit(Arc::new(PageTransferGroup::new(members)?), None)
            .map(Some)
    }

    /// Lets go of a request's own page: its objects are dropped now, the page is freed once
    /// none lingers.
    pub fn release_page(&mut self, dir: &Directory, h: u32, gen: u32) -> Result<()> {
        let ns = Namespace {
            id: HOST_NS + u64::from(h),
            version: gen,
        };
        dir.drop_namespace(ns)?;
        self.bump(h);
        self.limbo.push(Limbo { host: h, ns });
        Ok(())
    }

    /// Frees the pages in limbo that nothing touches any more.
    pub fn free_settled(&mut self, dir: &Directory) -> Result<()> {
        let mut free = Vec::new();
        self.limbo.retain(|l| {
            let done = dir.lingering(l.ns) == 0;
            if done {
                free.push(PageId::new(l.host));
            }
            !done
        });
        if !free.is_empty() {
            self.cache.free_host(&free)?;
        }
        Ok(())
    }

    /// The prefix cache (for stats and checks).
    pub fn cache(&self) -> &HiCache {
        &self.cache
    }

    /// Pages in limbo.
    pub fn limbo_len(&self) -> usize {
        self.limbo.len()
    }
}
