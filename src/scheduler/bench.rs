//! The decode-step workload shared by the criterion bench (`benches/scheduler.rs`): the Rust
//! half of `sparsetier bench decode`, with the same kind of synthetic selections: block mode
//! the sink, the last block and blocks that stay from one step to the next with probability
//! `locality`; token mode `tokens` tokens drawn from `token_pages` hot pages per request and
//! layer (each staying with probability `locality`) and the current token, rows sorted.
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
    /// Token mode: tokens selected per request per layer (0: block mode).
    pub tokens: usize,
    /// Token mode: the hot pages the tokens are drawn from.
    pub token_pages: usize,
    /// Token mode: each row's tokens mapped to its distinct pages with their token counts
    /// before the timer (where `sparsetier.token_map` does it: the GPU) and planned as counted
    /// page rows (`plan_counted`), the core's part of that path.
    pub counted: bool,
    /// Rows handed over as int32 (converted before the timer) instead of int64.
    pub int32: bool,
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
            tokens: 0,
            token_pages: 128,
            counted: false,
            int32: false,
        }
    }

    /// The same shape in token mode: top-2048 tokens from 128 hot pages.
    pub fn deepseek_v32_tokens() -> Self {
        DecodeShape {
            tokens: 2048,
            ..Self::deepseek_v32()
        }
    }

    /// Token mode with the tokens mapped to counted page rows outside the timer.
    pub fn deepseek_v32_tokens_counted() -> Self {
        DecodeShape {
            counted: true,
            ..Self::deepseek_v32_tokens()
        }
    }

    /// Selection entries per request per layer, and tokens per entry.
    fn entries(&self) -> (usize, u32) {
        if self.tokens > 0 {
            (self.tokens, 1)
        } else {
            (self.blocks, self.page_size)
        }
    }

    /// Hot blocks or pages per request per layer.
    fn hot(&self) -> usize {
        if self.tokens > 0 {
            self.token_pages
        } else {
            self.blocks - 2
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
    /// The same rows as int32, when the shape hands them over so.
    sel32: Vec<i32>,
    /// Counted shapes: per layer, the page rows, their counts and the row width.
    pages: Vec<(Vec<i64>, Vec<u32>, usize)>,
    /// Steps the host pool has room for (each appends a token to every request), and steps
    /// run so far.
    capacity: u64,
    ran: u64,
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
        let floor = (shape.batch * shape.layers as usize * 2
            + shape.batch * shape.blocks.max(shape.token_pages) * 2) as u64;
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
        let k = shape.hot();
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
            sel32: Vec::new(),
            pages: Vec::new(),
            capacity: steps,
            ran: 0,
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
        self.shape.layers as usize * self.shape.batch * self.shape.entries().0
    }

    /// Moves the hot blocks (locality) for the next step; not part of the timed work.
    fn next_selection(&mut self) {
        let s = self.shape;
        let ps = u64::from(s.page_size);
        let k = s.hot();
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
                if s.tokens > 0 {
                    // Hot pages stay below the last, partial page, so every token exists.
                    for _ in 1..s.tokens {
                        let page = row[self.rng.below(k as u64) as usize] as u64;
                        self.sel.push((page * ps + self.rng.below(ps)) as i64);
                    }
                    self.sel.push(n as i64 - 1);
                } else {
                    self.sel.push(0);
                    self.sel.extend_from_slice(row);
                    self.sel.push(pages as i64 - 1);
                }
                self.sel[start..].sort_unstable();
            }
        }
        if s.int32 {
            self.sel32.clear();
            self.sel32.extend(self.sel.iter().map(|&e| e as i32));
        }
        if s.counted && s.tokens > 0 {
            let per_layer = s.batch * s.tokens;
            self.pages = self
                .sel
                .chunks(per_layer)
                .map(|layer| counted_rows(layer, s.tokens, s.page_size))
                .collect();
        }
    }

    /// Steps the workload was built for and has not run (`new`'s `steps`): more run out of
    /// host pages.
    pub fn steps_left(&self) -> u64 {
        self.capacity.saturating_sub(self.ran)
    }

    /// The shape it runs.
    pub fn shape(&self) -> DecodeShape {
        self.shape
    }

    /// Runs `steps` decode steps; returns the time spent in scheduler calls.
    pub fn run(&mut self, steps: u64) -> Result<Duration> {
        let s = self.shape;
        let (k, unit) = s.entries();
        let unit = SelectionUnit::new(unit, s.page_size)?;
        let per_layer = s.batch * k;
        let mut spent = Duration::ZERO;
        for _ in 0..steps {
            self.next_selection();
            self.ran += 1;
            let t = Instant::now();
            self.sched.append(&self.rids)?;
            for l in 0..s.layers {
                let (id, _) = if s.counted && s.tokens > 0 {
                    let (pages, counts, width) = &self.pages[l as usize];
                    let page = SelectionUnit::new(s.page_size, s.page_size)?;
                    self.sched
                        .plan_counted(l, &self.rids, pages, *width, page, Some(counts))?
                } else {
                    let at = l as usize * per_layer..(l as usize + 1) * per_layer;
                    if s.int32 {
                        let sel = &self.sel32[at];
                        self.sched.plan_counted(l, &self.rids, sel, k, unit, None)?
                    } else {
                        self.sched.plan(l, &self.rids, &self.sel[at], k, unit)?
                    }
                };
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

/// Token rows (`k` a row, -1 = none, any order) as page rows: each row's distinct pages with
/// its distinct tokens in each, padded with -1 (count 0) to the widest row: what
/// `sparsetier.token_map` computes on the device. Returns (pages, counts, width).
pub(crate) fn counted_rows(rows: &[i64], k: usize, page_size: u32) -> (Vec<i64>, Vec<u32>, usize) {
    let ps = i64::from(page_size);
    let mut mapped: Vec<Vec<(i64, u32)>> = Vec::with_capacity(rows.len() / k.max(1));
    let mut sorted = Vec::with_capacity(k);
    for row in rows.chunks(k.max(1)) {
        sorted.clear();
        sorted.extend_from_slice(row);
        sorted.sort_unstable();
        let mut out: Vec<(i64, u32)> = Vec::new();
        let mut last = -1;
        for &t in &sorted {
            if t < 0 || t == last {
                continue; // padding, or a token named again
            }
            last = t;
            match out.last_mut() {
                Some((p, c)) if *p == t / ps => *c += 1,
                _ => out.push((t / ps, 1)),
            }
        }
        mapped.push(out);
    }
    let width = mapped.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let (mut pages, mut counts) = (Vec::new(), Vec::new());
    for row in &mapped {
        for j in 0..width {
            let (p, c) = row.get(j).copied().unwrap_or((-1, 0));
            pages.push(p);
            counts.push(c);
        }
    }
    (pages, counts, width)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::StepRecord;

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

    #[test]
    fn a_small_token_workload_keeps_most_pages_and_stays_valid() {
        // The same selections as token rows and as counted page rows (mapped before the
        // timer): the same distinct pages; the counted rows count a token named twice once.
        let run = |counted| {
            let shape = DecodeShape {
                layers: 3,
                batch: 4,
                context: (2048, 4096),
                tokens: 256,
                token_pages: 16,
                counted,
                ..DecodeShape::deepseek_v32()
            };
            let mut w = DecodeWorkload::new(shape, 8).unwrap();
            w.run(8).unwrap();
            w.scheduler().validate().unwrap();
            assert!(w.scheduler().kept_pins() > 0);
            w.scheduler().totals()
        };
        let (t, c) = (run(false), run(true));
        assert_eq!(t.selected, 8 * 3 * 4 * 256);
        // At most the hot pages and the current token's page per row, most of them kept.
        assert!(t.pages <= 8 * 3 * 4 * 17, "{t:?}");
        assert_eq!(c.pages, t.pages);
        assert!(c.selected <= t.selected && c.selected > c.pages);
        assert!(c.bytes_needed <= t.bytes_needed && c.bytes_needed > 0);
    }

    /// The full DeepSeek-V3.2 shape, for profiling: `cargo test --release --lib
    /// full_shape -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn full_shape_step_time() {
        // SPARSETIER_LOCALITY: the chance a block stays (0.9).
        let locality = env_or("SPARSETIER_LOCALITY", 0.9);
        // SPARSETIER_MODE=token: top-2048 tokens instead of 32 blocks; =counted: the same
        // tokens mapped to counted page rows before the timer (`plan_counted`).
        let mode = std::env::var("SPARSETIER_MODE").unwrap_or_default();
        // SPARSETIER_BUDGET: device slots as a share of all objects (0.25).
        let budget = env_or("SPARSETIER_BUDGET", 0.25);
        // SPARSETIER_ENTRY=i32: rows handed over as int32.
        let int32 = std::env::var("SPARSETIER_ENTRY").is_ok_and(|m| m == "i32");
        let shape = DecodeShape {
            locality,
            budget,
            int32,
            ..match mode.as_str() {
                "token" => DecodeShape::deepseek_v32_tokens(),
                "counted" => DecodeShape::deepseek_v32_tokens_counted(),
                _ => DecodeShape::deepseek_v32(),
            }
        };
        // SPARSETIER_WARMUP: steps before the timed ones (3; ~130 reach the steady state, where
        // every device slot has been turned over once). SPARSETIER_STEPS: timed steps (30).
        let (warmup, steps) = (
            env_or("SPARSETIER_WARMUP", 3u64),
            env_or("SPARSETIER_STEPS", 30u64),
        );
        let mut w = DecodeWorkload::new(shape, warmup + steps).unwrap();
        // SPARSETIER_KEEP=0: every selected page through the directory (no kept selections).
        let keep = std::env::var("SPARSETIER_KEEP").map_or(true, |v| v != "0");
        w.scheduler_mut().set_keep_selections(keep).unwrap();
        w.run(warmup).unwrap();
        let before = w.scheduler().totals();
        let series = std::env::var("SPARSETIER_SERIES").is_ok();
        // SPARSETIER_POLLUTE=MB: before each timed step, write this many MB (untimed), as the
        // other stacks of `bench decode`'s paired run do with their own directories, so that
        // the step starts with cold caches.
        let mut pollute = vec![0u8; env_or("SPARSETIER_POLLUTE", 0usize) << 20];
        let mut each: Vec<Duration> = Vec::with_capacity(steps as usize);
        for i in 0..steps {
            for line in pollute.chunks_mut(64) {
                line[0] = line[0].wrapping_add(1);
            }
            std::hint::black_box(&pollute);
            let a = w.scheduler().totals();
            let d = w.run(1).unwrap();
            if series && d > Duration::from_millis(8) {
                // A slow step, and where its in-core time went.
                let b = w.scheduler().totals();
                eprintln!(
                    "step {i}: {:.2} ms; {}",
                    d.as_secs_f64() * 1e3,
                    in_core(&a, &b, 1)
                );
            }
            each.push(d);
        }
        let t: Duration = each.iter().sum();
        let after = w.scheduler().totals();
        if series {
            // Per 25 steps: the median and the max.
            for (c, chunk) in each.chunks(25).enumerate() {
                let mut v = chunk.to_vec();
                v.sort_unstable();
                eprintln!(
                    "steps {}..: p50 {:.2} max {:.2}",
                    c * 25,
                    v[v.len() / 2].as_secs_f64() * 1e3,
                    v[v.len() - 1].as_secs_f64() * 1e3
                );
            }
        }
        each.sort_unstable();
        let at = |q: f64| each[((each.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
        eprintln!(
            "steps: p50 {:.2} ms, p99 {:.2}, max {:.2}",
            at(0.5),
            at(0.99),
            at(1.0)
        );
        eprintln!(
            "{:.2} ms per step, {} lookups per step",
            t.as_secs_f64() * 1e3 / steps as f64,
            w.lookups_per_step()
        );
        eprintln!("{}", in_core(&before, &after, steps));
    }

    /// An environment variable's value, or `default` when unset or unreadable.
    fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
        std::env::var(name)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    }

    /// The in-core time between two totals, per step over `steps`, by part.
    fn in_core(a: &StepRecord, b: &StepRecord, steps: u64) -> String {
        let ms = |f: fn(&StepRecord) -> u64| (f(b) - f(a)) as f64 / 1e6 / steps as f64;
        format!(
            "in-core {:.2} ms: plan {:.2} (rows {:.2}, resolve {:.2}, submit {:.2}), ready {:.2}, \
             finish {:.2}, append {:.2}, end_step {:.2}; prefetch {:.2}",
            ms(|r| r.cpu_ns),
            ms(|r| r.cpu_plan_ns),
            ms(|r| r.cpu_rows_ns),
            ms(|r| r.cpu_resolve_ns),
            ms(|r| r.cpu_submit_ns),
            ms(|r| r.cpu_ready_ns),
            ms(|r| r.cpu_finish_ns),
            ms(|r| r.cpu_append_ns),
            ms(|r| r.cpu_end_step_ns),
            ms(|r| r.cpu_prefetch_ns),
        )
    }
}
