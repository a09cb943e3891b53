//! The joined mode's request lifecycle on [`StepScheduler`]: admission by prefix match, the
//! Indexer-K restore a prefill waits on layer by layer, and the end of a request (its pages
//! written through and inserted into the prefix tree, or let go).
//!
//! # One request, joined
//! `admit(tokens)`: the prefix cache matches the prompt's whole pages (at least one token is
//! left to prefill) and locks the match; the host part's sidecars (Indexer-K: every page; SWA:
//! its window) are restored into fresh device pages in one transfer with an event per layer;
//! the main KV of every matched page stays on host and is registered in the directory as
//! host-Ready objects at the pages' homes -> `extend` (the suffix, chunk by chunk: new host
//! pages, Indexer-K device pages and per-layer device slots) -> per layer `wait_prefix`, then
//! the usual plans (loading only the matched blocks the selections pick) -> decode steps ->
//! `end_request(tokens)`: once its main KV is host-Ready and its own Indexer-K pages are
//! written through, its whole pages are inserted into the tree (host copies taken as they
//! are, nothing copied again), the partial last page is let go, and the match is unlocked.

use super::core::{SchedulerConfig, StepScheduler, NONE};
use super::prefix::Finishing;
use super::tier::Tier;
use super::{PrefixTier, PrefixTotals};
use crate::config::HitPolicy;
use crate::directory::{HostState, ObjectHint, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, PageId, RequestId, SlotId};
use crate::radix::{HiCache, HiCacheConfig, PoolPair};
use crate::scheduler::request::RequestState;
use crate::scheduler::Admission;
use crate::transfer::binding::{check_disjoint, check_same_rows};
use crate::transfer::{CopyEngine, PageTransferBinding};
use crate::transfer::{Direction, LayerStatus};
use std::ops::Range;
use std::sync::Arc;

impl StepScheduler<PrefixTier> {
    /// A joined scheduler: main-KV objects live at the host pages of a radix prefix cache
    /// (`host_kv`, the group's multi-layer KV host pool, in either layout) and are loaded
    /// per layer into `device` slots as selections pick them; `sidecars` (Indexer-K, SWA,
    /// draft) are whole-page pools of `sidecar_device_pages` device pages, restored by the
    /// prefix cache on a hit (ALL_PAGES, or the SWA window) and written through when a request
    /// ends. `cfg.host_pages` is the group's host page count.
    pub fn joined(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host_kv: PageTransferBinding,
        sidecars: Vec<PoolPair>,
        sidecar_device_pages: u32,
        engine: Arc<dyn CopyEngine>,
    ) -> Result<Self> {
        if cfg.layers == 0 {
            return Err(Error::config("layers", 0, "an integer >= 1"));
        }
        if device.layers() != 1 || device.pages() != cfg.device_pages {
            return Err(Error::config(
                "device",
                format!("{} layers x {} pages", device.layers(), device.pages()),
                format!("a one-layer KV pool of {} slots", cfg.device_pages),
            ));
        }
        if host_kv.layers() != cfg.layers as usize
            || host_kv.pages() != cfg.host_pages
            || host_kv.page_size() != cfg.page_size
            || host_kv.planes_per_layer() != device.planes_per_layer()
            || host_kv.page_bytes() != device.page_bytes()
        {
            return Err(Error::config(
                "host_kv",
                format!(
                    "{} layers x {} pages of {} tokens",
                    host_kv.layers(),
                    host_kv.pages(),
                    host_kv.page_size()
                ),
                format!(
                    "the group's KV host pool: {} layers x {} pages of {} tokens, rows as the \
                     device slots'",
                    cfg.layers, cfg.host_pages, cfg.page_size
                ),
            ));
        }
        if sidecars.iter().any(|p| p.device.is_none()) {
            return Err(Error::config(
                "sidecars",
                "a pool without a device buffer",
                "Indexer-K / SWA / draft pools with device and host buffers",
            ));
        }
        let names: Vec<[String; 2]> = (0..sidecars.len())
            .map(|i| {
                [
                    format!("sidecars[{i}].device"),
                    format!("sidecars[{i}].host"),
                ]
            })
            .collect();
        let mut all = vec![("device", &device), ("host_kv", &host_kv)];
        for (p, [d, h]) in sidecars.iter().zip(&names) {
            all.extend(p.device.iter().map(|dev| (d.as_str(), dev)));
            all.push((h.as_str(), &p.host));
        }
        check_disjoint(&all)?;
        check_same_rows(("device", &device), ("host_kv", &host_kv))?;
        for (p, [d, h]) in sidecars.iter().zip(&names) {
            if let Some(dev) = &p.device {
                check_same_rows((d, dev), (h, &p.host))?;
            }
        }
        let (flat, order) = host_kv.flatten_layers()?;
        let kv_page_bytes = host_kv.page_bytes() * host_kv.planes_per_layer() as u64;
        let mut pools = vec![PoolPair {
            device: None,
            host: host_kv,
            hit: HitPolicy::AllPages,
        }];
        pools.extend(sidecars.iter().cloned());
        let cache = HiCache::new(
            HiCacheConfig {
                page_size: cfg.page_size as usize,
                device_pages: sidecar_device_pages,
                device_reserve: 0,
                host_pages: cfg.host_pages,
                host_reserve: 0,
                drop_unbacked: false,
            },
            pools,
            Some(engine.clone()),
        )?;
        let tier = PrefixTier::new(
            cache,
            sidecars,
            order,
            cfg.host_pages,
            cfg.layers,
            cfg.page_size,
            kv_page_bytes,
        );
        let objects = cfg.host_pages as usize * cfg.layers as usize;
        let s = Self::assemble(cfg, device, flat, engine, tier)?;
        // Every main-KV object has its home in a host page, one a layer: the directory holds
        // at most that many, and room for them now keeps its growth out of decode steps.
        s.dir.reserve_objects(objects);
        Ok(s)
    }

    /// The prefix tier.
    pub fn prefix_tier(&self) -> &PrefixTier {
        &self.tier
    }

    /// Admits request `id` with prompt `tokens`: matches its whole pages in the prefix cache
    /// (leaving at least one token to prefill), locks the match, starts the restore of the
    /// host part's Indexer-K, and registers the matched pages' main KV as host-resident
    /// objects. The request starts at the matched length; `extend` prefills the rest.
    pub fn admit(&mut self, id: RequestId, tokens: &[u32]) -> Result<Admission> {
        self.no_device_step("admit")?;
        if self.requests.contains_key(&id) {
            return Err(Error::KeyExists {
                key: format!("request {id}"),
            });
        }
        if tokens.is_empty() {
            return Err(Error::config(
                "tokens",
                "an empty prompt",
                "at least one token",
            ));
        }
        let ps = self.cfg.page_size as usize;
        let layers = self.cfg.layers as usize;
        let dir = self.dir.clone();
        let p = &mut self.tier;
        p.cache.poll()?;
        p.drop_freed(&dir)?;
        let cap = (tokens.len() - 1) / ps * ps;
        let m = p.cache.match_prefix(0, &tokens[..cap]);
        let mut node = m.last_node;
        let mut matched = (m.device_len + m.host_len) / ps;
        let mut restored = 0;
        let mut restores = Vec::new();
        if matched > 0 {
            p.cache.lock(node)?;
        }
        if m.host_len > 0 {
            match p.cache.load_back(node) {
                Ok(Some(lb)) => {
                    #[cfg(any(test, feature = "testing"))]
                    if p.restore_faults > 0 {
                        p.restore_faults -= 1;
                        let engine = &self.xfer.engine;
                        engine.inject(crate::transfer::Fault {
                            nth: engine.submitted(),
                            layer: None,
                            action: crate::transfer::FaultAction::Fail(
                                "injected restore fault".into(),
                            ),
                        })?;
                    }
                    if let Err(e) = p.cache.flush() {
                        p.cache.unlock(node)?;
                        return Err(e);
                    }
                    for t in lb.transfer.into_iter().chain(lb.joined) {
                        if let Some(ev) = p.cache.events(t) {
                            restores.push(ev);
                        }
                    }
                    restored = m.host_len / ps;
                }
                Ok(None) => {
                    // No device pages for the restore: use the device part only.
                    p.cache.unlock(node)?;
                    node = m.device_node;
                    matched = m.device_len / ps;
                    if matched > 0 {
                        p.cache.lock(node)?;
                    }
                    p.totals.restores_refused += 1;
                }
                Err(e) => {
                    p.cache.unlock(node)?;
                    return Err(e);
                }
            }
        }
        let (idx_pages, host_pages) = if matched > 0 {
            let t = p.cache.tree();
            (t.path_device_pages(node)?, t.path_host_pages(node)?)
        } else {
            (Vec::new(), Vec::new())
        };
        debug_assert_eq!(idx_pages.len(), matched);
        debug_assert_eq!(host_pages.len(), matched);
        let homes = p.homes_of(&host_pages);
        let (keys, at) = p.keys_of(&homes);
        p.totals.requests += 1;
        if matched > 0 {
            p.totals.hits += 1;
        }
        let ps64 = ps as u64;
        p.totals.device_hit_tokens += (matched - restored) as u64 * ps64;
        p.totals.host_hit_tokens += restored as u64 * ps64;
        let side =
            p.sidecar_restore_bytes((matched - restored) as u32..matched as u32, matched as u32);
        p.totals.sidecar_bytes_restored += side;
        p.totals.full_restore_bytes += restored as u64 * p.kv_page_bytes() + side;
        // (Checked before the state takes a kept slot: a refusal leaves nothing behind.)
        let idx = if keys.is_empty() {
            Vec::new()
        } else {
            dir.register_host(&keys, &at)?;
            dir.index_of(&keys)
        };
        let slot = self.kept.add();
        let mut state = RequestState::new(id, (matched * ps) as u64, None, layers, slot);
        state.joined = true;
        state.homes = homes;
        state.idx_pages = idx_pages.iter().map(|p| p.raw()).collect();
        state.matched = matched as u32;
        state.node = (matched > 0).then_some(node);
        state.tokens = tokens.to_vec();
        state.restores = restores;
        state.prefix_seen = vec![0; (matched * layers).div_ceil(64)];
        state.restored_from = (matched - restored) as u32;
        if !keys.is_empty() {
            for l in 0..layers {
                state.set_index(
                    l as u16,
                    0..matched as u32,
                    &idx[l * matched..(l + 1) * matched],
                );
            }
        }
        self.requests.insert(id, state);
        if let Err(e) = self.decide_restore(id, (tokens.len() - matched * ps) as u64) {
            // Nothing of a refused admission stays: its match unlocked, its pages let go.
            self.end_request(id, None)?;
            return Err(e);
        }
        Ok(Admission {
            matched_pages: matched as u32,
            device_pages: (matched - restored) as u32,
            restored_pages: restored as u32,
            full_restore_objects: self.requests[&id].restore_loaded,
        })
    }

    /// Makes layer `layer` of request `id`'s restored Indexer-K readable: an event wait (cpu)
    /// or a stream wait (CUDA). A failed restore is an error: the caller ends the request.
    pub fn wait_prefix(&mut self, id: RequestId, layer: u16, stream: Option<u64>) -> Result<()> {
        if layer >= self.cfg.layers {
            return Err(Error::out_of_range("layer", layer, 0, self.cfg.layers));
        }
        self.xfer.engine.check_stream(stream)?;
        let r = self
            .requests
            .get(&id)
            .ok_or_else(|| Error::config("rid", id, "a running request"))?;
        let t0 = std::time::Instant::now();
        let out = PrefixTier::wait_restore(&self.xfer.engine, &r.restores, layer, stream);
        let waited = t0.elapsed().as_nanos() as u64;
        self.rec.exposed_wait_ns += waited;
        if let Some(r) = self.requests.get_mut(&id) {
            r.exposed_wait_ns += waited;
        }
        if out.is_err() {
            self.tier.totals.restores_failed += 1;
        }
        out
    }

    /// Indexer-K device pages of request `id`, one per page.
    pub fn indexer_pages(&self, id: RequestId) -> Result<&[u32]> {
        self.requests
            .get(&id)
            .map(|r| r.idx_pages.as_slice())
            .ok_or_else(|| Error::config("rid", id, "a running request"))
    }

    /// Ends request `id` without inserting its pages (`end_request(id, None)`).
    pub fn finish_request(&mut self, id: RequestId) -> Result<()> {
        self.end_request(id, None)
    }

    /// Ends request `id`. With `tokens` (its prompt and generated tokens, at least its whole
    /// pages' worth), its whole pages go into the prefix tree once written through; without,
    /// its own pages are let go. Either way the match is unlocked when that is done.
    pub fn end_request(&mut self, id: RequestId, tokens: Option<&[u32]>) -> Result<()> {
        self.no_device_step("end_request")?;
        let r = self
            .requests
            .get(&id)
            .ok_or_else(|| Error::config("rid", id, "a running request"))?;
        let ps = self.cfg.page_size as usize;
        let full = (r.len as usize / ps) as u32;
        if let Some(t) = tokens {
            // Every prompt token the inserted pages hold is checked against the prompt the
            // request was admitted with (a later request over other tokens must not read
            // this one's KV); the generated ones the core never saw.
            let whole = full as usize * ps;
            let p = r.tokens.len().min(whole);
            if t.len() < whole || t[..p] != r.tokens[..p] {
                return Err(Error::config(
                    "tokens",
                    format!("{} tokens", t.len()),
                    format!(
                        "the request's tokens: at least {whole} (its whole pages), starting \
                         with the {} it was admitted with",
                        r.tokens.len()
                    ),
                ));
            }
        }
        let r = self.requests.remove(&id).expect("checked");
        self.learn_restore(&r, tokens.is_some());
        self.release_kept_of(r.kept_slot)?;
        let f = Finishing {
            id,
            tokens: tokens.map_or(Vec::new(), |t| t[..full as usize * ps].to_vec()),
            homes: r.homes,
            idx_pages: r.idx_pages,
            matched: r.matched,
            full,
            node: r.node,
            insert: tokens.is_some(),
            write: None,
            written: false,
        };
        if f.insert {
            self.tier.finishing.push(f);
            self.progress_finishing()
        } else {
            self.let_go(f, 0)
        }
    }

    /// Lets go of a finishing request's own pages from `from` on (all of them when it is not
    /// inserted) and unlocks its match.
    pub(super) fn let_go(&mut self, f: Finishing, from: u32) -> Result<()> {
        let dir = self.dir.clone();
        let p = &mut self.tier;
        let start = from.max(f.matched) as usize;
        let mut idx = Vec::new();
        for i in start..f.homes.len() {
            let (h, gen) = f.homes[i];
            p.release_page(&dir, h, gen)?;
            idx.push(PageId::new(f.idx_pages[i]));
        }
        p.cache.free_device(&idx)?;
        if let Some(node) = f.node {
            p.cache.unlock(node)?;
        }
        p.free_settled(&dir)?;
        Ok(())
    }

    /// Advances the requests that ended: submits their Indexer-K write-through, and inserts
    /// those whose pages are all written through.
    pub(super) fn progress_finishing(&mut self) -> Result<()> {
        let p = &mut self.tier;
        if p.finishing.is_empty() {
            return p.free_settled(&self.dir);
        }
        let list = std::mem::take(&mut p.finishing);
        let mut keep = Vec::new();
        for mut f in list {
            if !f.written {
                match &f.write {
                    None => {
                        let pairs: Vec<(u32, u32)> = (f.matched..f.full)
                            .map(|i| (f.idx_pages[i as usize], f.homes[i as usize].0))
                            .collect();
                        self.xfer.arm(Direction::Backup, None)?;
                        match self.tier.write_through(&self.xfer.engine, &pairs) {
                            Ok(Some(ev)) => f.write = Some(ev),
                            Ok(None) => f.written = true,
                            Err(_) => self.tier.totals.writes_failed += 1,
                        }
                    }
                    Some(ev) if ev.is_finished() => {
                        let ok = ev
                            .layers()
                            .iter()
                            .all(|&l| matches!(ev.status(l), Ok(LayerStatus::Done)));
                        if ok {
                            f.written = true;
                        } else {
                            self.tier.totals.writes_failed += 1;
                        }
                        f.write = None;
                    }
                    Some(_) => {}
                }
            }
            if f.written && self.kv_written(&f) {
                self.commit(f)?;
            } else {
                keep.push(f);
            }
        }
        let p = &mut self.tier;
        keep.append(&mut p.finishing);
        p.finishing = keep;
        p.free_settled(&self.dir)
    }

    /// Whether every layer of the request's own whole pages is host-Ready.
    pub(super) fn kv_written(&self, f: &Finishing) -> bool {
        (f.matched..f.full).all(|i| {
            let (h, gen) = f.homes[i as usize];
            (0..self.cfg.layers).all(|l| {
                self.dir
                    .state(&PrefixTier::key(h, gen, l))
                    .is_some_and(|o| matches!(o.host, HostState::Ready { .. }))
            })
        })
    }

    /// Inserts a written-through request's whole pages and lets go of the rest.
    pub(super) fn commit(&mut self, f: Finishing) -> Result<()> {
        let dir = self.dir.clone();
        let p = &mut self.tier;
        let full = f.full as usize;
        if full > 0 {
            let dev: Vec<PageId> = f.idx_pages[..full]
                .iter()
                .map(|&x| PageId::new(x))
                .collect();
            let host: Vec<PageId> = f.homes[..full]
                .iter()
                .map(|&(h, _)| PageId::new(h))
                .collect();
            let (_, spare) = p.cache.insert_with_host(0, &f.tokens, &dev, &host)?;
            p.totals.pages_inserted += u64::from(f.full - f.matched);
            for s in spare {
                let i = host.iter().position(|&h| h == s).expect("given");
                let (h, gen) = f.homes[i];
                p.release_page(&dir, h, gen)?;
            }
        }
        self.let_go(f_tail(f), 0)
    }

    /// Arms `count` failures of the next Indexer-K restores (through the engine's fault hook).
    #[cfg(any(test, feature = "testing"))]
    pub fn inject_restore_faults(&mut self, count: u32) {
        self.tier.restore_faults += count;
    }

    /// Writes through and inserts every request that ended, waiting for the copies (a retry
    /// for a failed one included); what remains is still retried at every `end_step`. A
    /// caller that wants the next admission to see these pages deterministically calls this
    /// after `end_request`.
    pub fn flush_finished(&mut self) -> Result<()> {
        for _ in 0..3 {
            if self.finishing() == 0 {
                break;
            }
            self.xfer.pending.append(&mut self.xfer.filled);
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
            self.progress_finishing()?;
            let waits: Vec<_> = (self.tier.finishing.iter())
                .filter_map(|f| f.write.clone())
                .collect();
            for ev in waits {
                let _ = ev.wait_all(None);
            }
            self.progress_finishing()?;
        }
        Ok(())
    }

    /// Prefix-tier counters (joined mode).
    pub fn prefix_totals(&self) -> PrefixTotals {
        self.tier.totals
    }

    /// Evicts prefix-cache pages: `device` Indexer-K device pages of unlocked nodes, then
    /// `host` host pages of unlocked host-only nodes (whose main-KV objects go with them).
    /// Returns (device pages freed, host pages freed).
    pub fn evict_prefix(&mut self, device: usize, host: usize) -> Result<(usize, usize)> {
        self.no_device_step("evict_prefix")?;
        if device > 0 {
            // What the device resolver's pool holds becomes the directory's, to leave too.
            self.release_device()?;
        }
        let dir = self.dir.clone();
        let p = &mut self.tier;
        let d = p.cache.evict_device(device);
        let h = p.cache.evict_host(host)?;
        p.drop_freed(&dir)?;
        Ok((d, h))
    }

    /// Requests that ended and wait for their pages to be written through.
    pub fn finishing(&self) -> usize {
        self.tier.finishing.len()
    }

    /// Checks the prefix tier: the cache's invariants, and that every page the cache handed
    /// out is held by exactly one running or finishing request, or waits in limbo.
    pub(super) fn validate_prefix(&self) -> std::result::Result<(), String> {
        let p = &self.tier;
        p.cache.validate()?;
        let ps = u64::from(self.cfg.page_size);
        let mut own_dev = 0usize;
        let mut own_host = 0usize;
        let mut seen = rustc_hash::FxHashSet::default();
        let owners = self
            .requests
            .values()
            .map(|r| {
                (
                    r.id,
                    r.matched as usize,
                    &r.homes,
                    &r.idx_pages,
                    r.pages(self.cfg.page_size),
                )
            })
            .chain(p.finishing.iter().map(|f| {
                (
                    f.id,
                    f.matched as usize,
                    &f.homes,
                    &f.idx_pages,
                    f.homes.len() as u32,
                )
            }));
        for (id, matched, homes, idx, pages) in owners {
            if homes.len() != pages as usize || idx.len() != pages as usize {
                return Err(format!(
                    "request {id}: {} homes, {} Indexer-K pages for {pages} pages",
                    homes.len(),
                    idx.len()
                ));
            }
            own_dev += idx.len() - matched;
            own_host += homes.len() - matched;
            for &(h, _) in &homes[matched..] {
                if !seen.insert(h) {
                    return Err(format!("host page {h} held twice (request {id})"));
                }
            }
        }
        let _ = ps;
        if own_dev != p.cache.outstanding() {
            return Err(format!(
                "Indexer-K device pages: requests hold {own_dev}, cache handed out {}",
                p.cache.outstanding()
            ));
        }
        if own_host + p.limbo_len() != p.cache.outstanding_host() {
            return Err(format!(
                "host pages: requests hold {own_host} + limbo {}, cache handed out {}",
                p.limbo_len(),
                p.cache.outstanding_host()
            ));
        }
        Ok(())
    }
}

impl Tier for PrefixTier {
    const JOINED: bool = true;

    /// The pages first get host pages and Indexer-K device pages from the prefix cache, and
    /// their objects a home there.
    fn start_pages(
        s: &mut StepScheduler<Self>,
        starts: &[(RequestId, Range<u32>)],
    ) -> Result<(Vec<ObjectKey>, Vec<SlotId>)> {
        let layers = s.cfg.layers;
        let n: usize = starts.iter().map(|(_, r)| r.len()).sum();
        let p = &mut s.tier;
        let host = p.alloc_host(&s.dir, n)?;
        let idx = match p.cache.alloc_device(n) {
            Ok(v) => v,
            Err(e) => {
                p.cache.free_host(&host)?;
                return Err(e);
            }
        };
        let page_homes = p.homes_of(&host);
        let mut at = 0;
        for (id, range) in starts {
            let r = s.requests.get_mut(id).expect("checked by the caller");
            debug_assert_eq!(r.homes.len(), range.start as usize);
            r.homes.extend_from_slice(&page_homes[at..at + range.len()]);
            r.idx_pages
                .extend(idx[at..at + range.len()].iter().map(|p| p.raw()));
            at += range.len();
        }
        let mut keys = Vec::with_capacity(n * layers as usize);
        let mut homes: Vec<HostSlotId> = Vec::with_capacity(n * layers as usize);
        for (id, range) in starts {
            let r = &s.requests[id];
            for l in 0..layers {
                for page in range.clone() {
                    keys.push(r.key(page, l));
                    homes.push(s.tier.home(r.homes[page as usize].0, l));
                }
            }
        }
        match s.allocate_with_room(&keys, Some(&homes)) {
            Ok(slots) => {
                // Pages being written have no host copy yet: the device must find them.
                if let Some(link) = s.tier.device.as_mut() {
                    let layers = layers as usize;
                    for key in &keys {
                        let h = (key.namespace.id - super::prefix::HOST_NS) as usize;
                        let crate::directory::LayerGroup::Layer(l) = key.layers else {
                            unreachable!("main-KV objects are per layer")
                        };
                        link.adds.push(h * layers + l as usize);
                    }
                }
                Ok((keys, slots))
            }
            Err(e) => {
                for (id, range) in starts {
                    let r = s.requests.get_mut(id).expect("checked by the caller");
                    r.homes.truncate(range.start as usize);
                    r.idx_pages.truncate(range.start as usize);
                }
                s.tier.cache.free_host(&host)?;
                s.tier.cache.free_device(&idx)?;
                Err(e)
            }
        }
    }

    /// Counts the main-KV bytes loaded for matched prefix pages, and those loaded for the
    /// first time in their request. What the host loaded enters the device resolver's mirror
    /// at its next grant: otherwise the device would copy those objects in again.
    fn count_loads(
        s: &mut StepScheduler<Self>,
        layer: u16,
        keys: &[ObjectKey],
        loaded: &[bool],
        from_prefix: &[u32],
        key_rids: &[RequestId],
    ) {
        if let (Some(link), false) = (s.tier.device.as_mut(), keys.is_empty()) {
            let layers = s.cfg.layers as usize;
            for (key, _) in keys.iter().zip(loaded).filter(|(_, &l)| l) {
                let h = (key.namespace.id - super::prefix::HOST_NS) as usize;
                link.adds.push(h * layers + layer as usize);
            }
        }
        let object_bytes = s.object_bytes();
        let layers = s.cfg.layers as usize;
        let totals = &mut s.tier.totals;
        for (i, (&l, &page)) in loaded.iter().zip(from_prefix).enumerate() {
            if !l || page == NONE {
                continue;
            }
            let Some(r) = s.requests.get_mut(&key_rids[i]) else {
                continue;
            };
            if page < r.restored_from {
                // Indexer-K was on the device: a whole-prefix restore moves nothing here.
                totals.device_part_kv_bytes_loaded += object_bytes;
                continue;
            }
            totals.prefix_kv_bytes_loaded += object_bytes;
            let bit = page as usize * layers + layer as usize;
            let word = &mut r.prefix_seen[bit / 64];
            if *word & (1 << (bit % 64)) == 0 {
                *word |= 1 << (bit % 64);
                totals.prefix_kv_bytes_first += object_bytes;
            }
        }
    }

    /// Settles the cache's transfers, drops the objects of the host pages it let go, and
    /// advances the requests that ended.
    fn end_step(s: &mut StepScheduler<Self>) -> Result<()> {
        // A device step whose log never came back (its grant written off) still ends as a
        // step: the cache's transfers settle and ended requests move on; then its error.
        let device = s.end_device_step();
        let rest = s
            .tier
            .cache
            .poll()
            .and_then(|_| s.tier.drop_freed(&s.dir))
            .and_then(|()| s.progress_finishing());
        device.and(rest)
    }

    /// Waits for the cache's transfers, then writes through and inserts the requests that
    /// ended (a failed write gets more tries).
    fn drain(s: &mut StepScheduler<Self>) -> Result<()> {
        // (A device step whose log never came back still hands its grant back.)
        let device = s.end_device_step();
        s.park_grant()?;
        device?;
        s.tier.cache.drain()?;
        s.tier.drop_freed(&s.dir)?;
        s.flush_finished()?;
        s.progress_finishing()
    }

    fn validate(s: &StepScheduler<Self>) -> std::result::Result<(), String> {
        s.validate_prefix()?;
        #[cfg(any(test, feature = "testing"))]
        s.validate_copies()?;
        s.validate_device()
    }

    fn make_room(s: &mut StepScheduler<Self>) -> Result<()> {
        s.release_device()
    }

    fn adopt_own(
        s: &mut StepScheduler<Self>,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
    ) -> Result<()> {
        s.adopt_pooled(keys, hints).map(drop)
    }

    fn reclaim(s: &mut StepScheduler<Self>, n: usize) -> Result<usize> {
        s.reclaim_device(n)
    }

    fn extra_pins(s: &StepScheduler<Self>) -> u64 {
        s.device_pins()
    }

    fn device_victims(s: &StepScheduler<Self>) -> rustc_hash::FxHashSet<u32> {
        s.granted_victims()
    }

    fn device_step_open(&self) -> bool {
        self.device.as_ref().is_some_and(|l| l.open)
    }

    #[cfg(any(test, feature = "testing"))]
    fn restore_faults(&self) -> u64 {
        u64::from(self.restore_faults)
    }
}

/// The part of a committed request that was not inserted: its pages past the whole ones.
fn f_tail(mut f: Finishing) -> Finishing {
    f.matched = f.full.max(f.matched);
    f
}
