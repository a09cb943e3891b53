//! A GPU as the resolver kernel's device: its state in device memory (`cuMemAlloc`), the
//! uploads of a step staged in one pinned buffer and copied in stream order, the read-back at a
//! step's end into another pinned buffer and waited for once, and the kernel's three entry
//! points launched on the step's stream (torch's current one). Written to the same protocol
//! the CPU run in CI drives (`kernel`, over `device::HostDevice`); on a GPU,
//! `scripts/gpu-check.sh` part `resolver` runs it.

use super::device::KernelDevice;
use super::launch::{LaunchArgs, ResolveKernel};
use crate::error::Result;
use crate::transfer::cuda::{check, check_mapped, CurrentContext};
use cudarc::driver::sys;

/// A batch of uploads or read-backs past this many bytes frees its pinned buffer afterwards.
const LARGE: usize = 16 << 20;

/// Pinned host memory (`cuMemHostAlloc`) of `bytes`.
#[derive(Debug)]
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: a plain allocation owned by the device that holds it, used under its `&mut self`.
unsafe impl Send for Pinned {}

impl Pinned {
    fn new(bytes: usize) -> Result<Self> {
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a live out-pointer; the context is bound by the caller.
        check(
            unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 0) },
            "cuMemHostAlloc",
        )?;
        Ok(Pinned {
            ptr: ptr as *mut u8,
            bytes,
        })
    }
}

/// The kernel's device: one GPU's primary context, the kernel loaded on it.
#[derive(Debug)]
pub(crate) struct GpuDevice {
    kernel: ResolveKernel,
    stream: u64,
    /// Staging of the last batch of uploads, and the event after its copies (the buffer is
    /// written again only once they have run).
    staging: Option<Pinned>,
    staged: sys::CUevent,
    readback: Option<Pinned>,
    /// Device allocations to free (the context's).
    allocs: Vec<u64>,
}

// SAFETY: the event and pointers are the device's own, used only under `&mut self` (the
// resolver's lock) with its context bound for the call.
unsafe impl Send for GpuDevice {}

impl GpuDevice {
    /// The kernel on device `ordinal`, copying from the host pool at `host_base` (which must
    /// be pinned and mapped for the device at the same address: the kernel reads it over
    /// unified addressing).
    pub(crate) fn new(ordinal: usize, host_base: u64) -> Result<Self> {
        let kernel = ResolveKernel::new(ordinal)?;
        let _bound = CurrentContext::bind(kernel.context())?;
        check_mapped(host_base, "host pool")?;
        let mut staged: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a live out-pointer; valid flags.
        check(
            unsafe {
                sys::cuEventCreate(
                    &mut staged,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                )
            },
            "cuEventCreate",
        )?;
        Ok(GpuDevice {
            kernel,
            stream: 0,
            staging: None,
            staged,
            readback: None,
            allocs: Vec::new(),
        })
    }

    fn stream(&self) -> sys::CUstream {
        self.stream as sys::CUstream
    }

    /// A pinned buffer of at least `bytes` in `slot` (grown by powers of two).
    fn room(slot: &mut Option<Pinned>, bytes: usize) -> Result<*mut u8> {
        if slot.as_ref().is_none_or(|p| p.bytes < bytes) {
            Self::release(slot);
            *slot = Some(Pinned::new(bytes.max(4096).next_power_of_two())?);
        }
        Ok(slot.as_ref().expect("allocated above").ptr)
    }

    /// Frees the pinned buffer in `slot`, which no copy uses any more (the caller waited).
    fn release(slot: &mut Option<Pinned>) {
        if let Some(old) = slot.take() {
            // SAFETY: allocated by cuMemHostAlloc, freed once; the context is bound.
            unsafe { sys::cuMemFreeHost(old.ptr as *mut std::ffi::c_void) };
        }
    }
}

impl KernelDevice for GpuDevice {
    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        let _bound = CurrentContext::bind(self.kernel.context())?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: a live out-pointer; the context is bound.
        check(
            unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(8)) },
            "cuMemAlloc",
        )?;
        self.allocs.push(p);
        Ok(p)
    }

    fn free(&mut self, addr: u64) {
        let Ok(_bound) = CurrentContext::bind(self.kernel.context()) else {
            return;
        };
        if let Some(i) = self.allocs.iter().position(|&a| a == addr) {
            self.allocs.swap_remove(i);
            // Work queued on it runs first (on whichever stream: the one it was queued on
            // may be gone by now). Frees come only when a buffer grows, and at drop.
            // SAFETY: the context is bound; `addr` was allocated by `alloc` in it, freed once.
            unsafe {
                let _ = sys::cuCtxSynchronize();
                let _ = sys::cuMemFree_v2(addr);
            }
        }
    }

    fn set_stream(&mut self, stream: u64) {
        self.stream = stream;
    }

    fn host_memory(&self) -> bool {
        false
    }

    unsafe fn upload(&mut self, parts: &[(u64, &[u8])]) -> Result<()> {
        let _bound = CurrentContext::bind(self.kernel.context())?;
        // The last batch's copies have run before its staging is written again (usually long
        // since: a step's end waited for the stream).
        // SAFETY: a live event of this context.
        check(
            unsafe { sys::cuEventSynchronize(self.staged) },
            "cuEventSynchronize",
        )?;
        // Each part at an 8-byte aligned offset.
        let total: usize = parts.iter().map(|(_, b)| b.len().next_multiple_of(8)).sum();
        let base = Self::room(&mut self.staging, total)?;
        let mut at = 0;
        let mut queued = Ok(());
        for (dst, bytes) in parts {
            if bytes.is_empty() {
                continue;
            }
            // SAFETY: `base` has `total` bytes, of which this part's are `at..at + len`; the
            // source is the caller's slice.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base.add(at), bytes.len()) };
            // SAFETY: `dst` has room (the caller's contract); the staging stays untouched until
            // the event recorded below has completed.
            queued = check(
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        *dst,
                        base.add(at) as *const std::ffi::c_void,
                        bytes.len(),
                        self.stream(),
                    )
                },
                "cuMemcpyHtoDAsync",
            );
            if queued.is_err() {
                break;
            }
            at += bytes.len().next_multiple_of(8);
        }
        // After what was queued, whatever failed: the staging is written again only once the
        // copies already queued have read it.
        // SAFETY: a live event and the step's stream.
        let recorded = check(
            unsafe { sys::cuEventRecord(self.staged, self.stream()) },
            "cuEventRecord",
        );
        queued?;
        recorded?;
        // A large one-off batch (the mirror when the resolver starts, a resync) does not keep
        // its pinned staging for good.
        if total > LARGE {
            // SAFETY: the event recorded above.
            check(
                unsafe { sys::cuEventSynchronize(self.staged) },
                "cuEventSynchronize",
            )?;
            Self::release(&mut self.staging);
        }
        Ok(())
    }

    unsafe fn fill32(&mut self, dst: u64, value: u32, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let _bound = CurrentContext::bind(self.kernel.context())?;
        // SAFETY: `dst` has `n` words (the caller's contract).
        check(
            unsafe { sys::cuMemsetD32Async(dst, value, n, self.stream()) },
            "cuMemsetD32Async",
        )
    }

    unsafe fn read(&mut self, parts: &mut [(u64, &mut [u8])]) -> Result<()> {
        let _bound = CurrentContext::bind(self.kernel.context())?;
        let total: usize = parts.iter().map(|(_, b)| b.len().next_multiple_of(8)).sum();
        let base = Self::room(&mut self.readback, total)?;
        let mut at = 0;
        let mut queued = Ok(());
        for (src, bytes) in parts.iter() {
            if !bytes.is_empty() {
                // SAFETY: `src` has as many bytes (the caller's contract); `base` has `total`.
                queued = check(
                    unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            base.add(at) as *mut std::ffi::c_void,
                            *src,
                            bytes.len(),
                            self.stream(),
                        )
                    },
                    "cuMemcpyDtoHAsync",
                );
                if queued.is_err() {
                    break;
                }
            }
            at += bytes.len().next_multiple_of(8);
        }
        // The one wait of a step: its work, and the read-back after it (also when a copy
        // could not be queued: those queued write into `readback` until then).
        // SAFETY: the step's stream.
        let waited = check(
            unsafe { sys::cuStreamSynchronize(self.stream()) },
            "cuStreamSynchronize",
        );
        queued?;
        waited?;
        let mut at = 0;
        for (_, bytes) in parts.iter_mut() {
            // SAFETY: the copies above have completed into `base[at..at + len]`.
            unsafe { std::ptr::copy_nonoverlapping(base.add(at), bytes.as_mut_ptr(), bytes.len()) };
            at += bytes.len().next_multiple_of(8);
        }
        if total > LARGE {
            Self::release(&mut self.readback); // (the mirror, read back by `validate`)
        }
        Ok(())
    }

    fn capturing(&self, stream: u64) -> Result<bool> {
        let _bound = CurrentContext::bind(self.kernel.context())?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live out-pointer; `stream` is a stream of this device (the caller's,
        // torch's current one), its context bound above.
        check(
            unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) },
            "cuStreamIsCapturing",
        )?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    unsafe fn resolve(&mut self, args: &LaunchArgs) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.kernel.launch(self.stream, args) }
    }

    unsafe fn mirror_apply(&mut self, changes: u64, n: u32, mirror: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.kernel
                .launch_mirror_apply(self.stream, changes, n, mirror)
        }
    }

    unsafe fn marks_read(&mut self, marks: u64, st: u64, entries: u32, bits: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.kernel
                .launch_marks_read(self.stream, marks, st, entries, bits)
        }
    }
}

impl Drop for GpuDevice {
    fn drop(&mut self) {
        let Ok(_bound) = CurrentContext::bind(self.kernel.context()) else {
            return;
        };
        // SAFETY: the context is bound; every handle below is this device's, released once,
        // after the work queued on them (on any stream: the step's may be gone).
        unsafe {
            let _ = sys::cuCtxSynchronize();
            for a in self.allocs.drain(..) {
                let _ = sys::cuMemFree_v2(a);
            }
            for p in [self.staging.take(), self.readback.take()]
                .into_iter()
                .flatten()
            {
                let _ = sys::cuMemFreeHost(p.ptr as *mut std::ffi::c_void);
            }
            let _ = sys::cuEventDestroy_v2(self.staged);
        }
    }
}
