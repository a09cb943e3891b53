//! Workloads shared by the criterion benches (`benches/directory.rs`) and the Python benchmark
//! (`sparsetier bench directory`), so both time exactly the same work.
//!
//! Each workload keeps its directory in a steady state: every iteration undoes what the timed
//! call did, outside the timed region.

use super::{Directory, DirectoryConfig, LayerGroup, ObjectKey, Resolved};
use crate::error::Result;
use std::time::{Duration, Instant};

/// Bytes of one object in the benches: one 64-token page of one layer of 8 x 128 bf16 K/V.
pub const BENCH_OBJECT_BYTES: u64 = 256 * 1024;

fn keys(ns: u64, n: usize) -> Vec<ObjectKey> {
    (0..n as u32)
        .map(|p| ObjectKey::new(ns, 0, p, LayerGroup::Layer(0)))
        .collect()
}

/// Spreads `misses` indices evenly over `0..n` (a selection's misses are scattered).
fn spread(n: usize, misses: usize) -> Vec<usize> {
    (0..misses).map(|i| i * n / misses.max(1)).collect()
}

/// Resolve of `batch` distinct keys of which a fraction `hit_rate` is Ready on the device
/// and the rest host-only. Reset: the batch's load is failed with `ended` (its objects go
/// back to host-only, slots freed) and the pins released.
pub struct ResolveWorkload {
    dir: Directory,
    keys: Vec<ObjectKey>,
}

impl ResolveWorkload {
    /// Builds the directory and its objects.
    pub fn new(batch: usize, hit_rate: f64) -> Result<Self> {
        let n = batch as u32;
        let dir = Directory::new(DirectoryConfig {
            device_pages: n,
            device_reserve: 0,
            host_pages: n,
            host_reserve: 0,
            object_bytes: BENCH_OBJECT_BYTES,
        })?;
        let all = keys(1, batch);
        dir.allocate(&all)?;
        let plan = dir.backup(&all)?;
        if let Some(t) = plan.transfer {
            dir.backup_complete(t)?;
        }
        let misses = ((1.0 - hit_rate.clamp(0.0, 1.0)) * batch as f64).round() as usize;
        // Make the spread-out misses host-only: evict them by pinning the rest first.
        let miss_idx = spread(batch, misses);
        let mut is_miss = vec![false; batch];
        for &i in &miss_idx {
            is_miss[i] = true;
        }
        let hits: Vec<ObjectKey> = (0..batch)
            .filter(|&i| !is_miss[i])
            .map(|i| all[i])
            .collect();
        let guard = if hits.is_empty() {
            None
        } else {
            Some(dir.resolve(&hits, None)?.handle)
        };
        dir.evict(misses);
        if let Some(h) = guard {
            dir.release(h)?;
        }
        Ok(ResolveWorkload { dir, keys: all })
    }

    /// The directory, for checks.
    pub fn directory(&self) -> &Directory {
        &self.dir
    }

    /// The batch's keys.
    pub fn keys(&self) -> &[ObjectKey] {
        &self.keys
    }

    /// The timed call.
    pub fn resolve(&self) -> Resolved {
        self.dir
            .resolve(&self.keys, None)
            .expect("steady-state batch resolves")
    }

    /// Undoes a resolve: loads failed and ended, pins released.
    pub fn reset(&self, r: &Resolved) {
        for lp in &r.loads {
            self.dir
                .fail(lp.transfer, "bench reset", true)
                .expect("fresh load");
        }
        self.dir.release(r.handle).expect("fresh handle");
    }

    /// Times `iters` resolves (reset excluded) and returns the total.
    pub fn time_resolves(&self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let t = Instant::now();
            let r = self.resolve();
            total += t.elapsed();
            self.reset(&r);
        }
        total
    }
}

/// Resolve under pressure: the device is full of evictable objects, and every key of the
/// batch is host-only, so each load evicts one LRU object. Two key sets take turns.
pub struct PressureWorkload {
    dir: Directory,
    sets: [Vec<ObjectKey>; 2],
    turn: std::cell::Cell<usize>,
}

impl PressureWorkload {
    /// A device of `batch` slots, full of set 0; set 1 host-only.
    pub fn new(batch: usize) -> Result<Self> {
        let n = batch as u32;
        let dir = Directory::new(DirectoryConfig {
            device_pages: n,
            device_reserve: 0,
            host_pages: 2 * n,
            host_reserve: 0,
            object_bytes: BENCH_OBJECT_BYTES,
        })?;
        let sets = [keys(1, batch), keys(2, batch)];
        for set in sets.iter().rev() {
            dir.allocate(set)?;
            if let Some(t) = dir.backup(set)?.transfer {
                dir.backup_complete(t)?;
            }
            if std::ptr::eq(set, &sets[1]) {
                dir.evict(batch);
            }
        }
        Ok(PressureWorkload {
            dir,
            sets,
            turn: std::cell::Cell::new(1),
        })
    }

    /// Times `iters` evicting resolves (complete and release excluded).
    pub fn time_resolves(&self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let set = &self.sets[self.turn.get()];
            let t = Instant::now();
            let r = self.dir.resolve(set, None).expect("evicts the other set");
            total += t.elapsed();
            for lp in &r.loads {
                self.dir.complete(lp.transfer).expect("fresh load");
            }
            self.dir.release(r.handle).expect("fresh handle");
            self.turn.set(1 - self.turn.get());
        }
        total
    }
}

/// `complete` and `release` of a batch of `batch` loads, timed separately.
pub fn time_complete_release(batch: usize, iters: u64) -> Result<(Duration, Duration)> {
    let w = ResolveWorkload::new(batch, 0.0)?;
    let (mut complete, mut release) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..iters {
        let r = w.resolve();
        let t = Instant::now();
        for lp in &r.loads {
            w.dir.complete(lp.transfer)?;
        }
        complete += t.elapsed();
        let t = Instant::now();
        w.dir.release(r.handle)?;
        release += t.elapsed();
        w.dir.evict(batch);
    }
    Ok((complete, release))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_are_steady() {
        let w = ResolveWorkload::new(100, 0.9).unwrap();
        for _ in 0..3 {
            let r = w.resolve();
            assert_eq!((r.metrics.ready, r.metrics.absent), (90, 10));
            w.reset(&r);
            w.directory().validate().unwrap();
        }
        let p = PressureWorkload::new(64).unwrap();
        p.time_resolves(3);
        p.dir.validate().unwrap();
        assert_eq!(p.dir.stats().totals.evictions, 3 * 64 + 64);
        time_complete_release(32, 2).unwrap();
    }
}
