//! Selection entries as the caller holds them: int64 (what `torch.topk` returns) or int32.
//!
//! A token row of DeepSeek-V3.2's top-2048 is 16 KB of int64 and a decode step's rows are
//! 64 MB: reading them is most of what token mode's rows cost the CPU. The same rows as int32
//! are half the bytes to copy from the GPU and to read, and a sorted row's compares take eight
//! entries an AVX2 instruction instead of four. The row builders are generic over both; -1
//! is padding in both; any other negative entry is refused (an out-of-range error naming
//! its cell), never skipped.

use std::fmt::Display;

/// An entry type a plan reads rows of.
pub trait Entry: Copy + Ord + Display + Send + Sync + 'static {
    /// The entry as an i64 (padding is -1).
    fn get(self) -> i64;
    /// The greatest value of this type that is at most `v` (`v` >= 0): `v` where it fits,
    /// else the type's maximum (every entry of the type is then <= it).
    fn at_most(v: i64) -> Self;
}

impl Entry for i64 {
    #[inline(always)]
    fn get(self) -> i64 {
        self
    }

    #[inline(always)]
    fn at_most(v: i64) -> Self {
        v
    }
}

impl Entry for i32 {
    #[inline(always)]
    fn get(self) -> i64 {
        i64::from(self)
    }

    #[inline(always)]
    fn at_most(v: i64) -> Self {
        i32::try_from(v).unwrap_or(i32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_past_the_type_admits_every_entry_of_it() {
        assert_eq!(i32::at_most(7), 7);
        assert_eq!(i32::at_most(i64::from(i32::MAX) + 5), i32::MAX);
        assert_eq!(
            i64::at_most(i64::from(i32::MAX) + 5),
            i64::from(i32::MAX) + 5
        );
        assert_eq!((-1i32).get(), -1);
    }
}
