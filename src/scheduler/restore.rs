//! The joined scheduler's side of the restore policy (`restore_policy.rs`): the decision at
//! admission, the bulk restore (full or predicted pages) it may start, and what the policy
//! learns when the request ends.

use super::core::StepScheduler;
use super::record::StepRecord;
use super::request::RequestState;
use super::restore_policy::{RestoreChoice, RestoreDecision, RestoreMode, RestorePolicy};
use super::tier::Tier;
use super::PrefixTier;
use crate::directory::{DeviceState, ObjectHint, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::RequestId;

impl StepScheduler<PrefixTier> {
    /// Sets how prefix hits restore their main KV (`mode`), and what a copy's fixed cost is
    /// worth in bytes in the cost model. The policy starts over: what it learned is dropped.
    pub fn set_restore_policy(&mut self, mode: RestoreMode, copy_overhead: u64) {
        self.tier.policy = RestorePolicy::new(mode, copy_overhead);
    }

    /// The restore policy.
    pub fn restore_policy(&self) -> &RestorePolicy {
        &self.tier.policy
    }

    /// Decides what request `id`'s prefix hit restores of its host-restored pages' main KV
    /// (its Indexer-K is restored either way), for a prefill of `suffix` tokens; starts a bulk
    /// restore (full or predicted pages) if that is the choice.
    pub(super) fn decide_restore(&mut self, id: RequestId, suffix: u64) -> Result<()> {
        let r = &self.requests[&id];
        let (from, to) = (r.restored_from, r.matched);
        if from >= to {
            return Ok(()); // nothing restored from host
        }
        let layers = self.cfg.layers;
        let absent: Vec<u32> = (from..to)
            .map(|p| {
                (0..layers)
                    .filter(|&l| {
                        self.dir
                            .state(&r.key(p, l))
                            .is_some_and(|o| matches!(o.device, DeviceState::Absent))
                    })
                    .count() as u32
            })
            .collect();
        let (d, predicted) = self.tier.policy.decide(
            from,
            to,
            &absent,
            u64::from(layers),
            suffix,
            self.object_bytes(),
        );
        let r = self.requests.get_mut(&id).expect("checked above");
        r.restore = Some(d);
        r.restore_absent = absent;
        match d.choice {
            RestoreChoice::Full if d.absent > 0 => self.restore_pages(id, (from..to).collect())?,
            RestoreChoice::Predicted => self.restore_pages(id, predicted)?,
            _ => {}
        }
        // Counted once it stands (a restore that failed refuses the admission).
        let t = &mut self.tier.totals;
        match d.choice {
            RestoreChoice::IndexerOnly => t.restores_indexer_only += 1,
            RestoreChoice::Full => t.restores_full += 1,
            RestoreChoice::Predicted => t.restores_predicted += 1,
        }
        Ok(())
    }

    /// Loads the main KV of request `id`'s host-restored `pages` that is not on the device:
    /// one submission per layer, unpinned once submitted (the prefill finds it Ready or
    /// joins its load). Stops at the first layer the device cannot hold (the rest loads on
    /// demand).
    fn restore_pages(&mut self, id: RequestId, pages: Vec<u32>) -> Result<()> {
        let key_rids = vec![id; pages.len()];
        let (mut loaded, mut submissions) = (0, 0);
        for l in 0..self.cfg.layers {
            let r = &self.requests[&id];
            let keys: Vec<ObjectKey> = pages.iter().map(|&p| r.key(p, l)).collect();
            let hints: Vec<ObjectHint> = pages.iter().map(|&p| r.hint(p, l)).collect();
            // (What the device resolver's pool holds is adopted there, not loaded again.)
            self.adopt_pooled(&keys, &hints)?;
            let mut res = self.dir.prefetch_loads(&keys, &hints);
            if let Err(e @ Error::OutOfSlots { .. }) = &res {
                if self.reclaim_for(e)? {
                    res = self.dir.prefetch_loads(&keys, &hints);
                }
            }
            let res = match res {
                Ok(res) => res,
                Err(Error::OutOfSlots { .. }) => {
                    self.tier.totals.restores_partial += 1;
                    break;
                }
                Err(e) => return Err(e),
            };
            // (The device resolver's mirror learns where they land at its next grant.)
            <PrefixTier as Tier>::count_loads(self, l, &keys, &res.loaded, &pages, &key_rids);
            let mut rec = StepRecord::default();
            if let Some(lp) = res.loads.first() {
                self.xfer.submit_load(
                    &self.dir,
                    lp.transfer,
                    &lp.host_slots,
                    &lp.device_slots,
                    l,
                    &mut rec,
                );
                submissions += 1;
            }
            self.rec.fold(&rec);
            loaded += res.metrics.absent;
            self.dir.release(res.handle)?;
        }
        let r = self.requests.get_mut(&id).expect("checked above");
        r.restore_loaded = loaded;
        r.restore_submissions = submissions;
        Ok(())
    }

    /// Request `id`'s restore so far: its decision, the objects of its host-restored pages it
    /// has loaded (each once; a bulk restore's at admission included), and what it waited.
    /// None when its admission restored nothing from host.
    pub fn restore_status(&self, id: RequestId) -> Result<Option<RestoreStatus>> {
        let r = self
            .requests
            .get(&id)
            .ok_or_else(|| Error::config("rid", id, "a running request"))?;
        Ok(r.restore.map(|d| RestoreStatus {
            decision: d,
            loaded: seen(r).max(r.restore_loaded),
            bulk_loaded: r.restore_loaded,
            bulk_submissions: r.restore_submissions,
            on_demand: seen_on_demand(r),
            exposed_wait_ns: r.exposed_wait_ns,
        }))
    }

    /// What request `r`, ending, teaches the policy and the record: a request that completed
    /// (`completed`: its pages inserted) after an Indexer-K-only restore is a coverage and
    /// position sample; each decision's prediction is compared with what it loaded.
    pub(super) fn learn_restore(&mut self, r: &RequestState, completed: bool) {
        let Some(d) = r.restore else {
            return;
        };
        if !completed {
            return; // cut short: what it loaded says nothing of what it would have
        }
        let known = |x: f64| (!x.is_nan()).then(|| x.round() as u64);
        let p = d.predicted;
        let (predicted, loaded) = match d.choice {
            RestoreChoice::IndexerOnly => {
                let layers = self.cfg.layers as usize;
                let loaded: Vec<u32> = (r.restored_from..r.matched)
                    .map(|page| {
                        (0..layers)
                            .filter(|&l| {
                                let bit = page as usize * layers + l;
                                r.prefix_seen[bit / 64] & (1 << (bit % 64)) != 0
                            })
                            .count() as u32
                    })
                    .collect();
                self.tier.policy.learn(
                    d.suffix,
                    r.restored_from,
                    r.matched,
                    &r.restore_absent,
                    &loaded,
                );
                (known(p.indexer), seen(r))
            }
            RestoreChoice::Full => (Some(d.absent), r.restore_loaded),
            RestoreChoice::Predicted => (known(p.predicted), seen(r)),
        };
        let t = &mut self.tier.totals;
        if let Some(pr) = predicted {
            t.restore_objects_predicted += pr;
            t.restore_objects_loaded += loaded;
            t.restore_model_abs_error += pr.abs_diff(loaded);
        }
        t.restore_objects_if_indexer += known(p.indexer).unwrap_or(0);
        t.restore_objects_if_full += d.absent;
        // No page predicted: that choice is Indexer-K only.
        t.restore_objects_if_predicted += known(p.predicted).or(known(p.indexer)).unwrap_or(0);
    }
}

/// The objects of a request's host-restored pages it loaded, each once.
fn seen(r: &RequestState) -> u64 {
    r.prefix_seen
        .iter()
        .map(|w| u64::from(w.count_ones()))
        .sum()
}

/// Of those, the ones first loaded after admission (as selections named them, or a prefetch
/// ahead of them), each once.
fn seen_on_demand(r: &RequestState) -> u64 {
    seen(r).saturating_sub(r.restore_loaded)
}

/// A running request's restore: its decision, and what it moved and waited so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestoreStatus {
    /// The decision at admission, with its predictions.
    pub decision: RestoreDecision,
    /// Objects of its host-restored pages loaded so far, each once.
    pub loaded: u64,
    /// Of those, loaded in bulk at admission (a full or predicted restore), in
    /// `bulk_submissions` submissions (one a layer).
    pub bulk_loaded: u64,
    /// (See `bulk_loaded`.)
    pub bulk_submissions: u64,
    /// Loaded first after admission (as its selections named them), each once.
    pub on_demand: u64,
    /// Time its prefill and decode layers waited on loads and restores, on the host (each
    /// decode wait counts for every request of the step).
    pub exposed_wait_ns: u64,
}
