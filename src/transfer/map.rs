//! `PageTransferMap`: this operation's (source, destination) pairs.
//!
//! Pairs are in units of whole pages, or of token rows in token-granularity mode (a token
//! unit is `page * page_size + token`). Sorted by source and merged where both sides are
//! contiguous, they become segments: what the direct path submits.

use crate::error::{Error, Result};
use rustc_hash::FxHashSet;

/// What one unit of a map is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// Whole pages.
    Page,
    /// Single token rows: a token-level selection moves only what it needs.
    Token,
}

impl Granularity {
    /// Parses `page` or `token`.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s {
            "page" => Ok(Granularity::Page),
            "token" => Ok(Granularity::Token),
            _ => Err(Error::config(field, format!("{s:?}"), "page or token")),
        }
    }

    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            Granularity::Page => "page",
            Granularity::Token => "token",
        }
    }
}

/// A run of units contiguous on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First source unit.
    pub src: u64,
    /// First destination unit.
    pub dst: u64,
    /// Units in the run.
    pub len: u64,
}

/// The (source, destination) pairs of one operation, sorted by source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTransferMap {
    granularity: Granularity,
    pairs: Vec<(u64, u64)>,
    segments: Vec<Segment>,
}

impl PageTransferMap {
    /// Pairs `src[i] -> dst[i]`. Refuses unequal lengths, an empty map, and a destination
    /// listed twice (two writers of one unit).
    pub fn new(granularity: Granularity, src: &[u64], dst: &[u64]) -> Result<Self> {
        if src.len() != dst.len() {
            return Err(Error::plan(
                "dst.len()",
                dst.len(),
                format!("{}: one destination per source", src.len()),
            ));
        }
        if src.is_empty() {
            return Err(Error::plan("src", "an empty map", "at least one pair"));
        }
        let mut seen = FxHashSet::default();
        seen.reserve(dst.len());
        for &d in dst {
            if !seen.insert(d) {
                return Err(Error::plan(
                    "dst",
                    format!("{} {d} listed twice", granularity.name()),
                    "each destination at most once",
                ));
            }
        }
        let mut pairs: Vec<(u64, u64)> = src.iter().copied().zip(dst.iter().copied()).collect();
        pairs.sort_unstable();
        let mut segments: Vec<Segment> = Vec::new();
        for &(s, d) in &pairs {
            match segments.last_mut() {
                Some(seg) if seg.src + seg.len == s && seg.dst + seg.len == d => seg.len += 1,
                _ => segments.push(Segment {
                    src: s,
                    dst: d,
                    len: 1,
                }),
            }
        }
        Ok(PageTransferMap {
            granularity,
            pairs,
            segments,
        })
    }

    /// Page or token units.
    pub fn granularity(&self) -> Granularity {
        self.granularity
    }

    /// The pairs, sorted by source.
    pub fn pairs(&self) -> &[(u64, u64)] {
        &self.pairs
    }

    /// Runs contiguous on both sides.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Units moved.
    pub fn units(&self) -> usize {
        self.pairs.len()
    }

    /// Largest source and destination unit, for range checks.
    pub fn max_units(&self) -> (u64, u64) {
        let s = self.pairs.last().map_or(0, |p| p.0);
        let d = self.pairs.iter().map(|p| p.1).max().unwrap_or(0);
        (s, d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_and_merges_runs_contiguous_on_both_sides() {
        let m = PageTransferMap::new(
            Granularity::Page,
            &[7, 2, 3, 4, 9, 8],
            &[5, 10, 11, 12, 1, 6],
        )
        .unwrap();
        assert_eq!(
            m.segments(),
            &[
                Segment {
                    src: 2,
                    dst: 10,
                    len: 3
                },
                Segment {
                    src: 7,
                    dst: 5,
                    len: 2
                },
                Segment {
                    src: 9,
                    dst: 1,
                    len: 1
                },
            ]
        );
        assert_eq!(m.units(), 6);
    }

    #[test]
    fn duplicate_destination_is_an_error() {
        let e = PageTransferMap::new(Granularity::Page, &[1, 2], &[3, 3]).unwrap_err();
        assert!(matches!(e, Error::Plan { ref field, .. } if field == "dst"));
        assert!(PageTransferMap::new(Granularity::Page, &[1], &[]).is_err());
        assert!(PageTransferMap::new(Granularity::Token, &[], &[]).is_err());
        // a source listed twice is fine: one page restored into two slots
        PageTransferMap::new(Granularity::Page, &[1, 1], &[2, 3]).unwrap();
    }
}
