//! The residency directory: for every object, where it lives, whether it is ready, and who is
//! using it.
//!
//! # What it owns
//! The device and host slot allocators of the objects it tracks, every object's states
//! ([`state`]), the LRU list of evictable objects ([`lru`]), transfer records and quarantined
//! slots ([`transfer`]), pin handles, and the metrics ([`metrics`]).
//!
//! # Concurrency and lock order
//! [`Directory`] is `Send + Sync`: one mutex guards the whole [`core::Core`], and a condvar
//! wakes [`Directory::wait`]ers when a transfer finishes. There is one lock, so there is no
//! lock order to keep; no call holds it while waiting or calling out.
//!
//! # Drop behaviour
//! [`PinGuard`] releases its pins when dropped. Dropping the directory frees nothing outside
//! itself: the slots it hands out are indices into pools it does not own.

pub mod arena;
pub mod bench;
pub mod core;
pub mod journal;
pub mod key;
pub mod lru;
pub mod metrics;
mod recorder;
pub mod slot_set;
pub mod state;
pub mod transfer;

pub use self::core::{DirectoryConfig, DirectoryStats, Resolved};
pub use key::{LayerGroup, Namespace, ObjectKey};
pub use metrics::{token_pages, ResolveMetrics, TokenPages, Totals};
pub use state::{DeviceState, HostState, ObjectHint};
pub use transfer::{BackupPlan, LoadPlan};

use crate::error::{Error, Result};
use crate::guard::Poison;
use crate::ids::{PinHandleId, TransferId};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The thread-safe residency directory.
#[derive(Debug)]
pub struct Directory {
    core: Mutex<recorder::Recorded>,
    finished: Condvar,
    /// Set when a call through a binding panicked inside (see [`crate::guard`]); the
    /// bindings refuse every later call. The core itself does not read it.
    poison: Arc<Poison>,
}

/// The state of one object, copied out of the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectState {
    /// Device tier.
    pub device: DeviceState,
    /// Host tier.
    pub host: HostState,
    /// Pin count.
    pub pins: u32,
    /// LRU stamp.
    pub stamp: u64,
}

impl Directory {
    /// An empty directory of the given sizes.
    pub fn new(cfg: DirectoryConfig) -> Result<Self> {
        Ok(Directory {
            core: Mutex::new(recorder::Recorded::new(self::core::Core::new(cfg)?)),
            finished: Condvar::new(),
            poison: Arc::default(),
        })
    }

    /// The flag the guards of this directory's owners share (see [`crate::guard`]).
    pub fn poison(&self) -> &Arc<Poison> {
        &self.poison
    }

    /// See [`core::Core::allocate`].
    pub fn allocate(&self, keys: &[ObjectKey]) -> Result<Vec<crate::ids::SlotId>> {
        self.core.lock().allocate(keys)
    }

    /// See [`core::Core::allocate_homed`].
    pub fn allocate_homed(
        &self,
        keys: &[ObjectKey],
        homes: &[crate::ids::HostSlotId],
    ) -> Result<Vec<crate::ids::SlotId>> {
        self.core.lock().allocate_homed(keys, homes)
    }

    /// See [`core::Core::register_host`].
    pub fn register_host(
        &self,
        keys: &[ObjectKey],
        homes: &[crate::ids::HostSlotId],
    ) -> Result<usize> {
        self.core.lock().register_host(keys, homes)
    }

    /// See [`core::Core::resolve`].
    pub fn resolve(&self, keys: &[ObjectKey], bytes_needed: Option<u64>) -> Result<Resolved> {
        self.core.lock().resolve(keys, bytes_needed)
    }

    /// See [`core::Core::resolve_hinted`].
    pub fn resolve_hinted(
        &self,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
        bytes_needed: Option<u64>,
    ) -> Result<Resolved> {
        self.core
            .lock()
            .resolve_hinted(keys, Some(hints), bytes_needed)
    }

    /// See [`core::Core::prefetch_loads`].
    pub fn prefetch_loads(&self, keys: &[ObjectKey], hints: &[ObjectHint]) -> Result<Resolved> {
        self.core.lock().prefetch_loads(keys, Some(hints))
    }

    /// See [`core::Core::set_epoch`].
    #[cfg(test)]
    pub(crate) fn set_epoch(&self, epoch: u32) {
        self.core.lock().set_epoch(epoch);
    }

    /// See [`core::Core::index_of`].
    pub fn index_of(&self, keys: &[ObjectKey]) -> Vec<ObjectHint> {
        self.core.lock().index_of(keys)
    }

    /// Resolves and returns a guard that releases the pins when dropped.
    pub fn resolve_guarded(&self, keys: &[ObjectKey]) -> Result<(Resolved, PinGuard<'_>)> {
        let r = self.resolve(keys, None)?;
        let guard = PinGuard {
            directory: self,
            handle: Some(r.handle),
        };
        Ok((r, guard))
    }

    /// See [`core::Core::release`].
    pub fn release(&self, handle: PinHandleId) -> Result<ResolveMetrics> {
        self.core.lock().release(handle)
    }

    /// See [`core::Core::hold`].
    pub fn hold(&self, objects: &[u32], held: &mut Vec<bool>) -> Result<()> {
        self.core.lock().hold(objects, held)
    }

    /// See [`core::Core::unhold`].
    pub fn unhold(&self, objects: &[u32]) -> Result<()> {
        self.core.lock().unhold(objects)
    }

    /// See [`core::Core::held_pins`].
    pub fn held_pins(&self) -> u64 {
        self.core.lock().held_pins()
    }

    /// See [`core::Core::grant_slots`].
    pub fn grant_slots(&self, n: usize) -> Result<Vec<crate::ids::SlotId>> {
        self.core.lock().grant_slots(n)
    }

    /// The cumulative totals alone (what [`Directory::stats`] gives with them, without its
    /// walk over every object).
    pub fn totals(&self) -> Totals {
        self.core.lock().totals()
    }

    /// See [`core::Core::publish_reads`].
    pub fn publish_reads(&self, bits: std::sync::Arc<Vec<u32>>, base: u64, layers: u16) {
        self.core.lock().publish_reads(bits, base, layers)
    }

    /// See [`core::Core::device_free`].
    pub fn device_free(&self) -> usize {
        self.core.lock().device_free()
    }

    /// See [`core::Core::grant_victims`].
    pub fn grant_victims(&self, n: usize) -> Vec<(u32, ObjectKey, crate::ids::SlotId)> {
        self.core.lock().grant_victims(n)
    }

    /// [`core::Core::take_victim`] for each (object index, slot), in one lock.
    pub fn take_victims(&self, victims: &[(u32, crate::ids::SlotId)]) -> Result<()> {
        self.core.lock().take_victims(victims)
    }

    /// See [`core::Core::is_held_at`].
    pub fn is_held_at(&self, idx: u32, slot: crate::ids::SlotId) -> bool {
        self.core.lock().is_held_at(idx, slot)
    }

    /// Whether device `slot` is granted (held by no object, neither free).
    pub fn is_granted(&self, slot: crate::ids::SlotId) -> bool {
        self.core.lock().is_granted(slot)
    }

    /// Of `slots`, the indices of those granted (one lock for them all).
    pub fn granted_among(&self, slots: &[crate::ids::SlotId]) -> Vec<usize> {
        let core = self.core.lock();
        (0..slots.len())
            .filter(|&i| core.is_granted(slots[i]))
            .collect()
    }

    /// See [`core::Core::granted`].
    pub fn granted(&self) -> usize {
        self.core.lock().granted()
    }

    /// See [`core::Core::return_slots`].
    pub fn return_slots(&self, slots: &[crate::ids::SlotId]) -> Result<()> {
        self.core.lock().return_slots(slots)
    }

    /// [`core::Core::adopt_hinted`] for each (key, hint, slot), in one lock: whether each was
    /// adopted.
    pub fn adopt(
        &self,
        entries: &[(ObjectKey, ObjectHint, crate::ids::SlotId)],
    ) -> Result<Vec<bool>> {
        self.core.lock().adopt_all(entries)
    }

    /// See [`core::Core::log_releases`].
    pub fn log_releases(&self, on: bool) {
        self.core.lock().log_releases(on)
    }

    /// See [`core::Core::pending_releases`].
    pub fn pending_releases(&self) -> Vec<(ObjectKey, crate::ids::SlotId)> {
        self.core.lock().pending_releases()
    }

    /// See [`core::Core::take_releases`].
    pub fn take_releases(&self) -> Vec<(ObjectKey, crate::ids::SlotId)> {
        self.core.lock().take_releases()
    }

    /// Whether a journal is recording (see [`recorder`]).
    pub fn journaling(&self) -> bool {
        self.core.lock().journaling()
    }

    /// See [`core::Core::mark_submitted`].
    pub fn mark_submitted(&self, id: TransferId) -> Result<()> {
        self.core.lock().mark_submitted(id)
    }

    /// See [`core::Core::complete`]; wakes waiters.
    pub fn complete(&self, id: TransferId) -> Result<()> {
        let r = self.core.lock().complete(id);
        self.finished.notify_all();
        r
    }

    /// See [`core::Core::backup_complete`]; wakes waiters.
    pub fn backup_complete(&self, id: TransferId) -> Result<()> {
        let r = self.core.lock().backup_complete(id);
        self.finished.notify_all();
        r
    }

    /// See [`core::Core::fail`]; wakes waiters, who get [`Error::TransferFailed`].
    pub fn fail(&self, id: TransferId, reason: &str, ended: bool) -> Result<()> {
        let r = self.core.lock().fail(id, reason, ended);
        self.finished.notify_all();
        r
    }

    /// See [`core::Core::transfer_ended`].
    pub fn transfer_ended(&self, id: TransferId) -> Result<()> {
        self.core.lock().transfer_ended(id)
    }

    /// Blocks until transfer `id` finishes: `Ok` when it completed, [`Error::TransferFailed`]
    /// when it failed, [`Error::WaitTimeout`] when `timeout` passes first.
    pub fn wait(&self, id: TransferId, timeout: Option<Duration>) -> Result<()> {
        // A deadline past what the clock can hold is no deadline.
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut core = self.core.lock();
        loop {
            if let Some(outcome) = core.outcome(id)? {
                return outcome;
            }
            match deadline {
                None => self.finished.wait(&mut core),
                Some(d) => {
                    if self.finished.wait_until(&mut core, d).timed_out()
                        && core.outcome(id)?.is_none()
                    {
                        return Err(Error::WaitTimeout {
                            id: id.raw(),
                            timeout_ms: timeout.unwrap_or_default().as_millis() as u64,
                        });
                    }
                }
            }
        }
    }

    /// The outcome of transfer `id` without waiting: `None` while in flight. Known while a
    /// pin handle refers to it or it is in flight.
    pub fn outcome(&self, id: TransferId) -> Result<Option<Result<()>>> {
        self.core.lock().outcome(id)
    }

    /// See [`core::Core::backup`].
    pub fn backup(&self, keys: &[ObjectKey]) -> Result<BackupPlan> {
        self.core.lock().backup(keys)
    }

    /// See [`core::Core::evict`].
    pub fn evict(&self, n: usize) -> Vec<ObjectKey> {
        self.core.lock().evict(n)
    }

    /// Starts recording every call into a fresh journal (see [`recorder`]).
    pub fn start_journal(&self) {
        self.core.lock().start_journal()
    }

    /// Stops recording and returns the journal, if one was recording.
    pub fn take_journal(&self) -> Option<journal::Journal> {
        self.core.lock().take_journal()
    }

    /// Marks the end of a decode step in the journal.
    pub fn journal_step(&self) {
        self.core.lock().journal_step()
    }

    /// See [`core::Core::lingering`].
    pub fn lingering(&self, ns: Namespace) -> usize {
        self.core.lock().lingering(ns)
    }

    /// See [`core::Core::remembers_dropped`].
    pub fn remembers_dropped(&self, ns: Namespace) -> bool {
        self.core.lock().remembers_dropped(ns)
    }

    /// See [`core::Core::drop_namespace`].
    pub fn drop_namespace(&self, ns: Namespace) -> Result<(usize, usize)> {
        self.core.lock().drop_namespace(ns)
    }

    /// The states of a live object.
    pub fn state(&self, key: &ObjectKey) -> Option<ObjectState> {
        self.core.lock().state(key).map(|o| ObjectState {
            device: o.device,
            host: o.host,
            pins: o.pins,
            stamp: o.stamp,
        })
    }

    /// The device state of each live object of `keys` (None: no such object), in one lock.
    pub fn device_states(&self, keys: &[ObjectKey]) -> Vec<Option<DeviceState>> {
        let core = self.core.lock();
        keys.iter()
            .map(|k| core.state(k).map(|o| o.device))
            .collect()
    }

    /// See [`core::Core::reserve_objects`].
    pub fn reserve_objects(&self, n: usize) {
        self.core.lock().reserve_objects(n)
    }

    /// See [`core::Core::object_room`].
    pub fn object_room(&self) -> usize {
        self.core.lock().object_room()
    }

    /// See [`core::Core::device_usage`].
    pub fn device_usage(&self) -> (usize, usize) {
        self.core.lock().device_usage()
    }

    /// See [`core::Core::stats`].
    pub fn stats(&self) -> DirectoryStats {
        self.core.lock().stats()
    }

    /// See [`core::Core::validate`].
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.core.lock().validate()
    }

    /// Tests: the LRU list's sweeps start and run early (see [`lru::Lru::tune`]).
    #[cfg(test)]
    pub(crate) fn tune_lru(&self, slack: isize, step: usize, run: usize) {
        self.core.lock().tune_lru(slack, step, run)
    }
}

/// Pins of one resolve, released on drop.
#[derive(Debug)]
pub struct PinGuard<'a> {
    directory: &'a Directory,
    handle: Option<PinHandleId>,
}

impl PinGuard<'_> {
    /// Releases now and returns the completed metrics record.
    pub fn release(mut self) -> Result<ResolveMetrics> {
        let h = self.handle.take().ok_or(Error::UnknownHandle { id: 0 })?;
        self.directory.release(h)
    }
}

impl Drop for PinGuard<'_> {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            // The handle came from this directory and was not released: this cannot fail.
            let _ = self.directory.release(h);
        }
    }
}

#[cfg(test)]
#[path = "../tests/directory_examples.rs"]
mod examples;

#[cfg(test)]
#[path = "../tests/directory_proptest.rs"]
mod proptest_model;
