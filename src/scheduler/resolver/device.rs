//! Where the resolver's kernel keeps its state and runs: the memory and the launches its
//! protocol (`kernel`) needs, on a GPU (`gpu`) or, in test builds, in host memory over CPU
//! threads ([`HostDevice`]). The protocol is written once against this trait, so the CPU run
//! in CI drives the same sequence of uploads, launches and read-backs a GPU gets.

use super::launch::LaunchArgs;
use crate::error::Result;

/// Memory and launches, all queued in order (a GPU: on the stream of the step).
pub(crate) trait KernelDevice: Send + std::fmt::Debug {
    /// Allocates `bytes` (8-byte aligned, contents undefined until written).
    fn alloc(&mut self, bytes: usize) -> Result<u64>;

    /// Frees what [`KernelDevice::alloc`] returned, once the work queued on it has run.
    fn free(&mut self, addr: u64);

    /// Sets the stream later work is queued on (a raw `CUstream`; ignored on the CPU).
    fn set_stream(&mut self, stream: u64);

    /// Whether its memory is this process's (the CPU): a launch may then take host slices.
    fn host_memory(&self) -> bool;

    /// Whether a CUDA graph is capturing `stream` (a raw `CUstream` of this device; never on
    /// the CPU).
    fn capturing(&self, _stream: u64) -> Result<bool> {
        Ok(false)
    }

    /// Queues copies of each `(dst, bytes)` to device address `dst`; the bytes may be reused
    /// once this returns.
    ///
    /// # Safety
    /// Each `dst` lies in an allocation of this device with room for its bytes.
    unsafe fn upload(&mut self, parts: &[(u64, &[u8])]) -> Result<()>;

    /// Queues filling `n` 32-bit words at `dst` with `value`.
    ///
    /// # Safety
    /// `dst` lies in an allocation of this device with room for `n` words.
    unsafe fn fill32(&mut self, dst: u64, value: u32, n: usize) -> Result<()>;

    /// Copies each `(src, bytes)` back from device address `src`, after everything queued so
    /// far; returns when they are here.
    ///
    /// # Safety
    /// Each `src` lies in an allocation of this device with as many bytes.
    unsafe fn read(&mut self, parts: &mut [(u64, &mut [u8])]) -> Result<()>;

    /// Queues one layer: `sparsetier_mark`, then `sparsetier_resolve`.
    ///
    /// # Safety
    /// As [`super::launch::ResolveKernel::launch`].
    unsafe fn resolve(&mut self, args: &LaunchArgs) -> Result<()>;

    /// Queues `sparsetier_mirror_apply` over `n` (entry, slot) pairs at `changes`.
    ///
    /// # Safety
    /// `changes` holds `n` pairs, each entry an index of `mirror`.
    unsafe fn mirror_apply(&mut self, changes: u64, n: u32, mirror: u64) -> Result<()>;

    /// Queues `sparsetier_marks_read`: the `entries` marks equal to `st`'s serial as bits.
    ///
    /// # Safety
    /// `marks` has `entries` words, `st` the kernel's `st`, `bits` `entries / 32` rounded up.
    unsafe fn marks_read(&mut self, marks: u64, st: u64, entries: u32, bits: u64) -> Result<()>;
}

#[cfg(feature = "host-kernel")]
pub(crate) use host::HostDevice;

#[cfg(feature = "host-kernel")]
mod host {
    use super::{KernelDevice, LaunchArgs, Result};
    use rustc_hash::FxHashMap;

    extern "C" {
        fn sparsetier_mirror_apply_host(
            threads: i32,
            changes: *const i32,
            n: i32,
            mirror: *mut i32,
        );
        fn sparsetier_marks_read_host(
            threads: i32,
            marks: *const u32,
            st: *const u32,
            entries: i32,
            bits: *mut u32,
        );
    }

    /// The CPU as the kernel's device (test builds): memory of this process, each launch on
    /// `threads` CPU threads that race as warps do (`cuda/host/resolve_host.cpp`), done when
    /// the call returns.
    #[derive(Debug)]
    pub(crate) struct HostDevice {
        threads: u32,
        /// The allocations, by address (words, so that every one is 8-byte aligned).
        blocks: FxHashMap<u64, Vec<u64>>,
        /// Freed allocations, kept until the device drops so that no address is handed out
        /// twice: a launch naming a freed buffer is always refused (buffers only grow, so
        /// few are freed).
        freed: Vec<Vec<u64>>,
    }

    impl HostDevice {
        /// A device whose launches run on `threads` CPU threads (1 to 256).
        pub(crate) fn new(threads: u32) -> Self {
            HostDevice {
                threads: threads.clamp(1, 256),
                blocks: FxHashMap::default(),
                freed: Vec::new(),
            }
        }
    }

    impl KernelDevice for HostDevice {
        fn alloc(&mut self, bytes: usize) -> Result<u64> {
            let block = vec![0u64; bytes.div_ceil(8).max(1)];
            let addr = block.as_ptr() as u64;
            self.blocks.insert(addr, block);
            Ok(addr)
        }

        fn free(&mut self, addr: u64) {
            if let Some(block) = self.blocks.remove(&addr) {
                self.freed.push(block);
            }
        }

        fn set_stream(&mut self, _stream: u64) {}

        fn host_memory(&self) -> bool {
            true
        }

        unsafe fn upload(&mut self, parts: &[(u64, &[u8])]) -> Result<()> {
            for (dst, bytes) in parts {
                // SAFETY: the caller's contract: `dst` has room for the bytes, in a block of
                // this device, which is not the caller's slice.
                unsafe {
                    std::ptr::copy_nonoverlapping(bytes.as_ptr(), *dst as *mut u8, bytes.len())
                };
            }
            Ok(())
        }

        unsafe fn fill32(&mut self, dst: u64, value: u32, n: usize) -> Result<()> {
            // SAFETY: the caller's contract: `n` aligned words at `dst`, in a block of this
            // device, nothing else borrowing them.
            unsafe { std::slice::from_raw_parts_mut(dst as *mut u32, n) }.fill(value);
            Ok(())
        }

        unsafe fn read(&mut self, parts: &mut [(u64, &mut [u8])]) -> Result<()> {
            for (src, bytes) in parts.iter_mut() {
                // SAFETY: the caller's contract: `src` has as many bytes, in a block of this
                // device, which is not the caller's slice.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        *src as *const u8,
                        bytes.as_mut_ptr(),
                        bytes.len(),
                    )
                };
            }
            Ok(())
        }

        unsafe fn resolve(&mut self, args: &LaunchArgs) -> Result<()> {
            // Every buffer of the device the launch names is one it holds: a replayed launch
            // whose buffers moved is refused (on a GPU it would read freed memory).
            let s = &args.step;
            let named = [
                args.rows,
                args.tables,
                args.lens,
                s.mirror as u64,
                s.marks as u64,
                s.filled as u64,
                s.grant as u64,
                s.deferred as u64,
                s.log as u64,
                s.st as u64,
                s.counts as u64,
                s.tok as u64,
                args.geo.host_planes as u64,
            ];
            if let Some(gone) = named.iter().find(|a| !self.blocks.contains_key(a)) {
                return Err(crate::error::Error::Cuda {
                    call: "cuLaunchKernel",
                    message: format!("the launch names freed device memory ({gone:#x})"),
                });
            }
            // SAFETY: the caller's contract, with this process's memory for the device's.
            unsafe { super::super::kernel::launch_on_host(self.threads, args) };
            Ok(())
        }

        unsafe fn mirror_apply(&mut self, changes: u64, n: u32, mirror: u64) -> Result<()> {
            // SAFETY: the caller's contract; the call joins its threads before it returns.
            unsafe {
                sparsetier_mirror_apply_host(
                    self.threads as i32,
                    changes as *const i32,
                    n as i32,
                    mirror as *mut i32,
                )
            };
            Ok(())
        }

        unsafe fn marks_read(
            &mut self,
            marks: u64,
            st: u64,
            entries: u32,
            bits: u64,
        ) -> Result<()> {
            // SAFETY: the caller's contract; the call joins its threads before it returns.
            unsafe {
                sparsetier_marks_read_host(
                    self.threads as i32,
                    marks as *const u32,
                    st as *const u32,
                    entries as i32,
                    bits as *mut u32,
                )
            };
            Ok(())
        }
    }
}
