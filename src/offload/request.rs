//! Request records: what one request touched, for request-scoped recency.
//!
//! vLLM keeps a request's cache accesses on its `ReqContext`; here they live in the core, and
//! the context carries a [`RequestRef`] (a slot and its generation) to them. A record holds
//! the keys the request saw, in first-seen order, with what it did to each (inserted, reused,
//! store-missed), the LRU rank it took, and whether it finished. A record belongs to one cache
//! generation: after `reset_cache` it reads as new. Records are freed when the engine drops
//! the context (the binding queues the ref) — a finished request's record is kept until then,
//! emptied, so a second finish stays a no-op.

use super::keys::{KeyId, KeyTable};
use rustc_hash::FxHashMap;

/// What a request did to a key it saw.
pub(crate) mod flags {
    /// It stored the key (its store allocated the chunk).
    pub const INSERTED: u8 = 1;
    /// It read the key's ready chunk (a load, or an offer of an already stored key).
    pub const REUSED: u8 = 2;
    /// Its offer found the key missing (ARC learns from ghosts once per request).
    pub const STORE_MISS: u8 = 4;
}

/// Freed records kept for reuse.
const SPARE_RECORDS: usize = 64;

/// A handle to a request record, as a context carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestRef {
    /// The slot.
    pub slot: u32,
    /// The slot's generation when the record was made.
    pub generation: u32,
}

/// A key a request saw: where its token span ends (as its context said when the key was
/// first seen, if it said) and what the request did to it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seen {
    pub id: KeyId,
    pub position: Option<i64>,
    pub flags: u8,
}

/// One request's accesses (module docs).
#[derive(Debug, Default)]
pub(crate) struct RequestRecord {
    /// The cache generation the record belongs to.
    pub cache_generation: u64,
    /// The LRU rank the request took, once it needed one.
    pub rank: Option<u64>,
    /// Keys seen, first-seen order.
    pub order: Vec<Seen>,
    /// Where each seen key is in `order`.
    pub seen: FxHashMap<KeyId, u32>,
    pub finished: bool,
}

impl RequestRecord {
    /// Drops the record's keys (releasing what nothing else holds) and starts it over for
    /// `cache_generation`.
    pub fn restart(&mut self, keys: &mut KeyTable, cache_generation: u64) {
        self.drop_keys(keys);
        self.cache_generation = cache_generation;
        self.rank = None;
        self.finished = false;
    }

    /// Releases the keys it holds.
    pub fn drop_keys(&mut self, keys: &mut KeyTable) {
        for s in self.order.drain(..) {
            keys.get_mut(s.id).holders -= 1;
            keys.release(s.id);
        }
        self.seen.clear();
    }

    /// Marks `id` seen at `position` (holding it) if new; returns whether it was new.
    pub fn see(&mut self, keys: &mut KeyTable, id: KeyId, position: Option<i64>) -> bool {
        let next = self.order.len() as u32;
        if *self.seen.entry(id).or_insert(next) != next {
            return false;
        }
        self.order.push(Seen {
            id,
            position,
            flags: 0,
        });
        keys.get_mut(id).holders += 1;
        true
    }

    /// Whether `id` was seen.
    pub fn has_seen(&self, id: KeyId) -> bool {
        self.seen.contains_key(&id)
    }

    /// The flags of a seen key (0 if unseen).
    pub fn flags(&self, id: KeyId) -> u8 {
        self.seen
            .get(&id)
            .map_or(0, |&i| self.order[i as usize].flags)
    }

    /// Adds `f` to a seen key's flags.
    pub fn set(&mut self, id: KeyId, f: u8) {
        if let Some(&i) = self.seen.get(&id) {
            self.order[i as usize].flags |= f;
        }
    }
}

/// The records, in slots with generations.
#[derive(Debug, Default)]
pub(crate) struct RequestTable {
    slots: Vec<(u32, Option<RequestRecord>)>,
    free: Vec<u32>,
    /// Freed records, emptied, whose maps and lists keep their capacity for the next ones
    /// (a long request's record grows to thousands of keys).
    spare: Vec<RequestRecord>,
}

impl RequestTable {
    /// The record `r` names, if it is still the one made for it.
    pub fn get_mut(&mut self, r: RequestRef) -> Option<&mut RequestRecord> {
        match self.slots.get_mut(r.slot as usize) {
            Some((g, Some(rec))) if *g == r.generation => Some(rec),
            _ => None,
        }
    }

    /// A new record for `cache_generation`.
    pub fn create(&mut self, cache_generation: u64) -> RequestRef {
        let mut rec = self.spare.pop().unwrap_or_default();
        rec.cache_generation = cache_generation;
        match self.free.pop() {
            Some(slot) => {
                let (g, r) = &mut self.slots[slot as usize];
                *r = Some(rec);
                RequestRef {
                    slot,
                    generation: *g,
                }
            }
            None => {
                self.slots.push((0, Some(rec)));
                RequestRef {
                    slot: (self.slots.len() - 1) as u32,
                    generation: 0,
                }
            }
        }
    }

    /// Frees the record `r` names (its context is gone); a stale `r` is ignored.
    pub fn free(&mut self, keys: &mut KeyTable, r: RequestRef) {
        if let Some((g, slot)) = self.slots.get_mut(r.slot as usize) {
            if *g == r.generation {
                if let Some(mut rec) = slot.take() {
                    rec.drop_keys(keys);
                    rec.rank = None;
                    rec.finished = false;
                    if self.spare.len() < SPARE_RECORDS {
                        self.spare.push(rec);
                    }
                    *g = g.wrapping_add(1);
                    self.free.push(r.slot);
                }
            }
        }
    }

    /// Live records.
    pub fn len(&self) -> usize {
        self.slots.iter().filter(|(_, r)| r.is_some()).count()
    }

    /// Every live record.
    pub fn iter(&self) -> impl Iterator<Item = &RequestRecord> {
        self.slots.iter().filter_map(|(_, r)| r.as_ref())
    }
}
