//! The joined scheduler's side of the device resolver (`resolver.rs`): what it grants the
//! device at a step's start, and what it learns from the device's log at the step's end.
//!
//! # One device step
//! `append` -> `begin_device_step` (one call: the mirror brought up to date with what the
//! core changed since the last step, the batch's page tables, the grant topped up) -> per
//! layer the resolver (no call into the core) -> `end_step` (one call: the log reconciled, then
//! the usual write-through and settling).
//!
//! # The grant
//! A standing list of device slots the device may fill, taken in order: free slots first,
//! then victims (the core's least recently used evictable objects, pinned so that the host
//! cannot move them, still readable and still in the mirror), then the slots of the
//! resolver's pool (`device_pool.rs`) in clock order. It holds at least one entry per
//! cell a layer can miss (`cells`: per row, its entries or its pages if fewer; the slots
//! earlier layers filled are filled again once the grant is spent), so a step never runs out;
//! when the device cannot give that many, `begin_device_step` says so and the step plans on
//! the host.
//! What a step did not take stays granted.
//!
//! # Reconcile (at `end_step`)
//! For each entry the step took: a victim is evicted (`take_victim`), and the slot joins the
//! pool with the object copied in, which stays the resolver's (the directory never learns of
//! it: no work per miss). Victims the step read are given back to the LRU (they are hot); the
//! pool's slots it passed over go to the pool's back.
//!
//! # The pool
//! Slots the resolver owns between steps, granted in the directory. When the host lacks
//! device slots and the directory has nothing to evict, the pool frees them from its front
//! (`reclaim_device`); `make_room` gives it back whole, its objects adopted where they are.
//! A host load of an object a pool slot holds adopts it in that slot (`adopt_pooled`).
//!
//! # Recency
//! The core's LRU does not see the device's hits. So victims are chosen by second chance: a
//! least recently used object the last device step read (the resolver's read marks) goes back
//! to the LRU's end instead, as its hit would have put it (the pool's clock does the same
//! with its slots). Nothing the device reads is pinned
//! between steps: what the host evicts then is logged and leaves the mirror at the next grant,
//! and on a GPU the host's copies are stream-ordered after the device's reads.
//!
//! # Invariants (`validate`)
//! Every mirror entry names a device-Ready object of the directory at that slot, or a slot of
//! the resolver's that holds it; every object of a running request on the device is in the
//! mirror (the host's loads enter it too: `Tier::count_loads`); the resolver's slots (the
//! pool's, and the grant's that are not victims) are distinct and are the directory's granted
//! slots.

use super::core::StepScheduler;
use super::device_pool::DevicePool;
use super::prefix::HOST_NS;
use super::record::StepRecord;
use super::resolver::{ResolverState, ABSENT};
use super::tier::Tier;
use super::PrefixTier;
use crate::directory::{DeviceState, LayerGroup, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{RequestId, SlotId};
use parking_lot::Mutex;
use std::sync::Arc;

/// What a grant entry's slot holds when granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Held {
    /// Nothing: a free slot.
    Free,
    /// A directory object the device may evict: (mirror entry, object index).
    Victim(usize, u32),
    /// The object a step copied into this pool slot (its mirror entry).
    Pool(usize),
}

impl Held {
    /// What the slot holds for the pool (a victim is not the resolver's: none).
    pub(super) fn pool_entry(self) -> Option<usize> {
        match self {
            Held::Pool(e) => Some(e),
            _ => None,
        }
    }

    /// The mirror entry the kernel evicts when it takes the slot, or -1.
    fn victim(self) -> i64 {
        match self {
            Held::Free => -1,
            Held::Victim(e, _) | Held::Pool(e) => e as i64,
        }
    }
}

/// A grant entry: its slot, and what it holds.
pub(super) type Entry = (SlotId, Held);

/// The link between a joined scheduler and its device resolver.
pub(crate) struct DeviceLink {
    pub(crate) state: Arc<Mutex<ResolverState>>,
    /// Mirror entries to set at the next grant, or when a host step ends: pages that started on
    /// the device, objects the host loaded (those still loading then wait for the next).
    pub(crate) adds: Vec<usize>,
    /// Host pages that got a new generation: their entries name another page's objects now.
    pub(crate) bumped: Vec<u32>,
    pub(super) grant: Vec<Entry>,
    /// Slots the resolver keeps between steps, with what it copied into them.
    pub(super) pool: DevicePool,
    pub(super) open: bool,
    /// Device steps run, steps that planned on the host for want of a grant, and slots
    /// filled twice in a step.
    steps: u64,
    fallbacks: u64,
    refills: u64,
    /// Objects host loads found in the pool and adopted there instead of copying them.
    pub(super) adopted: u64,
    /// Objects the last device step copied in: the grant holds twice as many, so that a step
    /// rarely fills a slot twice (an object an earlier layer brought in leaves then, and the
    /// next step loads it again).
    last_misses: usize,
}

impl std::fmt::Debug for DeviceLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLink")
            .field("grant", &self.grant.len())
            .field("open", &self.open)
            .finish()
    }
}

/// Device-resolve counters of a joined scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceTotals {
    /// Steps resolved on the device.
    pub steps: u64,
    /// Steps that planned on the host for want of a grant.
    pub fallbacks: u64,
    /// Grant entries standing.
    pub granted: u64,
    /// Of them, directory objects granted as victims: pinned until the device takes them or
    /// the grant ends.
    pub granted_victims: u64,
    /// Slots in the resolver's pool (outside the grant).
    pub pool: u64,
    /// Objects the resolver's slots hold (pool and grant) that the mirror names there and the
    /// directory has nowhere else on the device: what the resolver adds to the device's
    /// residency.
    pub pool_live: u64,
    /// Slots a step filled again after an earlier layer of it had filled them.
    pub refills: u64,
    /// Objects the host was about to load that the pool held: adopted where they were, not
    /// copied again.
    pub adopted: u64,
    /// Objects the host's evictions passed over because the last device step read them.
    pub second_chances: u64,
    /// Second chances the grants gave for the same reason (each passed over once a bitmap; a
    /// walk that comes round to one again grants it then).
    pub grant_second_chances: u64,
}

impl StepScheduler<PrefixTier> {
    /// Starts resolving decode steps on the device: returns the resolver's state, which the
    /// device side (`resolve_layer`) works on between `begin_device_step` and `end_step`.
    /// Pages that start from now on are mirrored from their start, and the scheduler stops
    /// prefetching (the resolver serves its misses itself). Idempotent.
    pub fn enable_device_resolver(&mut self) -> Result<Arc<Mutex<ResolverState>>> {
        if let Some(link) = &self.tier.device {
            return Ok(link.state.clone());
        }
        let gpu = self.xfer.device().kind() == crate::transfer::MemoryKind::Device;
        let (device, host, order) = (
            self.xfer.device().clone(),
            self.xfer.host().clone(),
            self.tier.order(),
        );
        let ordinal = device.device().unwrap_or(0) as usize;
        let host_base = host.extent().0;
        let mut state = ResolverState::new(
            self.cfg.layers,
            self.cfg.page_size,
            self.cfg.host_pages,
            device,
            host,
            order,
        )?;
        if gpu {
            // CUDA pools: the kernel on their device, reading the host pool over unified
            // addressing.
            let dev = super::resolver::gpu::GpuDevice::new(ordinal, host_base)?;
            state.use_kernel(Box::new(dev))?;
        }
        let state = Arc::new(Mutex::new(state));
        // The resolver serves its misses itself: a prefetch would load pages for plans that
        // decode steps no longer make. Prefetch stops here (what is outstanding is let go).
        let outstanding: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in outstanding {
            self.drop_prefetch(l)?;
        }
        self.cfg.prefetch = false;
        // Every object on the device enters the mirror now (one lookup a home and layer):
        // a running request's, and as well a finished one's that the prefix cache keeps, which
        // a later request that matches it reads. From here on the directory logs what leaves
        // the device and start_pages what enters.
        self.dir.log_releases(true);
        let layers = self.cfg.layers as usize;
        let entries = self.cfg.host_pages as usize * layers;
        let mut adds = Vec::new();
        let mut keys = Vec::with_capacity(entries.min(4096));
        for chunk in 0..entries.div_ceil(4096) {
            let from = chunk * 4096;
            let to = (from + 4096).min(entries);
            keys.clear();
            keys.extend((from..to).map(|e| self.key_of(e, layers)));
            for (e, state) in (from..to).zip(self.dir.device_states(&keys)) {
                // (One still loading is looked up again at the first grant after it lands.)
                if matches!(
                    state,
                    Some(DeviceState::Ready { .. } | DeviceState::Loading { .. })
                ) {
                    adds.push(e);
                }
            }
        }
        self.tier.device = Some(DeviceLink {
            state: state.clone(),
            adds,
            bumped: Vec::new(),
            grant: Vec::new(),
            pool: DevicePool::default(),
            open: false,
            steps: 0,
            fallbacks: 0,
            refills: 0,
            adopted: 0,
            last_misses: 0,
        });
        Ok(state)
    }

    /// The CUDA device the resolver's kernel runs on, when it runs on a GPU (a step's work is
    /// queued on the stream [`StepScheduler::begin_device_step_on`] names).
    pub fn device_resolver_gpu(&self) -> Option<usize> {
        let link = self.tier.device.as_ref()?;
        link.state
            .lock()
            .on_gpu()
            .then(|| self.xfer.device().device().unwrap_or(0) as usize)
    }

    /// The mirror entry of a joined object key.
    pub(super) fn entry_of(&self, key: &ObjectKey) -> usize {
        let h = (key.namespace.id - HOST_NS) as usize;
        let LayerGroup::Layer(l) = key.layers else {
            unreachable!("main-KV objects are per layer")
        };
        h * self.cfg.layers as usize + l as usize
    }

    /// Grants the device decode step of `rids`, whose rows have at most `entries` entries a
    /// layer: brings the mirror up to date, publishes the batch's page tables, and tops the
    /// grant up to a slot for every cell. Returns false when the device cannot give that many
    /// (this step then plans on the host; nothing is open).
    pub fn begin_device_step(&mut self, rids: &[RequestId], entries: usize) -> Result<bool> {
        self.begin_device_step_on(rids, entries, None)
    }

    /// [`StepScheduler::begin_device_step`], the step's kernel work queued on `stream` (a raw
    /// `CUstream` of the resolver's GPU: torch's current one) when given. Nothing changes
    /// when the step is refused.
    pub fn begin_device_step_on(
        &mut self,
        rids: &[RequestId],
        entries: usize,
        stream: Option<u64>,
    ) -> Result<bool> {
        let Some(link) = self.tier.device.as_ref() else {
            return Err(Error::config(
                "resolver",
                "not enabled",
                "a scheduler with a device resolver (enable_device_resolver)",
            ));
        };
        if link.open {
            return Err(Error::config(
                "step",
                "open",
                "no device step open (end_step ends the last one)",
            ));
        }
        // A host layer plan still open holds pins and slots the device step's grant and
        // mirror do not account for; a step is planned on one side.
        if !self.plans.is_empty() {
            return Err(Error::config(
                "plans",
                format!("{} still open", self.plans.len()),
                "none: finish every host layer plan before a device step",
            ));
        }
        if let Some(id) = rids.iter().find(|id| !self.requests.contains_key(id)) {
            return Err(Error::config("rids", id, "running requests"));
        }
        // One layer's cells: a row reads at most its request's pages (slots filled by earlier
        // layers of the step are filled again once the grant is spent).
        let ps = self.cfg.page_size;
        let cells: usize = rids
            .iter()
            .map(|id| entries.min(self.requests[id].pages(ps) as usize))
            .sum();
        let mut seen = rustc_hash::FxHashSet::default();
        if let Some(id) = rids.iter().find(|id| !seen.insert(**id)) {
            return Err(Error::config(
                "rids",
                id,
                "distinct requests (this one twice)",
            ));
        }
        let state = link.state.clone();
        let mut st = state.lock();
        self.sync_mirror(&mut st)?;
        // Page tables: homes of the batch's pages (appended as they start), and lengths.
        for id in rids {
            let r = &self.requests[id];
            st.update_table(*id, r.serial, &r.homes, r.len);
        }
        let requests = &self.requests;
        st.retain_tables(|id| requests.contains_key(id));
        let last = self.tier.device.as_ref().map_or(0, |l| l.last_misses);
        let want = cells.max(2 * last);
        // (Granting evicts nothing: free slots are taken as they are, and victims stay where
        // they are, named in the mirror by `top_up`.)
        let mut ok = self.top_up(cells, want, &mut st)?;
        if !ok && (!self.xfer.pending.is_empty() || self.xfer.backups_in_flight()) {
            // Short only because pages are not written through yet (right after a prefill):
            // they become evictable once their write-throughs land, which costs a wait for
            // those copies; planning the step on the host instead costs a round trip a layer
            // and hands the resolver's pool back.
            drop(st);
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
            st = state.lock();
            self.sync_mirror(&mut st)?;
            ok = self.top_up(cells, want, &mut st)?;
        }
        let link = self.tier.device.as_mut().expect("checked above");
        if !ok {
            link.fallbacks += 1;
            return Ok(false);
        }
        let grant = link
            .grant
            .iter()
            .map(|&(s, held)| (s.raw() as i32, held.victim()))
            .collect();
        // The step's stream, once the step is granted (the last one's back if it cannot open).
        let before = st.stream();
        if let Some(s) = stream {
            st.set_stream(s);
        }
        // Armed load failures (test builds) fail the resolver's copies this step.
        if let Err(e) = st.open((rids, entries), grant, self.xfer.take_copy_faults(), cells) {
            st.set_stream(before);
            self.xfer.restore_copy_faults(st.take_faults());
            return Err(e);
        }
        link.open = true;
        link.steps += 1;
        Ok(true)
    }

    /// Applies to the mirror what changed on the device since the last call (objects that
    /// gave up their slot, pages that started): each entry touched is set to where the
    /// directory has its object now, whatever the order the changes came in.
    pub(super) fn sync_mirror(&mut self, st: &mut ResolverState) -> Result<()> {
        const CHUNK: usize = 4096;
        let mut changed: Vec<usize> = self
            .dir
            .take_releases()
            .iter()
            .filter(|(k, _)| k.namespace.id >= HOST_NS)
            .map(|(k, _)| self.entry_of(k))
            .collect();
        let layers = self.cfg.layers as usize;
        if let Some(link) = self.tier.device.as_mut() {
            changed.append(&mut link.adds);
            for h in link.bumped.drain(..) {
                changed.extend(h as usize * layers..(h as usize + 1) * layers);
            }
        }
        changed.sort_unstable();
        changed.dedup();
        // An object still loading (a restore's loads are not waited for) is not readable yet:
        // it stays pending until its load settles, or the device would copy it in again.
        let mut loading = Vec::new();
        // Looked up a chunk a lock (a prefill's pages arrive by the hundred thousand).
        let mut keys = Vec::with_capacity(changed.len().min(CHUNK));
        for chunk in changed.chunks(CHUNK) {
            keys.clear();
            keys.extend(chunk.iter().map(|&e| self.key_of(e, layers)));
            for (&e, state) in chunk.iter().zip(self.dir.device_states(&keys)) {
                let now = match state {
                    Some(DeviceState::Ready { slot }) => slot.raw() as i32,
                    Some(DeviceState::Loading { .. }) => {
                        loading.push(e);
                        ABSENT
                    }
                    _ => ABSENT,
                };
                st.set(e, now);
            }
        }
        if let Some(link) = self.tier.device.as_mut() {
            link.adds.append(&mut loading);
        }
        Ok(())
    }

    /// Tops the grant up to `want` entries (at least `cells`): free slots, then the
    /// directory's victims (the pool grows into the device), then the pool's slots in clock
    /// order, those the last step read last. Returns whether it has `cells` (when not, what
    /// it took stays granted).
    fn top_up(&mut self, cells: usize, want: usize, st: &mut ResolverState) -> Result<bool> {
        let have = self.tier.device.as_ref().map_or(0, |l| l.grant.len());
        if have >= want {
            return Ok(true);
        }
        let mut need = want - have;
        let free = self.dir.device_free();
        let take = need.min(free);
        let mut fresh: Vec<Entry> = Vec::with_capacity(need);
        if take > 0 {
            fresh.extend(
                self.dir
                    .grant_slots(take)?
                    .into_iter()
                    .map(|s| (s, Held::Free)),
            );
            need -= take;
        }
        if need > 0 {
            // (An object the last device step read gets a second chance, as from the host's
            // own evictions: the step's bitmap was published when it was reconciled.)
            let victims = self.dir.grant_victims(need);
            need -= victims.len();
            for (idx, key, slot) in victims {
                fresh.push((slot, Held::Victim(self.entry_of(&key), idx)));
            }
        }
        // A victim the mirror does not name yet (it came to the device another way) enters
        // it: a cell that selects it hits, so a layer passes over at most as many victims as
        // it hits, and no object is copied in twice.
        for &(slot, held) in &fresh {
            if let Held::Victim(e, _) = held {
                st.set(e, slot.raw() as i32);
            }
        }
        let link = self.tier.device.as_mut().expect("checked by the caller");
        if need > 0 {
            let fetch = |e: usize| st.prefetch_read(e);
            let mut pooled = Vec::with_capacity(need);
            link.pool
                .take(need, true, |e| st.was_read(e), fetch, &mut pooled);
            let short = need.saturating_sub(pooled.len());
            if link.grant.len() + fresh.len() + pooled.len() < cells {
                // Not enough without them: the slots the last step read too.
                link.pool.take(short, false, |_| false, fetch, &mut pooled);
            }
            fresh.extend(
                pooled
                    .into_iter()
                    .map(|(s, e)| (s, e.map_or(Held::Free, Held::Pool))),
            );
        }
        link.grant.extend(fresh);
        Ok(link.grant.len() >= cells)
    }

    /// After a step whose log never came back: any slot of the grant may hold something else
    /// now. Victims count as evicted, every slot joins the pool empty, and the mirror forgets
    /// them (the next step uploads it whole).
    fn taint_grant(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        let grant = std::mem::take(&mut link.grant);
        let mut st = link.state.lock();
        let mut evicted = Vec::new();
        for &(slot, held) in &grant {
            match held {
                Held::Victim(e, idx) => {
                    if st.mirror()[e] == slot.raw() as i32 {
                        st.set(e, ABSENT);
                    }
                    evicted.push((idx, slot));
                }
                Held::Pool(e) if st.mirror()[e] == slot.raw() as i32 => st.set(e, ABSENT),
                _ => {}
            }
            link.pool.push(slot, None);
        }
        drop(st);
        self.dir.take_victims(&evicted)
    }

    /// Reconciles the open device step from the device's log (see the module docs); folds its
    /// counts into the step record. Nothing to do when no device step is open.
    pub(crate) fn end_device_step(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        if !link.open {
            // A host step (a prefill's): the mirror learns its pages now, so that a long
            // prompt's hundred thousand entries are not left to the next decode step's grant.
            if link.adds.is_empty() && link.bumped.is_empty() {
                return Ok(());
            }
            let state = link.state.clone();
            let mut st = state.lock();
            return self.sync_mirror(&mut st);
        }
        link.open = false;
        let state = link.state.clone();
        let closed = state.lock().close();
        let mut done = match closed {
            Ok(done) => done,
            Err(e) => {
                // (The faults it was handed are armed again: it learnt nothing of them.)
                let faults = state.lock().take_faults();
                self.xfer.restore_copy_faults(faults);
                self.taint_grant()?;
                return Err(e);
            }
        };
        // The host's own evictions now see what the device read (a hit leaves no trace in the
        // directory's LRU otherwise).
        self.dir
            .publish_reads(std::mem::take(&mut done.reads), HOST_NS, self.cfg.layers);
        let link = self.tier.device.as_mut().expect("checked above");
        let mut grant = std::mem::take(&mut link.grant);
        self.xfer
            .restore_copy_faults(std::mem::take(&mut done.faults));
        // Each taken entry's last copy: a slot filled more than once this step holds its
        // last object (none when that copy failed).
        const UNTAKEN: u32 = u32::MAX;
        const EMPTY: u32 = u32::MAX - 1;
        let mut owner = vec![UNTAKEN; done.used];
        for en in &done.log {
            owner[en.g as usize] = if en.failed { EMPTY } else { en.e };
        }
        // Victims the device took are evicted; those it passed over it read, so they go back
        // to the LRU as the most recently used. Every other slot the step went through stays
        // the resolver's, in the pool, with what it holds now.
        let mut evicted = Vec::new();
        let mut back = Vec::new();
        let link = self.tier.device.as_mut().expect("checked above");
        for (g, (slot, held)) in grant.drain(..done.used).enumerate() {
            let now = (owner[g] < EMPTY).then_some(owner[g] as usize);
            match (held, owner[g]) {
                (Held::Victim(_, idx), UNTAKEN) => back.push(idx),
                (Held::Victim(_, idx), _) => {
                    evicted.push((idx, slot));
                    link.pool.push(slot, now);
                }
                (Held::Pool(e), UNTAKEN) => link.pool.push(slot, Some(e)),
                (Held::Free, UNTAKEN) => link.pool.push(slot, None),
                (_, _) => link.pool.push(slot, now),
            }
        }
        // What the step did not reach stays granted.
        link.grant = grant;
        self.dir.take_victims(&evicted)?;
        self.dir.unhold(&back)?;
        let layers = self.cfg.layers as usize;

        // Matched prefix pages loaded, as the host path counts them (per layer: the log's
        // entries of one layer together).
        let mut by_layer: Vec<(Vec<u32>, Vec<RequestId>)> = Vec::new();
        // (Only prefix pages count: the rest would be skipped there. Most steps have none,
        // and a step's entries come a row at a time: one lookup a run of a request's.)
        let any_prefix = self.requests.values().any(|r| r.matched > 0);
        let mut matched: Option<(RequestId, u32)> = None;
        for &super::resolver::LogEntry {
            e,
            rid,
            page,
            failed,
            ..
        } in done.log.iter().filter(|_| any_prefix)
        {
            if failed {
                continue;
            }
            let m = match matched {
                Some((r, m)) if r == rid => m,
                _ => {
                    let m = self.requests.get(&rid).map_or(0, |r| r.matched);
                    matched = Some((rid, m));
                    m
                }
            };
            if page >= m {
                continue;
            }
            let l = e as usize % layers;
            if by_layer.is_empty() {
                by_layer.resize_with(layers, Default::default);
            }
            by_layer[l].0.push(page);
            by_layer[l].1.push(rid);
        }
        for (l, (pages, rids)) in by_layer.iter().enumerate() {
            if !pages.is_empty() {
                // (The device's own loads, every one a load: its mirror has them.)
                let loaded = vec![true; pages.len()];
                <PrefixTier as Tier>::count_loads(self, l as u16, &[], &loaded, pages, rids);
            }
        }
        // Rows that got a failed cell had no data for that layer: failed for the step, once.
        for &rid in &done.failed_rids {
            if self.failed_this_step.insert(rid) {
                self.rec.failed_requests += 1;
            }
        }
        if let Some(link) = self.tier.device.as_mut() {
            link.refills += done.counts.refills;
            link.last_misses = done.log.iter().filter(|en| !en.failed).count();
        }
        // The record, as the host path keeps it.
        let c = &done.counts;
        let hits: u64 = c.hits.iter().sum();
        let misses: u64 = c.misses.iter().sum();
        let object_bytes = self.object_bytes();
        let rec = StepRecord {
            selected: c.selected,
            pages: hits + misses,
            ready: hits,
            loaded: misses,
            bytes_transferred: misses * object_bytes,
            bytes_needed: c.needed_tokens * self.token_bytes,
            bytes_needed_of_transferred: c.needed_tokens_moved * self.token_bytes,
            failed_loads: c.failed,
            retried_loads: c.retried,
            layers: u64::from(self.cfg.layers),
            ..Default::default()
        };
        self.rec.fold(&rec);
        if done.bad_cells > 0 {
            return Err(Error::config(
                "selection",
                format!("{} entries past their request's tokens", done.bad_cells),
                "entries inside their requests' tokens (those cells read nothing)",
            ));
        }
        if c.overflow > 0 {
            return Err(Error::Internal {
                site: "scheduler::device_step::end_device_step".into(),
                message: format!(
                    "the device resolver ran out of granted slots ({} cells): the grant is \
                     sized to every cell of the step",
                    c.overflow
                ),
            });
        }
        Ok(())
    }

    /// Pins the device path holds: the victims granted.
    pub(crate) fn device_pins(&self) -> u64 {
        self.tier.device.as_ref().map_or(0, |l| {
            l.grant
                .iter()
                .filter(|(_, h)| matches!(h, Held::Victim(..)))
                .count() as u64
        })
    }

    /// The objects the standing grant holds as victims.
    pub(crate) fn granted_victims(&self) -> rustc_hash::FxHashSet<u32> {
        self.tier
            .device
            .as_ref()
            .map_or_else(Default::default, |l| {
                l.grant
                    .iter()
                    .filter_map(|&(_, h)| match h {
                        Held::Victim(_, idx) => Some(idx),
                        _ => None,
                    })
                    .collect()
            })
    }

    /// The object key of mirror entry `e`.
    pub(super) fn key_of(&self, e: usize, layers: usize) -> ObjectKey {
        let (h, l) = ((e / layers) as u32, (e % layers) as u16);
        self.tier.key_at(h, l)
    }

    /// Device-resolve counters (zero when no resolver is enabled).
    pub fn device_totals(&self) -> DeviceTotals {
        let Some(l) = self.tier.device.as_ref() else {
            return DeviceTotals::default();
        };
        let totals = self.dir.totals();
        let layers = self.cfg.layers as usize;
        let pool_live = self
            .resolver_named()
            .into_iter()
            .filter(|&(e, _)| {
                !self
                    .dir
                    .state(&self.key_of(e, layers))
                    .is_some_and(|o| matches!(o.device, DeviceState::Ready { .. }))
            })
            .count() as u64;
        DeviceTotals {
            steps: l.steps,
            fallbacks: l.fallbacks,
            granted: l.grant.len() as u64,
            granted_victims: l
                .grant
                .iter()
                .filter(|(_, h)| matches!(h, Held::Victim(..)))
                .count() as u64,
            pool: l.pool.len() as u64,
            pool_live,
            refills: l.refills,
            adopted: l.adopted,
            second_chances: totals.second_chances,
            grant_second_chances: totals.grant_second_chances,
        }
    }

    /// Whether a device step is granted and not yet reconciled (the copy check's guard).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn device_step_open(&self) -> bool {
        self.tier.device.as_ref().is_some_and(|l| l.open)
    }

    /// The mirror entries the next grant sets again (pages started, homes with a new
    /// generation, objects that gave up their slot): until then the mirror may be stale there.
    fn pending_entries(&self, link: &DeviceLink) -> rustc_hash::FxHashSet<usize> {
        let layers = self.cfg.layers as usize;
        let mut pending: rustc_hash::FxHashSet<usize> = link.adds.iter().copied().collect();
        for &h in &link.bumped {
            pending.extend((0..layers).map(|l| h as usize * layers + l));
        }
        pending.extend(
            self.dir
                .pending_releases()
                .iter()
                .filter(|(k, _)| k.namespace.id >= HOST_NS)
                .map(|(k, _)| self.entry_of(k)),
        );
        pending
    }

    /// (mirror entry, slot) of every object a slot of the resolver's holds and the mirror
    /// names there, changes pending for the next grant left out (checks and stats).
    pub(super) fn resolver_named(&self) -> Vec<(usize, SlotId)> {
        let Some(link) = &self.tier.device else {
            return Vec::new();
        };
        let pending = self.pending_entries(link);
        let st = link.state.lock();
        let in_grant = link.grant.iter().filter_map(|&(s, h)| match h {
            Held::Pool(e) => Some((s, Some(e))),
            _ => None,
        });
        link.pool
            .iter()
            .chain(in_grant)
            .filter_map(|(s, e)| e.map(|e| (e, s)))
            .filter(|&(e, s)| st.mirror()[e] == s.raw() as i32 && !pending.contains(&e))
            .collect()
    }

    /// Checks the mirror against the directory (see the module docs).
    pub(crate) fn validate_device(&self) -> std::result::Result<(), String> {
        let Some(link) = &self.tier.device else {
            return Ok(());
        };
        let mut st = link.state.lock();
        if st.is_open() {
            return Ok(()); // mid-step: filled entries are not adopted yet
        }
        // The device's mirror is the host's, as the log told it (the kernel's).
        if let Some(m) = st.device_mirror_mismatch() {
            return Err(m);
        }
        let layers = self.cfg.layers as usize;
        let pending = self.pending_entries(link);
        // The resolver's slots: the pool's and the grant's free and pool entries, each once,
        // and every one of them granted by the directory (held by no object); the grant's
        // victims are held objects Ready at their slots, none of them the resolver's.
        let mut owned: rustc_hash::FxHashMap<i32, Option<usize>> = Default::default();
        let grant_owned = link.grant.iter().filter_map(|&(s, h)| match h {
            Held::Free => Some((s, None)),
            Held::Pool(e) => Some((s, Some(e))),
            Held::Victim(..) => None,
        });
        for (s, e) in link.pool.iter().chain(grant_owned) {
            if owned.insert(s.raw() as i32, e).is_some() {
                return Err(format!("the resolver holds slot {s} twice"));
            }
        }
        // (A victim is checked by its object, not its home's key: the home may have a new
        // generation since, the victim staying pinned where it is until taken or given back.)
        for (s, held) in &link.grant {
            if let Held::Victim(_, idx) = *held {
                if !self.dir.is_held_at(idx, *s) || owned.contains_key(&(s.raw() as i32)) {
                    return Err(format!("victim {idx} is not an object held at slot {s}"));
                }
            }
        }
        if let Some(s) = owned
            .keys()
            .find(|&&s| !self.dir.is_granted(SlotId::new(s as u32)))
        {
            return Err(format!("the resolver holds slot {s}, which is not granted"));
        }
        if owned.len() != self.dir.granted() {
            return Err(format!(
                "the resolver holds {} slots, the directory granted {}",
                owned.len(),
                self.dir.granted()
            ));
        }
        for (e, &slot) in st.mirror().iter().enumerate() {
            if slot < 0 || pending.contains(&e) {
                continue;
            }
            if owned.get(&slot) == Some(&Some(e)) {
                continue; // in a slot of the resolver's, which it copied there
            }
            let key = self.key_of(e, layers);
            let ok = self.dir.state(&key).is_some_and(|o| {
                o.device
                    == DeviceState::Ready {
                        slot: SlotId::new(slot as u32),
                    }
            });
            if !ok {
                return Err(format!(
                    "mirror names slot {slot} for {key}, which is not there"
                ));
            }
        }
        for r in self.requests.values() {
            for page in 0..r.pages(self.cfg.page_size) {
                for l in 0..self.cfg.layers {
                    let key = r.key(page, l);
                    let Some(o) = self.dir.state(&key) else {
                        continue;
                    };
                    // Every object of a running request on the device is in the mirror (or
                    // enters it at the next grant): one the host loaded too, or the device
                    // would copy it in again; one not written to host yet above all.
                    if let DeviceState::Ready { slot } = o.device {
                        let e = self.entry_of(&key);
                        let named = pending.contains(&e) || st.mirror()[e] == slot.raw() as i32;
                        if !named {
                            return Err(format!(
                                "{key} is on the device and the mirror does not name it"
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
