//! The device resolver's CUDA kernel (`cuda/resolve.cu`) run on the CPU, in place of the
//! reference (test builds, feature `host-kernel`): the same source compiled for the host
//! (`cuda/host/resolve_host.cpp`), launched over CPU threads that race as warps do, on the
//! same protocol a GPU's copy would follow: the kernel works on its own copies of the mirror,
//! read marks and fill marks ("device memory"), the resolver's mirror is copied in when a step
//! opens and the mirror and marks copied back when it closes, so the core reads and changes
//! them only between steps, as it must on a GPU. The state the kernel keeps in its own form
//! (the grant, deferred victims, the log, cursors and counts) lives here too, set up when a
//! step opens; the log and the counts are read once when it closes, so that between launches
//! the host does nothing but launch, and the core reconciles a kernel's step as it does the
//! reference's.

use super::abi::{
    Geometry, Step, CLAIMING, LOG_INTS, NOT_YET, ST_BAD, ST_GRANT_LEN, ST_LEN, ST_LOG, ST_OVERFLOW,
    ST_SERIAL, ST_USED, TOK_NEEDED, TOK_NEEDED_MOVED, TOK_SELECTED,
};
use super::{LogEntry, ResolveCounts, ResolverState, FAILED};
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

/// The kernel's own state for one step, and how many threads a launch runs.
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
    /// Per launch of the step, its batch's requests (a log entry's row is one of them).
    call_rids: Vec<Vec<RequestId>>,
    st: [u32; ST_LEN],
    /// The kernel's copies: `[homes * layers]` mirror, read marks and fill marks.
    mirror: Vec<i32>,
    marks: Vec<u32>,
    filled: Vec<u32>,
    /// `[layers * 2]`: hits, misses.
    counts: Vec<u32>,
    tok: [u64; 3],
}

impl HostKernel {
    /// A kernel run on `threads` CPU threads, for a resolver over `entries` mirror entries.
    pub(super) fn new(threads: usize, entries: usize) -> Result<Self> {
        let threads = i32::try_from(threads)
            .ok()
            .filter(|&t| (1..=256).contains(&t))
            .ok_or_else(|| Error::out_of_range("threads", threads as u64, 1, 257))?;
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
            call_rids: Vec::new(),
            st: [0; ST_LEN],
            mirror: vec![-1; entries],
            marks: vec![0; entries],
            filled: vec![0; entries],
            counts: Vec::new(),
            tok: [0; 3],
        })
    }

    /// Starts step `serial` over `grant` with room for `log_capacity` log entries, the
    /// resolver's `mirror` copied in (and when the serials wrapped, the marks cleared).
    pub(super) fn open(
        &mut self,
        grant: &[(i32, i64)],
        layers: u16,
        serial: u32,
        log_capacity: usize,
        mirror: &[i32],
        wrapped: bool,
    ) {
        self.mirror.copy_from_slice(mirror);
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
        self.call_rids.clear();
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
                rid: self.call_rids[l[4] as usize - 1][l[2] as usize],
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

    /// Copies the kernel's mirror and read marks back to the resolver's (the step closed).
    pub(super) fn download(&self, mirror: &mut [i32], marks: &mut [u32]) {
        debug_assert!(!self.mirror.contains(&CLAIMING));
        mirror.copy_from_slice(&self.mirror);
        marks.copy_from_slice(&self.marks);
    }

    /// Grant entries the step went through (the kernel's cursor runs past the end).
    pub(super) fn used(&self) -> usize {
        (self.st[ST_USED] as usize).min(self.grant.len() / 2)
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
        let mut k = HostKernel::new(threads, self.mirror.len())?;
        k.marks.copy_from_slice(&self.mark);
        k.filled.copy_from_slice(&self.filled);
        self.kernel = Some(k);
        Ok(())
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
        // Each batch row its own table row: (homes, len), as the device would hold them.
        let mut width = 0;
        for id in rids {
            let t = self
                .tables
                .get(id)
                .ok_or_else(|| Error::config("rids", id, "requests of the granted step"))?;
            width = width.max(t.homes.len());
        }
        let width = width.max(1);
        let mut homes = vec![0i32; rids.len() * width];
        let mut lens = Vec::with_capacity(rids.len());
        for (b, id) in rids.iter().enumerate() {
            let t = &self.tables[id];
            for (p, &h) in t.homes.iter().enumerate() {
                homes[b * width + p] = h as i32;
            }
            lens.push(t.len as i64);
        }
        let rows: Vec<i32> = (0..rids.len() as i32).collect();
        let cells = selection.len();
        let layers = self.layers;
        let page_size = self.page_size;
        let call = self.call as i32;
        let (host_planes, dev_planes, geo) = geometry(&self.host, &self.device, self.order);
        let kern = self.kernel.as_mut().expect("the kernel chosen");
        kern.call_rids.push(rids.to_vec());
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
            tables: homes.as_ptr() as u64,
            lens: lens.as_ptr() as u64,
            table: table.as_mut_ptr() as u64,
            step,
            geo,
            cells: cells as u32,
            k: k as u32,
            pages_per_row: width as u32,
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
        // counts have 2 a layer; `sel`, `table` have `cells`; `rows`, `lens` one a row and
        // `homes` `width` a row. The planes' addresses are the bindings', checked when built,
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
