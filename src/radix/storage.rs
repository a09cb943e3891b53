//! The L3 tier's state: page keys, the write policy, and the writes and prefetches the cache
//! has planned and a backend executes.
//!
//! The core decides what moves and when; a backend (`sparsetier.l3`, Python: a local
//! directory or Mooncake Store) only runs the plans and reports back. What the core keeps:
//! - **page keys**: a hash chain over each page's tokens and its parent's key, under a salt
//!   (model version, LoRA) and the namespace, stable across processes and machines;
//! - **being written**: the node's host pages are pinned (host eviction cannot free a page
//!   under a write; device eviction and the node's ancestors are unaffected);
//! - **being prefetched**: host pages held by the prefetch until it is committed or ended;
//! - **stored**: keys this process wrote or fetched, a bounded memory of recent ones (the
//!   store itself is the truth: another server's pages are found by asking it).

use crate::ids::PageId;
use crate::radix::NodeId;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::VecDeque;
use std::fmt;

/// A page's key in the store: 128 bits of a BLAKE3 chain.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey(pub [u8; 16]);

impl fmt::Debug for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageKey({self})")
    }
}

impl fmt::Display for PageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Keys of the whole pages of `tokens` in namespace `ns` under `salt`: page i's key hashes
/// page i-1's key and page i's tokens (little-endian u32), so equal keys mean equal prefixes.
pub fn page_keys(salt: &str, ns: u32, tokens: &[u32], page_size: usize) -> Vec<PageKey> {
    let mut base = blake3::Hasher::new();
    base.update(b"sparsetier-l3-page-v1\0");
    base.update(&(salt.len() as u64).to_le_bytes());
    base.update(salt.as_bytes());
    base.update(&ns.to_le_bytes());
    let mut parent = [0u8; 16];
    let mut bytes = Vec::with_capacity(page_size * 4);
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            let mut h = base.clone();
            h.update(&parent);
            bytes.clear();
            bytes.extend(page.iter().flat_map(|t| t.to_le_bytes()));
            h.update(&bytes);
            parent.copy_from_slice(&h.finalize().as_bytes()[..16]);
            PageKey(parent)
        })
        .collect()
}

/// When a host page is written to L3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePolicy {
    /// As soon as its host copy is Ready.
    WriteThrough,
    /// When the host tier evicts it (the page leaves host memory only once stored).
    WriteBack,
}

impl WritePolicy {
    /// Parses `write_through` / `write_back`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "write_through" => Some(WritePolicy::WriteThrough),
            "write_back" => Some(WritePolicy::WriteBack),
            _ => None,
        }
    }
}

/// A write for a backend: put host pages under their keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// The id to report back with.
    pub id: u64,
    /// One key per page.
    pub keys: Vec<PageKey>,
    /// The host pages to read, one per key.
    pub host_pages: Vec<PageId>,
}

/// A prefetch for a backend: get keys into host pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefetchPlan {
    /// The id to report back with.
    pub id: u64,
    /// One key per page, in prefix order.
    pub keys: Vec<PageKey>,
    /// The host pages to fill, one per key.
    pub host_pages: Vec<PageId>,
}

/// The L3 tier state of one key as this process knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L3State {
    /// Nothing known: ask the store.
    Unknown,
    /// Written or fetched by this process (recently).
    Stored,
    /// A write is in flight.
    Writing,
    /// A prefetch is in flight.
    Prefetching,
}

/// Counters of the L3 tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageTotals {
    /// Write plans handed out.
    pub writes_planned: u64,
    /// Pages written (reported stored).
    pub pages_written: u64,
    /// Pages whose write failed.
    pub write_failures: u64,
    /// Host pages evicted under write-back while the store was off (not stored).
    pub evicted_unstored: u64,
    /// Prefetch plans handed out.
    pub prefetches_planned: u64,
    /// Pages prefetched and inserted into the tree.
    pub pages_prefetched: u64,
    /// Planned pages that did not arrive (missing, corrupt, failed, or not waited for).
    pub prefetch_missed: u64,
    /// Pages that arrived but the tree already held (or whose prefix left meanwhile).
    pub prefetch_spare: u64,
    /// Times the store was turned off (unreachable).
    pub offline_events: u64,
}

pub(crate) struct WriteOp {
    /// Pinned until the write ends: its host pages cannot leave meanwhile.
    pub node: NodeId,
    pub keys: Vec<PageKey>,
    pub host_pages: Vec<PageId>,
}

pub(crate) struct PrefetchOp {
    pub ns: u32,
    /// Tokens of every planned page (from the root).
    pub tokens: Vec<u32>,
    pub start_page: usize,
    pub keys: Vec<PageKey>,
    pub host_pages: Vec<PageId>,
    /// Pages before this were handed to the tree (or freed) by `commit`; `host_pages` then
    /// holds only the rest, which `end` frees.
    pub committed: Option<usize>,
}

/// A bounded set remembering the most recently added keys.
struct RecentKeys {
    set: FxHashSet<PageKey>,
    order: VecDeque<PageKey>,
    cap: usize,
}

impl RecentKeys {
    fn new(cap: usize) -> Self {
        RecentKeys {
            set: FxHashSet::default(),
            order: VecDeque::new(),
            cap: cap.max(1),
        }
    }

    fn insert(&mut self, k: PageKey) {
        if self.set.insert(k) {
            self.order.push_back(k);
            while self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }

    fn remove(&mut self, k: &PageKey) -> bool {
        // The order queue keeps the stale entry; it only ages out (bounded by `cap`).
        self.set.remove(k)
    }

    fn contains(&self, k: &PageKey) -> bool {
        self.set.contains(k)
    }

    fn len(&self) -> usize {
        self.set.len()
    }
}

/// The L3 tier of a [`crate::radix::HiCache`].
pub struct StorageTier {
    pub(crate) policy: WritePolicy,
    /// Under write-back, the share of host pages kept clean (free, or stored in L3).
    pub(crate) write_ahead: f64,
    pub(crate) salt: String,
    pub(crate) online: bool,
    pub(crate) writes: FxHashMap<u64, WriteOp>,
    pub(crate) queued: Vec<u64>,
    pub(crate) prefetches: FxHashMap<u64, PrefetchOp>,
    stored: RecentKeys,
    /// Keys whose write-back failed: evicted without another try (not a livelock on a store
    /// that refuses them).
    failed: RecentKeys,
    writing: FxHashMap<PageKey, u32>,
    prefetching: FxHashMap<PageKey, u32>,
    pub(crate) totals: StorageTotals,
}

impl StorageTier {
    /// A tier writing under `policy`, keys salted with `salt`, remembering up to `remember`
    /// stored keys, keeping `write_ahead` of the host tier clean under write-back.
    pub fn new(policy: WritePolicy, salt: String, remember: usize, write_ahead: f64) -> Self {
        StorageTier {
            policy,
            write_ahead,
            salt,
            online: true,
            writes: FxHashMap::default(),
            queued: Vec::new(),
            prefetches: FxHashMap::default(),
            stored: RecentKeys::new(remember),
            failed: RecentKeys::new(remember),
            writing: FxHashMap::default(),
            prefetching: FxHashMap::default(),
            totals: StorageTotals::default(),
        }
    }

    /// The write policy.
    pub fn policy(&self) -> WritePolicy {
        self.policy
    }

    /// Whether the store is in use.
    pub fn online(&self) -> bool {
        self.online
    }

    /// Counters.
    pub fn totals(&self) -> StorageTotals {
        self.totals
    }

    /// Keys remembered as stored.
    pub fn stored_len(&self) -> usize {
        self.stored.len()
    }

    /// Writes planned and not yet reported.
    pub fn writes_in_flight(&self) -> usize {
        self.writes.len()
    }

    /// Prefetches planned and not yet ended.
    pub fn prefetches_in_flight(&self) -> usize {
        self.prefetches.len()
    }

    /// What this process knows of `key`.
    pub fn state(&self, key: &PageKey) -> L3State {
        if self.writing.contains_key(key) {
            L3State::Writing
        } else if self.prefetching.contains_key(key) {
            L3State::Prefetching
        } else if self.stored.contains(key) {
            L3State::Stored
        } else {
            L3State::Unknown
        }
    }

    /// Keys of `keys` that need a write: not stored, not being written.
    pub(crate) fn unstored(&self, keys: &[PageKey]) -> Vec<usize> {
        (0..keys.len())
            .filter(|&i| !self.stored.contains(&keys[i]) && !self.writing.contains_key(&keys[i]))
            .collect()
    }

    /// Write plans queued since the last call, for a backend.
    pub(crate) fn take_plans(&mut self) -> Vec<WritePlan> {
        let queued = std::mem::take(&mut self.queued);
        queued
            .into_iter()
            .filter_map(|id| {
                self.writes.get(&id).map(|op| WritePlan {
                    id,
                    keys: op.keys.clone(),
                    host_pages: op.host_pages.clone(),
                })
            })
            .collect()
    }

    /// Forgets every failed write (the store came back: they may succeed now).
    pub(crate) fn clear_failed(&mut self) {
        self.failed = RecentKeys::new(self.failed.cap);
    }

    /// Whether a write-back of `key` failed before (then it is evicted without a retry).
    pub(crate) fn gave_up(&self, key: &PageKey) -> bool {
        self.failed.contains(key)
    }

    pub(crate) fn forget_failed(&mut self, key: &PageKey) {
        self.failed.remove(key);
    }

    fn id(&mut self) -> u64 {
        crate::ids::serial()
    }

    pub(crate) fn add_write(
        &mut self,
        node: NodeId,
        keys: Vec<PageKey>,
        host_pages: Vec<PageId>,
    ) -> u64 {
        let id = self.id();
        for k in &keys {
            *self.writing.entry(*k).or_default() += 1;
        }
        self.writes.insert(
            id,
            WriteOp {
                node,
                keys,
                host_pages,
            },
        );
        self.queued.push(id);
        self.totals.writes_planned += 1;
        id
    }

    /// Ends write `id`: keys with `ok` become stored. Returns the op.
    pub(crate) fn end_write(&mut self, id: u64, ok: &[bool]) -> Option<WriteOp> {
        let op = self.writes.remove(&id)?;
        self.queued.retain(|&q| q != id);
        for (i, k) in op.keys.iter().enumerate() {
            unmark(&mut self.writing, k);
            if ok.get(i).copied().unwrap_or(false) {
                self.stored.insert(*k);
                self.failed.remove(k);
                self.totals.pages_written += 1;
            } else {
                self.failed.insert(*k);
                self.totals.write_failures += 1;
            }
        }
        Some(op)
    }

    pub(crate) fn add_prefetch(&mut self, op: PrefetchOp) -> u64 {
        let id = self.id();
        for k in &op.keys {
            *self.prefetching.entry(*k).or_default() += 1;
        }
        self.prefetches.insert(id, op);
        self.totals.prefetches_planned += 1;
        id
    }

    pub(crate) fn mark_stored(&mut self, keys: &[PageKey]) {
        for k in keys {
            self.stored.insert(*k);
        }
    }

    pub(crate) fn end_prefetch(&mut self, id: u64) -> Option<PrefetchOp> {
        let op = self.prefetches.remove(&id)?;
        for k in &op.keys {
            unmark(&mut self.prefetching, k);
        }
        Some(op)
    }

    /// Host pages held by prefetches (not yet handed to the tree or freed).
    pub(crate) fn held_host_pages(&self) -> usize {
        self.prefetches.values().map(|p| p.host_pages.len()).sum()
    }
}

fn unmark(m: &mut FxHashMap<PageKey, u32>, k: &PageKey) {
    if let Some(c) = m.get_mut(k) {
        *c -= 1;
        if *c == 0 {
            m.remove(k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_over_prefixes() {
        let t: Vec<u32> = (0..12).collect();
        let a = page_keys("m", 0, &t, 4);
        assert_eq!(a.len(), 3);
        // A prefix has the same keys; a change in page 1 changes pages 1 and 2 only.
        assert_eq!(page_keys("m", 0, &t[..8], 4), a[..2]);
        let mut u = t.clone();
        u[5] = 99;
        let b = page_keys("m", 0, &u, 4);
        assert_eq!(b[0], a[0]);
        assert_ne!(b[1], a[1]);
        assert_ne!(b[2], a[2]);
        // Salt and namespace separate everything.
        assert_ne!(page_keys("n", 0, &t, 4)[0], a[0]);
        assert_ne!(page_keys("m", 1, &t, 4)[0], a[0]);
        // A partial page has no key.
        assert_eq!(page_keys("m", 0, &t[..11], 4).len(), 2);
        // Stable across processes, machines and releases: a fixed value (a change of the
        // key format orphans every stored page, so it must be deliberate).
        assert_eq!(
            page_keys("", 0, &t, 4)[0].to_string(),
            "c4dacb2b43954d512e3d4f55db9ae53a"
        );
    }

    #[test]
    fn recent_keys_are_bounded() {
        let mut r = RecentKeys::new(2);
        for i in 0..5u8 {
            r.insert(PageKey([i; 16]));
        }
        assert_eq!(r.len(), 2);
        assert!(r.contains(&PageKey([4; 16])) && !r.contains(&PageKey([0; 16])));
    }
}
