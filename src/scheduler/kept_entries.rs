//! Kept selections for entries smaller than a page: token mode's top-k tokens (DSA), or
//! blocks that lie inside a page.
//!
//! A token row names ~2048 entries over ~128 pages, so the per-entry work must be a handful of
//! instructions and the directory must see only the pages the row did not keep. The indexer's
//! rows usually come sorted (checked with one compare per pair, no early exit, so it
//! vectorizes), and then each page is one run of adjacent entries. Such a row takes one pass
//! over its runs (`merge_runs`; AVX2 code where the CPU has it): each run is counted a window
//! of 32 compares at a time (no branch per entry), merged with the row's kept list at once
//! (as block mode merges its pages, `kept.rs`), and its cells written a fixed window at a time
//! with the outcome (a kept slot, or -1 until the resolve places its key), the next run
//! overwriting what spilled; each cell is written once. (Mapping the runs first, then merging,
//! then filling, each through per-page vectors, was slower: benches/RESULTS.md, "Decode step,
//! token mode".) Any other
//! row goes entry by entry, dedups through a stamp per page ([`RowDedup`]) once it goes out of
//! order, sorts its distinct pages if need be, merges them and then writes its cells.
//!
//! Counts match the plan without kept selections: `selected` counts entries, `needed` the
//! selected tokens of each page (capped at the page), `pages` the distinct pages.
//!
//! [`RowDedup`]: crate::scheduler::selection::RowDedup

use super::core::{mark_batch, StepScheduler, KEPT, NONE};
use super::csr::RowsIn;
use super::request::Kept;
use super::rows::{KeptRows, Rows};
use super::tier::Tier;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::scheduler::entry::Entry;
use crate::scheduler::selection::RowDedup;
use crate::scheduler::SelectionUnit;
use std::mem::MaybeUninit;

/// Entries a sorted row's run scan compares at once (a run of a 64-token page is at most 64
/// token entries, ~16 in a top-2048 row over 128 pages).
const RUN_WINDOW: usize = 32;

/// Cells a sorted row's pass writes at once from a run's first cell (see `merge_runs`).
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

/// A row's distinct pages as the general pass (`map_any`) finds them, first-seen order: rows
/// that are not sorted, or have padding.
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
            if e == -1 {
                self.of_column.push(NONE); // padding
                continue;
            }
            if e < 0 || e as u64 >= entries {
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

impl<T: Tier> StepScheduler<T> {
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
        let mut fresh: Vec<Fresh> = Vec::new();
        for (b, &id) in rids.iter().enumerate() {
            let r = mark_batch(&mut self.requests, id, batch)?;
            let len = r.len;
            let m = Mapping::new(unit, len);
            let cells = rows_in.row(b);
            let at = cells.start;
            let row = &selection[cells];
            // The indexer's rows come sorted (and unpadded once contexts are long): such a
            // row is checked at its two ends, and each of its pages is one run of adjacent
            // entries.
            let runs = row.first().is_some_and(|&e| e.get() >= 0)
                && row.last().is_some_and(|&e| (e.get() as u64) < m.entries)
                && is_sorted(row);
            // The next row's first read (the sortedness check) comes from memory: ask for it
            // a part at a time during this row's merge, so that its misses overlap it.
            let ahead = match b + 1 < rids.len() {
                true => &selection[rows_in.row(b + 1)],
                false => &[],
            };
            let kept = self.kept.list(l, r.kept_slot);
            if runs {
                let row_in = SortedRow {
                    row,
                    at,
                    ahead,
                    m: &m,
                    kept,
                };
                let row_out = RunsOut {
                    out: &mut out,
                    kr: &mut kr,
                    fresh: &mut fresh,
                };
                merge_runs(row_in, row_out);
                for f in &fresh {
                    let first = at + f.first as usize;
                    let key =
                        out.push_key(&mut kr, f.at_list, r, (f.page, layer), (b, first), f.needed);
                    out.repeats
                        .push_run(first as u32 + 1..(at + f.end as usize) as u32, key);
                }
            } else {
                // Entry by entry to distinct pages, merged page by page, then each cell from
                // its page's outcome.
                d.clear();
                let (valid, in_order) =
                    d.map_any(row, &m, &mut self.dedup, r.pages(ps))
                        .map_err(|(j, e)| {
                            Error::out_of_range(rows_in.name(false, b, j), e, -1, m.entries)
                        })?;
                out.selected += valid;
                d.order
                    .extend(d.page.iter().enumerate().map(|(i, &p)| (p, i as u32)));
                if !in_order {
                    d.order.sort_unstable();
                }
                d.cell.clear();
                d.cell.resize(d.page.len(), NONE);
                d.slot.clear();
                d.slot.resize(d.page.len(), -1);
                let mut kc = 0;
                let keys_before = kr.key_at.len();
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
                // A key's cells but its first are repeats, placed once the resolve gave the
                // key its slot.
                d.fill_columns(&mut out, at, kr.key_at.len() > keys_before);
            }
            kr.ends.push(kr.lists.len() as u32);
            kr.dropped_ends.push(kr.dropped.len() as u32);
            kr.serials.push(r.serial);
        }
        self.look_up_hints(layer, rids, &mut out, &kr);
        out.kept_rows = Some(kr);
        Ok(out)
    }
}

/// A sorted row of valid entries: its entries, its first cell in the table, the next row (to
/// fetch ahead), its request's mapping of entries to pages and its kept list.
#[derive(Clone, Copy)]
struct SortedRow<'a, E> {
    row: &'a [E],
    at: usize,
    ahead: &'a [E],
    m: &'a Mapping,
    kept: &'a [Kept],
}

/// Where a sorted row's pass writes: the plan's rows (table, counts), the kept rows (next
/// kept list, dropped pages) and the row's new pages.
struct RunsOut<'a> {
    out: &'a mut Rows,
    kr: &'a mut KeptRows,
    fresh: &'a mut Vec<Fresh>,
}

/// A page a sorted row newly selects: its run of cells (`first..end` in the row), its
/// selected tokens, and its placeholder's place in the row's next kept list.
struct Fresh {
    page: u32,
    first: u32,
    end: u32,
    needed: u32,
    at_list: u32,
}

/// A sorted row in one pass over its runs: each run (a page's adjacent entries, counted a
/// window of compares at a time) is merged with the kept list at once and its cells written
/// (a window at a time from its first; the next run overwrites what spilled) with the kept
/// slot, or -1 for a page the row newly selects, which goes on `fresh` for the caller to make
/// its key. Kept pages the row no longer names go on `dropped`; `lists` gets the row's next
/// kept list. Each cell is written once, into reserved room.
fn merge_runs<E: Entry>(s: SortedRow<'_, E>, o: RunsOut<'_>) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above); the function is the safe
            // body below, compiled for it.
            return unsafe { merge_runs_avx2(s, o) };
        }
    }
    merge_runs_any(s, o)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn merge_runs_avx2<E: Entry>(s: SortedRow<'_, E>, o: RunsOut<'_>) {
    merge_runs_any(s, o)
}

#[inline(always)]
fn merge_runs_any<E: Entry>(s: SortedRow<'_, E>, o: RunsOut<'_>) {
    let SortedRow {
        row,
        at,
        ahead,
        m,
        kept,
    } = s;
    let RunsOut { out, kr, fresh } = o;
    let (u, ps, k) = (m.u, u64::from(m.ps), row.len());
    fresh.clear();
    debug_assert_eq!(out.table.len(), at);
    out.table.reserve(k + FILL_WINDOW);
    let t = &mut out.table.spare_capacity_mut()[..k + FILL_WINDOW];
    let (mut hits, mut hit_tokens) = (0u64, 0u64);
    let (mut j, mut kc) = (0usize, 0usize);
    while j < k {
        let first = j;
        let page = m.page_of(row[j].get() as u64);
        let last: E = m.page_last(page);
        j += 1;
        // Sorted, so the run's entries are a prefix of what follows: count them a window at
        // a time, every compare done (no branch per entry to mispredict).
        loop {
            let w = &row[j..(j + RUN_WINDOW).min(k)];
            let n: usize = w.iter().map(|&e| usize::from(e <= last)).sum();
            j += n;
            if n < RUN_WINDOW {
                break;
            }
        }
        let run = (j - first) as u64;
        let mut tokens = run * u;
        if j == k && m.last_tokens < u {
            // Sorted: the entries naming the request's last, partial entry end the row.
            let partial = row[first..]
                .iter()
                .rev()
                .take_while(|&&e| e.get() as u64 == m.entries - 1)
                .count() as u64;
            tokens = (run - partial) * u + partial * m.last_tokens;
        }
        let needed = tokens.min(ps) as u32;
        if let Some(next) = ahead.get(first..j.min(ahead.len())) {
            crate::prefetch::prefetch_range(next, usize::MAX);
        }
        while kc < kept.len() && kept[kc].page < page {
            kr.dropped.push(kept[kc].object);
            kc += 1;
        }
        let slot = if kc < kept.len() && kept[kc].page == page {
            hits += 1;
            hit_tokens += u64::from(needed);
            kr.lists.push(kept[kc]);
            kc += 1;
            kept[kc - 1].slot
        } else {
            fresh.push(Fresh {
                page,
                first: first as u32,
                end: j as u32,
                needed,
                at_list: kr.lists.len() as u32,
            });
            kr.lists.push(Kept::placeholder(page));
            -1
        };
        let slot = MaybeUninit::new(slot);
        let mut c = first;
        loop {
            t[c..c + FILL_WINDOW].fill(slot);
            c += FILL_WINDOW;
            if c >= j {
                break;
            }
        }
    }
    // SAFETY: the first run starts at column 0, each next one where the last ended, and the
    // last ends at `k`; each wrote its cells from its first to at least its end (whole
    // windows), so every cell of `[0, k)` past the table's `at` initialized ones was written
    // above, within the reserved room.
    unsafe { out.table.set_len(at + k) };
    kr.dropped.extend(kept[kc..].iter().map(|k| k.object));
    out.selected += k as u64;
    out.kept_hits += hits;
    out.kept_needed += hit_tokens;
}

/// Whether `row` is sorted: every pair compared, no early exit, so the compares vectorize (a
/// token row is 2048 entries; the usual answer is yes). Compiled for AVX2 where the CPU has
/// it: the wheel targets baseline x86-64, whose SSE2 has no 64-bit compare, and this pass is
/// the first to read each row (8 million entries a step at DeepSeek-V3.2's shape), so it should
/// keep up with memory, which baseline code does not (benches/RESULTS.md, "Memory system").
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
        #![proptest_config(crate::testing::proptest_config(256, "kept_entries"))]

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

        /// A sorted row's one pass (`merge_runs`): its pages, first columns and needed tokens
        /// are the general pass's (`map_any`) on rows with long runs (repeated entries, longer
        /// than a window) and the request's last, partial entry; each kept page's cells get
        /// its kept slot and a new page's -1; the next kept list is the merge of the two; the
        /// kept pages the row no longer names are dropped; earlier rows' cells are left alone
        /// and nothing is written past the row. The same row as int32 gives the same.
        #[test]
        fn a_sorted_row_merges_and_fills_in_one_pass_as_the_general_pass_maps(
            mut row in proptest::collection::vec(0i64..40, 1..200),
            unit in prop_oneof![Just(1u32), Just(2), Just(4)],
            extra in 0u64..4,
            kept_pages in proptest::collection::btree_set(0u32..24, 0..12),
            before in 0usize..3,
        ) {
            let ps = 8;
            row.sort_unstable();
            let len = (*row.last().unwrap() as u64 + 1) * u64::from(unit)
                - extra.min(u64::from(unit) - 1);
            let m = Mapping::new(SelectionUnit::new(unit, ps).unwrap(), len);
            let mut any = Distinct::default();
            let mut dedup = RowDedup::default();
            let pages = len.div_ceil(u64::from(ps)) as u32;
            let (valid, in_order) = any.map_any(&row, &m, &mut dedup, pages).unwrap();
            prop_assert_eq!(valid, row.len() as u64);
            prop_assert!(in_order);
            let kept: Vec<Kept> = kept_pages
                .iter()
                .map(|&p| Kept { page: p, object: 500 + p, slot: 1000 + p as i32 })
                .collect();
            let narrow: Vec<i32> = row.iter().map(|&e| e as i32).collect();
            let k = row.len();
            let mut runs = Vec::new();
            for wide in [true, false] {
                let mut out = Rows::unfilled(0, (before + 1) * k + FILL_WINDOW);
                out.table.resize(before * k, 7);
                let mut kr = KeptRows::default();
                let mut fresh = Vec::new();
                let at = before * k;
                let o = RunsOut { out: &mut out, kr: &mut kr, fresh: &mut fresh };
                if wide {
                    merge_runs(SortedRow { row: &row[..], at, ahead: &[], m: &m, kept: &kept }, o);
                } else {
                    merge_runs(SortedRow { row: &narrow[..], at, ahead: &[], m: &m, kept: &kept }, o);
                }
                prop_assert_eq!(out.table.len(), at + k);
                prop_assert!(out.table[..at].iter().all(|&c| c == 7));
                for (j, &e) in row.iter().enumerate() {
                    let page = m.page_of(e as u64);
                    let want = if kept_pages.contains(&page) { 1000 + page as i32 } else { -1 };
                    prop_assert_eq!(out.table[at + j], want, "cell {}", j);
                }
                // Every distinct page, in order, with its first column and needed tokens:
                // kept ones through the counts, new ones through `fresh`.
                let mut listed: Vec<u32> = kr.lists.iter().map(|k| k.page).collect();
                listed.dedup();
                prop_assert_eq!(&listed, &any.page);
                let hits: Vec<u32> = any.page.iter().copied().filter(|p| kept_pages.contains(p)).collect();
                prop_assert_eq!(out.kept_hits, hits.len() as u64);
                let hit_tokens: u64 = any
                    .page
                    .iter()
                    .zip(&any.needed)
                    .filter(|(p, _)| kept_pages.contains(p))
                    .map(|(_, &n)| u64::from(n))
                    .sum();
                prop_assert_eq!(out.kept_needed, hit_tokens);
                let new: Vec<(u32, u32, u32)> = any
                    .page
                    .iter()
                    .zip(any.first.iter().zip(&any.needed))
                    .filter(|(p, _)| !kept_pages.contains(p))
                    .map(|(&p, (&f, &n))| (p, f, n))
                    .collect();
                let got: Vec<(u32, u32, u32)> = fresh.iter().map(|f| (f.page, f.first, f.needed)).collect();
                prop_assert_eq!(&got, &new);
                for f in &fresh {
                    prop_assert_eq!(kr.lists[f.at_list as usize].page, f.page);
                    prop_assert_eq!(kr.lists[f.at_list as usize].slot, -1);
                    let next = any.first.iter().find(|&&c| c > f.first).map_or(k as u32, |&c| c);
                    prop_assert_eq!(f.end, next);
                }
                let dropped: Vec<u32> = kept
                    .iter()
                    .filter(|k| !any.page.contains(&k.page))
                    .map(|k| k.object)
                    .collect();
                prop_assert_eq!(&kr.dropped, &dropped);
                runs.push((out.table, kr.lists.len(), kr.dropped));
            }
            prop_assert_eq!(&runs[0], &runs[1]);
        }
    }
}
