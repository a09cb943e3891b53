//! A plan's selection, row by row: the keys to resolve and where each slot-table cell reads
//! from. Three builders: `selection_rows` (any selection unit, every page resolved), `kept_rows`
//! (`kept.rs`: block = page, kept pages read from their kept slots) and `kept_entry_rows`
//! (`kept_entries.rs`: entries inside a page, token mode, mapped to pages, then the same).

use super::core::{mark_batch, StepScheduler, NONE};
use super::csr::RowsIn;
use super::repeats::Repeats;
use super::request::{Kept, RequestState};
use super::tier::Tier;
use crate::directory::{ObjectHint, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::scheduler::entry::Entry;
use crate::scheduler::SelectionUnit;

/// A kept-selection plan's rows, merged with the rows' kept lists as they were when it was
/// planned: each row's next kept list, written by the merge, so that finish only copies it.
#[derive(Debug, Default)]
pub(super) struct KeptRows {
    /// Every row's next kept list (its distinct pages, sorted), flat: kept entries as they
    /// were, new pages filled in from the resolve at finish.
    pub lists: Vec<Kept>,
    /// Per row: where its run of `lists` ends.
    pub ends: Vec<u32>,
    /// Per key (row order): its entry in `lists`.
    pub key_at: Vec<u32>,
    /// The objects of kept pages the rows no longer select, flat.
    pub dropped: Vec<u32>,
    /// Per row: where its run of `dropped` ends.
    pub dropped_ends: Vec<u32>,
    /// Per row: the request state merged against (`RequestState::serial`).
    pub serials: Vec<u64>,
}

impl KeptRows {
    /// Rows that write their lists into `lists` (empty, with room for the distinct pages
    /// expected), over `rows` rows (about one page in eight new or dropped).
    pub(super) fn with_lists(lists: Vec<Kept>, rows: usize) -> Self {
        let pages = lists.capacity();
        KeptRows {
            lists,
            ends: Vec::with_capacity(rows),
            key_at: Vec::with_capacity(pages / 8),
            dropped: Vec::with_capacity(pages / 8),
            dropped_ends: Vec::with_capacity(rows),
            serials: Vec::with_capacity(rows),
        }
    }
}

/// What a plan's rows produce.
pub(super) struct Rows {
    /// The keys to resolve, one per distinct page of each row.
    pub keys: Vec<ObjectKey>,
    /// Per key: where the directory holds its object, if known.
    pub hints: Vec<ObjectHint>,
    /// Per key: its row.
    pub key_row: Vec<u32>,
    /// Per key: the first cell naming it.
    pub key_cell: Vec<u32>,
    /// Per key: the selected tokens it holds.
    pub needed: Vec<u32>,
    /// Joined mode, per key: the request page if it is a matched prefix page, else NONE.
    pub from_prefix: Vec<u32>,
    /// Per cell: the slot where known already (kept cells), else -1 (a key's cell until the
    /// resolve places it, or padding).
    pub table: Vec<i32>,
    /// Every cell naming a key but its first (a page repeated in its row): with `key_cell`,
    /// every cell a resolve's slots go to.
    pub repeats: Repeats,
    /// Per row: its distinct pages, sorted, with their key index (the prefetch's input).
    pub rows_pages: Vec<Vec<(u32, u32)>>,
    /// Kept-selection plans: every row's distinct pages with their cells, and row ends.
    pub kept_rows: Option<KeptRows>,
    /// Selected pages, repeats included.
    pub selected: u64,
    /// Distinct pages read from kept slots.
    pub kept_hits: u64,
    /// Selected tokens in those pages.
    pub kept_needed: u64,
}

impl Rows {
    /// Room for `entries` keys and `cells` cells, every table cell -1.
    pub(super) fn with_table(entries: usize, cells: usize) -> Self {
        let mut r = Self::unfilled(entries, cells);
        r.table.resize(cells, -1);
        r
    }

    /// A page a kept-selection row newly selects (`page` of `layer`, first named at cell `at`
    /// of row `b`): a key to resolve, its hint looked up later with every other key's (the
    /// misses overlapped), and a placeholder in the row's next kept list that `finish` fills
    /// from the resolve. Returns the key index.
    #[inline]
    pub(super) fn push_new_page(
        &mut self,
        kr: &mut KeptRows,
        r: &RequestState,
        (page, layer): (u32, u16),
        (b, at): (usize, usize),
        needed: u32,
    ) -> u32 {
        let at_list = kr.lists.len() as u32;
        kr.lists.push(Kept::placeholder(page));
        self.push_key(kr, at_list, r, (page, layer), (b, at), needed)
    }

    /// The key of a page a kept-selection row newly selects, whose placeholder in the row's
    /// next kept list is `lists[at_list]` (see [`Self::push_new_page`]). Returns the key index.
    #[inline]
    pub(super) fn push_key(
        &mut self,
        kr: &mut KeptRows,
        at_list: u32,
        r: &RequestState,
        (page, layer): (u32, u16),
        (b, at): (usize, usize),
        needed: u32,
    ) -> u32 {
        let key = self.keys.len() as u32;
        kr.key_at.push(at_list);
        self.keys.push(r.key(page, layer));
        self.hints.push(ObjectHint::NONE); // looked up for the whole plan at once
        self.key_row.push(b as u32);
        self.key_cell.push(at as u32);
        self.from_prefix
            .push(if page < r.matched { page } else { NONE });
        self.needed.push(needed);
        key
    }

    /// Kept-selection rows whose builder pushes every table cell in order.
    pub(super) fn unfilled(entries: usize, cells: usize) -> Self {
        Rows {
            keys: Vec::with_capacity(entries),
            hints: Vec::with_capacity(entries),
            key_row: Vec::with_capacity(entries),
            key_cell: Vec::with_capacity(entries),
            needed: Vec::with_capacity(entries),
            from_prefix: Vec::with_capacity(entries),
            table: Vec::with_capacity(cells),
            repeats: Repeats::default(),
            rows_pages: Vec::new(),
            kept_rows: None,
            selected: 0,
            kept_hits: 0,
            kept_needed: 0,
        }
    }
}

/// The selected tokens cell `at` (row `b`, column `j` of `rows`) says its page holds: 1 to the
/// tokens the page has (`in_page`).
#[inline]
pub(super) fn entry_count(
    counts: &[u32],
    at: usize,
    rows: RowsIn<'_>,
    (b, j): (usize, usize),
    in_page: u32,
) -> Result<u32> {
    let c = counts[at];
    if c == 0 || c > in_page {
        return Err(Error::out_of_range(
            rows.name(true, b, j),
            c,
            1,
            u64::from(in_page) + 1,
        ));
    }
    Ok(c)
}

impl<T: Tier> StepScheduler<T> {
    /// Every selected page of every row becomes a key (deduplicated within its row). With
    /// `counts` (page entries only) each entry needs that many of its page's tokens.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn selection_rows<E: Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        rows_in: RowsIn<'_>,
        unit: SelectionUnit,
        counts: Option<&[u32]>,
        batch: u64,
    ) -> Result<Rows> {
        let ps = self.cfg.page_size;
        let ppe = unit.pages_per_entry();
        let mut out = Rows::with_table(selection.len(), selection.len() * ppe);
        out.rows_pages.reserve(rids.len());
        let mut pages_buf = vec![None; ppe];
        // The dense page -> object tables are cache misses at scale: ask for every row's
        // entries first, so the misses overlap instead of coming one by one below.
        let shift = unit.unit() / ps; // pages per entry, 0 when entries lie inside a page
        for (b, id) in rids.iter().enumerate() {
            if let Some(r) = self.requests.get(id) {
                let t = &r.index[layer as usize];
                for &e in &selection[rows_in.row(b)] {
                    let e = e.get();
                    let page = if shift > 0 {
                        e.wrapping_mul(i64::from(shift))
                    } else {
                        e.wrapping_mul(i64::from(unit.unit())) / i64::from(ps)
                    };
                    crate::prefetch::prefetch(t.as_ptr().wrapping_add(page as usize));
                }
            }
        }
        for (b, &id) in rids.iter().enumerate() {
            let r = mark_batch(&mut self.requests, id, batch)?;
            let len = r.len;
            self.dedup.begin_row(r.pages(ps));
            let cells = rows_in.row(b);
            let mut row_pages = Vec::with_capacity(cells.len());
            for (j, &e) in selection[cells.clone()].iter().enumerate() {
                let e = e.get();
                if e == -1 {
                    continue; // padding
                }
                if e < 0 || e as u64 >= unit.entries(len) {
                    return Err(Error::out_of_range(
                        rows_in.name(false, b, j),
                        e,
                        -1,
                        unit.entries(len),
                    ));
                }
                unit.entry_pages(e as u64, len, &mut pages_buf);
                for (i, cell) in pages_buf.iter().enumerate() {
                    let Some((page, mut tokens)) = *cell else {
                        continue;
                    };
                    let at = (cells.start + j) * ppe + i;
                    if let Some(c) = counts {
                        tokens = entry_count(c, at, rows_in, (b, j), tokens)?;
                        out.selected += u64::from(tokens);
                    } else {
                        out.selected += 1;
                    }
                    let next = out.keys.len() as u32;
                    match self.dedup.seen_or_insert(page, next) {
                        Some(idx) => {
                            out.repeats.push(at as u32, idx);
                            let n = &mut out.needed[idx as usize];
                            *n = (*n + tokens).min(ps);
                        }
                        None => {
                            out.keys.push(r.key(page, layer));
                            out.hints.push(r.hint(page, layer));
                            out.key_row.push(b as u32);
                            out.key_cell.push(at as u32);
                            out.from_prefix
                                .push(if page < r.matched { page } else { NONE });
                            out.needed.push(tokens);
                            row_pages.push((page, next));
                        }
                    }
                }
            }
            if !row_pages.is_sorted() {
                row_pages.sort_unstable();
            }
            out.rows_pages.push(row_pages);
        }
        Ok(out)
    }
}
