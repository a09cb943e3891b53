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

mod input;
mod kept;
mod kept_races;
mod rows;
mod step;

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

    /// Adds a shared prompt of `pages` pages, written; returns the prefix requests read it by.
    fn add_prompt(&mut self, ns: u64, pages: u32) -> Option<Prefix> {
        let slots = self.s.add_prompt(ns, pages).unwrap();
        for l in 0..LAYERS {
            for p in 0..pages {
                for row in 0..PS {
                    self.write_row(slots[(l as u32 * pages + p) as usize], ns, p, l, row);
                }
            }
        }
        Some(Prefix {
            namespace: ns,
            pages,
        })
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
