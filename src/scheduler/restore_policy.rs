//! The restore policy: what a prefix hit restores of its matched pages' main KV, decided by
//! the core for each admission. Indexer-K is restored either way (the indexer scores every
//! past token); the main KV is either restored whole, in one bulk load per layer, or left on
//! host and loaded page by page as the request's selections name it.
//!
//! # The cost model
//! - A full restore loads every matched object not on the device: `absent` objects, exactly,
//!   in one submission per layer.
//! - Indexer-K only loads the share of those objects the request's selections will name (its
//!   coverage), one copy each, scattered. The coverage is learned: when a request that
//!   restored Indexer-K only ends, the objects it loaded (each once) over the absent ones at
//!   its admission is a sample, kept per suffix length (powers of two) as a moving average;
//!   a length with no sample of its own reads between its neighbours'.
//! - Cost = bytes + copies x `copy_overhead` (the bytes a copy's fixed cost is worth: scattered
//!   copies pay it per object, a bulk restore per layer). The cheaper choice wins; with no
//!   sample yet for the suffix's length (or a neighbour's), Indexer-K only (its cost is the
//!   unknown one, and it is what teaches the model).
//!
//! A full restore teaches nothing of coverage (it loads everything), so a suffix length the
//! model sends to full restores would keep its estimate for good: every `EXPLORE`-th such
//! decision restores Indexer-K only instead, and its request is a fresh sample.
//!
//! Each decision keeps its prediction; when its request ends the outcome is compared with it
//! (`PrefixTotals`: decisions, bytes predicted and moved, the model's absolute error).

use crate::error::{Error, Result};

/// What a prefix hit restores of the matched pages' main KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreChoice {
    /// Indexer-K only; the main KV loads as selections name it.
    IndexerOnly,
    /// Every matched page's main KV, in bulk, at admission.
    Full,
}

/// How the core chooses (`restore=` in Python).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RestoreMode {
    /// By the cost model, per admission.
    #[default]
    Auto,
    /// Always Indexer-K only.
    IndexerOnly,
    /// Always a full restore.
    Full,
}

impl RestoreMode {
    /// By name: `auto`, `indexer` or `full`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(RestoreMode::Auto),
            "indexer" => Ok(RestoreMode::IndexerOnly),
            "full" => Ok(RestoreMode::Full),
            other => Err(Error::config("restore", other, "auto, indexer or full")),
        }
    }
}

/// One admission's decision and what it predicted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RestoreDecision {
    /// What it restores.
    pub choice: RestoreChoice,
    /// Matched objects (host-restored pages x layers) not on the device at admission.
    pub absent: u64,
    /// Suffix tokens the request prefills.
    pub suffix: u64,
    /// The coverage the model predicted, if it had a sample.
    pub coverage: Option<f64>,
    /// Objects each choice was predicted to load: (Indexer-K only, full restore).
    pub predicted: (f64, f64),
}

/// Suffix-length buckets (powers of two, up to 2^31 tokens).
const BUCKETS: usize = 32;
/// Weight of a new sample in its bucket's moving average.
const ALPHA: f64 = 0.25;
/// One decision in this many that the model sends to a full restore restores Indexer-K only.
pub const EXPLORE: u32 = 8;

/// The learned coverage and the cost model's constants.
#[derive(Debug, Clone)]
pub struct RestorePolicy {
    mode: RestoreMode,
    /// What a copy's fixed cost is worth, in bytes.
    copy_overhead: u64,
    /// Per suffix-length bucket: (moving average of coverage, samples).
    coverage: [(f64, u64); BUCKETS],
    /// Per bucket: full restores decided since its last Indexer-K-only decision.
    full_run: [u32; BUCKETS],
}

impl RestorePolicy {
    /// A policy in `mode`; `copy_overhead`: the bytes a copy's fixed cost is worth.
    pub fn new(mode: RestoreMode, copy_overhead: u64) -> Self {
        RestorePolicy {
            mode,
            copy_overhead,
            coverage: [(0.0, 0); BUCKETS],
            full_run: [0; BUCKETS],
        }
    }

    /// The mode.
    pub fn mode(&self) -> RestoreMode {
        self.mode
    }

    fn bucket(suffix: u64) -> usize {
        (u64::BITS - suffix.max(1).leading_zeros() - 1).min(BUCKETS as u32 - 1) as usize
    }

    /// The coverage expected for a suffix of `suffix` tokens: its bucket's; else between the
    /// nearest buckets with samples below and above, linear in log2 of the length (coverage
    /// grows with the suffix); else the nearest one's.
    pub fn coverage(&self, suffix: u64) -> Option<f64> {
        let b = Self::bucket(suffix);
        let at = |x: usize| {
            let (c, n) = self.coverage[x];
            (n > 0).then_some(c)
        };
        if let Some(c) = at(b) {
            return Some(c);
        }
        let lo = (0..b).rev().find_map(|x| at(x).map(|c| (x, c)));
        let hi = (b + 1..BUCKETS).find_map(|x| at(x).map(|c| (x, c)));
        match (lo, hi) {
            (Some((xl, cl)), Some((xh, ch))) => {
                let x = (suffix.max(1) as f64).log2();
                let t = ((x - xl as f64) / (xh - xl) as f64).clamp(0.0, 1.0);
                Some(cl + t * (ch - cl))
            }
            (Some((_, c)), None) | (None, Some((_, c))) => Some(c),
            (None, None) => None,
        }
    }

    /// Decides for an admission whose matched host pages hold `absent` objects off the
    /// device, over `layers` layers, with a `suffix`-token prefill; `object_bytes` per object.
    pub fn decide(
        &mut self,
        absent: u64,
        layers: u64,
        suffix: u64,
        object_bytes: u64,
    ) -> RestoreDecision {
        let coverage = self.coverage(suffix);
        let full = absent as f64;
        let idx = coverage.map_or(f64::NAN, |c| c * full);
        let choice = match self.mode {
            RestoreMode::IndexerOnly => RestoreChoice::IndexerOnly,
            RestoreMode::Full => RestoreChoice::Full,
            RestoreMode::Auto if absent == 0 || coverage.is_none() => RestoreChoice::IndexerOnly,
            RestoreMode::Auto => {
                let (ob, ov) = (object_bytes as f64, self.copy_overhead as f64);
                let cost_idx = idx * (ob + ov);
                let cost_full = full * ob + layers as f64 * ov;
                let run = &mut self.full_run[Self::bucket(suffix)];
                if cost_full >= cost_idx {
                    *run = 0;
                    RestoreChoice::IndexerOnly
                } else if *run + 1 >= EXPLORE {
                    *run = 0; // a fresh sample for this length
                    RestoreChoice::IndexerOnly
                } else {
                    *run += 1;
                    RestoreChoice::Full
                }
            }
        };
        RestoreDecision {
            choice,
            absent,
            suffix,
            coverage,
            predicted: (idx, full),
        }
    }

    /// Learns from a request that restored Indexer-K only: it loaded `loaded` of the
    /// `absent` objects its admission found off the device.
    pub fn learn(&mut self, suffix: u64, absent: u64, loaded: u64) {
        if absent == 0 {
            return;
        }
        let sample = (loaded as f64 / absent as f64).min(1.0);
        let (c, n) = &mut self.coverage[Self::bucket(suffix)];
        *c = if *n == 0 {
            sample
        } else {
            (1.0 - ALPHA) * *c + ALPHA * sample
        };
        *n += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_no_sample_it_restores_indexer_k_only_and_learns() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        let d = p.decide(1000, 4, 256, 8192);
        assert_eq!(d.choice, RestoreChoice::IndexerOnly);
        assert!(d.coverage.is_none() && d.predicted.0.is_nan());
        // A long suffix that loaded nearly everything: a full restore is cheaper next time.
        p.learn(300, 1000, 950);
        let d = p.decide(1000, 4, 300, 8192);
        assert_eq!(d.choice, RestoreChoice::Full);
        assert_eq!(d.predicted, (950.0, 1000.0));
        // A short suffix borrows the nearest sample until it has its own; then its own.
        assert_eq!(p.coverage(3), Some(0.95));
        p.learn(3, 1000, 100);
        assert_eq!(
            p.decide(1000, 4, 3, 8192).choice,
            RestoreChoice::IndexerOnly
        );
        assert_eq!(p.coverage(2), Some(0.1));
        // Between two samples (buckets 1 and 8): linear in log2 of the length.
        let c = p.coverage(16).unwrap(); // log2 16 = 4: 3/7 of the way from 0.1 to 0.95
        assert!((c - (0.1 + 3.0 / 7.0 * 0.85)).abs() < 1e-12, "{c}");
    }

    #[test]
    fn a_length_sent_to_full_restores_is_sampled_again_now_and_then() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        p.learn(300, 1000, 950);
        let picks: Vec<_> = (0..2 * EXPLORE)
            .map(|_| p.decide(1000, 4, 300, 8192).choice)
            .collect();
        let idx: Vec<usize> = (0..picks.len())
            .filter(|&i| picks[i] == RestoreChoice::IndexerOnly)
            .collect();
        assert_eq!(idx, [EXPLORE as usize - 1, 2 * EXPLORE as usize - 1]);
        // The sample it brings moves the estimate: coverage dropped, Indexer-K only from then.
        p.learn(300, 1000, 100);
        p.learn(300, 1000, 100);
        p.learn(300, 1000, 100);
        assert_eq!(
            p.decide(1000, 4, 300, 8192).choice,
            RestoreChoice::IndexerOnly
        );
    }

    #[test]
    fn scattered_copies_cost_their_overhead() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 0);
        p.learn(64, 100, 99);
        // Without overhead, 99 objects scattered beat 100 in bulk.
        assert_eq!(
            p.decide(100, 2, 64, 1000).choice,
            RestoreChoice::IndexerOnly
        );
        let mut p = RestorePolicy::new(RestoreMode::Auto, 1000);
        p.learn(64, 100, 99);
        // A copy's fixed cost as much as an object: bulk wins.
        assert_eq!(p.decide(100, 2, 64, 1000).choice, RestoreChoice::Full);
    }

    #[test]
    fn fixed_modes_and_names() {
        let mut p = RestorePolicy::new(RestoreMode::Full, 0);
        assert_eq!(p.decide(10, 1, 1, 1).choice, RestoreChoice::Full);
        let mut p = RestorePolicy::new(RestoreMode::IndexerOnly, 0);
        assert_eq!(p.decide(10, 1, 1, 1).choice, RestoreChoice::IndexerOnly);
        assert_eq!(RestoreMode::parse("auto").unwrap(), RestoreMode::Auto);
        assert!(RestoreMode::parse("half").is_err());
        // Moving average: a new sample weighs a quarter.
        let mut p = RestorePolicy::new(RestoreMode::Auto, 0);
        p.learn(8, 100, 100);
        p.learn(8, 100, 0);
        assert_eq!(p.coverage(8), Some(0.75));
        p.learn(8, 0, 0); // nothing absent: no sample
        assert_eq!(p.coverage(8), Some(0.75));
    }
}
