//! The device resolver's CUDA kernel (`cuda/resolve.cu`) run on the CPU, in place of the
//! reference (test builds, feature `host-kernel`): the same source compiled for the host
//! (`cuda/host/resolve_host.cpp`), launched over CPU threads that race as warps do, on the
//! protocol a GPU's copy follows. The kernel's state ("device memory": its mirror, read and
//! fill marks, the step's page tables, grant, log, cursors and counts) lives here, apart from
//! the resolver's; between a step's launches the host does nothing but launch.
//! - When a step opens: the core's changes to the mirror since the last step go in as
//!   (entry, slot) pairs, applied by `sparsetier_mirror_apply`; the batch's page tables, the
//!   grant, the step's serial and the log (its calls NOT_YET) are written.
//! - When it closes: the log, the counts and a bitmap of the entries the step read
//!   (`sparsetier_marks_read`) come back, never the mirror. The resolver's mirror (the host's
//!   copy) follows the device's from the log alone ([`ResolverState::close`]); the two are
//!   compared by `validate` ([`ResolverState::device_mirror_mismatch`]).

use super::abi::{
    Geometry, Step, LOG_INTS, NOT_YET, ST_BAD, ST_GRANT_LEN, ST_LEN, ST_LOG, ST_OVERFLOW,
    ST_SERIAL, ST_USED, TOK_NEEDED, TOK_NEEDED_MOVED, TOK_SELECTED,
};
use super::{LogEntry, ResolveCounts, ResolverState, ABSENT, FAILED};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::transfer::{LayerPageOrder, PageTransferBinding};

extern "C" {
    fn sparsetier_resolve_host(
        threads: i32,
        sel: *const i32,
        rows: *const i32,
        tables: *const i32,
        lens: *const i64,
        table: *mut i32,
        s: Step,
        geo: Geometry,
        cells: i32,
        k: i32,
        pages_per_row: i32,
        layers: i32,
        layer: i32,
        page_size: i32,
        tokens: i32,
    );
    fn sparsetier_mirror_apply_host(threads: i32, changes: *const i32, n: i32, mirror: *mut i32);
    fn sparsetier_marks_read_host(
        threads: i32,
        marks: *const u32,
        st: *const u32,
        entries: i32,
        bits: *mut u32,
    );
}

/// Launches the kernel on `threads` CPU threads (1 to 256) over `args` (host addresses);
/// returns when it is done.
///
/// # Safety
/// As [`super::launch::ResolveKernel::launch`], with host memory for device memory.
pub unsafe fn launch_on_host(threads: u32, args: &super::launch::LaunchArgs) {
    // SAFETY: the caller's contract.
    unsafe {
        sparsetier_resolve_host(
            threads.clamp(1, 256) as i32,
            args.sel as *const i32,
            args.rows as *const i32,
            args.tables as *const i32,
            args.lens as *const i64,
            args.table as *mut i32,
            args.step,
            args.geo,
            args.cells as i32,
            args.k as i32,
            args.pages_per_row as i32,
            args.layers as i32,
            args.layer as i32,
            args.page_size as i32,
            i32::from(args.tokens),
        )
    }
}

/// The kernel's own state ("device memory"), and how many threads a launch runs.
#[derive(Debug)]
pub(super) struct HostKernel {
    threads: i32,
    /// `[G * 2]`: (slot, victim entry or -1).
    grant: Vec<i32>,
    /// `[G * 2]`: (grant index, call), call [`NOT_YET`] until written.
    deferred: Vec<i32>,
    /// `[capacity * LOG_INTS]`, sized when a step opens (as on a GPU, where nothing is read
    /// back between launches).
    log: Vec<i32>,
    st: [u32; ST_LEN],
    /// `[homes * layers]` mirror, read marks and fill marks.
    mirror: Vec<i32>,
    marks: Vec<u32>,
    filled: Vec<u32>,
    /// `[layers * 2]`: hits, misses.
    counts: Vec<u32>,
    tok: [u64; 3],
    /// The step's page tables: a row per request of the step (`rids`), `width` homes each,
    /// and their lengths; `ident` maps batch row `b` to table row `b` (the batch is the
    /// step's, in its order: nothing to upload per launch).
    rids: Vec<RequestId>,
    tables: Vec<i32>,
    lens: Vec<i64>,
    width: usize,
    ident: Vec<i32>,
    /// The host's side: mirror entries the core changed since the step last opened (uploaded
    /// when the next opens), and the read bitmap of the last step (read back when it closed).
    pub(super) changed: Vec<usize>,
    read: Vec<u32>,
}

impl HostKernel {
    /// A kernel run on `threads` CPU threads, for a resolver over `entries` mirror entries,
    /// its mirror and marks as `mirror`, `marks` and `filled` (copied in whole once).
    pub(super) fn new(
        threads: usize,
        mirror: &[i32],
        marks: &[u32],
        filled: &[u32],
    ) -> Result<Self> {
        let threads = i32::try_from(threads)
            .ok()
            .filter(|&t| (1..=256).contains(&t))
            .ok_or_else(|| Error::out_of_range("threads", threads as u64, 1, 257))?;
        let entries = mirror.len();
        if i32::try_from(entries).is_err() {
            return Err(Error::config(
                "host_pages",
                entries,
                "host pages x layers that an int32 mirror index holds",
            ));
        }
        Ok(HostKernel {
            threads,
            grant: Vec::new(),
            deferred: Vec::new(),
            log: Vec::new(),
            st: [0; ST_LEN],
            mirror: mirror.to_vec(),
            marks: marks.to_vec(),
            filled: filled.to_vec(),
            counts: Vec::new(),
            tok: [0; 3],
            rids: Vec::new(),
            tables: Vec::new(),
            lens: Vec::new(),
            width: 1,
            ident: Vec::new(),
            changed: Vec::new(),
            read: vec![0; entries.div_ceil(32)],
        })
    }

    /// Starts step `serial` over `grant` with room for `log_capacity` log entries: applies
    /// the changes to the mirror (`mirror` is the host's copy; when the serials wrapped, the
    /// marks are cleared) and writes the batch's page tables (`tables`: per request of the
    /// step, its homes and length).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        &mut self,
        grant: &[(i32, i64)],
        layers: u16,
        serial: u32,
        log_capacity: usize,
        mirror: &[i32],
        wrapped: bool,
        tables: &[(RequestId, &[u32], u64)],
    ) {
        // The changes, one pair an entry (its value now), applied in parallel.
        self.changed.sort_unstable();
        self.changed.dedup();
        let pairs: Vec<i32> = self
            .changed
            .drain(..)
            .flat_map(|e| [e as i32, mirror[e]])
            .collect();
        // SAFETY: `pairs` holds `n` (entry, slot) pairs; every entry indexes the mirror (the
        // host's mirror has the kernel's length, and `new` checked it fits an int32); nothing
        // else touches the kernel's mirror while `&mut self` is held, and the call joins its
        // threads before it returns.
        unsafe {
            sparsetier_mirror_apply_host(
                self.threads,
                pairs.as_ptr(),
                (pairs.len() / 2) as i32,
                self.mirror.as_mut_ptr(),
            )
        };
        if wrapped {
            self.marks.fill(0);
            self.filled.fill(0);
        }
        self.grant.clear();
        for &(slot, victim) in grant {
            // Victims are mirror entries: `new` checked that they fit an int32.
            self.grant.extend([slot, victim as i32]);
        }
        self.deferred.clear();
        for _ in grant {
            self.deferred.extend([0, NOT_YET]);
        }
        // Each entry's call reads NOT_YET until the entry is written.
        self.log.clear();
        self.log.resize(log_capacity * LOG_INTS, 0);
        for en in self.log.chunks_mut(LOG_INTS) {
            en[LOG_INTS - 1] = NOT_YET;
        }
        self.width = tables.iter().map(|t| t.1.len()).max().unwrap_or(0).max(1);
        self.rids.clear();
        self.tables.clear();
        self.tables.resize(tables.len() * self.width, 0);
        self.lens.clear();
        for (r, &(id, homes, len)) in tables.iter().enumerate() {
            self.rids.push(id);
            for (p, &h) in homes.iter().enumerate() {
                self.tables[r * self.width + p] = h as i32;
            }
            self.lens.push(len as i64);
        }
        self.ident = (0..tables.len() as i32).collect();
        self.st = [0; ST_LEN];
        self.st[ST_GRANT_LEN] = grant.len() as u32;
        self.st[ST_SERIAL] = serial;
        self.counts = vec![0; 2 * layers as usize];
        self.tok = [0; 3];
    }

    /// The step's log, read once when it closes (as from a GPU), and how many entries did
    /// not fit (none: a step's capacity is a layer's cells times its layers, and a cell takes
    /// at most one entry).
    pub(super) fn log_entries(&self) -> (Vec<LogEntry>, u64) {
        let cap = self.log.len() / LOG_INTS;
        let written = self.st[ST_LOG] as usize;
        let entries = self.log[..written.min(cap) * LOG_INTS]
            .chunks(LOG_INTS)
            .map(|l| LogEntry {
                g: l[0] as u32,
                e: l[1] as u32,
                rid: self.rids[l[2] as usize],
                page: l[3] as u32,
                call: l[4] as u32,
                failed: false,
            })
            .collect();
        (entries, written.saturating_sub(cap) as u64)
    }

    /// The step's counts as the reference keeps them; `log` is the step's log, in order.
    pub(super) fn counts(&self, layers: u16, log: &[LogEntry]) -> ResolveCounts {
        let mut seen = vec![false; self.grant.len() / 2];
        let mut refills = 0;
        for en in log {
            let s = &mut seen[en.g as usize];
            refills += u64::from(*s);
            *s = true;
        }
        ResolveCounts {
            hits: (0..layers as usize)
                .map(|l| u64::from(self.counts[2 * l]))
                .collect(),
            misses: (0..layers as usize)
                .map(|l| u64::from(self.counts[2 * l + 1]))
                .collect(),
            needed_tokens: self.tok[TOK_NEEDED],
            needed_tokens_moved: self.tok[TOK_NEEDED_MOVED],
            selected: self.tok[TOK_SELECTED],
            overflow: u64::from(self.st[ST_OVERFLOW]),
            refills,
            failed: 0,
            retried: 0,
        }
    }

    /// Reads back which entries the step read, as a bitmap made on the device.
    pub(super) fn read_marks(&mut self) {
        // SAFETY: `marks` has an entry per mirror entry and `read` a bit each, rounded up to
        // whole words; `st` is the step's; `&mut self` is held and the call joins its threads.
        unsafe {
            sparsetier_marks_read_host(
                self.threads,
                self.marks.as_ptr(),
                self.st.as_ptr(),
                self.marks.len() as i32,
                self.read.as_mut_ptr(),
            )
        };
    }

    /// Whether the last step read entry `e` (its bit, read back when it closed).
    pub(super) fn was_read(&self, e: usize) -> bool {
        self.read[e / 32] >> (e % 32) & 1 == 1
    }

    /// Grant entries the step went through (the kernel's cursor runs past the end).
    pub(super) fn used(&self) -> usize {
        (self.st[ST_USED] as usize).min(self.grant.len() / 2)
    }
}

/// Applies a closed step's `log` (in order) to the host's `mirror`: each entry's slot names
/// the object it filled, and the object the slot held before (the grant's victim, or what an
/// earlier entry of the step filled it with) leaves the slot, unless it moved on meanwhile.
/// `grant` is the step's, (slot, victim entry or -1).
pub(super) fn follow_log(mirror: &mut [i32], grant: &[(i32, i64)], log: &[LogEntry]) {
    let mut last: Vec<Option<u32>> = vec![None; grant.len()];
    for en in log {
        let (slot, victim) = grant[en.g as usize];
        let before = match last[en.g as usize] {
            Some(e) => Some(e as usize),
            None => usize::try_from(victim).ok(),
        };
        if let Some(b) = before {
            if mirror[b] == slot {
                mirror[b] = ABSENT;
            }
        }
        mirror[en.e as usize] = slot;
        last[en.g as usize] = Some(en.e);
    }
}

/// The kernel's geometry over the resolver's bindings (planes of one flattened layer).
fn geometry(
    host: &PageTransferBinding,
    device: &PageTransferBinding,
    order: LayerPageOrder,
) -> (Vec<u64>, Vec<u64>, Geometry) {
    let planes = device.planes_per_layer();
    let host_planes: Vec<u64> = (0..planes).map(|p| host.row_addr(p, 0, 0)).collect();
    let dev_planes: Vec<u64> = (0..planes).map(|p| device.row_addr(p, 0, 0)).collect();
    let (order_first, order_n) = match order {
        LayerPageOrder::LayerFirst { pages } => (1, pages),
        LayerPageOrder::LayerPageFirst { layers } => (0, layers),
    };
    let geo = Geometry {
        host_planes: host_planes.as_ptr(),
        dev_planes: dev_planes.as_ptr(),
        host_stride: host.page_stride(),
        dev_stride: device.page_stride(),
        page_bytes: device.page_bytes(),
        planes: planes as i32,
        order_first,
        order_n,
    };
    (host_planes, dev_planes, geo)
}

impl ResolverState {
    /// Runs the kernel's source for every later step (test builds): `threads` CPU threads a
    /// launch. Refused while a step is open.
    pub fn use_host_kernel(&mut self, threads: usize) -> Result<()> {
        if self.open {
            return Err(Error::config(
                "step",
                "open",
                "no step granted and not yet ended",
            ));
        }
        self.kernel = Some(HostKernel::new(
            threads,
            &self.mirror,
            &self.mark,
            &self.filled,
        )?);
        Ok(())
    }

    /// Where the kernel's mirror ("device memory") differs from the host's, outside a step,
    /// other than by the changes the next step applies: the first such entry (`validate`).
    pub(crate) fn device_mirror_mismatch(&self) -> Option<String> {
        let k = self.kernel.as_ref()?;
        if self.open {
            return None;
        }
        let pending: rustc_hash::FxHashSet<usize> = k.changed.iter().copied().collect();
        let e = (0..self.mirror.len())
            .find(|&e| k.mirror[e] != self.mirror[e] && !pending.contains(&e))?;
        Some(format!(
            "the device's mirror has {} for entry {e} (home {}, layer {}), the host's {}",
            k.mirror[e],
            e / self.layers as usize,
            e % self.layers as usize,
            self.mirror[e]
        ))
    }

    /// [`ResolverState::resolve_layer`] by the kernel: one launch for the batch. The
    /// arguments were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_host_kernel(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[i32],
        k: usize,
        tokens: bool,
        table: &mut [i32],
    ) -> Result<()> {
        let kern = self.kernel.as_mut().expect("the kernel chosen");
        // Batch rows to table rows: none to upload when the batch is the step's, in order.
        let own: Vec<i32>;
        let rows: &[i32] = if rids == kern.rids.as_slice() {
            &kern.ident
        } else {
            own = rids
                .iter()
                .map(|id| {
                    kern.rids
                        .iter()
                        .position(|r| r == id)
                        .map(|r| r as i32)
                        .ok_or_else(|| Error::config("rids", id, "requests of the granted step"))
                })
                .collect::<Result<_>>()?;
            &own
        };
        let cells = selection.len();
        let layers = self.layers;
        let page_size = self.page_size;
        let call = self.call as i32;
        let (host_planes, dev_planes, geo) = geometry(&self.host, &self.device, self.order);
        let step = Step {
            mirror: kern.mirror.as_mut_ptr(),
            marks: kern.marks.as_mut_ptr(),
            filled: kern.filled.as_mut_ptr(),
            grant: kern.grant.as_ptr(),
            deferred: kern.deferred.as_mut_ptr(),
            log: kern.log.as_mut_ptr(),
            log_capacity: (kern.log.len() / LOG_INTS) as i32,
            st: kern.st.as_mut_ptr(),
            counts: kern.counts.as_mut_ptr(),
            tok: kern.tok.as_mut_ptr(),
            call,
        };
        let args = super::launch::LaunchArgs {
            sel: selection.as_ptr() as u64,
            rows: rows.as_ptr() as u64,
            tables: kern.tables.as_ptr() as u64,
            lens: kern.lens.as_ptr() as u64,
            table: table.as_mut_ptr() as u64,
            step,
            geo,
            cells: cells as u32,
            k: k as u32,
            pages_per_row: kern.width as u32,
            layers: u32::from(layers),
            layer: u32::from(layer),
            page_size,
            tokens,
            blocks: None,
        };
        // SAFETY: every pointer is to a live buffer of the length the kernel indexes: the
        // mirror, marks and filled have an entry per (home, layer) and the tables' homes come
        // from the core's pages (homes of the host pool); the grant and deferred have 2 ints
        // an entry; the log has room for every take of the step (one a cell a layer); the
        // counts have 2 a layer; `sel`, `table` have `cells`; `rows` one a batch row, each a
        // row of the step's tables, which have `width` homes a row and a length each. The planes' addresses are the bindings', checked when built,
        // and the slots the grant names are pages of the device pool (the core granted them).
        // Nothing else touches these buffers until the call returns: `&mut self` is held, and
        // the launch joins its threads before returning. Host (a home) and device (a slot)
        // pages are distinct buffers.
        unsafe { launch_on_host(kern.threads as u32, &args) };
        drop((host_planes, dev_planes));
        for (b, row) in table.chunks(k.max(1)).enumerate() {
            for _ in row.iter().filter(|&&s| s == FAILED) {
                self.failed_rids.push(rids[b]);
            }
        }
        let bad = std::mem::take(&mut kern.st[ST_BAD]);
        if bad > 0 {
            return Err(Error::config(
                "selection",
                format!("{bad} entries past their request's tokens"),
                "entries inside their requests' tokens",
            ));
        }
        Ok(())
    }
}
