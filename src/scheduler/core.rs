//! `StepScheduler`: the batched decode step. One call per layer for the whole batch.
//!
//! # What it owns
//! The residency directory of the main-KV objects (one object = one page of one layer of one
//! request or shared prefix), the device and host KV bindings those objects' slots index, the
//! copy engine, every request's block state, the loads and backups in flight, the layer plans
//! handed out, the prefetches, and the step record.
//!
//! # One step
//! `append` (slots for the batch's new K/V rows; a page that starts is allocated for every
//! layer) -> per layer: `plan` (one directory resolve for the batch, one load submission for
//! every miss, a slot table) -> `ready` (event wait, or a CUDA stream wait; failures retried
//! once, then reported per request) -> `finish` (pins released, metrics folded) ->
//! `end_step` (filled pages written through in one backup submission, finished transfers
//! settled, the next step's first prefetches issued).
//!
//! # Invariants (checked by [`StepScheduler::validate`])
//! - the directory's own invariants;
//! - every pin the directory holds belongs to an outstanding plan or prefetch: with none
//!   outstanding, the directory holds no pin and no handle;
//! - every load or backup in flight in the directory is tracked here (or was settled), so
//!   nothing stays Loading or Writing once its events fired and `poll` ran;
//! - each request's tail slots are device-Ready objects of that request.
//!
//! # Failure
//! A failed load is settled (`fail`: its objects go back to host-only, their slots are
//! quarantined until the copy can no longer write them), retried once by the plan that needs
//! it, and if the retry fails too, the plan's rows that read those objects are reported failed
//! with the reason; the rest of the batch goes on. A failed backup leaves its pages device-only
//! (never evicted) and is submitted again at every `end_step` until it lands.
//!
//! # Drop
//! Dropping the scheduler drops the directory and the engine handle; transfers still in flight
//! keep their buffers alive only through the bindings' contract (the Python layer keeps the
//! tensors alive in the engine).

use super::kept_store::KeptStore;
use super::plan_steps;
use super::record::StepRecord;
use super::request::{Kept, RequestState};
use super::selection::{RowDedup, SelectionUnit};
use crate::directory::{Directory, DirectoryConfig, ObjectHint, ObjectKey, Resolved};
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, LayerPlanId, PinHandleId, RequestId, SlotId, TransferId};
use crate::transfer::{CopyEngine, PageTransferBinding};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::csr::{self, RowForm, RowsIn};
use super::kept;
use super::repeats;
use super::rows::{self, KeptRows, Rows};
use super::tier::{Plain, Tier};
use super::transfers::Transfers;

/// A slot-table cell naming no page (padding), and a key read from no matched prefix page.
pub(super) const NONE: u32 = u32::MAX;
/// A slot-table cell read from the row's kept pages (the merge wrote its slot).
pub(super) const KEPT: u32 = 1 << 31;

/// Sizes and switches of a scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Model layers (each layer's page is its own object).
    pub layers: u16,
    /// Tokens per page.
    pub page_size: u32,
    /// Device slots, reserve included.
    pub device_pages: u32,
    /// Device slots never handed out.
    pub device_reserve: u32,
    /// Host slots.
    pub host_pages: u32,
    /// Load what each request selected at a layer last step before that layer's indexer runs.
    pub prefetch: bool,
    /// How many layers ahead `plan(l)` prefetches (layer `l + depth`).
    pub prefetch_depth: u16,
}

/// What `ready` reports.
#[derive(Debug, Clone, Default)]
pub struct ReadyOutcome {
    /// Rows of the batch whose loads failed twice: (row, request, reason). Their slot-table
    /// rows are -1; the caller ends or restarts those requests. A row whose request ended
    /// since the plan (or started again under its id) is not named: its cells are only in
    /// `failed_cells`.
    pub failed: Vec<(usize, RequestId, String)>,
    /// Whether a retry moved objects to other slots (the slot table changed).
    pub slots_changed: bool,
    /// The cells a retry moved, with their new slots (the failed rows' cells are not listed:
    /// they all become -1). What a caller that took the table (`take_table`) applies to it.
    pub moved: Vec<(u32, i32)>,
    /// Per failed row (named in `failed` or not), its cells in the table (start, end): they
    /// all become -1.
    pub failed_cells: Vec<(u32, u32)>,
}

/// A finished plan's own counts, for callers that attribute them (prefix hits at prefill).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Distinct objects found Ready.
    pub ready: u64,
    /// Distinct objects loaded.
    pub loaded: u64,
    /// Distinct objects found Loading.
    pub joined: u64,
    /// Time blocked in `ready`, ns.
    pub exposed_wait_ns: u64,
}

/// A plan's resolve: its pins and loads (None: every page was kept), or "start over" after
/// making room took back kept pages the rows had read. (Returned once a plan and moved into
/// it: boxing the large variant would cost an allocation a plan.)
#[allow(clippy::large_enum_variant)]
pub(super) enum Resolution {
    Resolved(Option<Resolved>),
    StartOver,
}

#[derive(Debug)]
pub(super) struct Prefetch {
    pub(super) handle: PinHandleId,
    pub(super) pins: u64,
    /// Per request: (predicted pages, pages this prefetch loaded), both sorted.
    pub(super) rows: plan_steps::Predicted,
}

#[derive(Debug)]
pub(super) struct LayerPlan {
    pub(super) layer: u16,
    pub(super) rids: Vec<RequestId>,
    /// Per row: the serial of its request's state when planned (0: none). A request ended
    /// and started again under its id meanwhile has another: the plan's waits and failures
    /// are not the new one's.
    pub(super) serials: Vec<u64>,
    pub(super) handles: Vec<PinHandleId>,
    pub(super) prefetch: Option<Prefetch>,
    pub(super) keys: Vec<ObjectKey>,
    pub(super) key_row: Vec<u32>,
    /// Every cell naming a key but its first; the first is `key_cell`. The cells of neither
    /// read kept slots or are padding.
    pub(super) repeats: repeats::Repeats,
    /// Per key: the first cell that names it.
    pub(super) key_cell: Vec<u32>,
    /// Per key: the directory's object index.
    pub(super) indices: Vec<u32>,
    /// Kept-selection plans: their rows (`rows::KeptRows`).
    pub(super) rows: Option<rows::KeptRows>,
    /// Rows whose loads failed twice.
    pub(super) failed: Vec<u32>,
    /// The slot table, a row per request; None once taken (`take_table`).
    pub(super) table: Option<Vec<i32>>,
    /// The form its rows came in (padded or CSR, `plan_csr`): the table is in that form,
    /// and so are the cells `ready` reports.
    pub(super) form: RowForm,
    /// Per key: its slot (what its cells hold), kept when the table is taken.
    pub(super) key_slot: Vec<i32>,
    pub(super) transfers: Vec<TransferId>,
    pub(super) pins: u64,
    pub(super) submitted_at: Option<Instant>,
    pub(super) counts: PlanCounts,
    pub(super) ready: bool,
}

/// The batched, asynchronous decode-step scheduler. `T` is where its host copies live: a
/// host pool of its own ([`Plain`]) or the pages of a radix prefix cache
/// ([`PrefixTier`](super::PrefixTier), the joined scheduler). Each has the calls only it has.
pub struct StepScheduler<T: Tier = Plain> {
    pub(super) cfg: SchedulerConfig,
    pub(super) dir: Arc<Directory>,
    /// The engine, the bindings, and the copies in flight and queued.
    pub(super) xfer: Transfers,
    pub(super) token_bytes: u64,
    pub(super) requests: FxHashMap<RequestId, RequestState>,
    pub(super) plans: FxHashMap<LayerPlanId, LayerPlan>,
    pub(super) prefetches: FxHashMap<u16, Prefetch>,
    /// The next plan panics inside the core (an injected bug: `inject_internal_fault`).
    #[cfg(any(test, feature = "testing"))]
    pub(super) internal_fault: bool,
    /// Serial of the last batch named (a request at most once per batch).
    pub(super) batch: u64,
    pub(super) last_batch: Vec<RequestId>,
    /// Pins held by outstanding plans and prefetches.
    pub(super) pins: u64,
    pub(super) prefetch_pins: u64,
    pub(super) rec: StepRecord,
    pub(super) totals: StepRecord,
    pub(super) steps: u64,
    pub(super) dedup: RowDedup,
    pub(super) started: Instant,
    pub(super) failed_this_step: rustc_hash::FxHashSet<RequestId>,
    /// What only this kind of scheduler has (plain: stored prompts; joined: the prefix tier).
    pub(super) tier: T,
    /// Selections keep their pages pinned from one step to the next (`kept.rs`).
    pub(super) keep: bool,
    /// Pins held for kept pages.
    pub(super) kept_pins: u64,
    /// The kept lists, layer-major (`kept_store.rs`).
    pub(super) kept: KeptStore,
}

impl<T: Tier> std::fmt::Debug for StepScheduler<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepScheduler")
            .field("cfg", &self.cfg)
            .field("engine", &self.xfer.engine.name())
            .field("joined", &T::JOINED)
            .field("requests", &self.requests.len())
            .field("plans", &self.plans.len())
            .finish()
    }
}

impl<T: Tier> StepScheduler<T> {
    pub(super) fn assemble(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host: PageTransferBinding,
        engine: Arc<dyn CopyEngine>,
        tier: T,
    ) -> Result<Self> {
        let object_bytes = device.page_bytes() * device.planes_per_layer() as u64;
        let dir = Directory::new(DirectoryConfig {
            device_pages: cfg.device_pages,
            device_reserve: cfg.device_reserve,
            // Joined: every object's host copy is at its home; the directory's own host
            // allocator is left unused.
            host_pages: if T::JOINED { 1 } else { cfg.host_pages },
            host_reserve: 0,
            object_bytes,
        })?;
        Ok(StepScheduler {
            token_bytes: object_bytes / u64::from(cfg.page_size),
            cfg,
            dir: Arc::new(dir),
            xfer: Transfers::new(engine, device, host),
            requests: FxHashMap::default(),
            plans: FxHashMap::default(),
            prefetches: FxHashMap::default(),
            #[cfg(any(test, feature = "testing"))]
            internal_fault: false,
            batch: 0,
            last_batch: Vec::new(),
            pins: 0,
            prefetch_pins: 0,
            rec: StepRecord::default(),
            totals: StepRecord::default(),
            steps: 0,
            dedup: RowDedup::default(),
            started: Instant::now(),
            failed_this_step: rustc_hash::FxHashSet::default(),
            tier,
            keep: true,
            kept_pins: 0,
            kept: KeptStore::new(cfg.layers as usize),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The directory (for stats and checks; the scheduler makes every transition).
    pub fn directory(&self) -> &Arc<Directory> {
        &self.dir
    }

    /// The copy engine.
    pub fn engine(&self) -> &Arc<dyn CopyEngine> {
        &self.xfer.engine
    }

    /// Bytes of one object (one page of one layer, every plane).
    pub fn object_bytes(&self) -> u64 {
        self.xfer.object_bytes()
    }

    /// Requests running.
    pub fn requests(&self) -> impl Iterator<Item = &RequestState> {
        self.requests.values()
    }

    /// The pages request `id`'s last selection of `layer` kept pinned, sorted by page (None:
    /// not running, or no such layer).
    pub fn kept_pages(&self, id: RequestId, layer: u16) -> Option<&[Kept]> {
        let r = self.requests.get(&id)?;
        (layer < self.cfg.layers).then(|| self.kept.list(layer as usize, r.kept_slot))
    }

    /// One running request's block state.
    pub fn request(&self, id: RequestId) -> Option<&RequestState> {
        self.requests.get(&id)
    }

    /// Cumulative record: every finished step, plus what happened since the last one.
    pub fn totals(&self) -> StepRecord {
        let mut t = self.totals;
        t.fold(&self.rec);
        t
    }

    /// Loads and backups in flight (tracked here, not yet settled).
    pub fn in_flight(&self) -> (usize, usize) {
        self.xfer.in_flight()
    }

    /// Outstanding layer plans and prefetches.
    pub fn outstanding(&self) -> (usize, usize) {
        (self.plans.len(), self.prefetches.len())
    }

    // -- requests -----------------------------------------------------------------------

    /// Appends `tokens` prefilled tokens to request `id` (chunked prefill): returns the first
    /// page they touch and the slots of every page they touch, layer-major (`[layer][page]`),
    /// allocating the new pages for every layer in one call. The caller writes every layer's
    /// rows before its next `extend`, `append` or `end_step` (a layer's plan may come between);
    /// pages that fill are written through after that.
    pub fn extend(&mut self, id: RequestId, tokens: u64) -> Result<(u32, Vec<SlotId>)> {
        self.no_device_step("extend")?;
        let ps = u64::from(self.cfg.page_size);
        let layers = self.cfg.layers;
        let r = self
            .requests
            .get(&id)
            .ok_or_else(|| Error::config("rid", id, "a running request"))?;
        if tokens == 0 {
            return Err(Error::config("tokens", 0, "an integer >= 1"));
        }
        let (len, end) = (r.len, r.len.saturating_add(tokens));
        // The chunks extended before are written by now: their filled pages may go through.
        self.xfer.pending.append(&mut self.xfer.filled);
        // Refuse what the device can never hold before building one key per page and layer.
        let new_pages = end.div_ceil(ps) - len / ps;
        self.check_fits("tokens", tokens, new_pages)?;
        let first = (len / ps) as u32;
        let partial = len % ps != 0;
        let fresh_from = first + u32::from(partial);
        let last = end.div_ceil(ps) as u32;
        let tail = r.tail.clone();
        let (keys, fresh) = if fresh_from < last {
            T::start_pages(self, &[(id, fresh_from..last)])?
        } else {
            (Vec::new(), Vec::new())
        };
        let per = (last - fresh_from) as usize;
        let touched = (last - first) as usize;
        if !keys.is_empty() {
            let idx = self.dir.index_of(&keys);
            let r = self.requests.get_mut(&id).expect("checked above");
            for l in 0..layers {
                let at = l as usize * per;
                r.set_index(l, fresh_from..last, &idx[at..at + per]);
            }
        }
        let mut slots = Vec::with_capacity(touched * layers as usize);
        for l in 0..layers as usize {
            if partial {
                slots.push(tail[l]);
            }
            slots.extend_from_slice(&fresh[l * per..(l + 1) * per]);
        }
        let r = self.requests.get_mut(&id).expect("checked above");
        r.len = end;
        let full_to = (end / ps) as u32;
        // The caller writes this chunk's rows layer by layer, calling in between (a layer's
        // plan may make room, which writes pending pages through and lets them be evicted):
        // its pages that fill wait in `filled` until its next extend, append or end_step.
        for l in 0..layers {
            for p in first..full_to {
                self.xfer.filled.push(r.key(p, l));
            }
        }
        r.tail.clear();
        if end % ps != 0 {
            let last_i = touched - 1;
            r.tail
                .extend((0..layers as usize).map(|l| slots[l * touched + last_i]));
        }
        Ok((first, slots))
    }

    /// Refuses `pages` new pages (for every layer) that exceed the usable device slots: they
    /// could never be allocated at once, and building their keys could exhaust memory.
    pub(super) fn check_fits(
        &self,
        field: &str,
        value: impl std::fmt::Display,
        pages: u64,
    ) -> Result<()> {
        let usable = u64::from(self.cfg.device_pages - self.cfg.device_reserve);
        let need = pages.saturating_mul(u64::from(self.cfg.layers));
        if need > usable {
            return Err(Error::config(
                field,
                value,
                format!(
                    "a size whose new pages x {} layers fit the {usable} usable device slots \
                     ({need} needed)",
                    self.cfg.layers
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn request_mut(&mut self, id: RequestId, batch: u64) -> Result<&mut RequestState> {
        mark_batch(&mut self.requests, id, batch)
    }

    /// Allocates, and when the device is full of pages not yet written through, backs them up
    /// and settles first (the caller wrote them before this call, by contract).
    pub(super) fn allocate_with_room(
        &mut self,
        keys: &[ObjectKey],
        homes: Option<&[HostSlotId]>,
    ) -> Result<Vec<SlotId>> {
        let alloc = |dir: &Directory| match homes {
            Some(h) => dir.allocate_homed(keys, h),
            None => dir.allocate(keys),
        };
        match alloc(&self.dir) {
            Err(e @ Error::OutOfSlots { .. }) => {
                if !self.reclaim_for(&e)? {
                    self.make_room()?;
                }
                alloc(&self.dir)
            }
            r => r,
        }
    }

    /// After `err`, a device `OutOfSlots`: frees what the call lacked from what the tier
    /// keeps on the device for itself (the device resolver's pool), when it can. Returns
    /// whether it did (the call may then be retried without making room).
    pub(super) fn reclaim_for(&mut self, err: &Error) -> Result<bool> {
        let Error::OutOfSlots {
            tier: "device",
            requested,
            free,
            evictable,
        } = *err
        else {
            return Ok(false);
        };
        let short = requested.saturating_sub(free + evictable);
        Ok(short > 0 && T::reclaim(self, short)? >= short)
    }

    /// Resolves a plan's new keys (none when every page was kept): pins them and plans the
    /// loads of the absent. When the device is full it makes room, kept pages included, and
    /// resolves again; but a plan whose rows read kept lists (`read_kept`: a hit, or a page a
    /// row dropped) must start over, since making room gave those pages back.
    pub(super) fn resolve_rows(
        &mut self,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
        needed_bytes: u64,
        read_kept: bool,
    ) -> Result<Resolution> {
        if keys.is_empty() {
            return Ok(Resolution::Resolved(None));
        }
        T::adopt_own(self, keys, hints)?;
        match self.dir.resolve_hinted(keys, hints, Some(needed_bytes)) {
            Err(e @ Error::OutOfSlots { .. }) => {
                if self.reclaim_for(&e)? {
                    let r = self.dir.resolve_hinted(keys, hints, Some(needed_bytes))?;
                    return Ok(Resolution::Resolved(Some(r)));
                }
                self.make_room()?;
                if read_kept {
                    return Ok(Resolution::StartOver);
                }
                let r = self.dir.resolve_hinted(keys, hints, Some(needed_bytes))?;
                Ok(Resolution::Resolved(Some(r)))
            }
            r => Ok(Resolution::Resolved(Some(r?))),
        }
    }

    /// What the device can give back when full: pages written but not yet through to host
    /// (written through and settled here, so they become evictable) and the pins of
    /// outstanding prefetches (best effort: dropped, their loads still settle).
    pub(super) fn make_room(&mut self) -> Result<()> {
        // A write-through that fails here is retried once more at once.
        for _ in 0..2 {
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
            if self.xfer.retry.is_empty() {
                break;
            }
        }
        let held: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in held {
            self.drop_prefetch(l)?;
            self.rec.prefetch_skipped += 1;
        }
        self.release_all_kept()?;
        T::make_room(self)?;
        // Loads nobody pins any more still hold their slots until settled.
        self.xfer.wait_loads();
        self.poll()
    }

    // -- the step -----------------------------------------------------------------------

    /// Starts a step for `rids`: returns, per request, the device slot of its new token's page
    /// at every layer (`[B][layers]`) and the row inside that page (`[B]`). A request whose
    /// token starts a page gets that page allocated for every layer, in one allocation for the
    /// batch. The caller writes layer l's rows any time before `end_step`: a page this token
    /// fills is written through only then.
    pub fn append(&mut self, rids: &[RequestId]) -> Result<(Vec<SlotId>, Vec<u32>)> {
        self.no_device_step("append")?;
        let t0 = Instant::now();
        // The prefill chunks extended before this step are written by now.
        self.xfer.pending.append(&mut self.xfer.filled);
        self.batch += 1;
        let batch = self.batch;
        let layers = self.cfg.layers;
        let ps = u64::from(self.cfg.page_size);
        let mut starts = Vec::new();
        for &id in rids {
            let r = self.request_mut(id, batch)?;
            if r.len % ps == 0 {
                let page = (r.len / ps) as u32;
                starts.push((id, page..page + 1));
            }
        }
        if !starts.is_empty() {
            let (fresh, slots) = T::start_pages(self, &starts)?;
            let idx = self.dir.index_of(&fresh);
            let mut at = 0;
            for id in rids {
                let r = self.requests.get_mut(id).expect("checked above");
                if r.len % ps == 0 {
                    let page = (r.len / ps) as u32;
                    r.tail.clear();
                    r.tail.extend_from_slice(&slots[at..at + layers as usize]);
                    for l in 0..layers {
                        r.set_index(
                            l,
                            page..page + 1,
                            &idx[at + l as usize..at + l as usize + 1],
                        );
                    }
                    at += layers as usize;
                }
            }
        }
        let mut slots = Vec::with_capacity(rids.len() * layers as usize);
        let mut rows = Vec::with_capacity(rids.len());
        for id in rids {
            let r = self.requests.get_mut(id).expect("checked above");
            slots.extend_from_slice(&r.tail);
            rows.push((r.len % ps) as u32);
            r.len += 1;
            if r.len % ps == 0 {
                // Layer l's row is written when layer l runs: the page may be written
                // through only once the step ends.
                let page = (r.len / ps - 1) as u32;
                for l in 0..layers {
                    self.xfer.filled.push(r.key(page, l));
                }
            }
        }
        self.last_batch.clear();
        self.last_batch.extend_from_slice(rids);
        self.rec.requests += rids.len() as u64;
        let cpu = ns(t0.elapsed());
        self.rec.cpu_append_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok((slots, rows))
    }

    /// Plans `layer` for the batch `rids`: `selection` is `[B][k]` entries (-1 = none) of
    /// `unit` tokens each. One directory resolve for the whole batch, one load submission for
    /// every miss. Returns the plan and its slot table, `[B][k * pages_per_entry]` device
    /// slots, -1 where an entry names nothing.
    pub fn plan(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[i64],
        k: usize,
        unit: SelectionUnit,
    ) -> Result<(LayerPlanId, &[i32])> {
        self.plan_counted(layer, rids, selection, k, unit, None)
    }

    /// [`plan`](Self::plan) of page rows (`unit` = the page size) that say, per entry, how
    /// many selected tokens its page holds (`counts`, `[B][k]`, 1 to the page's tokens where
    /// the entry names a page): token mode with its tokens mapped to pages and deduplicated
    /// where they were selected (the GPU), so the core sees pages, not tokens. Bytes needed,
    /// read amplification and the selected count are the tokens'; the table is per page.
    /// Entries are int64 or int32 ([`Entry`](super::Entry): int32 rows are half the bytes).
    pub fn plan_counted<E: super::Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        k: usize,
        unit: SelectionUnit,
        counts: Option<&[u32]>,
    ) -> Result<(LayerPlanId, &[i32])> {
        self.no_device_step("plan")?;
        if selection.len() != rids.len() * k {
            return Err(Error::config(
                "selection",
                format!("{} entries", selection.len()),
                format!("{} x {k}: one row of k per request", rids.len()),
            ));
        }
        let form = RowForm::Padded {
            k,
            ppe: unit.pages_per_entry(),
        };
        self.plan_rows(layer, rids, selection, form, unit, counts)
    }

    /// A plan of rows in either form (padded `[B, k]` or CSR): the one path of
    /// [`plan_counted`](Self::plan_counted) and [`plan_csr`](Self::plan_csr). Its steps: the
    /// rows (keys, hints, the slot table's kept cells), the resolve (pins and loads), the
    /// record, then the commit (submit, place the slots, hand out the plan).
    pub(super) fn plan_rows<E: super::Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        form: RowForm,
        unit: SelectionUnit,
        counts: Option<&[u32]>,
    ) -> Result<(LayerPlanId, &[i32])> {
        let t0 = Instant::now();
        plan_steps::check_args(&self.cfg, layer, selection.len(), unit, counts)?;
        let rows = self.build_rows(layer, rids, selection, form.rows_in(), unit, counts)?;
        let t_rows = Instant::now();
        self.rec.cpu_rows_ns += ns(t_rows - t0);
        let needed_bytes =
            rows.needed.iter().map(|&n| u64::from(n)).sum::<u64>() * self.token_bytes;
        let read_kept =
            rows.kept_hits > 0 || (rows.kept_rows.as_ref()).is_some_and(|k| !k.dropped.is_empty());
        let res = match self.resolve_rows(&rows.keys, &rows.hints, needed_bytes, read_kept)? {
            Resolution::Resolved(res) => res,
            Resolution::StartOver => {
                // This attempt's time counts; the plan starts over.
                self.rec.cpu_resolve_ns += ns(t_rows.elapsed());
                let cpu = ns(t0.elapsed());
                self.rec.cpu_plan_ns += cpu;
                self.rec.cpu_ns += cpu;
                return self.plan_rows(layer, rids, selection, form, unit, counts);
            }
        };
        self.rec.cpu_resolve_ns += ns(t_rows.elapsed());
        // Everything below commits: the resolve pinned the batch.
        let id = self.commit_plan(t0, layer, rids, form, rows, res, needed_bytes)?;
        let cpu = ns(t0.elapsed());
        self.rec.cpu_plan_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok((id, self.plans[&id].table.as_deref().unwrap_or_default()))
    }

    /// A plan's rows: with kept selections a page the row kept is read from its kept slot,
    /// without a directory call (`kept.rs` for page rows, `kept_entries.rs` for entries of a
    /// page or less); else every selected page is resolved (`rows.rs`).
    fn build_rows<E: super::Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        rows_in: RowsIn<'_>,
        unit: SelectionUnit,
        counts: Option<&[u32]>,
    ) -> Result<Rows> {
        self.batch += 1;
        let batch = self.batch;
        let fast = self.keeps(layer, unit);
        let rows = if fast && unit.unit() == self.cfg.page_size {
            // Block rows compile without the counts' checks (the hot path).
            match counts {
                Some(c) => self.kept_rows::<true, E>(layer, rids, selection, rows_in, c, batch)?,
                None => self.kept_rows::<false, E>(layer, rids, selection, rows_in, &[], batch)?,
            }
        } else if fast {
            self.kept_entry_rows(layer, rids, selection, rows_in, unit, batch)?
        } else {
            self.selection_rows(layer, rids, selection, rows_in, unit, counts, batch)?
        };
        if rows.keys.is_empty() && rows.kept_hits == 0 {
            return Err(Error::config(
                match rows_in {
                    RowsIn::Padded(_) => "selection",
                    RowsIn::Csr(_) => "entries",
                },
                "no entry naming a page",
                "at least one selected block or token (the sink block is always read)",
            ));
        }
        Ok(rows)
    }

    /// Kept hits on matched prefix pages that name an object counted already: kept by an
    /// earlier row of the plan, or resolved for another row.
    fn shared_kept_repeats(&self, rids: &[RequestId], kr: &KeptRows, res: &Resolved) -> u64 {
        let mut objs = Vec::new();
        let mut start = 0;
        for (b, &end) in kr.ends.iter().enumerate() {
            let end = end as usize;
            let matched = self.requests.get(&rids[b]).map_or(0, |r| r.matched);
            if matched > 0 {
                objs.extend(
                    kr.lists[start..end]
                        .iter()
                        .filter(|k| k.page < matched && k.object != u32::MAX)
                        .map(|k| k.object),
                );
            }
            start = end;
        }
        if objs.len() < 2 && res.indices.is_empty() {
            return 0;
        }
        objs.sort_unstable();
        let all = objs.len();
        objs.dedup();
        let mut repeats = (all - objs.len()) as u64;
        if !objs.is_empty() {
            let mut resolved = res.indices.clone();
            resolved.sort_unstable();
            resolved.dedup();
            repeats += resolved
                .iter()
                .filter(|i| objs.binary_search(i).is_ok())
                .count() as u64;
        }
        repeats
    }

    /// Commits a resolved plan: counts it, submits its load, places the resolved slots in
    /// its table, keeps the plan and prefetches ahead.
    #[allow(clippy::too_many_arguments)]
    fn commit_plan(
        &mut self,
        t0: Instant,
        layer: u16,
        rids: &[RequestId],
        form: RowForm,
        rows: Rows,
        res: Option<Resolved>,
        needed_bytes: u64,
    ) -> Result<LayerPlanId> {
        let Rows {
            keys,
            key_row,
            key_cell,
            needed,
            from_prefix,
            mut table,
            repeats,
            rows_pages,
            kept_rows,
            selected,
            kept_hits,
            kept_needed,
            ..
        } = rows;
        // Every page kept: no directory call, no handle.
        let handles: Vec<PinHandleId> = res.iter().map(|r| r.handle).collect();
        let res = res.unwrap_or_else(plan_steps::nothing_resolved);
        if T::JOINED {
            let key_rids: Vec<RequestId> = key_row.iter().map(|&b| rids[b as usize]).collect();
            T::count_loads(self, layer, &keys, &res.loaded, &from_prefix, &key_rids);
        }
        let prefetch = self.prefetches.remove(&layer);
        let needed_bytes = needed_bytes + kept_needed * self.token_bytes;
        // A prefix object several rows keep (or one keeps and another resolves) is one object.
        let shared = match &kept_rows {
            Some(kr) if T::JOINED && kept_hits > 0 => self.shared_kept_repeats(rids, kr, &res),
            _ => 0,
        };
        let (mut rec, counts) = plan_steps::plan_record(&res.metrics, kept_hits - shared, selected);
        rec.bytes_needed = needed_bytes;
        // Prefetch accuracy: the prediction against the selection, row by row. A kept-selection
        // plan's prediction is its kept pages (last step's selection, held on the device, not
        // loaded again), plus what a prefetch predicted of the rest (pages given back to make
        // room, or a layer whose last plan did not keep): the two never share a page.
        let rows_pages = match (&kept_rows, &prefetch) {
            (Some(kr), Some(_)) => kept::rows_pages(kr),
            _ => rows_pages,
        };
        if let (Some(kr), true) = (&kept_rows, self.cfg.prefetch) {
            rec.prefetch_predicted += kept_hits + kr.dropped.len() as u64;
            rec.prefetch_hits += kept_hits;
        }
        // Needed tokens inside the pages moved for this plan: its loads and the prefetch
        // loads its rows read.
        let moved = plan_steps::Moved {
            rids,
            rows_pages: &rows_pages,
            needed: &needed,
            loaded: &res.loaded,
        };
        let pf_rows = prefetch.as_ref().map(|pf| &pf.rows);
        let needed_moved = plan_steps::score_moved(&moved, pf_rows, self.object_bytes(), &mut rec);
        rec.bytes_needed_of_transferred = needed_moved * self.token_bytes;
        // The next prediction: this step's distinct pages, sorted, for prefetch (a
        // kept-selection plan's are its rows' next kept lists, settled at finish).
        if self.cfg.prefetch && kept_rows.is_none() {
            plan_steps::remember_selection(&mut self.requests, rids, layer, &rows_pages);
        }
        let t_submit = Instant::now();
        let transfers = self.xfer.submit_resolved(&self.dir, &res, layer, &mut rec);
        #[cfg(any(test, feature = "testing"))]
        if std::mem::take(&mut self.internal_fault) {
            crate::guard::injected_panic("injected internal fault in plan");
        }
        let submitted_at = (!res.loads.is_empty()).then(Instant::now);
        rec.cpu_submit_ns = ns(t_submit.elapsed());
        let key_slot: Vec<i32> = res.slots.iter().map(|s| s.raw() as i32).collect();
        plan_steps::place_slots(&mut table, &key_cell, &repeats, &key_slot);
        let pins = res.metrics.distinct;
        self.pins += pins;
        self.rec.pinned_peak = self.rec.pinned_peak.max(self.pins + self.kept_pins);
        let id = LayerPlanId::new(crate::ids::serial());
        rec.queue_ns = submitted_at.map_or(0, |s| (s - t0).as_nanos() as u64);
        rec.selection_done_ns = self.since(t0);
        rec.submitted_ns = submitted_at.map_or(0, |s| self.since(s));
        let serials = rids
            .iter()
            .map(|r| self.requests.get(r).map_or(0, |s| s.serial))
            .collect();
        self.plans.insert(
            id,
            LayerPlan {
                layer,
                rids: rids.to_vec(),
                serials,
                handles,
                prefetch,
                keys,
                key_row,
                repeats,
                key_cell,
                indices: res.indices,
                rows: kept_rows,
                failed: Vec::new(),
                table: Some(table),
                form,
                key_slot,
                transfers,
                pins,
                submitted_at,
                counts,
                ready: false,
            },
        );
        self.rec.fold(&rec);
        if self.cfg.prefetch {
            let ahead = layer + self.cfg.prefetch_depth;
            if ahead < self.cfg.layers {
                let rids = rids.to_vec();
                self.prefetch(ahead, &rids)?;
            }
        }
        Ok(id)
    }

    /// [`plan_counted`](Self::plan_counted) of rows given as CSR (`csr.rs`): row `b`'s
    /// entries are `entries[offsets[b]..offsets[b + 1]]` (and its counts the same range of
    /// `counts`). The slot table comes back in the same form: each entry's cells, row after
    /// row. An entry or count out of range is named by its place in `entries`
    /// (`entries[n]`, `counts[n]`).
    pub fn plan_csr<E: super::Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        offsets: &[i64],
        entries: &[E],
        unit: SelectionUnit,
        counts: Option<&[u32]>,
    ) -> Result<(LayerPlanId, &[i32])> {
        self.no_device_step("plan_csr")?;
        let csr = csr::Csr::check(
            rids.len(),
            offsets,
            entries.len(),
            counts,
            unit.pages_per_entry(),
        )?;
        self.plan_rows(layer, rids, entries, RowForm::Csr(csr), unit, counts)
    }

    pub(super) fn since(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.started).as_nanos() as u64
    }

    /// The slot table of an outstanding plan.
    pub fn table(&self, id: LayerPlanId) -> Result<&[i32]> {
        self.plan_ref(id)?.table.as_deref().ok_or_else(|| {
            Error::config(
                "plan",
                id,
                "a plan whose table was not taken (take_table hands it over)",
            )
        })
    }

    /// Hands over the slot table of an outstanding plan, without a copy (token mode's are
    /// half a megabyte a layer at DeepSeek-V3.2's shape). The plan keeps each key's slot, so
    /// `finish` does not need it; a retry in `ready` then reports the cells it moved
    /// ([`ReadyOutcome::moved`]) for the caller to apply.
    pub fn take_table(&mut self, id: LayerPlanId) -> Result<Vec<i32>> {
        let plan = self
            .plans
            .get_mut(&id)
            .ok_or_else(|| Error::config("plan", id, "an outstanding layer plan (not finished)"))?;
        plan.table
            .take()
            .ok_or_else(|| Error::config("plan", id, "a plan whose table was not taken yet"))
    }

    pub(super) fn plan_ref(&self, id: LayerPlanId) -> Result<&LayerPlan> {
        self.plans
            .get(&id)
            .ok_or_else(|| Error::config("plan", id, "an outstanding layer plan (not finished)"))
    }

    /// Releases the plan's pins (and the prefetch it consumed) and folds its metrics.
    pub fn finish(&mut self, id: LayerPlanId) -> Result<PlanCounts> {
        let t0 = Instant::now();
        let mut plan = self
            .plans
            .remove(&id)
            .ok_or_else(|| Error::config("plan", id, "an outstanding layer plan (not finished)"))?;
        self.refresh_kept(&mut plan)?;
        for h in &plan.handles {
            self.dir.release(*h)?;
        }
        self.pins -= plan.pins;
        if let Some(pf) = plan.prefetch {
            self.dir.release(pf.handle)?;
            self.pins -= pf.pins;
            self.prefetch_pins -= pf.pins;
        }
        self.rec.layers += 1;
        self.rec.consumed_ns = self.since(Instant::now());
        let cpu = ns(t0.elapsed());
        self.rec.cpu_finish_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok(plan.counts)
    }

    /// Ends the step: writes through every page that filled (one backup submission), settles
    /// finished transfers, releases prefetches no plan consumed, issues the next step's first
    /// prefetches, and returns the step's record; or, when the tier's end of the step failed
    /// (a device step's log that never came back, selections it refused), that error, the
    /// step ended all the same (its record folded into the totals). While a layer plan is
    /// open the step does not end: a config error, nothing changed.
    pub fn end_step(&mut self) -> Result<StepRecord> {
        // A plan left open would hold its pins into the next step, and this step's record
        // would not count its layer.
        if !self.plans.is_empty() {
            return Err(Error::config(
                "plans",
                format!("{} still open", self.plans.len()),
                "none: finish every layer plan of the step before end_step",
            ));
        }
        let t0 = Instant::now();
        self.xfer.pending.append(&mut self.xfer.filled);
        let before = self.submit_pending_backups().and_then(|()| self.poll());
        // The tier's error (a device step's log that never came back, cells it refused) is
        // the step's, returned once the step has ended: its counts are in the totals. (So is
        // a failed submission's: the tier ends its step all the same, or the device step would
        // stay open, its victims pinned.)
        let tier = before.and(T::end_step(self));
        let stale: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in stale {
            if let Err(e) = self.drop_prefetch(l) {
                tier?; // (the tier's error first: it came first)
                return Err(e);
            }
        }
        if self.cfg.prefetch {
            let rids = std::mem::take(&mut self.last_batch);
            let rids: Vec<RequestId> = rids
                .into_iter()
                .filter(|r| self.requests.contains_key(r))
                .collect();
            for l in 0..self.cfg.prefetch_depth.min(self.cfg.layers) {
                self.prefetch(l, &rids)?;
            }
            self.last_batch = rids;
        }
        let (used, capacity) = self.dir.device_usage();
        self.rec.device_used = used as u64;
        self.rec.device_capacity = capacity as u64;
        self.rec.step = self.steps;
        let cpu = ns(t0.elapsed());
        self.rec.cpu_end_step_ns += cpu;
        self.rec.cpu_ns += cpu;
        self.dir.journal_step();
        let rec = std::mem::take(&mut self.rec);
        self.failed_this_step.clear();
        self.totals.fold(&rec);
        self.steps += 1;
        self.rec.pinned_peak = self.pins;
        self.rec.prefetch_pinned_peak = self.prefetch_pins;
        tier.map(|()| rec)
    }

    /// Writes through what filled, waits for every transfer in flight and settles it,
    /// releases prefetches; what a caller does between steps before dropping the pools.
    pub fn drain(&mut self) -> Result<()> {
        let stale: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in stale {
            self.drop_prefetch(l)?;
        }
        // Between steps every row is written: what filled goes through now.
        self.xfer.pending.append(&mut self.xfer.filled);
        self.submit_pending_backups()?;
        self.xfer.wait_loads();
        self.wait_backups();
        self.poll()?;
        // A retry queued by a failed backup gets one more try here.
        if !self.xfer.retry.is_empty() {
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
        }
        T::drain(self)
    }

    /// Refuses `call` while a device step is open: the step's later layers may still read any
    /// slot its mirror names (nothing the device reads is pinned), so nothing may take a
    /// device slot, or free a page, until `end_step`.
    pub(super) fn no_device_step(&self, call: &str) -> Result<()> {
        if self.tier.device_step_open() {
            return Err(Error::config(
                "step",
                format!("a device step open ({call} called in it)"),
                "no device step open: end_step first",
            ));
        }
        Ok(())
    }

    /// Settles every finished load and backup (complete, or fail and retry a backup once).
    pub fn poll(&mut self) -> Result<()> {
        self.xfer.poll(&self.dir, &mut self.rec)
    }

    /// Blocks until every backup in flight has finished (used when the device is full of
    /// pages that are not written through yet, and by shutdown).
    pub fn wait_backups(&self) {
        self.xfer.wait_backups();
    }

    /// Writes through the pages that filled and those whose backup failed.
    pub(super) fn submit_pending_backups(&mut self) -> Result<()> {
        self.xfer
            .submit_pending(&self.dir, &mut self.rec, T::JOINED)
    }

    /// Settles load `tid` if it is still tracked.
    pub(super) fn settle_load(&mut self, tid: TransferId) -> Result<()> {
        self.xfer.settle_load(&self.dir, tid, &mut self.rec)
    }
}

/// Marks request `id` as named by batch `batch`; refuses unknown ids and repeats in a batch.
pub(super) fn mark_batch(
    requests: &mut FxHashMap<RequestId, RequestState>,
    id: RequestId,
    batch: u64,
) -> Result<&mut RequestState> {
    let r = requests
        .get_mut(&id)
        .ok_or_else(|| Error::config("rids", id, "running requests"))?;
    if r.batch_mark == batch {
        return Err(Error::config(
            "rids",
            id,
            "each request at most once per batch",
        ));
    }
    r.batch_mark = batch;
    Ok(r)
}

/// Nanoseconds of `d`, saturated (a step's CPU split counts in u64 nanoseconds).
pub(super) fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
