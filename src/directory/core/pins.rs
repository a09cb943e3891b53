//! Pins: the handles a resolve hands out (release), and the objects a caller holds across
//! steps without a handle (hold, unhold: the scheduler's kept selections).

use super::*;

impl Core {
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
}
