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

use super::faults::ArmedFaults;
use super::kept_store::{KeptSlot, KeptStore, Run};
use super::plan_steps;
use super::prefix::{Finishing, PrefixTier, PrefixTotals};
use super::record::StepRecord;
use super::request::{Kept, Prefix, RequestState};
use super::selection::{RowDedup, SelectionUnit};
use crate::config::HitPolicy;
use crate::directory::{Directory, DirectoryConfig, LayerGroup, ObjectHint, ObjectKey, Resolved};
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, LayerPlanId, PageId, PinHandleId, RequestId, SlotId, TransferId};
use crate::radix::{HiCache, HiCacheConfig, PoolPair};
use crate::transfer::{
    CopyEngine, Direction, Granularity, LayerStatus, PageTransferBinding, PageTransferGroup,
    PageTransferMap, PreparedPageTransfer, TransferEvents,
};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "csr.rs"]
mod csr;
#[path = "joined.rs"]
mod joined;
#[path = "kept.rs"]
mod kept;
#[path = "kept_entries.rs"]
mod kept_entries;
#[path = "repeats.rs"]
mod repeats;
#[path = "rows.rs"]
mod rows;
use csr::{RowForm, RowsIn};
use rows::Rows;

const NONE: u32 = u32::MAX;
/// A slot-table cell read from the row's kept pages (the merge wrote its slot).
const KEPT: u32 = 1 << 31;

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
    /// rows are -1; the caller ends or restarts those requests.
    pub failed: Vec<(usize, RequestId, String)>,
    /// Whether a retry moved objects to other slots (the slot table changed).
    pub slots_changed: bool,
    /// The cells a retry moved, with their new slots (the failed rows' cells are not listed:
    /// they all become -1). What a caller that took the table (`take_table`) applies to it.
    pub moved: Vec<(u32, i32)>,
    /// Per failed row, its cells in the table (start, end): they all become -1.
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
enum Resolution {
    Resolved(Option<Resolved>),
    StartOver,
}

#[derive(Debug)]
struct Load {
    events: Arc<TransferEvents>,
}

#[derive(Debug)]
struct Backup {
    events: Arc<TransferEvents>,
    keys: Vec<ObjectKey>,
}

#[derive(Debug)]
struct Prefetch {
    handle: PinHandleId,
    pins: u64,
    /// Per request: (predicted pages, pages this prefetch loaded), both sorted.
    rows: plan_steps::Predicted,
}

#[derive(Debug)]
struct LayerPlan {
    layer: u16,
    rids: Vec<RequestId>,
    handles: Vec<PinHandleId>,
    prefetch: Option<Prefetch>,
    keys: Vec<ObjectKey>,
    key_row: Vec<u32>,
    /// Every cell naming a key but its first; the first is `key_cell`. The cells of neither
    /// read kept slots or are padding.
    repeats: repeats::Repeats,
    /// Per key: the first cell that names it.
    key_cell: Vec<u32>,
    /// Per key: the directory's object index.
    indices: Vec<u32>,
    /// Kept-selection plans: their rows (`rows::KeptRows`).
    rows: Option<rows::KeptRows>,
    /// Rows whose loads failed twice.
    failed: Vec<u32>,
    /// The slot table, a row per request; None once taken (`take_table`).
    table: Option<Vec<i32>>,
    /// The form its rows came in (padded or CSR, `plan_csr`): the table is in that form,
    /// and so are the cells `ready` reports.
    form: RowForm,
    /// Per key: its slot (what its cells hold), kept when the table is taken.
    key_slot: Vec<i32>,
    transfers: Vec<TransferId>,
    pins: u64,
    submitted_at: Option<Instant>,
    counts: PlanCounts,
    ready: bool,
}

/// The batched, asynchronous decode-step scheduler.
pub struct StepScheduler {
    cfg: SchedulerConfig,
    dir: Arc<Directory>,
    engine: Arc<dyn CopyEngine>,
    device: PageTransferBinding,
    host: PageTransferBinding,
    object_bytes: u64,
    token_bytes: u64,
    requests: FxHashMap<RequestId, RequestState>,
    prompts: FxHashMap<u64, u32>,
    prompt_index: FxHashMap<u64, Vec<Vec<ObjectHint>>>,
    loads: FxHashMap<TransferId, Load>,
    backups: FxHashMap<TransferId, Backup>,
    pending_backups: Vec<ObjectKey>,
    filled: Vec<ObjectKey>,
    retry_backups: Vec<ObjectKey>,
    plans: FxHashMap<LayerPlanId, LayerPlan>,
    prefetches: FxHashMap<u16, Prefetch>,
    faults: ArmedFaults,
    /// The next plan panics inside the core (an injected bug: [`Self::inject_internal_fault`]).
    internal_fault: bool,
    /// Injected copy-worker panics handed to the engine with a submission.
    batch: u64,
    last_batch: Vec<RequestId>,
    pins: u64,
    prefetch_pins: u64,
    rec: StepRecord,
    totals: StepRecord,
    steps: u64,
    dedup: RowDedup,
    started: Instant,
    failed_this_step: rustc_hash::FxHashSet<RequestId>,
    /// The joined mode's prefix tier (host pages owned by the prefix cache).
    prefix: Option<PrefixTier>,
    /// Selections keep their pages pinned from one step to the next (`kept.rs`).
    keep: bool,
    /// Pins held for kept pages.
    kept_pins: u64,
    /// The kept lists, layer-major (`kept_store.rs`).
    kept: KeptStore,
}

impl std::fmt::Debug for StepScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepScheduler")
            .field("cfg", &self.cfg)
            .field("engine", &self.engine.name())
            .field("requests", &self.requests.len())
            .field("plans", &self.plans.len())
            .finish()
    }
}

impl StepScheduler {
    /// A scheduler over one-layer KV pools whose pages are the objects' slots: `device` holds
    /// `device_pages` pages, `host` holds `host_pages`, both of `page_size` tokens.
    pub fn new(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host: PageTransferBinding,
        engine: Arc<dyn CopyEngine>,
    ) -> Result<Self> {
        if cfg.layers == 0 {
            return Err(Error::config("layers", 0, "an integer >= 1"));
        }
        if device.layers() != 1 || host.layers() != 1 {
            return Err(Error::config(
                "device/host bindings",
                format!("{} and {} layers", device.layers(), host.layers()),
                "one-layer KV pools: one page of them is one layer of one page of a request",
            ));
        }
        for (field, b, pages) in [
            ("device.pages", &device, cfg.device_pages),
            ("host.pages", &host, cfg.host_pages),
        ] {
            if b.pages() != pages {
                return Err(Error::config(field, b.pages(), format!("{pages}")));
            }
            if b.page_size() != cfg.page_size {
                return Err(Error::config(
                    "page_size",
                    b.page_size(),
                    format!("{}: the scheduler's page size", cfg.page_size),
                ));
            }
        }
        Self::assemble(cfg, device, host, engine, None)
    }

    /// A joined scheduler: main-KV objects live at the host pages of a radix prefix cache
    /// (`host_kv`, the group's multi-layer KV host pool, in either layout) and are loaded
    /// per layer into `device` slots as selections pick them; `sidecars` (Indexer-K, SWA,
    /// draft) are whole-page pools of `sidecar_device_pages` device pages, restored by the
    /// prefix cache on a hit (ALL_PAGES, or the SWA window) and written through when a request
    /// ends. `cfg.host_pages` is the group's host page count.
    pub fn joined(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host_kv: PageTransferBinding,
        sidecars: Vec<PoolPair>,
        sidecar_device_pages: u32,
        engine: Arc<dyn CopyEngine>,
    ) -> Result<Self> {
        if cfg.layers == 0 {
            return Err(Error::config("layers", 0, "an integer >= 1"));
        }
        if device.layers() != 1 || device.pages() != cfg.device_pages {
            return Err(Error::config(
                "device",
                format!("{} layers x {} pages", device.layers(), device.pages()),
                format!("a one-layer KV pool of {} slots", cfg.device_pages),
            ));
        }
        if host_kv.layers() != cfg.layers as usize
            || host_kv.pages() != cfg.host_pages
            || host_kv.page_size() != cfg.page_size
            || host_kv.planes_per_layer() != device.planes_per_layer()
            || host_kv.page_bytes() != device.page_bytes()
        {
            return Err(Error::config(
                "host_kv",
                format!(
                    "{} layers x {} pages of {} tokens",
                    host_kv.layers(),
                    host_kv.pages(),
                    host_kv.page_size()
                ),
                format!(
                    "the group's KV host pool: {} layers x {} pages of {} tokens, rows as the \
                     device slots'",
                    cfg.layers, cfg.host_pages, cfg.page_size
                ),
            ));
        }
        if sidecars.iter().any(|p| p.device.is_none()) {
            return Err(Error::config(
                "sidecars",
                "a pool without a device buffer",
                "Indexer-K / SWA / draft pools with device and host buffers",
            ));
        }
        let (flat, order) = host_kv.flatten_layers()?;
        let kv_page_bytes = host_kv.page_bytes() * host_kv.planes_per_layer() as u64;
        let mut pools = vec![PoolPair {
            device: None,
            host: host_kv,
            hit: HitPolicy::AllPages,
        }];
        pools.extend(sidecars.iter().cloned());
        let cache = HiCache::new(
            HiCacheConfig {
                page_size: cfg.page_size as usize,
                device_pages: sidecar_device_pages,
                device_reserve: 0,
                host_pages: cfg.host_pages,
                host_reserve: 0,
                drop_unbacked: false,
            },
            pools,
            Some(engine.clone()),
        )?;
        let tier = PrefixTier::new(
            cache,
            sidecars,
            order,
            cfg.host_pages,
            cfg.layers,
            cfg.page_size,
            kv_page_bytes,
        );
        Self::assemble(cfg, device, flat, engine, Some(tier))
    }

    fn assemble(
        cfg: SchedulerConfig,
        device: PageTransferBinding,
        host: PageTransferBinding,
        engine: Arc<dyn CopyEngine>,
        prefix: Option<PrefixTier>,
    ) -> Result<Self> {
        let object_bytes = device.page_bytes() * device.planes_per_layer() as u64;
        let dir = Directory::new(DirectoryConfig {
            device_pages: cfg.device_pages,
            device_reserve: cfg.device_reserve,
            // Joined: every object's host copy is at its home; the directory's own host
            // allocator is left unused.
            host_pages: if prefix.is_some() { 1 } else { cfg.host_pages },
            host_reserve: 0,
            object_bytes,
        })?;
        Ok(StepScheduler {
            token_bytes: object_bytes / u64::from(cfg.page_size),
            cfg,
            dir: Arc::new(dir),
            engine,
            device,
            host,
            object_bytes,
            requests: FxHashMap::default(),
            prompts: FxHashMap::default(),
            prompt_index: FxHashMap::default(),
            loads: FxHashMap::default(),
            backups: FxHashMap::default(),
            pending_backups: Vec::new(),
            filled: Vec::new(),
            retry_backups: Vec::new(),
            plans: FxHashMap::default(),
            prefetches: FxHashMap::default(),
            faults: ArmedFaults::default(),
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
            prefix,
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
        &self.engine
    }

    /// Bytes of one object (one page of one layer, every plane).
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
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
        (self.loads.len(), self.backups.len())
    }

    /// Outstanding layer plans and prefetches.
    pub fn outstanding(&self) -> (usize, usize) {
        (self.plans.len(), self.prefetches.len())
    }

    // -- requests -----------------------------------------------------------------------

    /// Stores a shared prefix of `pages` whole pages under `namespace`: its objects are
    /// allocated for every layer and returned layer-major (`[layer][page]`); the caller writes
    /// them before its next call, and they are written through to host at the next `end_step`.
    pub fn add_prompt(&mut self, namespace: u64, pages: u32) -> Result<Vec<SlotId>> {
        self.not_joined("add_prompt")?;
        if self.prompts.contains_key(&namespace)
            || self.requests.contains_key(&RequestId::new(namespace))
        {
            return Err(Error::config(
                "namespace",
                namespace,
                "a namespace no prompt or request uses",
            ));
        }
        if pages == 0 {
            return Err(Error::config("pages", 0, "an integer >= 1"));
        }
        self.check_fits("pages", pages, u64::from(pages))?;
        let keys: Vec<ObjectKey> = (0..self.cfg.layers)
            .flat_map(|l| {
                (0..pages).map(move |p| ObjectKey::new(namespace, 0, p, LayerGroup::Layer(l)))
            })
            .collect();
        let slots = self.allocate_with_room(&keys, None)?;
        let idx = self.dir.index_of(&keys);
        let per = pages as usize;
        self.prompt_index.insert(
            namespace,
            (0..self.cfg.layers as usize)
                .map(|l| idx[l * per..(l + 1) * per].to_vec())
                .collect(),
        );
        self.pending_backups.extend_from_slice(&keys);
        self.prompts.insert(namespace, pages);
        Ok(slots)
    }

    /// Whole pages of a stored prefix.
    pub fn prompt_pages(&self, namespace: u64) -> Option<u32> {
        self.prompts.get(&namespace).copied()
    }

    /// Ends a stored prefix; refused while a running request reads it.
    pub fn drop_prompt(&mut self, namespace: u64) -> Result<()> {
        if !self.prompts.contains_key(&namespace) {
            return Err(Error::config("namespace", namespace, "a stored prompt"));
        }
        if let Some(r) = self
            .requests
            .values()
            .find(|r| r.prefix.is_some_and(|p| p.namespace == namespace))
        {
            return Err(Error::config(
                "namespace",
                namespace,
                format!("a prompt no running request reads (request {} does)", r.id),
            ));
        }
        self.prompts.remove(&namespace);
        self.prompt_index.remove(&namespace);
        self.pending_backups.retain(|k| k.namespace.id != namespace);
        self.dir
            .drop_namespace(crate::directory::Namespace {
                id: namespace,
                version: 0,
            })
            .map(|_| ())
    }

    /// Admits request `id` with `tokens` tokens already prefilled, the first `prefix.pages`
    /// pages read from a stored prefix: registers it over the prefix, then [`Self::extend`]s
    /// it by the rest and returns those slots (`[layer][page]`, see `extend`).
    pub fn add_request(
        &mut self,
        id: RequestId,
        tokens: u64,
        prefix: Option<Prefix>,
    ) -> Result<Vec<SlotId>> {
        self.not_joined("add_request")?;
        if self.requests.contains_key(&id) || self.prompts.contains_key(&id.raw()) {
            return Err(Error::KeyExists {
                key: format!("request {id}"),
            });
        }
        let ps = u64::from(self.cfg.page_size);
        let from_prefix = prefix.map_or(0, |p| u64::from(p.pages) * ps);
        if let Some(p) = prefix {
            let stored = self.prompts.get(&p.namespace).copied().unwrap_or(0);
            if p.pages == 0 || p.pages > stored || from_prefix > tokens {
                return Err(Error::config(
                    "prefix",
                    format!("({}, {} pages)", p.namespace, p.pages),
                    format!(
                        "a stored prompt and 1..={} of its pages, no more than the request's \
                         {tokens} tokens cover",
                        stored.min((tokens / ps) as u32)
                    ),
                ));
            }
        }
        if tokens == 0 {
            return Err(Error::config("tokens", 0, "an integer >= 1"));
        }
        let layers = self.cfg.layers as usize;
        let mut state = RequestState::new(id, from_prefix, prefix, layers, self.kept.add());
        if let (Some(p), Some(t)) = (
            prefix,
            prefix.and_then(|p| self.prompt_index.get(&p.namespace)),
        ) {
            for (l, idx) in t.iter().enumerate() {
                state.set_index(l as u16, 0..p.pages, &idx[..p.pages as usize]);
            }
        }
        self.requests.insert(id, state);
        if tokens == from_prefix {
            return Ok(Vec::new());
        }
        match self.extend(id, tokens - from_prefix) {
            Ok((_, slots)) => Ok(slots),
            Err(e) => {
                let r = self.requests.remove(&id).expect("inserted above");
                self.release_kept_of(r.kept_slot)?;
                Err(e)
            }
        }
    }

    /// Appends `tokens` prefilled tokens to request `id` (chunked prefill): returns the first
    /// page they touch and the slots of every page they touch, layer-major (`[layer][page]`),
    /// allocating the new pages for every layer in one call. The caller writes the rows before
    /// its next call; pages that fill are written through at the next `end_step`.
    pub fn extend(&mut self, id: RequestId, tokens: u64) -> Result<(u32, Vec<SlotId>)> {
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
        // Refuse what the device can never hold before building one key per page and layer.
        let new_pages = end.div_ceil(ps) - len / ps;
        self.check_fits("tokens", tokens, new_pages)?;
        let first = (len / ps) as u32;
        let partial = len % ps != 0;
        let fresh_from = first + u32::from(partial);
        let last = end.div_ceil(ps) as u32;
        let tail = r.tail.clone();
        let (keys, fresh) = if fresh_from < last {
            self.start_pages(&[(id, fresh_from..last)])?
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
        for l in 0..layers {
            for p in first..full_to {
                self.pending_backups.push(r.key(p, l));
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

    /// Ends request `id`: its objects go now, or when the last pin or transfer touching them
    /// ends. Shared prefixes stay.
    pub fn finish_request(&mut self, id: RequestId) -> Result<()> {
        if self.prefix.is_some() {
            return self.end_request(id, None);
        }
        let Some(r) = self.requests.remove(&id) else {
            return Err(Error::config("rid", id, "a running request"));
        };
        self.release_kept_of(r.kept_slot)?;
        self.pending_backups.retain(|k| k.namespace.id != id.raw());
        self.filled.retain(|k| k.namespace.id != id.raw());
        self.retry_backups.retain(|k| k.namespace.id != id.raw());
        self.dir
            .drop_namespace(crate::directory::Namespace {
                id: id.raw(),
                version: 0,
            })
            .map(|_| ())
    }

    /// Refuses `pages` new pages (for every layer) that exceed the usable device slots: they
    /// could never be allocated at once, and building their keys could exhaust memory.
    fn check_fits(&self, field: &str, value: impl std::fmt::Display, pages: u64) -> Result<()> {
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

    fn not_joined(&self, what: &str) -> Result<()> {
        if self.prefix.is_some() {
            return Err(Error::config(
                "mode",
                "joined",
                format!(
                    "a scheduler without a prefix cache for {what} (a joined scheduler admits \
                     requests by their tokens: admit)"
                ),
            ));
        }
        Ok(())
    }

    /// Creates every layer's object of the pages `starts` name (per start, layer-major) on
    /// the device, returning their keys and slots. Joined: the pages first get host pages and
    /// Indexer-K device pages from the prefix cache, and their objects a home there.
    fn start_pages(
        &mut self,
        starts: &[(RequestId, std::ops::Range<u32>)],
    ) -> Result<(Vec<ObjectKey>, Vec<SlotId>)> {
        let layers = self.cfg.layers;
        let n: usize = starts.iter().map(|(_, r)| r.len()).sum();
        let mut taken: Option<(Vec<PageId>, Vec<PageId>)> = None;
        if let Some(p) = self.prefix.as_mut() {
            let host = p.alloc_host(&self.dir, n)?;
            let idx = match p.cache.alloc_device(n) {
                Ok(v) => v,
                Err(e) => {
                    p.cache.free_host(&host)?;
                    return Err(e);
                }
            };
            let homes = p.homes_of(&host);
            let mut at = 0;
            for (id, range) in starts {
                let r = self.requests.get_mut(id).expect("checked by the caller");
                debug_assert_eq!(r.homes.len(), range.start as usize);
                r.homes.extend_from_slice(&homes[at..at + range.len()]);
                r.idx_pages
                    .extend(idx[at..at + range.len()].iter().map(|p| p.raw()));
                at += range.len();
            }
            taken = Some((host, idx));
        }
        let mut keys = Vec::with_capacity(n * layers as usize);
        let mut homes: Vec<HostSlotId> = Vec::new();
        for (id, range) in starts {
            let r = &self.requests[id];
            for l in 0..layers {
                for page in range.clone() {
                    keys.push(r.key(page, l));
                    if let Some(p) = &self.prefix {
                        homes.push(p.home(r.homes[page as usize].0, l));
                    }
                }
            }
        }
        let got = if self.prefix.is_some() {
            self.allocate_with_room(&keys, Some(&homes))
        } else {
            self.allocate_with_room(&keys, None)
        };
        match got {
            Ok(slots) => Ok((keys, slots)),
            Err(e) => {
                if let (Some(p), Some((host, idx))) = (self.prefix.as_mut(), taken) {
                    for (id, range) in starts {
                        let r = self.requests.get_mut(id).expect("checked by the caller");
                        r.homes.truncate(range.start as usize);
                        r.idx_pages.truncate(range.start as usize);
                    }
                    p.cache.free_host(&host)?;
                    p.cache.free_device(&idx)?;
                }
                Err(e)
            }
        }
    }

    fn request_mut(&mut self, id: RequestId, batch: u64) -> Result<&mut RequestState> {
        mark_batch(&mut self.requests, id, batch)
    }

    /// Allocates, and when the device is full of pages not yet written through, backs them up
    /// and settles first (the caller wrote them before this call, by contract).
    fn allocate_with_room(
        &mut self,
        keys: &[ObjectKey],
        homes: Option<&[HostSlotId]>,
    ) -> Result<Vec<SlotId>> {
        let alloc = |dir: &Directory| match homes {
            Some(h) => dir.allocate_homed(keys, h),
            None => dir.allocate(keys),
        };
        match alloc(&self.dir) {
            Err(Error::OutOfSlots { .. }) => {
                self.make_room()?;
                alloc(&self.dir)
            }
            r => r,
        }
    }

    /// Resolves a plan's new keys (none when every page was kept): pins them and plans the
    /// loads of the absent. When the device is full it makes room, kept pages included, and
    /// resolves again; but a plan whose rows read kept lists (`read_kept`: a hit, or a page a
    /// row dropped) must start over, since making room gave those pages back.
    fn resolve_rows(
        &mut self,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
        needed_bytes: u64,
        read_kept: bool,
    ) -> Result<Resolution> {
        if keys.is_empty() {
            return Ok(Resolution::Resolved(None));
        }
        match self.dir.resolve_hinted(keys, hints, Some(needed_bytes)) {
            Err(Error::OutOfSlots { .. }) => {
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
    fn make_room(&mut self) -> Result<()> {
        // A write-through that fails here is retried once more at once.
        for _ in 0..2 {
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
            if self.retry_backups.is_empty() {
                break;
            }
        }
        let held: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in held {
            self.drop_prefetch(l)?;
            self.rec.prefetch_skipped += 1;
        }
        self.release_all_kept()?;
        // Loads nobody pins any more still hold their slots until settled.
        for ld in self.loads.values() {
            let _ = ld.events.wait_all(None);
        }
        self.poll()
    }

    // -- the step -----------------------------------------------------------------------

    /// Starts a step for `rids`: returns, per request, the device slot of its new token's page
    /// at every layer (`[B][layers]`) and the row inside that page (`[B]`). A request whose
    /// token starts a page gets that page allocated for every layer, in one allocation for the
    /// batch. The caller writes layer l's rows any time before `end_step`: a page this token
    /// fills is written through only then.
    pub fn append(&mut self, rids: &[RequestId]) -> Result<(Vec<SlotId>, Vec<u32>)> {
        let t0 = Instant::now();
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
            let (fresh, slots) = self.start_pages(&starts)?;
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
                    self.filled.push(r.key(page, l));
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
    /// [`plan_counted`](Self::plan_counted) and [`plan_csr`](Self::plan_csr).
    fn plan_rows<E: super::Entry>(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[E],
        form: RowForm,
        unit: SelectionUnit,
        counts: Option<&[u32]>,
    ) -> Result<(LayerPlanId, &[i32])> {
        let t0 = Instant::now();
        let rows_in = form.rows_in();
        plan_steps::check_args(&self.cfg, layer, selection.len(), unit, counts)?;
        self.batch += 1;
        let batch = self.batch;
        let ps = self.cfg.page_size;
        // Selections keep their pages pinned to the next step (`kept.rs`, `kept_entries.rs`):
        // a page the row kept is read from its kept slot, without a directory call.
        let fast = self.keeps(layer, unit);
        let Rows {
            keys,
            hints,
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
        } = if fast && unit.unit() == ps {
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
        let t_rows = Instant::now();
        self.rec.cpu_rows_ns += ns(t_rows - t0);
        if keys.is_empty() && kept_hits == 0 {
            return Err(Error::config(
                match rows_in {
                    RowsIn::Padded(_) => "selection",
                    RowsIn::Csr(_) => "entries",
                },
                "no entry naming a page",
                "at least one selected block or token (the sink block is always read)",
            ));
        }
        let needed_bytes: u64 =
            needed.iter().map(|&n| u64::from(n)).sum::<u64>() * self.token_bytes;
        let read_kept = kept_hits > 0 || kept_rows.as_ref().is_some_and(|k| !k.dropped.is_empty());
        let res = match self.resolve_rows(&keys, &hints, needed_bytes, read_kept)? {
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
        let needed_bytes = needed_bytes + kept_needed * self.token_bytes;
        // Every page kept: no directory call, no handle.
        let handles: Vec<PinHandleId> = res.iter().map(|r| r.handle).collect();
        let res = res.unwrap_or_else(|| Resolved {
            slots: Vec::new(),
            loads: Vec::new(),
            joined: Default::default(),
            handle: PinHandleId::new(0),
            metrics: Default::default(),
            loaded: Vec::new(),
            indices: Vec::new(),
        });
        // Everything below commits: the resolve pinned the batch.
        if self.prefix.is_some() {
            let key_rids: Vec<RequestId> = key_row.iter().map(|&b| rids[b as usize]).collect();
            self.count_prefix_loads(layer, &res.loaded, &from_prefix, &key_rids);
        }
        let prefetch = self.prefetches.remove(&layer);
        let mut rec = StepRecord {
            selected,
            pages: res.metrics.distinct + kept_hits,
            ready: res.metrics.ready + kept_hits,
            loaded: res.metrics.absent,
            joined: res.metrics.loading,
            bytes_needed: needed_bytes,
            ..Default::default()
        };
        let mut counts = PlanCounts {
            ready: res.metrics.ready + kept_hits,
            loaded: res.metrics.absent,
            joined: res.metrics.loading,
            exposed_wait_ns: 0,
        };
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
        let needed_moved = plan_steps::score_moved(&moved, pf_rows, self.object_bytes, &mut rec);
        rec.bytes_needed_of_transferred = needed_moved * self.token_bytes;
        // The next prediction: this step's distinct pages, sorted, for prefetch (a
        // kept-selection plan's are its rows' next kept lists, settled at finish).
        if self.cfg.prefetch && kept_rows.is_none() {
            for (b, id) in rids.iter().enumerate() {
                let r = self.requests.get_mut(id).expect("checked above");
                let last = &mut r.last_selection[layer as usize];
                last.clear();
                last.extend(rows_pages[b].iter().map(|&(p, _)| p));
            }
        }
        let t_submit = Instant::now();
        let transfers = self.submit_resolved(&res, layer, &mut rec);
        if std::mem::take(&mut self.internal_fault) {
            crate::guard::injected_panic("injected internal fault in plan");
        }
        let submitted_at = (!res.loads.is_empty()).then(Instant::now);
        rec.cpu_submit_ns = ns(t_submit.elapsed());
        // Kept cells hold their slots already: place the resolved keys' (a tenth of the cells
        // at decode's usual locality with kept selections), first cells and repeats.
        let key_slot: Vec<i32> = res.slots.iter().map(|s| s.raw() as i32).collect();
        debug_assert_eq!(table.len(), selection.len() * unit.pages_per_entry());
        for (key, &at) in key_cell.iter().enumerate() {
            table[at as usize] = key_slot[key];
        }
        repeats.place(&mut table, |key| key_slot[key]);
        let pins = res.metrics.distinct;
        self.pins += pins;
        self.rec.pinned_peak = self.rec.pinned_peak.max(self.pins + self.kept_pins);
        counts.loaded = res.metrics.absent;
        let id = LayerPlanId::new(crate::ids::serial());
        rec.queue_ns = submitted_at.map_or(0, |s| (s - t0).as_nanos() as u64);
        rec.selection_done_ns = self.since(t0);
        rec.submitted_ns = submitted_at.map_or(0, |s| self.since(s));
        self.plans.insert(
            id,
            LayerPlan {
                layer,
                rids: rids.to_vec(),
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
        let cpu = ns(t0.elapsed());
        self.rec.cpu_plan_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok((id, self.plans[&id].table.as_deref().unwrap_or_default()))
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
        let csr = csr::Csr::check(
            rids.len(),
            offsets,
            entries.len(),
            counts,
            unit.pages_per_entry(),
        )?;
        self.plan_rows(layer, rids, entries, RowForm::Csr(csr), unit, counts)
    }

    /// Joined mode: counts the main-KV bytes loaded for matched prefix pages, and those
    /// loaded for the first time in their request.
    fn count_prefix_loads(
        &mut self,
        layer: u16,
        loaded: &[bool],
        from_prefix: &[u32],
        key_rids: &[RequestId],
    ) {
        let Some(p) = self.prefix.as_mut() else {
            return;
        };
        let layers = self.cfg.layers as usize;
        for (i, (&l, &page)) in loaded.iter().zip(from_prefix).enumerate() {
            if !l || page == NONE {
                continue;
            }
            let Some(r) = self.requests.get_mut(&key_rids[i]) else {
                continue;
            };
            if page < r.restored_from {
                // Indexer-K was on the device: a whole-prefix restore moves nothing here.
                p.totals.device_part_kv_bytes_loaded += self.object_bytes;
                continue;
            }
            p.totals.prefix_kv_bytes_loaded += self.object_bytes;
            {
                let bit = page as usize * layers + layer as usize;
                let word = &mut r.prefix_seen[bit / 64];
                if *word & (1 << (bit % 64)) == 0 {
                    *word |= 1 << (bit % 64);
                    p.totals.prefix_kv_bytes_first += self.object_bytes;
                }
            }
        }
    }

    fn since(&self, t: Instant) -> u64 {
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

    fn plan_ref(&self, id: LayerPlanId) -> Result<&LayerPlan> {
        self.plans
            .get(&id)
            .ok_or_else(|| Error::config("plan", id, "an outstanding layer plan (not finished)"))
    }

    /// Makes the plan's data readable: on the cpu engine, waits for every transfer the plan
    /// depends on; with `stream` (a CUDA engine), makes that stream wait on the GPU instead.
    /// A failed load is retried once; rows still without their data are reported failed.
    pub fn ready(&mut self, id: LayerPlanId, stream: Option<u64>) -> Result<ReadyOutcome> {
        let t0 = Instant::now();
        let plan = self.plan_ref(id)?;
        if plan.ready {
            return Ok(ReadyOutcome::default());
        }
        let transfers = plan.transfers.clone();
        let mut waited = Duration::ZERO;
        let mut failed = false;
        for tid in &transfers {
            if let Some(ld) = self.loads.get(tid) {
                match stream {
                    Some(s) if !ld.events.is_finished() => {
                        self.engine.stream_wait(&ld.events, 0, s)?;
                        continue;
                    }
                    _ => {
                        let w = Instant::now();
                        let _ = ld.events.wait_all(None);
                        waited += w.elapsed();
                    }
                }
                self.settle_load(*tid)?;
            }
            failed |= matches!(self.dir.outcome(*tid), Ok(Some(Err(_))));
        }
        let mut out = ReadyOutcome::default();
        if failed {
            waited += self.recover(id, &mut out)?;
        }
        let plan = self.plans.get_mut(&id).expect("checked above");
        plan.ready = true;
        plan.counts.exposed_wait_ns = waited.as_nanos() as u64;
        if let Some(s) = plan.submitted_at {
            self.rec.transfer_ns += s.elapsed().as_nanos() as u64;
        }
        self.rec.exposed_wait_ns += waited.as_nanos() as u64;
        self.rec.ready_ns = self.since(Instant::now());
        // A request that fails at several layers of one step counts once.
        for (_, rid, _) in &out.failed {
            if self.failed_this_step.insert(*rid) {
                self.rec.failed_requests += 1;
            }
        }
        let cpu = ns(t0.elapsed().saturating_sub(waited));
        self.rec.cpu_ready_ns += cpu;
        self.rec.cpu_ns += cpu;
        Ok(out)
    }

    /// Retries the plan's objects whose load failed, once; reports the rows that still lack
    /// their data. Returns the time blocked.
    fn recover(&mut self, id: LayerPlanId, out: &mut ReadyOutcome) -> Result<Duration> {
        let plan = &self.plans[&id];
        let layer = plan.layer;
        let mut lost: Vec<u32> = Vec::new();
        for (i, k) in plan.keys.iter().enumerate() {
            if self
                .dir
                .state(k)
                .is_some_and(|s| s.device == crate::directory::DeviceState::Absent)
            {
                lost.push(i as u32);
            }
        }
        if lost.is_empty() {
            return Ok(Duration::ZERO);
        }
        let keys: Vec<ObjectKey> = lost.iter().map(|&i| plan.keys[i as usize]).collect();
        let mut waited = Duration::ZERO;
        let mut reason = String::new();
        let retried = match self.dir.resolve(&keys, None) {
            Ok(res) => {
                let plan = self.plans.get_mut(&id).expect("outstanding");
                plan.handles.push(res.handle);
                plan.pins += res.metrics.distinct;
                self.pins += res.metrics.distinct;
                let mut rec = StepRecord::default();
                let deps = self.submit_resolved(&res, layer, &mut rec);
                rec.retried_loads = 1;
                self.rec.fold(&rec);
                let mut ok = true;
                for tid in deps {
                    if let Some(ld) = self.loads.get(&tid) {
                        let w = Instant::now();
                        let _ = ld.events.wait_all(None);
                        waited += w.elapsed();
                        self.settle_load(tid)?;
                    }
                    if let Ok(Some(Err(e))) = self.dir.outcome(tid) {
                        ok = false;
                        reason = e.to_string();
                    }
                }
                ok.then_some(res.slots)
            }
            Err(e) => {
                reason = e.to_string();
                None
            }
        };
        let plan = self.plans.get_mut(&id).expect("outstanding");
        match retried {
            Some(slots) => {
                let mut new_slot = vec![-1i32; plan.keys.len()];
                for (n, &i) in lost.iter().enumerate() {
                    new_slot[i as usize] = slots[n].raw() as i32;
                }
                for &i in &lost {
                    let key = i as usize;
                    plan.key_slot[key] = new_slot[key];
                    out.moved.push((plan.key_cell[key], new_slot[key]));
                }
                out.moved.extend(
                    plan.repeats
                        .cells_of(|key| Some(new_slot[key]).filter(|&s| s >= 0)),
                );
                if let Some(table) = plan.table.as_mut() {
                    for &(at, slot) in &out.moved {
                        table[at as usize] = slot;
                    }
                }
                out.slots_changed = true;
            }
            None => {
                let mut rows: Vec<u32> = lost.iter().map(|&i| plan.key_row[i as usize]).collect();
                rows.sort_unstable();
                rows.dedup();
                for &b in &rows {
                    plan.failed.push(b);
                    let b = b as usize;
                    let cells = plan.form.row_cells(b);
                    if let Some(table) = plan.table.as_mut() {
                        table[cells.clone()].fill(-1);
                    }
                    out.failed_cells
                        .push((cells.start as u32, cells.end as u32));
                    out.failed.push((b, plan.rids[b], reason.clone()));
                }
                out.slots_changed = true;
            }
        }
        Ok(waited)
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
    /// prefetches, and returns the step's record.
    pub fn end_step(&mut self) -> Result<StepRecord> {
        let t0 = Instant::now();
        self.pending_backups.append(&mut self.filled);
        self.submit_pending_backups()?;
        self.poll()?;
        if let Some(p) = self.prefix.as_mut() {
            p.cache.poll()?;
            p.drop_freed(&self.dir)?;
        }
        self.progress_finishing()?;
        let stale: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in stale {
            self.drop_prefetch(l)?;
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
        Ok(rec)
    }

    /// Settles every finished load and backup (complete, or fail and retry a backup once).
    pub fn poll(&mut self) -> Result<()> {
        let done: Vec<TransferId> = self
            .loads
            .iter()
            .filter(|(_, l)| l.events.is_finished())
            .map(|(t, _)| *t)
            .collect();
        for t in done {
            self.settle_load(t)?;
        }
        let done: Vec<TransferId> = self
            .backups
            .iter()
            .filter(|(_, b)| b.events.is_finished())
            .map(|(t, _)| *t)
            .collect();
        for t in done {
            let b = self.backups.remove(&t).expect("listed");
            match first_failure(&b.events) {
                None => self.dir.backup_complete(t)?,
                Some(reason) => {
                    self.dir.fail(t, &reason, true)?;
                    self.rec.failed_backups += 1;
                    self.retry_backups.extend(b.keys);
                }
            }
        }
        Ok(())
    }

    /// Blocks until every backup in flight has finished (used when the device is full of
    /// pages that are not written through yet, and by shutdown).
    pub fn wait_backups(&self) {
        for b in self.backups.values() {
            let _ = b.events.wait_all(None);
        }
    }

    /// Arms `count` failures (or, with `delay`, slow copies) for the next load (or backup)
    /// submissions, at `layer` only if given. Through the engine's fault hook, so the failure
    /// takes the real path.
    pub fn inject_faults(
        &mut self,
        direction: Direction,
        count: u32,
        layer: Option<u16>,
        delay: Option<Duration>,
    ) {
        self.faults.fail(direction, count, layer, delay);
    }

    /// Arms `count` panics of the engine's worker (cpu engine) in the next load (or backup)
    /// submissions, at `layer` only if given: a bug in the copy path, which the engine turns
    /// into a failed transfer.
    pub fn inject_panics(&mut self, direction: Direction, count: u32, layer: Option<u16>) {
        self.faults.panic(direction, count, layer);
    }

    /// Injected copy-worker panics handed to the engine so far, each with the submission it
    /// fails (a panic armed but not yet handed over is in [`Self::armed_faults`]).
    pub fn copy_panics_injected(&self) -> u64 {
        self.faults.copy_panics()
    }

    /// The next plan panics inside the core after it has pinned and submitted its loads, as
    /// a bug would (tests the bindings' containment: see [`crate::guard`]).
    pub fn inject_internal_fault(&mut self) {
        self.internal_fault = true;
    }

    /// Injected faults still armed, by kind: (loads, backups, restores). A fault stays armed
    /// until a submission of its kind (at its layer, if it names one) takes it, so a run whose
    /// faults found nothing to fail can say so.
    pub fn armed_faults(&self) -> (u64, u64, u64) {
        let restores = self
            .prefix
            .as_ref()
            .map_or(0, |p| u64::from(p.restore_faults));
        let armed = |d| self.faults.armed(d);
        (armed(Direction::Load), armed(Direction::Backup), restores)
    }

    /// Hands an armed fault of `direction` at `layer` to the engine for its next submission.
    fn arm(&mut self, direction: Direction, layer: Option<u16>) -> Result<()> {
        self.faults.arm(&*self.engine, direction, layer)
    }

    // -- transfers ----------------------------------------------------------------------

    fn group(
        &self,
        direction: Direction,
        src: &[u64],
        dst: &[u64],
    ) -> Result<(PageTransferGroup, u64)> {
        let map = PageTransferMap::new(Granularity::Page, src, dst)?;
        let segments = map.segments().len() as u64;
        let (s, d) = match direction {
            Direction::Load => (&self.host, &self.device),
            Direction::Backup => (&self.device, &self.host),
        };
        let t = PreparedPageTransfer::new(s.clone(), d.clone(), map, direction)?;
        Ok((
            PageTransferGroup::new(vec![t])?,
            segments * self.device.planes_per_layer() as u64,
        ))
    }

    /// Submits a resolve's load (if any); returns every transfer the batch now depends on: the
    /// ones it joined, then its own.
    fn submit_resolved(
        &mut self,
        res: &Resolved,
        layer: u16,
        rec: &mut StepRecord,
    ) -> Vec<TransferId> {
        let mut deps: Vec<TransferId> = res.joined.iter().copied().collect();
        if let Some(lp) = res.loads.first() {
            self.submit_load(lp.transfer, &lp.host_slots, &lp.device_slots, layer, rec);
            deps.push(lp.transfer);
        }
        deps
    }

    /// Submits directory load `tid`; a submission the engine refuses fails the load at once.
    fn submit_load(
        &mut self,
        tid: TransferId,
        host: &[crate::ids::HostSlotId],
        device: &[SlotId],
        layer: u16,
        rec: &mut StepRecord,
    ) {
        let src: Vec<u64> = host.iter().map(|s| u64::from(s.raw())).collect();
        let dst: Vec<u64> = device.iter().map(|s| u64::from(s.raw())).collect();
        let submitted = self.arm(Direction::Load, Some(layer)).and_then(|()| {
            let (g, segments) = self.group(Direction::Load, &src, &dst)?;
            rec.copy_segments += segments;
            self.engine.submit(Arc::new(g), None)
        });
        rec.load_submissions += 1;
        rec.bytes_transferred += device.len() as u64 * self.object_bytes;
        match submitted {
            Ok(events) => {
                let _ = self.dir.mark_submitted(tid);
                self.loads.insert(tid, Load { events });
            }
            Err(e) => {
                // Nothing was queued: the slots can be reused at once.
                let _ = self.dir.fail(tid, &e.to_string(), true);
                rec.failed_loads += 1;
            }
        }
    }

    fn settle_load(&mut self, tid: TransferId) -> Result<()> {
        let Some(ld) = self.loads.remove(&tid) else {
            return Ok(());
        };
        match first_failure(&ld.events) {
            None => self.dir.complete(tid),
            Some(reason) => {
                self.rec.failed_loads += 1;
                self.dir.fail(tid, &reason, ld.events.is_finished())
            }
        }
    }

    /// Writes through the pages that filled (attempt 0) and, separately, the pages whose
    /// backup failed (a retry).
    fn submit_pending_backups(&mut self) -> Result<()> {
        let mut keys = std::mem::take(&mut self.pending_backups);
        if self.prefix.is_some() {
            // Pages of a request that was let go are dropped objects by now.
            keys.retain(|k| self.dir.state(k).is_some());
        }
        self.submit_backup(keys)?;
        let retry: Vec<ObjectKey> = std::mem::take(&mut self.retry_backups)
            .into_iter()
            .filter(|k| self.dir.state(k).is_some())
            .collect();
        self.submit_backup(retry)
    }

    fn submit_backup(&mut self, keys: Vec<ObjectKey>) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let plan = self.dir.backup(&keys)?;
        let Some(tid) = plan.transfer else {
            return Ok(());
        };
        let src: Vec<u64> = plan
            .device_slots
            .iter()
            .map(|s| u64::from(s.raw()))
            .collect();
        let dst: Vec<u64> = plan.host_slots.iter().map(|s| u64::from(s.raw())).collect();
        let submitted = self.arm(Direction::Backup, None).and_then(|()| {
            let (g, _) = self.group(Direction::Backup, &src, &dst)?;
            self.engine.submit(Arc::new(g), None)
        });
        self.rec.backup_submissions += 1;
        self.rec.backup_pages += src.len() as u64;
        match submitted {
            Ok(events) => {
                self.backups.insert(tid, Backup { events, keys });
            }
            Err(e) => {
                self.dir.fail(tid, &e.to_string(), true)?;
                self.rec.failed_backups += 1;
                self.retry_backups.extend(keys);
            }
        }
        Ok(())
    }

    // -- prefetch -----------------------------------------------------------------------

    /// Loads (and pins until `plan(layer)` finishes) what each request of `rids` selected at
    /// `layer` last step and is now on host only; pages still on the device are left alone
    /// (not pinned: the plan pins them if they are still there). Best effort: skipped when the
    /// device cannot hold it.
    fn prefetch(&mut self, layer: u16, rids: &[RequestId]) -> Result<()> {
        let t = Instant::now();
        let r = self.prefetch_layer(layer, rids);
        self.rec.cpu_prefetch_ns += ns(t.elapsed());
        r
    }

    fn prefetch_layer(&mut self, layer: u16, rids: &[RequestId]) -> Result<()> {
        if self.prefetches.contains_key(&layer) {
            return Ok(());
        }
        let ps = self.cfg.page_size;
        let mut keys = Vec::new();
        let mut hints = Vec::new();
        let mut rows = FxHashMap::default();
        let mut from_prefix = Vec::new();
        let mut key_rids = Vec::new();
        for id in rids {
            let Some(r) = self.requests.get(id) else {
                continue;
            };
            let pages = r.pages(ps);
            // Kept pages are held on the device: only the rest may need a load. (Kept plans
            // leave only unkept pages here; an unkept plan of a layer with kept lists, one
            // planned while another was outstanding, may not.)
            let kept = self.kept.list(layer as usize, r.kept_slot);
            let mut kc = 0;
            let predicted: Vec<u32> = r.last_selection[layer as usize]
                .iter()
                .copied()
                .filter(|&p| {
                    while kc < kept.len() && kept[kc].page < p {
                        kc += 1;
                    }
                    p < pages && kept.get(kc).is_none_or(|k| k.page != p)
                })
                .collect();
            keys.extend(predicted.iter().map(|&p| r.key(p, layer)));
            hints.extend(predicted.iter().map(|&p| r.hint(p, layer)));
            from_prefix.extend(
                predicted
                    .iter()
                    .map(|&p| if p < r.matched { p } else { NONE }),
            );
            key_rids.extend(predicted.iter().map(|_| *id));
            rows.insert(*id, (predicted, Vec::new()));
        }
        if keys.is_empty() {
            return Ok(());
        }
        let res = match self.dir.prefetch_loads(&keys, &hints) {
            Ok(r) => r,
            Err(Error::OutOfSlots { .. }) => {
                self.rec.prefetch_skipped += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        self.count_prefix_loads(layer, &res.loaded, &from_prefix, &key_rids);
        let mut rec = StepRecord {
            prefetch_predicted: keys.len() as u64,
            prefetch_loaded: res.metrics.absent,
            ..Default::default()
        };
        if let Some(lp) = res.loads.first() {
            let mut i = 0;
            for id in rids {
                let Some((predicted, loaded)) = rows.get_mut(id) else {
                    continue;
                };
                for &p in predicted.iter() {
                    if res.loaded[i] {
                        loaded.push(p);
                    }
                    i += 1;
                }
            }
            self.submit_load(
                lp.transfer,
                &lp.host_slots,
                &lp.device_slots,
                layer,
                &mut rec,
            );
        }
        self.rec.fold(&rec);
        let pins = res.metrics.distinct;
        self.pins += pins;
        self.prefetch_pins += pins;
        self.rec.pinned_peak = self.rec.pinned_peak.max(self.pins);
        self.rec.prefetch_pinned_peak = self.rec.prefetch_pinned_peak.max(self.prefetch_pins);
        self.prefetches.insert(
            layer,
            Prefetch {
                handle: res.handle,
                pins,
                rows,
            },
        );
        Ok(())
    }

    fn drop_prefetch(&mut self, layer: u16) -> Result<()> {
        if let Some(pf) = self.prefetches.remove(&layer) {
            let wasted: u64 = pf.rows.values().map(|(_, l)| l.len() as u64).sum();
            self.rec.prefetch_wasted += wasted;
            self.rec.prefetch_wasted_bytes += wasted * self.object_bytes;
            self.dir.release(pf.handle)?;
            self.pins -= pf.pins;
            self.prefetch_pins -= pf.pins;
        }
        Ok(())
    }

    /// Waits for every transfer in flight and settles it, releases prefetches; what a caller
    /// does before dropping the pools.
    pub fn drain(&mut self) -> Result<()> {
        let stale: Vec<u16> = self.prefetches.keys().copied().collect();
        for l in stale {
            self.drop_prefetch(l)?;
        }
        self.submit_pending_backups()?;
        for ld in self.loads.values() {
            let _ = ld.events.wait_all(None);
        }
        self.wait_backups();
        self.poll()?;
        // A retry queued by a failed backup gets one more try here.
        if !self.retry_backups.is_empty() {
            self.submit_pending_backups()?;
            self.wait_backups();
            self.poll()?;
        }
        if let Some(p) = self.prefix.as_mut() {
            p.cache.drain()?;
            p.drop_freed(&self.dir)?;
        }
        // Ended requests: write through and insert (a failed write gets more tries).
        self.flush_finished()?;
        self.progress_finishing()
    }

    /// Checks the directory's invariants and the scheduler's own (module docs).
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.dir.validate()?;
        self.validate_prefix()?;
        let s = self.dir.stats();
        // A plan holds its own pins and those of the prefetch it consumed.
        let held: u64 = self
            .plans
            .values()
            .map(|p| p.pins + p.prefetch.as_ref().map_or(0, |pf| pf.pins))
            .sum::<u64>()
            + self.prefetches.values().map(|p| p.pins).sum::<u64>();
        if held != self.pins {
            return Err(format!(
                "pins counted {} != held by plans {held}",
                self.pins
            ));
        }
        self.validate_kept()?;
        if self.plans.is_empty()
            && self.prefetches.is_empty()
            && (s.pins != self.kept_pins || s.handles != 0)
        {
            return Err(format!(
                "no plan or prefetch outstanding, yet {} pins in {} handles",
                s.pins, s.handles
            ));
        }
        if s.transfers_in_flight > self.loads.len() + self.backups.len() {
            return Err(format!(
                "directory has {} transfers in flight, scheduler tracks {}",
                s.transfers_in_flight,
                self.loads.len() + self.backups.len()
            ));
        }
        for r in self.requests.values() {
            if r.len % u64::from(self.cfg.page_size) == 0 {
                continue; // the next token starts a page: no page is being written
            }
            for (l, slot) in r.tail.iter().enumerate() {
                let key = r.key((r.len / u64::from(self.cfg.page_size)) as u32, l as u16);
                let ok = self.dir.state(&key).is_some_and(|o| {
                    o.device == crate::directory::DeviceState::Ready { slot: *slot }
                });
                if !ok {
                    return Err(format!(
                        "request {}: tail slot {slot} of layer {l} is not its page",
                        r.id
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Marks request `id` as named by batch `batch`; refuses unknown ids and repeats in a batch.
fn mark_batch(
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

/// The first failure among a transfer's layers, if any.
fn first_failure(ev: &TransferEvents) -> Option<String> {
    ev.layers().iter().find_map(|&l| match ev.status(l) {
        Ok(LayerStatus::Failed(r)) => Some(r),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    })
}

/// Nanoseconds of `d`, saturated (a step's CPU split counts in u64 nanoseconds).
fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
