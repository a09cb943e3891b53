//! The invariants of the module docs, checked from scratch (after every step of the
//! state-machine tests).

use super::*;

impl Core {
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
        for s in self.granted.iter() {
            let s = &s;
            if dev_owner.contains_key(s) || !self.device.is_allocated(s.page()) {
                return Err(format!("granted slot {s} is held by an object or free"));
            }
        }
        let gd = self.granted.len();
        if dev_owner.len() + qd + gd + self.device.free_count() != self.device.capacity() {
            return Err(format!(
                "device: held {} + quarantined {qd} + granted {gd} + free {} != capacity {}",
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
