//! What a selection cost: per-resolve records, cumulative totals, and the token-to-page
//! granularity helper.

use crate::error::{Error, Result};

/// The record of one `resolve` batch. Timestamps are ns since the directory started; those not
/// reached yet are `None` (the record returned by `resolve` has only `resolved_ns`; the one
/// returned by `release` has all that happened).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ResolveMetrics {
    /// Keys in the batch, repeats included.
    pub selected: u64,
    /// Distinct objects after dedup.
    pub distinct: u64,
    /// Objects already Ready on the device.
    pub ready: u64,
    /// Objects that were Absent and now load.
    pub absent: u64,
    /// Objects found Loading: joined in-flight transfers.
    pub loading: u64,
    /// In-flight reuse: objects served by a transfer another batch started.
    pub inflight_reuse: u64,
    /// Bytes the consumer needs (by default distinct objects x object bytes).
    pub bytes_needed: u64,
    /// Bytes this batch makes the engine move.
    pub bytes_transferred: u64,
    /// Selection finished and resolved.
    pub resolved_ns: u64,
    /// Last of this batch's new loads reported submitted.
    pub submitted_ns: Option<u64>,
    /// Every transfer the batch depends on finished.
    pub ready_ns: Option<u64>,
    /// The batch's pins were released.
    pub consumed_ns: Option<u64>,
}

impl ResolveMetrics {
    /// Bytes this batch moved over the bytes its consumer needs, hits included (0 when
    /// nothing was needed). Not seed 002's read amplification (moved over needed *among what
    /// moved*), which the step scheduler's record reports; the two agree only when every
    /// selected page moved.
    pub fn moved_per_needed(&self) -> f64 {
        ratio(self.bytes_transferred, self.bytes_needed)
    }

    /// Share of the batch's distinct objects already Ready on the device.
    pub fn device_byte_hit_rate(&self) -> f64 {
        ratio(self.ready, self.distinct)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Cumulative counters since the directory started.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Totals {
    /// `resolve` batches applied.
    pub resolves: u64,
    /// Keys selected, repeats included.
    pub selected: u64,
    /// Distinct objects resolved.
    pub distinct: u64,
    /// Device hits.
    pub ready: u64,
    /// Loads started.
    pub absent: u64,
    /// In-flight reuse.
    pub inflight_reuse: u64,
    /// Bytes needed.
    pub bytes_needed: u64,
    /// Bytes loaded.
    pub bytes_transferred: u64,
    /// Bytes backed up.
    pub bytes_backed_up: u64,
    /// Objects evicted from the device.
    pub evictions: u64,
    /// Objects an eviction passed over because the last device step read them (the
    /// resolver's published read bitmap).
    pub second_chances: u64,
    /// Second chances a device's grant of victims gave for the same reason (an object sent
    /// back once a bitmap; one the same walk reaches again, the rest being read too, is
    /// granted then, and counted here as well).
    pub grant_second_chances: u64,
    /// Loads completed.
    pub loads_completed: u64,
    /// Backups completed.
    pub backups_completed: u64,
    /// Transfers failed or cancelled.
    pub failed_transfers: u64,
    /// Loads started for objects whose previous load had failed.
    pub retries: u64,
    /// Pin handles released.
    pub releases: u64,
    /// Namespaces dropped.
    pub namespaces_dropped: u64,
}

impl Totals {
    /// Adds one resolve record.
    pub fn add(&mut self, m: &ResolveMetrics) {
        self.resolves += 1;
        self.selected += m.selected;
        self.distinct += m.distinct;
        self.ready += m.ready;
        self.absent += m.absent;
        self.inflight_reuse += m.inflight_reuse;
        self.bytes_needed += m.bytes_needed;
        self.bytes_transferred += m.bytes_transferred;
    }
}

/// Selected token positions mapped onto pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPages {
    /// Distinct pages touched, ascending.
    pub pages: Vec<u32>,
    /// Distinct tokens selected.
    pub tokens: u64,
    /// Bytes the consumer needs: tokens x bytes per token.
    pub bytes_needed: u64,
    /// Bytes a whole-page path moves: pages x page bytes.
    pub bytes_to_move: u64,
}

impl TokenPages {
    /// Bytes to move over bytes needed.
    pub fn read_amplification(&self) -> f64 {
        ratio(self.bytes_to_move, self.bytes_needed)
    }
}

/// Maps token positions to the pages that hold them: dedups tokens and pages, and counts the
/// bytes needed against the bytes a whole-page copy moves.
pub fn token_pages(positions: &[u64], page_size: u32, token_bytes: u64) -> Result<TokenPages> {
    if page_size == 0 {
        return Err(Error::config("page_size", 0, "an integer >= 1"));
    }
    let ps = u64::from(page_size);
    let mut tokens = positions.to_vec();
    tokens.sort_unstable();
    tokens.dedup();
    let mut pages: Vec<u32> = Vec::new();
    for &t in &tokens {
        let page = u32::try_from(t / ps).map_err(|_| {
            Error::out_of_range("positions", t, 0, i128::from(u32::MAX) * i128::from(ps))
        })?;
        if pages.last() != Some(&page) {
            pages.push(page);
        }
    }
    let n_tokens = tokens.len() as u64;
    Ok(TokenPages {
        bytes_needed: n_tokens * token_bytes,
        bytes_to_move: pages.len() as u64 * ps * token_bytes,
        tokens: n_tokens,
        pages,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scattered_tokens_amplify_reads_64x() {
        // 10 tokens of 1 KiB, each in its own 64-token page of 64 KiB.
        let positions: Vec<u64> = (0..10).map(|i| i * 64 + 5).collect();
        let tp = token_pages(&positions, 64, 1024).unwrap();
        assert_eq!(tp.pages.len(), 10);
        assert_eq!(tp.bytes_needed, 10 * 1024);
        assert_eq!(tp.bytes_to_move, 640 * 1024);
        assert_eq!(tp.read_amplification(), 64.0);
    }

    #[test]
    fn shared_pages_reduce_amplification() {
        let positions = [0u64, 1, 2, 3, 64, 65, 3, 2];
        let tp = token_pages(&positions, 64, 1024).unwrap();
        assert_eq!(tp.pages, vec![0, 1]);
        assert_eq!(tp.tokens, 6);
        assert!((tp.read_amplification() - 128.0 / 6.0).abs() < 1e-9);
    }
}
