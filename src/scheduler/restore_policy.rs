//! The restore policy: what a prefix hit restores of its matched pages' main KV, decided by
//! the core for each admission. Indexer-K is restored either way (the indexer scores every
//! past token); the main KV is restored whole in one bulk load per layer, or left on host and
//! loaded page by page as the request's selections name it, or the pages predicted to be
//! selected are restored in bulk and the rest left to load on demand.
//!
//! # The cost model
//! - A full restore loads every matched object not on the device: `absent` objects, exactly,
//!   in one submission per layer.
//! - Indexer-K only loads the share of those objects the request's selections will name (its
//!   coverage), one copy each, scattered. The coverage is learned: when a request that
//!   restored Indexer-K only ends, the objects it loaded (each once) over the absent ones at
//!   its admission is a sample, kept per suffix length (powers of two) as a moving average;
//!   a length with no sample of its own reads between its neighbours'.
//! - A predicted restore loads in bulk the pages whose position class
//!   (`restore_positions.rs`) is selected often enough to be cheaper in bulk (a share of at
//!   least `object_bytes / (object_bytes + copy_overhead)`), and the rest on demand: the
//!   coverage's objects less those the bulk part is expected to hold.
//! - Cost = bytes + copies x `copy_overhead` (the bytes a copy's fixed cost is worth: scattered
//!   copies pay it per object, a bulk restore per layer). The cheapest choice wins; with no
//!   sample yet for the suffix's length (or a neighbour's), Indexer-K only (its cost is the
//!   unknown one, and it is what teaches the model).
//!
//! A full or predicted restore teaches nothing of coverage (it loads its pages whatever is
//! selected), so a suffix length the model sends to them would keep its estimate for good:
//! every `EXPLORE`-th such decision restores Indexer-K only instead, and its request is a
//! fresh sample.
//!
//! Each decision keeps its prediction; when its request ends the outcome is compared with it
//! (`PrefixTotals`: decisions, objects predicted and loaded, the model's absolute error).

use super::restore_positions::{self, Average, PositionModel, BUCKETS};
use crate::error::{Error, Result};

/// What a prefix hit restores of the matched pages' main KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreChoice {
    /// Indexer-K only; the main KV loads as selections name it.
    IndexerOnly,
    /// Every matched page's main KV, in bulk, at admission.
    Full,
    /// The pages predicted to be selected, in bulk, at admission; the rest on demand.
    Predicted,
}

impl RestoreChoice {
    /// The name Python uses.
    pub fn name(self) -> &'static str {
        match self {
            RestoreChoice::IndexerOnly => "indexer",
            RestoreChoice::Full => "full",
            RestoreChoice::Predicted => "predicted",
        }
    }
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
    /// Always the predicted pages (Indexer-K only while nothing is predicted).
    Predicted,
}

impl RestoreMode {
    /// By name: `auto`, `indexer`, `full` or `predicted`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(RestoreMode::Auto),
            "indexer" => Ok(RestoreMode::IndexerOnly),
            "full" => Ok(RestoreMode::Full),
            "predicted" => Ok(RestoreMode::Predicted),
            other => Err(Error::config(
                "restore",
                other,
                "auto, indexer, full or predicted",
            )),
        }
    }
}

/// What each choice was predicted to load, in objects (NaN where the model had no sample).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Predicted {
    /// Indexer-K only: the coverage's share of the absent objects.
    pub indexer: f64,
    /// A full restore: every absent object.
    pub full: f64,
    /// The predicted restore: its bulk part and the rest it expects on demand.
    pub predicted: f64,
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
    /// Objects each choice was predicted to load.
    pub predicted: Predicted,
    /// Of those, what the predicted restore loads in bulk (0 when it predicts no page).
    pub bulk: u64,
}

/// What a copy's fixed cost is worth by default, in bytes, on engine `backend`: the bytes the
/// engine moves in the time it spends on one more copy of a scattered load (its measured
/// figures: `docs/architecture.md`, "The restore policy"). The cpu engine pays a copy on its
/// worker; the kernel one op in the list the CPU builds; `direct` the driver's work per range.
pub fn default_copy_overhead(backend: crate::config::IoBackend) -> u64 {
    use crate::config::IoBackend;
    match backend {
        IoBackend::Cpu => 16 << 10,
        IoBackend::Kernel => 2 << 10,
        IoBackend::Direct => 192 << 10,
    }
}

/// One decision in this many that the model sends to a bulk restore restores Indexer-K only.
pub const EXPLORE: u32 = 8;

/// The learned coverage and the cost model's constants.
#[derive(Debug, Clone)]
pub struct RestorePolicy {
    mode: RestoreMode,
    /// What a copy's fixed cost is worth, in bytes.
    copy_overhead: u64,
    /// Per suffix-length bucket: the moving average of coverage.
    coverage: [Average; BUCKETS],
    /// Per position class and suffix-length bucket: the share selected.
    positions: PositionModel,
    /// Per bucket: bulk restores decided since its last Indexer-K-only decision.
    bulk_run: [u32; BUCKETS],
}

impl RestorePolicy {
    /// A policy in `mode`; `copy_overhead`: the bytes a copy's fixed cost is worth.
    pub fn new(mode: RestoreMode, copy_overhead: u64) -> Self {
        RestorePolicy {
            mode,
            copy_overhead,
            coverage: [Average::default(); BUCKETS],
            positions: PositionModel::default(),
            bulk_run: [0; BUCKETS],
        }
    }

    /// The mode.
    pub fn mode(&self) -> RestoreMode {
        self.mode
    }

    /// What a copy's fixed cost is worth in its cost model, in bytes.
    pub fn copy_overhead(&self) -> u64 {
        self.copy_overhead
    }

    /// The coverage expected for a suffix of `suffix` tokens: its bucket's; else from the
    /// nearest buckets with samples, as a union grows (`restore_positions::interpolate`).
    pub fn coverage(&self, suffix: u64) -> Option<f64> {
        restore_positions::interpolate(suffix, |b| self.coverage[b].get())
    }

    /// Decides for an admission over a `matched`-page prefix whose pages from `first` on were
    /// restored from host, `absent[i]` objects of page `first + i` off the device, over
    /// `layers` layers, with a `suffix`-token prefill; `object_bytes` per object. Returns the
    /// decision and, for a predicted restore, the pages it restores (ascending).
    pub fn decide(
        &mut self,
        first: u32,
        matched: u32,
        absent: &[u32],
        layers: u64,
        suffix: u64,
        object_bytes: u64,
    ) -> (RestoreDecision, Vec<u32>) {
        debug_assert_eq!(first as usize + absent.len(), matched as usize);
        let total: u64 = absent.iter().map(|&a| u64::from(a)).sum();
        let coverage = self.coverage(suffix);
        let (ob, ov) = (object_bytes as f64, self.copy_overhead as f64);
        let full = total as f64;
        let mut idx = coverage.map_or(f64::NAN, |c| c * full);
        // The predicted pages: those whose class is selected at least at the break-even share.
        let even = ob / (ob + ov);
        let mut pages = Vec::new();
        let (mut bulk, mut expected, mut by_class, mut known) = (0u64, 0.0, 0.0, true);
        if coverage.is_some() {
            let mut share = [None; restore_positions::CLASSES];
            for (i, &a) in absent.iter().enumerate() {
                let page = first + i as u32;
                let c = restore_positions::class_of(page, matched);
                let s = *share[c].get_or_insert_with(|| self.positions.share(suffix, c));
                known &= s.is_some();
                let s = s.unwrap_or(0.0);
                by_class += s * f64::from(a);
                if s > 0.0 && s >= even && a > 0 {
                    pages.push(page);
                    bulk += u64::from(a);
                    expected += s * f64::from(a);
                }
            }
            // Where every page's class has a share, their sum is the finer estimate (a prefix
            // restored from host past its start is mostly of the end's classes).
            if known {
                idx = by_class;
            }
        }
        let rest = (idx - expected).max(0.0);
        let pred = if pages.is_empty() {
            f64::NAN
        } else {
            bulk as f64 + rest
        };
        let cost_idx = idx * (ob + ov);
        let cost_full = full * ob + layers as f64 * ov;
        let cost_pred = bulk as f64 * ob + layers as f64 * ov + rest * (ob + ov);
        let bulk_choice = match self.mode {
            RestoreMode::IndexerOnly => None,
            RestoreMode::Full => Some(RestoreChoice::Full),
            RestoreMode::Predicted => (!pages.is_empty()).then_some(RestoreChoice::Predicted),
            RestoreMode::Auto if total == 0 || coverage.is_none() => None,
            RestoreMode::Auto => {
                let mut best = (cost_idx, None);
                if cost_full < best.0 {
                    best = (cost_full, Some(RestoreChoice::Full));
                }
                if !pages.is_empty() && cost_pred < best.0 {
                    best = (cost_pred, Some(RestoreChoice::Predicted));
                }
                if best.1.is_none() {
                    // The model chose Indexer-K only: a sample comes anyway.
                    self.bulk_run[restore_positions::bucket(suffix)] = 0;
                }
                best.1
            }
        };
        let choice = match (self.mode, bulk_choice) {
            (_, None) => RestoreChoice::IndexerOnly,
            (RestoreMode::Auto, Some(c)) => {
                let run = &mut self.bulk_run[restore_positions::bucket(suffix)];
                if *run + 1 >= EXPLORE {
                    *run = 0; // a fresh sample for this length
                    RestoreChoice::IndexerOnly
                } else {
                    *run += 1;
                    c
                }
            }
            (_, Some(c)) => c,
        };
        if choice != RestoreChoice::Predicted {
            pages.clear();
        }
        let d = RestoreDecision {
            choice,
            absent: total,
            suffix,
            coverage,
            predicted: Predicted {
                indexer: idx,
                full,
                predicted: pred,
            },
            bulk: if pred.is_nan() { 0 } else { bulk },
        };
        (d, pages)
    }

    /// Learns from a request with a `suffix`-token prefill that restored Indexer-K only over a
    /// `matched`-page prefix: `absent[i]` objects of page `first + i` were off the device at
    /// its admission and it loaded `loaded[i]` of them.
    pub fn learn(&mut self, suffix: u64, first: u32, matched: u32, absent: &[u32], loaded: &[u32]) {
        let total: u64 = absent.iter().map(|&a| u64::from(a)).sum();
        if total == 0 {
            return;
        }
        let got: u64 = absent
            .iter()
            .zip(loaded)
            .map(|(&a, &l)| u64::from(l.min(a)))
            .sum();
        self.coverage[restore_positions::bucket(suffix)].add(got as f64 / total as f64);
        self.positions.learn(suffix, first, matched, absent, loaded);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `objects` absent objects as whole pages of `layers` objects (a prefix all from host).
    fn pages(objects: u32, layers: u32) -> Vec<u32> {
        vec![layers; (objects / layers) as usize]
    }

    /// Decides for a prefix of `objects` absent objects in pages of `layers`.
    fn decide(
        p: &mut RestorePolicy,
        objects: u32,
        layers: u32,
        suffix: u64,
        ob: u64,
    ) -> RestoreDecision {
        let a = pages(objects, layers);
        p.decide(0, a.len() as u32, &a, u64::from(layers), suffix, ob)
            .0
    }

    /// Learns that a request loaded `loaded` of `objects` absent objects, spread evenly.
    fn learn(p: &mut RestorePolicy, suffix: u64, objects: u32, loaded: u32) {
        let a = pages(objects, 4);
        let n = a.len() as u32;
        let l: Vec<u32> = (0..n)
            .map(|i| loaded * (i + 1) / n - loaded * i / n)
            .collect();
        p.learn(suffix, 0, n, &a, &l);
    }

    #[test]
    fn with_no_sample_it_restores_indexer_k_only_and_learns() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        let d = decide(&mut p, 1000, 4, 256, 8192);
        assert_eq!(d.choice, RestoreChoice::IndexerOnly);
        assert!(d.coverage.is_none() && d.predicted.indexer.is_nan());
        // A long suffix that loaded nearly everything: a full restore is cheaper next time.
        learn(&mut p, 300, 1000, 950);
        let d = decide(&mut p, 1000, 4, 300, 8192);
        assert_eq!(d.choice, RestoreChoice::Full);
        assert!((d.predicted.indexer - 950.0).abs() < 1e-9 && d.predicted.full == 1000.0);
        // A short suffix borrows the nearest sample until it has its own; then its own.
        assert_eq!(p.coverage(3), Some(0.95));
        learn(&mut p, 3, 1000, 100);
        assert_eq!(
            decide(&mut p, 1000, 4, 3, 8192).choice,
            RestoreChoice::IndexerOnly
        );
        assert_eq!(p.coverage(2), Some(0.1));
        // Between two samples (buckets 1 and 8): the hazard -ln(1 - c) geometric in log2 of
        // the length, log2 16 = 4 being 3/7 of the way.
        let c = p.coverage(16).unwrap();
        let (ul, uh) = (-(0.9f64).ln(), -(0.05f64).ln());
        let want = 1.0 - (-(ul * (uh / ul).powf(3.0 / 7.0))).exp();
        assert!((c - want).abs() < 1e-12 && c > 0.1 && c < 0.95, "{c}");
        // Past the ends, from the two nearest samples as a union grows: a longer suffix than
        // any seen covers more than the longest seen (not the same), a shorter one less.
        let (hi, lo) = (p.coverage(4096).unwrap(), p.coverage(1).unwrap());
        assert!(hi > 0.95 && hi <= 1.0, "{hi}");
        assert!(lo > 0.0 && lo < 0.1, "{lo}");
        // The hazard -ln(1 - c) grows at most in proportion to the length (tokens that select
        // independently): from 0.01 at 16 tokens and 0.5 at 32, 64 tokens read 0.75, not more.
        let mut q = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut q, 16, 1000, 10);
        learn(&mut q, 32, 1000, 500);
        let c = q.coverage(64).unwrap();
        assert!((c - 0.75).abs() < 1e-12, "{c}");
        assert!(q.coverage(1 << 20).unwrap() <= 1.0);
        // Below a sample and one that loaded everything (no power fits): independent
        // tokens', so 16 tokens under 0.75 at 64 read 1 - 0.25^(1/4), not 0.75.
        let mut r = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut r, 64, 1000, 750);
        learn(&mut r, 256, 1000, 1000);
        let c = r.coverage(16).unwrap();
        assert!((c - (1.0 - 0.25f64.powf(0.25))).abs() < 1e-12, "{c}");
        // Between a sample and a longer one that loaded everything: the shorter samples'
        // power, not a straight line to 1. From 0.2 at 16 tokens and 0.5 at 64 (the hazard
        // x3.1 in 4x the length), 256 tokens read 1 - 0.5^3.1, as the union grows; the line
        // from 64 to 1024 tokens would read 0.75, under the loads' break-even here.
        let mut s = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut s, 16, 1000, 200);
        learn(&mut s, 64, 1000, 500);
        learn(&mut s, 1024, 1000, 1000);
        let power = (0.5f64.ln() / 0.8f64.ln()).log(4.0);
        let want = 1.0 - 0.5f64.powf(4f64.powf(power));
        let c = s.coverage(256).unwrap();
        assert!((c - want).abs() < 1e-12 && c > 0.85, "{c}");
        // With one sample below, no power fits: independent tokens', the hazard x4 in 4x the
        // length (1 - 0.5^4).
        let mut t = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut t, 64, 1000, 500);
        learn(&mut t, 1024, 1000, 1000);
        assert!((t.coverage(256).unwrap() - 0.9375).abs() < 1e-12);
    }

    #[test]
    fn a_length_sent_to_full_restores_is_sampled_again_now_and_then() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut p, 300, 1000, 950);
        let picks: Vec<_> = (0..2 * EXPLORE)
            .map(|_| decide(&mut p, 1000, 4, 300, 8192).choice)
            .collect();
        let idx: Vec<usize> = (0..picks.len())
            .filter(|&i| picks[i] == RestoreChoice::IndexerOnly)
            .collect();
        assert_eq!(idx, [EXPLORE as usize - 1, 2 * EXPLORE as usize - 1]);
        // The sample it brings moves the estimate: coverage dropped, Indexer-K only from then.
        for _ in 0..3 {
            learn(&mut p, 300, 1000, 100);
        }
        assert_eq!(
            decide(&mut p, 1000, 4, 300, 8192).choice,
            RestoreChoice::IndexerOnly
        );
    }

    #[test]
    fn a_decision_that_teaches_nothing_does_not_put_off_exploring() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        learn(&mut p, 300, 1000, 950);
        let mut picks = Vec::new();
        for i in 0..EXPLORE {
            picks.push(decide(&mut p, 1000, 4, 300, 8192).choice);
            if i == 2 {
                // Nothing off the device: Indexer-K only, no sample, the run goes on.
                assert_eq!(
                    decide(&mut p, 0, 4, 300, 8192).choice,
                    RestoreChoice::IndexerOnly
                );
            }
        }
        assert_eq!(picks.last(), Some(&RestoreChoice::IndexerOnly), "{picks:?}");
        assert!(picks[..EXPLORE as usize - 1]
            .iter()
            .all(|&c| c == RestoreChoice::Full));
    }

    #[test]
    fn scattered_copies_cost_their_overhead() {
        let mut p = RestorePolicy::new(RestoreMode::Auto, 0);
        learn(&mut p, 64, 100, 99);
        // Without overhead, 99 objects scattered beat 100 in bulk.
        assert_eq!(
            decide(&mut p, 100, 2, 64, 1000).choice,
            RestoreChoice::IndexerOnly
        );
        let mut p = RestorePolicy::new(RestoreMode::Auto, 1000);
        learn(&mut p, 64, 100, 99);
        // A copy's fixed cost as much as an object: bulk wins.
        assert_eq!(decide(&mut p, 100, 2, 64, 1000).choice, RestoreChoice::Full);
    }

    #[test]
    fn pages_selected_by_position_are_restored_in_bulk_and_the_rest_on_demand() {
        // 100 pages of 2 layers; requests loaded the first page and the last 4 whole, and 10 %
        // of the rest: a sink and a window, as an indexer selects.
        let mut p = RestorePolicy::new(RestoreMode::Auto, 4096);
        let absent = vec![2u32; 100];
        let mut loaded: Vec<u32> = (0..100).map(|i| u32::from(i % 10 == 5)).collect();
        for i in [0, 96, 97, 98, 99] {
            loaded[i] = 2;
        }
        for _ in 0..3 {
            p.learn(64, 0, 100, &absent, &loaded);
        }
        let (d, pages) = p.decide(0, 100, &absent, 2, 64, 8192);
        assert_eq!(d.choice, RestoreChoice::Predicted);
        // The classes at break-even (2/3) or more: page 0, and pages 97-99 (0, 1-2 from the
        // end). Page 96 shares its class (3-6 from the end) with 93-95: 3 of 8 objects.
        assert_eq!(pages, [0, 97, 98, 99]);
        assert_eq!(d.bulk, 2 * pages.len() as u64);
        assert!(d.predicted.predicted < d.predicted.full);
        // Cheaper than either fixed choice by the model's own costs.
        let (ob, ov) = (8192.0, 4096.0);
        let cost_idx = d.predicted.indexer * (ob + ov);
        let cost_full = d.predicted.full * ob + 2.0 * ov;
        let rest = d.predicted.predicted - d.bulk as f64;
        let cost_pred = d.bulk as f64 * ob + 2.0 * ov + rest * (ob + ov);
        assert!(cost_pred < cost_idx && cost_pred < cost_full);
        // Pages restored from host past the start: only those are predicted.
        let (d, pages) = p.decide(90, 100, &absent[90..], 2, 64, 8192);
        assert_eq!(d.choice, RestoreChoice::Predicted);
        assert!(pages.iter().all(|&q| q >= 90) && pages.contains(&99));
        // The fixed mode predicts even where another choice is cheaper; with nothing learned
        // it restores Indexer-K only.
        let mut q = RestorePolicy::new(RestoreMode::Predicted, 4096);
        assert_eq!(
            q.decide(0, 100, &absent, 2, 64, 8192).0.choice,
            RestoreChoice::IndexerOnly
        );
        q.learn(64, 0, 100, &absent, &loaded);
        assert_eq!(
            q.decide(0, 100, &absent, 2, 64, 8192).0.choice,
            RestoreChoice::Predicted
        );
    }

    #[test]
    fn a_copy_costs_what_its_engine_spends_on_one() {
        use crate::config::IoBackend;
        // The kernel's ops are nearly free to add; the driver's ranges dearest.
        let [k, c, d] =
            [IoBackend::Kernel, IoBackend::Cpu, IoBackend::Direct].map(default_copy_overhead);
        assert!(k < c && c < d, "{k} {c} {d}");
        assert_eq!(c, crate::scheduler::prefix::DEFAULT_COPY_OVERHEAD);
    }

    #[test]
    fn fixed_modes_and_names() {
        let mut p = RestorePolicy::new(RestoreMode::Full, 0);
        assert_eq!(decide(&mut p, 10, 1, 1, 1).choice, RestoreChoice::Full);
        let mut p = RestorePolicy::new(RestoreMode::IndexerOnly, 0);
        assert_eq!(
            decide(&mut p, 10, 1, 1, 1).choice,
            RestoreChoice::IndexerOnly
        );
        assert_eq!(RestoreMode::parse("auto").unwrap(), RestoreMode::Auto);
        assert_eq!(
            RestoreMode::parse("predicted").unwrap(),
            RestoreMode::Predicted
        );
        assert!(RestoreMode::parse("half").is_err());
        assert_eq!(RestoreChoice::Predicted.name(), "predicted");
        // Moving average: a new sample weighs a quarter.
        let mut p = RestorePolicy::new(RestoreMode::Auto, 0);
        learn(&mut p, 8, 100, 100);
        learn(&mut p, 8, 100, 0);
        assert_eq!(p.coverage(8), Some(0.75));
        learn(&mut p, 8, 0, 0); // nothing absent: no sample
        assert_eq!(p.coverage(8), Some(0.75));
    }
}
