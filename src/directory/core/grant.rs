//! Slots granted to a device resolver. A device resolver serves a decode step's misses on the
//! device: it copies each missing object from its host copy into a slot the core granted
//! before the step, and logs what it did; the core adopts those objects from the log a step
//! behind. So that the resolver's view of the device (its mirror) never names a slot that was
//! reused, the directory logs every object that loses its device slot while the log is on
//! (but the victims the device took: it cleared those from its mirror itself).
//!
//! Granted slots are out of the free list and held by no object until adopted or returned:
//! page conservation counts them (`validate`).

use super::*;

impl Core {
    /// Takes `n` device slots for a device resolver, evicting least recently used objects if
    /// the free ones are too few; all or nothing (`OutOfSlots` before anything changes).
    pub fn grant_slots(&mut self, n: usize) -> Result<Vec<SlotId>> {
        let (free, evictable) = self.device_available(0);
        if free + evictable < n {
            return Err(Error::OutOfSlots {
                tier: "device",
                requested: n,
                free,
                evictable,
            });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let s = self.take_device_slot();
            self.granted.insert(s);
            out.push(s);
        }
        Ok(out)
    }

    /// Up to `n` least recently used evictable objects the device may evict: each stays
    /// device-Ready (and readable) but is pinned, out of the host's reach, until the core
    /// takes it ([`Self::take_victim`]: the device evicted it) or gives it back
    /// ([`Self::unhold`]). Returns (object index, key, slot) in eviction order.
    ///
    /// Objects the last device step read get a second chance, as from the host's own
    /// evictions ([`Self::second_chance`]), once a published bitmap but with no bound a victim:
    /// what the device read it will likely read again, and each victim it reads again is a
    /// copy (`benches/RESULTS.md` has what a bound cost).
    pub fn grant_victims(&mut self, n: usize) -> Vec<(u32, ObjectKey, SlotId)> {
        let mut out = Vec::with_capacity(n.min(self.lru.len()));
        let mut given = 0;
        while out.len() < n {
            // Victims come in runs: fetch the ones ahead (the object and its key).
            let objects = &mut self.objects;
            let mut popped_seq = 0;
            let popped = self.lru.pop_front_ahead(PREFETCH_AHEAD, |i, seq, ahead| {
                if let Some(a) = ahead {
                    objects.prefetch(a);
                    objects.prefetch_side(a);
                }
                popped_seq = seq;
                take_lru_entry(objects, i, seq)
            });
            let Some(idx) = popped else {
                break;
            };
            if self.second_chance(idx, popped_seq, &mut given, u32::MAX) {
                continue;
            }
            let obj = &mut self.objects[idx];
            let DeviceState::Ready { slot } = obj.device else {
                unreachable!("LRU list holds only device-Ready objects")
            };
            obj.pins += 1;
            obj.held += 1;
            out.push((idx as u32, self.objects.side_of(idx).key, slot));
        }
        self.totals.grant_second_chances += u64::from(given);
        out
    }

    /// The device evicted victim `idx` (granted by [`Self::grant_victims`]) and reused its
    /// `slot`: the object becomes device-Absent and the slot a granted one, for
    /// [`Self::adopt`] or [`Self::return_slots`].
    pub fn take_victim(&mut self, idx: u32, slot: SlotId) -> Result<()> {
        let i = idx as usize;
        match self.objects.get(i) {
            Some(o) if o.held > 0 && o.device == (DeviceState::Ready { slot }) => {}
            _ => {
                return Err(Error::config(
                    "victim",
                    idx,
                    "a granted victim, device-Ready at its slot",
                ))
            }
        }
        let obj = &mut self.objects[i];
        obj.held -= 1;
        obj.pins -= 1;
        obj.device = DeviceState::Absent;
        self.totals.evictions += 1;
        self.granted.insert(slot);
        // Not logged as a release: the device that took it cleared it from its mirror.
        self.settle(i);
        Ok(())
    }

    /// [`Self::take_victim`] for each (object index, slot), the objects fetched ahead.
    pub fn take_victims(&mut self, victims: &[(u32, SlotId)]) -> Result<()> {
        for &(idx, _) in victims.iter().take(PREFETCH_AHEAD) {
            self.objects.prefetch(idx as usize);
        }
        for (n, &(idx, slot)) in victims.iter().enumerate() {
            if let Some(&(ahead, _)) = victims.get(n + PREFETCH_AHEAD) {
                self.objects.prefetch(ahead as usize);
            }
            self.take_victim(idx, slot)?;
        }
        Ok(())
    }

    /// [`Self::adopt_hinted`] for each (key, hint, slot), the hinted objects fetched ahead:
    /// whether each was adopted.
    pub fn adopt_all(&mut self, entries: &[(ObjectKey, ObjectHint, SlotId)]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(entries.len());
        for &(_, hint, _) in entries.iter().take(PREFETCH_AHEAD) {
            if hint != ObjectHint::NONE {
                self.objects.prefetch(hint.index() as usize);
            }
        }
        for (n, &(key, hint, slot)) in entries.iter().enumerate() {
            if let Some(&(_, ahead, _)) = entries.get(n + PREFETCH_AHEAD) {
                if ahead != ObjectHint::NONE {
                    self.objects.prefetch(ahead.index() as usize);
                }
            }
            out.push(self.adopt_hinted(&key, hint, slot)?);
        }
        Ok(out)
    }

    /// Gives back granted slots the resolver did not fill.
    pub fn return_slots(&mut self, slots: &[SlotId]) -> Result<()> {
        if let Some(&s) = slots.iter().find(|s| !self.granted.contains(s)) {
            return Err(Error::config("slots", s, "slots granted and not adopted"));
        }
        for s in slots {
            self.granted.remove(s);
            self.device
                .free(&[s.page()])
                .expect("a granted slot is allocated");
        }
        Ok(())
    }

    /// Device slots free, in O(1).
    pub fn device_free(&self) -> usize {
        self.device.free_count()
    }

    /// Whether object `idx` is a granted victim: held, and device-Ready at `slot` (checks).
    pub fn is_held_at(&self, idx: u32, slot: SlotId) -> bool {
        self.objects
            .get(idx as usize)
            .is_some_and(|o| o.held > 0 && o.device == (DeviceState::Ready { slot }))
    }

    /// Whether `slot` is granted and neither adopted nor returned.
    pub fn is_granted(&self, slot: SlotId) -> bool {
        self.granted.contains(&slot)
    }

    /// Slots granted and neither adopted nor returned.
    pub fn granted(&self) -> usize {
        self.granted.len()
    }

    /// The device copied object `key` from its host copy into granted `slot`: the object
    /// becomes device-Ready there, unpinned and evictable. Returns false, changing nothing,
    /// when the object is not device-Absent with a host copy (it came to the device by
    /// another way meanwhile, or is gone): the caller returns the slot. `key` must name a live
    /// object and `slot` a granted one.
    pub fn adopt(&mut self, key: &ObjectKey, slot: SlotId) -> Result<bool> {
        self.adopt_hinted(key, ObjectHint::NONE, slot)
    }

    /// [`Self::adopt`], with where the object was (`hint`, from [`Self::index_of`]): a hint
    /// whose generation still holds spares the key lookup.
    pub fn adopt_hinted(
        &mut self,
        key: &ObjectKey,
        hint: ObjectHint,
        slot: SlotId,
    ) -> Result<bool> {
        if !self.granted.contains(&slot) {
            return Err(Error::config(
                "slot",
                slot,
                "a slot granted and not adopted",
            ));
        }
        let i = hint.index() as usize;
        let idx = if hint != ObjectHint::NONE
            && self
                .objects
                .get_versioned(i, hint.generation())
                .is_some_and(|o| !o.dropped)
        {
            debug_assert_eq!(self.objects.side_of(i).key, *key, "a hint of another key");
            i
        } else {
            let Some(&idx) = self.index.get(key) else {
                return Ok(false);
            };
            idx
        };
        let obj = &mut self.objects[idx];
        if obj.device != DeviceState::Absent
            || !matches!(obj.host, HostState::Ready { .. })
            || obj.dropped
        {
            return Ok(false);
        }
        self.granted.remove(&slot);
        obj.device = DeviceState::Ready { slot };
        obj.stamp = self.clock;
        self.totals.loads_completed += 1;
        self.settle(idx);
        Ok(true)
    }

    /// Starts (or stops, discarding it) the log of objects that lose their device slot.
    pub fn log_releases(&mut self, on: bool) {
        self.released = on.then(Vec::new);
    }

    /// The objects that lost their device slot since the last call (eviction or removal),
    /// with the slot each held.
    pub fn take_releases(&mut self) -> Vec<(ObjectKey, SlotId)> {
        match self.released.as_mut() {
            Some(v) => std::mem::take(v),
            None => Vec::new(),
        }
    }

    /// The releases logged and not yet taken (for checks).
    pub fn pending_releases(&self) -> Vec<(ObjectKey, SlotId)> {
        self.released.clone().unwrap_or_default()
    }

    /// Logs that object `idx` gave up device `slot`, while the log is on.
    #[inline]
    pub(super) fn log_release(&mut self, idx: usize, slot: SlotId) {
        if let Some(v) = self.released.as_mut() {
            v.push((self.objects.side_of(idx).key, slot));
        }
    }
}
