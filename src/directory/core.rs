//! The residency state machine, single-threaded. [`super::Directory`] wraps it in a mutex.
//!
//! Every transition is one function here and checks its from-state; every side effect on
//! slots (allocate, free, quarantine) has one call site: [`Core::take_device_slot`],
//! [`Core::reap`], [`Core::quarantine_or_free`] and [`Core::transfer_ended`].
//!
//! # Invariants (checked by [`Core::validate`] after every step of the state-machine tests)
//! - page conservation on both tiers: free + held by objects + quarantined = capacity;
//! - no slot is held by two objects, and no quarantined slot is held by an object;
//! - an object is in the LRU list iff it is evictable (Ready, unpinned, host Ready, live), so a
//!   pinned object is never evicted;
//! - a Loading object has exactly one in-flight load transfer, which lists it;
//! - pin counts equal the number of live pin handles that hold the object;
//! - a home (a host slot owned outside the directory) holds at most one live object; a dropped
//!   object may linger at a reused home until its pins and reads end, but never writes it.

use super::arena::Arena;
use super::key::{Namespace, ObjectKey};
use super::lru::Lru;
use super::metrics::{ResolveMetrics, Totals};
use super::state::{DeviceState, HostState, Identity, Object, ObjectHint};
use super::transfer::{BackupPlan, LoadPlan, Transfer, TransferKind, TransferList, TransferState};
use crate::alloc::PageAllocator;
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, PinHandleId, SlotId, TransferId};
use rustc_hash::{FxHashMap, FxHashSet};
use std::time::Instant;

/// Sizes of a directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectoryConfig {
    /// Device slots, reserve included.
    pub device_pages: u32,
    /// Device slots never handed out.
    pub device_reserve: u32,
    /// Host slots, reserve included.
    pub host_pages: u32,
    /// Host slots never handed out.
    pub host_reserve: u32,
    /// Bytes of one object (one page of the pool(s) it covers), for the metrics.
    pub object_bytes: u64,
}

/// What `resolve` returns.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The device slot of every key, in the order given (repeats included).
    pub slots: Vec<SlotId>,
    /// New loads, grouped into one transfer per batch (empty when nothing loads).
    pub loads: Vec<LoadPlan>,
    /// In-flight transfers this batch joined.
    pub joined: TransferList,
    /// The receipt `release` consumes.
    pub handle: PinHandleId,
    /// This batch's record.
    pub metrics: ResolveMetrics,
    /// Per key: whether this batch's load brings it (its first occurrence; repeats are false).
    pub loaded: Vec<bool>,
    /// Per key: the object's index (for [`Core::hold`]); empty for a prefetch.
    pub indices: Vec<u32>,
}

/// Counts of a directory at one moment, with cumulative totals.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DirectoryStats {
    /// Live objects (dropped ones still pinned or in flight included).
    pub objects: usize,
    /// Objects device Absent.
    pub device_absent: usize,
    /// Objects device Loading.
    pub device_loading: usize,
    /// Objects device Ready.
    pub device_ready: usize,
    /// Objects with no host copy.
    pub host_none: usize,
    /// Objects whose backup is in flight.
    pub host_writing: usize,
    /// Objects with a ready host copy.
    pub host_ready: usize,
    /// Objects with at least one pin.
    pub pinned_objects: usize,
    /// Sum of pin counts.
    pub pins: u64,
    /// Objects eviction could take now.
    pub evictable: usize,
    /// Usable device slots.
    pub device_capacity: usize,
    /// Free device slots.
    pub device_free: usize,
    /// Device slots held by objects.
    pub device_used: usize,
    /// Device slots held by failed transfers that may still write them.
    pub device_quarantined: usize,
    /// Usable host slots.
    pub host_capacity: usize,
    /// Free host slots.
    pub host_free: usize,
    /// Host slots held by objects.
    pub host_used: usize,
    /// Host slots held by failed backups that may still write them.
    pub host_quarantined: usize,
    /// Transfers in flight.
    pub transfers_in_flight: usize,
    /// Pin handles not yet released.
    pub handles: usize,
    /// Cumulative counters.
    pub totals: Totals,
}

#[derive(Debug, Clone, Copy)]
enum Class {
    Ready,
    Join(TransferId),
    Load,
    Repeat,
}

#[derive(Debug)]
struct Handle {
    objects: Vec<usize>,
    transfers: TransferList,
    own_load: Option<TransferId>,
    metrics: ResolveMetrics,
}

#[derive(Debug, Default)]
struct Quarantine {
    device: Vec<SlotId>,
    host: Vec<HostSlotId>,
}

/// The residency directory's state and transitions.
#[derive(Debug)]
pub struct Core {
    /// Objects' states, their identities in the column.
    objects: Arena<Object, Identity>,
    index: FxHashMap<ObjectKey, usize>,
    namespaces: FxHashMap<Namespace, Vec<usize>>,
    dropped: FxHashSet<Namespace>,
    /// `dropped` in drop order: the oldest are forgotten past [`DROPPED_REMEMBERED`].
    dropped_order: std::collections::VecDeque<Namespace>,
    /// Dropped namespaces whose objects are not all removed yet: how many remain.
    lingering: FxHashMap<Namespace, usize>,
    device: PageAllocator,
    host: PageAllocator,
    lru: Lru,
    transfers: FxHashMap<TransferId, Transfer>,
    handles: FxHashMap<PinHandleId, Handle>,
    quarantine: FxHashMap<TransferId, Quarantine>,
    quarantined_device: usize,
    quarantined_host: usize,
    clock: u64,
    /// The last batch's number (resolve or backup); objects it saw carry it.
    epoch: u32,
    object_bytes: u64,
    totals: Totals,
    t0: Instant,
    scratch: Vec<(usize, Class)>,
    idx_scratch: Vec<usize>,
}

/// How many dropped namespaces the directory remembers (so that a late key of one is
/// `NamespaceDropped`, not `NotResident`, and cannot be recreated by mistake). Older ones are
/// forgotten, unless objects of theirs still linger: memory stays bounded however many
/// requests a process serves.
pub const DROPPED_REMEMBERED: usize = 1 << 16;

/// How many keys ahead `resolve` prefetches objects.
const PREFETCH_AHEAD: usize = 16;

impl Core {
    /// An empty directory.
    pub fn new(cfg: DirectoryConfig) -> Result<Self> {
        let device = PageAllocator::new(cfg.device_pages, cfg.device_reserve)
            .map_err(|e| rename(e, "device_pages", "device_reserve"))?;
        let host = PageAllocator::new(cfg.host_pages, cfg.host_reserve)
            .map_err(|e| rename(e, "host_pages", "host_reserve"))?;
        if cfg.object_bytes == 0 {
            return Err(Error::config("object_bytes", 0, "an integer >= 1"));
        }
        Ok(Core {
            // Room for an object per slot of either tier (homed objects keep their host copy
            // outside this directory, so the room is a hint: past it the arena grows).
            objects: Arena::with_capacity(cfg.device_pages as usize + cfg.host_pages as usize),
            index: FxHashMap::default(),
            namespaces: FxHashMap::default(),
            dropped: FxHashSet::default(),
            dropped_order: Default::default(),
            lingering: FxHashMap::default(),
            device,
            host,
            lru: Lru::new(),
            transfers: FxHashMap::default(),
            handles: FxHashMap::default(),
            quarantine: FxHashMap::default(),
            quarantined_device: 0,
            quarantined_host: 0,
            clock: 0,
            epoch: 0,
            object_bytes: cfg.object_bytes,
            totals: Totals::default(),
            t0: Instant::now(),
            scratch: Vec::new(),
            idx_scratch: Vec::new(),
        })
    }

    /// A new batch number. Once they run out (2^32 batches) every object's is cleared and
    /// numbering starts again, so that no object can carry a current number it was not given.
    fn next_epoch(&mut self) -> u32 {
        if self.epoch == u32::MAX {
            self.objects.values_mut().for_each(|o| o.epoch = 0);
            self.epoch = 0;
        }
        self.epoch += 1;
        self.epoch
    }

    /// Sets the last batch number, as if that many batches had run (tests of the wrap).
    #[cfg(test)]
    pub(crate) fn set_epoch(&mut self, epoch: u32) {
        self.epoch = epoch;
    }

    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn new_transfer(&mut self, kind: TransferKind) -> TransferId {
        let id = TransferId::new(crate::ids::serial());
        self.transfers.insert(
            id,
            Transfer {
                kind,
                objects: Vec::new(),
                state: TransferState::InFlight,
                refs: 0,
                submitted_ns: None,
                finished_ns: None,
            },
        );
        id
    }

    /// The object index of a live key, or why there is none.
    fn lookup(&self, key: &ObjectKey) -> Result<usize> {
        match self.index.get(key) {
            Some(&idx) => Ok(idx),
            None if self.dropped.contains(&key.namespace) => Err(Error::NamespaceDropped {
                namespace: key.namespace.to_string(),
            }),
            None => Err(Error::NotResident {
                key: key.to_string(),
            }),
        }
    }

    /// Slots free plus slots eviction could free, leaving out `keep` evictable batch members.
    fn device_available(&self, keep: usize) -> (usize, usize) {
        (self.device.free_count(), self.lru.len() - keep)
    }

    /// A device slot from the free list, or from the LRU object (which becomes Absent).
    /// Callers have checked that one exists.
    fn take_device_slot(&mut self) -> SlotId {
        if let Some(p) = self.device.alloc_one() {
            return SlotId::of_page(p);
        }
        // Evictions come in runs (one per load of a batch): fetch the victims ahead.
        let objects = &mut self.objects;
        let victim = self
            .lru
            .pop_front_ahead(PREFETCH_AHEAD, |i, seq, ahead| {
                if let Some(a) = ahead {
                    objects.prefetch(a);
                }
                take_lru_entry(objects, i, seq)
            })
            .expect("caller checked free + evictable >= needed");
        let obj = &mut self.objects[victim];
        let DeviceState::Ready { slot } = obj.device else {
            unreachable!("LRU list holds only device-Ready objects")
        };
        obj.device = DeviceState::Absent;
        self.totals.evictions += 1;
        slot
    }

    /// Creates objects for `keys`, each device-Ready in a fresh slot with no host copy.
    pub fn allocate(&mut self, keys: &[ObjectKey]) -> Result<Vec<SlotId>> {
        self.allocate_at(keys, None)
    }

    /// As [`Self::allocate`], each object's host copy to be written at its home
    /// (`homes[i]`, owned by the caller: see [`Object::home`]).
    pub fn allocate_homed(
        &mut self,
        keys: &[ObjectKey],
        homes: &[HostSlotId],
    ) -> Result<Vec<SlotId>> {
        same_len(keys, homes)?;
        self.allocate_at(keys, Some(homes))
    }

    fn check_new(&self, keys: &[ObjectKey]) -> Result<()> {
        non_empty(keys)?;
        let mut seen = FxHashSet::default();
        for key in keys {
            if self.dropped.contains(&key.namespace) {
                return Err(Error::NamespaceDropped {
                    namespace: key.namespace.to_string(),
                });
            }
            if self.index.contains_key(key) || !seen.insert(*key) {
                return Err(Error::KeyExists {
                    key: key.to_string(),
                });
            }
        }
        Ok(())
    }

    fn allocate_at(
        &mut self,
        keys: &[ObjectKey],
        homes: Option<&[HostSlotId]>,
    ) -> Result<Vec<SlotId>> {
        self.check_new(keys)?;
        let (free, evictable) = self.device_available(0);
        if keys.len() > free + evictable {
            return Err(Error::OutOfSlots {
                tier: "device",
                requested: keys.len(),
                free,
                evictable,
            });
        }
        let mut slots = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            let slot = self.take_device_slot();
            let home = homes.map(|h| h[i]);
            self.insert_object(*key, DeviceState::Ready { slot }, HostState::None, home);
            slots.push(slot);
        }
        Ok(slots)
    }

    /// Registers objects whose only copy is already at their home on host (a prefix's KV
    /// pages, written through by an earlier request): device Absent, host Ready, loaded when
    /// selected. Keys already live are skipped when their home agrees (a prefix several
    /// requests share). Returns the objects it created: (key, home) each.
    pub fn register_host(
        &mut self,
        keys: &[ObjectKey],
        homes: &[HostSlotId],
    ) -> Result<Vec<(ObjectKey, HostSlotId)>> {
        same_len(keys, homes)?;
        let mut fresh = Vec::new();
        for (key, &home) in keys.iter().zip(homes) {
            match self.index.get(key) {
                Some(&idx) if self.objects.side_of(idx).home == Some(home) => {}
                Some(_) => {
                    return Err(Error::KeyExists {
                        key: format!("{key} with another home than host slot {home}"),
                    })
                }
                None => fresh.push((*key, home)),
            }
        }
        let keys_new: Vec<ObjectKey> = fresh.iter().map(|&(k, _)| k).collect();
        if keys_new.is_empty() {
            return Ok(fresh);
        }
        self.check_new(&keys_new)?;
        for &(key, home) in &fresh {
            let idx = self.insert_object(
                key,
                DeviceState::Absent,
                HostState::Ready { slot: home },
                Some(home),
            );
            self.settle(idx);
        }
        Ok(fresh)
    }

    fn insert_object(
        &mut self,
        key: ObjectKey,
        device: DeviceState,
        host: HostState,
        home: Option<HostSlotId>,
    ) -> usize {
        let stamp = self.tick();
        let idx = self
            .objects
            .insert(Identity { key, home }, |generation| Object {
                device,
                host,
                pins: 0,
                stamp,
                epoch: 0,
                generation,
                dropped: false,
                load_failed: false,
                lru_mark: 0,
                held: 0,
            });
        self.index.insert(key, idx);
        self.namespaces.entry(key.namespace).or_default().push(idx);
        idx
    }

    /// Resolves a batch: pins Ready objects, starts loads for Absent objects with a Ready host
    /// copy, joins Loading ones. All or nothing. `bytes_needed` overrides the default
    /// (distinct objects x object bytes) when the consumer needs less than whole objects.
    pub fn resolve(&mut self, keys: &[ObjectKey], bytes_needed: Option<u64>) -> Result<Resolved> {
        self.resolve_hinted(keys, None, bytes_needed)
    }

    /// [`Self::resolve`] with `hints[i]`, where known, where `keys[i]`'s object is (from
    /// [`Self::index_of`]): it saves the hash probe. A hint is checked against its slot's
    /// generation, so a stale one falls back to the index map instead of aliasing the object
    /// that reused the slot. It is not checked against the key (that read a second cache line
    /// per key; debug builds assert it): `hints[i]` must have been taken for `keys[i]`, or it
    /// names another key's object.
    pub fn resolve_hinted(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
        bytes_needed: Option<u64>,
    ) -> Result<Resolved> {
        self.resolve_inner(keys, hints, bytes_needed, true)
    }

    /// A prefetch: starts loads for the keys that are Absent with a Ready host copy, pinning
    /// only those (until the handle is released); keys already Ready or Loading are left as
    /// they are, neither pinned nor joined, so a prefetch costs one object read per present
    /// key. `slots` is empty (the loads carry their slots; `loaded` says which keys load).
    /// Keys with no copy anywhere are `NotResident`, as in `resolve`.
    pub fn prefetch_loads(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
    ) -> Result<Resolved> {
        self.resolve_inner(keys, hints, None, false)
    }

    fn resolve_inner(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
        bytes_needed: Option<u64>,
        pin_present: bool,
    ) -> Result<Resolved> {
        non_empty(keys)?;
        let epoch = self.next_epoch();
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let staged = self.stage_resolve(keys, hints, epoch, &mut scratch);
        let result = staged.and_then(|(loads, keep)| {
            let (free, evictable) = self.device_available(keep);
            if loads > free + evictable {
                return Err(Error::OutOfSlots {
                    tier: "device",
                    requested: loads,
                    free,
                    evictable,
                });
            }
            Ok(self.commit_resolve(keys.len(), &scratch, loads, bytes_needed, pin_present))
        });
        self.scratch = scratch;
        result
    }

    /// Classifies every key; changes nothing but the objects' batch epochs.
    fn stage_resolve(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
        epoch: u32,
        scratch: &mut Vec<(usize, Class)>,
    ) -> Result<(usize, usize)> {
        let mut loads = 0;
        let mut keep = 0;
        // Two passes: every key's index first (independent hash probes overlap), then the
        // objects, each prefetched a few keys ahead. In a directory of millions of objects
        // each object is a cache miss; issued one after another behind a data-dependent
        // branch they would not overlap.
        let mut idxs = std::mem::take(&mut self.idx_scratch);
        idxs.clear();
        if let Some(h) = hints {
            for &i in h {
                self.objects.prefetch(i.index() as usize);
            }
        }
        for (n, key) in keys.iter().enumerate() {
            if let Some(&h) = hints.and_then(|h| h.get(n)) {
                let i = h.index() as usize;
                // The generation proves the hint still names the object it was taken for,
                // from the state line alone (the key would be a second line).
                if self
                    .objects
                    .get_versioned(i, h.generation())
                    .is_some_and(|o| !o.dropped)
                {
                    debug_assert_eq!(self.objects.side_of(i).key, *key, "a hint of another key");
                    idxs.push(i);
                    continue;
                }
            }
            match self.lookup(key) {
                Ok(i) => idxs.push(i),
                Err(e) => {
                    self.idx_scratch = idxs;
                    return Err(e);
                }
            }
        }
        for &i in idxs.iter().take(PREFETCH_AHEAD) {
            self.prefetch_object(i);
        }
        for (n, key) in keys.iter().enumerate() {
            if let Some(&ahead) = idxs.get(n + PREFETCH_AHEAD) {
                self.prefetch_object(ahead);
            }
            let idx = idxs[n];
            let obj = &mut self.objects[idx];
            if obj.epoch == epoch {
                scratch.push((idx, Class::Repeat));
                continue;
            }
            obj.epoch = epoch;
            let class = match obj.device {
                DeviceState::Ready { .. } => {
                    keep += usize::from(obj.evictable());
                    Class::Ready
                }
                DeviceState::Loading { transfer, .. } => Class::Join(transfer),
                DeviceState::Absent => match obj.host {
                    HostState::Ready { .. } => {
                        loads += 1;
                        Class::Load
                    }
                    _ => {
                        self.idx_scratch = idxs;
                        return Err(Error::NotResident {
                            key: key.to_string(),
                        });
                    }
                },
            };
            scratch.push((idx, class));
        }
        self.idx_scratch = idxs;
        Ok((loads, keep))
    }

    /// Where each live key's object is ([`ObjectHint::NONE`] where none): hints for
    /// [`Self::resolve_hinted`].
    pub fn index_of(&self, keys: &[ObjectKey]) -> Vec<ObjectHint> {
        keys.iter()
            .map(|k| {
                self.index.get(k).map_or(ObjectHint::NONE, |&i| {
                    ObjectHint::new(i as u32, self.objects[i].generation)
                })
            })
            .collect()
    }

    /// Hints the CPU to fetch object `idx`'s state, one cache line (a hint: any index is
    /// harmless).
    #[inline]
    fn prefetch_object(&self, idx: usize) {
        self.objects.prefetch(idx);
    }

    fn commit_resolve(
        &mut self,
        selected: usize,
        scratch: &[(usize, Class)],
        loads: usize,
        bytes_needed: Option<u64>,
        pin_present: bool,
    ) -> Resolved {
        let mut m = ResolveMetrics {
            selected: selected as u64,
            resolved_ns: self.now_ns(),
            ..Default::default()
        };
        let mut objects = Vec::with_capacity(scratch.len());
        let mut joined = TransferList::new();
        // Pass 1: pin what is on the device, so eviction in pass 2 cannot take it.
        for &(idx, class) in scratch {
            match class {
                Class::Ready | Class::Join(_) if !pin_present => {}
                Class::Ready | Class::Join(_) => {
                    let stamp = self.tick();
                    let obj = &mut self.objects[idx];
                    self.lru.remove(&mut obj.lru_mark);
                    obj.pins += 1;
                    obj.stamp = stamp;
                    objects.push(idx);
                    if let Class::Join(t) = class {
                        m.loading += 1;
                        if !joined.contains(&t) {
                            joined.push(t);
                        }
                    } else {
                        m.ready += 1;
                    }
                }
                Class::Load | Class::Repeat => {}
            }
        }
        // Pass 2: one transfer for every new load of the batch.
        let mut plan = None;
        if loads > 0 {
            let tid = self.new_transfer(TransferKind::Load);
            let mut lp = LoadPlan {
                transfer: tid,
                host_slots: Vec::with_capacity(loads),
                device_slots: Vec::with_capacity(loads),
            };
            let mut moved = Vec::with_capacity(loads);
            for &(idx, class) in scratch {
                if !matches!(class, Class::Load) {
                    continue;
                }
                let slot = self.take_device_slot();
                let stamp = self.tick();
                let obj = &mut self.objects[idx];
                let HostState::Ready { slot: hslot } = obj.host else {
                    unreachable!("staged as Load only with a Ready host copy")
                };
                obj.device = DeviceState::Loading {
                    slot,
                    transfer: tid,
                };
                obj.pins += 1;
                obj.stamp = stamp;
                if std::mem::replace(&mut obj.load_failed, false) {
                    self.totals.retries += 1;
                }
                lp.host_slots.push(hslot);
                lp.device_slots.push(slot);
                moved.push(idx);
                objects.push(idx);
            }
            m.absent = moved.len() as u64;
            self.transfers.get_mut(&tid).expect("just created").objects = moved;
            plan = Some(lp);
        }
        m.inflight_reuse = m.loading;
        m.distinct = objects.len() as u64;
        m.bytes_needed = bytes_needed.unwrap_or(m.distinct * self.object_bytes);
        m.bytes_transferred = m.absent * self.object_bytes;
        // Slots in key order, repeats included. A prefetch pins only its loads (a present key
        // may even have been evicted by them): it returns no slots.
        let slots = if pin_present {
            scratch
                .iter()
                .map(|&(idx, _)| self.objects[idx].device_slot().expect("pinned on device"))
                .collect()
        } else {
            Vec::new()
        };
        let own_load = plan.as_ref().map(|p| p.transfer);
        let mut transfers = joined.clone();
        transfers.extend(own_load);
        for t in &transfers {
            self.transfers.get_mut(t).expect("in flight").refs += 1;
        }
        let handle = PinHandleId::new(crate::ids::serial());
        self.handles.insert(
            handle,
            Handle {
                objects,
                transfers,
                own_load,
                metrics: m,
            },
        );
        self.totals.add(&m);
        let loaded = scratch
            .iter()
            .map(|&(_, c)| matches!(c, Class::Load))
            .collect();
        let indices = if pin_present {
            scratch.iter().map(|&(idx, _)| idx as u32).collect()
        } else {
            Vec::new()
        };
        Resolved {
            slots,
            loads: plan.into_iter().collect(),
            joined,
            handle,
            metrics: m,
            loaded,
            indices,
        }
    }

    /// Records that the engine submitted `id`.
    pub fn mark_submitted(&mut self, id: TransferId) -> Result<()> {
        let now = self.now_ns();
        let t = self.in_flight(id, "mark submitted")?;
        t.submitted_ns.get_or_insert(now);
        Ok(())
    }

    fn in_flight(&mut self, id: TransferId, op: &'static str) -> Result<&mut Transfer> {
        let t = self
            .transfers
            .get_mut(&id)
            .ok_or(Error::UnknownTransfer { id: id.raw() })?;
        if t.state != TransferState::InFlight {
            return Err(Error::TransferState {
                op,
                id: id.raw(),
                state: describe(&t.state),
            });
        }
        Ok(t)
    }

    fn in_flight_of(&mut self, id: TransferId, kind: TransferKind, op: &'static str) -> Result<()> {
        let t = self.in_flight(id, op)?;
        if t.kind != kind {
            return Err(Error::TransferState {
                op,
                id: id.raw(),
                state: format!("a {}", t.kind.name()),
            });
        }
        Ok(())
    }

    /// Loading -> Ready for every object of load `id`; wakes its waiters.
    pub fn complete(&mut self, id: TransferId) -> Result<()> {
        self.in_flight_of(id, TransferKind::Load, "complete")?;
        let objects = std::mem::take(&mut self.transfers.get_mut(&id).expect("checked").objects);
        for &idx in &objects {
            let stamp = self.tick();
            let obj = &mut self.objects[idx];
            let DeviceState::Loading { slot, transfer } = obj.device else {
                unreachable!("a load's objects are Loading until it ends")
            };
            debug_assert_eq!(transfer, id);
            obj.device = DeviceState::Ready { slot };
            obj.stamp = stamp;
            self.settle(idx);
        }
        self.totals.loads_completed += objects.len() as u64;
        self.finish(id, TransferState::Completed);
        Ok(())
    }

    /// Writing -> Ready for every host copy of backup `id`.
    pub fn backup_complete(&mut self, id: TransferId) -> Result<()> {
        self.in_flight_of(id, TransferKind::Backup, "backup_complete")?;
        let objects = std::mem::take(&mut self.transfers.get_mut(&id).expect("checked").objects);
        for &idx in &objects {
            let obj = &mut self.objects[idx];
            let HostState::Writing { slot, transfer } = obj.host else {
                unreachable!("a backup's objects are Writing until it ends")
            };
            debug_assert_eq!(transfer, id);
            obj.host = HostState::Ready { slot };
            self.settle(idx);
        }
        self.totals.backups_completed += objects.len() as u64;
        self.finish(id, TransferState::Completed);
        Ok(())
    }

    /// Loading -> Absent (a load) or Writing -> None (a backup) for every object of `id`.
    /// Their destination slots are quarantined until [`Self::transfer_ended`], or freed now
    /// when `ended` says the transfer can no longer write them.
    pub fn fail(&mut self, id: TransferId, reason: &str, ended: bool) -> Result<()> {
        self.in_flight(id, "fail")?;
        let kind = self.transfers[&id].kind;
        let t = self.transfers.get_mut(&id).expect("checked");
        let objects = std::mem::take(&mut t.objects);
        let mut q = Quarantine::default();
        for &idx in &objects {
            let homed = self.objects.side_of(idx).home.is_some();
            let obj = &mut self.objects[idx];
            match kind {
                TransferKind::Load => {
                    let DeviceState::Loading { slot, .. } = obj.device else {
                        unreachable!("a load's objects are Loading until it ends")
                    };
                    obj.device = DeviceState::Absent;
                    obj.load_failed = true;
                    q.device.push(slot);
                }
                TransferKind::Backup => {
                    let HostState::Writing { slot, .. } = obj.host else {
                        unreachable!("a backup's objects are Writing until it ends")
                    };
                    obj.host = HostState::None;
                    // A home is its owner's to keep: only directory slots wait here.
                    if !homed {
                        q.host.push(slot);
                    }
                }
            }
        }
        self.quarantined_device += q.device.len();
        self.quarantined_host += q.host.len();
        self.quarantine.insert(id, q);
        for &idx in &objects {
            self.settle(idx);
        }
        self.totals.failed_transfers += 1;
        self.finish(id, TransferState::Failed(reason.to_owned()));
        if ended {
            self.transfer_ended(id)?;
        }
        Ok(())
    }

    /// The engine reports that failed transfer `id` can no longer write its destinations:
    /// its quarantined slots return to the free lists, exactly once.
    pub fn transfer_ended(&mut self, id: TransferId) -> Result<()> {
        let Some(q) = self.quarantine.remove(&id) else {
            return Err(match self.transfers.get(&id) {
                Some(t) => Error::TransferState {
                    op: "end",
                    id: id.raw(),
                    state: match t.state {
                        TransferState::Failed(_) => "already ended".to_owned(),
                        ref s => describe(s),
                    },
                },
                None => Error::UnknownTransfer { id: id.raw() },
            });
        };
        self.quarantined_device -= q.device.len();
        self.quarantined_host -= q.host.len();
        let dev: Vec<_> = q.device.iter().map(|s| s.page()).collect();
        let host: Vec<_> = q.host.iter().map(|s| s.page()).collect();
        self.device
            .free(&dev)
            .expect("quarantined device slots are allocated");
        self.host
            .free(&host)
            .expect("quarantined host slots are allocated");
        Ok(())
    }

    /// Tests: see [`Lru::tune`].
    #[cfg(test)]
    pub(super) fn tune_lru(&mut self, slack: isize, step: usize, run: usize) {
        self.lru.tune(slack, step, run)
    }

    /// After a state change: put the object in the LRU list if it became evictable, or remove
    /// it if it was dropped and nothing refers to it any more.
    fn settle(&mut self, idx: usize) {
        let obj = &mut self.objects[idx];
        if obj.evictable() {
            self.lru.push_back(idx, &mut obj.lru_mark);
            let objects = &self.objects;
            self.lru.compact_if_needed(
                |i| objects.get(i).map_or(0, |o| o.lru_mark),
                |i| objects.prefetch(i),
            );
        } else if obj.reapable() {
            self.reap(idx);
        }
    }

    /// Pops the least recently used evictable object.
    fn lru_pop(&mut self) -> Option<usize> {
        let objects = &mut self.objects;
        self.lru.pop_front(|i, seq| take_lru_entry(objects, i, seq))
    }

    /// Removes a dropped object, freeing the slots it holds.
    fn reap(&mut self, idx: usize) {
        self.lru.remove(&mut self.objects[idx].lru_mark);
        let (obj, id) = self.objects.remove(idx);
        if let Some(n) = self.lingering.get_mut(&id.key.namespace) {
            *n -= 1;
            if *n == 0 {
                self.lingering.remove(&id.key.namespace);
            }
        }
        if let DeviceState::Ready { slot } = obj.device {
            self.device
                .free(&[slot.page()])
                .expect("a Ready object's slot is allocated");
        }
        if let (HostState::Ready { slot }, None) = (obj.host, id.home) {
            self.host
                .free(&[slot.page()])
                .expect("a Ready host copy's slot is allocated");
        }
    }

    /// Marks `id` finished. Its object list was taken by the caller: a finished transfer
    /// refers to no object, since those may be removed from now on.
    fn finish(&mut self, id: TransferId, state: TransferState) {
        let now = self.now_ns();
        let t = self
            .transfers
            .get_mut(&id)
            .expect("finishing a known transfer");
        t.state = state;
        t.finished_ns = Some(now);
        if t.refs == 0 {
            self.transfers.remove(&id);
        }
    }

    /// Unpins every object of `handle` and returns its metrics record, completed with the
    /// submitted, ready and consumed times.
    pub fn release(&mut self, handle: PinHandleId) -> Result<ResolveMetrics> {
        let h = self
            .handles
            .remove(&handle)
            .ok_or(Error::UnknownHandle { id: handle.raw() })?;
        let mut m = h.metrics;
        m.consumed_ns = Some(self.now_ns());
        let mut ready = Some(m.resolved_ns);
        for t in &h.transfers {
            let rec = self
                .transfers
                .get_mut(t)
                .expect("referenced transfers are kept");
            if Some(*t) == h.own_load {
                m.submitted_ns = rec.submitted_ns;
            }
            ready = match (&rec.state, ready, rec.finished_ns) {
                (TransferState::Completed, Some(r), Some(f)) => Some(r.max(f)),
                _ => None,
            };
            rec.refs -= 1;
            if rec.refs == 0 && rec.state != TransferState::InFlight {
                self.transfers.remove(t);
            }
        }
        m.ready_ns = ready;
        // By release time the batch's objects have usually left the cache: fetch ahead.
        for &idx in h.objects.iter().take(PREFETCH_AHEAD) {
            self.prefetch_object(idx);
        }
        for (n, &idx) in h.objects.iter().enumerate() {
            if let Some(&ahead) = h.objects.get(n + PREFETCH_AHEAD) {
                self.prefetch_object(ahead);
            }
            let stamp = self.tick();
            let obj = &mut self.objects[idx];
            obj.pins -= 1;
            obj.stamp = stamp;
            self.settle(idx);
        }
        self.totals.releases += 1;
        Ok(m)
    }

    /// Pins the objects at `objects` (indices from [`Resolved::indices`]) outside any handle,
    /// one pin each until [`Self::unhold`]: what the step scheduler keeps of a selection for
    /// the next step. Only objects Ready on the device are held (a load may still be in
    /// flight on a CUDA stream, and may yet fail); `held[i]` says which were. Unknown indices
    /// are an error, and nothing is held then.
    pub fn hold(&mut self, objects: &[u32], held: &mut Vec<bool>) -> Result<()> {
        // Checked first, fetching ahead (the objects are cold); the pass below finds them in
        // cache.
        for &i in objects.iter().take(PREFETCH_AHEAD) {
            self.prefetch_object(i as usize);
        }
        if let Some(&bad) = objects.iter().enumerate().find_map(|(n, i)| {
            if let Some(&ahead) = objects.get(n + PREFETCH_AHEAD) {
                self.prefetch_object(ahead as usize);
            }
            self.objects
                .get(*i as usize)
                .is_none_or(|o| o.held == u16::MAX)
                .then_some(i)
        }) {
            return Err(Error::config(
                "objects",
                bad,
                "live object indices from a resolve, each held fewer than 65535 times",
            ));
        }
        held.clear();
        for &i in objects {
            let obj = &mut self.objects[i as usize];
            let ok = matches!(obj.device, DeviceState::Ready { .. });
            if ok {
                self.lru.remove(&mut obj.lru_mark);
                obj.pins += 1;
                obj.held += 1;
            }
            held.push(ok);
        }
        Ok(())
    }

    /// Drops one held pin of each object at `objects` (see [`Self::hold`]); an object left
    /// unpinned becomes evictable (most recently used) or, dropped, goes. An index not held
    /// (as often as it appears) is an error, and nothing changes then.
    pub fn unhold(&mut self, objects: &[u32]) -> Result<()> {
        // Stage: take the held counts, putting them back if one is refused (fetching ahead:
        // the objects are cold; the pass below finds them in cache).
        for &i in objects.iter().take(PREFETCH_AHEAD) {
            self.prefetch_object(i as usize);
        }
        for (n, &i) in objects.iter().enumerate() {
            if let Some(&ahead) = objects.get(n + PREFETCH_AHEAD) {
                self.prefetch_object(ahead as usize);
            }
            match self.objects.get_mut(i as usize) {
                Some(o) if o.held > 0 => o.held -= 1,
                _ => {
                    for &j in &objects[..n] {
                        self.objects[j as usize].held += 1;
                    }
                    return Err(Error::config("objects", i, "objects this directory holds"));
                }
            }
        }
        for &i in objects.iter().take(PREFETCH_AHEAD) {
            self.prefetch_object(i as usize);
        }
        for (n, &i) in objects.iter().enumerate() {
            if let Some(&ahead) = objects.get(n + PREFETCH_AHEAD) {
                self.prefetch_object(ahead as usize);
            }
            let stamp = self.tick();
            let obj = &mut self.objects[i as usize];
            obj.pins -= 1;
            obj.stamp = stamp;
            self.settle(i as usize);
        }
        Ok(())
    }

    /// Pins held outside handles ([`Self::hold`]), all objects together (walks every object).
    pub fn held_pins(&self) -> u64 {
        self.objects.iter().map(|(_, o)| u64::from(o.held)).sum()
    }

    /// The state of transfer `id`: `None` while in flight, else its outcome. Unknown ids are
    /// an error.
    pub fn outcome(&self, id: TransferId) -> Result<Option<Result<()>>> {
        let t = self
            .transfers
            .get(&id)
            .ok_or(Error::UnknownTransfer { id: id.raw() })?;
        Ok(match &t.state {
            TransferState::InFlight => None,
            TransferState::Completed => Some(Ok(())),
            TransferState::Failed(reason) => Some(Err(Error::TransferFailed {
                id: id.raw(),
                reason: reason.clone(),
            })),
        })
    }

    /// Plans write-through backups of device-Ready objects that have no host copy yet. Keys
    /// already backed up or being backed up are skipped. All or nothing.
    pub fn backup(&mut self, keys: &[ObjectKey]) -> Result<BackupPlan> {
        non_empty(keys)?;
        let epoch = self.next_epoch();
        let mut todo = Vec::new();
        for key in keys {
            let idx = self.lookup(key)?;
            let obj = &mut self.objects[idx];
            if obj.epoch == epoch {
                continue;
            }
            obj.epoch = epoch;
            if !matches!(obj.device, DeviceState::Ready { .. }) {
                return Err(Error::InvalidTransition {
                    op: "back up",
                    key: key.to_string(),
                    state: obj.device.to_string(),
                });
            }
            if matches!(obj.host, HostState::None) {
                todo.push(idx);
            }
        }
        let owned = todo
            .iter()
            .filter(|&&i| self.objects.side_of(i).home.is_none())
            .count();
        if owned > self.host.free_count() {
            return Err(Error::OutOfSlots {
                tier: "host",
                requested: owned,
                free: self.host.free_count(),
                evictable: 0,
            });
        }
        if todo.is_empty() {
            return Ok(BackupPlan {
                transfer: None,
                device_slots: Vec::new(),
                host_slots: Vec::new(),
            });
        }
        let tid = self.new_transfer(TransferKind::Backup);
        let mut plan = BackupPlan {
            transfer: Some(tid),
            device_slots: Vec::with_capacity(todo.len()),
            host_slots: Vec::with_capacity(todo.len()),
        };
        for &idx in &todo {
            let hslot = match self.objects.side_of(idx).home {
                Some(home) => home,
                None => HostSlotId::of_page(self.host.alloc_one().expect("counted above")),
            };
            let obj = &mut self.objects[idx];
            obj.host = HostState::Writing {
                slot: hslot,
                transfer: tid,
            };
            plan.device_slots
                .push(obj.device_slot().expect("device Ready"));
            plan.host_slots.push(hslot);
        }
        self.totals.bytes_backed_up += todo.len() as u64 * self.object_bytes;
        self.transfers.get_mut(&tid).expect("just created").objects = todo;
        Ok(plan)
    }

    /// Evicts up to `n` least recently used evictable objects; returns their keys.
    pub fn evict(&mut self, n: usize) -> Vec<ObjectKey> {
        let mut out = Vec::with_capacity(n.min(self.lru.len()));
        while out.len() < n {
            let Some(idx) = self.lru_pop() else {
                break;
            };
            let obj = &mut self.objects[idx];
            let DeviceState::Ready { slot } = obj.device else {
                unreachable!("LRU list holds only device-Ready objects")
            };
            obj.device = DeviceState::Absent;
            out.push(self.objects.side_of(idx).key);
            self.device
                .free(&[slot.page()])
                .expect("a Ready object's slot is allocated");
            self.totals.evictions += 1;
        }
        out
    }

    /// Ends namespace `ns`: its keys stop resolving at once; each object is removed now, or
    /// when its last pin is released and no transfer touches it. Returns (removed now,
    /// deferred).
    pub fn drop_namespace(&mut self, ns: Namespace) -> Result<(usize, usize)> {
        if !self.dropped.insert(ns) {
            return Err(Error::NamespaceDropped {
                namespace: ns.to_string(),
            });
        }
        self.totals.namespaces_dropped += 1;
        self.dropped_order.push_back(ns);
        self.forget_old_drops();
        let (mut now, mut later) = (0, 0);
        for idx in self.namespaces.remove(&ns).unwrap_or_default() {
            self.objects[idx].dropped = true;
            let key = self.objects.side_of(idx).key;
            self.index.remove(&key);
            self.lru.remove(&mut self.objects[idx].lru_mark);
            if self.objects[idx].reapable() {
                self.reap(idx);
                now += 1;
            } else {
                later += 1;
            }
        }
        if later > 0 {
            self.lingering.insert(ns, later);
        }
        Ok((now, later))
    }

    /// Forgets the oldest dropped namespaces past [`DROPPED_REMEMBERED`], keeping those whose
    /// objects still linger (their count is keyed by the namespace).
    fn forget_old_drops(&mut self) {
        let mut tries = self.dropped_order.len();
        while self.dropped_order.len() > DROPPED_REMEMBERED && tries > 0 {
            tries -= 1;
            let ns = self
                .dropped_order
                .pop_front()
                .expect("longer than the bound");
            if self.lingering.contains_key(&ns) {
                self.dropped_order.push_back(ns);
            } else {
                self.dropped.remove(&ns);
            }
        }
    }

    /// Dropped namespaces remembered now.
    pub fn dropped_remembered(&self) -> usize {
        self.dropped.len()
    }

    /// Keys of live objects on the device with no host copy yet (what a make-room writes
    /// through first).
    pub fn unbacked_keys(&self) -> Vec<ObjectKey> {
        self.objects
            .iter()
            .filter(|(_, o)| {
                !o.dropped
                    && matches!(o.device, DeviceState::Ready { .. })
                    && matches!(o.host, HostState::None)
            })
            .map(|(i, _)| self.objects.side_of(i).key)
            .collect()
    }

    /// What a journal of this directory records up front: (object bytes, usable device
    /// slots).
    pub(super) fn journal_geometry(&self) -> (u64, u64) {
        (self.object_bytes, self.device.capacity() as u64)
    }

    /// The kind of transfer `id`, while the directory remembers it.
    pub(super) fn transfer_kind(&self, id: TransferId) -> Option<TransferKind> {
        self.transfers.get(&id).map(|t| t.kind)
    }

    /// Objects of dropped namespace `ns` not yet removed (a pin or a transfer still holds
    /// them); 0 once whatever lives at their homes may be reused.
    pub fn lingering(&self, ns: Namespace) -> usize {
        self.lingering.get(&ns).copied().unwrap_or(0)
    }

    /// The object's states, if the key is live.
    pub fn state(&self, key: &ObjectKey) -> Option<&Object> {
        self.index.get(key).map(|&idx| &self.objects[idx])
    }

    /// Device slots held by objects and usable device slots, in O(1) (`stats` walks every
    /// object).
    pub fn device_usage(&self) -> (usize, usize) {
        (
            self.device.used_count() - self.quarantined_device,
            self.device.capacity(),
        )
    }

    /// Counts now, with cumulative totals.
    pub fn stats(&self) -> DirectoryStats {
        let mut s = DirectoryStats {
            objects: self.objects.len(),
            evictable: self.lru.len(),
            device_capacity: self.device.capacity(),
            device_free: self.device.free_count(),
            device_used: self.device.used_count() - self.quarantined_device,
            device_quarantined: self.quarantined_device,
            host_capacity: self.host.capacity(),
            host_free: self.host.free_count(),
            host_used: self.host.used_count() - self.quarantined_host,
            host_quarantined: self.quarantined_host,
            transfers_in_flight: self
                .transfers
                .values()
                .filter(|t| t.state == TransferState::InFlight)
                .count(),
            handles: self.handles.len(),
            totals: self.totals,
            ..Default::default()
        };
        for (_, o) in &self.objects {
            match o.device {
                DeviceState::Absent => s.device_absent += 1,
                DeviceState::Loading { .. } => s.device_loading += 1,
                DeviceState::Ready { .. } => s.device_ready += 1,
            }
            match o.host {
                HostState::None => s.host_none += 1,
                HostState::Writing { .. } => s.host_writing += 1,
                HostState::Ready { .. } => s.host_ready += 1,
            }
            s.pinned_objects += usize::from(o.pins > 0);
            s.pins += u64::from(o.pins);
        }
        s
    }

    /// Checks every invariant; returns the first one broken.
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.objects
            .validate()
            .map_err(|e| format!("object arena: {e}"))?;
        self.device
            .validate()
            .map_err(|e| format!("device allocator: {e}"))?;
        self.host
            .validate()
            .map_err(|e| format!("host allocator: {e}"))?;
        self.lru
            .validate(|i| self.objects.get(i).map_or(0, |o| o.lru_mark))
            .map_err(|e| format!("LRU list: {e}"))?;
        let mut dev_owner: FxHashMap<SlotId, usize> = FxHashMap::default();
        let mut host_owner: FxHashMap<HostSlotId, usize> = FxHashMap::default();
        let mut home_owner: FxHashMap<HostSlotId, usize> = FxHashMap::default();
        let mut pins: FxHashMap<usize, u32> = FxHashMap::default();
        for h in self.handles.values() {
            for &idx in &h.objects {
                *pins.entry(idx).or_default() += 1;
            }
        }
        for (idx, o) in &self.objects {
            let Identity { key, home } = *self.objects.side_of(idx);
            if let Some(s) = o.device_slot() {
                if !self.device.is_allocated(s.page()) {
                    return Err(format!("{} holds device slot {s}, which is free", key));
                }
                if let Some(other) = dev_owner.insert(s, idx) {
                    return Err(format!("device slot {s} held by objects {other} and {idx}"));
                }
            }
            if let Some(home) = home {
                if o.host_slot().is_some_and(|s| s != home) {
                    return Err(format!("{} holds a host slot other than its home", key));
                }
                // One live object per home. A dropped one may linger there (a load reading the
                // old page), but never write it: only a Writing object writes its home.
                let writes = matches!(o.host, HostState::Writing { .. });
                if !o.dropped || writes {
                    if let Some(other) = home_owner.insert(home, idx) {
                        return Err(format!("home {home} held by objects {other} and {idx}"));
                    }
                }
            } else if let Some(s) = o.host_slot() {
                if !self.host.is_allocated(s.page()) {
                    return Err(format!("{} holds host slot {s}, which is free", key));
                }
                if let Some(other) = host_owner.insert(s, idx) {
                    return Err(format!("host slot {s} held by objects {other} and {idx}"));
                }
            }
            if (o.lru_mark != 0) != o.evictable() {
                return Err(format!(
                    "{}: in LRU list = {}, evictable = {} (pins {}, {}, {})",
                    key,
                    o.lru_mark != 0,
                    o.evictable(),
                    o.pins,
                    o.device,
                    o.host
                ));
            }
            if pins.get(&idx).copied().unwrap_or(0) + u32::from(o.held) != o.pins {
                return Err(format!(
                    "{}: pin count {} disagrees with handles and {} held",
                    key, o.pins, o.held
                ));
            }
            if o.held > 0 && !matches!(o.device, DeviceState::Ready { .. }) {
                return Err(format!("{} held, but {}", key, o.device));
            }
            if let DeviceState::Loading { transfer, .. } = o.device {
                let t = self
                    .transfers
                    .get(&transfer)
                    .ok_or_else(|| format!("{} Loading under unknown transfer {transfer}", key))?;
                if t.state != TransferState::InFlight
                    || t.kind != TransferKind::Load
                    || !t.objects.contains(&idx)
                {
                    return Err(format!(
                        "{} Loading, but transfer {transfer} does not carry it",
                        key
                    ));
                }
            }
            if let HostState::Writing { transfer, .. } = o.host {
                let ok = self.transfers.get(&transfer).is_some_and(|t| {
                    t.state == TransferState::InFlight
                        && t.kind == TransferKind::Backup
                        && t.objects.contains(&idx)
                });
                if !ok {
                    return Err(format!(
                        "{} Writing, but backup {transfer} does not carry it",
                        key
                    ));
                }
            }
            if o.dropped == self.index.get(&key).is_some_and(|&i| i == idx) {
                return Err(format!(
                    "{}: dropped = {} disagrees with the index",
                    key, o.dropped
                ));
            }
            if o.reapable() {
                return Err(format!(
                    "{} was dropped and is unreferenced, yet not removed",
                    key
                ));
            }
        }
        if self.dropped.len() != self.dropped_order.len() {
            return Err("dropped set and its order disagree".into());
        }
        if let Some(ns) = self.lingering.keys().find(|ns| !self.dropped.contains(ns)) {
            return Err(format!(
                "namespace {ns} lingers but is not remembered as dropped"
            ));
        }
        let (mut qd, mut qh) = (0, 0);
        for q in self.quarantine.values() {
            for s in &q.device {
                if dev_owner.contains_key(s) || !self.device.is_allocated(s.page()) {
                    return Err(format!("quarantined device slot {s} is owned or free"));
                }
            }
            for s in &q.host {
                if host_owner.contains_key(s) || !self.host.is_allocated(s.page()) {
                    return Err(format!("quarantined host slot {s} is owned or free"));
                }
            }
            qd += q.device.len();
            qh += q.host.len();
        }
        if (qd, qh) != (self.quarantined_device, self.quarantined_host) {
            return Err("quarantine counters disagree with the quarantine".into());
        }
        if dev_owner.len() + qd + self.device.free_count() != self.device.capacity() {
            return Err(format!(
                "device: held {} + quarantined {qd} + free {} != capacity {}",
                dev_owner.len(),
                self.device.free_count(),
                self.device.capacity()
            ));
        }
        if host_owner.len() + qh + self.host.free_count() != self.host.capacity() {
            return Err(format!(
                "host: held {} + quarantined {qh} + free {} != capacity {}",
                host_owner.len(),
                self.host.free_count(),
                self.host.capacity()
            ));
        }
        for (id, t) in &self.transfers {
            if t.state == TransferState::InFlight {
                for &idx in &t.objects {
                    if !self.objects.contains(idx) {
                        return Err(format!("transfer {id} carries a removed object"));
                    }
                }
            } else if t.refs == 0 {
                return Err(format!(
                    "finished transfer {id} with no handle was not forgotten"
                ));
            }
        }
        Ok(())
    }
}

/// An empty batch is a caller bug (a selection always holds the sink block), not a no-op.
/// Whether the LRU entry `(i, seq)` is live (object `i`'s mark is `seq`); if so, clears the
/// mark.
#[inline]
fn take_lru_entry(objects: &mut Arena<Object, Identity>, i: usize, seq: u64) -> bool {
    match objects.get_mut(i) {
        Some(o) if o.lru_mark == seq => {
            o.lru_mark = 0;
            true
        }
        _ => false,
    }
}

fn non_empty(keys: &[ObjectKey]) -> Result<()> {
    if keys.is_empty() {
        Err(Error::config(
            "keys",
            "an empty batch",
            "a batch of at least one key",
        ))
    } else {
        Ok(())
    }
}

fn describe(s: &TransferState) -> String {
    match s {
        TransferState::InFlight => "in flight".to_owned(),
        TransferState::Completed => "completed".to_owned(),
        TransferState::Failed(r) => format!("failed ({r})"),
    }
}

fn rename(e: Error, pages: &str, reserve: &str) -> Error {
    match e {
        Error::Config {
            field,
            value,
            allowed,
        } => {
            let f = if field == "pages" { pages } else { reserve };
            Error::Config {
                field: f.to_owned(),
                value,
                allowed,
            }
        }
        other => other,
    }
}

fn same_len(keys: &[ObjectKey], homes: &[HostSlotId]) -> Result<()> {
    if keys.len() == homes.len() {
        Ok(())
    } else {
        Err(Error::config(
            "homes",
            format!("{} homes", homes.len()),
            format!("{}: one per key", keys.len()),
        ))
    }
}
