//! The soak of the joined scheduler, in Rust: the loop of `sparsetier soak` (Python,
//! `python/sparsetier/soak.py`) without the interpreter, so a ten-million-request run fits
//! in under an hour instead of six (issue 17). Same workload, same data patterns, same
//! report fields; `sparsetier soak --engine rust` runs it through the binding.
//!
//! Requests over Zipf-popular system prompts and their next turns are admitted by prefix
//! match, prefilled, decoded for a few steps with random block selections, and ended with or
//! without insertion into the prefix tree; random load, backup and restore faults go through
//! the cpu engine's fault hook. Every K, V and Indexer-K row written holds bytes derived from
//! (token, position, layer, plane) ([`pattern`], the Python soak's function), so a prefix's
//! rows are the same whoever wrote them; every selected page is read back through its slot
//! table after `ready`, and every admitted prefix's Indexer-K after its restore. A load,
//! backup, restore or eviction that moved the wrong bytes, or a slot reused too early, ends
//! the soak with [`SoakError::Broken`] naming the row.

use super::{JoinedScheduler, SchedulerConfig, SelectionUnit, StepScheduler};
use crate::config::HitPolicy;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::layout::{Component, Dtype};
use crate::pool::PoolSpec;
use crate::radix::PoolPair;
use crate::testing::XorShift;
use crate::transfer::{CpuEngine, Direction, PageTransferBinding};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// Why a soak stopped.
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    /// A core call failed in a way the soak does not expect of a request (or the report
    /// callback asked to stop).
    #[error(transparent)]
    Core(#[from] Error),
    /// A row read back differs from what was written, or an invariant broke.
    #[error("soak broken: {0}")]
    Broken(String),
}

type SoakResult<T> = std::result::Result<T, SoakError>;

/// Bytes per token row per plane: small pools whose every row is checked.
pub const ROW: usize = 8;

/// Distinct token ids.
const VOCAB: u64 = 50_000;

/// Blocks selected per request per layer.
const PICK: usize = 4;

/// Finished conversations kept for next turns.
const TURNS: usize = 256;

/// The soak's sizes (the Python `SoakConfig`'s fields and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoakConfig {
    /// Requests to end (admitted or refused).
    pub requests: u64,
    /// Requests decoding at once (the batch).
    pub concurrent: usize,
    /// Model layers.
    pub layers: u16,
    /// Tokens per page (= selection block).
    pub page_size: u32,
    /// Device slots of the per-layer main-KV pool.
    pub device_slots: u32,
    /// Host pages (every layer of each).
    pub host_pages: u32,
    /// Indexer-K device pages.
    pub indexer_pages: u32,
    /// Distinct system prompts (Zipf 1.1 popularity).
    pub prompts: u32,
    /// Decode steps per request.
    pub steps: u32,
    /// Chance per step of arming one fault (load, backup or restore).
    pub faults: f64,
    /// Requests between reports.
    pub every: u64,
    /// Random seed.
    pub seed: u64,
}

impl Default for SoakConfig {
    fn default() -> Self {
        SoakConfig {
            requests: 100_000,
            concurrent: 8,
            layers: 4,
            page_size: 16,
            device_slots: 20_000,
            host_pages: 100_000,
            indexer_pages: 8_000,
            prompts: 2_000,
            steps: 8,
            faults: 0.01,
            every: 10_000,
            seed: 0,
        }
    }
}

/// Latency of one call kind since the last report, µs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// One report, every `every` requests (the Python soak's fields).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SoakReport {
    /// Requests ended so far.
    pub requests: u64,
    /// Seconds since the start.
    pub seconds: f64,
    /// Resident set size, MiB.
    pub rss_mib: f64,
    /// Live directory objects.
    pub objects: usize,
    /// Prefix-tree nodes.
    pub tree_nodes: usize,
    /// Ended requests still being written through.
    pub finishing: usize,
    /// Requests refused or ended by a failure.
    pub failed_requests: u64,
    /// Loads that failed (each retried once).
    pub failed_loads: u64,
    /// Backups that failed (each retried).
    pub failed_backups: u64,
    /// Indexer-K restores that failed.
    pub restores_failed: u64,
    /// Rows compared with their pattern so far.
    pub rows_checked: u64,
    /// `(call, latency)` for admit, plan, end_step and finish.
    pub latency: Vec<(&'static str, Latency)>,
}

/// The bytes of the row of `token` at `position` in `layer` and `plane` (0 K, 1 V,
/// 2 Indexer-K): `sparsetier.soak.pattern`'s arithmetic (u32, wrapping).
pub fn pattern(token: u32, position: u32, layer: u16, plane: u32) -> [u8; ROW] {
    let base = token
        .wrapping_mul(0x9E37_79B1)
        .wrapping_add(position.wrapping_mul(0x85EB_CA77))
        .wrapping_add(u32::from(layer).wrapping_mul(0xC2B2_AE3D))
        .wrapping_add(plane.wrapping_mul(0x27D4_EB2F));
    std::array::from_fn(|i| (base.wrapping_add((i as u32).wrapping_mul(0x1656_67B1)) >> 17) as u8)
}

/// Resident set size of this process, MiB (0 where /proc is missing).
pub fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0.0, |pages| (pages * 4096) as f64 / f64::from(1 << 20))
}

/// The pools and the rows of the soak: writes and checks patterns through the bindings.
struct Rows {
    kv: PageTransferBinding,
    ik: PageTransferBinding,
    checked: u64,
    /// Test hook: every n-th K/V row write flips a byte of K (a torn copy's mark).
    #[cfg(test)]
    tear_every: u64,
    #[cfg(test)]
    writes: u64,
    _buffers: Vec<Box<[u8]>>,
}

impl Rows {
    /// Where row `row` of `page` lies in plane `plane`: a page or row outside the pool (a
    /// slot the scheduler got wrong) is a broken soak, not a write or read outside it.
    fn addr(b: &PageTransferBinding, plane: usize, page: u32, row: u32) -> SoakResult<u64> {
        b.row_addr_checked(plane, page, row).ok_or_else(|| {
            SoakError::Broken(format!(
                "slot {page} row {row} plane {plane}: outside the pool ({} pages)",
                b.pages()
            ))
        })
    }

    fn poke(
        b: &PageTransferBinding,
        plane: usize,
        page: u32,
        row: u32,
        v: [u8; ROW],
    ) -> SoakResult<()> {
        let addr = Self::addr(b, plane, page, row)?;
        // SAFETY: `b` binds one of `_buffers` (alive as long as `self`) and the row is inside
        // it (checked above); the page was handed to the request writing it, which no
        // transfer in flight reads or writes until the request's step ends.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), addr as *mut u8, ROW) };
        Ok(())
    }

    fn peek(b: &PageTransferBinding, plane: usize, page: u32, row: u32) -> SoakResult<[u8; ROW]> {
        let mut v = [0u8; ROW];
        let addr = Self::addr(b, plane, page, row)?;
        // SAFETY: as in `poke`; the loads or restores the page depends on were waited for.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), ROW) };
        Ok(v)
    }

    fn same(
        &mut self,
        got: [u8; ROW],
        want: [u8; ROW],
        what: impl FnOnce() -> String,
    ) -> SoakResult<()> {
        if got != want {
            return Err(SoakError::Broken(format!(
                "data pattern: {} holds {got:?}, written {want:?}",
                what()
            )));
        }
        self.checked += 1;
        Ok(())
    }

    /// K and V rows of `token` at `pos` into device `slot` (layer `layer`'s page), `row`.
    fn write_kv(
        &mut self,
        slot: u32,
        row: u32,
        token: u32,
        pos: u32,
        layer: u16,
    ) -> SoakResult<()> {
        for plane in 0..2 {
            #[allow(unused_mut)]
            let mut v = pattern(token, pos, layer, plane as u32);
            #[cfg(test)]
            {
                self.writes += 1;
                if self.tear_every > 0 && self.writes % self.tear_every == 0 {
                    v[0] ^= 0xFF;
                }
            }
            Self::poke(&self.kv, plane, slot, row, v)?;
        }
        Ok(())
    }

    /// Indexer-K rows of `token` at `pos` into Indexer-K `page`, every layer.
    fn write_key(&self, page: u32, ps: u32, token: u32, pos: u32, layers: u16) -> SoakResult<()> {
        for l in 0..layers {
            Self::poke(
                &self.ik,
                l as usize,
                page,
                pos % ps,
                pattern(token, pos, l, 2),
            )?;
        }
        Ok(())
    }
}

/// A running request: its tokens so far and the steps it has left.
struct Running {
    tokens: Vec<u32>,
    steps_left: u32,
    indexer: Vec<u32>,
}

/// Per-call latencies since the last report, ns.
#[derive(Default)]
struct Timings {
    calls: [Vec<u64>; 4],
}

const CALLS: [&str; 4] = ["admit", "plan", "end_step", "finish"];

impl Timings {
    fn add(&mut self, call: usize, t: Instant) {
        self.calls[call].push(t.elapsed().as_nanos() as u64);
    }

    fn take(&mut self) -> Vec<(&'static str, Latency)> {
        CALLS
            .iter()
            .zip(self.calls.iter_mut())
            .map(|(name, v)| {
                let l = Latency {
                    p50_us: percentile(v, 50.0),
                    p99_us: percentile(v, 99.0),
                };
                v.clear();
                (*name, l)
            })
            .collect()
    }
}

/// The `q`-th percentile of `v` in µs, linear between ranks (numpy's default).
fn percentile(v: &mut [u64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_unstable();
    let at = q / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    let x = v[lo] as f64 + (v[hi] as f64 - v[lo] as f64) * (at - lo as f64);
    x / 1e3
}

fn is_out_of_pages(e: &SoakError) -> bool {
    matches!(
        e,
        SoakError::Core(Error::OutOfPages { .. } | Error::OutOfSlots { .. })
    )
}

/// The soak's state: the scheduler, its pools and the workload.
struct Soak {
    cfg: SoakConfig,
    s: JoinedScheduler,
    rows: Rows,
    rng: XorShift,
    zipf: Vec<f64>,
    sys_len: Vec<u32>,
    running: BTreeMap<u64, Running>,
    turns: Vec<Vec<u32>>,
    lat: Timings,
    done: u64,
    failed: u64,
    next_rid: u64,
}

/// Runs the soak; calls `report` every `cfg.every` requests (an error from it stops the run)
/// and returns every report. Ends with every request ended, the scheduler drained and its
/// invariants checked, and nothing pinned or in flight.
pub fn run(
    cfg: SoakConfig,
    mut report: impl FnMut(&SoakReport) -> Result<()>,
) -> SoakResult<Vec<SoakReport>> {
    for (field, v) in [
        ("requests", cfg.requests),
        ("concurrent", cfg.concurrent as u64),
        ("layers", u64::from(cfg.layers)),
        ("steps", u64::from(cfg.steps)),
        ("every", cfg.every),
        ("prompts", u64::from(cfg.prompts)),
        ("page_size", u64::from(cfg.page_size)),
    ] {
        if v < 1 {
            return Err(Error::config(field, v, "an integer >= 1").into());
        }
    }
    if !(0.0..=1.0).contains(&cfg.faults) {
        return Err(Error::config("faults", cfg.faults, "a chance in [0, 1]").into());
    }
    let mut soak = Soak::new(cfg)?;
    let t0 = Instant::now();
    let mut reports = Vec::new();
    let mut next_report = cfg.every;
    while soak.done < cfg.requests {
        soak.admit_up_to()?;
        soak.step()?;
        while soak.done >= next_report {
            let r = soak.report(t0);
            report(&r)?;
            reports.push(r);
            next_report += cfg.every;
        }
    }
    soak.end()?;
    Ok(reports)
}

impl Soak {
    fn new(cfg: SoakConfig) -> Result<Self> {
        let ps = cfg.page_size;
        let layers = u32::from(cfg.layers);
        let kv = PoolSpec::new(
            Component::Kv,
            1,
            2,
            1,
            ROW as u32,
            Dtype::Fp8E4m3,
            ps,
            cfg.device_slots,
        )?;
        let kv_host = PoolSpec::new(
            Component::Kv,
            layers,
            2,
            1,
            ROW as u32,
            Dtype::Fp8E4m3,
            ps,
            cfg.host_pages,
        )?;
        let ik = PoolSpec::new(
            Component::Indexer,
            layers,
            1,
            1,
            ROW as u32,
            Dtype::Fp8E4m3,
            ps,
            cfg.indexer_pages,
        )?;
        let ik_host = ik.with_pages(cfg.host_pages)?;
        // SAFETY: `Rows` owns every buffer for as long as the scheduler lives (the scheduler
        // is dropped first: `Soak` declares it before `rows`), and the soak writes them only
        // through `Rows::poke`, into rows no transfer in flight touches.
        let (b0, dev) = unsafe { crate::testing::host_pool(&kv)? };
        // SAFETY: as above.
        let (b1, host_kv) = unsafe { crate::testing::host_pool(&kv_host)? };
        // SAFETY: as above.
        let (b2, ik_dev) = unsafe { crate::testing::host_pool(&ik)? };
        // SAFETY: as above.
        let (b3, ik_h) = unsafe { crate::testing::host_pool(&ik_host)? };
        let sched_cfg = SchedulerConfig {
            layers: cfg.layers,
            page_size: ps,
            device_pages: cfg.device_slots,
            device_reserve: 0,
            host_pages: cfg.host_pages,
            prefetch: false,
            prefetch_depth: 1,
        };
        let sidecars = vec![PoolPair {
            device: Some(ik_dev.clone()),
            host: ik_h,
            hit: HitPolicy::AllPages,
        }];
        let s = StepScheduler::joined(
            sched_cfg,
            dev.clone(),
            host_kv,
            sidecars,
            cfg.indexer_pages,
            Arc::new(CpuEngine::new(1)?),
        )?;
        let mut rng = XorShift::new(cfg.seed.wrapping_mul(0x9E37_79B9).wrapping_add(1));
        let mut zipf: Vec<f64> = (1..=cfg.prompts).map(|i| f64::from(i).powf(-1.1)).collect();
        let total: f64 = zipf.iter().sum();
        let mut acc = 0.0;
        for w in &mut zipf {
            acc += *w / total;
            *w = acc;
        }
        let sys_len = (0..cfg.prompts)
            .map(|_| 64 + rng.below(448) as u32)
            .collect();
        Ok(Soak {
            cfg,
            s,
            rows: Rows {
                kv: dev,
                ik: ik_dev,
                checked: 0,
                #[cfg(test)]
                tear_every: 0,
                #[cfg(test)]
                writes: 0,
                _buffers: vec![b0, b1, b2, b3],
            },
            rng,
            zipf,
            sys_len,
            running: BTreeMap::new(),
            turns: Vec::new(),
            lat: Timings::default(),
            done: 0,
            failed: 0,
            next_rid: 0,
        })
    }

    /// A new prompt: a next turn of a finished conversation (30 %) or a Zipf-popular system
    /// prompt, then 8-63 random tokens.
    fn prompt(&mut self) -> Vec<u32> {
        let mut toks = if !self.turns.is_empty() && self.rng.unit() < 0.3 {
            self.turns[self.rng.below(self.turns.len() as u64) as usize].clone()
        } else {
            let u = self.rng.unit();
            let p = self
                .zipf
                .partition_point(|&c| c < u)
                .min(self.zipf.len() - 1) as u64;
            (0..u64::from(self.sys_len[p as usize]))
                .map(|i| ((i * 7919 + p * 104_729) % VOCAB) as u32)
                .collect()
        };
        let extra = 8 + self.rng.below(56);
        toks.extend((0..extra).map(|_| self.rng.below(VOCAB) as u32));
        toks
    }

    fn admit_up_to(&mut self) -> SoakResult<()> {
        while self.running.len() < self.cfg.concurrent {
            let id = self.next_rid;
            self.next_rid += 1;
            let rid = RequestId::new(id);
            let toks = self.prompt();
            let t = Instant::now();
            let adm = self.s.admit(rid, &toks);
            self.lat.add(0, t);
            let adm = match adm {
                Ok(a) => a,
                Err(Error::OutOfPages { .. } | Error::OutOfSlots { .. }) => {
                    self.failed += 1;
                    self.done += 1;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let start = adm.matched_pages * self.cfg.page_size;
            match self.prefill(rid, &toks, start) {
                Ok(indexer) => {
                    let r = Running {
                        tokens: toks,
                        steps_left: self.cfg.steps,
                        indexer,
                    };
                    self.running.insert(id, r);
                }
                // A pattern mismatch is the soak's own failure, never a request's.
                Err(e) if is_broken(&e) => return Err(e),
                Err(_) => {
                    self.s.finish_request(rid)?;
                    self.failed += 1;
                    self.done += 1;
                }
            }
        }
        Ok(())
    }

    /// Waits for the restore, checks the matched prefix's Indexer-K, prefills the rest and
    /// writes its rows; returns the request's Indexer-K pages.
    fn prefill(&mut self, rid: RequestId, toks: &[u32], start: u32) -> SoakResult<Vec<u32>> {
        let (ps, layers) = (self.cfg.page_size, self.cfg.layers);
        for l in 0..layers {
            self.s.wait_prefix(rid, l, None)?; // a failed restore ends the request
        }
        let idx = self.s.indexer_pages(rid)?.to_vec();
        for pos in 0..start {
            for l in 0..layers {
                let got = Rows::peek(
                    &self.rows.ik,
                    l as usize,
                    idx[(pos / ps) as usize],
                    pos % ps,
                )?;
                let want = pattern(toks[pos as usize], pos, l, 2);
                self.rows.same(got, want, || {
                    format!("Indexer-K of request {rid}, layer {l}, position {pos}")
                })?;
            }
        }
        let (first, slots) = self.s.extend(rid, toks.len() as u64 - u64::from(start))?;
        let touched = slots.len() / layers as usize;
        let idx = self.s.indexer_pages(rid)?.to_vec();
        for pos in start..toks.len() as u32 {
            let page = pos / ps;
            for l in 0..layers {
                let slot = slots[l as usize * touched + (page - first) as usize];
                self.rows
                    .write_kv(slot.raw(), pos % ps, toks[pos as usize], pos, l)?;
            }
            self.rows
                .write_key(idx[page as usize], ps, toks[pos as usize], pos, layers)?;
        }
        Ok(idx)
    }

    /// `min(PICK, n)` distinct pages of `n`, ascending, -1 padded, into `out`.
    fn pick(&mut self, n: u32, out: &mut [i64]) {
        let k = (PICK as u32).min(n) as usize;
        let mut got = [0i64; PICK];
        let mut len = 0;
        while len < k {
            let p = self.rng.below(u64::from(n)) as i64;
            if !got[..len].contains(&p) {
                got[len] = p;
                len += 1;
            }
        }
        got[..len].sort_unstable();
        out[..len].copy_from_slice(&got[..len]);
        out[len..].fill(-1);
    }

    /// One decode step of every running request: append, write the new rows, plan every
    /// layer with random selections, read every selected page back, end the step; then end
    /// the requests whose steps ran out or that failed.
    fn step(&mut self) -> SoakResult<()> {
        if self.rng.unit() < self.cfg.faults {
            match self.rng.below(3) {
                0 => self.s.inject_faults(Direction::Load, 1, None, None),
                1 => self.s.inject_faults(Direction::Backup, 1, None, None),
                _ => self.s.inject_restore_faults(1),
            }
        }
        let ids: Vec<u64> = self.running.keys().copied().collect();
        let rids: Vec<RequestId> = ids.iter().map(|&i| RequestId::new(i)).collect();
        let mut bad = vec![false; rids.len()];
        match self.decode(&ids, &rids, &mut bad) {
            Ok(()) => {}
            Err(e) if is_out_of_pages(&e) => bad.fill(true), // the device holds too much not yet written through
            Err(e) => return Err(e),
        }
        for (b, &id) in ids.iter().enumerate() {
            let r = self.running.get_mut(&id).expect("running");
            r.steps_left -= 1;
            if !bad[b] && r.steps_left > 0 {
                continue;
            }
            let r = self.running.remove(&id).expect("running");
            let insert = !bad[b] && self.rng.unit() < 0.9;
            let t = Instant::now();
            let rid = RequestId::new(id);
            if insert {
                self.s.end_request(rid, Some(&r.tokens))?;
            } else {
                self.s.finish_request(rid)?;
            }
            self.lat.add(3, t);
            if insert {
                if self.turns.len() < TURNS {
                    self.turns.push(r.tokens);
                } else {
                    let at = self.rng.below(TURNS as u64) as usize;
                    self.turns[at] = r.tokens;
                }
            }
            self.failed += u64::from(bad[b]);
            self.done += 1;
        }
        Ok(())
    }

    fn decode(&mut self, ids: &[u64], rids: &[RequestId], bad: &mut [bool]) -> SoakResult<()> {
        let (ps, layers) = (self.cfg.page_size, self.cfg.layers);
        let (slots, rows) = self.s.append(rids)?;
        let mut lens = Vec::with_capacity(ids.len());
        for (b, id) in ids.iter().enumerate() {
            let token = self.rng.below(VOCAB) as u32;
            let r = self.running.get_mut(id).expect("running");
            let pos = r.tokens.len() as u32;
            r.tokens.push(token);
            if rows[b] == 0 {
                // A page started: its Indexer-K page is new.
                r.indexer = self.s.indexer_pages(rids[b])?.to_vec();
            }
            for l in 0..layers {
                let slot = slots[b * layers as usize + l as usize].raw();
                self.rows.write_kv(slot, rows[b], token, pos, l)?;
            }
            self.rows
                .write_key(r.indexer[(pos / ps) as usize], ps, token, pos, layers)?;
            lens.push(pos + 1);
        }
        let unit = SelectionUnit::new(ps, ps)?;
        let mut sel = vec![-1i64; ids.len() * PICK];
        for l in 0..layers {
            for (b, &len) in lens.iter().enumerate() {
                let mut row = [0i64; PICK];
                self.pick(len.div_ceil(ps), &mut row);
                sel[b * PICK..(b + 1) * PICK].copy_from_slice(&row);
            }
            let t = Instant::now();
            let (plan, _) = self.s.plan(l, rids, &sel, PICK, unit)?;
            self.lat.add(1, t);
            let out = self.s.ready(plan, None)?;
            for (b, _, _) in &out.failed {
                bad[*b] = true;
            }
            let table = self.s.table(plan)?.to_vec();
            self.check_plan(l, ids, &sel, &table, &lens, bad)?;
            self.s.finish(plan)?;
        }
        let t = Instant::now();
        self.s.end_step()?;
        self.lat.add(2, t);
        Ok(())
    }

    /// The selected pages' rows, read through the slot table, hold their tokens' rows; rows
    /// of failed requests are not read.
    fn check_plan(
        &mut self,
        layer: u16,
        ids: &[u64],
        sel: &[i64],
        table: &[i32],
        lens: &[u32],
        bad: &[bool],
    ) -> SoakResult<()> {
        let ps = self.cfg.page_size;
        for (b, id) in ids.iter().enumerate() {
            if bad[b] {
                continue;
            }
            let toks = &self.running[id].tokens;
            for j in 0..PICK {
                let (page, slot) = (sel[b * PICK + j], table[b * PICK + j]);
                if page < 0 {
                    continue;
                }
                let first = page as u32 * ps;
                for pos in first..(first + ps).min(lens[b]) {
                    for plane in 0..2u32 {
                        let got = Rows::peek(&self.rows.kv, plane as usize, slot as u32, pos % ps)?;
                        let want = pattern(toks[pos as usize], pos, layer, plane);
                        if got != want {
                            return Err(SoakError::Broken(format!(
                                "data pattern: layer {layer}, request {id}, position {pos}, \
                                 plane {plane} (slot {slot}) holds {got:?}, written {want:?}"
                            )));
                        }
                    }
                    self.rows.checked += 2;
                }
            }
        }
        Ok(())
    }

    fn report(&mut self, t0: Instant) -> SoakReport {
        let st = self.s.directory().stats();
        let totals = self.s.totals();
        let px = self.s.prefix_totals();
        SoakReport {
            requests: self.done,
            seconds: t0.elapsed().as_secs_f64(),
            rss_mib: rss_mib(),
            objects: st.objects,
            tree_nodes: self.s.prefix_tier().cache().tree().node_count(),
            finishing: self.s.finishing(),
            failed_requests: self.failed,
            failed_loads: totals.failed_loads,
            failed_backups: totals.failed_backups,
            restores_failed: px.restores_failed,
            rows_checked: self.rows.checked,
            latency: self.lat.take(),
        }
    }

    /// Ends every running request, drains, and checks the invariants and that nothing is
    /// left pinned or in flight.
    fn end(&mut self) -> SoakResult<()> {
        let ids: Vec<u64> = self.running.keys().copied().collect();
        for id in ids {
            self.s.finish_request(RequestId::new(id))?;
        }
        self.running.clear();
        self.s.drain()?;
        self.s
            .validate()
            .map_err(|why| Error::config("soak invariants", why, "all held"))?;
        let st = self.s.directory().stats();
        if st.pins != 0 || st.handles != 0 || st.transfers_in_flight != 0 {
            return Err(SoakError::Broken(format!(
                "the soak ended with {} pins, {} handles, {} transfers in flight",
                st.pins, st.handles, st.transfers_in_flight
            )));
        }
        Ok(())
    }
}

fn is_broken(e: &SoakError) -> bool {
    matches!(e, SoakError::Broken(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SoakConfig {
        SoakConfig {
            requests: 3_000,
            every: 500,
            device_slots: 3_000,
            host_pages: 1_500,
            indexer_pages: 1_200,
            prompts: 300,
            faults: 0.02,
            ..SoakConfig::default()
        }
    }

    #[test]
    fn pattern_matches_the_python_soaks() {
        // sparsetier.soak.pattern(...) as numpy computes it (uint32 wrapping, >> 17, uint8).
        assert_eq!(
            pattern(12345, 678, 3, 1),
            [201, 244, 31, 74, 118, 161, 204, 247]
        );
        assert_eq!(
            pattern(49999, 70000, 60, 2),
            [54, 97, 140, 183, 227, 14, 57, 100]
        );
    }

    #[test]
    fn a_short_soak_checks_rows_and_ends_clean() {
        let mut seen = 0;
        let reps = run(small(), |_| {
            seen += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(reps.len(), 6);
        assert_eq!(seen, 6);
        let last = reps.last().unwrap();
        assert!(
            (3_000..3_000 + 8).contains(&last.requests),
            "{}",
            last.requests
        );
        assert!(last.rows_checked > reps[0].rows_checked && reps[0].rows_checked > 0);
        assert!(
            last.failed_loads + last.restores_failed + last.failed_backups > 0,
            "faults ran"
        );
        assert!(reps.iter().all(|r| r.objects <= 1_500 * 4));
        assert!(last
            .latency
            .iter()
            .all(|(_, l)| l.p99_us >= l.p50_us && l.p50_us > 0.0));
    }

    #[test]
    fn a_torn_row_fails_the_soak() {
        // One K/V row write in 997 leaves a flipped byte, as a torn copy or a slot reused too
        // early would: the soak must fail on it, not count it as checked.
        let cfg = SoakConfig {
            faults: 0.0,
            ..small()
        };
        let mut soak = Soak::new(cfg).unwrap();
        soak.rows.tear_every = 997;
        let e = loop {
            if let Err(e) = soak.admit_up_to().and_then(|()| soak.step()) {
                break e;
            }
            assert!(soak.done < cfg.requests, "the torn rows were never read");
        };
        assert!(is_broken(&e), "{e}");
    }

    /// `SPARSETIER_SOAK_REQUESTS=1000000 cargo test --release --lib default_sizes -- \
    /// --ignored --nocapture`: the default sizes without the interpreter (profiling).
    #[test]
    #[ignore]
    fn default_sizes() {
        let requests = std::env::var("SPARSETIER_SOAK_REQUESTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(30_000);
        let cfg = SoakConfig {
            requests,
            every: requests / 5,
            ..SoakConfig::default()
        };
        run(cfg, |r| {
            println!("{r:?}");
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn bad_sizes_are_refused() {
        let e = run(
            SoakConfig {
                every: 0,
                ..small()
            },
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("every"), "{e}");
        let e = run(
            SoakConfig {
                faults: 1.5,
                ..small()
            },
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("faults"), "{e}");
    }

    #[test]
    fn a_report_error_stops_the_run() {
        let e = run(small(), |_| Err(Error::config("report", "stop", "go on"))).unwrap_err();
        assert!(e.to_string().contains("report"), "{e}");
    }
}
