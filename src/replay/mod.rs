//! Replays a directory journal at other device sizes: the residency policy sparsetier runs
//! (LRU with pins, through the real directory) and the offline optimum (Belady's MIN) on the
//! same calls, so a user sees what a device budget buys and how far LRU is from the best any
//! policy could do.
//!
//! Both replays run the journal's calls in order with an instant link: a load completes when
//! the recorded one did (or, if the recording made none, before its handle is released), a
//! backup when the recorded one did. When the device is full of pages that are pinned or not
//! yet written through, both write every unbacked page through at once and drop the pins of
//! outstanding prefetches, as the step scheduler's make-room does; a budget that still cannot
//! hold a call's pinned pages is infeasible.

pub mod lru;
pub mod min;

pub use lru::replay_lru;
pub use min::replay_min;

use crate::directory::journal::{Journal, Op};

/// What one replay at one budget saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Device slots.
    pub budget: u64,
    /// Whether every call fit; the counts stop where one did not.
    pub feasible: bool,
    /// Objects read by resolves (distinct per call).
    pub accesses: u64,
    /// Of those, found on the device (Ready, or Loading by an earlier call).
    pub hits: u64,
    /// Objects loaded (resolves and prefetches).
    pub loads: u64,
    /// Of those, by prefetches.
    pub prefetch_loads: u64,
    /// Pages written through early to make room.
    pub forced_backups: u64,
    /// Decode steps (journal step markers).
    pub steps: u64,
}

/// The most objects alive at once: at this budget nothing ever needs evicting.
pub fn peak_live(j: &Journal) -> u64 {
    let mut live: rustc_hash::FxHashMap<(u64, u32), u64> = Default::default();
    let (mut now, mut peak) = (0u64, 0u64);
    let mut seen = rustc_hash::FxHashSet::default();
    for i in 0..j.len() {
        let (op, arg, flag, keys) = j.entry(i);
        match op {
            Op::Alloc | Op::Register => {
                for k in keys {
                    if seen.insert(j.key(k)) {
                        now += 1;
                        *live.entry((j.ns[k], j.version[k])).or_default() += 1;
                    }
                }
                peak = peak.max(now);
            }
            Op::Drop => {
                now -= live.remove(&(arg, flag)).unwrap_or(0);
            }
            _ => {}
        }
    }
    peak
}
