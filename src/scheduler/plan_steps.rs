//! The steps of a layer plan that need nothing of the scheduler but what they are handed:
//! checking the plan's arguments against the configuration, counting the resolve, scoring
//! the plan's rows against what prefetch predicted and moved, remembering the selection for
//! the next prefetch, and placing the resolved slots in the table. `StepScheduler::plan_rows`
//! (`core.rs`) runs them between building the rows and committing the plan.

use super::core::{PlanCounts, SchedulerConfig};
use super::record::StepRecord;
use super::repeats::Repeats;
use super::request::RequestState;
use super::selection::SelectionUnit;
use crate::directory::{ResolveMetrics, Resolved};
use crate::error::{Error, Result};
use crate::ids::{PinHandleId, RequestId};
use rustc_hash::FxHashMap;

/// Per request: the pages a prefetch predicted and the pages it loaded, both sorted.
pub(super) type Predicted = FxHashMap<RequestId, (Vec<u32>, Vec<u32>)>;

/// A plan's arguments against the scheduler's configuration, before anything changes:
/// `entries` selection entries of `unit`, `counts` (page rows only) one per entry, at `layer`.
pub(super) fn check_args(
    cfg: &SchedulerConfig,
    layer: u16,
    entries: usize,
    unit: SelectionUnit,
    counts: Option<&[u32]>,
) -> Result<()> {
    if let Some(c) = counts {
        if c.len() != entries {
            return Err(Error::config(
                "counts",
                format!("{} entries", c.len()),
                format!("{entries}: one per selection entry"),
            ));
        }
        if unit.unit() != cfg.page_size {
            return Err(Error::config(
                "unit",
                unit.unit(),
                format!(
                    "the page size {} with counts (page rows; token rows need none)",
                    cfg.page_size
                ),
            ));
        }
    }
    if layer >= cfg.layers {
        return Err(Error::out_of_range("layer", layer, 0, cfg.layers));
    }
    if unit.page_size() != cfg.page_size {
        return Err(Error::config(
            "unit",
            unit.unit(),
            format!(
                "a selection unit over the scheduler's {}-token pages",
                cfg.page_size
            ),
        ));
    }
    Ok(())
}

/// What a plan's rows read, set against what was moved for them.
pub(super) struct Moved<'a> {
    /// The batch's requests, a row each.
    pub rids: &'a [RequestId],
    /// Per row: its distinct pages, sorted, with their key index (a kept plan's rows: every
    /// distinct page, kept or not).
    pub rows_pages: &'a [Vec<(u32, u32)>],
    /// Per key: the selected tokens it holds.
    pub needed: &'a [u32],
    /// Per key: whether this plan's resolve loads it.
    pub loaded: &'a [bool],
}

/// Scores the plan against the layer's prefetch (`rows`: per request, the pages it predicted
/// and the pages it loaded, both sorted) into `rec` (hits, waste), and returns the selected
/// tokens inside every page moved for the plan: its own loads and the prefetch loads its rows
/// read (read amplification's denominator, seed 002).
pub(super) fn score_moved(
    m: &Moved<'_>,
    prefetch: Option<&Predicted>,
    object_bytes: u64,
    rec: &mut StepRecord,
) -> u64 {
    let mut needed_moved: u64 = m
        .loaded
        .iter()
        .zip(m.needed)
        .map(|(&l, &n)| if l { u64::from(n) } else { 0 })
        .sum();
    let Some(pf) = prefetch else {
        return needed_moved;
    };
    let mut wasted = 0u64;
    for (b, id) in m.rids.iter().enumerate() {
        let Some((predicted, loaded)) = pf.get(id) else {
            continue;
        };
        let row = &m.rows_pages[b];
        rec.prefetch_hits += intersect(row, predicted, |_| ());
        let mut used = 0u64;
        // (A page prefetch loaded was Absent, so never kept: each is a key.)
        let used_n = intersect(row, loaded, |idx| {
            used += m.needed.get(idx as usize).map_or(0, |&n| u64::from(n));
        });
        needed_moved += used;
        wasted += loaded.len() as u64 - used_n;
    }
    for (id, (_, loaded)) in pf {
        if !m.rids.contains(id) {
            wasted += loaded.len() as u64;
        }
    }
    rec.prefetch_wasted += wasted;
    rec.prefetch_wasted_bytes += wasted * object_bytes;
    needed_moved
}

/// How many pages of `row` (sorted, with key indices) `other` (sorted) holds, calling `hit`
/// with the key index of each.
pub(super) fn intersect(row: &[(u32, u32)], other: &[u32], mut hit: impl FnMut(u32)) -> u64 {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < row.len() && j < other.len() {
        match row[i].0.cmp(&other[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                hit(row[i].1);
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// The resolve of a plan whose every page was kept: nothing pinned, nothing loaded.
pub(super) fn nothing_resolved() -> Resolved {
    Resolved {
        slots: Vec::new(),
        loads: Vec::new(),
        joined: Default::default(),
        handle: PinHandleId::new(0),
        metrics: Default::default(),
        loaded: Vec::new(),
        indices: Vec::new(),
    }
}

/// A plan's record and counts from its resolve (`m`) and its kept hits (pages read from kept
/// slots, Ready without a directory call).
pub(super) fn plan_record(
    m: &ResolveMetrics,
    kept_hits: u64,
    selected: u64,
) -> (StepRecord, PlanCounts) {
    let rec = StepRecord {
        selected,
        pages: m.distinct + kept_hits,
        ready: m.ready + kept_hits,
        loaded: m.absent,
        joined: m.loading,
        ..Default::default()
    };
    let counts = PlanCounts {
        ready: m.ready + kept_hits,
        loaded: m.absent,
        joined: m.loading,
        exposed_wait_ns: 0,
    };
    (rec, counts)
}

/// Keeps each row's distinct pages at `layer` (sorted) as its request's next prediction.
pub(super) fn remember_selection(
    requests: &mut FxHashMap<RequestId, RequestState>,
    rids: &[RequestId],
    layer: u16,
    rows_pages: &[Vec<(u32, u32)>],
) {
    for (b, id) in rids.iter().enumerate() {
        let r = requests.get_mut(id).expect("checked by the rows");
        let last = &mut r.last_selection[layer as usize];
        last.clear();
        last.extend(rows_pages[b].iter().map(|&(p, _)| p));
    }
}

/// Places the resolved keys' slots in the table: each key's first cell and its repeats (kept
/// cells hold their slots already; at decode's usual locality the keys are a tenth of the
/// cells).
pub(super) fn place_slots(
    table: &mut [i32],
    key_cell: &[u32],
    repeats: &Repeats,
    key_slot: &[i32],
) {
    for (key, &at) in key_cell.iter().enumerate() {
        table[at as usize] = key_slot[key];
    }
    repeats.place(table, |key| key_slot[key]);
}
