//! Kept selections: the hit path of decode (block mode here; token mode maps its rows to
//! pages first, `kept_entries.rs`).
//!
//! Decode selections change slowly from step to step (`bench decode` assumes nine blocks in
//! ten stay, its `locality`). A page a plan selected stays pinned when the plan
//! finishes (held by the directory, outside any handle) and is remembered in the
//! request's `kept` list for that layer with its slot. The next plan of that layer reads a
//! kept page's slot from the list, without a directory call; only the pages the selection
//! newly picked are resolved (one batched call, as before), and only the pages it dropped are
//! unpinned. A hit costs a merge step against a list of ~32 entries the request owns, instead
//! of a pin and an unpin on an object among millions. The plan's merge also lists the pages each
//! row dropped, so its finish replaces the lists without merging again.
//! Block rows in page order (the common case) merge by runs (`merge_sorted_block_row`): a run
//! of pages the row shares with its list costs a compare and two copies a cell.
//!
//! What it costs: the kept pages stay on the device until dropped (one selection per layer per
//! request; the device budget must hold that, which any plan needs anyway), and they are not
//! eviction candidates meanwhile. Making room gives back every kept page no outstanding plan
//! reads (`make_room`); a plan that ran out of slots after reading kept lists (a hit, or a
//! page its row dropped) starts over.
//! Entries smaller than a page (token mode's tokens) keep their pages the same way; their rows
//! map entries to pages first (`kept_entries.rs`). Blocks larger than a page and a directory
//! journal (whose replay models handles only) leave the kept lists alone and resolve every
//! page.
//!
//! Kept pages hold at most half the device (`KEPT_SHARE_DIVISOR`): a plan whose refresh would
//! pass that keeps nothing, as if kept selections were off for it. A budget too small to keep
//! every layer's selection then keeps what fits instead of giving every kept page back to make
//! room at each plan.
//!
//! Prefetch predicts a layer's selection by the same layer's last step. Kept selections hold
//! that prediction on the device, so with both on a kept plan records its kept pages as
//! predicted and its kept hits as hits. A request's `last_selection` then holds only the
//! predicted pages that are not kept (a row that kept nothing, pages given back to make room
//! or still loading at finish): prefetch loads those and scores them as before.
//!
//! Invariants (checked by `validate`): every kept entry is its object's, Ready at the kept
//! slot, and the kept entries are exactly the directory's held pins.

use super::core::{mark_batch, LayerPlan, StepScheduler, KEPT, NONE};
use super::csr::RowsIn;
use super::kept_store::{KeptSlot, Run};
use super::request::{Kept, RequestState};
use super::rows::{entry_count, KeptRows, Rows};
use super::tier::Tier;
use crate::directory::ObjectHint;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::scheduler::entry::Entry;
use crate::scheduler::SelectionUnit;

/// Kept pages hold at most 1 / this of the device's usable slots (see `refresh_kept`).
pub(super) const KEPT_SHARE_DIVISOR: u64 = 2;

/// Bytes of the kept array a row's merge asks for past its own list (about two rows).
const AHEAD_BYTES: usize = 768;

impl<T: Tier> StepScheduler<T> {
    /// Whether a plan of `layer` over `unit` uses and refreshes the kept lists: entries of at
    /// most a page (block = page here, smaller ones in `kept_entries.rs`), and no other plan
    /// of the layer outstanding (a plan's kept cells rely on the kept pins
    /// until it finishes, so only one plan at a time may read and replace a layer's lists).
    pub(super) fn keeps(&self, layer: u16, unit: SelectionUnit) -> bool {
        self.keep
            && unit.unit() <= self.cfg.page_size
            && !self.plans.values().any(|p| p.layer == layer)
            && !self.dir.journaling()
    }

    /// The rows of a kept-selection plan (block = page): each row's pages in page order,
    /// merged with the row's kept list; a kept page's cell gets its kept slot at once, a new
    /// page becomes a key. Repeated pages (adjacent once sorted) share their first cell.
    /// `COUNTED` rows come with `counts`, each cell's selected tokens in its page (token rows
    /// mapped to pages); block rows need whole pages and skip those checks.
    pub(super) fn kept_rows<const COUNTED: bool, E: Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        rows_in: RowsIn<'_>,
        counts: &[u32],
        batch: u64,
    ) -> Result<Rows> {
        let ps = u64::from(self.cfg.page_size);
        let l = layer as usize;
        let mut out = Rows::with_table(selection.len() / 8, selection.len());
        let mut kr = KeptRows::with_lists(self.kept.take_spare(selection.len()), rids.len());
        let mut order: Vec<(u32, u32)> = Vec::new(); // (page, column)
        for (b, &id) in rids.iter().enumerate() {
            let r = mark_batch(&mut self.requests, id, batch)?;
            let len = r.len;
            let entries = len.div_ceil(ps);
            order.clear();
            let cells = rows_in.row(b);
            let row = &selection[cells.clone()];
            // The indexer's rows come sorted by page (and unpadded once contexts are long):
            // such a row is its own order, checked at its two ends and copied without a branch.
            let in_order = row.first().is_some_and(|&e| e.get() >= 0)
                && row.last().is_some_and(|&e| (e.get() as u64) < entries)
                && row.is_sorted();
            if in_order && !COUNTED {
                // Block rows in order (the common case): merged straight from the row.
                let kept = self.kept.list_ahead(l, r.kept_slot, AHEAD_BYTES);
                if let Some(next) = selection.get(cells.end..) {
                    crate::prefetch::prefetch_range(next, AHEAD_BYTES / 2);
                }
                merge_sorted_block_row(
                    kept,
                    row,
                    (b, cells.start),
                    (r, layer, ps),
                    &mut out,
                    &mut kr,
                );
                kr.ends.push(kr.lists.len() as u32);
                kr.dropped_ends.push(kr.dropped.len() as u32);
                kr.serials.push(r.serial);
                continue;
            }
            if in_order {
                order.extend(
                    row.iter()
                        .enumerate()
                        .map(|(j, &e)| (e.get() as u32, j as u32)),
                );
            } else {
                for (j, &e) in row.iter().enumerate() {
                    let e = e.get();
                    if e == -1 {
                        continue; // padding
                    }
                    if e < 0 || e as u64 >= entries {
                        return Err(Error::out_of_range(
                            rows_in.name(false, b, j),
                            e,
                            -1,
                            entries,
                        ));
                    }
                    order.push((e as u32, j as u32));
                }
                if !order.is_sorted() {
                    order.sort_unstable();
                }
            }
            let kept = self.kept.list(l, r.kept_slot);
            let mut kc = 0;
            let (mut prev, mut prev_cell, mut prev_slot) = (u32::MAX, NONE, -1);
            let mut prev_tokens = 0;
            for &(page, j) in &order {
                let at = cells.start + j as usize;
                if !COUNTED {
                    out.selected += 1;
                }
                if page == prev {
                    out.table[at] = prev_slot;
                    if prev_cell & KEPT == 0 {
                        out.repeats.push(at as u32, prev_cell);
                    }
                    if COUNTED {
                        // A page named twice: its tokens add up, to the page's at most.
                        let p = u64::from(page);
                        let in_page = (((p + 1) * ps).min(len) - p * ps) as u32;
                        let c = entry_count(counts, at, rows_in, (b, j as usize), in_page)?;
                        out.selected += u64::from(c);
                        let more = (prev_tokens + c).min(in_page) - prev_tokens;
                        prev_tokens += more;
                        if prev_cell & KEPT == 0 {
                            out.needed[prev_cell as usize] += more;
                        } else {
                            out.kept_needed += u64::from(more);
                        }
                    }
                    continue;
                }
                let p = u64::from(page);
                let in_page = (((p + 1) * ps).min(len) - p * ps) as u32;
                // Page rows that say how many selected tokens each page holds (token mode
                // mapped on the device) need those bytes only; block rows need the page.
                let tokens = if COUNTED {
                    let c = entry_count(counts, at, rows_in, (b, j as usize), in_page)?;
                    out.selected += u64::from(c);
                    prev_tokens = c;
                    c
                } else {
                    in_page
                };
                while kc < kept.len() && kept[kc].page < page {
                    kr.dropped.push(kept[kc].object);
                    kc += 1;
                }
                let (cell, slot) = if kc < kept.len() && kept[kc].page == page {
                    out.kept_hits += 1;
                    out.kept_needed += u64::from(tokens);
                    let hit = kept[kc];
                    kr.lists.push(hit);
                    kc += 1;
                    (KEPT, hit.slot)
                } else {
                    let key = out.push_new_page(&mut kr, r, (page, layer), (b, at), tokens);
                    (key, -1)
                };
                out.table[at] = slot;
                (prev, prev_cell, prev_slot) = (page, cell, slot);
            }
            kr.dropped.extend(kept[kc..].iter().map(|k| k.object));
            kr.ends.push(kr.lists.len() as u32);
            kr.dropped_ends.push(kr.dropped.len() as u32);
            kr.serials.push(r.serial);
        }
        self.look_up_hints(layer, rids, &mut out, &kr);
        out.kept_rows = Some(kr);
        Ok(out)
    }

    /// Fills each key's hint from its row's page table (the key's page is its kept-list
    /// entry's), all the tables' misses asked for first so that they overlap.
    pub(super) fn look_up_hints(
        &self,
        layer: u16,
        rids: &[RequestId],
        out: &mut Rows,
        kr: &KeptRows,
    ) {
        if out.keys.is_empty() {
            return;
        }
        let tables: Vec<&[ObjectHint]> = rids
            .iter()
            .map(|id| &self.requests[id].index[layer as usize][..])
            .collect();
        let page = |key: usize| kr.lists[kr.key_at[key] as usize].page as usize;
        for (key, &b) in out.key_row.iter().enumerate() {
            crate::prefetch::prefetch(tables[b as usize].as_ptr().wrapping_add(page(key)));
        }
        for (key, (&b, h)) in out.key_row.iter().zip(out.hints.iter_mut()).enumerate() {
            *h = tables[b as usize]
                .get(page(key))
                .copied()
                .unwrap_or(ObjectHint::NONE);
        }
    }

    /// Turns kept selections on (the default) or off; off gives every kept page back.
    pub fn set_keep_selections(&mut self, on: bool) -> Result<()> {
        self.keep = on;
        if !on {
            self.release_all_kept()?;
        }
        Ok(())
    }

    /// Whether block selections are kept (see the module).
    pub fn keeps_selections(&self) -> bool {
        self.keep
    }

    /// Pins held for kept pages now.
    pub fn kept_pins(&self) -> u64 {
        self.kept_pins
    }

    /// Gives back every kept page of every request, but those of layers an outstanding plan
    /// reads kept slots of (they go back when it finishes, if it no longer selects them).
    pub(super) fn release_all_kept(&mut self) -> Result<()> {
        if self.kept_pins == 0 {
            return Ok(());
        }
        let busy: Vec<usize> = self
            .plans
            .values()
            .filter(|p| p.rows.is_some())
            .map(|p| p.layer as usize)
            .collect();
        let mut objects = Vec::with_capacity(self.kept_pins as usize);
        for r in self.requests.values_mut() {
            for l in 0..self.cfg.layers as usize {
                if busy.contains(&l) {
                    continue;
                }
                if self.cfg.prefetch {
                    // Still the layer's prediction; no longer held, so prefetch may load it.
                    let last = &mut r.last_selection[l];
                    last.extend(self.kept.list(l, r.kept_slot).iter().map(|k| k.page));
                    last.sort_unstable();
                    last.dedup();
                }
                self.kept.drain(l, r.kept_slot, &mut objects);
            }
        }
        self.unhold(&objects)
    }

    /// Gives back the kept pages of a request that ended (taken out of `requests`), and its
    /// kept slot.
    pub(super) fn release_kept_of(&mut self, slot: KeptSlot) -> Result<()> {
        let mut objects = Vec::new();
        self.kept.remove(slot, &mut objects);
        self.unhold(&objects)
    }

    pub(super) fn unhold(&mut self, objects: &[u32]) -> Result<()> {
        if objects.is_empty() {
            return Ok(());
        }
        self.dir.unhold(objects)?;
        self.kept_pins -= objects.len() as u64;
        Ok(())
    }

    /// At the end of a kept-selection plan: each row's kept list becomes the list its merge
    /// wrote (the kept entries as they were, the newly resolved pages held at their slots;
    /// failed rows none); pages it no longer selects (found when the plan merged) are given
    /// back. Runs before the plan's handles are released, so a page kept on is never unpinned
    /// in between.
    pub(super) fn refresh_kept(&mut self, plan: &mut LayerPlan) -> Result<()> {
        let Some(kr) = plan.rows.as_mut() else {
            return Ok(());
        };
        let layer = plan.layer as usize;
        // Kept pages may hold at most a share of the device: a budget that cannot keep every
        // layer's selection would otherwise give them all back to make room at every plan
        // (and leave prefetch no room). Past the share this plan keeps nothing.
        let (_, capacity) = self.dir.device_usage();
        let projected =
            (self.kept_pins + kr.key_at.len() as u64).saturating_sub(kr.dropped.len() as u64);
        let keep = self.keep && projected <= capacity as u64 / KEPT_SHARE_DIVISOR;
        // The resolved pages' objects, and their slots as `ready` left them (a retried load
        // may have moved).
        for (key, &at) in kr.key_at.iter().enumerate() {
            let e = &mut kr.lists[at as usize];
            e.object = plan.indices[key];
            e.slot = plan.key_slot[key];
        }
        let mut to_hold: Vec<u32> = Vec::with_capacity(kr.key_at.len());
        let mut placed: Vec<(usize, usize)> = Vec::with_capacity(kr.key_at.len()); // (row, entry)
        let mut to_unhold: Vec<u32> = Vec::with_capacity(kr.dropped.len());
        let mut covered: Vec<(KeptSlot, Run)> = Vec::with_capacity(kr.ends.len());
        let (mut start, mut dstart, mut key) = (0usize, 0usize, 0usize);
        for (b, (&end, &dend)) in kr.ends.iter().zip(&kr.dropped_ends).enumerate() {
            let (end, dend) = (end as usize, dend as usize);
            let row = &kr.lists[start..end];
            let dropped = &kr.dropped[dstart..dend];
            let first_key = key;
            while key < kr.key_at.len() && (kr.key_at[key] as usize) < end {
                key += 1;
            }
            let row_start = start;
            (start, dstart) = (end, dend);
            let Some(r) = self.requests.get_mut(&plan.rids[b]) else {
                continue; // ended meanwhile: its kept pages went back then
            };
            if r.serial != kr.serials[b] {
                // Ended and added again: the merge was against its old lists. (An id cannot
                // start again while a plan pins its pages; this keeps the lists apart
                // whatever changes.)
                continue;
            }
            // The next prediction (prefetch's input): a kept row's pages are its kept list;
            // a row that keeps nothing predicts its pages through `last_selection`.
            let kept_row = keep && !plan.failed.contains(&(b as u32));
            if self.cfg.prefetch {
                let last = &mut r.last_selection[layer];
                last.clear();
                if !kept_row {
                    last.extend(row.iter().map(|e| e.page));
                }
            }
            if !kept_row {
                self.kept.drain(layer, r.kept_slot, &mut to_unhold);
                continue;
            }
            for k in first_key..key {
                placed.push((b, kr.key_at[k] as usize));
                to_hold.push(plan.indices[k]);
            }
            to_unhold.extend_from_slice(dropped);
            let run = Run {
                start: row_start as u32,
                end: end as u32,
            };
            covered.push((r.kept_slot, run));
        }
        let mut held = Vec::with_capacity(to_hold.len());
        // A victim the device resolver's standing grant holds (a step planned on the host
        // because the device could not grant it) is not kept: the device may evict it at its
        // next step, under the kept list. It is resolved again, as a load still in flight is.
        let victims = T::device_victims(self);
        if victims.is_empty() {
            self.dir.hold(&to_hold, &mut held)?;
        } else {
            let keep: Vec<u32> = to_hold
                .iter()
                .copied()
                .filter(|i| !victims.contains(i))
                .collect();
            let mut kept = Vec::with_capacity(keep.len());
            self.dir.hold(&keep, &mut kept)?;
            let mut kept = kept.into_iter();
            held.extend(
                to_hold
                    .iter()
                    .map(|i| !victims.contains(i) && kept.next().expect("one per kept object")),
            );
        }
        let n_held = held.iter().filter(|&&h| h).count();
        self.kept_pins += n_held as u64;
        let mut lists = std::mem::take(&mut kr.lists);
        let mut unready: Vec<KeptSlot> = Vec::new();
        if n_held < held.len() {
            // Loads still in flight on a CUDA stream: not kept, resolved again next step.
            for (&(b, at), &h) in placed.iter().zip(&held) {
                if !h {
                    lists[at].slot = -1;
                    let r = self.requests.get_mut(&plan.rids[b]).expect("placed above");
                    unready.push(r.kept_slot);
                    if self.cfg.prefetch {
                        let page = lists[at].page;
                        let last = &mut r.last_selection[layer];
                        let i = last.partition_point(|&p| p < page);
                        last.insert(i, page);
                    }
                }
            }
        }
        self.kept.install(layer, lists, &covered);
        for slot in unready {
            self.kept.retain(layer, slot, |k| k.slot >= 0);
        }
        self.unhold(&to_unhold)
    }

    /// The kept lists against the directory (module docs).
    pub(super) fn validate_kept(&self) -> std::result::Result<(), String> {
        self.kept.validate()?;
        let slots: rustc_hash::FxHashSet<KeptSlot> =
            self.requests.values().map(|r| r.kept_slot).collect();
        if slots.len() != self.requests.len() || self.kept.in_use() != slots.len() {
            return Err(format!(
                "{} requests own {} kept slots; {} slots in use",
                self.requests.len(),
                slots.len(),
                self.kept.in_use()
            ));
        }
        let mut n = 0u64;
        for r in self.requests.values() {
            for l in 0..self.cfg.layers as usize {
                let kept = self.kept.list(l, r.kept_slot);
                if !kept.is_sorted_by_key(|k| k.page) {
                    return Err(format!(
                        "request {}: kept pages of layer {l} unsorted",
                        r.id
                    ));
                }
                for k in kept {
                    let key = r.key(k.page, l as u16);
                    let ok = self.dir.state(&key).is_some_and(|o| {
                        o.pins > 0
                            && o.device
                                == crate::directory::DeviceState::Ready {
                                    slot: crate::ids::SlotId::new(k.slot as u32),
                                }
                    });
                    if !ok {
                        return Err(format!(
                            "request {}: kept page {} of layer {l} is not Ready at slot {}: {:?}",
                            r.id,
                            k.page,
                            k.slot,
                            self.dir.state(&key).map(|o| o.device)
                        ));
                    }
                    n += 1;
                }
            }
        }
        if n != self.kept_pins {
            return Err(format!(
                "{n} kept pages, {} kept pins counted",
                self.kept_pins
            ));
        }
        // The directory's holds: kept pages, and what the kind holds besides (joined: the
        // device resolver's holds and victims).
        let held = self.dir.held_pins();
        let extra = T::extra_pins(self);
        if held != n + extra {
            return Err(format!(
                "{n} kept pages and {extra} held otherwise, the directory holds {held}"
            ));
        }
        Ok(())
    }
}

/// Merges a block row whose pages are sorted and in range (`row`, its first cell at `base`)
/// with its kept list, as `kept_rows`' general loop does, by runs: decode rows keep most of
/// their pages from one step to the next, and a run of pages the row shares with the list
/// goes through a loop of a compare and two copies a cell (~125k cells a step at
/// DeepSeek-V3.2's shape).
#[inline]
fn merge_sorted_block_row<E: Entry>(
    kept: &[Kept],
    row: &[E],
    (b, base): (usize, usize),
    (r, layer, ps): (&RequestState, u16, u64),
    out: &mut Rows,
    kr: &mut KeptRows,
) {
    let len = r.len;
    let in_page = |page: u32| {
        let p = u64::from(page);
        (((p + 1) * ps).min(len) - p * ps) as u32
    };
    // Out of `out` while the row is merged (new pages push their keys into `out`).
    let mut all = std::mem::take(&mut out.table);
    let table = &mut all[base..base + row.len()];
    let (mut j, mut kc, mut hits) = (0usize, 0usize, 0usize);
    let mut prev = u32::MAX; // the last page merged
    let mut prev_key = NONE; // its key, if it was new
    while j < row.len() {
        // A run the row shares with the list: hits, their slots straight into the table.
        let mut n = 0;
        for ((&e, &k), cell) in row[j..].iter().zip(&kept[kc..]).zip(&mut table[j..]) {
            if e.get() as u32 != k.page {
                break;
            }
            *cell = k.slot;
            kr.lists.push(k);
            n += 1;
        }
        if n > 0 {
            (j, kc) = (j + n, kc + n);
            hits += n;
            (prev, prev_key) = (row[j - 1].get() as u32, NONE);
            continue;
        }
        let page = row[j].get() as u32;
        if page == prev {
            // Named again (adjacent, sorted): the cell reads what the first one reads.
            if prev_key == NONE {
                table[j] = table[j - 1];
            } else {
                out.repeats.push((base + j) as u32, prev_key);
            }
            j += 1;
        } else if kc < kept.len() && kept[kc].page < page {
            kr.dropped.push(kept[kc].object);
            kc += 1;
        } else {
            // Not kept: a key to resolve (the table's cell stays -1 until then).
            prev_key = out.push_new_page(kr, r, (page, layer), (b, base + j), in_page(page));
            prev = page;
            j += 1;
        }
    }
    kr.dropped.extend(kept[kc..].iter().map(|k| k.object));
    // Every page is whole but the request's last, which a sorted row names at its end.
    let mut needed = hits as u64 * ps;
    if let (Some(&cell), Some(&e)) = (table.last(), row.last()) {
        if cell >= 0 {
            needed -= ps - u64::from(in_page(e.get() as u32));
        }
    }
    out.table = all;
    out.kept_hits += hits as u64;
    out.kept_needed += needed;
    out.selected += row.len() as u64;
}

/// Each row's distinct pages, sorted, with their key index (`NONE` for a kept page): the rows
/// as `selection_rows` lists them, to score a prefetch a kept-selection plan consumes.
pub(super) fn rows_pages(kr: &KeptRows) -> Vec<Vec<(u32, u32)>> {
    let mut key_of = vec![NONE; kr.lists.len()];
    for (key, &at) in kr.key_at.iter().enumerate() {
        key_of[at as usize] = key as u32;
    }
    let mut start = 0;
    kr.ends
        .iter()
        .map(|&end| {
            let row = (start..end as usize)
                .map(|i| (kr.lists[i].page, key_of[i]))
                .collect();
            start = end as usize;
            row
        })
        .collect()
}
