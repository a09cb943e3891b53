//! The device resolver: a decode layer's top-k mapped to device slots where the data lives,
//! with the misses served from pinned host memory into slots the core granted, and no call
//! into the core. This is the algorithm and its state; [`ResolverState::resolve_layer`] is the
//! reference implementation (sequential, on the CPU), which the CPU runtime uses and which a
//! CUDA kernel is held to. On CUDA pools the kernel runs in its place (`kernel`, over `gpu`),
//! and in test builds (`host-kernel`) the kernel's own source, compiled for the CPU, can
//! (`kernel` over `device::HostDevice`).
//!
//! # State (device memory on a GPU; here, memory of this process)
//! - the mirror: per (host page `h`, layer `l`) the device slot holding that object, or -1
//!   (joined mode: every main-KV object lives at a host page, its home, so an object shared
//!   by the requests of one prefix has one entry);
//! - per running request, its page table: page -> home;
//! - the grant: device slots the core handed over, each free, holding a victim (an object
//!   the core lets the device evict, least recently used first) or holding an object an
//!   earlier step copied into the resolver's pool, taken in order; what a step did not take
//!   stays granted for the next;
//! - the log: for each grant entry taken, the object copied into it;
//! - a read mark per mirror entry (the step that last read it: a layer counts each object once),
//!   and a bit per entry for what the last closed step read (the core gives what the device
//!   read a second chance: a bit keeps that walk within cache), and counts per layer.
//!
//! # One layer
//! For each cell (row `b`, entry `k`): the page it names (block mode: the entry; token mode:
//! the entry's token / page size) -> its home `h` -> `mirror[h, l]`. A slot there is a hit. Else
//! the next granted entry is taken (a victim this layer already read is passed over: its rows
//! may still be read), its victim leaves the mirror, the object's rows are copied from its
//! home into the slot, the mirror names it, and the log records it; the cell gets that slot. A
//! later cell naming the same object hits. No grant left is an overflow: the cell gets
//! [`FAILED`] and the layer is reported (the core grants enough that this does not happen:
//! `JoinedScheduler::begin_device_step`). A copy that fails twice leaves its cell [`FAILED`],
//! its slot for the next miss, and the object's later cells of the step [`FAILED`] without
//! another try (fault injection). Once the grant is spent, the slots earlier layers of
//! the step filled are filled again, oldest first: each layer's table is read before the next
//! layer is resolved (the caller's contract, as stream order gives it on a GPU), so the grant
//! need only cover one layer's cells.
//!
//! # What the core keeps exact (`joined.rs`, `device_step.rs`)
//! Every mirror entry names a device-Ready object at that slot; objects that lose their slot
//! (eviction, removal) are cleared before the next step; objects whose host copy is not
//! written (pages being written) are in the mirror from their start, so a miss only ever reads
//! a host copy that is ready and, while the request runs, never freed or rewritten.

use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::transfer::{LayerPageOrder, PageTransferBinding};
use rustc_hash::FxHashMap;

pub mod abi;
mod capture;
pub(crate) mod device;
pub(crate) mod gpu;
pub mod kernel;
pub mod launch;
mod reads;
mod tables;

/// A mirror entry's device slot when the object is not on the device (as far as the device
/// knows).
pub const ABSENT: i32 = -1;

/// A cell's slot when its object's copy failed (twice: a failed copy is retried once). Its
/// row has no data for this layer; the caller fails that request for the step.
pub const FAILED: i32 = -2;
/// A cell's table entry between a layer's two passes (the kernel's launches): its object's
/// mark set by this cell (it counts the hit), or by another. Never slots: a table left so by a
/// failed call names no slot.
const MARKED_FIRST: i32 = -4;
const MARKED: i32 = -5;

/// What a step's resolves did, per layer and in all.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolveCounts {
    /// Per layer: distinct objects found in the mirror.
    pub hits: Vec<u64>,
    /// Per layer: distinct objects copied from host.
    pub misses: Vec<u64>,
    /// Selected tokens, every cell (bytes needed, in tokens).
    pub needed_tokens: u64,
    /// Selected tokens in the objects copied (read amplification's denominator).
    pub needed_tokens_moved: u64,
    /// Selected entries (tokens in token mode, blocks in block mode), every row.
    pub selected: u64,
    /// Cells left without a slot for want of granted slots.
    pub overflow: u64,
    /// Slots filled again: an earlier layer of the step had filled them.
    pub refills: u64,
    /// Copies that failed (each attempt, retries included).
    pub failed: u64,
    /// Retries of failed copies.
    pub retried: u64,
}

/// A grant entry the device took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogEntry {
    /// Its index in the grant (its slot is the grant's).
    pub g: u32,
    /// The mirror entry it filled (`h * layers + l`).
    pub e: u32,
    /// The request and page whose cell missed first.
    pub rid: RequestId,
    pub page: u32,
    /// The resolve call of the step that took it.
    pub call: u32,
    /// Its copy failed (and its retry): the slot holds no object, and the cell read nothing.
    pub failed: bool,
}

/// A running request's page table: the home of each page, and its length in tokens.
#[derive(Debug, Default)]
struct PageTable {
    /// The admission it belongs to (a restarted request keeps its id).
    serial: u64,
    homes: Vec<u32>,
    len: u64,
}

/// What a closed step did (see [`ResolverState::close`]).
#[derive(Debug, Default)]
pub(crate) struct StepDone {
    pub used: usize,
    pub log: Vec<LogEntry>,
    pub counts: ResolveCounts,
    /// Copy faults armed and not taken: (layer or any, count).
    pub faults: Vec<(Option<u16>, u32)>,
    /// The requests of the rows that got a [`FAILED`] cell (repeats included).
    pub failed_rids: Vec<RequestId>,
    /// Cells the kernel found naming a page past their request (left without a slot; the
    /// reference refuses them before it resolves anything).
    pub bad_cells: u64,
    /// What the step read: a bit per mirror entry.
    pub reads: std::sync::Arc<Vec<u32>>,
}

/// The resolver's state: the mirror, page tables, grant, log and counts.
#[derive(Debug)]
pub struct ResolverState {
    layers: u16,
    page_size: u32,
    /// `[host pages * layers]`: device slot or [`ABSENT`].
    mirror: Vec<i32>,
    /// Per running request: its page table.
    tables: FxHashMap<RequestId, PageTable>,
    /// (slot, the mirror entry of its victim or -1 for a free slot), in the order to take.
    grant: Vec<(i32, i64)>,
    used: usize,
    /// The grant entries taken, in order. A grant entry appears more than once when its slot
    /// was filled again later in the step (`take`: a slot an earlier layer filled); the last
    /// is the slot's owner. Entries before `used` not here were passed over.
    log: Vec<LogEntry>,
    /// Resolve calls this step, and the first log entry not yet refilled.
    call: u32,
    /// Per layer, whether the step resolved it (each layer once a step: a second call of a
    /// layer could refill a slot a cell of that layer read), and the widest row the step
    /// granted for (its log and grant are sized by it).
    resolved: Vec<bool>,
    entries: usize,
    /// The step's requests (a call's batch is some of them, each once).
    step_rids: rustc_hash::FxHashSet<RequestId>,
    /// The step's requests in its order (a launch for them reads the rows sent at its open).
    step_order: Vec<RequestId>,
    refill_at: usize,
    /// Grant entries passed over (a victim the resolving layer had read), for later layers.
    deferred: Vec<usize>,
    /// The next deferred entry to take, and the end of those earlier calls deferred.
    def_at: usize,
    def_usable: usize,
    /// Grant entries whose copy failed this step: their slots hold nothing, taken again first.
    spare: Vec<usize>,
    /// The requests of the rows that got a [`FAILED`] cell this step.
    failed_rids: Vec<RequestId>,
    /// A layer's cells' mirror entries (`u32::MAX`: none), from its first pass to its second.
    cell_entries: Vec<u32>,
    /// Per mirror entry, the serial of the step that last read it (a layer counts each object
    /// once; the core gives a victim read by the last step a second chance); `filled` marks
    /// the entries this step brought in.
    mark: Vec<u32>,
    filled: Vec<u32>,
    /// A bit per mirror entry: read by the last closed step (what `was_read` asks), and read
    /// by this one so far (the reference's; the kernel's come back from its device). One
    /// bit an entry keeps the core's second chance within cache where the marks are not;
    /// `reads_serial` is the step that cleared `reads_now` (the device's side does, at its
    /// first resolve).
    reads_last: reads::ReadBitmaps,
    reads_now: Vec<u32>,
    reads_serial: u32,
    /// Per mirror entry, the serial of the step whose copy of it failed (its later cells of
    /// the step fail without trying again).
    failed: Vec<u32>,
    serial: u32,
    counts: ResolveCounts,
    /// Whether the core granted this step (resolves are refused otherwise).
    open: bool,
    /// Copy failures armed for this step (fault injection): (layer or any, count).
    faults: Vec<(Option<u16>, u32)>,
    device: PageTransferBinding,
    host: PageTransferBinding,
    order: LayerPageOrder,
    /// The CUDA kernel, on a GPU or (test builds) on the CPU, in place of the reference.
    kernel: Option<kernel::DeviceKernel>,
    /// The stream the kernel's work of the next step is queued on (a raw `CUstream`).
    stream: u64,
    /// The launches CUDA graphs captured, by layer and rows, and those captured since the
    /// step opened and not replayed yet (their calls follow the step's).
    captured: FxHashMap<(u16, usize), capture::Captured>,
    pending: Vec<(u16, usize)>,
    /// Test builds: launches over host memory are recorded, not run (a capture on the CPU).
    #[cfg(any(test, feature = "testing"))]
    recording: bool,
}

impl ResolverState {
    /// A resolver over `host_pages` homes of `layers` layers, copying from `host` (the group's
    /// KV host pool, layer-flattened, numbered by `order`) into `device` (one-layer slots).
    pub fn new(
        layers: u16,
        page_size: u32,
        host_pages: u32,
        device: PageTransferBinding,
        host: PageTransferBinding,
        order: LayerPageOrder,
    ) -> Result<Self> {
        if device.planes_per_layer() != host.planes_per_layer()
            || device.page_bytes() != host.page_bytes()
        {
            return Err(Error::config(
                "device",
                "rows unlike the host pool's",
                "device slots with the host pool's planes and page bytes",
            ));
        }
        let n = host_pages as usize * layers as usize;
        Ok(ResolverState {
            layers,
            page_size,
            mirror: vec![ABSENT; n],
            tables: FxHashMap::default(),
            grant: Vec::new(),
            used: 0,
            log: Vec::new(),
            mark: vec![0; n],
            filled: vec![0; n],
            reads_last: reads::ReadBitmaps::new(n),
            reads_now: vec![0; n.div_ceil(32)],
            reads_serial: 0,
            failed: vec![0; n],
            call: 0,
            refill_at: 0,
            deferred: Vec::new(),
            def_at: 0,
            def_usable: 0,
            spare: Vec::new(),
            failed_rids: Vec::new(),
            cell_entries: Vec::new(),
            serial: 0,
            counts: ResolveCounts::default(),
            open: false,
            faults: Vec::new(),
            device,
            host,
            order,
            kernel: None,
            stream: 0,
            resolved: vec![false; layers as usize],
            entries: 0,
            step_rids: Default::default(),
            step_order: Vec::new(),
            captured: FxHashMap::default(),
            pending: Vec::new(),
            #[cfg(any(test, feature = "testing"))]
            recording: false,
        })
    }

    /// Layers.
    pub fn layers(&self) -> u16 {
        self.layers
    }

    /// The mirror entry of home `h` at `layer`.
    #[inline]
    pub fn entry(&self, h: u32, layer: u16) -> usize {
        h as usize * self.layers as usize + layer as usize
    }

    /// The device slot the mirror names for home `h` at `layer`, or [`ABSENT`].
    pub fn slot(&self, h: u32, layer: u16) -> i32 {
        self.mirror[self.entry(h, layer)]
    }

    /// Whether a step is open (granted and not yet reconciled).
    pub fn is_open(&self) -> bool {
        self.open
    }

    // -- the core's side (step boundaries) -----------------------------------------------

    /// Sets mirror entry `e` (the core: a page that started on the device, a duplicate found
    /// on reconcile).
    pub(crate) fn set(&mut self, e: usize, slot: i32) {
        self.mirror[e] = slot;
        if let Some(k) = &mut self.kernel {
            k.changed.push(e);
        }
    }

    /// Brings request `id`'s page table up to `homes` (its pages' homes) and `len` tokens:
    /// appends the pages it lacks, or starts over for another admission under the same id
    /// (`serial`).
    pub(crate) fn update_table(
        &mut self,
        id: RequestId,
        serial: u64,
        homes: &[(u32, u32)],
        len: u64,
    ) {
        let t = self.tables.entry(id).or_default();
        if t.serial != serial || t.homes.len() > homes.len() {
            t.serial = serial;
            t.homes.clear();
        }
        let n = t.homes.len();
        t.homes.extend(homes[n..].iter().map(|&(h, _)| h));
        t.len = len;
    }

    /// Forgets the tables of requests `keep` does not name.
    pub(crate) fn retain_tables(&mut self, keep: impl Fn(&RequestId) -> bool) {
        self.tables.retain(|id, _| keep(id));
    }

    /// Opens a step of the batch `rids` (their tables up to date), whose rows have at most
    /// `entries` entries a layer, with `grant` entries to take: (slot, victim entry or -1),
    /// and `faults` copy failures armed (fault injection: (layer or any, count)); `cells`
    /// bounds the objects one layer of the step can miss (the kernel's log is sized by it).
    pub(crate) fn open(
        &mut self,
        (rids, entries): (&[RequestId], usize),
        grant: Vec<(i32, i64)>,
        faults: Vec<(Option<u16>, u32)>,
        cells: usize,
    ) -> Result<()> {
        self.resolved.fill(false);
        self.pending.clear();
        self.entries = entries;
        self.step_rids = rids.iter().copied().collect();
        self.step_order = rids.to_vec();
        self.grant = grant;
        self.faults = faults;
        self.used = 0;
        self.log.clear();
        self.call = 0;
        self.refill_at = 0;
        self.deferred.clear();
        self.def_at = 0;
        self.def_usable = 0;
        self.spare.clear();
        self.failed_rids.clear();
        self.counts = ResolveCounts {
            hits: vec![0; self.layers as usize],
            misses: vec![0; self.layers as usize],
            ..Default::default()
        };
        self.serial = self.serial.wrapping_add(1);
        let wrapped = self.serial == 0;
        if wrapped {
            // The marks wrapped: start them over.
            self.mark.fill(0);
            self.filled.fill(0);
            self.failed.fill(0);
            self.serial = 1;
            self.reads_serial = 0;
        }
        if let Some(k) = &mut self.kernel {
            let capacity = cells * self.layers as usize;
            // (A length past the homes it has would name a page with none: bounded by them.)
            let ps = u64::from(self.page_size);
            let tables: Vec<tables::StepTable<'_>> = rids
                .iter()
                .filter_map(|id| {
                    let t = self.tables.get(id)?;
                    let len = t.len.min(t.homes.len() as u64 * ps);
                    Some((*id, t.serial, &t.homes[..], len))
                })
                .collect();
            let running = &self.tables;
            let live = |id: &RequestId| running.contains_key(id);
            k.open(
                self.stream,
                &self.grant,
                self.serial,
                capacity,
                &self.mirror,
                wrapped,
                (&tables, &live),
            )?;
        }
        self.open = true;
        Ok(())
    }

    /// Sets the stream the kernel's work of the next steps is queued on (a raw `CUstream` of
    /// the pools' device, torch's current one; ignored by the reference and on the CPU).
    pub fn set_stream(&mut self, stream: u64) {
        self.stream = stream;
    }

    /// The stream the kernel's work is queued on.
    pub fn stream(&self) -> u64 {
        self.stream
    }

    /// Whether the kernel resolves, on a device whose memory is not this process's (a GPU):
    /// resolves then take device addresses ([`ResolverState::resolve_layer_device`]).
    pub fn on_gpu(&self) -> bool {
        self.kernel.as_ref().is_some_and(|k| !k.on_host())
    }

    /// Closes the step. Returns what it did: how many of the grant's entries the step went
    /// through, the log and the counts. The kernel's are read back from its device (a wait
    /// for the step's work); when that fails the step is closed with nothing done.
    pub(crate) fn close(&mut self) -> Result<StepDone> {
        self.open = false;
        let mut bad_cells = 0;
        if let Some(k) = &mut self.kernel {
            let mut bits = self.reads_last.spare();
            let read = k.close(self.layers, &mut bits);
            let (log, counts, bad) = match read {
                Ok(r) => {
                    self.reads_last.publish(bits);
                    r
                }
                Err(e) => {
                    self.grant.clear();
                    return Err(e);
                }
            };
            self.used = k.used();
            self.log = log;
            self.counts = counts;
            bad_cells = bad;
            kernel::follow_log(&mut self.mirror, &self.grant, &self.log);
        } else {
            // (A step that resolved nothing read nothing.)
            self.start_reads();
            let next = self.reads_last.spare();
            let now = std::mem::replace(&mut self.reads_now, next);
            self.reads_last.publish(now);
        }
        self.grant.clear();
        Ok(StepDone {
            bad_cells,
            reads: self.reads_last.last(),
            used: std::mem::take(&mut self.used),
            log: std::mem::take(&mut self.log),
            counts: std::mem::take(&mut self.counts),
            faults: std::mem::take(&mut self.faults),
            failed_rids: std::mem::take(&mut self.failed_rids),
        })
    }

    /// Empties the open step's read bits once a step (the reference's; at its first resolve,
    /// as the kernel's device does its own).
    fn start_reads(&mut self) {
        if self.reads_serial != self.serial {
            self.reads_now.fill(0);
            self.reads_serial = self.serial;
        }
    }

    /// The copy faults armed for the step and not taken (after a close that failed).
    pub(crate) fn take_faults(&mut self) -> Vec<(Option<u16>, u32)> {
        std::mem::take(&mut self.faults)
    }

    /// Whether the last step read mirror entry `e` (hit or copied in).
    pub(crate) fn was_read(&self, e: usize) -> bool {
        self.reads_last.was_read(e)
    }

    /// Fetches what [`Self::was_read`] reads for entry `e` into the cache (a hint: any `e`
    /// is fine).
    #[inline]
    pub(crate) fn prefetch_read(&self, e: usize) {
        self.reads_last.prefetch(e);
    }

    /// The mirror, for the core's checks.
    pub(crate) fn mirror(&self) -> &[i32] {
        &self.mirror
    }

    // -- the device's side (each layer) --------------------------------------------------

    /// A resolve of `layer` with rows of `k` entries is allowed now: a step is open, the
    /// layer exists and was not resolved yet this step, and `k` is at most what the step was
    /// granted for.
    fn check_call(&self, layer: u16, k: usize) -> Result<()> {
        if !self.open {
            return Err(Error::config(
                "step",
                "not granted",
                "a step the core granted (begin_device_step) and did not end yet",
            ));
        }
        if layer >= self.layers {
            return Err(Error::out_of_range("layer", layer, 0, self.layers));
        }
        if self.resolved[layer as usize] {
            return Err(Error::config(
                "layer",
                layer,
                "a layer not resolved yet this step (each layer once a step)",
            ));
        }
        if k > self.entries {
            return Err(Error::config(
                "selection.shape",
                format!("rows of {k} entries"),
                format!(
                    "at most {} entries a row, as granted by begin_device_step",
                    self.entries
                ),
            ));
        }
        Ok(())
    }

    /// A call's batch is requests of the step, each once (the grant and the log were sized
    /// for the step's rows).
    fn check_rids(&self, rids: &[RequestId]) -> Result<()> {
        let mut seen = rustc_hash::FxHashSet::default();
        for id in rids {
            if !self.step_rids.contains(id) {
                return Err(Error::config("rids", id, "requests of the granted step"));
            }
            if !seen.insert(*id) {
                return Err(Error::config(
                    "rids",
                    id,
                    "distinct requests (this one twice)",
                ));
            }
        }
        Ok(())
    }

    /// Checks a batch on host memory before anything changes: its requests have tables (are
    /// running), and every entry lies inside its request's tokens.
    fn check_batch(
        &self,
        rids: &[RequestId],
        selection: &[i32],
        k: usize,
        tokens: bool,
    ) -> Result<()> {
        let per = if tokens { 1 } else { u64::from(self.page_size) };
        for (b, id) in rids.iter().enumerate() {
            let t = self
                .tables
                .get(id)
                .ok_or_else(|| Error::config("rids", id, "requests of the granted step"))?;
            for &entry in &selection[b * k..(b + 1) * k] {
                if entry >= 0 && entry as u64 * per >= t.len {
                    return Err(Error::config(
                        "selection",
                        entry,
                        format!("an entry inside its request's {} tokens", t.len),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Resolves `layer` for the batch `rids`: `selection` is `[B][k]` entries (-1 = none), of
    /// a page each (`tokens` false: block ids) or of one token (`tokens` true). Writes the
    /// slot of each cell into `table` (`[B][k]`, -1 where the entry names nothing). Misses are
    /// copied from host into granted slots before this returns. `B` may exceed the batch when
    /// it is the step's, in its order: rows past it are padding (a CUDA graph's batch
    /// bucket), their cells left -1.
    pub fn resolve_layer(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[i32],
        k: usize,
        tokens: bool,
        table: &mut [i32],
    ) -> Result<()> {
        self.check_call(layer, k)?;
        let rows = selection.len().checked_div(k).unwrap_or(rids.len());
        if selection.len() != rows * k || table.len() != selection.len() || rows < rids.len() {
            return Err(Error::config(
                "selection",
                format!("{} entries, a table of {}", selection.len(), table.len()),
                format!(
                    "B x {k} with B >= {}: one row of k per request (padding after), and a \
                     table as large",
                    rids.len()
                ),
            ));
        }
        self.check_rids(rids)?;
        self.check_padding(rids, rows)?;
        let n = rids.len() * k;
        self.check_batch(rids, &selection[..n], k, tokens)?;
        if self.kernel.is_some() {
            return self.launch_on_host_memory(layer, rids, selection, (k, tokens), table);
        }
        self.call += 1;
        self.resolved[layer as usize] = true;
        // What earlier calls deferred is this call's to take (see `take`).
        self.deferred.drain(..self.def_at);
        self.def_at = 0;
        self.def_usable = self.deferred.len();
        table[n..].fill(ABSENT);
        self.start_reads();
        // The tables are read while the mirror and marks change: held apart meanwhile.
        let tables = std::mem::take(&mut self.tables);
        let out = self.resolve_rows(
            &tables,
            layer,
            rids,
            &selection[..n],
            k,
            tokens,
            &mut table[..n],
        );
        self.tables = tables;
        out
    }

    /// Which rows a launch for `rids` reads: the step's (uploaded when it opened) when they
    /// are the step's batch in its order.
    fn batch<'a>(&self, rids: &'a [RequestId]) -> kernel::Batch<'a> {
        if rids == self.step_order.as_slice() {
            kernel::Batch::Step
        } else {
            kernel::Batch::Of(rids)
        }
    }

    /// A selection of `rows` rows for the batch `rids`: rows past the batch (padding) only
    /// when it is the step's, in its order (the kernel bounds a launch's rows by the step's).
    fn check_padding(&self, rids: &[RequestId], rows: usize) -> Result<()> {
        if rows < rids.len() {
            return Err(Error::config(
                "selection.shape",
                format!("{rows} rows"),
                format!("at least a row per request ({})", rids.len()),
            ));
        }
        if rows > rids.len() && rids != self.step_order.as_slice() {
            return Err(Error::config(
                "rids",
                format!("{} requests under {rows} rows", rids.len()),
                "the step's batch in begin_device_step's order when the selection has more \
                 rows (rows past it are padding)",
            ));
        }
        Ok(())
    }

    /// [`ResolverState::resolve_layer`] on the kernel's device, queued on the step's stream:
    /// `selection` and `table` are device addresses of `rows * k` int32 each. Nothing
    /// is read back: cells naming a page past their request are left without a slot (-1)
    /// and reported when the step ends.
    ///
    /// With `capture` (a stream a CUDA graph is capturing), the launch is captured there
    /// instead ([`ResolverState::will_replay`]).
    ///
    /// # Safety
    /// `selection` and `table` are addresses the kernel's device can read and write, of
    /// `rows * k` int32 each, alive until the step's work has run (captured: until
    /// every replay of the graph has run).
    pub unsafe fn resolve_layer_device(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        (selection, table): (u64, u64),
        (rows, k, tokens): (usize, usize, bool),
        capture: Option<u64>,
    ) -> Result<()> {
        self.check_call(layer, k)?;
        self.check_rids(rids)?;
        self.check_padding(rids, rows)?;
        let cells = rows * k;
        if i32::try_from(cells).is_err() {
            return Err(Error::config(
                "selection.shape",
                format!("{rows} x {k}"),
                "fewer than 2^31 entries",
            ));
        }
        if self.kernel.is_none() {
            return Err(Error::config(
                "resolver",
                "the reference (CPU)",
                "a resolver whose kernel runs on a device",
            ));
        }
        let cells = (selection, table, cells, k);
        if let Some(stream) = capture {
            // SAFETY: the caller's contract.
            return unsafe {
                self.capture_launch(
                    kernel::CaptureTo::Stream(stream),
                    (layer, rids),
                    cells,
                    tokens,
                )
            };
        }
        let batch = self.batch(rids);
        let kern = self.kernel.as_mut().expect("checked above");
        let call = self.call + 1;
        // SAFETY: the caller's contract.
        unsafe { kern.launch(layer, batch, cells, call, self.page_size, tokens)? };
        self.call = call;
        self.resolved[layer as usize] = true;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn resolve_rows(
        &mut self,
        tables: &FxHashMap<RequestId, PageTable>,
        layer: u16,
        rids: &[RequestId],
        selection: &[i32],
        k: usize,
        tokens: bool,
        table: &mut [i32],
    ) -> Result<()> {
        let rows: Vec<&PageTable> = rids
            .iter()
            .map(|id| {
                tables
                    .get(id)
                    .ok_or_else(|| Error::config("rids", id, "requests of the granted step"))
            })
            .collect::<Result<_>>()?;
        let ps = u64::from(self.page_size);
        let per = if tokens { 1 } else { ps };
        // (Every entry was checked before anything changed: `check_batch`.)
        // A first pass marks every object the layer reads, so that a miss passes over a
        // victim any cell of the layer reads (the host path, which plans a layer whole, does
        // the same), not only those earlier cells read. The cell that marked its object first
        // counts the hit: its table cell holds MARKED_FIRST until the second pass, else MARKED
        // (as the kernel's: negative, never read as a slot). Each cell's
        // entry is kept for the second pass (`cell_entries`: no second lookup of its home).
        let shift = ps.is_power_of_two().then(|| ps.trailing_zeros());
        let mut cell_entries = std::mem::take(&mut self.cell_entries);
        cell_entries.clear();
        cell_entries.resize(selection.len(), u32::MAX);
        for (b, PageTable { homes, .. }) in rows.iter().enumerate() {
            let row = &selection[b * k..(b + 1) * k];
            // (Token mode: a row's tokens often come a page at a time; that page's entry was
            // marked by the cell before.)
            let mut last = (usize::MAX, 0usize);
            for (c, &entry) in row.iter().enumerate() {
                let at = b * k + c;
                table[at] = MARKED;
                if entry < 0 {
                    continue;
                }
                let at_token = entry as u64 * per;
                let page = if let Some(sh) = shift {
                    (at_token >> sh) as usize
                } else {
                    (at_token / ps) as usize
                };
                if page == last.0 {
                    cell_entries[at] = last.1 as u32;
                    continue;
                }
                let e = homes[page] as usize * self.layers as usize + layer as usize;
                last = (page, e);
                cell_entries[at] = e as u32;
                // (The second pass reads its slot: fetched while this one goes on.)
                crate::prefetch::prefetch(self.mirror.as_ptr().wrapping_add(e));
                if self.mark[e] != self.serial {
                    self.mark[e] = self.serial;
                    self.reads_now[e / 32] |= 1 << (e % 32);
                    table[at] = MARKED_FIRST;
                }
            }
        }
        let served = self.serve_rows(
            &rows,
            rids,
            selection,
            k,
            (layer, tokens),
            &cell_entries,
            table,
        );
        self.cell_entries = cell_entries;
        served
    }

    /// The second pass of [`Self::resolve_rows`]: each cell's object (`cell_entries`, from the
    /// first pass) mapped to a slot, a miss served from the grant.
    #[allow(clippy::too_many_arguments)]
    fn serve_rows(
        &mut self,
        rows: &[&PageTable],
        rids: &[RequestId],
        selection: &[i32],
        k: usize,
        (layer, tokens): (u16, bool),
        cell_entries: &[u32],
        table: &mut [i32],
    ) -> Result<()> {
        let ps = u64::from(self.page_size);
        let per = if tokens { 1 } else { ps };
        for (b, PageTable { len, .. }) in rows.iter().enumerate() {
            let rid = rids[b];
            let row = &selection[b * k..(b + 1) * k];
            for (c, &entry) in row.iter().enumerate() {
                let at = b * k + c;
                let first_touch = table[at] == MARKED_FIRST;
                table[at] = ABSENT;
                if entry < 0 {
                    continue;
                }
                let first = entry as u64 * per;
                let e = cell_entries[at] as usize;
                // Selected tokens this entry puts in its page.
                let needed = if tokens { 1 } else { ps.min(*len - first) };
                self.counts.selected += 1;
                self.counts.needed_tokens += needed;
                let slot = self.mirror[e];
                if slot >= 0 {
                    table[at] = slot;
                    if first_touch {
                        self.counts.hits[layer as usize] += 1;
                    } else if self.filled[e] == self.serial {
                        // Brought in by this layer: its selected tokens count as moved.
                        self.counts.needed_tokens_moved += needed;
                    }
                    continue;
                }
                if self.failed[e] == self.serial {
                    table[at] = FAILED; // its copy failed this step: no second try
                    self.failed_rids.push(rid);
                    continue;
                }
                let Some((g, slot)) = self.take(layer) else {
                    // No slot: the row has no data here (the core reports the overflow).
                    self.counts.overflow += 1;
                    table[at] = FAILED;
                    self.failed_rids.push(rid);
                    continue;
                };
                // (A miss's home and page: divisions a hit does not pay.)
                let h = (e / self.layers as usize) as u32;
                let page = (first / ps) as u32;
                let copied = self.fetch(h, layer, slot)?;
                self.log.push(LogEntry {
                    g: g as u32,
                    e: e as u32,
                    rid,
                    page,
                    call: self.call,
                    failed: !copied,
                });
                if !copied {
                    // The slot holds nothing the mirror names (a failed copy may have written
                    // part of it): the next miss takes it. The object's later cells fail too.
                    self.failed[e] = self.serial;
                    self.spare.push(g);
                    table[at] = FAILED;
                    self.failed_rids.push(rid);
                    continue;
                }
                self.mirror[e] = slot;
                self.filled[e] = self.serial;
                self.counts.misses[layer as usize] += 1;
                self.counts.needed_tokens_moved += needed;
                table[at] = slot;
            }
        }
        Ok(())
    }

    /// The next slot the step may fill: a granted entry (free, or a victim it did not read:
    /// its mirror entry is cleared), or once the grant is spent, a slot an earlier resolve
    /// call of the step filled (that layer's cells were read before this call: the caller's
    /// contract), oldest first. Returns (its grant index, its slot).
    fn take(&mut self, layer: u16) -> Option<(usize, i32)> {
        let layers = self.layers as usize;
        // A victim read by this layer may still be read by its cells: passed over, and taken
        // by a later layer (whose call comes after this layer's cells were read).
        let read_here = |s: &Self, v: usize| s.mark[v] == s.serial && v % layers == layer as usize;
        if let Some(g) = self.spare.pop() {
            return Some((g, self.grant[g].0));
        }
        // Entries earlier calls deferred come first, in order: their victims are of the layers
        // those calls resolved, never this one's (each layer once a step), so any of them will
        // do; this call's own follow them, for later calls (the kernel's ST_DEF_AT/ST_DEF_LEN).
        if self.def_at < self.def_usable {
            let g = self.deferred[self.def_at];
            self.def_at += 1;
            let (slot, v) = self.grant[g];
            debug_assert!(!read_here(self, v as usize));
            if self.mirror[v as usize] == slot {
                self.mirror[v as usize] = ABSENT;
            }
            return Some((g, slot));
        }
        while let Some(&(slot, victim)) = self.grant.get(self.used) {
            let g = self.used;
            self.used += 1;
            // A victim the mirror no longer names here (it moved or left) is as good as free.
            if victim >= 0 && self.mirror[victim as usize] == slot {
                let v = victim as usize;
                if read_here(self, v) {
                    self.deferred.push(g);
                    continue;
                }
                self.mirror[v] = ABSENT;
            }
            return Some((g, slot));
        }
        while let Some(&en) = self.log.get(self.refill_at) {
            if en.call >= self.call {
                return None; // the rest are this call's: their cells may still be read
            }
            self.refill_at += 1;
            let slot = self.grant[en.g as usize].0;
            if self.mirror[en.e as usize] != slot {
                continue; // filled again since
            }
            self.mirror[en.e as usize] = ABSENT;
            self.counts.refills += 1;
            return Some((en.g as usize, slot));
        }
        None
    }

    /// Copies home `h`'s rows of `layer` into device `slot`, retrying a failed copy once.
    /// Returns whether it was copied.
    fn fetch(&mut self, h: u32, layer: u16, slot: i32) -> Result<bool> {
        for attempt in 0..2 {
            if attempt > 0 {
                self.counts.retried += 1;
            }
            if self.fault(layer) {
                self.counts.failed += 1;
                continue;
            }
            self.copy(h, layer, slot)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Whether an armed fault fails this copy at `layer` (taking it).
    fn fault(&mut self, layer: u16) -> bool {
        let Some(f) = self
            .faults
            .iter_mut()
            .find(|(l, n)| *n > 0 && l.is_none_or(|l| l == layer))
        else {
            return false;
        };
        f.1 -= 1;
        self.faults.retain(|(_, n)| *n > 0);
        true
    }

    /// Copies home `h`'s rows of `layer` into device `slot`, every plane.
    fn copy(&self, h: u32, layer: u16, slot: i32) -> Result<()> {
        let src_page = self.order.flat(h, layer);
        let dst_page = slot as u32;
        let bytes = self.device.page_bytes() as usize;
        for plane in 0..self.device.planes_per_layer() {
            let (Some(src), Some(dst)) = (
                self.host.row_addr_checked(plane, src_page, 0),
                self.device.row_addr_checked(plane, dst_page, 0),
            ) else {
                return Err(Error::config(
                    "slot",
                    slot,
                    "a granted slot of the device pool and a home of the host pool",
                ));
            };
            // SAFETY: both bindings were checked when built (base, extent, page geometry) and
            // stay alive with the scheduler that owns them; `row_addr_checked` bounded page and
            // plane, and a page's `bytes` lie inside its plane. The resolver runs only on CPU
            // memory (the cpu engine): the runtime refuses it for CUDA pools. Source (a host
            // page) and destination (a device slot) are distinct buffers.
            unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes);
            }
        }
        Ok(())
    }
}
