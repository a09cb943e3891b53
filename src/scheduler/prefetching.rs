//! Prefetch: at each plan, the layer `prefetch_depth` ahead loads what each request selected
//! there last step and is now on host only, and pins it until that layer's plan consumes it.
//! Best effort: skipped when the device cannot hold it; what no plan consumed is counted
//! wasted when the step ends.

use super::core::{ns, Prefetch, StepScheduler, NONE};
use super::record::StepRecord;
use super::tier::Tier;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use rustc_hash::FxHashMap;
use std::time::Instant;

impl<T: Tier> StepScheduler<T> {
    /// Loads (and pins until `plan(layer)` finishes) what each request of `rids` selected at
    /// `layer` last step and is now on host only; pages still on the device are left alone
    /// (not pinned: the plan pins them if they are still there). Best effort: skipped when the
    /// device cannot hold it.
    pub(super) fn prefetch(&mut self, layer: u16, rids: &[RequestId]) -> Result<()> {
        let t = Instant::now();
        let r = self.prefetch_layer(layer, rids);
        self.rec.cpu_prefetch_ns += ns(t.elapsed());
        r
    }

    pub(super) fn prefetch_layer(&mut self, layer: u16, rids: &[RequestId]) -> Result<()> {
        if self.prefetches.contains_key(&layer) {
            return Ok(());
        }
        let ps = self.cfg.page_size;
        let mut keys = Vec::new();
        let mut hints = Vec::new();
        let mut rows = FxHashMap::default();
        let mut from_prefix = Vec::new();
        let mut key_rids = Vec::new();
        for id in rids {
            let Some(r) = self.requests.get(id) else {
                continue;
            };
            let pages = r.pages(ps);
            // Kept pages are held on the device: only the rest may need a load. (Kept plans
            // leave only unkept pages here; an unkept plan of a layer with kept lists, one
            // planned while another was outstanding, may not.)
            let kept = self.kept.list(layer as usize, r.kept_slot);
            let mut kc = 0;
            let predicted: Vec<u32> = r.last_selection[layer as usize]
                .iter()
                .copied()
                .filter(|&p| {
                    while kc < kept.len() && kept[kc].page < p {
                        kc += 1;
                    }
                    p < pages && kept.get(kc).is_none_or(|k| k.page != p)
                })
                .collect();
            keys.extend(predicted.iter().map(|&p| r.key(p, layer)));
            hints.extend(predicted.iter().map(|&p| r.hint(p, layer)));
            from_prefix.extend(
                predicted
                    .iter()
                    .map(|&p| if p < r.matched { p } else { NONE }),
            );
            key_rids.extend(predicted.iter().map(|_| *id));
            rows.insert(*id, (predicted, Vec::new()));
        }
        if keys.is_empty() {
            return Ok(());
        }
        let res = match self.dir.prefetch_loads(&keys, &hints) {
            Ok(r) => r,
            Err(Error::OutOfSlots { .. }) => {
                self.rec.prefetch_skipped += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if T::JOINED {
            T::count_loads(self, layer, &keys, &res.loaded, &from_prefix, &key_rids);
        }
        let mut rec = StepRecord {
            prefetch_predicted: keys.len() as u64,
            prefetch_loaded: res.metrics.absent,
            ..Default::default()
        };
        if let Some(lp) = res.loads.first() {
            let mut i = 0;
            for id in rids {
                let Some((predicted, loaded)) = rows.get_mut(id) else {
                    continue;
                };
                for &p in predicted.iter() {
                    if res.loaded[i] {
                        loaded.push(p);
                    }
                    i += 1;
                }
            }
            self.xfer.submit_load(
                &self.dir,
                lp.transfer,
                &lp.host_slots,
                &lp.device_slots,
                layer,
                &mut rec,
            );
        }
        self.rec.fold(&rec);
        let pins = res.metrics.distinct;
        self.pins += pins;
        self.prefetch_pins += pins;
        self.rec.pinned_peak = self.rec.pinned_peak.max(self.pins);
        self.rec.prefetch_pinned_peak = self.rec.prefetch_pinned_peak.max(self.prefetch_pins);
        self.prefetches.insert(
            layer,
            Prefetch {
                handle: res.handle,
                pins,
                rows,
            },
        );
        Ok(())
    }

    pub(super) fn drop_prefetch(&mut self, layer: u16) -> Result<()> {
        if let Some(pf) = self.prefetches.remove(&layer) {
            let wasted: u64 = pf.rows.values().map(|(_, l)| l.len() as u64).sum();
            self.rec.prefetch_wasted += wasted;
            self.rec.prefetch_wasted_bytes += wasted * self.object_bytes();
            self.dir.release(pf.handle)?;
            self.pins -= pf.pins;
            self.prefetch_pins -= pf.pins;
        }
        Ok(())
    }
}
