//! The device resolver's kernel (`cuda/resolve.cu`) launched on a GPU: its cubin for the
//! device's architecture (NVRTC, cached on disk), and a layer's two launches (its marks, then
//! the resolve) on the caller's stream.
//! The caller owns the buffers and their contents; what the kernel indexes with them is the
//! caller's contract ([`ResolveKernel::launch`]). Used by the runtime's resolver on CUDA pools
//! (`gpu`) and by the GPU check of the kernel (`sparsetier.tools.resolver_gpu`, through
//! `_testing.ResolveKernel`).

use super::abi::{Geometry, Step};
use crate::error::Result;
use crate::transfer::cubin::{arch_of, cubin_of, RESOLVE};
use crate::transfer::cuda::{check, check_libraries, cuda_err, guarded, CurrentContext};
use cudarc::driver::{sys, CudaContext, CudaFunction};
use std::ffi::c_void;
use std::sync::Arc;

/// The kernels' names in `cuda/resolve.cu`.
const MARK: &str = "sparsetier_mark";
const NAME: &str = "sparsetier_resolve";
const APPLY: &str = "sparsetier_mirror_apply";
const MARKS: &str = "sparsetier_marks_read";
/// Threads a block: 8 warps, one cell each at a time.
const THREADS: u32 = 256;

/// One layer's launch: the buffers (device addresses) and the sizes.
#[derive(Debug, Clone, Copy)]
pub struct LaunchArgs {
    /// `[cells]` int32 entries (-1 = none).
    pub sel: u64,
    /// `[cells / k]` int32: each batch row's page-table row.
    pub rows: u64,
    /// `[table rows * pages_per_row]` int32 homes.
    pub tables: u64,
    /// `[table rows]` int64 lengths in tokens.
    pub lens: u64,
    /// `[cells]` int32 out: each cell's slot.
    pub table: u64,
    /// The step's state (device addresses).
    pub step: Step,
    /// Where the host and device pages lie (device-readable plane tables).
    pub geo: Geometry,
    /// Cells: rows x k.
    pub cells: u32,
    /// Entries a row.
    pub k: u32,
    /// Width of a page-table row.
    pub pages_per_row: u32,
    /// Layers of the mirror (entry = home x layers + layer).
    pub layers: u32,
    /// The layer resolved.
    pub layer: u32,
    /// Tokens a page.
    pub page_size: u32,
    /// Entries are tokens (else pages).
    pub tokens: bool,
    /// Blocks to launch for each of the layer's two kernels (each strides over the cells);
    /// `None`: a thread a cell for the marks and a warp a cell for the resolve, at most 4096
    /// blocks each.
    pub blocks: Option<u32>,
}

impl LaunchArgs {
    /// The kernel's int parameters, in its order: cells, k, pages_per_row, layers, layer,
    /// page_size, tokens.
    pub fn ints(&self) -> [i32; 7] {
        [
            self.cells as i32,
            self.k as i32,
            self.pages_per_row as i32,
            self.layers as i32,
            self.layer as i32,
            self.page_size as i32,
            i32::from(self.tokens),
        ]
    }
}

/// The kernel, loaded on one device.
pub struct ResolveKernel {
    ctx: Arc<CudaContext>,
    mark: CudaFunction,
    func: CudaFunction,
    apply: CudaFunction,
    marks: CudaFunction,
}

impl std::fmt::Debug for ResolveKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResolveKernel")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

impl ResolveKernel {
    /// Loads the kernel on device `ordinal`: a cubin for its architecture, compiled once and
    /// kept on disk. The caller's current context is left as it was.
    pub fn new(ordinal: usize) -> Result<Self> {
        check_libraries(true)?;
        guarded("resolve kernel setup", || {
            let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
            let _bound = CurrentContext::bind(&ctx)?;
            let (major, minor) = ctx
                .compute_capability()
                .map_err(cuda_err("cuDeviceGetAttribute"))?;
            let image = cubin_of(RESOLVE, &arch_of(major, minor), None)?.image;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                .map_err(cuda_err("cuModuleLoadData"))?;
            let load = |name| {
                module
                    .load_function(name)
                    .map_err(cuda_err("cuModuleGetFunction"))
            };
            Ok(ResolveKernel {
                mark: load(MARK)?,
                func: load(NAME)?,
                apply: load(APPLY)?,
                marks: load(MARKS)?,
                ctx,
            })
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's primary context.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Queues `sparsetier_mirror_apply` over `n` (entry, slot) pairs at `changes`.
    ///
    /// # Safety
    /// `changes` holds `n` int32 pairs in device memory, each entry an index of `mirror`;
    /// `stream` is a live stream of this device's primary context.
    pub unsafe fn launch_mirror_apply(
        &self,
        stream: u64,
        changes: u64,
        n: u32,
        mirror: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (mut c, mut n, mut m) = (changes, n as i32, mirror);
        let mut params: [*mut c_void; 3] = [
            &mut c as *mut u64 as *mut c_void,
            &mut n as *mut i32 as *mut c_void,
            &mut m as *mut u64 as *mut c_void,
        ];
        let blocks = (n as u32).div_ceil(THREADS).min(4096);
        // SAFETY: the parameters match the kernel's (two device pointers around an int), each
        // a live local; the buffers are the caller's contract.
        unsafe { self.raw_launch(&self.apply, blocks, stream, &mut params) }
    }

    /// Queues `sparsetier_marks_read`: bit e of `bits` set where `marks[e]` is `st`'s serial.
    ///
    /// # Safety
    /// `marks` has `entries` u32, `st` the kernel's `st`, `bits` `entries / 32` words rounded
    /// up, all device memory of this device; `stream` a live stream of its primary context.
    pub unsafe fn launch_marks_read(
        &self,
        stream: u64,
        marks: u64,
        st: u64,
        entries: u32,
        bits: u64,
    ) -> Result<()> {
        let (mut m, mut s, mut e, mut b) = (marks, st, entries as i32, bits);
        let mut params: [*mut c_void; 4] = [
            &mut m as *mut u64 as *mut c_void,
            &mut s as *mut u64 as *mut c_void,
            &mut e as *mut i32 as *mut c_void,
            &mut b as *mut u64 as *mut c_void,
        ];
        let blocks = entries.div_ceil(32).div_ceil(THREADS).clamp(1, 4096);
        // SAFETY: the parameters match the kernel's, each a live local; the buffers are the
        // caller's contract.
        unsafe { self.raw_launch(&self.marks, blocks, stream, &mut params) }
    }

    /// Launches `func` on `blocks` blocks of [`THREADS`] with `params` on `stream`.
    ///
    /// # Safety
    /// `params` are pointers to the kernel's parameters in order, alive for the call; what
    /// the kernel indexes is the caller's contract.
    unsafe fn raw_launch(
        &self,
        func: &CudaFunction,
        blocks: u32,
        stream: u64,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let _bound = CurrentContext::bind(&self.ctx)?;
        // SAFETY: the function is loaded in this context (bound above); the parameters are
        // the caller's contract, copied by the driver at the call.
        let r = unsafe {
            sys::cuLaunchKernel(
                func.cu_function(),
                blocks.max(1),
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream as sys::CUstream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(r, "cuLaunchKernel")
    }

    /// Launches one layer on `stream` (a raw `CUstream` of this device, e.g. torch's current
    /// stream): `sparsetier_mark` (a thread a cell), then `sparsetier_resolve` (a warp a cell),
    /// with the same arguments; returns once both are queued.
    ///
    /// # Safety
    /// Every address in `args` is device-accessible memory of this device (or pinned host
    /// memory mapped for it) that stays alive until the launch has run, large enough for what
    /// the kernel indexes: the sizes in `args`, the `rows` and `tables` contents (table rows,
    /// homes of the host pool), the grant's slots (slots of the device pool) and its victims
    /// (mirror entries), the log's capacity; the mirror, marks and filled have an entry per
    /// (home, layer). `stream` is a live stream of this device's primary context.
    pub unsafe fn launch(&self, stream: u64, args: &LaunchArgs) -> Result<()> {
        if args.cells == 0 {
            return Ok(());
        }
        let warps_a_block = THREADS / 32;
        let blocks = args
            .blocks
            .unwrap_or_else(|| args.cells.div_ceil(warps_a_block).min(4096))
            .max(1);
        let (mut sel, mut rows, mut tables, mut lens, mut table) =
            (args.sel, args.rows, args.tables, args.lens, args.table);
        let (mut step, mut geo) = (args.step, args.geo);
        let mut ints = args.ints();
        let [cells, k, ppr, layers, layer, page_size, tokens] = &mut ints;
        // The kernel's parameters in order, each a pointer to its value.
        let mut params: [*mut c_void; 14] = [
            &mut sel as *mut u64 as *mut c_void,
            &mut rows as *mut u64 as *mut c_void,
            &mut tables as *mut u64 as *mut c_void,
            &mut lens as *mut u64 as *mut c_void,
            &mut table as *mut u64 as *mut c_void,
            &mut step as *mut Step as *mut c_void,
            &mut geo as *mut Geometry as *mut c_void,
            cells as *mut i32 as *mut c_void,
            k as *mut i32 as *mut c_void,
            ppr as *mut i32 as *mut c_void,
            layers as *mut i32 as *mut c_void,
            layer as *mut i32 as *mut c_void,
            page_size as *mut i32 as *mut c_void,
            tokens as *mut i32 as *mut c_void,
        ];
        // A thread a cell, the first launch: a block covers THREADS cells.
        let mark_blocks = args
            .blocks
            .unwrap_or_else(|| args.cells.div_ceil(THREADS).min(4096))
            .max(1);
        // SAFETY: each parameter points to a live local of the kernels' parameter type (u64
        // device addresses for its pointers, the `#[repr(C)]` structs for `Step` and
        // `Geometry`, i32 for its ints; both kernels take the same); the buffers are the
        // caller's contract. The driver copies the parameters at each call.
        unsafe {
            self.raw_launch(&self.mark, mark_blocks, stream, &mut params)?;
            self.raw_launch(&self.func, blocks, stream, &mut params)
        }
    }
}
