//! Resolve: a batch of keys to device slots, pinned under one handle, with one load
//! transfer for every absent object (staged first, so a refusal changes nothing), and the
//! prefetch variant that pins nothing it does not load.

use super::*;

impl Core {
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

    pub(super) fn resolve_inner(
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
    pub(super) fn stage_resolve(
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
    pub(super) fn prefetch_object(&self, idx: usize) {
        self.objects.prefetch(idx);
    }

    pub(super) fn commit_resolve(
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
}
