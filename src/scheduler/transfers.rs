//! The scheduler's copies: the engine and the two bindings it copies between, the loads and
//! backups in flight, and the pages waiting to be written through.
//!
//! A component of [`StepScheduler`](super::StepScheduler) with a narrow borrow: each call
//! takes the directory whose transfers it submits or settles and the record it counts into,
//! and nothing else of the scheduler.
//!
//! # Invariants
//! - every load or backup here is in flight in the directory under the same id, until it is
//!   settled (`complete`/`fail`, `backup_complete`/`fail`);
//! - a backup that failed leaves its keys in `retry`, submitted again at the next
//!   `submit_pending`.

#[cfg(any(test, feature = "testing"))]
use super::faults::ArmedFaults;
use super::record::StepRecord;
use crate::directory::{Directory, ObjectKey, Resolved};
use crate::error::Result;
use crate::ids::{HostSlotId, SlotId, TransferId};
use crate::transfer::{
    CopyEngine, Direction, Granularity, LayerStatus, PageTransferBinding, PageTransferGroup,
    PageTransferMap, PreparedPageTransfer, TransferEvents,
};
use rustc_hash::FxHashMap;
use std::sync::Arc;

#[derive(Debug)]
struct Backup {
    events: Arc<TransferEvents>,
    keys: Vec<ObjectKey>,
}

/// Copies between the device and host bindings, in flight and queued.
pub(super) struct Transfers {
    pub(super) engine: Arc<dyn CopyEngine>,
    device: PageTransferBinding,
    host: PageTransferBinding,
    /// Bytes of one object (one page of one layer, every plane).
    object_bytes: u64,
    /// Faults armed for coming submissions (test builds: the testing hooks).
    #[cfg(any(test, feature = "testing"))]
    pub(super) faults: ArmedFaults,
    loads: FxHashMap<TransferId, Arc<TransferEvents>>,
    backups: FxHashMap<TransferId, Backup>,
    /// Pages to write through at the next submission.
    pub(super) pending: Vec<ObjectKey>,
    /// Pages whose last row this step wrote: written through when the step ends.
    pub(super) filled: Vec<ObjectKey>,
    /// Pages whose backup failed: submitted again.
    pub(super) retry: Vec<ObjectKey>,
}

impl Transfers {
    pub(super) fn new(
        engine: Arc<dyn CopyEngine>,
        device: PageTransferBinding,
        host: PageTransferBinding,
    ) -> Self {
        Transfers {
            object_bytes: device.page_bytes() * device.planes_per_layer() as u64,
            engine,
            device,
            host,
            #[cfg(any(test, feature = "testing"))]
            faults: ArmedFaults::default(),
            loads: FxHashMap::default(),
            backups: FxHashMap::default(),
            pending: Vec::new(),
            filled: Vec::new(),
            retry: Vec::new(),
        }
    }

    /// The device binding (one-layer slots).
    pub(super) fn device(&self) -> &PageTransferBinding {
        &self.device
    }

    /// The host binding (joined: the KV host pool, layer-flattened).
    pub(super) fn host(&self) -> &PageTransferBinding {
        &self.host
    }

    pub(super) fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// Loads and backups in flight (not yet settled).
    pub(super) fn in_flight(&self) -> (usize, usize) {
        (self.loads.len(), self.backups.len())
    }

    /// The events of load `tid`, while it is tracked here.
    pub(super) fn load(&self, tid: TransferId) -> Option<&Arc<TransferEvents>> {
        self.loads.get(&tid)
    }

    /// Blocks until every load in flight has finished.
    pub(super) fn wait_loads(&self) {
        for ev in self.loads.values() {
            let _ = ev.wait_all(None);
        }
    }

    /// Whether a backup is tracked (in flight, or finished and not polled yet).
    pub(super) fn backups_in_flight(&self) -> bool {
        !self.backups.is_empty()
    }

    /// Blocks until every backup in flight has finished.
    pub(super) fn wait_backups(&self) {
        for b in self.backups.values() {
            let _ = b.events.wait_all(None);
        }
    }

    /// Forgets the queued write-throughs of namespace `ns` (a request that ended).
    pub(super) fn forget(&mut self, ns: u64) {
        self.pending.retain(|k| k.namespace.id != ns);
        self.filled.retain(|k| k.namespace.id != ns);
        self.retry.retain(|k| k.namespace.id != ns);
    }

    /// Hands an armed fault of `direction` at `layer` to the engine for its next submission
    /// (test builds; a release build has no faults to arm).
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn arm(&mut self, direction: Direction, layer: Option<u16>) -> Result<()> {
        self.faults.arm(&*self.engine, direction, layer)
    }

    #[cfg(not(any(test, feature = "testing")))]
    #[inline(always)]
    pub(super) fn arm(&mut self, _: Direction, _: Option<u16>) -> Result<()> {
        Ok(())
    }

    /// The armed load failures, handed to a device step's copies: (layer or any, count)
    /// (test builds; a release build has none).
    pub(super) fn take_copy_faults(&mut self) -> Vec<(Option<u16>, u32)> {
        #[cfg(any(test, feature = "testing"))]
        return self.faults.take_copy_faults();
        #[cfg(not(any(test, feature = "testing")))]
        Vec::new()
    }

    /// Arms again the copy failures a device step did not take.
    pub(super) fn restore_copy_faults(&mut self, faults: Vec<(Option<u16>, u32)>) {
        #[cfg(any(test, feature = "testing"))]
        self.faults.restore_copy_faults(faults);
        #[cfg(not(any(test, feature = "testing")))]
        let _ = faults;
    }

    fn group(
        &self,
        direction: Direction,
        src: &[u64],
        dst: &[u64],
    ) -> Result<(PageTransferGroup, u64)> {
        let map = PageTransferMap::new(Granularity::Page, src, dst)?;
        let segments = map.segments().len() as u64;
        let (s, d) = match direction {
            Direction::Load => (&self.host, &self.device),
            Direction::Backup => (&self.device, &self.host),
        };
        let t = PreparedPageTransfer::new(s.clone(), d.clone(), map, direction)?;
        Ok((
            PageTransferGroup::new(vec![t])?,
            segments * self.device.planes_per_layer() as u64,
        ))
    }

    /// Submits a resolve's load (if any); returns every transfer the batch now depends on: the
    /// ones it joined, then its own.
    pub(super) fn submit_resolved(
        &mut self,
        dir: &Directory,
        res: &Resolved,
        layer: u16,
        rec: &mut StepRecord,
    ) -> Vec<TransferId> {
        let mut deps: Vec<TransferId> = res.joined.iter().copied().collect();
        if let Some(lp) = res.loads.first() {
            self.submit_load(
                dir,
                lp.transfer,
                &lp.host_slots,
                &lp.device_slots,
                layer,
                rec,
            );
            deps.push(lp.transfer);
        }
        deps
    }

    /// Submits directory load `tid`; a submission the engine refuses fails the load at once.
    pub(super) fn submit_load(
        &mut self,
        dir: &Directory,
        tid: TransferId,
        host: &[HostSlotId],
        device: &[SlotId],
        layer: u16,
        rec: &mut StepRecord,
    ) {
        let src: Vec<u64> = host.iter().map(|s| u64::from(s.raw())).collect();
        let dst: Vec<u64> = device.iter().map(|s| u64::from(s.raw())).collect();
        let submitted = self.arm(Direction::Load, Some(layer)).and_then(|()| {
            let (g, segments) = self.group(Direction::Load, &src, &dst)?;
            rec.copy_segments += segments;
            self.engine.submit(Arc::new(g), None)
        });
        rec.load_submissions += 1;
        rec.bytes_transferred += device.len() as u64 * self.object_bytes;
        match submitted {
            Ok(events) => {
                let _ = dir.mark_submitted(tid);
                self.loads.insert(tid, events);
            }
            Err(e) => {
                // Nothing was queued: the slots can be reused at once.
                let _ = dir.fail(tid, &e.to_string(), true);
                rec.failed_loads += 1;
            }
        }
    }

    /// Settles load `tid` if it is tracked here (its events must have fired).
    pub(super) fn settle_load(
        &mut self,
        dir: &Directory,
        tid: TransferId,
        rec: &mut StepRecord,
    ) -> Result<()> {
        let Some(events) = self.loads.remove(&tid) else {
            return Ok(());
        };
        match first_failure(&events) {
            None => dir.complete(tid),
            Some(reason) => {
                rec.failed_loads += 1;
                dir.fail(tid, &reason, events.is_finished())
            }
        }
    }

    /// Writes through the queued pages (attempt 0) and, separately, the pages whose backup
    /// failed (a retry). `prune`: drop queued pages whose objects are gone first (joined: a
    /// request that was let go).
    pub(super) fn submit_pending(
        &mut self,
        dir: &Directory,
        rec: &mut StepRecord,
        prune: bool,
    ) -> Result<()> {
        let mut keys = std::mem::take(&mut self.pending);
        if prune {
            live_only(dir, &mut keys);
        }
        self.submit_backup(dir, keys, rec)?;
        let mut retry = std::mem::take(&mut self.retry);
        live_only(dir, &mut retry);
        self.submit_backup(dir, retry, rec)
    }

    fn submit_backup(
        &mut self,
        dir: &Directory,
        keys: Vec<ObjectKey>,
        rec: &mut StepRecord,
    ) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let plan = dir.backup(&keys)?;
        let Some(tid) = plan.transfer else {
            return Ok(());
        };
        let src: Vec<u64> = plan
            .device_slots
            .iter()
            .map(|s| u64::from(s.raw()))
            .collect();
        let dst: Vec<u64> = plan.host_slots.iter().map(|s| u64::from(s.raw())).collect();
        let submitted = self.arm(Direction::Backup, None).and_then(|()| {
            let (g, _) = self.group(Direction::Backup, &src, &dst)?;
            self.engine.submit(Arc::new(g), None)
        });
        rec.backup_submissions += 1;
        rec.backup_pages += src.len() as u64;
        match submitted {
            Ok(events) => {
                self.backups.insert(tid, Backup { events, keys });
            }
            Err(e) => {
                dir.fail(tid, &e.to_string(), true)?;
                rec.failed_backups += 1;
                self.retry.extend(keys);
            }
        }
        Ok(())
    }

    /// Settles every finished load and backup (complete, or fail and queue a backup's retry).
    pub(super) fn poll(&mut self, dir: &Directory, rec: &mut StepRecord) -> Result<()> {
        let done: Vec<TransferId> = self
            .loads
            .iter()
            .filter(|(_, ev)| ev.is_finished())
            .map(|(t, _)| *t)
            .collect();
        for t in done {
            self.settle_load(dir, t, rec)?;
        }
        let done: Vec<TransferId> = self
            .backups
            .iter()
            .filter(|(_, b)| b.events.is_finished())
            .map(|(t, _)| *t)
            .collect();
        for t in done {
            let b = self.backups.remove(&t).expect("listed");
            match first_failure(&b.events) {
                None => dir.backup_complete(t)?,
                Some(reason) => {
                    dir.fail(t, &reason, true)?;
                    rec.failed_backups += 1;
                    self.retry.extend(b.keys);
                }
            }
        }
        Ok(())
    }
}

/// The first failure among a transfer's layers, if any.
fn first_failure(ev: &TransferEvents) -> Option<String> {
    ev.layers().iter().find_map(|&l| match ev.status(l) {
        Ok(LayerStatus::Failed(r)) => Some(r),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    })
}

/// Keeps the keys of `keys` whose objects are still live (one directory lock for them all: a
/// prefill chunk queues thousands).
fn live_only(dir: &Directory, keys: &mut Vec<ObjectKey>) {
    if keys.is_empty() {
        return;
    }
    let live = dir.device_states(keys);
    let mut live = live.iter();
    keys.retain(|_| live.next().is_some_and(Option::is_some));
}
