//! `ready`: makes a layer plan's data readable (an event wait, or a CUDA stream wait), and
//! the recovery of its failed loads: retried once, then the rows still without their data
//! reported failed, the rest of the batch going on.

use super::core::{ns, ReadyOutcome, StepScheduler};
use super::record::StepRecord;
use super::tier::Tier;
use crate::directory::ObjectKey;
use crate::error::Result;
use crate::ids::LayerPlanId;
use std::time::{Duration, Instant};

impl<T: Tier> StepScheduler<T> {
    /// Makes the plan's data readable: on the cpu engine, waits for every transfer the plan
    /// depends on; with `stream` (a CUDA engine), makes that stream wait on the GPU instead.
    /// A failed load is retried once; rows still without their data are reported failed.
    pub fn ready(&mut self, id: LayerPlanId, stream: Option<u64>) -> Result<ReadyOutcome> {
        let t0 = Instant::now();
        self.xfer.engine.check_stream(stream)?;
        let plan = self.plan_ref(id)?;
        if plan.ready {
            return Ok(ReadyOutcome::default());
        }
        let transfers = plan.transfers.clone();
        let mut waited = Duration::ZERO;
        let mut failed = false;
        for tid in &transfers {
            if let Some(ev) = self.xfer.load(*tid) {
                match stream {
                    Some(s) if !ev.is_finished() => {
                        self.xfer.engine.stream_wait(ev, 0, s)?;
                        continue;
                    }
                    _ => {
                        let w = Instant::now();
                        let _ = ev.wait_all(None);
                        waited += w.elapsed();
                    }
                }
                self.settle_load(*tid)?;
            }
            failed |= matches!(self.dir.outcome(*tid), Ok(Some(Err(_))));
        }
        let mut out = ReadyOutcome::default();
        if failed {
            waited += self.recover(id, &mut out)?;
        }
        let plan = self.plans.get_mut(&id).expect("checked above");
        plan.ready = true;
        plan.counts.exposed_wait_ns = waited.as_nanos() as u64;
        if !waited.is_zero() {
            // Every request of the plan waited (a restore's choice shows in its own); not a
            // request started again under an id the plan named.
            for (rid, &serial) in plan.rids.iter().zip(&plan.serials) {
                match self.requests.get_mut(rid) {
                    Some(r) if r.serial == serial => r.exposed_wait_ns += waited.as_nanos() as u64,
                    _ => {}
                }
            }
        }
        if let Some(s) = plan.submitted_at {
            self.rec.transfer_ns += s.elapsed().as_nanos() as u64;
        }
        self.rec.exposed_wait_ns += waited.as_nanos() as u64;
        self.rec.ready_ns = self.since(Instant::now());
        // A request that fails at several layers of one step counts once.
        for (_, rid, _) in &out.failed {
            if self.failed_this_step.insert(*rid) {
                self.rec.failed_requests += 1;
            }
        }
        let cpu = ns(t0.elapsed().saturating_sub(waited));
        self.rec.cpu_ready_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok(out)
    }

    /// Retries the plan's objects whose load failed, once; reports the rows that still lack
    /// their data. Returns the time blocked.
    pub(super) fn recover(&mut self, id: LayerPlanId, out: &mut ReadyOutcome) -> Result<Duration> {
        let plan = &self.plans[&id];
        let layer = plan.layer;
        let mut lost: Vec<u32> = Vec::new();
        for (i, k) in plan.keys.iter().enumerate() {
            if self
                .dir
                .state(k)
                .is_some_and(|s| s.device == crate::directory::DeviceState::Absent)
            {
                lost.push(i as u32);
            }
        }
        if lost.is_empty() {
            return Ok(Duration::ZERO);
        }
        let keys: Vec<ObjectKey> = lost.iter().map(|&i| plan.keys[i as usize]).collect();
        let mut waited = Duration::ZERO;
        let mut reason = String::new();
        let retried = match self.dir.resolve(&keys, None) {
            Ok(res) => {
                let plan = self.plans.get_mut(&id).expect("outstanding");
                plan.handles.push(res.handle);
                plan.pins += res.metrics.distinct;
                self.pins += res.metrics.distinct;
                let mut rec = StepRecord::default();
                let deps = self.xfer.submit_resolved(&self.dir, &res, layer, &mut rec);
                rec.retried_loads = 1;
                self.rec.fold(&rec);
                let mut ok = true;
                for tid in deps {
                    if let Some(ev) = self.xfer.load(tid) {
                        let w = Instant::now();
                        let _ = ev.wait_all(None);
                        waited += w.elapsed();
                        self.settle_load(tid)?;
                    }
                    if let Ok(Some(Err(e))) = self.dir.outcome(tid) {
                        ok = false;
                        reason = e.to_string();
                    }
                }
                ok.then_some(res.slots)
            }
            Err(e) => {
                reason = e.to_string();
                None
            }
        };
        let plan = self.plans.get_mut(&id).expect("outstanding");
        match retried {
            Some(slots) => {
                let mut new_slot = vec![-1i32; plan.keys.len()];
                for (n, &i) in lost.iter().enumerate() {
                    new_slot[i as usize] = slots[n].raw() as i32;
                }
                for &i in &lost {
                    let key = i as usize;
                    plan.key_slot[key] = new_slot[key];
                    out.moved.push((plan.key_cell[key], new_slot[key]));
                }
                out.moved.extend(
                    plan.repeats
                        .cells_of(|key| Some(new_slot[key]).filter(|&s| s >= 0)),
                );
                if let Some(table) = plan.table.as_mut() {
                    for &(at, slot) in &out.moved {
                        table[at as usize] = slot;
                    }
                }
                out.slots_changed = true;
            }
            None => {
                let mut rows: Vec<u32> = lost.iter().map(|&i| plan.key_row[i as usize]).collect();
                rows.sort_unstable();
                rows.dedup();
                for &b in &rows {
                    plan.failed.push(b);
                    let b = b as usize;
                    let cells = plan.form.row_cells(b);
                    if let Some(table) = plan.table.as_mut() {
                        table[cells.clone()].fill(-1);
                    }
                    out.failed_cells
                        .push((cells.start as u32, cells.end as u32));
                    // A request that ended since the plan has nothing left to fail, and a
                    // new one under its id did not fail: its row's cells are only emptied.
                    let serial = self.requests.get(&plan.rids[b]).map(|r| r.serial);
                    if serial == Some(plan.serials[b]) {
                        out.failed.push((b, plan.rids[b], reason.clone()));
                    }
                }
                out.slots_changed = true;
            }
        }
        Ok(waited)
    }
}
