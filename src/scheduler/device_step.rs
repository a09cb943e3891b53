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
//! cannot move them, still readable and still in the mirror). It holds at least one entry per
//! cell a layer can miss (`cells`: per row, its entries or its pages if fewer; the slots
//! earlier layers filled are filled again once the grant is spent), so a step never runs out;
//! when the device cannot give that many, `begin_device_step` says so and the step plans on
//! the host.
//! What a step did not take stays granted.
//!
//! # Reconcile (at `end_step`)
//! For each entry the step took: a victim is evicted (`take_victim`); the object copied in is
//! adopted at the slot (`adopt`), or, when it came to the device another way meanwhile, the
//! slot is given back and the mirror names where it is. Victims the step read are given back
//! to the LRU (they are hot).
//!
//! # Recency
//! The core's LRU does not see the device's hits. So victims are chosen by second chance: a
//! least recently used object the last device step read (the resolver's read marks) goes back
//! to the LRU's end instead, as its hit would have put it. Nothing the device reads is pinned
//! between steps: what the host evicts then is logged and leaves the mirror at the next grant,
//! and on a GPU the host's copies are stream-ordered after the device's reads.
//!
//! # Invariants (`validate`)
//! Every mirror entry names a device-Ready object of the directory at that slot (or a slot
//! granted and filled this step); every object of a running request on the device is in the
//! mirror (the host's loads enter it too: `Tier::count_loads`); the grant's slots are the
//! directory's granted slots and victims.

use super::core::{StepScheduler, NONE};
use super::prefix::HOST_NS;
use super::record::StepRecord;
use super::resolver::{ResolverState, ABSENT};
use super::tier::Tier;
use super::PrefixTier;
use crate::directory::{DeviceState, LayerGroup, ObjectHint, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{RequestId, SlotId};
use parking_lot::Mutex;
use std::sync::Arc;

/// A grant entry: its slot, and its victim's (mirror entry, object index) when not free.
type Entry = (SlotId, Option<(usize, u32)>);

/// The link between a joined scheduler and its device resolver.
pub(crate) struct DeviceLink {
    pub(crate) state: Arc<Mutex<ResolverState>>,
    /// Mirror entries to set at the next grant: pages that started on the device.
    pub(crate) adds: Vec<usize>,
    /// Host pages that got a new generation: their entries name another page's objects now.
    pub(crate) bumped: Vec<u32>,
    grant: Vec<Entry>,
    open: bool,
    /// Device steps run, steps that planned on the host for want of a grant, and slots
    /// filled twice in a step.
    steps: u64,
    fallbacks: u64,
    refills: u64,
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
    /// Slots a step filled again after an earlier layer of it had filled them.
    pub refills: u64,
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
            // addressing (never run on a GPU yet).
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
        // Every device-Ready object of a running request enters the mirror now; from here on
        // the directory logs what leaves the device and start_pages what enters.
        self.dir.log_releases(true);
        let mut adds = Vec::new();
        for r in self.requests.values() {
            for page in 0..r.pages(self.cfg.page_size) {
                for l in 0..self.cfg.layers {
                    let key = r.key(page, l);
                    if self
                        .dir
                        .state(&key)
                        .is_some_and(|o| matches!(o.device, DeviceState::Ready { .. }))
                    {
                        adds.push(self.entry_of(&key));
                    }
                }
            }
        }
        self.tier.device = Some(DeviceLink {
            state: state.clone(),
            adds,
            bumped: Vec::new(),
            grant: Vec::new(),
            open: false,
            steps: 0,
            fallbacks: 0,
            refills: 0,
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
    fn entry_of(&self, key: &ObjectKey) -> usize {
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
        let ok = self.top_up(cells, want, &mut st)?;
        let link = self.tier.device.as_mut().expect("checked above");
        if !ok {
            link.fallbacks += 1;
            return Ok(false);
        }
        let grant = link
            .grant
            .iter()
            .map(|&(s, v)| (s.raw() as i32, v.map_or(-1, |(e, _)| e as i64)))
            .collect();
        // The step's stream, once the step is granted (the last one's back if it cannot open).
        let before = st.stream();
        if let Some(s) = stream {
            st.set_stream(s);
        }
        // Armed load failures (test builds) fail the resolver's copies this step.
        if let Err(e) = st.open((rids, entries), grant, self.xfer.take_copy_faults(), cells) {
            st.set_stream(before);
            return Err(e);
        }
        link.open = true;
        link.steps += 1;
        Ok(true)
    }

    /// Applies to the mirror what changed on the device since the last call (objects that
    /// gave up their slot, pages that started): each entry touched is set to where the
    /// directory has its object now, whatever the order the changes came in.
    fn sync_mirror(&mut self, st: &mut ResolverState) -> Result<()> {
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
        for e in changed {
            let now = match self.dir.state(&self.key_of(e, layers)).map(|o| o.device) {
                Some(DeviceState::Ready { slot }) => slot.raw() as i32,
                _ => ABSENT,
            };
            st.set(e, now);
        }
        Ok(())
    }

    /// Tops the grant up to `want` entries (at least `cells`): free slots, then victims.
    /// Returns whether it has `cells` (when not, what it took stays granted).
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
            fresh.extend(self.dir.grant_slots(take)?.into_iter().map(|s| (s, None)));
            need -= take;
        }
        if need > 0 {
            // Second chance: an object the last device step read goes back to the LRU's end.
            let layers = self.cfg.layers as usize;
            let entry = |key: &ObjectKey| {
                let LayerGroup::Layer(l) = key.layers else {
                    return None;
                };
                (key.namespace.id >= HOST_NS)
                    .then(|| (key.namespace.id - HOST_NS) as usize * layers + l as usize)
            };
            let victims = self
                .dir
                .grant_victims(need, |key| entry(key).is_some_and(|e| st.was_read(e)));
            for (idx, key, slot) in victims {
                fresh.push((slot, Some((self.entry_of(&key), idx))));
            }
        }
        // A victim the mirror does not name yet (it came to the device another way) enters
        // it: a cell that selects it hits, so a layer passes over at most as many victims as
        // it hits, and no object is copied in twice.
        for &(slot, v) in &fresh {
            if let Some((e, _)) = v {
                st.set(e, slot.raw() as i32);
            }
        }
        let link = self.tier.device.as_mut().expect("checked by the caller");
        link.grant.extend(fresh);
        Ok(link.grant.len() >= cells)
    }

    /// Reconciles the open device step from the device's log (see the module docs); folds its
    /// counts into the step record. Nothing to do when no device step is open.
    pub(crate) fn end_device_step(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        if !link.open {
            return Ok(());
        }
        link.open = false;
        let state = link.state.clone();
        let mut done = state.lock().close()?;
        let grant = std::mem::take(&mut link.grant);
        self.xfer
            .restore_copy_faults(std::mem::take(&mut done.faults));
        let mut taken = vec![false; done.used];
        for en in &done.log {
            taken[en.g as usize] = true;
        }
        // Victims first: the device evicted those it took; those it passed over it read, so
        // they go back to the LRU as the most recently used.
        let mut evicted = Vec::new();
        let mut back = Vec::new();
        for (g, &(slot, victim)) in grant[..done.used].iter().enumerate() {
            match (victim, taken[g]) {
                (Some((_, idx)), true) => evicted.push((idx, slot)),
                (Some((_, idx)), false) => back.push(idx),
                (None, _) => {}
            }
        }
        self.dir.take_victims(&evicted)?;
        self.dir.unhold(&back)?;
        // The objects the device copied in: adopted at their slots, or (already on the device
        // another way) their slots given back and the mirror pointed where they are.
        let layers = self.cfg.layers as usize;
        // A slot filled more than once this step holds its last object.
        let mut owner_seen = vec![false; done.used];
        let mut owners: Vec<&super::resolver::LogEntry> = Vec::with_capacity(done.log.len());
        for en in done.log.iter().rev() {
            if !std::mem::replace(&mut owner_seen[en.g as usize], true) {
                owners.push(en);
            }
        }
        // A slot whose last copy failed holds nothing: it goes back free.
        let mut spare: Vec<SlotId> = Vec::new();
        owners.retain(|en| {
            if en.failed {
                spare.push(grant[en.g as usize].0);
            }
            !en.failed
        });
        // Each with its object's index from the request's hints (no key lookup).
        let keys: Vec<(ObjectKey, ObjectHint, SlotId)> = owners
            .iter()
            .map(|en| {
                // The hint of the request's page, if it still names that home.
                let h = (en.e as usize / layers) as u32;
                let hint = self
                    .requests
                    .get(&en.rid)
                    .filter(|r| {
                        r.homes
                            .get(en.page as usize)
                            .is_some_and(|&(hh, _)| hh == h)
                    })
                    .map_or(ObjectHint::NONE, |r| {
                        r.hint(en.page, (en.e as usize % layers) as u16)
                    });
                (
                    self.key_of(en.e as usize, layers),
                    hint,
                    grant[en.g as usize].0,
                )
            })
            .collect();
        let adopted = self.dir.adopt(&keys)?;
        {
            let mut st = state.lock();
            for ((key, _, slot), ok) in keys.iter().zip(&adopted) {
                if !ok {
                    spare.push(*slot);
                    let e = self.entry_of(key);
                    let now = match self.dir.state(key).map(|o| o.device) {
                        Some(DeviceState::Ready { slot }) => slot.raw() as i32,
                        _ => ABSENT,
                    };
                    st.set(e, now);
                }
            }
        }
        self.dir.return_slots(&spare)?;
        // What the step did not reach stays granted.
        let link = self.tier.device.as_mut().expect("checked above");
        link.grant = grant[done.used..].to_vec();

        // Matched prefix pages loaded, as the host path counts them (per layer: the log's
        // entries of one layer together).
        let mut by_layer: Vec<(Vec<bool>, Vec<u32>, Vec<RequestId>)> =
            vec![Default::default(); layers];
        for &super::resolver::LogEntry {
            e,
            rid,
            page,
            failed,
            ..
        } in &done.log
        {
            if failed {
                continue;
            }
            let l = e as usize % layers;
            let matched = self.requests.get(&rid).is_some_and(|r| page < r.matched);
            by_layer[l].0.push(true);
            by_layer[l].1.push(if matched { page } else { NONE });
            by_layer[l].2.push(rid);
        }
        for (l, (loaded, pages, rids)) in by_layer.iter().enumerate() {
            if !loaded.is_empty() {
                // (The device's own loads: its mirror has them.)
                <PrefixTier as Tier>::count_loads(self, l as u16, &[], loaded, pages, rids);
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

    /// Gives back the grant between steps (no step open): victims to the LRU and free slots
    /// to the free list. The host needs the room (`make_room`), or the run is ending (`drain`).
    /// The mirror stays true: what the host then evicts is logged and cleared at the next
    /// grant.
    pub(crate) fn release_device(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        let grant = if link.open {
            Vec::new()
        } else {
            std::mem::take(&mut link.grant)
        };
        let victims: Vec<u32> = grant
            .iter()
            .filter_map(|(_, v)| v.map(|(_, i)| i))
            .collect();
        let free: Vec<SlotId> = grant
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(s, _)| *s)
            .collect();
        self.dir.unhold(&victims)?;
        self.dir.return_slots(&free)
    }

    /// Pins the device path holds: the victims granted.
    pub(crate) fn device_pins(&self) -> u64 {
        self.tier.device.as_ref().map_or(0, |l| {
            l.grant.iter().filter(|(_, v)| v.is_some()).count() as u64
        })
    }

    /// The object key of mirror entry `e`.
    fn key_of(&self, e: usize, layers: usize) -> ObjectKey {
        let (h, l) = ((e / layers) as u32, (e % layers) as u16);
        self.tier.key_at(h, l)
    }

    /// Device-resolve counters (zero when no resolver is enabled).
    pub fn device_totals(&self) -> DeviceTotals {
        self.tier
            .device
            .as_ref()
            .map_or_else(DeviceTotals::default, |l| DeviceTotals {
                steps: l.steps,
                fallbacks: l.fallbacks,
                granted: l.grant.len() as u64,
                refills: l.refills,
            })
    }

    /// Whether a device step is granted and not yet reconciled (the copy check's guard).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn device_step_open(&self) -> bool {
        self.tier.device.as_ref().is_some_and(|l| l.open)
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
        // What the next grant applies: pages started, and slots given up.
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
        for (e, &slot) in st.mirror().iter().enumerate() {
            if slot < 0 || pending.contains(&e) {
                continue;
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
