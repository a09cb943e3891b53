//! A software prefetch hint, for loops over millions of objects where each access is a cache
//! miss: issuing the next accesses early lets the misses overlap.

/// Asks the CPU to bring the cache line at `p` closer. A hint only: it never faults, reads
/// nothing the program can observe, and does nothing on targets without the instruction, so
/// any address (even dangling or out of bounds) is fine.
#[inline(always)]
pub fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` is architecturally a hint: it cannot fault or change program
    // state, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`prefetch`] of every cache line of `s`, up to `max_bytes`: the accesses that follow then
/// wait for their misses together, not one after another.
#[inline(always)]
pub fn prefetch_range<T>(s: &[T], max_bytes: usize) {
    let bytes = std::mem::size_of_val(s).min(max_bytes);
    let base = s.as_ptr().cast::<u8>();
    let mut off = 0;
    while off < bytes {
        prefetch(base.wrapping_add(off));
        off += 64;
    }
}
