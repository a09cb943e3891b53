//! The CUDA copy engines, launched through cudarc: `kernel` (a copy kernel on SMs) and
//! `direct` (`cuMemcpyBatchAsync`, or an explicit per-segment `cuMemcpyAsync` mode).
//!
//! Run on a GPU by `scripts/gpu-check.sh` (the CUDA tests, the decode runtime, injected
//! faults, compute-sanitizer, the transfer bench; what ran, where and when: benches/RESULTS.md,
//! "GPU check runs (H200)"). The code compiles
//! everywhere (cudarc loads libcuda and libnvrtc at run time) and the kernel source is compiled
//! with NVRTC in CI, which has no GPU.
//!
//! # No panic reaches the caller
//! cudarc panics when it cannot load a library or a symbol. Every entry point here first checks
//! that libcuda (and, for the kernel, libnvrtc) can be loaded, and that the driver exports
//! `cuMemcpyBatchAsync_v2` before the direct engine uses it; calls are also wrapped in
//! `catch_unwind` as a backstop, turning a panic into [`Error::CudaUnavailable`].
//!
//! # Streams and events
//! Loads run on the engine's load stream, backups on its write stream. Before its copies, a
//! submission makes its stream wait on an event recorded on the producer stream (torch's
//! current stream, set through [`CopyEngine::set_producer`] by every Python call that may
//! submit), so a backup never copies a page torch has not finished writing and a load never
//! lands before a queued torch write of the same slots. Each layer ends with a recorded
//! blocking-sync CUDA event; one watcher thread per stream synchronizes those events in order
//! and publishes them to the transfer's [`TransferEvents`] for CPU-side waiters, while GPU
//! consumers make their own stream wait on the CUDA event ([`CudaEngine::stream_wait`]) without
//! blocking the CPU; a layer that failed is an error for them, never stale data.
//!
//! # Checks before launch
//! A submission checks everything it can before launching anything: the layers' copy ops, that
//! device memory is on the engine's device, and (once per buffer) that host memory is pinned
//! and mapped for the device. If a launch fails part-way, the handle is still returned: its
//! later layers report the failure, and every buffer stays alive until the launched layers
//! end. An `Err` from `submit` means nothing was launched. The unlaunched layers are failed
//! on the handle before `submit` returns, so a stream wait on one is an error at once.
//!
//! # Injected faults
//! [`CopyEngine::inject`] arms a failure of a later submission at one of its layers: the
//! engine launches the layers before it and fails the rest exactly as a launch that failed
//! there (above), also when that is the first layer (the handle then fails every layer). Delays
//! are refused: a GPU copy cannot be held back from the host.
//!
//! # Kernel image
//! The kernel is loaded as a cubin for the device's own compute capability, compiled with
//! NVRTC once and cached on disk ([`super::cubin`]); PTX would need the driver's JIT and fails
//! under an NVRTC newer than the driver.
//!
//! # Context
//! The engine uses the device's primary context with cudarc's event tracking off (it orders
//! its own buffers), so creating it does not synchronize the context; every call that binds
//! the context puts the caller's current context back.

use super::engine::{submission_layers, CopyEngine};
use super::events::{LayerStatus, TransferEvents};
use super::fault::{first_failure, take_for, Fault, FaultAction};
use super::prepared::{CopyOp, Direction, PageTransferGroup};
use crate::error::{Error, Result};
use crate::guard::panic_message;
use crossbeam_channel::{unbounded, Sender};
use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

/// The kernel's CUDA source.
pub const KERNEL_SOURCE: &str = include_str!("../../cuda/page_copy.cu");

/// The device resolver's kernels (`scheduler::resolver`'s algorithm: a layer's marks, a thread
/// a cell, then its cells, a warp each). Compiled by [`compile_kernels`] (CI checks they
/// build); launched by `scheduler::resolver::launch`.
pub const RESOLVE_SOURCE: &str = include_str!("../../cuda/resolve.cu");
/// The kernel's entry point.
pub const KERNEL_NAME: &str = "sparsetier_copy_ops";
/// Ranges larger than this are split, so one big page does not serialize on one block.
pub const KERNEL_CHUNK_BYTES: u64 = 64 * 1024;
const THREADS_PER_BLOCK: u32 = 512;
const BLOCKS_PER_SM: u32 = 4;
/// The fewest threads that copy one op together (four 16-byte words: a 64-byte row).
const MIN_LANES: u32 = 4;

/// Threads per op for a launch whose longest op is `max_len` bytes: about one 16-byte word
/// each, a power of two from [`MIN_LANES`] to a whole block. Small token rows then keep many
/// ops in flight at once (the link's latency, not its width, bounds a copy of a few hundred
/// bytes), and a 64 KiB chunk still gets a whole block.
pub fn lanes_for(max_len: u64) -> u32 {
    let words = (max_len / 16).clamp(1, u64::from(THREADS_PER_BLOCK));
    // The largest power of two <= words, then clamped.
    let pow = 1u64 << (63 - words.leading_zeros());
    (pow as u32).clamp(MIN_LANES, THREADS_PER_BLOCK)
}

/// Refuses a `lanes` the kernel's group arithmetic cannot use.
pub fn check_lanes(lanes: Option<u32>) -> Result<()> {
    match lanes {
        Some(l) if !(l.is_power_of_two() && (MIN_LANES..=THREADS_PER_BLOCK).contains(&l)) => {
            Err(Error::config(
                "lanes",
                l,
                format!(
                    "None (by op length) or a power of two from {MIN_LANES} to {THREADS_PER_BLOCK}"
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// Blocks for `n_ops` ops of `lanes` threads each, at most `sm_limit` SMs' worth.
pub fn blocks_for(n_ops: usize, lanes: u32, sm_limit: u32) -> u32 {
    let per_block = (THREADS_PER_BLOCK / lanes) as u64;
    let needed = (n_ops as u64).div_ceil(per_block);
    needed
        .min(u64::from(sm_limit.saturating_mul(BLOCKS_PER_SM)))
        .max(1) as u32
}

const INSTALL_DRIVER: &str = "Install the NVIDIA driver (libcuda.so.1) or use io_backend='cpu'";
pub(crate) const INSTALL_NVRTC: &str =
    "Install NVRTC: `pip install nvidia-cuda-nvrtc==13.0.*` (and preload \
     it with sparsetier.cuda_libs.preload_nvrtc()), or put libnvrtc.so.13 on LD_LIBRARY_PATH";

/// Checks that libcuda, and libnvrtc when `nvrtc`, can be loaded, without touching cudarc's
/// panicking loaders.
pub fn check_libraries(nvrtc: bool) -> Result<()> {
    // SAFETY: only tries to dlopen the libraries by name; nothing is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            what: "libcuda (the NVIDIA driver library) cannot be loaded".into(),
            fix: INSTALL_DRIVER.into(),
        });
    }
    // SAFETY: as above, for libnvrtc.
    if nvrtc && !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            what: "libnvrtc (the CUDA runtime compiler) cannot be loaded".into(),
            fix: INSTALL_NVRTC.into(),
        });
    }
    Ok(())
}

/// Runs `f`, turning a cudarc panic into a typed error.
pub(crate) fn guarded<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::CudaUnavailable {
            what: format!("{what} panicked inside cudarc: {msg}"),
            fix: INSTALL_DRIVER.into(),
        })
    })
}

pub(crate) fn cuda_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        message: format!("{e:?}"),
    }
}

/// Compiles the kernel sources (the copy kernel, the device resolver) with NVRTC for `arch`
/// (e.g. `sm_90`) and returns their PTX, one after the other. Only libnvrtc is needed: this is
/// what CI runs to check the kernels compile.
pub fn compile_kernels(arch: &'static str) -> Result<String> {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            what: "libnvrtc (the CUDA runtime compiler) cannot be loaded".into(),
            fix: INSTALL_NVRTC.into(),
        });
    }
    guarded("NVRTC compile", || {
        let mut out = String::new();
        for (name, src) in [
            ("page_copy.cu", KERNEL_SOURCE),
            ("resolve.cu", RESOLVE_SOURCE),
        ] {
            let opts = cudarc::nvrtc::CompileOptions {
                arch: Some(arch),
                options: vec!["--std=c++17".into()],
                name: Some(name.into()),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| Error::Cuda {
                call: "nvrtcCompileProgram",
                message: format!("{name}: {e:?}"),
            })?;
            out.push_str(&ptx.to_src());
        }
        Ok(out)
    })
}

/// How the CUDA engine copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaMode {
    /// The copy kernel, on at most `sm_limit` SMs' worth of blocks.
    Kernel {
        /// SMs to spread the blocks over.
        sm_limit: u32,
        /// Threads per op, or `None` to follow each launch's op length ([`lanes_for`]).
        lanes: Option<u32>,
    },
    /// `cuMemcpyBatchAsync` over merged segments, or one `cuMemcpyAsync` per segment when
    /// `per_segment` (chosen by the user, never as a silent fallback).
    Direct {
        /// Use one `cuMemcpyAsync` per segment.
        per_segment: bool,
    },
}

#[derive(Default)]
struct Staging {
    buf: Option<cudarc::driver::PinnedHostSlice<u64>>,
    last_upload: Option<CudaEvent>,
}

struct InFlight {
    events: Arc<Vec<CudaEvent>>,
    /// A submission that failed part-way: the layer it failed at (every later layer fails
    /// too) and why. The launched layers before it still run and are published.
    fail_from: Option<(usize, String)>,
    /// The device-side op table of the kernel path; freed (on its stream) once the transfer
    /// has finished.
    _table: Option<CudaSlice<u64>>,
    cpu: Arc<TransferEvents>,
    _group: Arc<PageTransferGroup>,
}

/// The `kernel` and `direct` engines.
pub struct CudaEngine {
    mode: CudaMode,
    ctx: Arc<CudaContext>,
    load_stream: Arc<CudaStream>,
    write_stream: Arc<CudaStream>,
    func: Option<CudaFunction>,
    events: Arc<Mutex<FxHashMap<u64, Arc<Vec<CudaEvent>>>>>,
    /// One watcher per stream (loads, backups), so a load's completion never waits behind
    /// earlier backups.
    watcher_tx: [Option<Sender<InFlight>>; 2],
    watchers: Vec<JoinHandle<()>>,
    /// Per stream: the pinned staging buffer op tables are uploaded from, and the event of
    /// its last upload (the buffer is rewritten only after it).
    staging: [Mutex<Staging>; 2],
    /// Host buffers already checked to be pinned and mapped for the device, by base address.
    mapped: Mutex<rustc_hash::FxHashSet<u64>>,
    seq: AtomicU64,
    /// The stream whose queued work every copy waits for (torch's current stream).
    producer: Mutex<Option<u64>>,
    /// Failures armed for later submissions (the test hook).
    faults: Mutex<Vec<Fault>>,
}

/// Kernel images loaded in this process, per architecture (compiled or read from disk once).
static CUBINS: OnceLock<Mutex<FxHashMap<String, CachedImage>>> = OnceLock::new();

/// A kernel image, or why it could not be made (kept so a failure is not retried per engine).
type CachedImage = std::result::Result<Vec<u8>, String>;

/// The kernel's cubin for `arch`, once per process (see [`super::cubin`]).
fn cubin_for(arch: &str) -> Result<Vec<u8>> {
    let mut map = CUBINS.get_or_init(Default::default).lock();
    map.entry(arch.to_owned())
        .or_insert_with(|| {
            super::cubin::cubin(arch, None)
                .map(|c| c.image)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|m| Error::Cuda {
            call: "nvrtcCompileProgram",
            message: m,
        })
}

impl CudaEngine {
    /// An engine on device `ordinal`. Checks the libraries, creates the streams, and for the
    /// kernel mode compiles (once per process) and loads the kernel.
    pub fn new(ordinal: usize, mode: CudaMode) -> Result<Self> {
        check_libraries(matches!(mode, CudaMode::Kernel { .. }))?;
        // Making the context current (cudarc does) must not change the caller's device.
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        let had = guarded("cuCtxGetCurrent", || {
            // SAFETY: libcuda is loadable (checked above); a live out-pointer. Before `cuInit`
            // this fails and leaves null, and nothing is restored.
            let r = unsafe { sys::cuCtxGetCurrent(&mut previous) };
            Ok(r == sys::CUresult::CUDA_SUCCESS)
        })?;
        let engine = Self::create(ordinal, mode);
        if had {
            // SAFETY: `previous` was this thread's current context (or null).
            let _ = unsafe { sys::cuCtxSetCurrent(previous) };
        }
        engine
    }

    /// The device ordinal the engine copies on.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    fn create(ordinal: usize, mode: CudaMode) -> Result<Self> {
        check_libraries(matches!(mode, CudaMode::Kernel { .. }))?;
        if let CudaMode::Kernel { sm_limit, lanes } = mode {
            if sm_limit == 0 {
                return Err(Error::config("sm_limit", 0, "an integer >= 1"));
            }
            check_lanes(lanes)?;
        }
        if let CudaMode::Direct { per_segment: false } = mode {
            // SAFETY: culib() is loadable (checked above); `get` only looks the symbol up.
            let has = unsafe {
                sys::culib()
                    .get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync_v2\0")
                    .is_ok()
            };
            if !has {
                return Err(Error::CudaUnavailable {
                    what: "the driver has no cuMemcpyBatchAsync (CUDA 13 driver API)".into(),
                    fix: "Update the driver to CUDA 13 or later, or ask for the per-segment mode \
                          explicitly (per_segment=True)"
                        .into(),
                });
            }
        }
        guarded("CUDA engine setup", || {
            let ctx = CudaContext::new(ordinal).map_err(cuda_err("cuDevicePrimaryCtxRetain"))?;
            // SAFETY: the engine orders its own work: every buffer a stream uses (op tables,
            // staging, the group's pools) stays alive until that stream's events for the
            // transfer have been synchronized, and device tables are freed on the stream that
            // read them. Without cudarc's tracking, making the streams does not synchronize
            // the whole context (stalling torch's work in flight), and an upload costs no
            // tracking events.
            unsafe { ctx.disable_event_tracking() };
            let load_stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
            let write_stream = ctx.new_stream().map_err(cuda_err("cuStreamCreate"))?;
            let func = match mode {
                CudaMode::Kernel { .. } => {
                    // A cubin for this device's own architecture: PTX would need the driver's
                    // JIT and fails under an NVRTC newer than the driver.
                    let (major, minor) = ctx
                        .compute_capability()
                        .map_err(cuda_err("cuDeviceGetAttribute"))?;
                    let image = cubin_for(&super::cubin::arch_of(major, minor))?;
                    let module = ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(image))
                        .map_err(cuda_err("cuModuleLoadData"))?;
                    Some(
                        module
                            .load_function(KERNEL_NAME)
                            .map_err(cuda_err("cuModuleGetFunction"))?,
                    )
                }
                CudaMode::Direct { .. } => None,
            };
            let events: Arc<Mutex<FxHashMap<u64, Arc<Vec<CudaEvent>>>>> = Arc::default();
            let mut senders = [None, None];
            let mut watchers = Vec::new();
            for (i, name) in ["sparsetier-cuda-loads", "sparsetier-cuda-backups"]
                .iter()
                .enumerate()
            {
                let (tx, rx) = unbounded::<InFlight>();
                let watch_events = Arc::clone(&events);
                let w = std::thread::Builder::new()
                    .name((*name).into())
                    .spawn(move || {
                        for job in rx {
                            // A panic here (a bug) must not end the watcher: every later
                            // transfer's events would stay pending.
                            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| watch(&job))) {
                                unwatch(&job, &panic_message(payload.as_ref()));
                            }
                            watch_events.lock().remove(&job.cpu.seq());
                        }
                    })
                    .map_err(|e| Error::Cuda {
                        call: "spawn watcher",
                        message: e.to_string(),
                    })?;
                senders[i] = Some(tx);
                watchers.push(w);
            }
            Ok(CudaEngine {
                mode,
                ctx,
                load_stream,
                write_stream,
                func,
                events,
                watcher_tx: senders,
                watchers,
                staging: Default::default(),
                mapped: Mutex::new(Default::default()),
                seq: AtomicU64::new(0),
                producer: Mutex::new(None),
                faults: Mutex::new(Vec::new()),
            })
        })
    }

    /// Uploads the op table of `per_layer` (sources, destinations, lengths: three arrays of
    /// `total` u64) in one device allocation, from the stream's pinned staging buffer, so the
    /// upload is truly asynchronous (from pageable memory it would wait for the stream).
    fn upload_table(
        &self,
        stream: &Arc<CudaStream>,
        dir: usize,
        per_layer: &[Vec<CopyOp>],
        total: usize,
    ) -> Result<CudaSlice<u64>> {
        let n = 3 * total.max(1);
        let mut st = self.staging[dir].lock();
        if let Some(ev) = st.last_upload.take() {
            ev.synchronize().map_err(cuda_err("cuEventSynchronize"))?; // usually long done
        }
        if st.buf.as_ref().is_none_or(|b| b.len() < n) {
            let cap = n.next_power_of_two().max(4096);
            // SAFETY: u64 is valid for any bits; the buffer is written below before any use.
            st.buf = Some(
                unsafe { self.ctx.alloc_pinned::<u64>(cap) }.map_err(cuda_err("cuMemHostAlloc"))?,
            );
        }
        let buf = st.buf.as_mut().expect("allocated above");
        let host = buf.as_mut_slice().map_err(cuda_err("cuEventSynchronize"))?;
        let ops = per_layer.iter().flatten();
        for (i, op) in ops.enumerate() {
            host[i] = op.src;
            host[total + i] = op.dst;
            host[2 * total + i] = op.len;
        }
        // SAFETY: u64 is valid for any bits and the upload below writes all `n` before the
        // kernels (queued after it on the same stream) read them.
        let mut dev = unsafe { stream.alloc::<u64>(n) }.map_err(cuda_err("cuMemAllocAsync"))?;
        let (dst, _g) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut dev, stream);
        // SAFETY: `host[..n]` is pinned memory that stays untouched until `last_upload` (recorded
        // right after) has completed; `dst` holds `n` u64.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, &host[..n], stream.cu_stream()) }
            .map_err(cuda_err("cuMemcpyHtoDAsync"))?;
        drop(_g);
        st.last_upload = Some(record(stream)?);
        Ok(dev)
    }

    /// Checks, once per buffer, that the group's host buffers are pinned and mapped for the
    /// device at the same address: an unmapped address in the kernel is an illegal access
    /// that poisons the whole CUDA context (torch's included).
    fn check_host_mapped(&self, group: &PageTransferGroup) -> Result<()> {
        let mut seen = self.mapped.lock();
        for m in group.members() {
            let (src, dst) = m.bindings();
            for b in [src, dst] {
                let (base, _) = b.extent();
                if b.kind() != super::binding::MemoryKind::Host || seen.contains(&base) {
                    continue;
                }
                check_mapped(base, "host tensor")?;
                seen.insert(base);
            }
        }
        Ok(())
    }

    /// Makes the CUDA stream `stream` (a raw `CUstream`, e.g. torch's
    /// `torch.cuda.current_stream().cuda_stream`) wait for `layer` of transfer `seq`, without
    /// blocking the CPU. A transfer whose events were already consumed needs no wait.
    pub fn stream_wait(&self, seq: u64, layer_index: usize, stream: u64) -> Result<()> {
        let Some(events) = self.events.lock().get(&seq).cloned() else {
            return Ok(()); // finished: the watcher synchronized every event already
        };
        let ev = events.get(layer_index).ok_or_else(|| {
            Error::out_of_range("layer_index", layer_index as u64, 0, events.len() as u64)
        })?;
        let _ctx = CurrentContext::bind(&self.ctx)?;
        // SAFETY: `stream` is a live CUstream of this context: the caller's contract, which
        // nothing here can check (a raw handle; the bindings document it as a stream of the
        // engine's device, e.g. torch's current one); `ev` is a live event of ours.
        let r = unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, ev.cu_event(), 0) };
        check(r, "cuStreamWaitEvent")
    }

    /// Launches the kernel over `ops` (the layer's ranges, at `offset` of the op table at
    /// `table`: three arrays of `total` u64, sources, destinations, lengths).
    #[allow(clippy::too_many_arguments)]
    fn kernel_layer(
        &self,
        stream: &Arc<CudaStream>,
        func: &CudaFunction,
        table: u64,
        total: usize,
        offset: usize,
        ops: &[CopyOp],
        sm_limit: u32,
        lanes: Option<u32>,
    ) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let at = |array: usize| table + 8 * (array * total + offset) as u64;
        let (s, d, l) = (at(0), at(1), at(2));
        let n = ops.len() as u32;
        let lanes =
            lanes.unwrap_or_else(|| lanes_for(ops.iter().map(|o| o.len).max().unwrap_or(0)));
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(ops.len(), lanes, sm_limit), 1, 1),
            block_dim: (THREADS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(func);
        b.arg(&s).arg(&d).arg(&l).arg(&n).arg(&lanes);
        // SAFETY: the table holds `ops.len()` ranges from `offset` on (uploaded on this stream
        // before the launch), each inside buffers that a PreparedPageTransfer checked and that
        // the caller keeps alive until the transfer's events are finished (we hold the group
        // until then). Host sources are pinned memory mapped for the device (checked once per
        // buffer by `check_host_mapped`). `lanes` is a power of two dividing the block size,
        // as the kernel's group arithmetic requires.
        unsafe { b.launch(cfg) }.map_err(cuda_err("cuLaunchKernel"))?;
        Ok(())
    }

    fn direct_layer(
        &self,
        stream: &Arc<CudaStream>,
        ops: &[CopyOp],
        per_segment: bool,
    ) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let raw = stream.cu_stream();
        if per_segment {
            for op in ops {
                // SAFETY: the range lies in buffers a PreparedPageTransfer checked, alive until
                // the transfer's events are finished.
                let r = unsafe { sys::cuMemcpyAsync(op.dst, op.src, op.len as usize, raw) };
                check(r, "cuMemcpyAsync")?;
            }
            return Ok(());
        }
        let mut dsts: Vec<sys::CUdeviceptr> = ops.iter().map(|o| o.dst).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = ops.iter().map(|o| o.src).collect();
        let mut sizes: Vec<usize> = ops.iter().map(|o| o.len as usize).collect();
        // SAFETY: a plain C struct; zero is a valid bit pattern for every field.
        let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        attr.flags = sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32;
        let mut idx: usize = 0;
        // SAFETY: the arrays hold `ops.len()` valid ranges (see `direct_layer`'s contract) and
        // live across the call; the symbol was checked to exist when the engine was made.
        let r = unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                ops.len(),
                &mut attr,
                &mut idx,
                1,
                raw,
            )
        };
        check(r, "cuMemcpyBatchAsync")
    }
}

/// Checks that host address `base` (named `field` in the error) is pinned memory mapped for
/// the current context's device at the same address: a kernel reading it over unified
/// addressing would otherwise make an illegal access that poisons the whole context.
pub(crate) fn check_mapped(base: u64, field: &str) -> Result<()> {
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: a live out-pointer of the attribute's size; `base` is any address.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            &mut dev as *mut sys::CUdeviceptr as *mut std::ffi::c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
            base,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS || dev != base {
        return Err(Error::config(
            field,
            format!("memory at {base:#x} ({r:?})"),
            "pinned host memory mapped for the device (tensor.pin_memory())",
        ));
    }
    Ok(())
}

pub(crate) fn check(r: sys::CUresult, call: &'static str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda {
            call,
            message: format!("{r:?}"),
        })
    }
}

/// Launches every layer in order, collecting each layer's event; stops at the first layer
/// that cannot be launched and returns it with the error.
fn launch_layers(
    per_layer: &[Vec<CopyOp>],
    events: &mut Vec<CudaEvent>,
    mut launch: impl FnMut(&[CopyOp]) -> Result<CudaEvent>,
) -> Option<(usize, Error)> {
    for (i, ops) in per_layer.iter().enumerate() {
        match launch(ops) {
            Ok(ev) => events.push(ev),
            Err(e) => return Some((i, e)),
        }
    }
    None
}

/// Records a blocking-sync event on `stream` (a waiting watcher sleeps instead of spinning).
fn record(stream: &Arc<CudaStream>) -> Result<CudaEvent> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
        .map_err(cuda_err("cuEventRecord"))
}

/// Synchronizes a transfer's layer events in order and publishes them to its CPU events; a
/// submission that failed part-way then fails its unlaunched layers.
fn watch(job: &InFlight) {
    for (i, ev) in job.events.iter().enumerate() {
        match ev.synchronize() {
            Ok(()) => job.cpu.record_done(i),
            Err(e) => {
                job.cpu.record_failed_from(i, &format!("{e:?}"));
                return;
            }
        }
    }
    if let Some((i, why)) = &job.fail_from {
        job.cpu.record_failed_from(*i, why);
    }
}

/// After `watch` panicked: waits (best effort) until the GPU is done with every layer of the
/// job, so no copy still writes into a slot a failed load gives back, then fails the layers
/// not recorded.
fn unwatch(job: &InFlight, message: &str) {
    for ev in job.events.iter() {
        let _ = catch_unwind(AssertUnwindSafe(|| ev.synchronize()));
    }
    job.cpu
        .fail_pending(&format!("CUDA watcher panicked: {message}"));
}

/// Whether `layer` of a transfer is written (`true`), still pending (`false`), or failed (the
/// error a consumer must get instead of the data).
pub fn layer_outcome(events: &TransferEvents, layer: usize) -> Result<bool> {
    match events.status(layer)? {
        LayerStatus::Failed(reason) => Err(Error::TransferFailed {
            id: events.seq(),
            reason,
        }),
        LayerStatus::Done => Ok(true),
        LayerStatus::Pending => Ok(false),
    }
}

/// Refuses a group whose device memory is on another CUDA device than `ordinal`: the copy would
/// read or write through addresses of another device's context.
pub fn check_devices(group: &PageTransferGroup, ordinal: usize) -> Result<()> {
    for m in group.members() {
        let (src, dst) = m.bindings();
        for b in [src, dst] {
            if b.kind() != super::binding::MemoryKind::Device {
                continue;
            }
            match b.device() {
                Some(d) if d as usize == ordinal => {}
                other => {
                    return Err(Error::config(
                        "tensor.device",
                        other.map_or_else(|| "cuda (unknown index)".to_owned(), |d| format!("cuda:{d}")),
                        format!("cuda:{ordinal}: the engine's device (make the engine on the tensors' device)"),
                    ))
                }
            }
        }
    }
    Ok(())
}

/// Splits ranges longer than `chunk` bytes (the list as it is when none is).
fn chunked(ops: Vec<CopyOp>, chunk: u64) -> Vec<CopyOp> {
    if ops.iter().all(|op| op.len <= chunk) {
        return ops;
    }
    let mut out = Vec::with_capacity(ops.len());
    for op in &ops {
        let mut off = 0;
        while off < op.len {
            let len = chunk.min(op.len - off);
            out.push(CopyOp {
                src: op.src + off,
                dst: op.dst + off,
                len,
            });
            off += len;
        }
    }
    out
}

impl CopyEngine for CudaEngine {
    fn has_streams(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        match self.mode {
            CudaMode::Kernel { .. } => "kernel",
            CudaMode::Direct { .. } => "direct",
        }
    }

    fn stream_wait(&self, events: &TransferEvents, layer_index: usize, stream: u64) -> Result<()> {
        let layer = *events.layers().get(layer_index).ok_or_else(|| {
            Error::out_of_range(
                "layer_index",
                layer_index as u64,
                0,
                events.layers().len() as u64,
            )
        })?;
        // A failed layer must reach the consumer as an error, never as stale data: the
        // watcher forgets a transfer's CUDA events once it finished, failed or not.
        if layer_outcome(events, layer)? {
            return Ok(());
        }
        CudaEngine::stream_wait(self, events.seq(), layer_index, stream)?;
        // The watcher may have settled it between the two looks: check once more.
        layer_outcome(events, layer).map(|_| ())
    }

    fn submitted(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    fn submit(
        &self,
        group: Arc<PageTransferGroup>,
        layer: Option<usize>,
    ) -> Result<Arc<TransferEvents>> {
        let layers = submission_layers(&group, layer)?;
        check_devices(&group, self.ordinal())?;
        let (stream, dir) = match group.direction() {
            Direction::Load => (&self.load_stream, 0),
            Direction::Backup => (&self.write_stream, 1),
        };
        // Everything that can be checked is checked before anything is launched.
        let per_layer: Vec<Vec<CopyOp>> = layers
            .iter()
            .map(|&l| {
                group.layer_ops(l).map(|ops| match self.mode {
                    CudaMode::Kernel { .. } => chunked(ops, KERNEL_CHUNK_BYTES),
                    CudaMode::Direct { .. } => ops,
                })
            })
            .collect::<Result<_>>()?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let cpu = Arc::new(TransferEvents::new(seq, self.name(), layers.clone()));
        let producer = *self.producer.lock();
        // An injected failure stops the launches at its layer, like a launch that failed there.
        let injected = first_failure(&take_for(&mut self.faults.lock(), seq), &layers);
        let launched = &per_layer[..injected.as_ref().map_or(per_layer.len(), |(i, _)| *i)];
        guarded("CUDA submit", || {
            let _ctx = CurrentContext::bind(&self.ctx)?;
            self.check_host_mapped(&group)?;
            // The copies come after the producer's queued work (torch's writes of the pages a
            // backup reads, or of the slots a load overwrites): the copy stream waits on an
            // event recorded on the producer stream now.
            if let Some(p) = producer {
                order_after(p, stream.cu_stream())?;
            }
            let mut table = None;
            let mut events = Vec::with_capacity(layers.len());
            let failed: Option<(usize, Error)>;
            match (self.mode, &self.func) {
                (CudaMode::Kernel { sm_limit, lanes }, Some(func)) => {
                    let total: usize = per_layer.iter().map(Vec::len).sum();
                    let t = self.upload_table(stream, dir, &per_layer, total)?;
                    let base = {
                        let (p, _g) = cudarc::driver::DevicePtr::device_ptr(&t, stream);
                        p
                    };
                    let mut offset = 0;
                    failed = launch_layers(launched, &mut events, |ops| {
                        let r = self
                            .kernel_layer(stream, func, base, total, offset, ops, sm_limit, lanes);
                        offset += ops.len();
                        r.and_then(|()| record(stream))
                    });
                    table = Some(t);
                }
                (CudaMode::Direct { per_segment }, _) => {
                    failed = launch_layers(launched, &mut events, |ops| {
                        self.direct_layer(stream, ops, per_segment)
                            .and_then(|()| record(stream))
                    });
                }
                (CudaMode::Kernel { .. }, None) => {
                    unreachable!("kernel mode always loads its function")
                }
            }
            if let (true, Some((_, e))) = (events.is_empty(), &failed) {
                // Nothing was launched (a failed first layer may have started copies, but the
                // tables and group stay alive until the stream passes this point).
                stream
                    .synchronize()
                    .map_err(cuda_err("cuStreamSynchronize"))?;
                return Err(e.clone());
            }
            // Part of it is launched (or an injected failure stopped it): hand back a handle
            // whose later layers fail, and keep every buffer alive until the launched layers
            // have ended. The unlaunched layers fail now: nothing will write them, and a
            // stream wait must see the failure before the watcher gets to it.
            let fail_from = failed.map(|(i, e)| (i, e.to_string())).or(injected);
            if let Some((i, why)) = &fail_from {
                cpu.record_failed_from(*i, why);
            }
            let events = Arc::new(events);
            self.events.lock().insert(seq, Arc::clone(&events));
            let tx = self.watcher_tx[dir]
                .as_ref()
                .expect("watchers live as long as the engine");
            tx.send(InFlight {
                events,
                fail_from,
                _table: table,
                cpu: Arc::clone(&cpu),
                _group: group,
            })
            .map_err(|_| Error::Cuda {
                call: "watcher",
                message: "stopped".into(),
            })?;
            Ok(())
        })?;
        Ok(cpu)
    }

    fn set_producer(&self, stream: Option<u64>) -> Result<()> {
        *self.producer.lock() = stream;
        Ok(())
    }

    fn inject(&self, fault: Fault) -> Result<()> {
        if let FaultAction::Panic(_) = &fault.action {
            return Err(Error::config(
                "panic",
                "true",
                format!(
                    "no injected panic on the {} engine (its copies run on the GPU, not on a \
                     worker thread of its own): a failure, or the cpu engine",
                    self.name()
                ),
            ));
        }
        if let FaultAction::Delay(d) = &fault.action {
            return Err(Error::config(
                "delay",
                format!("{d:?}"),
                format!(
                    "no delay on the {} engine (a GPU copy cannot be held back from the \
                     host): a failure, or the cpu engine",
                    self.name()
                ),
            ));
        }
        self.faults.lock().push(fault);
        Ok(())
    }
}

/// Makes `copy` wait for the work queued on `producer` so far (an event recorded now).
fn order_after(producer: u64, copy: sys::CUstream) -> Result<()> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `ev` is a live out-pointer; the flags are valid.
    let r =
        unsafe { sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) };
    check(r, "cuEventCreate")?;
    // SAFETY: `producer` is a live CUstream of the current context (the caller's contract:
    // torch's current stream on the engine's device); `ev` was just created.
    let r = unsafe { sys::cuEventRecord(ev, producer as sys::CUstream) };
    let r = if r == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: both handles are live; the wait is enqueued before the event is destroyed,
        // and a destroyed event's pending wait still completes (the driver frees it later).
        unsafe { sys::cuStreamWaitEvent(copy, ev, 0) }
    } else {
        r
    };
    // SAFETY: created above, destroyed once.
    unsafe { sys::cuEventDestroy_v2(ev) };
    check(r, "cuEventRecord/cuStreamWaitEvent")
}

/// Binds the engine's context to this thread and puts the caller's back on drop, so a call
/// into the engine never changes which device torch (or anyone else) is using.
pub(crate) struct CurrentContext {
    previous: sys::CUcontext,
}

impl CurrentContext {
    pub(crate) fn bind(ctx: &CudaContext) -> Result<Self> {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: a live out-pointer.
        check(
            unsafe { sys::cuCtxGetCurrent(&mut previous) },
            "cuCtxGetCurrent",
        )?;
        ctx.bind_to_thread().map_err(cuda_err("cuCtxSetCurrent"))?;
        Ok(CurrentContext { previous })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        // SAFETY: `previous` was this thread's current context (or null) before `bind`.
        let _ = unsafe { sys::cuCtxSetCurrent(self.previous) };
    }
}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        for tx in &mut self.watcher_tx {
            tx.take();
        }
        for w in self.watchers.drain(..) {
            let _ = w.join();
        }
    }
}
