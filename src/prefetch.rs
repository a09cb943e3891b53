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
    prefetch_bytes(s.as_ptr(), std::mem::size_of_val(s).min(max_bytes));
}

/// [`prefetch`] of every cache line the `bytes` bytes at `p` touch, counted from the line `p`
/// starts in: bytes that start mid-line and cross into another line get both (an address
/// only, never read: any `p` is fine).
#[inline(always)]
pub fn prefetch_bytes<T>(p: *const T, bytes: usize) {
    let p = p.cast::<u8>();
    let head = p as usize % 64;
    let line = p.wrapping_sub(head);
    for off in line_offsets(head, bytes) {
        prefetch(line.wrapping_add(off));
    }
}

/// The offsets, from the start of its first line, of every line `bytes` bytes starting `head`
/// bytes into a line touch.
#[inline(always)]
fn line_offsets(head: usize, bytes: usize) -> std::iter::StepBy<std::ops::Range<usize>> {
    (0..head + bytes).step_by(64)
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
    fn bytes_that_cross_a_line_get_both_lines() {
        let offsets = |head, bytes| super::line_offsets(head, bytes).collect::<Vec<_>>();
        assert_eq!(offsets(32, 64), [0, 64], "half a line, then half the next");
        assert_eq!(offsets(0, 64), [0], "one whole line");
        assert_eq!(offsets(0, 65), [0, 64]);
        assert_eq!(offsets(63, 2), [0, 64]);
        super::prefetch_bytes(std::ptr::null::<u8>().wrapping_add(96), 64); // any address
    }

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
