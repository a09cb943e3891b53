//! Transfers: the loads and backups the directory planned, from submission to their end
//! (complete, backup_complete, fail, transfer_ended), and the backup plan of written pages.

use super::*;

impl Core {
    /// Records that the engine submitted `id`.
    pub fn mark_submitted(&mut self, id: TransferId) -> Result<()> {
        let now = self.now_ns();
        let t = self.in_flight(id, "mark submitted")?;
        t.submitted_ns.get_or_insert(now);
        Ok(())
    }

    pub(super) fn in_flight(&mut self, id: TransferId, op: &'static str) -> Result<&mut Transfer> {
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

    pub(super) fn in_flight_of(
        &mut self,
        id: TransferId,
        kind: TransferKind,
        op: &'static str,
    ) -> Result<()> {
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

    /// Marks `id` finished. Its object list was taken by the caller: a finished transfer
    /// refers to no object, since those may be removed from now on.
    pub(super) fn finish(&mut self, id: TransferId, state: TransferState) {
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
}
