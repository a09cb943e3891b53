//! The LRU policy, with vLLM's request-scoped recency.
//!
//! Each key has a rank `(major, minor)`; the evictable key of lowest rank goes first, and keys
//! of equal rank go in byte order of the key (what vLLM's heap of `(rank, key)` tuples does).
//! A plain use (a store without a token position, a touch, a request's end) gives the key a
//! fresh global rank `(next, 0)`. A key a running request reaches at token position `p` gets
//! `(r, -p)`, `r` being one rank the request takes the first time it needs one: a request's
//! keys then share a recency, tails before heads, however its stores and loads complete.
//!
//! Evictable keys (resident, no load reading them, store complete) sit in a min-queue with
//! lazy deletion: every push stamps the key (`heap_seq`), and an entry is current only while
//! its key is still evictable with that stamp. Ranks mostly grow, so most pushes append to
//! the queue's sorted run and most pops take its front (`queue.rs`).

use super::keys::{KeyId, KeyTable};
use super::queue::MinQueue;

/// One queue entry. Entries of equal rank (a request's keys at one position, one per KV
/// group) leave in byte order of their keys, as vLLM's heap of `(rank, key)` tuples has them:
/// `evict` sorts each run of equal ranks it takes by the keys' bytes, so an entry carries
/// no bytes of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    rank: (u64, i64),
    id: KeyId,
    seq: u32,
}

/// The LRU policy's state (module docs).
#[derive(Debug, Default)]
pub struct LruPolicy {
    heap: MinQueue<Entry>,
    next_rank: u64,
    /// Evictable keys (each has exactly one current heap entry).
    evictable: usize,
}

impl LruPolicy {
    /// Whether `id`'s heap entry `seq` is current.
    fn current(keys: &KeyTable, id: KeyId, seq: u32) -> bool {
        let e = keys.get(id);
        e.heap_seq == seq && e.chunk.is_some_and(|c| c.refs == 0)
    }

    fn push(&mut self, keys: &mut KeyTable, id: KeyId) {
        let e = keys.get_mut(id);
        e.heap_seq = e.heap_seq.wrapping_add(1);
        self.heap.push(Entry {
            rank: e.rank,
            id,
            seq: e.heap_seq,
        });
        self.compact(keys);
    }

    /// Drops stale entries once they outnumber the current ones.
    fn compact(&mut self, keys: &KeyTable) {
        if self.heap.len() >= (2 * self.evictable).max(64) {
            self.heap.retain(|en| Self::current(keys, en.id, en.seq));
        }
    }

    /// A fresh global rank for a resident key; pushes it again if evictable.
    fn renew(&mut self, keys: &mut KeyTable, id: KeyId) {
        let e = keys.get_mut(id);
        let Some(chunk) = e.chunk else { return };
        self.next_rank += 1;
        e.rank = (self.next_rank, 0);
        if chunk.refs == 0 {
            self.push(keys, id);
        }
    }

    /// The next global rank (a request's rank is one of these, taken when first needed).
    pub fn take_rank(&mut self) -> u64 {
        self.next_rank += 1;
        self.next_rank
    }

    /// A key just stored (its chunk set): ranked by its request at `position`, else fresh.
    /// `request_rank` gives the request's rank, taking one the first time.
    pub fn insert(
        &mut self,
        keys: &mut KeyTable,
        id: KeyId,
        position: Option<i64>,
        request_rank: impl FnOnce(&mut Self) -> u64,
    ) {
        let rank = match position {
            Some(p) => (request_rank(self), p.wrapping_neg()),
            None => (self.take_rank(), 0),
        };
        keys.get_mut(id).rank = rank;
        if keys.get(id).chunk.is_some_and(|c| c.refs == 0) {
            self.mark_evictable(keys, id);
        }
    }

    /// A chunk's refs went to 0 (store completed, last load done).
    pub fn mark_evictable(&mut self, keys: &mut KeyTable, id: KeyId) {
        self.evictable += 1;
        self.push(keys, id);
    }

    /// A chunk's refs left 0 (a load pinned it): its heap entry is stale from now on.
    pub fn mark_non_evictable(&mut self) {
        self.evictable -= 1;
    }

    /// vLLM's `touch`: fresh ranks, last key first (so the first key ends most recent).
    pub fn touch(&mut self, keys: &mut KeyTable, ids: &[KeyId]) {
        for &id in ids.iter().rev() {
            self.renew(keys, id);
        }
    }

    /// A running request's first access of `ids` at their `positions`: each positioned
    /// resident key rises to `(request rank, -position)` unless it ranks higher already.
    pub fn on_request_access(
        &mut self,
        keys: &mut KeyTable,
        ids: &[KeyId],
        positions: &[Option<i64>],
        request_rank: u64,
    ) {
        for (&id, &pos) in ids.iter().zip(positions) {
            let Some(p) = pos else { continue };
            let e = keys.get_mut(id);
            let Some(chunk) = e.chunk else { continue };
            let rank = (request_rank, p.wrapping_neg());
            if e.rank >= rank {
                continue;
            }
            e.rank = rank;
            if chunk.refs == 0 {
                self.push(keys, id);
            }
        }
    }

    /// A request's end: its keys, head to tail, get fresh ranks tail first.
    pub fn on_request_finished(&mut self, keys: &mut KeyTable, ordered: &[KeyId]) {
        self.touch(keys, ordered);
    }

    /// Evicts exactly `n` evictable keys not `protected`, lowest rank first (equal ranks in
    /// byte order of the keys), or none at all (`None`). The caller removes the returned
    /// keys' chunks.
    pub fn evict(
        &mut self,
        keys: &KeyTable,
        n: usize,
        protected: impl Fn(KeyId) -> bool,
    ) -> Option<Vec<KeyId>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let mut selected: Vec<Entry> = Vec::with_capacity(n);
        let mut deferred = Vec::new();
        let mut run: Vec<Entry> = Vec::new();
        'take: while selected.len() < n {
            // The next run of current entries of one rank, in byte order of their keys.
            run.clear();
            while let Some(en) = self.heap.peek().copied() {
                if run.first().is_some_and(|f| f.rank != en.rank) {
                    break;
                }
                self.heap.pop();
                if Self::current(keys, en.id, en.seq) {
                    run.push(en);
                }
            }
            if run.is_empty() {
                break;
            }
            if run.len() > 1 {
                run.sort_by(|a, b| keys.get(a.id).bytes().cmp(keys.get(b.id).bytes()));
            }
            let mut rest = run.drain(..);
            for en in rest.by_ref() {
                if protected(en.id) {
                    deferred.push(en);
                } else {
                    selected.push(en);
                    if selected.len() == n {
                        deferred.extend(rest);
                        break 'take;
                    }
                }
            }
        }
        let ok = selected.len() == n;
        if !ok {
            deferred.append(&mut selected);
        }
        for en in deferred {
            self.heap.push(en);
        }
        if !ok {
            return None;
        }
        self.evictable -= n;
        Some(selected.into_iter().map(|en| en.id).collect())
    }

    /// Forgets every key (the caller clears the chunks) and restarts the ranks.
    pub fn clear(&mut self) {
        self.heap.clear();
        self.next_rank = 0;
        self.evictable = 0;
    }

    /// Checks that the current heap entries are exactly the evictable keys, one each.
    pub fn validate(&self, keys: &KeyTable) -> Result<(), String> {
        let mut current: Vec<KeyId> = self
            .heap
            .iter()
            .filter(|en| Self::current(keys, en.id, en.seq))
            .map(|en| en.id)
            .collect();
        current.sort_unstable();
        let before = current.len();
        current.dedup();
        if current.len() != before {
            return Err("a key has two current LRU heap entries".into());
        }
        let mut evictable: Vec<KeyId> = keys
            .iter()
            .filter(|(_, e)| e.chunk.is_some_and(|c| c.refs == 0))
            .map(|(id, _)| id)
            .collect();
        evictable.sort_unstable();
        if current != evictable {
            return Err(format!(
                "LRU heap holds {} current entries for {} evictable keys",
                current.len(),
                evictable.len()
            ));
        }
        if self.evictable != evictable.len() {
            return Err(format!(
                "LRU counts {} evictable keys, {} are",
                self.evictable,
                evictable.len()
            ));
        }
        for en in self.heap.iter() {
            if Self::current(keys, en.id, en.seq) && keys.get(en.id).rank != en.rank {
                return Err(format!(
                    "key {:?}'s current heap entry has a stale rank",
                    en.id
                ));
            }
        }
        Ok(())
    }
}
