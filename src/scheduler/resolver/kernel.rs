//! The device resolver's CUDA kernel (`cuda/resolve.cu`) as the resolver runs it: the state
//! it keeps in device memory and the protocol around its launches, written once over a
//! [`KernelDevice`] (a GPU, or in test builds the CPU, where the same source runs on threads
//! that race as warps do). Between a step's launches the host does nothing but launch.
//! - When a step opens (one batch of uploads): the core's changes to the mirror since the last
//!   step as (entry, slot) pairs, applied by `sparsetier_mirror_apply`; the grant; the batch's
//!   page tables; the step's serial and grant length in `st`. The log and the deferred list
//!   are filled with NOT_YET.
//! - When it closes (one read-back): `st`, the counts, the log's written entries and a bitmap
//!   of the entries the step read (`sparsetier_marks_read`), never the mirror. The resolver's
//!   mirror (the host's copy) follows the device's from the log alone
//!   ([`ResolverState::close`]); `validate` compares the two
//!   ([`ResolverState::device_mirror_mismatch`], which reads the device's back).

use super::abi::{
    Geometry, Step, LOG_INTS, NOT_YET, ST_BAD, ST_GRANT_LEN, ST_LEN, ST_LOG, ST_LOG_CAP,
    ST_OVERFLOW, ST_ROWS, ST_SERIAL, ST_USED, TOK_NEEDED, TOK_NEEDED_MOVED, TOK_SELECTED,
};
use super::device::KernelDevice;
use super::launch::LaunchArgs;
use super::tables::{DeviceTables, Live, StepTable, TableUpload};
use super::{LogEntry, ResolveCounts, ResolverState, ABSENT, FAILED};
use crate::error::{Error, Result};
use crate::ids::RequestId;
use crate::transfer::{LayerPageOrder, PageTransferBinding};

#[cfg(feature = "host-kernel")]
extern "C" {
    fn sparsetier_layer_host(
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
#[cfg(feature = "host-kernel")]
pub unsafe fn launch_on_host(threads: u32, args: &LaunchArgs) {
    let [cells, k, pages_per_row, layers, layer, page_size, tokens] = args.ints();
    // SAFETY: the caller's contract.
    unsafe {
        sparsetier_layer_host(
            threads.clamp(1, 256) as i32,
            args.sel as *const i32,
            args.rows as *const i32,
            args.tables as *const i32,
            args.lens as *const i64,
            args.table as *mut i32,
            args.step,
            args.geo,
            cells,
            k,
            pages_per_row,
            layers,
            layer,
            page_size,
            tokens,
        )
    }
}

/// A buffer of device memory that grows: its address and room in bytes.
#[derive(Debug, Default, Clone, Copy)]
struct Buf {
    addr: u64,
    bytes: usize,
}

/// Views plain integers as bytes (for uploads and read-backs).
fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: T is a plain integer type here (i32, i64, u32, u64): every byte is initialized
    // and any bytes are a valid value; the length covers the slice exactly.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T: Copy>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as `bytes_of`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// The kernel's state on its device, and what the host keeps of it.
#[derive(Debug)]
pub(crate) struct DeviceKernel {
    dev: Box<dyn KernelDevice>,
    entries: usize,
    layers: u16,
    /// `[entries]`: mirror, read marks, fill marks; `[entries / 32]` the read bitmap.
    mirror: u64,
    marks: u64,
    filled: u64,
    bits: u64,
    /// The plane tables: host planes, then device planes.
    planes: u64,
    /// The kernel's `Geometry`, its plane tables at `planes` (kept as plain data: the struct
    /// holds device addresses as pointers).
    geo: [u64; 6],
    st: u64,
    counts: u64,
    tok: u64,
    /// `[G * 2]` (slot, victim entry or -1) and (grant index, call).
    grant: Buf,
    deferred: Buf,
    /// `[capacity * LOG_INTS]`.
    log: Buf,
    log_capacity: usize,
    grant_len: usize,
    /// The running requests' page tables (kept from step to step), their lengths, the step's
    /// batch as rows of them (a batch that is the step's, in its order, needs no upload of
    /// its rows), and a call's rows otherwise.
    tables: DeviceTables,
    lens: Buf,
    step_rows: Buf,
    rows: Buf,
    /// The uploads' (index, value) pairs: the mirror's changes, the tables'.
    changes: Buf,
    table_changes: Buf,
    /// The host's side: entries the core changed since the step last opened (uploaded when
    /// the next opens); what came back when the last step closed.
    pub(super) changed: Vec<usize>,
    st_host: [u32; ST_LEN],
    counts_host: Vec<u32>,
    tok_host: [u64; 3],
    log_host: Vec<i32>,
    /// A step is open (between `open` and `close`).
    open: bool,
    /// The device's mirror may differ from the host's beyond the changes (a step whose
    /// read-back failed, or whose log lost entries): the next step uploads the whole mirror.
    resync: bool,
    /// The marks are still to clear (the serials wrapped at a step that could not open).
    wrap_pending: bool,
    /// Time the host spent in the device's calls when steps opened and closed (queuing, and
    /// on the CPU the device's work itself; the read-back's wait), in all.
    pub(super) device_ns: u64,
    /// The stream the open step's work is queued on.
    stream: u64,
    /// What a layer's launches take that can change between steps (the buffers' addresses,
    /// the tables' width), as of the last step that opened; `epoch` counts its changes. A
    /// launch captured in a CUDA graph replays correctly in any step of the same epoch.
    launch_sig: [u64; 7],
    pub(super) epoch: u64,
    /// Test builds: the next closes whose read-back fails (as a `cuMemcpyDtoHAsync` can).
    #[cfg(any(test, feature = "testing"))]
    pub(super) fail_closes: u32,
    /// Test builds: launches recorded instead of run, by layer (a CUDA graph's capture, on
    /// the CPU: the arguments kept by value and replayed as they are).
    #[cfg(any(test, feature = "testing"))]
    recorded: rustc_hash::FxHashMap<(u16, usize), Recorded>,
}

/// The rows a launch reads: the step's batch in its order (uploaded when the step opened),
/// or some of the step's requests in another order (uploaded with the launch).
#[derive(Debug, Clone, Copy)]
pub(super) enum Batch<'a> {
    Step,
    Of(&'a [RequestId]),
}

/// Where a captured launch goes ([`DeviceKernel::capture`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum CaptureTo {
    /// A raw `CUstream` a CUDA graph is capturing.
    Stream(u64),
    /// Test builds: kept by value on the host (the CPU device has no graphs).
    #[cfg(any(test, feature = "testing"))]
    Record,
}

/// Test builds: a launch's arguments kept for a replay.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, Copy)]
struct Recorded(LaunchArgs);

// SAFETY: the pointers are addresses kept as values; only the device dereferences them, in
// a replay made under the resolver's lock (the kernel is moved between threads whole).
#[cfg(any(test, feature = "testing"))]
unsafe impl Send for Recorded {}

impl DeviceKernel {
    /// The kernel on `dev` for a resolver over `mirror.len()` entries of `layers` layers,
    /// copying between `host` (homes) and `device` (slots); its mirror and marks start as
    /// `mirror`, `marks` and `filled` (copied in whole, once).
    pub(super) fn new(
        mut dev: Box<dyn KernelDevice>,
        layers: u16,
        (mirror, marks, filled): (&[i32], &[u32], &[u32]),
        host: &PageTransferBinding,
        device: &PageTransferBinding,
        order: LayerPageOrder,
    ) -> Result<Self> {
        let entries = mirror.len();
        if i32::try_from(entries).is_err() {
            return Err(Error::config(
                "host_pages",
                entries,
                "host pages x layers that an int32 mirror index holds",
            ));
        }
        let planes = device.planes_per_layer();
        let mut plane_addrs: Vec<u64> = (0..planes).map(|p| host.row_addr(p, 0, 0)).collect();
        plane_addrs.extend((0..planes).map(|p| device.row_addr(p, 0, 0)));
        let (order_first, order_n) = match order {
            LayerPageOrder::LayerFirst { pages } => (1, pages),
            LayerPageOrder::LayerPageFirst { layers } => (0, layers),
        };
        let words = entries.div_ceil(32);
        let m = dev.alloc(4 * entries)?;
        let mk = dev.alloc(4 * entries)?;
        let f = dev.alloc(4 * entries)?;
        let bits = dev.alloc(4 * words)?;
        let pl = dev.alloc(8 * plane_addrs.len())?;
        let st = dev.alloc(4 * ST_LEN)?;
        let counts = dev.alloc(8 * layers as usize)?;
        let tok = dev.alloc(24)?;
        // SAFETY: each destination was just allocated with room for its bytes (marks that
        // are all zero, as a resolver's are when it starts, are filled rather than copied).
        unsafe {
            let mut parts = vec![(m, bytes_of(mirror)), (pl, bytes_of(&plane_addrs))];
            for (at, v) in [(mk, marks), (f, filled)] {
                if v.iter().all(|&x| x == 0) {
                    dev.fill32(at, 0, entries)?;
                } else {
                    parts.push((at, bytes_of(v)));
                }
            }
            dev.upload(&parts)?
        };
        let geo = [
            host.page_stride(),
            device.page_stride(),
            device.page_bytes(),
            planes as u64,
            order_first,
            u64::from(order_n),
        ];
        Ok(DeviceKernel {
            dev,
            entries,
            layers,
            mirror: m,
            marks: mk,
            filled: f,
            bits,
            planes: pl,
            geo,
            st,
            counts,
            tok,
            grant: Buf::default(),
            deferred: Buf::default(),
            log: Buf::default(),
            log_capacity: 0,
            grant_len: 0,
            tables: DeviceTables::default(),
            lens: Buf::default(),
            step_rows: Buf::default(),
            rows: Buf::default(),
            changes: Buf::default(),
            table_changes: Buf::default(),
            changed: Vec::new(),
            st_host: [0; ST_LEN],
            counts_host: vec![0; 2 * layers as usize],
            tok_host: [0; 3],
            log_host: Vec::new(),
            open: false,
            resync: false,
            wrap_pending: false,
            device_ns: 0,
            stream: 0,
            launch_sig: [0; 7],
            epoch: 0,
            #[cfg(any(test, feature = "testing"))]
            fail_closes: 0,
            #[cfg(any(test, feature = "testing"))]
            recorded: rustc_hash::FxHashMap::default(),
        })
    }

    /// Makes `buf` hold at least `bytes` (grown by powers of two, so a run settles).
    fn room(dev: &mut dyn KernelDevice, buf: &mut Buf, bytes: usize) -> Result<()> {
        if buf.bytes >= bytes && buf.addr != 0 {
            return Ok(());
        }
        let want = bytes.max(64).next_power_of_two();
        let addr = dev.alloc(want)?;
        if buf.addr != 0 {
            dev.free(buf.addr);
        }
        *buf = Buf { addr, bytes: want };
        Ok(())
    }

    /// Opens step `serial` on `stream` over `grant` with room for `log_capacity` log
    /// entries: the changes to the mirror (`mirror` is the host's copy), the grant, what
    /// changed of the batch's page tables (`tables`, in the batch's order; the rows of
    /// requests `live` no longer names are let go) and `st` go in with one batch of uploads;
    /// when the serials wrapped, the marks are cleared.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        &mut self,
        stream: u64,
        grant: &[(i32, i64)],
        serial: u32,
        log_capacity: usize,
        mirror: &[i32],
        wrapped: bool,
        (tables, live): (&[StepTable<'_>], Live<'_>),
    ) -> Result<()> {
        self.dev.set_stream(stream);
        self.stream = stream;
        // The changes, one pair an entry (its value now); after a step that went wrong, all.
        self.changed.sort_unstable();
        self.changed.dedup();
        let pairs: Vec<i32> = if self.resync {
            mirror
                .iter()
                .enumerate()
                .flat_map(|(e, &s)| [e as i32, s])
                .collect()
        } else {
            self.changed
                .iter()
                .flat_map(|&e| [e as i32, mirror[e]])
                .collect()
        };
        // Victims are mirror entries: `new` checked that they fit an int32.
        let g: Vec<i32> = grant
            .iter()
            .flat_map(|&(slot, victim)| [slot, victim as i32])
            .collect();
        let t = self.tables.prepare(&mut *self.dev, tables, live)?;
        // From here a failure leaves the tables' rows unsent and the mirror's changes (or the
        // whole mirror) still to send: the next step sends them again.
        let wrapped = wrapped || self.wrap_pending;
        let sent = self.send_step(&g, &pairs, &t, (serial, log_capacity, wrapped));
        if let Err(e) = sent {
            self.tables.invalidate();
            self.wrap_pending = wrapped;
            return Err(e);
        }
        self.wrap_pending = false;
        self.resync = false;
        self.changed.clear();
        self.grant_len = grant.len();
        self.log_capacity = log_capacity;
        self.open = true;
        let sig = [
            self.grant.addr,
            self.deferred.addr,
            self.log.addr,
            self.lens.addr,
            self.step_rows.addr,
            self.tables.addr,
            self.tables.width as u64,
        ];
        if sig != self.launch_sig {
            self.launch_sig = sig;
            self.epoch += 1;
        }
        Ok(())
    }

    /// Sizes the buffers a launch names for steps of up to `requests` requests (as many
    /// running), `cells` cells a layer and a grant of up to `grant` entries, and page tables
    /// of `pages` pages a request: no step within them moves a buffer (changes the epoch).
    /// Only between steps.
    pub(super) fn reserve(
        &mut self,
        requests: usize,
        (cells, grant, pages): (usize, usize, usize),
    ) -> Result<()> {
        let d = &mut *self.dev;
        Self::room(d, &mut self.grant, 4 * 2 * grant)?;
        Self::room(d, &mut self.deferred, 4 * 2 * grant)?;
        Self::room(
            d,
            &mut self.log,
            4 * LOG_INTS * cells * self.layers as usize,
        )?;
        Self::room(d, &mut self.step_rows, 4 * requests)?;
        self.tables.reserve(d, pages, requests)?;
        // (The lengths go up a row of the tables each.)
        Self::room(d, &mut self.lens, 8 * self.tables.capacity())?;
        Ok(())
    }

    /// `open`'s buffers and uploads, in one batch: the grant `g`, the mirror's `pairs`, the
    /// tables' `t`, and `st` for step `serial` with room for `log_capacity` log entries.
    fn send_step(
        &mut self,
        g: &[i32],
        pairs: &[i32],
        t: &TableUpload,
        (serial, log_capacity, wrapped): (u32, usize, bool),
    ) -> Result<()> {
        let mut st = [0u32; ST_LEN];
        st[ST_GRANT_LEN] = (g.len() / 2) as u32;
        st[ST_SERIAL] = serial;
        // (A step's cells times its layers: far below 2^32, `open`'s cells fit an int32.)
        st[ST_LOG_CAP] = log_capacity as u32;
        st[ST_ROWS] = t.rows.len() as u32;
        let d = &mut *self.dev;
        Self::room(d, &mut self.changes, 4 * pairs.len())?;
        Self::room(d, &mut self.grant, 4 * g.len())?;
        Self::room(d, &mut self.deferred, 4 * g.len())?;
        Self::room(d, &mut self.log, 4 * LOG_INTS * log_capacity)?;
        Self::room(d, &mut self.table_changes, 4 * t.pairs.len())?;
        Self::room(d, &mut self.lens, 8 * t.lens.len())?;
        Self::room(d, &mut self.step_rows, 4 * t.rows.len())?;
        let zero = [0u64; 2 * 64];
        let t0 = std::time::Instant::now();
        // SAFETY: every destination has room for its bytes (sized above, or at `new`); the
        // fills cover the deferred list and the log as sized; the pairs' entries index the
        // mirror (the host's mirror has the device's length) and the tables' pairs the tables
        // (`prepare` sized them); the marks have `entries` words.
        unsafe {
            d.upload(&[
                (self.changes.addr, bytes_of(pairs)),
                (self.table_changes.addr, bytes_of(&t.pairs)),
                (self.grant.addr, bytes_of(g)),
                (self.lens.addr, bytes_of(&t.lens)),
                (self.step_rows.addr, bytes_of(&t.rows)),
                (self.st, bytes_of(&st)),
                (self.tok, bytes_of(&zero[..3])),
            ])?;
            d.fill32(self.counts, 0, 2 * self.layers as usize)?;
            d.fill32(self.deferred.addr, NOT_YET as u32, g.len())?;
            d.fill32(self.log.addr, NOT_YET as u32, LOG_INTS * log_capacity)?;
            d.mirror_apply(self.changes.addr, (pairs.len() / 2) as u32, self.mirror)?;
            d.mirror_apply(
                self.table_changes.addr,
                (t.pairs.len() / 2) as u32,
                self.tables.addr,
            )?;
            if wrapped {
                d.fill32(self.marks, 0, self.entries)?;
                d.fill32(self.filled, 0, self.entries)?;
            }
        }
        self.device_ns += t0.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Queues one layer's launch over `sel` and `table` (device addresses of `cells` int32
    /// each, `k` a row) for the batch `rids`, call `call` of the step. Checks what it can
    /// without reading the device: the batch's requests are the step's.
    ///
    /// # Safety
    /// `sel` and `table` are device-accessible addresses of `cells` int32 each, alive until
    /// the launch has run; `cells` is a multiple of `k` with a row per request of `rids`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn launch(
        &mut self,
        layer: u16,
        batch: Batch<'_>,
        cells: (u64, u64, usize, usize),
        call: u32,
        page_size: u32,
        tokens: bool,
    ) -> Result<()> {
        let args = self.args(layer, batch, cells, call, (page_size, tokens))?;
        // SAFETY: the step's buffers were sized when it opened: the mirror, marks and filled
        // an entry per (home, layer), and the tables' homes are the core's (homes of the host
        // pool); the grant and deferred 2 ints an entry; the log room for every take of the
        // step (one a cell a layer); the counts 2 a layer; `rows` a batch row each, each a row
        // of the step's tables, which have `width` homes a row and a length each. The planes
        // are the bindings', checked when built, and the slots the grant names are pages of
        // the device pool (the core granted them). `sel` and `table` are the caller's.
        unsafe { self.dev.resolve(&args) }
    }

    /// [`Self::launch`] captured instead of run: queued on a stream a CUDA graph is capturing
    /// (`CaptureTo::Stream`), or in test builds kept by value for
    /// [`Self::replay_recorded`] (`CaptureTo::Record`, the CPU, where no graph records it).
    /// The launch runs when the graph is replayed (on the step's stream, in a step of this
    /// epoch), over the step's batch in its order: its rows were uploaded when the step
    /// opened, and a capture can upload nothing.
    ///
    /// # Safety
    /// As [`Self::launch`], with `sel` and `table` alive until every replay has run.
    pub(super) unsafe fn capture(
        &mut self,
        to: CaptureTo,
        (layer, rows): (u16, usize),
        cells: (u64, u64, usize, usize),
        call: u32,
        shape: (u32, bool),
    ) -> Result<()> {
        debug_assert_eq!(rows * cells.3, cells.2, "cells are rows of k");
        let args = self.args(layer, Batch::Step, cells, call, shape)?;
        match to {
            CaptureTo::Stream(stream) => {
                self.dev.set_stream(stream);
                // SAFETY: as `launch`: the buffers stay where they are for the epoch, and a
                // replay in another epoch is refused (`ResolverState::will_replay`).
                let out = unsafe { self.dev.resolve(&args) };
                self.dev.set_stream(self.stream);
                out
            }
            #[cfg(any(test, feature = "testing"))]
            CaptureTo::Record => {
                self.recorded.insert((layer, rows), Recorded(args));
                Ok(())
            }
        }
    }

    /// Test builds: runs the launch recorded for `layer` over `rows` rows with its arguments
    /// as they were (a graph's replay). The host device refuses arguments naming memory it
    /// has freed.
    ///
    /// # Safety
    /// The recorded `sel` and `table` are still alive.
    #[cfg(any(test, feature = "testing"))]
    pub(super) unsafe fn replay_recorded(&mut self, layer: u16, rows: usize) -> Result<()> {
        let Recorded(args) = *self
            .recorded
            .get(&(layer, rows))
            .ok_or_else(|| Error::config("layers", layer, "layers whose launch was recorded"))?;
        // SAFETY: the caller's contract for `sel` and `table`; the device checks the rest.
        unsafe { self.dev.resolve(&args) }
    }

    /// A layer's launch arguments over `cells` = (sel, table, cells, k): the batch's rows (the
    /// step's, or those of some of its requests uploaded now), the step's buffers, the
    /// geometry.
    fn args(
        &mut self,
        layer: u16,
        batch: Batch<'_>,
        (sel, table, cells, k): (u64, u64, usize, usize),
        call: u32,
        (page_size, tokens): (u32, bool),
    ) -> Result<LaunchArgs> {
        // Batch rows to table rows: nothing to upload when the batch is the step's, in order.
        let rows = match batch {
            Batch::Step => self.step_rows.addr,
            Batch::Of(rids) => {
                // (The resolver checked that they are requests of the step, each once.)
                let rows = self.tables.rows_of(rids)?;
                Self::room(&mut *self.dev, &mut self.rows, 4 * rows.len())?;
                // SAFETY: sized just above.
                unsafe { self.dev.upload(&[(self.rows.addr, bytes_of(&rows))])? };
                self.rows.addr
            }
        };
        let step = Step {
            mirror: self.mirror as *mut i32,
            marks: self.marks as *mut u32,
            filled: self.filled as *mut u32,
            grant: self.grant.addr as *const i32,
            deferred: self.deferred.addr as *mut i32,
            log: self.log.addr as *mut i32,
            st: self.st as *mut u32,
            counts: self.counts as *mut u32,
            tok: self.tok as *mut u64,
            call: call as i32,
        };
        Ok(LaunchArgs {
            sel,
            rows,
            tables: self.tables.addr,
            lens: self.lens.addr,
            table,
            step,
            geo: Geometry {
                host_planes: self.planes as *const u64,
                dev_planes: (self.planes + 8 * self.geo[3]) as *const u64,
                host_stride: self.geo[0],
                dev_stride: self.geo[1],
                page_bytes: self.geo[2],
                planes: self.geo[3] as i32,
                order_first: self.geo[4] as i32,
                order_n: self.geo[5] as u32,
            },
            cells: cells as u32,
            k: k as u32,
            pages_per_row: self.tables.width as u32,
            layers: u32::from(self.layers),
            layer: u32::from(layer),
            page_size,
            tokens,
            blocks: None,
        })
    }

    /// Closes the step: reads back `st`, the counts, the log's entries and the read bitmap
    /// (into `read`, a bit per entry). Returns the log and the counts as the reference keeps
    /// them, and the cells that named a page past their request (which the kernel left
    /// without a slot).
    pub(super) fn close(
        &mut self,
        layers: u16,
        read: &mut [u32],
    ) -> Result<(Vec<LogEntry>, ResolveCounts, u64)> {
        self.open = false;
        // Until the step is read back in full, the host cannot tell what it changed.
        self.resync = true;
        #[cfg(any(test, feature = "testing"))]
        if self.fail_closes > 0 {
            // (The step's work is done; the host learns nothing of it.)
            self.fail_closes -= 1;
            return Err(Error::Cuda {
                call: "cuMemcpyDtoHAsync",
                message: "injected: the step's read-back failed".into(),
            });
        }
        if read.len() != self.entries.div_ceil(32) {
            return Err(Error::Internal {
                site: "scheduler::resolver::kernel::close".into(),
                message: format!(
                    "a read bitmap of {} words for {} entries",
                    read.len(),
                    self.entries
                ),
            });
        }
        let t0 = std::time::Instant::now();
        let d = &mut *self.dev;
        // SAFETY: `st` has ST_LEN words and `bits` (as `read`, checked above) a bit an entry;
        // the marks an entry each.
        unsafe {
            d.marks_read(self.marks, self.st, self.entries as u32, self.bits)?;
            d.read(&mut [
                (self.st, bytes_of_mut(&mut self.st_host)),
                (self.counts, bytes_of_mut(&mut self.counts_host)),
                (self.tok, bytes_of_mut(&mut self.tok_host)),
                (self.bits, bytes_of_mut(read)),
            ])?;
        }
        let cap = self.log_capacity;
        let written = self.st_host[ST_LOG] as usize;
        self.log_host.clear();
        self.log_host.resize(written.min(cap) * LOG_INTS, 0);
        // SAFETY: the log has room for `cap` entries, and at most that many are read.
        unsafe {
            self.dev
                .read(&mut [(self.log.addr, bytes_of_mut(&mut self.log_host))])?
        };
        self.device_ns += t0.elapsed().as_nanos() as u64;
        // One pass, no allocation but the log's (a step's misses: thousands of entries).
        let mut log: Vec<LogEntry> = Vec::with_capacity(self.log_host.len() / LOG_INTS);
        let owners = &self.tables.owners;
        // (Every entry the step took is before its cursor: one past it is a bad read-back.)
        let used = self.used();
        for l in self.log_host.chunks_exact(LOG_INTS) {
            let rid = usize::try_from(l[2])
                .ok()
                .and_then(|r| owners.get(r).copied().flatten());
            match rid {
                Some(rid)
                    if (l[0] as u32 as usize) < used && (l[1] as u32 as usize) < self.entries =>
                {
                    log.push(LogEntry {
                        g: l[0] as u32,
                        e: l[1] as u32,
                        rid,
                        page: l[3] as u32,
                        call: l[4] as u32,
                        failed: false,
                    })
                }
                _ => {
                    return Err(Error::Internal {
                        site: "scheduler::resolver::kernel::close".into(),
                        message: format!(
                        "a log entry names no row, grant entry or mirror entry of the step: {l:?}"
                    ),
                    })
                }
            }
        }
        // (Entries past the log's room: copies the host never learns of.)
        self.resync = written > cap;
        let mut seen = vec![false; self.grant_len];
        let mut refills = 0;
        for en in &log {
            let s = &mut seen[en.g as usize];
            refills += u64::from(*s);
            *s = true;
        }
        let counts = ResolveCounts {
            hits: (0..layers as usize)
                .map(|l| u64::from(self.counts_host[2 * l]))
                .collect(),
            misses: (0..layers as usize)
                .map(|l| u64::from(self.counts_host[2 * l + 1]))
                .collect(),
            needed_tokens: self.tok_host[TOK_NEEDED],
            needed_tokens_moved: self.tok_host[TOK_NEEDED_MOVED],
            selected: self.tok_host[TOK_SELECTED],
            // (Entries past the log's room would be copies the core never learns of:
            // reported as cells without a slot, which the core treats as an internal error.)
            overflow: u64::from(self.st_host[ST_OVERFLOW]) + written.saturating_sub(cap) as u64,
            refills,
            failed: 0,
            retried: 0,
        };
        Ok((log, counts, u64::from(self.st_host[ST_BAD])))
    }

    /// Grant entries the last step went through (the kernel's cursor runs past the end).
    pub(super) fn used(&self) -> usize {
        (self.st_host[ST_USED] as usize).min(self.grant_len)
    }

    /// Whether its device is the CPU.
    pub(super) fn on_host(&self) -> bool {
        self.dev.host_memory()
    }

    /// Whether a CUDA graph is capturing `stream`.
    pub(super) fn capturing(&self, stream: u64) -> Result<bool> {
        self.dev.capturing(stream)
    }

    /// The device's mirror, read back (`validate`).
    fn read_mirror(&mut self) -> Result<Vec<i32>> {
        let mut m = vec![0i32; self.entries];
        // SAFETY: the mirror has `entries` words.
        unsafe { self.dev.read(&mut [(self.mirror, bytes_of_mut(&mut m))])? };
        Ok(m)
    }
}

impl Drop for DeviceKernel {
    fn drop(&mut self) {
        self.tables.release(&mut *self.dev);
        for a in [
            self.mirror,
            self.marks,
            self.filled,
            self.bits,
            self.planes,
            self.st,
            self.counts,
            self.tok,
        ] {
            self.dev.free(a);
        }
        for b in [
            self.grant,
            self.deferred,
            self.log,
            self.lens,
            self.step_rows,
            self.rows,
            self.changes,
            self.table_changes,
        ] {
            if b.addr != 0 {
                self.dev.free(b.addr);
            }
        }
    }
}

/// Applies a closed step's `log` (in order) to the host's `mirror`: each entry's slot names
/// the object it filled, and the object the slot held before (the grant's victim, or what an
/// earlier entry of the step filled it with) leaves the slot, unless it moved on meanwhile.
/// `grant` is the step's, (slot, victim entry or -1).
pub(super) fn follow_log(mirror: &mut [i32], grant: &[(i32, i64)], log: &[LogEntry]) {
    // Each entry touches two mirror entries far apart (a cache miss apiece): those a few
    // entries ahead are fetched first, so that the misses overlap.
    const AHEAD: usize = 64;
    let base = mirror.as_ptr();
    let fetch = |en: &LogEntry| {
        crate::prefetch::prefetch(base.wrapping_add(en.e as usize));
        let victim = grant[en.g as usize].1;
        crate::prefetch::prefetch(base.wrapping_add(victim.max(0) as usize));
    };
    log.iter().take(AHEAD).for_each(fetch);
    let mut last: Vec<Option<u32>> = vec![None; grant.len()];
    for (i, en) in log.iter().enumerate() {
        if let Some(next) = log.get(i + AHEAD) {
            fetch(next);
        }
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

impl ResolverState {
    /// Runs the resolver's kernel on `dev` from the next step on. Refused while a step is
    /// open.
    pub(crate) fn use_kernel(&mut self, dev: Box<dyn KernelDevice>) -> Result<()> {
        if self.open {
            return Err(Error::config(
                "step",
                "open",
                "no step granted and not yet ended",
            ));
        }
        let mut kern = DeviceKernel::new(
            dev,
            self.layers,
            (&self.mirror, &self.mark, &self.filled),
            &self.host,
            &self.device,
            self.order,
        )?;
        // Its buffers are new: epochs go on from the old kernel's, and no capture replays.
        kern.epoch = self.kernel.as_ref().map_or(0, |k| k.epoch);
        self.kernel = Some(kern);
        self.forget_captures();
        Ok(())
    }

    /// Time the host spent in the kernel's device calls when steps opened and closed, in all
    /// (`None` on the reference): what a benchmark of the core takes out of a step.
    pub fn kernel_device_ns(&self) -> Option<u64> {
        self.kernel.as_ref().map(|k| k.device_ns)
    }

    /// Test builds: the read-back of each of the next `count` steps fails when the step
    /// closes, as a GPU's can; the step's work is done, and the host learns nothing of it.
    /// The reference reads nothing back: refused there.
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_read_backs(&mut self, count: u32) -> Result<()> {
        let k = self.kernel.as_mut().ok_or_else(|| {
            Error::config(
                "resolver",
                "the reference",
                "the kernel (use_host_kernel, or CUDA pools): the reference reads nothing back",
            )
        })?;
        k.fail_closes = count;
        Ok(())
    }

    /// Runs the kernel's source for every later step (test builds): on the CPU, `threads`
    /// threads a launch. Refused while a step is open.
    #[cfg(feature = "host-kernel")]
    pub fn use_host_kernel(&mut self, threads: usize) -> Result<()> {
        let threads = u32::try_from(threads)
            .ok()
            .filter(|&t| (1..=256).contains(&t))
            .ok_or_else(|| Error::out_of_range("threads", threads as u64, 1, 257))?;
        self.use_kernel(Box::new(super::device::HostDevice::new(threads)))
    }

    /// Where the kernel's mirror (read back from its device) differs from the host's, outside
    /// a step, other than by the changes the next step applies: the first such entry
    /// (`validate`). `None` on the reference, or when they agree.
    pub(crate) fn device_mirror_mismatch(&mut self) -> Option<String> {
        if self.open {
            return None;
        }
        let k = self.kernel.as_mut()?;
        if k.resync {
            return None; // known to differ: the next step uploads the whole mirror
        }
        let dev = match k.read_mirror() {
            Ok(m) => m,
            Err(e) => return Some(format!("the device's mirror could not be read: {e}")),
        };
        let pending: rustc_hash::FxHashSet<usize> = k.changed.iter().copied().collect();
        let e =
            (0..self.mirror.len()).find(|&e| dev[e] != self.mirror[e] && !pending.contains(&e))?;
        Some(format!(
            "the device's mirror has {} for entry {e} (home {}, layer {}), the host's {}",
            dev[e],
            e / self.layers as usize,
            e % self.layers as usize,
            self.mirror[e]
        ))
    }

    /// [`ResolverState::resolve_layer`] by the kernel, over host memory (its device is the
    /// CPU): one layer (its two launches) for the batch, whose entries the caller checked.
    pub(super) fn launch_on_host_memory(
        &mut self,
        layer: u16,
        rids: &[RequestId],
        selection: &[i32],
        (k, tokens): (usize, bool),
        table: &mut [i32],
    ) -> Result<()> {
        if !self.kernel.as_ref().is_some_and(|k| k.dev.host_memory()) {
            return Err(Error::config(
                "selection",
                "host memory",
                "device tensors: the resolver runs on a GPU (resolve_device)",
            ));
        }
        let cells = (
            selection.as_ptr() as u64,
            table.as_mut_ptr() as u64,
            selection.len(),
            k,
        );
        #[cfg(any(test, feature = "testing"))]
        if self.recording {
            // SAFETY: nothing runs now; the caller of a replay keeps the slices alive.
            return unsafe { self.capture_launch(CaptureTo::Record, (layer, rids), cells, tokens) };
        }
        let batch = self.batch(rids);
        let kern = self.kernel.as_mut().expect("checked above");
        let call = self.call + 1;
        // SAFETY: `selection` and `table` are live host slices of `cells` int32 (checked by
        // the caller), borrowed until the call returns, and the device runs its launches in
        // this process's memory before returning; `cells` is a row of `k` per request of
        // `rids`, then padding rows only when `rids` is the step's batch in order (the
        // kernel bounds the rows it reads by the step's).
        unsafe {
            kern.launch(layer, batch, cells, call, self.page_size, tokens)?;
        }
        self.call = call;
        self.resolved[layer as usize] = true;
        for (b, row) in table.chunks(k.max(1)).take(rids.len()).enumerate() {
            for _ in row.iter().filter(|&&s| s == FAILED) {
                self.failed_rids.push(rids[b]);
            }
        }
        Ok(())
    }
}
