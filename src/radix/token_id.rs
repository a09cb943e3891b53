//! Token ids as callers hold them: the tree's own `u32`, or wider or signed integers
//! (SGLang's `array('q')`, torch int64) compared against the tree's keys without narrowing the
//! whole sequence first; a value outside `0..2^32` is no token of the tree.

use crate::error::{Error, Result};

/// A token id as a caller holds it: the tree's own `u32`, or a wider or signed integer whose
/// value is compared without narrowing the whole sequence first.
pub trait TokenId: Copy {
    /// The value as a tree token id; None when it is none.
    fn id(self) -> Option<u32>;
    /// Length of the common prefix of `key` and `toks` (equally long).
    fn common_prefix(key: &[u32], toks: &[Self]) -> usize;
    /// Appends `src` as tree token ids to `out`, refusing (naming) a value that is none.
    fn extend_ids(src: &[Self], out: &mut Vec<u32>) -> Result<()>;
}

impl TokenId for u32 {
    #[inline(always)]
    fn id(self) -> Option<u32> {
        Some(self)
    }
    fn common_prefix(key: &[u32], toks: &[u32]) -> usize {
        common_prefix(key, toks)
    }
    fn extend_ids(src: &[u32], out: &mut Vec<u32>) -> Result<()> {
        out.extend_from_slice(src);
        Ok(())
    }
}

macro_rules! token_id {
    ($($t:ty => $wide:ty),*) => {$(
        impl Narrow for $t {
            #[inline(always)]
            fn high(self) -> u64 {
                (<$wide>::from(self) as u64) >> 32
            }
            #[inline(always)]
            fn low(self) -> u32 {
                self as u32
            }
        }

        impl TokenId for $t {
            #[inline(always)]
            fn id(self) -> Option<u32> {
                u32::try_from(self).ok()
            }
            fn common_prefix(key: &[u32], toks: &[$t]) -> usize {
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2") {
                        // SAFETY: the CPU supports AVX2 (checked just above); the function
                        // only reads the two slices.
                        return unsafe { wide_common_prefix_avx2(key, toks) };
                    }
                }
                wide_common_prefix(key, toks)
            }
            fn extend_ids(src: &[$t], out: &mut Vec<u32>) -> Result<()> {
                let start = out.len();
                #[cfg(target_arch = "x86_64")]
                let high = if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above); the function reads
                    // `src` and appends to `out`.
                    unsafe { narrow_into_avx2(src, out) }
                } else {
                    narrow_into(src, out)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let high = narrow_into(src, out);
                if high != 0 {
                    out.truncate(start);
                    let bad = src.iter().copied().find(|&v| u32::try_from(v).is_err());
                    return Err(Error::out_of_range(
                        "tokens",
                        bad.map_or(0, i128::from),
                        0,
                        i128::from(u32::MAX) + 1,
                    ));
                }
                Ok(())
            }
        }
    )*};
}
token_id!(i64 => i64, u64 => u64, i32 => i64);

/// A caller's token narrowed to a tree token: its low 32 bits, and the bits above them
/// (nonzero: no token id).
trait Narrow: Copy {
    fn high(self) -> u64;
    fn low(self) -> u32;
}

/// Appends `src` narrowed to `out`; returns the OR of the high parts (nonzero: a value was
/// no token id). Cast and OR in one pass, vectorized.
#[inline(always)]
fn narrow_into<T: Narrow>(src: &[T], out: &mut Vec<u32>) -> u64 {
    // In chunks of 4 KiB, each starting the fetch of the chunk two ahead: a long suffix is
    // read from memory, and more misses in flight than the hardware's own prefetch keeps.
    const CHUNK: usize = 4096;
    let per = CHUNK / std::mem::size_of::<T>().max(1);
    let mut high = 0u64;
    out.reserve(src.len());
    for (i, chunk) in src.chunks(per).enumerate() {
        if let Some(ahead) = src.get((i + 2) * per..) {
            crate::prefetch::prefetch_range(&ahead[..ahead.len().min(per)], CHUNK);
        }
        out.extend(chunk.iter().map(|&v| {
            high |= v.high();
            v.low()
        }));
    }
    high
}

/// [`narrow_into`] compiled for AVX2, where the CPU has it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn narrow_into_avx2<T: Narrow>(src: &[T], out: &mut Vec<u32>) -> u64 {
    narrow_into(src, out)
}

/// The key a page is listed under in its parent's children: the page itself for pages of one
/// or two tokens (no compare needed after the lookup), else a hash of it (siblings whose
/// first pages collide chain; `find_child` compares). None when a value is no token id.
#[inline]
pub(super) fn page_key<T: TokenId>(page: &[T]) -> Option<u64> {
    match page {
        [a] => Some(u64::from(a.id()?)),
        [a, b] => Some((u64::from(a.id()?) << 32) | u64::from(b.id()?)),
        _ => page.iter().try_fold(0u64, |h, &t| {
            Some((h.rotate_left(26) ^ u64::from(t.id()?)).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        }),
    }
}

/// A caller's token compared with a tree token, in the caller's width.
trait WideToken: Copy {
    fn same(self, id: u32) -> bool;
}

impl WideToken for i64 {
    #[inline(always)]
    fn same(self, id: u32) -> bool {
        i64::from(id) == self
    }
}

impl WideToken for u64 {
    #[inline(always)]
    fn same(self, id: u32) -> bool {
        u64::from(id) == self
    }
}

impl WideToken for i32 {
    #[inline(always)]
    fn same(self, id: u32) -> bool {
        i64::from(id) == i64::from(self)
    }
}

/// [`common_prefix`] between tree tokens and wider caller tokens: blocks of 64 compared
/// branch-free (vectorized), then the first differing block token by token.
#[inline(always)]
fn wide_common_prefix<T: WideToken>(key: &[u32], toks: &[T]) -> usize {
    const BLOCK: usize = 64;
    let mut at = 0;
    while at + BLOCK <= key.len()
        && key[at..at + BLOCK]
            .iter()
            .zip(&toks[at..at + BLOCK])
            .fold(true, |all, (&k, &t)| all & t.same(k))
    {
        at += BLOCK;
    }
    at + key[at..]
        .iter()
        .zip(&toks[at..])
        .position(|(&k, &t)| !t.same(k))
        .unwrap_or(key.len() - at)
}

/// [`wide_common_prefix`] compiled for AVX2 (64-bit lane compares), where the CPU has it: the
/// wheel targets baseline x86-64, whose SSE2 has no 64-bit compare.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn wide_common_prefix_avx2<T: WideToken>(key: &[u32], toks: &[T]) -> usize {
    wide_common_prefix(key, toks)
}

/// Length of the common prefix of two equally long slices: compared in blocks with `==`
/// (which the compiler turns into a vectorized memcmp), then token by token in the first
/// block that differs.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const BLOCK: usize = 64;
    let mut at = 0;
    while at + BLOCK <= a.len() && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..]
        .iter()
        .zip(&b[at..])
        .position(|(x, y)| x != y)
        .unwrap_or(a.len() - at)
}
