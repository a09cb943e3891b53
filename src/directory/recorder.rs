//! The journal as a layer around the directory's core: [`Recorded`] forwards every call to
//! [`Core`] and, while a journal is recording (`start_journal`), writes each call that
//! succeeded into it (inputs and the ids its result handed out), for `sparsetier replay`.
//! The core's transitions know nothing of it. Calls the journal does not record (holds, state
//! reads) reach the core through `Deref`.

use super::core::Core;
use super::journal::{Journal, Op};
use super::transfer::TransferKind;
use super::{BackupPlan, Namespace, ObjectHint, ObjectKey, ResolveMetrics, Resolved};
use crate::error::Result;
use crate::ids::{HostSlotId, PinHandleId, SlotId, TransferId};
use std::ops::{Deref, DerefMut};

/// A directory core with its journal, when one records.
#[derive(Debug)]
pub struct Recorded {
    core: Core,
    journal: Option<Journal>,
}

impl Deref for Recorded {
    type Target = Core;

    fn deref(&self) -> &Core {
        &self.core
    }
}

impl DerefMut for Recorded {
    fn deref_mut(&mut self) -> &mut Core {
        &mut self.core
    }
}

impl Recorded {
    pub fn new(core: Core) -> Self {
        Recorded {
            core,
            journal: None,
        }
    }

    /// Starts recording every call into a fresh journal (see [`Journal`]).
    pub fn start_journal(&mut self) {
        let (object_bytes, device_slots) = self.core.journal_geometry();
        self.journal = Some(Journal::new(object_bytes, device_slots));
    }

    /// Stops recording and returns the journal, if one was recording.
    pub fn take_journal(&mut self) -> Option<Journal> {
        self.journal.take()
    }

    /// Whether a journal is being recorded (held pins are not journaled: a caller that
    /// journals must not hold).
    pub fn journaling(&self) -> bool {
        self.journal.is_some()
    }

    /// Marks the end of a decode step in the journal.
    pub fn journal_step(&mut self) {
        if let Some(j) = self.journal.as_mut() {
            j.push(Op::Step, 0, 0, &[], None);
        }
    }

    /// See [`Core::allocate`].
    pub fn allocate(&mut self, keys: &[ObjectKey]) -> Result<Vec<SlotId>> {
        let slots = self.core.allocate(keys)?;
        if let Some(j) = self.journal.as_mut() {
            j.push(Op::Alloc, 0, 0, keys, None);
        }
        Ok(slots)
    }

    /// See [`Core::allocate_homed`].
    pub fn allocate_homed(
        &mut self,
        keys: &[ObjectKey],
        homes: &[HostSlotId],
    ) -> Result<Vec<SlotId>> {
        let slots = self.core.allocate_homed(keys, homes)?;
        if let Some(j) = self.journal.as_mut() {
            j.push(Op::Alloc, 0, 0, keys, Some(homes));
        }
        Ok(slots)
    }

    /// See [`Core::register_host`]: how many objects it created.
    pub fn register_host(&mut self, keys: &[ObjectKey], homes: &[HostSlotId]) -> Result<usize> {
        let fresh = self.core.register_host(keys, homes)?;
        if let (Some(j), false) = (self.journal.as_mut(), fresh.is_empty()) {
            let keys: Vec<ObjectKey> = fresh.iter().map(|&(k, _)| k).collect();
            let homes: Vec<HostSlotId> = fresh.iter().map(|&(_, h)| h).collect();
            j.push(Op::Register, 0, 0, &keys, Some(&homes));
        }
        Ok(fresh.len())
    }

    /// See [`Core::resolve`].
    pub fn resolve(&mut self, keys: &[ObjectKey], bytes_needed: Option<u64>) -> Result<Resolved> {
        self.resolve_hinted(keys, None, bytes_needed)
    }

    /// See [`Core::resolve_hinted`].
    pub fn resolve_hinted(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
        bytes_needed: Option<u64>,
    ) -> Result<Resolved> {
        let r = self.core.resolve_hinted(keys, hints, bytes_needed)?;
        self.record_resolve(Op::Resolve, keys, &r);
        Ok(r)
    }

    /// See [`Core::prefetch_loads`].
    pub fn prefetch_loads(
        &mut self,
        keys: &[ObjectKey],
        hints: Option<&[ObjectHint]>,
    ) -> Result<Resolved> {
        let r = self.core.prefetch_loads(keys, hints)?;
        self.record_resolve(Op::Prefetch, keys, &r);
        Ok(r)
    }

    fn record_resolve(&mut self, op: Op, keys: &[ObjectKey], r: &Resolved) {
        if let Some(j) = self.journal.as_mut() {
            let ord = j.resolves;
            j.resolves += 1;
            j.handle_ord.insert(r.handle, ord);
            if let Some(lp) = r.loads.first() {
                j.load_ord.insert(lp.transfer, ord);
            }
            j.push(op, ord, 0, keys, None);
        }
    }

    /// See [`Core::release`].
    pub fn release(&mut self, handle: PinHandleId) -> Result<ResolveMetrics> {
        let m = self.core.release(handle)?;
        if let Some(j) = self.journal.as_mut() {
            if let Some(ord) = j.handle_ord.remove(&handle) {
                j.push(Op::Release, ord, 0, &[], None);
            }
        }
        Ok(m)
    }

    /// See [`Core::complete`].
    pub fn complete(&mut self, id: TransferId) -> Result<()> {
        self.core.complete(id)?;
        self.record_transfer(Op::Complete, id, 0);
        Ok(())
    }

    /// See [`Core::backup_complete`].
    pub fn backup_complete(&mut self, id: TransferId) -> Result<()> {
        self.core.backup_complete(id)?;
        self.record_transfer(Op::BackupDone, id, 0);
        Ok(())
    }

    /// See [`Core::fail`] (with `ended`, it also ends the transfer, recorded after it).
    pub fn fail(&mut self, id: TransferId, reason: &str, ended: bool) -> Result<()> {
        let kind = self.core.transfer_kind(id);
        self.core.fail(id, reason, ended)?;
        let backup = kind == Some(TransferKind::Backup);
        let op = if backup { Op::FailBackup } else { Op::FailLoad };
        self.record_transfer(op, id, u32::from(ended));
        if ended {
            self.record_transfer(Op::Ended, id, u32::from(backup));
        }
        Ok(())
    }

    /// See [`Core::transfer_ended`].
    pub fn transfer_ended(&mut self, id: TransferId) -> Result<()> {
        let backup = self.core.transfer_kind(id) == Some(TransferKind::Backup);
        self.core.transfer_ended(id)?;
        self.record_transfer(Op::Ended, id, u32::from(backup));
        Ok(())
    }

    fn record_transfer(&mut self, op: Op, id: TransferId, flag: u32) {
        if let Some(j) = self.journal.as_mut() {
            let ord = match op {
                Op::Complete | Op::FailLoad => j.load_ord.get(&id),
                Op::BackupDone | Op::FailBackup => j.backup_ord.get(&id),
                _ if flag == 1 => j.backup_ord.get(&id),
                _ => j.load_ord.get(&id),
            };
            if let Some(&ord) = ord {
                j.push(op, ord, flag, &[], None);
            }
        }
    }

    /// See [`Core::backup`].
    pub fn backup(&mut self, keys: &[ObjectKey]) -> Result<BackupPlan> {
        let plan = self.core.backup(keys)?;
        if let Some(j) = self.journal.as_mut() {
            let ord = j.backups;
            j.backups += 1;
            j.push(Op::Backup, ord, 0, keys, None);
            if let Some(tid) = plan.transfer {
                j.backup_ord.insert(tid, ord);
            }
        }
        Ok(plan)
    }

    /// See [`Core::evict`].
    pub fn evict(&mut self, n: usize) -> Vec<ObjectKey> {
        if let Some(j) = self.journal.as_mut() {
            j.push(Op::Evict, n as u64, 0, &[], None);
        }
        self.core.evict(n)
    }

    /// See [`Core::drop_namespace`].
    pub fn drop_namespace(&mut self, ns: Namespace) -> Result<(usize, usize)> {
        let r = self.core.drop_namespace(ns)?;
        if let Some(j) = self.journal.as_mut() {
            j.push(Op::Drop, ns.id, ns.version, &[], None);
        }
        Ok(r)
    }
}
