//! Kept selections for entries smaller than a page: token mode's top-k tokens (DSA), or
//! blocks that lie inside a page.
//!
//! A token row names ~2048 entries over ~128 pages, so the per-entry work must be a handful of
//! instructions and the directory must see only the pages the row did not keep. A first pass
//! maps entries to row-distinct pages: the indexer's rows usually come sorted (checked with
//! one compare per pair, no early exit, so it vectorizes), and then each page is one run of
//! adjacent entries, counted a window of 32 compares at a time (no branch per entry; AVX2
//! code where the CPU has it); any other row goes entry by entry and
//! dedups through a stamp per page ([`RowDedup`]) once it goes out of order. The distinct pages,
//! a sixteenth of the entries, are sorted if need be and merged with the row's kept list as
//! block mode merges its pages (`kept.rs`); then the slot table is written from each page's
//! outcome (a kept slot, or -1 until the resolve places its key), a sorted row's runs a fixed
//! window each, later runs overwriting what an earlier one spilled.
//!
//! Counts match the plan without kept selections: `selected` counts entries, `needed` the
//! selected tokens of each page (capped at the page), `pages` the distinct pages.
//!
//! [`RowDedup`]: crate::scheduler::selection::RowDedup

use super::rows::{KeptRows, Rows};
use super::{mark_batch, RowsIn, StepScheduler, KEPT, NONE};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::scheduler::entry::Entry;
use crate::scheduler::selection::RowDedup;
use crate::scheduler::SelectionUnit;
use std::mem::MaybeUninit;

/// Entries a sorted row's run scan compares at once (a run of a 64-token page is at most 64
/// token entries, ~16 in a top-2048 row over 128 pages).
const RUN_WINDOW: usize = 32;

/// Cells a sorted row's fill writes at once from a run's first cell (see `fill_runs`).
const FILL_WINDOW: usize = 32;

/// How one request's entries map to pages.
struct Mapping {
    /// Tokens per entry.
    u: u64,
    /// Entries per page, and its log2 where it is a power of two (a shift, not a division).
    per_page: u64,
    shift: Option<u32>,
    /// Tokens per page: the cap of a page's needed tokens.
    ps: u32,
    /// Entries the request has, and the tokens of its last one (it may hold fewer than `u`).
    entries: u64,
    last_tokens: u64,
}

impl Mapping {
    fn new(unit: SelectionUnit, len: u64) -> Self {
        let (u, ps) = (u64::from(unit.unit()), unit.page_size());
        let per_page = u64::from(ps) / u;
        let entries = unit.entries(len);
        Mapping {
            u,
            per_page,
            shift: per_page
                .is_power_of_two()
                .then(|| per_page.trailing_zeros()),
            ps,
            entries,
            last_tokens: len - entries.saturating_sub(1) * u,
        }
    }

    #[inline]
    fn page_of(&self, e: u64) -> u32 {
        match self.shift {
            Some(s) => (e >> s) as u32,
            None => (e / self.per_page) as u32,
        }
    }

    /// The first entry of `page`.
    #[inline]
    fn page_start(&self, page: u32) -> i64 {
        (u64::from(page) * self.per_page) as i64
    }

    /// The last entry of `page` as an `E` (a sorted row's run of `page` is its entries up to
    /// this one; past the type's range, every entry of the type).
    #[inline]
    fn page_last<E: Entry>(&self, page: u32) -> E {
        E::at_most(self.page_start(page + 1) - 1)
    }
}

/// A row's distinct pages as the first pass finds them (first-seen order).
#[derive(Default)]
struct Distinct {
    /// Per distinct page: the page.
    page: Vec<u32>,
    /// Per distinct page: selected tokens in it.
    needed: Vec<u32>,
    /// Per distinct page: the column of its first entry.
    first: Vec<u32>,
    /// Per column: its distinct page, or NONE (padding).
    of_column: Vec<u32>,
    /// Per distinct page: its cell value (KEPT or a key index) and slot, once merged.
    cell: Vec<u32>,
    slot: Vec<i32>,
    /// (page, distinct index), sorted by page: the merge's input.
    order: Vec<(u32, u32)>,
}

impl Distinct {
    fn clear(&mut self) {
        self.page.clear();
        self.needed.clear();
        self.first.clear();
        self.of_column.clear();
        self.order.clear();
    }

    /// A sorted row whose entries are all valid: each page one run. Its needed tokens are the
    /// run's entries times `u`, but for entries naming the request's last, partial entry.
    fn map_runs<E: Entry>(&mut self, row: &[E], m: &Mapping) {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above); the function is the
                // safe body below, compiled for it.
                return unsafe { self.map_runs_avx2(row, m) };
            }
        }
        self.map_runs_any(row, m)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn map_runs_avx2<E: Entry>(&mut self, row: &[E], m: &Mapping) {
        self.map_runs_any(row, m)
    }

    #[inline(always)]
    fn map_runs_any<E: Entry>(&mut self, row: &[E], m: &Mapping) {
        let (u, ps) = (m.u, m.ps);
        // Sorted: a run ends at the first entry of a later page.
        let mut j = 0;
        while j < row.len() {
            let page = m.page_of(row[j].get() as u64);
            self.push(page, j as u32);
            let last: E = m.page_last(page);
            j += 1;
            // Sorted, so the run's entries are a prefix of what follows: count them a window
            // at a time, every compare done (no branch per entry to mispredict).
            loop {
                let w = &row[j..(j + RUN_WINDOW).min(row.len())];
                let n: usize = w.iter().map(|&e| usize::from(e <= last)).sum();
                j += n;
                if n < RUN_WINDOW {
                    break;
                }
            }
        }
        let n = self.page.len();
        for i in 0..n {
            let end = self.first.get(i + 1).map_or(row.len() as u32, |&f| f);
            let run = u64::from(end - self.first[i]);
            self.add_needed(i as u32, run * u, ps);
        }
        let partial = row
            .iter()
            .rev()
            .take_while(|&&e| e.get() as u64 == m.entries - 1)
            .count() as u64;
        if partial > 0 && m.last_tokens < u {
            // Sorted: the entries naming the last entry end the row, in its last page.
            let runlen = u64::from(row.len() as u32 - self.first[n - 1]);
            self.needed[n - 1] = 0;
            self.add_needed(
                (n - 1) as u32,
                (runlen - partial) * u + partial * m.last_tokens,
                ps,
            );
        }
    }

    /// Any row: padding (< 0) skipped, entries checked (`Err((column, entry))` for one past
    /// the request), repeats found by a stamp per page once the row goes out of order. A run
    /// of entries in one page adds its tokens once, when the run ends (the cap at a page is
    /// the same either way). Returns the valid entries and whether the pages came in order.
    fn map_any<E: Entry>(
        &mut self,
        row: &[E],
        m: &Mapping,
        dedup: &mut RowDedup,
        pages: u32,
    ) -> std::result::Result<(u64, bool), (usize, i64)> {
        let (u, ps, entries) = (m.u, m.ps, m.entries);
        let (mut prev_page, mut prev_d) = (u32::MAX, NONE);
        let (mut run, mut valid) = (0u64, 0u64);
        let mut in_order = true; // every new page so far above the previous one
        for (j, &e) in row.iter().enumerate() {
            let e = e.get();
            if e < 0 {
                self.of_column.push(NONE);
                continue;
            }
            if e as u64 >= entries {
                return Err((j, e));
            }
            let e = e as u64;
            valid += 1;
            let page = m.page_of(e);
            if page != prev_page {
                if prev_d != NONE {
                    self.add_needed(prev_d, run, ps);
                }
                run = 0;
                prev_d = if in_order && (prev_page == u32::MAX || page > prev_page) {
                    self.push(page, j as u32)
                } else {
                    if in_order {
                        // Out of order from here on: stamp the pages seen so far.
                        in_order = false;
                        dedup.begin_row(pages);
                        for (i, &p) in self.page.iter().enumerate() {
                            dedup.seen_or_insert(p, i as u32);
                        }
                    }
                    let next = self.page.len() as u32;
                    match dedup.seen_or_insert(page, next) {
                        Some(i) => i,
                        None => self.push(page, j as u32),
                    }
                };
                prev_page = page;
            }
            run += if e + 1 == entries { m.last_tokens } else { u };
            self.of_column.push(prev_d);
        }
        if prev_d != NONE {
            self.add_needed(prev_d, run, ps);
        }
        Ok((valid, in_order))
    }

    /// The cells of a row `map_runs` mapped, from `at` on: each run filled at once.
    fn fill_runs(&self, out: &mut Rows, at: usize, k: usize, new_keys: bool) {
        // Each run writes whole windows of cells from its first: a run shorter than a window
        // spills into the next run's cells, which that run then overwrites (runs come in
        // order), so every run is one fixed-size store and no branch on its length; the last
        // one spills into room past the row, cut off after.
        // The cells are written once, into reserved room (not set to -1 first: that was a
        // second pass over the row's 8 KB of cells, in token mode 32 MB a step).
        debug_assert_eq!(out.table.len(), at);
        debug_assert!(self.first.first() == Some(&0) && self.first.is_sorted());
        out.table.reserve(k + FILL_WINDOW);
        let t = &mut out.table.spare_capacity_mut()[..k + FILL_WINDOW];
        for (i, &first) in self.first.iter().enumerate() {
            let end = self.first.get(i + 1).map_or(k, |&f| f as usize);
            let slot = MaybeUninit::new(self.slot[i]);
            let mut c = first as usize;
            loop {
                t[c..c + FILL_WINDOW].fill(slot);
                c += FILL_WINDOW;
                if c >= end {
                    break;
                }
            }
        }
        // SAFETY: `map_runs` starts the first run at column 0 and each next run where the
        // last ended, and the last ends at `k`; each run wrote its cells from its first to at
        // least its end (whole windows), so every cell of `[0, k)` past the table's `at`
        // initialized ones was written above, within the reserved room.
        unsafe { out.table.set_len(at + k) };
        if !new_keys {
            return;
        }
        for (i, &first) in self.first.iter().enumerate() {
            let end = self.first.get(i + 1).map_or(k as u32, |&f| f);
            let cell = self.cell[i];
            if cell & KEPT == 0 {
                // The page's run of cells but its first, as one run.
                out.repeats
                    .push_run(at as u32 + first + 1..at as u32 + end, cell);
            }
        }
    }

    /// The cells of a row `map_any` mapped, from `at` on (padding reads an extra last entry:
    /// no key, no slot); repeats only where the row has new keys.
    fn fill_columns(&mut self, out: &mut Rows, at: usize, new_keys: bool) {
        let n = self.page.len() as u32;
        self.cell.push(NONE);
        self.slot.push(-1);
        out.table.extend(
            self.of_column
                .iter()
                .map(|&di| self.slot[di.min(n) as usize]),
        );
        if new_keys {
            for (j, &di) in self.of_column.iter().enumerate() {
                let di = di.min(n) as usize;
                let cell = self.cell[di];
                if cell & KEPT == 0 && self.first[di] != j as u32 {
                    out.repeats.push((at + j) as u32, cell);
                }
            }
        }
    }

    fn add_needed(&mut self, di: u32, tokens: u64, cap: u32) {
        let n = &mut self.needed[di as usize];
        *n = (u64::from(*n) + tokens).min(u64::from(cap)) as u32;
    }

    fn push(&mut self, page: u32, column: u32) -> u32 {
        self.page.push(page);
        self.needed.push(0);
        self.first.push(column);
        (self.page.len() - 1) as u32
    }
}

impl StepScheduler {
    /// The rows of a kept-selection plan whose entries lie inside pages (`unit` < page size):
    /// see the module docs.
    pub(super) fn kept_entry_rows<E: Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        rows_in: RowsIn<'_>,
        unit: SelectionUnit,
        batch: u64,
    ) -> Result<Rows> {
        let ps = self.cfg.page_size;
        debug_assert!(unit.pages_per_entry() == 1 && unit.unit() < ps);
        let l = layer as usize;
        let pages_guess = selection.len() / 8;
        // (Room past the last row: a sorted row's fill spills a window beyond it.)
        let mut out = Rows::unfilled(pages_guess / 8, selection.len() + FILL_WINDOW);
        let mut kr = KeptRows::with_lists(self.kept.take_spare(pages_guess), rids.len());
        let mut d = Distinct::default();
        for (b, &id) in rids.iter().enumerate() {
            let r = mark_batch(&mut self.requests, id, batch)?;
            let len = r.len;
            let m = Mapping::new(unit, len);
            let cells = rows_in.row(b);
            let (at, k) = (cells.start, cells.len());
            let row = &selection[cells];
            d.clear();
            // Pass 1: entries to distinct pages. The indexer's rows come sorted (and
            // unpadded once contexts are long): such a row is checked at its two ends, and
            // each of its pages is one run of adjacent entries.
            let runs = row.first().is_some_and(|&e| e.get() >= 0)
                && row.last().is_some_and(|&e| (e.get() as u64) < m.entries)
                && is_sorted(row);
            let in_order = if runs {
                d.map_runs(row, &m);
                out.selected += k as u64;
                true
            } else {
                let (valid, in_order) =
                    d.map_any(row, &m, &mut self.dedup, r.pages(ps))
                        .map_err(|(j, e)| {
                            Error::out_of_range(rows_in.name(false, b, j), e, -1, m.entries)
                        })?;
                out.selected += valid;
                in_order
            };
            d.order
                .extend(d.page.iter().enumerate().map(|(i, &p)| (p, i as u32)));
            if !in_order {
                d.order.sort_unstable();
            }
            // The merge with the kept list, page by page.
            d.cell.clear();
            d.cell.resize(d.page.len(), NONE);
            d.slot.clear();
            d.slot.resize(d.page.len(), -1);
            let kept = self.kept.list(l, r.kept_slot);
            let mut kc = 0;
            let keys_before = kr.key_at.len();
            // The next row's first read (the sortedness check) comes from memory: ask for it
            // a share a page now, so that its misses overlap this row's merge.
            let ahead = match b + 1 < rids.len() {
                true => &selection[rows_in.row(b + 1)],
                false => &[],
            };
            let pages = d.order.len();
            for (i, &(page, di)) in d.order.iter().enumerate() {
                crate::prefetch::prefetch_share(ahead, i, pages);
                while kc < kept.len() && kept[kc].page < page {
                    kr.dropped.push(kept[kc].object);
                    kc += 1;
                }
                let di = di as usize;
                if kc < kept.len() && kept[kc].page == page {
                    out.kept_hits += 1;
                    out.kept_needed += u64::from(d.needed[di]);
                    kr.lists.push(kept[kc]);
                    (d.cell[di], d.slot[di]) = (KEPT, kept[kc].slot);
                    kc += 1;
                } else {
                    let first = at + d.first[di] as usize;
                    d.cell[di] =
                        out.push_new_page(&mut kr, r, (page, layer), (b, first), d.needed[di]);
                }
            }
            kr.dropped.extend(kept[kc..].iter().map(|k| k.object));
            kr.ends.push(kr.lists.len() as u32);
            kr.dropped_ends.push(kr.dropped.len() as u32);
            kr.serials.push(r.serial);
            // Pass 2: every cell from its page's outcome; a key's cells but its first are
            // repeats, placed once the resolve gave the key its slot.
            if runs {
                d.fill_runs(&mut out, at, k, kr.key_at.len() > keys_before);
            } else {
                d.fill_columns(&mut out, at, kr.key_at.len() > keys_before);
            }
        }
        self.look_up_hints(layer, rids, &mut out, &kr);
        out.kept_rows = Some(kr);
        Ok(out)
    }
}

/// Whether `row` is sorted: every pair compared, no early exit, so the compares vectorize (a
/// token row is 2048 entries; the usual answer is yes). Compiled for AVX2 where the CPU has
/// it: the wheel targets baseline x86-64, whose SSE2 has no 64-bit compare, and this pass is
/// the first to read each row (8 million entries a step at DeepSeek-V3.2's shape: 11 ms for
/// the step's rows in baseline code, 7.5 ms with AVX2, about what memory delivers; a
/// microbenchmark on the development VM, 2026-11-30).
fn is_sorted<E: Entry>(row: &[E]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); the function only reads
            // `row`, a valid slice.
            return unsafe { is_sorted_avx2(row) };
        }
    }
    is_sorted_any(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn is_sorted_avx2<E: Entry>(row: &[E]) -> bool {
    is_sorted_any(row)
}

#[inline(always)]
fn is_sorted_any<E: Entry>(row: &[E]) -> bool {
    let pairs = row.iter().zip(row.iter().skip(1));
    !pairs.fold(false, |out, (a, b)| out | (a > b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The sortedness check the CPU runs (AVX2 where it has it) agrees with the standard
        /// library's, on sorted rows and on rows with one pair out of order anywhere.
        #[test]
        fn is_sorted_agrees_with_std(
            mut row in proptest::collection::vec(-3i64..1000, 0..300),
            sort in any::<bool>(),
            swap in any::<proptest::sample::Index>(),
        ) {
            if sort {
                row.sort_unstable();
                if row.len() > 1 && swap.index(4) == 0 {
                    let i = swap.index(row.len() - 1);
                    row.swap(i, i + 1);
                }
            }
            prop_assert_eq!(is_sorted(&row), row.is_sorted());
            prop_assert_eq!(is_sorted_any(&row), row.is_sorted());
            let narrow: Vec<i32> = row.iter().map(|&e| e as i32).collect();
            prop_assert_eq!(is_sorted(&narrow), row.is_sorted());
        }

        /// A sorted row's fill gives each cell its page's slot, runs longer than a window
        /// included, leaves earlier rows alone and writes nothing past the row; the cells of
        /// a new page but its first are its repeats. The run scan agrees with the general pass
        /// on such rows (runs of up to ~100 entries).
        #[test]
        fn sorted_rows_fill_every_cell_with_its_pages_slot(
            mut row in proptest::collection::vec(0i64..12, 1..300),
            unit in prop_oneof![Just(1u32), Just(2)],
            before in 0usize..3,
            new_every in 1usize..4,
        ) {
            let ps = 8;
            row.sort_unstable();
            let len = (*row.last().unwrap() as u64 + 1) * u64::from(unit);
            let m = Mapping::new(SelectionUnit::new(unit, ps).unwrap(), len);
            let (mut d, mut any) = (Distinct::default(), Distinct::default());
            d.map_runs(&row, &m);
            let mut dedup = RowDedup::default();
            any.map_any(&row, &m, &mut dedup, len.div_ceil(u64::from(ps)) as u32).unwrap();
            prop_assert_eq!((&d.page, &d.first, &d.needed), (&any.page, &any.first, &any.needed));
            let n = d.page.len();
            d.cell = (0..n)
                .map(|i| if i % new_every == 0 { i as u32 } else { KEPT })
                .collect();
            d.slot = d.page.iter().map(|&p| 1000 + p as i32).collect();
            let k = row.len();
            let mut out = Rows::unfilled(0, (before + 1) * k + FILL_WINDOW);
            out.table.resize(before * k, 7);
            d.fill_runs(&mut out, before * k, k, true);
            prop_assert_eq!(out.table.len(), (before + 1) * k);
            prop_assert!(out.table[..before * k].iter().all(|&c| c == 7));
            let mut repeats = Vec::new();
            for (j, &e) in row.iter().enumerate() {
                let page = m.page_of(e as u64);
                prop_assert_eq!(out.table[before * k + j], 1000 + page as i32, "cell {}", j);
                let di = d.page.binary_search(&page).unwrap();
                if d.cell[di] & KEPT == 0 && d.first[di] as usize != j {
                    repeats.push(((before * k + j) as u32, d.cell[di]));
                }
            }
            prop_assert_eq!(&out.repeats.expanded(), &repeats);
        }

        /// The run scan of sorted rows (windows of `RUN_WINDOW` compares) finds the same
        /// pages, first columns and needed tokens as the general pass, on rows with long runs
        /// (repeated entries) and the request's last, partial entry.
        #[test]
        fn sorted_rows_map_as_any_row_does(
            mut row in proptest::collection::vec(0i64..40, 1..120),
            unit in prop_oneof![Just(1u32), Just(2), Just(4)],
            extra in 0u64..4,
        ) {
            let ps = 8;
            row.sort_unstable();
            let len = (*row.last().unwrap() as u64 + 1) * u64::from(unit) - extra.min(u64::from(unit) - 1);
            let m = Mapping::new(SelectionUnit::new(unit, ps).unwrap(), len);
            let (mut a, mut b) = (Distinct::default(), Distinct::default());
            a.map_runs(&row, &m);
            let mut dedup = RowDedup::default();
            let (valid, in_order) = b.map_any(&row, &m, &mut dedup, len.div_ceil(u64::from(ps)) as u32).unwrap();
            prop_assert_eq!(valid, row.len() as u64);
            prop_assert!(in_order);
            prop_assert_eq!(&a.page, &b.page);
            prop_assert_eq!(&a.first, &b.first);
            prop_assert_eq!(&a.needed, &b.needed);
            // The same row as int32: the same runs.
            let narrow: Vec<i32> = row.iter().map(|&e| e as i32).collect();
            let mut c = Distinct::default();
            c.map_runs(&narrow, &m);
            prop_assert_eq!((&c.page, &c.first, &c.needed), (&a.page, &a.first, &a.needed));
        }
    }
}
