//! The decode-step workload shared by the criterion bench (`benches/scheduler.rs`): the Rust
//! half of `sparsetier bench decode`, with the same synthetic selections (sink, last block,
//! and blocks that stay from one step to the next with probability `locality`).
//!
//! Pools are one-layer KV pools of 1 head x 1 dim bf16 (256 B per 64-token object): the
//! scheduling work per key does not depend on the bytes, and the copies run on the cpu
//! engine's worker thread (DMA on a GPU), outside the measured CPU time.

use super::{SchedulerConfig, SelectionUnit, StepScheduler};
use crate::error::Result;
use crate::ids::RequestId;
use crate::layout::{Component, Dtype};
use crate::pool::PoolSpec;
use crate::testing::XorShift;
use crate::transfer::CpuEngine;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The shape of a decode-step workload.
#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    /// Model layers.
    pub layers: u16,
    /// Requests in the batch.
    pub batch: usize,
    /// Tokens per page (= selection block).
    pub page_size: u32,
    /// Shortest and longest context.
    pub context: (u64, u64),
    /// Device slots as a share of all objects.
    pub budget: f64,
    /// Blocks selected per request per layer (sink and last block included).
    pub blocks: usize,
    /// Probability that a selected block stays from one step to the next.
    pub locality: f64,
    /// Prefetch on.
    pub prefetch: bool,
}

impl DecodeShape {
    /// DeepSeek-V3.2's decode shape: 61 layers, batch 64, 64-token pages, 32k-128k contexts,
    /// 25% of the main KV on the device, 32 blocks per request per layer.
    pub fn deepseek_v32() -> Self {
        DecodeShape {
            layers: 61,
            batch: 64,
            page_size: 64,
            context: (32 * 1024, 128 * 1024),
            budget: 0.25,
            blocks: 32,
            locality: 0.9,
            prefetch: false,
        }
    }
}

/// A scheduler with `batch` prefilled requests and a selection generator.
pub struct DecodeWorkload {
    shape: DecodeShape,
    sched: StepScheduler,
    rids: Vec<RequestId>,
    lens: Vec<u64>,
    hot: Vec<i64>,
    rng: XorShift,
    sel: Vec<i64>,
    _buffers: (Box<[u8]>, Box<[u8]>),
}

impl DecodeWorkload {
    /// Builds the pools, the scheduler and the requests (every page prefilled and written
    /// through, then settled).
    pub fn new(shape: DecodeShape, steps: u64) -> Result<Self> {
        let mut rng = XorShift::new(7);
        let (lo, hi) = shape.context;
        let lens: Vec<u64> = (0..shape.batch)
            .map(|_| lo + rng.below(hi - lo + 1))
            .collect();
        let ps = u64::from(shape.page_size);
        let objects: u64 =
            lens.iter().map(|&n| (n + steps).div_ceil(ps)).sum::<u64>() * u64::from(shape.layers);
        let floor =
            (shape.batch * shape.layers as usize * 2 + shape.batch * shape.blocks * 2) as u64;
        let device_pages = ((shape.budget * objects as f64).ceil() as u64).max(floor) as u32;
        let host_pages = (objects + (shape.batch * shape.layers as usize) as u64) as u32;
        let spec = PoolSpec::new(
            Component::Kv,
            1,
            2,
            1,
            1,
            Dtype::Bf16,
            shape.page_size,
            device_pages,
        )?;
        let host_spec = spec.with_pages(host_pages)?;
        // SAFETY: the workload owns both buffers for as long as the scheduler lives and never
        // touches them itself.
        let (dev, d) = unsafe { crate::testing::host_pool(&spec)? };
        // SAFETY: as above.
        let (host, h) = unsafe { crate::testing::host_pool(&host_spec)? };
        let cfg = SchedulerConfig {
            layers: shape.layers,
            page_size: shape.page_size,
            device_pages,
            device_reserve: 0,
            host_pages,
            prefetch: shape.prefetch,
            prefetch_depth: 1,
        };
        let mut sched = StepScheduler::new(cfg, d, h, Arc::new(CpuEngine::new(1)?))?;
        let rids: Vec<RequestId> = (0..shape.batch as u64).map(RequestId::new).collect();
        for (i, &n) in lens.iter().enumerate() {
            sched.add_request(rids[i], n, None)?;
        }
        sched.drain()?;
        let k = shape.blocks - 2;
        let mut hot = Vec::with_capacity(shape.layers as usize * shape.batch * k);
        for _ in 0..shape.layers {
            for &n in &lens {
                let pages = (n + 1).div_ceil(ps);
                hot.extend((0..k).map(|_| 1 + rng.below(pages - 2) as i64));
            }
        }
        Ok(DecodeWorkload {
            shape,
            sched,
            rids,
            lens,
            hot,
            rng,
            sel: Vec::new(),
            _buffers: (dev, host),
        })
    }

    /// The scheduler.
    pub fn scheduler(&self) -> &StepScheduler {
        &self.sched
    }

    /// The scheduler, to change its switches.
    pub fn scheduler_mut(&mut self) -> &mut StepScheduler {
        &mut self.sched
    }

    /// Selection entries per step.
    pub fn lookups_per_step(&self) -> usize {
        self.shape.layers as usize * self.shape.batch * self.shape.blocks
    }

    /// Moves the hot blocks (locality) for the next step; not part of the timed work.
    fn next_selection(&mut self) {
        let s = self.shape;
        let ps = u64::from(s.page_size);
        let k = s.blocks - 2;
        for n in &mut self.lens {
            *n += 1;
        }
        self.sel.clear();
        for l in 0..s.layers as usize {
            for (b, &n) in self.lens.iter().enumerate() {
                let pages = n.div_ceil(ps);
                let row = &mut self.hot[(l * s.batch + b) * k..(l * s.batch + b + 1) * k];
                for h in row.iter_mut() {
                    if self.rng.unit() >= s.locality {
                        *h = 1 + self.rng.below(pages - 2) as i64;
                    }
                }
                let start = self.sel.len();
                self.sel.push(0);
                self.sel.extend_from_slice(row);
                self.sel.push(pages as i64 - 1);
                self.sel[start..].sort_unstable();
            }
        }
    }

    /// Runs `steps` decode steps; returns the time spent in scheduler calls.
    pub fn run(&mut self, steps: u64) -> Result<Duration> {
        let s = self.shape;
        let unit = SelectionUnit::new(s.page_size, s.page_size)?;
        let per_layer = s.batch * s.blocks;
        let mut spent = Duration::ZERO;
        for _ in 0..steps {
            self.next_selection();
            let t = Instant::now();
            self.sched.append(&self.rids)?;
            for l in 0..s.layers {
                let sel = &self.sel[l as usize * per_layer..(l as usize + 1) * per_layer];
                let (id, _) = self.sched.plan(l, &self.rids, sel, s.blocks, unit)?;
                self.sched.ready(id, None)?;
                self.sched.finish(id)?;
            }
            let rec = self.sched.end_step()?;
            spent += t
                .elapsed()
                .saturating_sub(Duration::from_nanos(rec.exposed_wait_ns));
        }
        Ok(spent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_decode_workload_runs_and_stays_valid() {
        let shape = DecodeShape {
            layers: 3,
            batch: 4,
            context: (512, 1024),
            ..DecodeShape::deepseek_v32()
        };
        let mut w = DecodeWorkload::new(shape, 8).unwrap();
        w.run(8).unwrap();
        w.scheduler().validate().unwrap();
        assert!(w.scheduler().totals().pages > 0);
    }

    /// The full DeepSeek-V3.2 shape, for profiling: `cargo test --release --lib
    /// full_shape -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn full_shape_step_time() {
        // SPARSETIER_LOCALITY: the chance a block stays (0.9).
        let locality = std::env::var("SPARSETIER_LOCALITY")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.9);
        let shape = DecodeShape {
            locality,
            ..DecodeShape::deepseek_v32()
        };
        let mut w = DecodeWorkload::new(shape, 200).unwrap();
        // SPARSETIER_KEEP=0: every selected page through the directory (no kept selections).
        let keep = std::env::var("SPARSETIER_KEEP").map_or(true, |v| v != "0");
        w.scheduler_mut().set_keep_selections(keep).unwrap();
        w.run(3).unwrap();
        let steps: u64 = std::env::var("SPARSETIER_STEPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30);
        let t = w.run(steps).unwrap();
        eprintln!(
            "{:.2} ms per step, {} lookups per step",
            t.as_secs_f64() * 1e3 / steps as f64,
            w.lookups_per_step()
        );
    }
}
