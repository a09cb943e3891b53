//! The step scheduler on the cpu engine over real buffers. Every token row written carries a
//! stamp of (namespace, page, layer, row, plane), so a read through a slot table proves the
//! right bytes arrived; faults go through the engine's hook, as a user meets them.

use super::*;
use crate::ids::{RequestId, SlotId};
use crate::layout::{Component, Dtype};
use crate::pool::PoolSpec;
use crate::testing::XorShift;
use crate::transfer::{CpuEngine, Direction, PageTransferBinding};
use proptest::prelude::*;
use std::sync::Arc;

const PS: u32 = 4;
const LAYERS: u16 = 3;

struct Harness {
    s: StepScheduler,
    /// Steps take each plan's table (`take_table`) and apply a retry's moves themselves, as
    /// the Python binding does.
    take_tables: bool,
    /// Token rows are mapped to page rows with per-page token counts before planning
    /// (`plan_counted`), as the runtime does on the device.
    map_tokens: bool,
    /// Plans go through `plan_csr`: each row without its padding (-1 entries), the table
    /// handed back as CSR and laid out as the padded one here for the byte checks.
    csr: bool,
    /// Plans get their rows (or CSR entries) as int32 instead of int64.
    int32: bool,
    /// Mapped token rows: each row's (page, count) cells are edited before planning (cells
    /// split into repeats, put out of order).
    edit_counted: Option<EditCounted>,
    dev: PageTransferBinding,
    _dev_buf: Box<[u8]>,
    _host_buf: Box<[u8]>,
}

fn stamp(ns: u64, page: u32, layer: u16, row: u32, plane: usize) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..2].copy_from_slice(&(ns as u16).to_le_bytes());
    b[2..4].copy_from_slice(&(page as u16).to_le_bytes());
    b[4] = layer as u8;
    b[5] = row as u8;
    b[6] = plane as u8;
    b[7] = 0xEE;
    b
}

impl Harness {
    fn new(device_pages: u32, host_pages: u32, prefetch: bool) -> Self {
        let spec = PoolSpec::new(Component::Kv, 1, 2, 1, 4, Dtype::Bf16, PS, device_pages).unwrap();
        let host_spec = spec.with_pages(host_pages).unwrap();
        // SAFETY: the harness owns both buffers for as long as the scheduler lives and writes
        // them only through `write_row`, into rows no transfer in flight touches.
        let (dev_buf, dev) = unsafe { crate::testing::host_pool(&spec) }.unwrap();
        // SAFETY: as above.
        let (host_buf, host) = unsafe { crate::testing::host_pool(&host_spec) }.unwrap();
        let cfg = SchedulerConfig {
            layers: LAYERS,
            page_size: PS,
            device_pages,
            device_reserve: 0,
            host_pages,
            prefetch,
            prefetch_depth: 1,
        };
        let engine = Arc::new(CpuEngine::new(2).unwrap());
        let s = StepScheduler::new(cfg, dev.clone(), host, engine).unwrap();
        Harness {
            s,
            take_tables: false,
            map_tokens: false,
            csr: false,
            int32: false,
            edit_counted: None,
            dev,
            _dev_buf: dev_buf,
            _host_buf: host_buf,
        }
    }

    fn write_row(&self, slot: SlotId, ns: u64, page: u32, layer: u16, row: u32) {
        for plane in 0..2 {
            let addr = self.dev.row_addr(plane, slot.raw(), row);
            let v = stamp(ns, page, layer, row, plane);
            // SAFETY: `row_addr` of a slot the scheduler handed out for this row lies inside
            // the device buffer; no transfer writes a slot while its object is being written.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), addr as *mut u8, 8) };
        }
    }

    fn read_row(&self, slot: u32, row: u32, plane: usize) -> [u8; 8] {
        // A wrong table (what these tests look for) must fail here, not read out of the
        // buffer: a cell left -1 or naming no slot is an assertion.
        let addr = self
            .dev
            .row_addr_checked(plane, slot, row)
            .unwrap_or_else(|| panic!("slot {slot} row {row}: outside the device pool"));
        let mut v = [0u8; 8];
        // SAFETY: in the buffer (checked above); the plan's loads are ready, so nothing writes
        // this slot now.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, v.as_mut_ptr(), 8) };
        v
    }

    fn add(&mut self, rid: u64, tokens: u64, prefix: Option<Prefix>) {
        self.try_add(rid, tokens, prefix).unwrap();
    }

    fn try_add(&mut self, rid: u64, tokens: u64, prefix: Option<Prefix>) -> crate::Result<()> {
        let slots = self.s.add_request(RequestId::new(rid), tokens, prefix)?;
        let first = prefix.map_or(0, |p| p.pages);
        let total = tokens.div_ceil(u64::from(PS)) as u32;
        let own = (total - first) as usize;
        for l in 0..LAYERS {
            for i in 0..own {
                let page = first + i as u32;
                for row in 0..PS {
                    if u64::from(page * PS + row) < tokens {
                        self.write_row(slots[l as usize * own + i], rid, page, l, row);
                    }
                }
            }
        }
        Ok(())
    }

    fn add_prompt(&mut self, ns: u64, pages: u32) {
        let slots = self.s.add_prompt(ns, pages).unwrap();
        for l in 0..LAYERS {
            for p in 0..pages {
                for row in 0..PS {
                    self.write_row(slots[(l as u32 * pages + p) as usize], ns, p, l, row);
                }
            }
        }
    }

    /// One step: append a token to every request, then per layer plan `sel(rid, layer, len)`
    /// (blocks of `unit` tokens), check every byte read through the slot table, finish.
    /// Returns the failed requests and the record.
    fn step(
        &mut self,
        rids: &[u64],
        unit: u32,
        k: usize,
        sel: &mut dyn FnMut(u64, u16, u64) -> Vec<i64>,
    ) -> (Vec<u64>, StepRecord) {
        self.try_step(rids, unit, k, sel).unwrap()
    }

    /// A step that returns the scheduler's refusal (a full device) instead of panicking; a
    /// plan refused mid-step ends the step as a runtime would.
    fn try_step(
        &mut self,
        rids: &[u64],
        unit: u32,
        k: usize,
        sel: &mut dyn FnMut(u64, u16, u64) -> Vec<i64>,
    ) -> crate::Result<(Vec<u64>, StepRecord)> {
        let ids: Vec<RequestId> = rids.iter().map(|&r| RequestId::new(r)).collect();
        let (slots, rows) = self.s.append(&ids)?;
        let lens: Vec<u64> = ids
            .iter()
            .map(|id| self.s.request(*id).unwrap().len)
            .collect();
        let (mut unit, mut k) = (unit, k);
        if self.map_tokens {
            assert_eq!(unit, 1, "token rows are what gets mapped");
            unit = PS;
        }
        let u = SelectionUnit::new(unit, PS).unwrap();
        let ppe = u.pages_per_entry();
        let mut failed = Vec::new();
        for l in 0..LAYERS {
            // As the runtime does: layer l's new rows are written when layer l runs, after
            // the earlier layers' plans (and whatever room they made) went by.
            for b in 0..rids.len() {
                let page = ((lens[b] - 1) / u64::from(PS)) as u32;
                let ns = self.s.request(ids[b]).unwrap().key(page, 0).namespace.id;
                self.write_row(
                    slots[b * LAYERS as usize + l as usize],
                    ns,
                    page,
                    l,
                    rows[b],
                );
            }
            let mut flat = Vec::new();
            let mut counts = None;
            if self.map_tokens {
                let rows: Vec<Vec<i64>> =
                    (0..rids.len()).map(|b| sel(rids[b], l, lens[b])).collect();
                let (mut pages, mut c, mut width) = map_token_rows(&rows, PS);
                if let Some(edit) = self.edit_counted {
                    (pages, c, width) = edit_counted_rows(&pages, &c, width, edit);
                }
                (flat, counts, k) = (pages, Some(c), width);
            } else {
                for (b, &rid) in rids.iter().enumerate() {
                    let mut row = sel(rid, l, lens[b]);
                    row.resize(k, -1);
                    flat.extend(row);
                }
            }
            // CSR: each row's entries without padding, with where each came from.
            let csr = self.csr.then(|| Ragged::of(&flat, counts.as_deref(), k));
            let as_i32 = |e: &[i64]| e.iter().map(|&v| v as i32).collect::<Vec<i32>>();
            let planned = match (&csr, self.int32) {
                (Some(c), false) => self
                    .s
                    .plan_csr(l, &ids, &c.offsets, &c.entries, u, c.counts.as_deref())
                    .map(|(id, _)| id),
                (Some(c), true) => self
                    .s
                    .plan_csr(
                        l,
                        &ids,
                        &c.offsets,
                        &as_i32(&c.entries),
                        u,
                        c.counts.as_deref(),
                    )
                    .map(|(id, _)| id),
                (None, false) => self
                    .s
                    .plan_counted(l, &ids, &flat, k, u, counts.as_deref())
                    .map(|(id, _)| id),
                (None, true) => self
                    .s
                    .plan_counted(l, &ids, &as_i32(&flat), k, u, counts.as_deref())
                    .map(|(id, _)| id),
            };
            let id = match planned {
                Ok(p) => p,
                Err(e) => {
                    // The step is abandoned, but every layer's new row is written before the
                    // step ends (the append contract), as a runtime would.
                    for later in l + 1..LAYERS {
                        for b in 0..rids.len() {
                            let page = ((lens[b] - 1) / u64::from(PS)) as u32;
                            let ns = self.s.request(ids[b]).unwrap().key(page, 0).namespace.id;
                            let slot = slots[b * LAYERS as usize + later as usize];
                            self.write_row(slot, ns, page, later, rows[b]);
                        }
                    }
                    self.s.end_step().unwrap();
                    self.s.validate().unwrap();
                    return Err(e);
                }
            };
            let taken = self.take_tables.then(|| self.s.take_table(id).unwrap());
            let out = self.s.ready(id, None).unwrap();
            // A failed row's cells, in the table's form.
            let row_cells = |b: usize| match &csr {
                Some(c) => c.offsets[b] as usize * ppe..c.offsets[b + 1] as usize * ppe,
                None => b * k * ppe..(b + 1) * k * ppe,
            };
            let failed_cells: Vec<(u32, u32)> = out
                .failed
                .iter()
                .map(|f| {
                    let r = row_cells(f.0);
                    (r.start as u32, r.end as u32)
                })
                .collect();
            assert_eq!(out.failed_cells, failed_cells);
            let table = match taken {
                Some(mut t) => {
                    assert!(self.s.table(id).is_err() && self.s.take_table(id).is_err());
                    for &(at, slot) in &out.moved {
                        t[at as usize] = slot;
                    }
                    for &(start, end) in &out.failed_cells {
                        t[start as usize..end as usize].fill(-1);
                    }
                    t
                }
                None => {
                    let t = self.s.table(id).unwrap().to_vec();
                    assert!(out.moved.iter().all(|&(at, slot)| t[at as usize] == slot));
                    t
                }
            };
            let table = match &csr {
                Some(c) => c.padded_table(&table, k, ppe),
                None => table,
            };
            for (b, &rid) in rids.iter().enumerate() {
                if let Some(f) = out.failed.iter().find(|f| f.0 == b) {
                    assert_eq!(f.1, ids[b]);
                    assert!(table[b * k * ppe..(b + 1) * k * ppe]
                        .iter()
                        .all(|&s| s == -1));
                    failed.push(rid);
                    continue;
                }
                for j in 0..k {
                    let e = flat[b * k + j];
                    if e < 0 {
                        continue;
                    }
                    for i in 0..ppe {
                        let slot = table[b * k * ppe + j * ppe + i];
                        let page = (e as u64 * u64::from(unit) / u64::from(PS)) as u32 + i as u32;
                        if u64::from(page * PS) >= lens[b] {
                            assert_eq!(slot, -1);
                            continue;
                        }
                        let ns = self.s.request(ids[b]).unwrap().key(page, l).namespace.id;
                        for row in 0..PS {
                            if u64::from(page * PS + row) >= lens[b] {
                                break;
                            }
                            for plane in 0..2 {
                                assert_eq!(
                                    self.read_row(slot as u32, row, plane),
                                    stamp(ns, page, l, row, plane),
                                    "request {rid} page {page} layer {l} row {row} (slot {slot})"
                                );
                            }
                        }
                    }
                }
            }
            self.s.finish(id).unwrap();
        }
        let rec = self.s.end_step().unwrap();
        self.s.validate().unwrap();
        failed.sort_unstable();
        failed.dedup();
        Ok((failed, rec))
    }

    fn assert_quiet(&mut self) {
        self.s.drain().unwrap();
        self.s.validate().unwrap();
        let st = self.s.directory().stats();
        // Kept selections stay pinned across steps (and a drain): nothing else does.
        assert_eq!(
            (st.pins, st.handles, st.transfers_in_flight),
            (self.s.kept_pins(), 0, 0)
        );
        assert_eq!(
            st.device_free + st.device_used + st.device_quarantined,
            st.device_capacity
        );
        assert_eq!(st.device_quarantined, 0);
    }
}

/// Padded rows as CSR: each row's entries (>= 0) in order, with the column each came from.
struct Ragged {
    offsets: Vec<i64>,
    entries: Vec<i64>,
    counts: Option<Vec<u32>>,
    columns: Vec<usize>,
}

impl Ragged {
    fn of(flat: &[i64], counts: Option<&[u32]>, k: usize) -> Self {
        let mut r = Ragged {
            offsets: vec![0],
            entries: Vec::new(),
            counts: counts.map(|_| Vec::new()),
            columns: Vec::new(),
        };
        for (row, start) in flat.chunks(k.max(1)).zip((0..).step_by(k.max(1))) {
            for (j, &e) in row.iter().enumerate() {
                if e >= 0 {
                    r.entries.push(e);
                    r.columns.push(j);
                    if let (Some(rc), Some(c)) = (r.counts.as_mut(), counts) {
                        rc.push(c[start + j]);
                    }
                }
            }
            r.offsets.push(r.entries.len() as i64);
        }
        r
    }

    /// A CSR table laid out as the padded rows' (-1 in padding).
    fn padded_table(&self, t: &[i32], k: usize, ppe: usize) -> Vec<i32> {
        let rows = self.offsets.len() - 1;
        assert_eq!(
            t.len(),
            self.entries.len() * ppe,
            "one cell per entry and page"
        );
        let mut out = vec![-1; rows * k * ppe];
        for b in 0..rows {
            for n in self.offsets[b] as usize..self.offsets[b + 1] as usize {
                let j = self.columns[n];
                out[(b * k + j) * ppe..(b * k + j + 1) * ppe]
                    .copy_from_slice(&t[n * ppe..(n + 1) * ppe]);
            }
        }
        out
    }
}

/// Token rows as page rows with per-page token counts, padded to the widest row (the
/// reference the runtime's device mapping is tested against). Returns (pages, counts, width).
fn map_token_rows(rows: &[Vec<i64>], ps: u32) -> (Vec<i64>, Vec<u32>, usize) {
    let k = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let flat: Vec<i64> = rows
        .iter()
        .flat_map(|r| r.iter().copied().chain(std::iter::repeat(-1)).take(k))
        .collect();
    crate::scheduler::bench::counted_rows(&flat, k, ps)
}

/// An edit of one counted row's (page, count) cells.
type EditCounted = fn(&mut Vec<(i64, u32)>);

/// Counted page rows (`width` cells a row, padding -1 with count 0) with each row's cells
/// edited by `edit`, padded again to the widest.
fn edit_counted_rows(
    pages: &[i64],
    counts: &[u32],
    width: usize,
    edit: EditCounted,
) -> (Vec<i64>, Vec<u32>, usize) {
    let rows: Vec<Vec<(i64, u32)>> = pages
        .chunks(width)
        .zip(counts.chunks(width))
        .map(|(p, c)| {
            let mut row: Vec<(i64, u32)> = p
                .iter()
                .copied()
                .zip(c.iter().copied())
                .filter(|&(p, _)| p >= 0)
                .collect();
            edit(&mut row);
            row
        })
        .collect();
    let width = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let cells = rows.iter().flat_map(|r| {
        r.iter()
            .copied()
            .chain(std::iter::repeat((-1, 0)))
            .take(width)
    });
    let (pages, counts) = cells.unzip();
    (pages, counts, width)
}

/// Sink, the last block, and pseudo-random blocks in between.
fn blocks(seed: u64, len: u64, unit: u32, k: usize) -> Vec<i64> {
    let n = len.div_ceil(u64::from(unit)) as i64;
    let mut rng = XorShift::new(seed);
    let mut v = vec![0, n - 1];
    while v.len() < k.min(n as usize) {
        let b = rng.below(n as u64) as i64;
        if !v.contains(&b) {
            v.push(b);
        }
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// Three requests of 30, 39 and 48 tokens on 64 device pages: selections of 4 blocks that
/// force loads and evictions.
fn three_requests(prefetch: bool) -> Harness {
    let mut h = Harness::new(64, 400, prefetch);
    for rid in 0..3 {
        h.add(rid, 30 + 9 * rid, None);
    }
    h
}

/// Step `step` of `three_requests`: a different mix of blocks per request, layer and step.
fn three_requests_step(h: &mut Harness, step: u64) -> (Vec<u64>, StepRecord) {
    h.step(&[0, 1, 2], PS, 4, &mut |r, l, len| {
        blocks(step * 97 + r * 13 + u64::from(l), len, PS, 4)
    })
}

#[test]
fn a_step_reads_the_right_bytes_through_loads_and_evictions() {
    let mut h = three_requests(false);
    let mut loads = 0;
    for step in 0..12 {
        let (failed, rec) = three_requests_step(&mut h, step);
        assert!(failed.is_empty());
        assert!(rec.pages <= rec.selected);
        loads += rec.loaded;
        assert_eq!(rec.layers, u64::from(LAYERS));
    }
    assert!(loads > 0, "the budget must force loads");
    h.assert_quiet();
    for rid in 0..3 {
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    assert_eq!(h.s.directory().stats().objects, 0);
}

#[test]
fn the_cpu_split_sums_to_the_step_cpu_and_counts_where_work_happened() {
    let mut h = three_requests(true);
    let mut loaded_steps = 0;
    for step in 0..8 {
        let (_, rec) = three_requests_step(&mut h, step);
        let calls = rec.cpu_plan_ns
            + rec.cpu_ready_ns
            + rec.cpu_finish_ns
            + rec.cpu_append_ns
            + rec.cpu_end_step_ns;
        assert_eq!(calls, rec.cpu_ns, "{rec:?}");
        assert!(rec.cpu_rows_ns + rec.cpu_resolve_ns + rec.cpu_submit_ns <= rec.cpu_plan_ns);
        assert!(rec.cpu_prefetch_ns <= rec.cpu_plan_ns + rec.cpu_end_step_ns);
        for (name, v) in [
            ("plan", rec.cpu_plan_ns),
            ("ready", rec.cpu_ready_ns),
            ("finish", rec.cpu_finish_ns),
            ("append", rec.cpu_append_ns),
            ("end_step", rec.cpu_end_step_ns),
            ("rows", rec.cpu_rows_ns),
            ("prefetch", rec.cpu_prefetch_ns),
        ] {
            assert!(v > 0, "cpu_{name}_ns is 0: {rec:?}");
        }
        if rec.loaded > 0 {
            loaded_steps += 1;
            assert!(rec.cpu_resolve_ns > 0 && rec.cpu_submit_ns > 0, "{rec:?}");
        }
    }
    assert!(loaded_steps > 0, "the budget must force loads");
    // The running totals fold the split like every other counter.
    let t = h.s.totals();
    assert!(t.cpu_rows_ns > 0 && t.cpu_plan_ns <= t.cpu_ns);
    h.assert_quiet();
}

#[test]
fn block_mode_reads_whole_pages_so_read_amplification_is_one() {
    let mut h = Harness::new(60, 400, false);
    h.add(0, 60, None);
    h.add(1, 44, None);
    let mut tot = StepRecord::default();
    for step in 0..6 {
        let (_, rec) = h.step(&[0, 1], PS, 3, &mut |r, l, len| {
            blocks(step * 5 + r + u64::from(l) * 7, len, PS, 3)
        });
        tot.fold(&rec);
    }
    assert!(tot.bytes_transferred > 0);
    assert_eq!(tot.bytes_transferred, tot.bytes_needed_of_transferred);
    assert!((tot.read_amplification().unwrap() - 1.0).abs() < 1e-12);
}

#[test]
fn token_mode_dedups_tokens_into_pages_and_counts_sparse_reads() {
    let mut h = Harness::new(56, 400, false);
    h.add(0, 64, None);
    h.add(1, 64, None);
    // Tokens 1, 2 (page 0), 17 (page 4), 33 (page 8), 62 (page 15): four pages, five tokens.
    let (failed, rec) = h.step(&[0], 1, 6, &mut |_, _, _| vec![1, 2, 17, 33, 62, -1]);
    assert!(failed.is_empty());
    assert_eq!(rec.selected, 5 * u64::from(LAYERS));
    assert_eq!(rec.pages, 4 * u64::from(LAYERS));
    let tb = h.s.object_bytes() / u64::from(PS);
    assert_eq!(rec.bytes_needed, 5 * u64::from(LAYERS) * tb);
    // Request 1's prefill (16 pages x 3 layers into 56 slots) evicted request 0's written-
    // through pages, so whole pages moved for one or two tokens each: amplification above 1.
    assert!(rec.bytes_transferred > 0, "{rec:?}");
    assert!(rec.read_amplification().unwrap() > 1.0, "{rec:?}");
    h.assert_quiet();
}

#[test]
fn blocks_larger_than_pages_fill_several_cells() {
    let mut h = Harness::new(60, 400, false);
    h.add(0, 37, None);
    // 8-token blocks over 4-token pages: block 4 covers tokens 32..40, of which 32..38 exist
    // after the append (38 tokens): pages 8 and 9.
    let (failed, rec) = h.step(&[0], 2 * PS, 2, &mut |_, _, _| vec![0, 4]);
    assert!(failed.is_empty());
    assert_eq!(rec.pages, 4 * u64::from(LAYERS));
    h.assert_quiet();
}

#[test]
fn one_failed_load_is_retried_and_nobody_fails() {
    for take in [false, true] {
        for csr in [false, true] {
            one_failed_load_retried(take, csr, false);
        }
    }
    // A copy worker that panics on a load (a bug in the copy path) fails it the same way.
    one_failed_load_retried(false, false, true);
}

/// Arms `count` load (or backup) faults: failures, or panics of the engine's worker.
fn arm(s: &mut StepScheduler, d: Direction, count: u32, layer: Option<u16>, panic: bool) {
    match panic {
        true => s.inject_panics(d, count, layer),
        false => s.inject_faults(d, count, layer, None),
    }
}

fn one_failed_load_retried(take_tables: bool, csr: bool, panic: bool) {
    let mut h = Harness::new(40, 400, false);
    h.take_tables = take_tables;
    h.csr = csr;
    for rid in 0..3 {
        h.add(rid, 40, None);
    }
    arm(&mut h.s, Direction::Load, 1, None, panic);
    let mut retried = 0;
    for step in 0..4 {
        let (failed, rec) = h.step(&[0, 1, 2], PS, 4, &mut |r, l, len| {
            blocks(step * 31 + r * 3 + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
        retried += rec.retried_loads;
    }
    assert_eq!(retried, 1);
    assert_eq!(h.s.totals().failed_loads, 1);
    h.assert_quiet();
}

#[test]
fn a_layer_whose_loads_fail_twice_fails_only_the_requests_that_needed_them() {
    for take in [false, true] {
        for csr in [false, true] {
            loads_failing_twice(take, csr, false);
        }
    }
    loads_failing_twice(true, false, true);
}

fn loads_failing_twice(take_tables: bool, csr: bool, panic: bool) {
    let mut h = Harness::new(40, 400, false);
    h.take_tables = take_tables;
    h.csr = csr;
    for rid in 0..3 {
        h.add(rid, 40, None);
    }
    // Request 2 reads only its local window (always on the device); 0 and 1 read old blocks.
    let mut sel = |r: u64, _l: u16, len: u64| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        if r == 2 {
            vec![n - 1]
        } else {
            vec![0, 1, 2, n - 1]
        }
    };
    arm(&mut h.s, Direction::Load, 2, Some(1), panic);
    let (failed, rec) = h.step(&[0, 1, 2], PS, 4, &mut sel);
    assert_eq!(failed, vec![0, 1]);
    assert_eq!(rec.failed_requests, 2);
    assert_eq!(rec.retried_loads, 1);
    h.s.validate().unwrap();
    // What stays pinned is what the rows keep for the next step: none at the failed layer.
    assert_eq!(h.s.directory().stats().pins, h.s.kept_pins());
    for rid in [0, 1] {
        assert!(h.s.kept_pages(RequestId::new(rid), 1).unwrap().is_empty());
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    // The survivor keeps its one page at every layer.
    assert_eq!(h.s.directory().stats().pins, u64::from(LAYERS));
    // The survivor goes on.
    for _ in 0..3 {
        let (failed, _) = h.step(&[2], PS, 4, &mut sel);
        assert!(failed.is_empty());
    }
    h.assert_quiet();
}

#[test]
fn a_failed_backup_is_retried_and_the_pages_become_evictable() {
    for panic in [false, true] {
        let mut h = Harness::new(40, 400, false);
        arm(&mut h.s, Direction::Backup, 1, None, panic);
        h.add(0, 16, None);
        for _ in 0..3 {
            h.step(&[0], PS, 2, &mut |_, _, len| blocks(1, len, PS, 2));
        }
        h.assert_quiet();
        assert_eq!(h.s.totals().failed_backups, 1);
        let st = h.s.directory().stats();
        // 4 full pages x 3 layers backed up on the retry; the page being written has no copy.
        assert_eq!(st.host_ready, 4 * LAYERS as usize);
    }
}

/// Request `r`'s selection that stays from step to step: the sink, block `2 + r`, block 5
/// and the last (which moves only when a page starts).
fn steady_blocks(r: u64, len: u64) -> Vec<i64> {
    let n = len.div_ceil(u64::from(PS)) as i64;
    vec![0, 2 + r as i64, 5, n - 1]
}

#[test]
fn prefetch_predicts_a_steady_selection_and_records_its_accuracy() {
    let mut h = Harness::new(56, 400, true);
    // Kept selections would hold last step's pages on the device: nothing to load ahead.
    h.s.set_keep_selections(false).unwrap();
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let (_, first) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!(first.prefetch_hits, 0);
    // Everything evictable leaves the device (a prefetch pins only what it loads), so the
    // later layers' prefetches, issued by the plans before them, have loads to make.
    h.s.directory().evict(1000);
    let (_, second) = h.step(&[0, 1], PS, 4, &mut sel);
    // Every layer's selection was predicted (the last block did not move within a page), and
    // what prefetch loaded was all read.
    assert_eq!(second.prefetch_hits, second.pages);
    assert!((second.prefetch_accuracy().unwrap() - 1.0).abs() < 1e-12);
    assert!(second.prefetch_loaded > 0 && second.prefetch_pinned_peak > 0);
    assert_eq!(second.prefetch_wasted, 0);
    h.assert_quiet();
}

#[test]
fn with_prefetch_on_kept_selections_are_the_prediction() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let (_, first) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!((first.prefetch_predicted, first.prefetch_hits), (0, 0));
    assert!(
        h.s.kept_pins() > 0,
        "prefetch on no longer turns kept selections off"
    );
    let (_, second) = h.step(&[0, 1], PS, 4, &mut sel);
    // Last step's selection stayed on the device: predicted, all read, nothing loaded for it.
    assert_eq!(second.prefetch_predicted, second.pages);
    assert_eq!(second.prefetch_hits, second.pages);
    assert_eq!(
        (
            second.loaded,
            second.prefetch_loaded,
            second.prefetch_wasted
        ),
        (0, 0, 0)
    );
    assert_eq!(second.prefetch_pinned_peak, 0);
    // A selection that moves: the dropped pages were predicted but not read.
    let mut moved = |r: u64, _l: u16, len: u64| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        vec![0, 3 + r as i64, 6, n - 1]
    };
    let (_, third) = h.step(&[0, 1], PS, 4, &mut moved);
    assert_eq!(third.prefetch_predicted, second.pages);
    // Two of each row's four pages moved.
    assert_eq!(third.prefetch_hits, third.pages / 2);
    assert!(third.prefetch_accuracy().unwrap() < 1.0);
    h.assert_quiet();
}

#[test]
fn with_prefetch_on_kept_token_selections_are_the_prediction() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    // Tokens 0-1, 9, 20-22 and the last: pages 0, 2, 5 and the last, as above.
    let mut sel = |_r: u64, _l: u16, len: u64| vec![0, 1, 9, 20, 21, 22, len as i64 - 1];
    h.step(&[0], 1, 7, &mut sel);
    let (_, second) = h.step(&[0], 1, 7, &mut sel);
    assert!(h.s.kept_pins() > 0);
    assert_eq!(second.prefetch_predicted, second.pages);
    assert_eq!(
        (second.prefetch_hits, second.prefetch_loaded),
        (second.pages, 0)
    );
    h.assert_quiet();
}

#[test]
fn kept_pages_given_back_stay_predicted() {
    let mut h = Harness::new(56, 400, true);
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    h.step(&[0, 1], PS, 4, &mut sel);
    h.step(&[0, 1], PS, 4, &mut sel);
    assert!(h.s.kept_pins() > 0);
    // Giving the kept pages back (what making room does) hands them to prefetch: once
    // evicted, the later layers' prefetches load them again.
    h.s.set_keep_selections(false).unwrap();
    h.s.directory().evict(1000);
    let (_, rec) = h.step(&[0, 1], PS, 4, &mut sel);
    assert!(rec.prefetch_loaded > 0, "{rec:?}");
    assert_eq!(rec.prefetch_wasted, 0);
    h.assert_quiet();
}

#[test]
fn kept_pages_hold_at_most_half_the_device() {
    // Three requests x three layers x four pages = 36 pages a step to keep, on 40 slots.
    let mut h = Harness::new(40, 400, false);
    for r in 0..3 {
        h.add(r, 40, None);
    }
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    let mut kept_any = false;
    for _ in 0..4 {
        h.step(&[0, 1, 2], PS, 4, &mut sel);
        assert!(h.s.kept_pins() <= 20, "{} kept pins", h.s.kept_pins());
        kept_any |= h.s.kept_pins() > 0;
        h.s.validate().unwrap();
    }
    // The layers that fit keep theirs; the others resolve every page, as without keeping.
    assert!(kept_any);
    h.assert_quiet();
}

#[test]
fn a_kept_plan_scores_the_prefetch_of_a_plan_that_did_not_keep() {
    let mut h = Harness::new(56, 400, true);
    h.s.set_keep_selections(false).unwrap();
    h.add(0, 64, None);
    h.add(1, 64, None);
    let mut sel = |r: u64, _l: u16, len: u64| steady_blocks(r, len);
    h.step(&[0, 1], PS, 4, &mut sel);
    h.s.directory().evict(1000);
    // The layers' prefetches come from the unkept step's selections; kept plans consume them.
    h.s.set_keep_selections(true).unwrap();
    let (_, rec) = h.step(&[0, 1], PS, 4, &mut sel);
    assert!(rec.prefetch_loaded > 0);
    assert_eq!(rec.prefetch_hits, rec.pages);
    assert_eq!(rec.prefetch_wasted, 0);
    assert!(h.s.kept_pins() > 0);
    // From here the kept pages are the prediction: no more prefetch loads.
    let (_, next) = h.step(&[0, 1], PS, 4, &mut sel);
    assert_eq!((next.prefetch_loaded, next.prefetch_hits), (0, next.pages));
    assert_eq!(next.prefetch_predicted, next.pages);
    h.assert_quiet();
}

#[test]
fn shared_prompts_are_read_by_every_request_and_outlive_them() {
    let mut h = Harness::new(60, 400, true);
    h.add_prompt(1000, 3);
    let prefix = Some(Prefix {
        namespace: 1000,
        pages: 3,
    });
    h.add(0, 20, prefix);
    h.add(1, 14, prefix);
    for step in 0..4 {
        let (failed, _) = h.step(&[0, 1], PS, 4, &mut |r, l, len| {
            blocks(step + r + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
    }
    assert!(h.s.drop_prompt(1000).is_err(), "read by running requests");
    for rid in [0, 1] {
        h.s.finish_request(RequestId::new(rid)).unwrap();
    }
    h.assert_quiet();
    assert_eq!(h.s.directory().stats().objects, 3 * LAYERS as usize);
    h.s.drop_prompt(1000).unwrap();
    assert_eq!(h.s.directory().stats().objects, 0);
}

#[test]
fn bad_input_is_refused_without_changing_anything() {
    let mut h = Harness::new(40, 400, false);
    h.add(0, 20, None);
    let u = SelectionUnit::new(PS, PS).unwrap();
    let ids = [RequestId::new(0)];
    let (_, _) = h.s.append(&ids).unwrap();
    assert!(matches!(
        h.s.plan(LAYERS, &ids, &[0], 1, u),
        Err(crate::Error::OutOfRange { .. })
    ));
    assert!(matches!(
        h.s.plan(0, &ids, &[99], 1, u),
        Err(crate::Error::OutOfRange { .. })
    ));
    // A sorted row (the indexer's) is checked at its ends: the culprit is still named.
    let e = h.s.plan(0, &ids, &[0, 1, 99], 3, u).unwrap_err();
    assert!(e.to_string().contains("selection[0][2]"), "{e}");
    assert!(h.s.plan(0, &ids, &[0, 1], 1, u).is_err());
    assert!(h.s.plan(0, &[RequestId::new(5)], &[0], 1, u).is_err());
    assert!(h.s.plan(0, &[ids[0], ids[0]], &[0, 1], 1, u).is_err());
    assert!(h.s.plan(0, &ids, &[-1], 1, u).is_err());
    // Token rows (kept selections map them to pages first): sorted, unsorted, all padding.
    let t = SelectionUnit::new(1, PS).unwrap();
    for (row, culprit) in [(&[0, 3, 21][..], 2), (&[21, 3, 0], 0), (&[3, -1, 99], 2)] {
        let e = h.s.plan(0, &ids, row, 3, t).unwrap_err();
        assert!(matches!(e, crate::Error::OutOfRange { .. }), "{e}");
        assert!(
            e.to_string().contains(&format!("selection[0][{culprit}]")),
            "{e}"
        );
    }
    assert!(h.s.plan(0, &ids, &[-1, -1], 2, t).is_err());
    assert!(h.s.add_request(RequestId::new(0), 4, None).is_err());
    assert!(h
        .s
        .add_request(
            RequestId::new(9),
            4,
            Some(Prefix {
                namespace: 77,
                pages: 1
            })
        )
        .is_err());
    // Sizes the device can never hold are refused before any key is built (a fuzz finding:
    // 2^40 tokens aborted the process on the allocation).
    assert!(matches!(
        h.s.add_request(RequestId::new(7), 1 << 40, None),
        Err(crate::Error::Config { .. })
    ));
    assert!(h.s.request(RequestId::new(7)).is_none());
    assert!(h.s.extend(ids[0], u64::MAX).is_err());
    assert!(h.s.add_prompt(99, u32::MAX).is_err());
    h.s.validate().unwrap();
    assert_eq!(h.s.directory().stats().pins, 0);
}

#[derive(Debug, Clone)]
enum Op {
    Add(u64),
    Step(u64),
    Finish(usize),
    LoadFault(u8, bool),
    BackupFault,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (8u64..40).prop_map(Op::Add),
        6 => any::<u64>().prop_map(Op::Step),
        1 => (0usize..8).prop_map(Op::Finish),
        1 => (0u8..3, any::<bool>()).prop_map(|(l, twice)| Op::LoadFault(l, twice)),
        1 => Just(Op::BackupFault),
    ]
}

proptest! {
    #![proptest_config(crate::testing::proptest_config(96, "scheduler"))]

    /// Random arrivals, steps (block or token selections, token rows sometimes mapped to
    /// counted page rows), finishes and faults against the reference model (the stamps):
    /// every byte read is right, every invariant holds after every step, and at the end
    /// nothing is pinned, in flight or quarantined.
    #[test]
    fn scheduler_state_machine(
        ops in proptest::collection::vec(op(), 1..30),
        prefetch: bool,
        keep: bool,
        take_tables: bool,
    ) {
        let mut h = Harness::new(100, 2000, prefetch);
        h.take_tables = take_tables;
        h.s.set_keep_selections(keep).unwrap();
        let mut live: Vec<u64> = Vec::new();
        let mut next = 0u64;
        let mut backup_faults = false;
        for op in ops {
            match op {
                Op::Add(n) => {
                    if live.len() < 4 {
                        match h.try_add(next, n, None) {
                            Ok(()) => live.push(next),
                            // Injected backup faults can leave too few evictable pages: a
                            // typed refusal that registers nothing.
                            Err(crate::Error::OutOfSlots { .. }) if backup_faults => {
                                prop_assert!(h.s.request(RequestId::new(next)).is_none());
                            }
                            Err(e) => return Err(TestCaseError::fail(e.to_string())),
                        }
                        next += 1;
                    }
                }
                Op::Step(seed) if !live.is_empty() => {
                    // Tokens (rows in any order, or sorted as the indexer's usually are),
                    // 2-token blocks inside pages, or page blocks.
                    let token = seed % 2 == 0;
                    let (unit, k) = match seed % 6 {
                        0 | 2 => (1, 6),
                        4 => (2, 6),
                        _ => (PS, 3),
                    };
                    // Some token steps arrive mapped to counted page rows (`plan_counted`).
                    h.map_tokens = unit == 1 && (seed / 12) % 2 == 1;
                    // Some steps plan their rows as CSR (`plan_csr`), padding dropped.
                    h.csr = (seed / 24) % 2 == 1;
                    // Some hand their rows over as int32.
                    h.int32 = (seed / 48) % 2 == 1;
                    let stepped = h.try_step(&live, unit, k, &mut |r, l, len| {
                        if token {
                            let mut rng = XorShift::new(seed ^ r ^ u64::from(l) << 8);
                            let n = len.div_ceil(u64::from(unit));
                            let mut row: Vec<i64> = (0..k).map(|_| rng.below(n) as i64).collect();
                            // Some rows shorter than k: padded in `[B, k]`, ragged as CSR.
                            row.truncate(k - rng.below(3) as usize);
                            if (seed / 6) % 2 == 0 {
                                row.sort_unstable();
                            }
                            row
                        } else {
                            blocks(seed ^ r ^ u64::from(l), len, unit, k)
                        }
                    });
                    (h.map_tokens, h.csr, h.int32) = (false, false, false);
                    let failed = match stepped {
                        Ok((failed, _)) => failed,
                        // Write-throughs that keep failing leave pages that cannot be
                        // evicted: a full device is then a typed refusal, and the state stays
                        // valid (checked below and at the end).
                        Err(crate::Error::OutOfSlots { .. }) if backup_faults => Vec::new(),
                        Err(e) => return Err(TestCaseError::fail(e.to_string())),
                    };
                    for f in failed {
                        h.s.finish_request(RequestId::new(f)).unwrap();
                        live.retain(|&r| r != f);
                    }
                }
                Op::Step(_) => {}
                Op::Finish(i) => {
                    if !live.is_empty() {
                        let r = live.remove(i % live.len());
                        h.s.finish_request(RequestId::new(r)).unwrap();
                    }
                }
                Op::LoadFault(l, twice) => {
                    h.s.inject_faults(Direction::Load, 1 + u32::from(twice), Some(u16::from(l)), None);
                }
                Op::BackupFault => {
                    backup_faults = true;
                    h.s.inject_faults(Direction::Backup, 1, None, None)
                }
            }
            h.s.validate().map_err(TestCaseError::fail)?;
        }
        h.assert_quiet();
        for r in live {
            h.s.finish_request(RequestId::new(r)).unwrap();
        }
        h.assert_quiet();
        prop_assert_eq!(h.s.kept_pins(), 0);
        prop_assert_eq!(h.s.directory().stats().objects, 0);
    }
}

#[test]
fn chunked_prefill_extends_the_page_being_written() {
    let mut h = Harness::new(64, 400, false);
    h.add(0, 6, None); // pages 0 (full) and 1 (2 rows)
    let (first, slots) = h.s.extend(RequestId::new(0), 7).unwrap(); // tokens 6..13
    assert_eq!(first, 1);
    let touched = 3; // pages 1, 2, 3
    assert_eq!(slots.len(), touched * LAYERS as usize);
    for l in 0..LAYERS {
        for i in 0..touched {
            let page = first + i as u32;
            for row in 0..PS {
                let t = u64::from(page * PS + row);
                if (6..13).contains(&t) {
                    h.write_row(slots[l as usize * touched + i], 0, page, l, row);
                }
            }
        }
    }
    for step in 0..5 {
        let (failed, _) = h.step(&[0], PS, 4, &mut |_, l, len| {
            blocks(step + u64::from(l), len, PS, 4)
        });
        assert!(failed.is_empty());
    }
    h.assert_quiet();
}

#[test]
fn a_page_filling_mid_step_is_written_through_only_after_every_layer_wrote_it() {
    let mut h = Harness::new(36, 400, false);
    h.add(1, 40, None);
    h.step(&[1], PS, 2, &mut |_, _, len| blocks(0, len, PS, 2));
    h.s.drain().unwrap();
    h.add(2, 40, None); // evicts request 1's written-through pages; its own wait for a backup
    h.add(0, 3, None);
    // This step's token fills request 0's page 0, layer by layer. Request 1 reads two pages
    // that are on host only, so the plan of layer 0 must make room (write request 2's prefill
    // through) while page 0 has its new row at layer 0 only.
    let (failed, _) = h.step(&[0, 1], PS, 3, &mut |r, _, len| {
        let n = len.div_ceil(u64::from(PS)) as i64;
        if r == 0 {
            vec![0]
        } else {
            vec![0, 1, n - 1]
        }
    });
    assert!(failed.is_empty());
    h.s.drain().unwrap();
    // Kept selections would keep page 0 pinned on the device: give them back to evict it.
    h.s.set_keep_selections(false).unwrap();
    h.s.directory().evict(1000);
    // Page 0 of every layer comes back from its host copy: every row must be there.
    let (failed, rec) = h.step(&[0], PS, 2, &mut |_, _, _| vec![0, 1]);
    assert!(failed.is_empty());
    assert!(rec.loaded >= u64::from(LAYERS), "{rec:?}");
    h.assert_quiet();
}

#[test]
fn kept_pages_are_read_from_their_slots_and_given_back_when_dropped() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None); // pages 0..10
    let pins_of = |h: &Harness, page: u32, l: u16| {
        let key = h.s.request(RequestId::new(0)).unwrap().key(page, l);
        h.s.directory().state(&key).unwrap().pins
    };
    let (failed, _) = h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 3, 9]);
    assert!(failed.is_empty());
    // Every selected page stays pinned for the next step, once.
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    assert_eq!(h.s.directory().stats().pins, h.s.kept_pins());
    assert_eq!(pins_of(&h, 3, 1), 1);
    // The same selection again: every page a kept hit, nothing resolved or loaded.
    let (failed, rec) = h.step(&[0], PS, 3, &mut |_, _, _| vec![9, 0, 3, 3]);
    assert!(failed.is_empty());
    assert_eq!((rec.ready, rec.loaded, rec.pages), (9, 0, 9), "{rec:?}");
    assert_eq!(pins_of(&h, 3, 1), 1, "a repeated entry pins nothing more");
    // Page 3 dropped for 5: given back, and 5 kept.
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(pins_of(&h, 3, 1), 0);
    assert_eq!(pins_of(&h, 5, 1), 1);
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    // A new page named twice: both cells read its fresh slot (checked by `step`).
    h.step(&[0], PS, 4, &mut |_, _, _| vec![0, 7, 9, 7]);
    assert_eq!(pins_of(&h, 7, 1), 1);
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    // Off: every kept page back, and the steps still read the right rows (checked by `step`).
    h.s.set_keep_selections(false).unwrap();
    assert_eq!((h.s.kept_pins(), h.s.directory().stats().pins), (0, 0));
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(h.s.directory().stats().pins, 0);
    h.s.set_keep_selections(true).unwrap();
    h.step(&[0], PS, 3, &mut |_, _, _| vec![0, 5, 9]);
    assert_eq!(h.s.kept_pins(), 3 * u64::from(LAYERS));
    h.s.finish_request(RequestId::new(0)).unwrap();
    assert_eq!((h.s.kept_pins(), h.s.directory().stats().pins), (0, 0));
    h.assert_quiet();
}

#[test]
fn token_selections_keep_their_pages_and_count_as_without_kept_selections() {
    // Tokens (and 2-token blocks) inside 4-token pages: sorted rows, rows out of order with
    // repeats and padding, a sorted row ending in a request's last, partial block. Kept
    // selections on and off must count the same entries, pages and needed bytes; `step`
    // checks every byte read through either table.
    let rows: [(u32, Vec<i64>); 7] = [
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
        (1, vec![31, 6, 0, 6, -1, 13, 1, 22]),
        (2, vec![0, 3, 6, 7, 15, -1, -1, -1]),
        // 998, 999: the request's last two blocks (request 0 has 35 tokens by then: its
        // last block holds one).
        (2, vec![0, 1, 4, 9, 9, 15, 998, 999]),
        (1, vec![2, 2, 2, 2, 2, 3, 9, -1]), // page 0 named six times: four tokens needed
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
        (1, vec![0, 1, 5, 6, 7, 13, 30, 31]),
    ];
    let mut kept = Harness::new(100, 400, false);
    let mut unkept = Harness::new(100, 400, false);
    unkept.s.set_keep_selections(false).unwrap();
    for h in [&mut kept, &mut unkept] {
        h.add(0, 31, None); // 32 tokens after the first append: pages 0..8
        h.add(1, 40, None);
    }
    for (i, (unit, row)) in rows.iter().enumerate() {
        let mut sel = |r: u64, _: u16, len: u64| -> Vec<i64> {
            let unit = i64::from(*unit);
            // Request 1 reads two pages further on, to be told apart.
            let shift = if r == 1 { 8 / unit } else { 0 };
            let entries = len.div_ceil(unit as u64) as i64;
            row.iter()
                .map(|&e| match e {
                    ..0 => e,
                    900.. => entries - (1000 - e),
                    _ => e + shift,
                })
                .collect()
        };
        let (f1, a) = kept.step(&[0, 1], *unit, 8, &mut sel);
        let (f2, b) = unkept.step(&[0, 1], *unit, 8, &mut sel);
        assert!(f1.is_empty() && f2.is_empty());
        assert_eq!(
            (a.selected, a.pages, a.bytes_needed),
            (b.selected, b.pages, b.bytes_needed),
            "step {i}"
        );
        kept.s.validate().unwrap();
        if i == 6 {
            // The same row two steps running: every page a kept hit, nothing resolved.
            assert_eq!((a.ready, a.loaded), (a.pages, 0), "{a:?}");
            // Pages 0, 1, 3, 7 of each request at every layer stay kept, once each.
            assert_eq!(kept.s.kept_pins(), 2 * 4 * u64::from(LAYERS));
        }
    }
    assert_eq!(unkept.s.kept_pins(), 0);
    kept.s.finish_request(RequestId::new(0)).unwrap();
    kept.s.finish_request(RequestId::new(1)).unwrap();
    assert_eq!(kept.s.kept_pins(), 0);
    kept.assert_quiet();
}

/// Request `r`'s row at layer `l` (`len` tokens) in `step`: 0 to 5 blocks of a page (of at
/// most `k`), or twice as many tokens, varying with all four.
fn ragged_row(tokens: bool, step: u64, (r, l, len): (u64, u16, u64), k: usize) -> Vec<i64> {
    let n = ((r + step + u64::from(l)) % 6) as usize; // 0 to 5 entries
    if tokens {
        (0..n as u64 * 2)
            .map(|i| ((i * 7 + r * 5 + step) % len) as i64)
            .collect()
    } else {
        let mut b = blocks(step * 13 + r * 3 + u64::from(l), len, PS, k);
        b.truncate(n);
        b
    }
}

#[test]
fn ragged_rows_as_csr_plan_as_their_padded_rows_do() {
    // Requests select different numbers of blocks (and some none at a layer); token rows,
    // as they are or mapped to counted pages, are ragged too. Through `plan_csr` each step
    // must read the same bytes (`step` checks every one through the table) and count the
    // same as the padded rows, with kept selections across steps. Each builder reads CSR rows
    // where they lie: blocks (`kept_rows`), token rows (`kept_entry_rows`), mapped ones
    // (`kept_rows` with counts).
    for (tokens, map_tokens) in [(false, false), (true, false), (true, true)] {
        let mut padded = three_requests(false);
        let mut csr = three_requests(false);
        csr.csr = true;
        for h in [&mut padded, &mut csr] {
            h.map_tokens = map_tokens;
            h.take_tables = tokens; // both ways of reading the table
        }
        let (unit, k) = if tokens { (1, 12) } else { (PS, 5) };
        for step in 0..8u64 {
            let mut sel = |r: u64, l: u16, len: u64| {
                let mut row = ragged_row(tokens, step, (r, l, len), k);
                row.dedup();
                row
            };
            if step == 5 {
                // A layer's load fails once: its retry moves cells, reported in each form.
                for h in [&mut padded, &mut csr] {
                    h.s.inject_faults(Direction::Load, 1, Some(2), None);
                }
            }
            let (f1, a) = padded.step(&[0, 1, 2], unit, k, &mut sel);
            let (f2, b) = csr.step(&[0, 1, 2], unit, k, &mut sel);
            if step == 5 {
                assert_eq!(
                    (a.retried_loads, b.retried_loads),
                    (1, 1),
                    "tokens {tokens}, mapped {map_tokens}"
                );
            }
            for h in [&mut padded, &mut csr] {
                h.s.drain().unwrap();
            }
            assert!(f1.is_empty() && f2.is_empty());
            let key = |r: &StepRecord| (r.selected, r.pages, r.bytes_needed, r.loaded, r.ready);
            assert_eq!(
                key(&a),
                key(&b),
                "step {step}, tokens {tokens}, mapped {map_tokens}"
            );
        }
        assert_eq!(padded.s.kept_pins(), csr.s.kept_pins());
        for h in [&mut padded, &mut csr] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

#[test]
fn int32_rows_plan_as_their_int64_rows_do() {
    // The same rows handed over as int32 must read the same bytes (`step` checks every one
    // through the table) and count the same as int64 rows, in every builder: block rows
    // (`kept_rows`), token rows sorted (the run scan) and not (`kept_entry_rows`), mapped to
    // counted pages, through the directory (kept selections off: `selection_rows`), padded and
    // as CSR, with padding (-1) in the rows.
    for (tokens, map_tokens, keep, csr, sorted) in [
        (false, false, true, false, true),
        (false, false, true, true, false),
        (true, false, true, false, true),
        (true, false, true, true, true),
        (true, false, true, true, false),
        (true, true, true, false, true),
        (true, false, false, false, false),
        (false, false, false, true, true),
    ] {
        let mut wide = three_requests(false);
        let mut narrow = three_requests(false);
        narrow.int32 = true;
        for h in [&mut wide, &mut narrow] {
            h.map_tokens = map_tokens;
            h.csr = csr;
            h.s.set_keep_selections(keep).unwrap();
        }
        let (unit, k) = if tokens { (1, 12) } else { (PS, 5) };
        let case = format!("tokens {tokens}, mapped {map_tokens}, keep {keep}, csr {csr}");
        for step in 0..8u64 {
            let mut sel = |r: u64, l: u16, len: u64| {
                let mut row = ragged_row(tokens, step, (r, l, len), k);
                if sorted {
                    row.sort_unstable();
                } else {
                    row.reverse();
                }
                row
            };
            let (f1, a) = wide.step(&[0, 1, 2], unit, k, &mut sel);
            let (f2, b) = narrow.step(&[0, 1, 2], unit, k, &mut sel);
            // Write-throughs landed before the next step on both (what is evictable, and so
            // what loads, follows them).
            for h in [&mut wide, &mut narrow] {
                h.s.drain().unwrap();
            }
            assert!(f1.is_empty() && f2.is_empty());
            assert_eq!(plan_counts(&a), plan_counts(&b), "step {step}, {case}");
        }
        assert_eq!(wide.s.kept_pins(), narrow.s.kept_pins(), "{case}");
        for h in [&mut wide, &mut narrow] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

/// What a step's plans selected, found, loaded and counted as needed: equal for two ways of
/// handing over the same rows.
fn plan_counts(r: &StepRecord) -> [u64; 7] {
    [
        r.selected,
        r.pages,
        r.ready,
        r.loaded,
        r.bytes_needed,
        r.bytes_transferred,
        r.bytes_needed_of_transferred,
    ]
}

/// Two harnesses that planned the same rows handed over differently: after the step (its
/// write-throughs landed on both), nothing failed, both counted alike, kept hits were read,
/// and every request keeps the same pages at the same slots.
fn assert_planned_alike(
    (x, y): (&mut Harness, &mut Harness),
    (f1, a): (&[u64], &StepRecord),
    (f2, b): (&[u64], &StepRecord),
    case: &str,
) {
    for h in [&mut *x, &mut *y] {
        h.s.drain().unwrap();
    }
    assert!(f1.is_empty() && f2.is_empty(), "{case}");
    assert_eq!(plan_counts(a), plan_counts(b), "{case}");
    assert!(a.ready > 0 && a.selected > a.pages, "{case}: {a:?}");
    for r in 0..3 {
        for l in 0..LAYERS {
            let id = RequestId::new(r);
            assert_eq!(
                x.s.kept_pages(id, l),
                y.s.kept_pages(id, l),
                "{case}, request {r}, layer {l}"
            );
        }
    }
}

/// Request `r`'s block row at layer `l` (`len` tokens) in `step`: `k` pages drawn with
/// repeats from a pool that changes a page a step (so rows keep most pages, drop some and
/// pick new ones), the request's last page (partial at most lengths) in about half the rows.
fn churning_row(step: u64, (r, l, len): (u64, u16, u64), k: usize) -> Vec<i64> {
    let pages = len.div_ceil(u64::from(PS));
    let seed = r * 31 + u64::from(l) * 7;
    let pool: Vec<u64> = (0..4)
        .map(|i| (seed + i * 5 + (step + i) / 4) % pages)
        .collect();
    let mut row: Vec<i64> = (0..k as u64)
        .map(|j| pool[((j * 3 + step + seed) % 4) as usize] as i64)
        .collect();
    if (step + seed) % 2 == 0 {
        row[0] = pages as i64 - 1;
    }
    row
}

#[test]
fn sorted_block_rows_plan_as_their_unsorted_rows_do() {
    // Block rows in page order take the merge by runs (`merge_sorted_block_row`); the same
    // rows out of order take the general merge. Both must read the same bytes (`step` checks
    // every cell through the table) and keep, load, count and give back the same pages:
    // rows with repeated pages, the request's partial last page, pages dropped before and
    // after the row's last, as int64 and int32 rows, padded and as CSR.
    for (int32, csr) in [(false, false), (true, false), (false, true)] {
        let mut sorted = three_requests(false);
        let mut shuffled = three_requests(false);
        for h in [&mut sorted, &mut shuffled] {
            (h.int32, h.csr) = (int32, csr);
        }
        let k = 6;
        for step in 0..12u64 {
            let (f1, a) = sorted.step(&[0, 1, 2], PS, k, &mut |r, l, len| {
                let mut row = churning_row(step, (r, l, len), k);
                row.sort_unstable();
                row
            });
            let (f2, b) = shuffled.step(&[0, 1, 2], PS, k, &mut |r, l, len| {
                let mut row = churning_row(step, (r, l, len), k);
                row.sort_unstable();
                row.rotate_left(1); // out of order unless every page is the same
                row
            });
            let case = format!("step {step}, int32 {int32}, csr {csr}");
            assert_planned_alike((&mut sorted, &mut shuffled), (&f1, &a), (&f2, &b), &case);
        }
        let loaded = sorted.s.totals().loaded;
        assert!(loaded > 3 * u64::from(LAYERS) * 4, "{loaded} pages loaded");
        for h in [&mut sorted, &mut shuffled] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

/// Splits every cell counting two tokens or more into two cells of the same page (a page named
/// twice, its tokens split between them).
fn split_counts(row: &mut Vec<(i64, u32)>) {
    *row = row
        .iter()
        .flat_map(|&(p, c)| {
            let first = c.div_ceil(2);
            std::iter::once((p, first)).chain((c > first).then_some((p, c - first)))
        })
        .collect();
}

/// [`split_counts`], then out of page order.
fn split_counts_rotated(row: &mut Vec<(i64, u32)>) {
    split_counts(row);
    if !row.is_empty() {
        row.rotate_left(1);
    }
}

#[test]
fn counted_rows_plan_alike_in_any_order_and_with_pages_named_twice() {
    // Token rows mapped to counted pages as they come (each page once), the same pages with
    // their counts split over two cells (a page named twice), and those cells out of order:
    // the same bytes, counts (a split page's tokens add up) and kept lists, as int64 and
    // int32, padded and as CSR. (Counted rows merge cell by cell in any order: merging them by
    // runs, as block rows do, measured slower at token mode's shape: benches/RESULTS.md,
    // "Decode step, token mode".)
    for (int32, csr) in [(false, false), (true, false), (false, true)] {
        let mut plain = three_requests(false);
        let mut split = three_requests(false);
        let mut shuffled = three_requests(false);
        split.edit_counted = Some(split_counts);
        shuffled.edit_counted = Some(split_counts_rotated);
        for h in [&mut plain, &mut split, &mut shuffled] {
            (h.int32, h.csr, h.map_tokens) = (int32, csr, true);
        }
        for step in 0..12u64 {
            // Up to three tokens of each of a row's churning pages.
            let mut sel = |r: u64, l: u16, len: u64| -> Vec<i64> {
                churning_row(step, (r, l, len), 6)
                    .into_iter()
                    .flat_map(|p| {
                        let n = 1 + (p as u64 + step) % 3;
                        (0..n).map(move |t| p * i64::from(PS) + t as i64)
                    })
                    .filter(|&t| (t as u64) < len)
                    .collect()
            };
            let (f0, p) = plain.step(&[0, 1, 2], 1, 24, &mut sel);
            let (f1, a) = split.step(&[0, 1, 2], 1, 24, &mut sel);
            let (f2, b) = shuffled.step(&[0, 1, 2], 1, 24, &mut sel);
            let case = format!("step {step}, int32 {int32}, csr {csr}");
            assert_planned_alike((&mut plain, &mut split), (&f0, &p), (&f1, &a), &case);
            assert_planned_alike((&mut split, &mut shuffled), (&f1, &a), (&f2, &b), &case);
        }
        for h in [&mut plain, &mut split, &mut shuffled] {
            for r in 0..3 {
                h.s.finish_request(RequestId::new(r)).unwrap();
            }
            h.assert_quiet();
        }
    }
}

#[test]
fn token_rows_mapped_to_counted_pages_plan_as_the_token_rows_do() {
    // Token mode with its tokens mapped to pages where they were selected (the runtime does
    // it on the device): page rows with per-page token counts must read the same bytes and
    // count the same entries, pages, needed bytes and loads as the token rows, with kept
    // selections on and off. `step` checks every byte read through each table.
    let mut rng = XorShift::new(11);
    let mut steps: Vec<Vec<Vec<i64>>> = Vec::new(); // [step][request] distinct tokens
    for step in 0..8u64 {
        let mut per = Vec::new();
        for r in 0..3u64 {
            let len = 30 + 9 * r + step + 1; // tokens once this step's append ran
            let prev: Vec<i64> = steps
                .last()
                .map(|s: &Vec<Vec<i64>>| s[r as usize].clone())
                .unwrap_or_default();
            let mut row: Vec<i64> = prev.into_iter().filter(|_| rng.below(4) != 0).collect();
            while row.len() < 10 {
                let t = rng.below(len) as i64;
                if !row.contains(&t) {
                    row.push(t);
                }
            }
            // Out of order on purpose: the mapping sorts.
            row.reverse();
            per.push(row);
        }
        steps.push(per);
    }
    let mut plain = three_requests(false);
    let mut mapped = three_requests(false);
    mapped.map_tokens = true;
    let mut unkept = three_requests(false);
    unkept.map_tokens = true;
    unkept.s.set_keep_selections(false).unwrap();
    for (i, per) in steps.iter().enumerate() {
        let mut sel = |r: u64, _: u16, _: u64| per[r as usize].clone();
        let (f1, a) = plain.step(&[0, 1, 2], 1, 10, &mut sel);
        let (f2, b) = mapped.step(&[0, 1, 2], 1, 10, &mut sel);
        let (f3, c) = unkept.step(&[0, 1, 2], 1, 10, &mut sel);
        // Write-throughs land when they land: which pages are evictable at the next step (and
        // so which get loaded) depends on it. Settled between steps, both sides evict alike.
        for h in [&mut plain, &mut mapped, &mut unkept] {
            h.s.drain().unwrap();
        }
        assert!(f1.is_empty() && f2.is_empty() && f3.is_empty());
        let key = |r: &StepRecord| {
            (
                r.selected,
                r.pages,
                r.bytes_needed,
                r.bytes_needed_of_transferred,
            )
        };
        assert_eq!(key(&a), key(&b), "step {i}: {a:?} {b:?}");
        // Without kept pages other pages get evicted and loaded: only the selection counts.
        let counted = |r: &StepRecord| (r.selected, r.pages, r.bytes_needed);
        assert_eq!(counted(&a), counted(&c), "step {i}");
        assert_eq!((a.loaded, a.ready), (b.loaded, b.ready), "step {i}");
        assert_eq!(a.selected, 3 * 10 * u64::from(LAYERS));
    }
    assert!(mapped.s.kept_pins() > 0);
    assert_eq!(plain.s.kept_pins(), mapped.s.kept_pins());
    for h in [&mut plain, &mut mapped, &mut unkept] {
        for r in 0..3 {
            h.s.finish_request(RequestId::new(r)).unwrap();
        }
        h.assert_quiet();
    }
}

#[test]
fn counts_are_checked_against_the_pages_they_count() {
    let mut h = three_requests(false);
    let ids: Vec<RequestId> = (0..3).map(RequestId::new).collect();
    h.s.append(&ids).unwrap();
    let u = SelectionUnit::new(PS, PS).unwrap();
    let pages = [0, 1, 0, 2, 0, -1];
    // A count of 0, more than the page holds, a short counts list, token units: refused.
    for (counts, field) in [
        (vec![1, 5, 1, 1, 1, 0], "counts[0][1]"),
        (vec![1, 1, 0, 1, 1, 0], "counts[1][0]"),
        (vec![1, 1, 1, 1, 1], "counts"),
    ] {
        let e =
            h.s.plan_counted(0, &ids, &pages, 2, u, Some(&counts))
                .unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
    let t = SelectionUnit::new(1, PS).unwrap();
    let e =
        h.s.plan_counted(0, &ids, &pages, 2, t, Some(&[1; 6]))
            .unwrap_err();
    assert!(e.to_string().contains("unit"), "{e}");
    h.s.validate().unwrap();
    let (p, _) =
        h.s.plan_counted(0, &ids, &pages, 2, u, Some(&[4, 1, 2, 3, 1, 0]))
            .unwrap();
    h.s.ready(p, None).unwrap();
    h.s.finish(p).unwrap();
    let rec = h.s.end_step().unwrap();
    assert_eq!(rec.selected, 4 + 1 + 2 + 3 + 1);
    // A token row: K and V planes of 4 bf16 values, 16 bytes.
    assert_eq!(rec.bytes_needed, (4 + 1 + 2 + 3 + 1) * 16);
    h.s.validate().unwrap();
    // The pages are kept now: a bad count of a kept page, or of a page named twice, is
    // refused just the same.
    assert!(h.s.kept_pins() > 0);
    h.s.append(&ids).unwrap();
    for (pages, counts, field) in [
        ([0, 1, 0, 2, 0, 1], [1, 5, 1, 1, 1, 1], "counts[0][1]"),
        ([0, 1, 0, 2, 0, 1], [0, 1, 1, 1, 1, 1], "counts[0][0]"),
        ([0, 1, 0, 0, 0, 1], [1, 1, 1, 0, 1, 1], "counts[1][1]"),
    ] {
        let e =
            h.s.plan_counted(0, &ids, &pages, 2, u, Some(&counts))
                .unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
        h.s.validate().unwrap();
    }
}

#[test]
fn a_second_plan_of_a_layer_resolves_everything_while_the_first_reads_kept_slots() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None);
    h.step(&[0], PS, 2, &mut |_, _, _| vec![1, 7]);
    let ids = [RequestId::new(0)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    let (a, ta) = h.s.plan(0, &ids, &[1, 7], 2, u).unwrap();
    let ta = ta.to_vec();
    // The second plan cannot use the kept lists the first one reads (and replaces at its
    // finish): it pins through the directory, and both see the same slots.
    let (b, tb) = h.s.plan(0, &ids, &[7, 1], 2, u).unwrap();
    assert_eq!(tb.to_vec(), vec![ta[1], ta[0]]);
    h.s.ready(a, None).unwrap();
    h.s.ready(b, None).unwrap();
    h.s.validate().unwrap();
    h.s.finish(a).unwrap();
    h.s.validate().unwrap();
    // A's finish kept 1 and 7 again; B's pins still hold them too.
    let key = h.s.request(ids[0]).unwrap().key(7, 0);
    assert_eq!(h.s.directory().state(&key).unwrap().pins, 2);
    h.s.finish(b).unwrap();
    assert_eq!(h.s.directory().state(&key).unwrap().pins, 1);
    h.s.validate().unwrap();
    h.s.end_step().unwrap();
    h.s.finish_request(ids[0]).unwrap();
    h.assert_quiet();
}

#[test]
fn a_request_ended_while_a_plan_reads_its_kept_slots() {
    let mut h = Harness::new(100, 400, false);
    h.add(0, 40, None);
    h.add(1, 40, None);
    h.step(&[0, 1], PS, 2, &mut |_, _, _| vec![1, 7]);
    let ids = [RequestId::new(0), RequestId::new(1)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    // Rows keep page 1 (a kept hit) and drop 7 for 3 and 4.
    let (p, _) = h.s.plan(0, &ids, &[1, 3, 1, 4], 2, u).unwrap();
    h.s.ready(p, None).unwrap();
    // Request 0 ends (its kept pages go back now): the plan's finish leaves its row alone and
    // keeps request 1's (page 1 as it was, 4 new; 7 given back).
    h.s.finish_request(ids[0]).unwrap();
    // Its id cannot start again while the plan still pins its pages.
    assert!(h.try_add(0, 40, None).is_err());
    h.s.finish(p).unwrap();
    h.s.validate().unwrap();
    assert_eq!(h.s.kept_pins(), 2 + 2 * u64::from(LAYERS - 1));
    let kept: Vec<u32> =
        h.s.kept_pages(ids[1], 0)
            .unwrap()
            .iter()
            .map(|k| k.page)
            .collect();
    assert_eq!(kept, vec![1, 4]);
    h.s.end_step().unwrap();
    h.add(2, 40, None);
    h.step(&[2, 1], PS, 2, &mut |_, _, _| vec![2, 5]);
    assert_eq!(h.s.kept_pins(), 4 * u64::from(LAYERS));
    h.s.finish_request(RequestId::new(2)).unwrap();
    h.s.finish_request(ids[1]).unwrap();
    h.assert_quiet();
}

/// The cpu engine with CUDA's stream semantics for `ready(plan, Some(stream))`: the wait is
/// the stream's, so the call returns while the loads are still in flight.
struct StreamOrdered(CpuEngine);

impl crate::transfer::engine::CopyEngine for StreamOrdered {
    fn name(&self) -> &'static str {
        "cpu, stream-ordered"
    }

    fn submit(
        &self,
        group: Arc<crate::transfer::prepared::PageTransferGroup>,
        layer: Option<usize>,
    ) -> crate::Result<Arc<crate::transfer::events::TransferEvents>> {
        self.0.submit(group, layer)
    }

    fn stream_wait(
        &self,
        _events: &crate::transfer::events::TransferEvents,
        _layer_index: usize,
        _stream: u64,
    ) -> crate::Result<()> {
        Ok(())
    }

    fn inject(&self, fault: crate::transfer::Fault) -> crate::Result<()> {
        crate::transfer::engine::CopyEngine::inject(&self.0, fault)
    }

    fn submitted(&self) -> u64 {
        crate::transfer::engine::CopyEngine::submitted(&self.0)
    }
}

#[test]
fn pages_still_loading_when_a_plan_finishes_are_not_kept_and_resolve_again() {
    let spec = PoolSpec::new(Component::Kv, 1, 2, 1, 4, Dtype::Bf16, PS, 100).unwrap();
    let host_spec = spec.with_pages(400).unwrap();
    // SAFETY: the test owns both buffers for as long as the scheduler lives and never
    // touches them itself.
    let (_dev_buf, dev) = unsafe { crate::testing::host_pool(&spec) }.unwrap();
    // SAFETY: as above.
    let (_host_buf, host) = unsafe { crate::testing::host_pool(&host_spec) }.unwrap();
    let cfg = SchedulerConfig {
        layers: LAYERS,
        page_size: PS,
        device_pages: 100,
        device_reserve: 0,
        host_pages: 400,
        prefetch: false,
        prefetch_depth: 1,
    };
    let engine = Arc::new(StreamOrdered(CpuEngine::new(1).unwrap()));
    let mut s = StepScheduler::new(cfg, dev, host, engine).unwrap();
    let ids = [RequestId::new(0)];
    let u = SelectionUnit::new(PS, PS).unwrap();
    s.add_request(ids[0], 40, None).unwrap(); // pages 0..10
    s.drain().unwrap();
    let kept = |s: &StepScheduler| -> Vec<u32> {
        s.kept_pages(ids[0], 0)
            .unwrap()
            .iter()
            .map(|k| k.page)
            .collect()
    };
    // Pages 1 and 7 kept; every other page evicted, so that new ones must load.
    let (p, _) = s.plan(0, &ids, &[1, 7], 2, u).unwrap();
    s.ready(p, None).unwrap();
    s.finish(p).unwrap();
    assert_eq!(kept(&s), vec![1, 7]);
    s.directory().evict(1000);
    // 3 and 9 load slowly; the stream-ordered ready returns before they land, so the plan
    // finishes with them Loading: they are not kept (the kept hits around them stay).
    s.inject_faults(
        Direction::Load,
        1,
        None,
        Some(std::time::Duration::from_millis(200)),
    );
    let (p, _) = s.plan(0, &ids, &[1, 3, 7, 9], 4, u).unwrap();
    s.ready(p, Some(0)).unwrap();
    s.finish(p).unwrap();
    assert_eq!(kept(&s), vec![1, 7]);
    assert_eq!(s.kept_pins(), 2);
    s.validate().unwrap();
    // Once landed, the next plan resolves them again (Ready: nothing loads) and keeps them.
    s.drain().unwrap();
    let (p, _) = s.plan(0, &ids, &[1, 3, 7, 9], 4, u).unwrap();
    s.ready(p, None).unwrap();
    let counts = s.finish(p).unwrap();
    assert_eq!((counts.ready, counts.loaded), (4, 0));
    assert_eq!(kept(&s), vec![1, 3, 7, 9]);
    assert_eq!(s.kept_pins(), 4);
    s.validate().unwrap();
    s.end_step().unwrap();
    s.finish_request(ids[0]).unwrap();
    s.drain().unwrap();
    assert_eq!(s.directory().stats().pins, 0);
}
