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

/// [`prefetch`] of the `part`-th of `parts` equal shares of `s`'s cache lines: called once per
/// step of a loop with `parts` steps, it asks for all of `s` a little at a time, so that the
/// misses overlap the loop's work instead of crowding the few line-fill buffers at once.
#[inline(always)]
pub fn prefetch_share<T>(s: &[T], part: usize, parts: usize) {
    let base = s.as_ptr().cast::<u8>();
    for line in share(std::mem::size_of_val(s).div_ceil(64), part, parts) {
        prefetch(base.wrapping_add(line * 64));
    }
}

/// The lines of share `part` of `parts` over `lines` lines (empty past the last share).
#[inline(always)]
fn share(lines: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    if parts == 0 || part >= parts {
        return 0..0;
    }
    part * lines / parts..(part + 1) * lines / parts
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_shares_cover_every_line_once() {
        for lines in [0, 1, 5, 64, 256, 257] {
            for parts in [1, 3, 128, 300] {
                let all: Vec<usize> = (0..parts + 2)
                    .flat_map(|p| super::share(lines, p, parts))
                    .collect();
                assert_eq!(
                    all,
                    (0..lines).collect::<Vec<_>>(),
                    "{lines} lines, {parts} parts"
                );
            }
        }
        assert!(super::share(10, 0, 0).is_empty());
    }
}
