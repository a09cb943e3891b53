//! The residency state machine, single-threaded. [`super::Directory`] wraps it in a mutex.
//!
//! Every transition is one function here and checks its from-state; every side effect on
//! slots (allocate, free, quarantine) has one call site: `Core::take_device_slot`,
//! `Core::reap`, `Core::fail` (quarantine) and `Core::transfer_ended` (its end).
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

mod grant;
mod pins;
mod reads;
pub(crate) use reads::MAX_CHANCES;
mod resolve;
mod transfers;
mod validate;

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
    /// Device slots granted to a device resolver, not yet adopted or returned (`grant`).
    granted: super::slot_set::SlotSet,
    /// Objects that lost their device slot, while a device resolver mirrors the device.
    released: Option<Vec<(ObjectKey, SlotId)>>,
    /// What a device resolver's last step read (`reads`): evictions give those a second
    /// chance.
    reads: Option<reads::ReadBits>,
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
            granted: Default::default(),
            released: None,
            reads: None,
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
        let mut given = 0;
        let victim = loop {
            // Evictions come in runs (one per load of a batch): fetch the victims ahead.
            let objects = &mut self.objects;
            let mut popped = 0;
            let victim = self
                .lru
                .pop_front_ahead(PREFETCH_AHEAD, |i, seq, ahead| {
                    if let Some(a) = ahead {
                        objects.prefetch(a);
                    }
                    popped = seq;
                    take_lru_entry(objects, i, seq)
                })
                .expect("caller checked free + evictable >= needed");
            if !self.second_chance(victim, popped, &mut given, MAX_CHANCES) {
                break victim;
            }
        };
        self.totals.second_chances += u64::from(given);
        let obj = &mut self.objects[victim];
        let DeviceState::Ready { slot } = obj.device else {
            unreachable!("LRU list holds only device-Ready objects")
        };
        obj.device = DeviceState::Absent;
        self.totals.evictions += 1;
        self.log_release(victim, slot);
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

    /// Pops the object to evict: the least recently used evictable one, after the second
    /// chances the last published read bitmap gives.
    fn lru_pop(&mut self) -> Option<usize> {
        let mut given = 0;
        loop {
            let objects = &mut self.objects;
            let mut popped = 0;
            let idx = self.lru.pop_front(|i, seq| {
                popped = seq;
                take_lru_entry(objects, i, seq)
            });
            let Some(idx) = idx else {
                self.totals.second_chances += u64::from(given);
                return None;
            };
            if !self.second_chance(idx, popped, &mut given, MAX_CHANCES) {
                self.totals.second_chances += u64::from(given);
                return Some(idx);
            }
        }
    }

    /// Removes a dropped object, freeing the slots it holds.
    fn reap(&mut self, idx: usize) {
        self.lru.remove(&mut self.objects[idx].lru_mark);
        if let DeviceState::Ready { slot } = self.objects[idx].device {
            self.log_release(idx, slot);
        }
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
            self.log_release(idx, slot);
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

    /// Whether `ns` was dropped and is still remembered so (its keys are refused for good
    /// until [`DROPPED_REMEMBERED`] later drops forget it, none of its objects lingering).
    pub fn remembers_dropped(&self, ns: Namespace) -> bool {
        self.dropped.contains(&ns)
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

    /// Room for `n` objects in all before the arena and the key index grow: each grows by
    /// moving every entry, inside whichever call crossed its capacity (a step's `append`,
    /// hundreds of milliseconds at millions of objects). A hint: refused, they grow as needed.
    pub fn reserve_objects(&mut self, n: usize) {
        self.objects.reserve(n);
        let n = n.min(super::arena::MAX_ROOM);
        let _ = self.index.try_reserve(n.saturating_sub(self.index.len()));
    }

    /// Objects it holds before its arena or key index grows.
    pub fn object_room(&self) -> usize {
        self.objects.capacity().min(self.index.capacity())
    }

    /// Device slots held by objects and usable device slots, in O(1) (`stats` walks every
    /// object).
    pub fn device_usage(&self) -> (usize, usize) {
        (
            self.device.used_count() - self.quarantined_device,
            self.device.capacity(),
        )
    }

    /// The cumulative totals.
    pub fn totals(&self) -> Totals {
        self.totals
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
