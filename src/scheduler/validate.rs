//! `validate`: the scheduler's invariants (see the `core` module docs), checked against the
//! directory's own, and the kind's (`Tier::validate`).

use super::core::StepScheduler;
use super::tier::Tier;

impl<T: Tier> StepScheduler<T> {
    /// Checks the directory's invariants and the scheduler's own (module docs).
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.dir.validate()?;
        T::validate(self)?;
        let s = self.dir.stats();
        // A plan holds its own pins and those of the prefetch it consumed.
        let held: u64 = self
            .plans
            .values()
            .map(|p| p.pins + p.prefetch.as_ref().map_or(0, |pf| pf.pins))
            .sum::<u64>()
            + self.prefetches.values().map(|p| p.pins).sum::<u64>();
        if held != self.pins {
            return Err(format!(
                "pins counted {} != held by plans {held}",
                self.pins
            ));
        }
        self.validate_kept()?;
        if self.plans.is_empty()
            && self.prefetches.is_empty()
            && (s.pins != self.kept_pins + T::extra_pins(self) || s.handles != 0)
        {
            return Err(format!(
                "no plan or prefetch outstanding, yet {} pins in {} handles",
                s.pins, s.handles
            ));
        }
        let (loads, backups) = self.xfer.in_flight();
        if s.transfers_in_flight > loads + backups {
            return Err(format!(
                "directory has {} transfers in flight, scheduler tracks {}",
                s.transfers_in_flight,
                loads + backups
            ));
        }
        for r in self.requests.values() {
            if r.len % u64::from(self.cfg.page_size) == 0 {
                continue; // the next token starts a page: no page is being written
            }
            for (l, slot) in r.tail.iter().enumerate() {
                let key = r.key((r.len / u64::from(self.cfg.page_size)) as u32, l as u16);
                let ok = self.dir.state(&key).is_some_and(|o| {
                    o.device == crate::directory::DeviceState::Ready { slot: *slot }
                });
                if !ok {
                    return Err(format!(
                        "request {}: tail slot {slot} of layer {l} is not its page",
                        r.id
                    ));
                }
            }
        }
        Ok(())
    }
}
