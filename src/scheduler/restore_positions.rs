//! Which matched pages a suffix selects, by where they sit in the prefix: the restore policy's
//! model for its third choice, a bulk restore of the pages predicted to be selected.
//!
//! What an indexer selects is partly positional: attention sinks at the start of the context,
//! and the local window, which for a suffix's first tokens reaches back into the prefix's
//! last pages. The rest depends on content and is not predictable from position. So a page's
//! *class* is the end of the prefix it is nearer to and its distance from it in powers of two
//! (page 0; pages 1-2; 3-6; ... from the start, and likewise from the end), and the model
//! learns, per class and per suffix length (the same powers of two as the coverage), the
//! share of its objects that requests loaded. A page whose class is selected often enough is
//! cheaper in a bulk restore than on demand.

/// Distance buckets per side (powers of two).
pub const SIDE_BUCKETS: usize = 32;
/// Classes: start side, then end side.
pub const CLASSES: usize = 2 * SIDE_BUCKETS;
/// Suffix-length buckets (powers of two, as the coverage's).
pub const BUCKETS: usize = 32;
/// Weight of a new sample in a moving average.
pub const ALPHA: f64 = 0.25;

/// The suffix-length bucket of a `suffix`-token prefill.
pub fn bucket(suffix: u64) -> usize {
    log2_bucket(suffix.max(1), BUCKETS)
}

fn log2_bucket(x: u64, n: usize) -> usize {
    ((u64::BITS - x.leading_zeros() - 1) as usize).min(n - 1)
}

/// The class of page `page` of a `matched`-page prefix.
pub fn class_of(page: u32, matched: u32) -> usize {
    debug_assert!(page < matched);
    let (start, end) = (u64::from(page), u64::from(matched - 1 - page));
    if start <= end {
        log2_bucket(start + 1, SIDE_BUCKETS)
    } else {
        SIDE_BUCKETS + log2_bucket(end + 1, SIDE_BUCKETS)
    }
}

/// A share learned per suffix-length bucket (a share of objects a suffix selects, which grows
/// with its length), read for a length without a sample as a union grows: the hazard
/// `-ln(1 - c)` as a power of the length. Between two samples, through both; where the longer
/// one is 1 (no power fits it), as past the ends below it, or linearly in log2 of the length
/// where that reads more; linearly where the shorter one is 0, or they do not grow. Past the
/// ends, from the two nearest samples on that side, the power bounded by 0 and 1 (tokens that
/// select independently: 1), so that a longer suffix is not read as one of the longest seen;
/// the nearest one's with one sample only. None with no sample.
pub fn interpolate(suffix: u64, at: impl Fn(usize) -> Option<f64>) -> Option<f64> {
    let b = bucket(suffix);
    if let Some(c) = at(b) {
        return Some(c);
    }
    let x = (suffix.max(1) as f64).log2();
    let mut below = (0..b).rev().filter_map(|x| at(x).map(|c| (x, c)));
    let mut above = (b + 1..BUCKETS).filter_map(|x| at(x).map(|c| (x, c)));
    match (below.next(), above.next()) {
        (Some((xl, cl)), Some((xh, ch))) => {
            let t = ((x - xl as f64) / (xh - xl) as f64).clamp(0.0, 1.0);
            let (ul, uh) = (hazard(cl), hazard(ch));
            if ul > 0.0 && uh.is_finite() && uh >= ul {
                // The hazard as a power of the length through both samples.
                Some(1.0 - (-(ul * (uh / ul).powf(t))).exp())
            } else if ul > 0.0 && !uh.is_finite() {
                // The longer sample covered everything: it fits no power, and a straight line
                // to it alone reads a union that saturated early as still growing slowly. As
                // past the ends: the power of the two shorter samples, else independent
                // tokens'; the line where it reads more (the shorter ones stopped growing).
                let line = cl + t * (ch - cl);
                Some(extrapolate(x, (xl, cl), below.next().or(Some((xh, ch)))).max(line))
            } else {
                Some(cl + t * (ch - cl))
            }
        }
        (Some(near), None) => Some(extrapolate(x, near, below.next())),
        (None, Some(near)) => Some(extrapolate(x, near, above.next())),
        (None, None) => None,
    }
}

/// `-ln(1 - c)`: what grows in proportion to the tokens of a union of independent draws that
/// covers a share `c`.
fn hazard(c: f64) -> f64 {
    -(1.0 - c.clamp(0.0, 1.0)).ln()
}

/// The share at log2 length `x` from the nearest sample `near` and the next one `far` (both
/// (bucket, share), on the same side of `x`).
fn extrapolate(x: f64, near: (usize, f64), far: Option<(usize, f64)>) -> f64 {
    let (xn, cn) = near;
    let Some((xf, cf)) = far else {
        return cn;
    };
    let (un, uf) = (hazard(cn), hazard(cf));
    if !un.is_finite() || un <= 0.0 {
        return cn; // the nearest is 0 or 1: it stays so
    }
    // u = un * 2^(power * (x - xn)), log2 lengths apart. A farther share of 0 or 1 fits no
    // power: independent tokens' (1), which a union never outgrows.
    let power = if uf.is_finite() && uf > 0.0 {
        ((un / uf).ln() / ((xn as f64 - xf as f64) * std::f64::consts::LN_2)).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let u = un * (power * (x - xn as f64) * std::f64::consts::LN_2).exp();
    1.0 - (-u).exp()
}

/// Moving average of a share, with its sample count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Average {
    /// The average.
    pub value: f64,
    /// Samples folded in.
    pub samples: u64,
}

impl Average {
    /// Folds in `sample` (the first one is taken whole).
    pub fn add(&mut self, sample: f64) {
        self.value = if self.samples == 0 {
            sample
        } else {
            (1.0 - ALPHA) * self.value + ALPHA * sample
        };
        self.samples += 1;
    }

    /// The average, if it has a sample.
    pub fn get(&self) -> Option<f64> {
        (self.samples > 0).then_some(self.value)
    }
}

/// The learned share of each class's objects selected, per suffix-length bucket.
#[derive(Debug, Clone)]
pub struct PositionModel {
    share: Box<[[Average; CLASSES]; BUCKETS]>,
}

impl Default for PositionModel {
    fn default() -> Self {
        PositionModel {
            share: Box::new([[Average::default(); CLASSES]; BUCKETS]),
        }
    }
}

impl PositionModel {
    /// Learns from a request with a `suffix`-token prefill over a `matched`-page prefix:
    /// `absent[i]` objects of page `first + i` were off the device at its admission and it
    /// loaded `loaded[i]` of them.
    pub fn learn(&mut self, suffix: u64, first: u32, matched: u32, absent: &[u32], loaded: &[u32]) {
        let mut sums = [(0u64, 0u64); CLASSES];
        for (i, (&a, &l)) in absent.iter().zip(loaded).enumerate() {
            let c = class_of(first + i as u32, matched);
            sums[c].0 += u64::from(a);
            sums[c].1 += u64::from(l.min(a));
        }
        let row = &mut self.share[bucket(suffix)];
        for (avg, &(a, l)) in row.iter_mut().zip(&sums) {
            if a > 0 {
                avg.add(l as f64 / a as f64);
            }
        }
    }

    /// The share of class `class`'s objects a `suffix`-token prefill is expected to select,
    /// or None before any sample of that class.
    pub fn share(&self, suffix: u64, class: usize) -> Option<f64> {
        interpolate(suffix, |b| self.share[b][class].get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Shares that grow with the length (as a union's do) are read back as shares that
        /// grow with the length: each sample as it is, every other length in [0, 1] and
        /// between its neighbours' samples, and none below a smaller length's.
        #[test]
        fn a_growing_share_reads_as_one(
            samples in prop::collection::btree_map(
                0usize..20,
                prop_oneof![Just(0.0f64), Just(1.0f64), 0.0f64..=1.0],
                1..6,
            ),
        ) {
            // Sorted by bucket, made non-decreasing in it.
            let mut grown = Vec::new();
            let mut top = 0.0f64;
            for (&b, &c) in &samples {
                top = top.max(c);
                grown.push((b, top));
            }
            let at = |b: usize| grown.iter().find(|s| s.0 == b).map(|s| s.1);
            let mut last = 0.0f64;
            for x in 0..24u32 {
                for suffix in [1u64 << x, (1u64 << x) + (1u64 << x) / 2] {
                    let c = interpolate(suffix, at).expect("there are samples");
                    prop_assert!((0.0..=1.0).contains(&c), "{suffix}: {c}");
                    prop_assert!(c >= last - 1e-12, "{suffix}: {c} after {last}");
                    if let Some(own) = at(bucket(suffix)) {
                        prop_assert_eq!(c, own);
                    }
                    let below = grown.iter().rev().find(|s| s.0 < bucket(suffix));
                    let above = grown.iter().find(|s| s.0 > bucket(suffix));
                    if let (Some(lo), Some(hi)) = (below, above) {
                        prop_assert!(c >= lo.1 - 1e-12 && c <= hi.1 + 1e-12, "{suffix}: {c}");
                    }
                    last = c;
                }
            }
        }
    }

    #[test]
    fn classes_are_distances_from_the_nearer_end_in_powers_of_two() {
        let m = 100;
        let classes: Vec<usize> = [0, 1, 2, 3, 6, 7, 40, 93, 96, 97, 98, 99]
            .iter()
            .map(|&p| class_of(p, m))
            .collect();
        let e = SIDE_BUCKETS;
        assert_eq!(
            classes,
            [0, 1, 1, 2, 2, 3, 5, e + 2, e + 2, e + 1, e + 1, e]
        );
        assert_eq!(class_of(0, 1), 0);
    }

    #[test]
    fn it_learns_each_class_s_share_per_suffix_length() {
        let mut m = PositionModel::default();
        assert_eq!(m.share(64, 0), None);
        // 8 pages, 2 objects each; the first and last loaded whole, the middle half of it.
        let absent = [2; 8];
        let loaded = [2, 1, 1, 0, 1, 1, 1, 2];
        m.learn(64, 0, 8, &absent, &loaded);
        assert_eq!(m.share(64, class_of(0, 8)), Some(1.0));
        assert_eq!(m.share(64, class_of(7, 8)), Some(1.0));
        // Pages 1-2 from the start: (1 + 1) of 4.
        assert_eq!(m.share(64, class_of(1, 8)), Some(0.5));
        // Another length reads this one's until it has its own.
        assert_eq!(m.share(4, class_of(0, 8)), Some(1.0));
        // A page restored from host past the start (first = 4): its classes only.
        m.learn(64, 4, 8, &[2, 2, 2, 2], &[0, 0, 0, 0]);
        assert_eq!(m.share(64, class_of(7, 8)), Some(0.75));
        assert_eq!(m.share(64, class_of(0, 8)), Some(1.0));
    }
}
