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

/// A handle to a request record, as a context carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestRef {
    /// The slot.
    pub slot: u32,
    /// The slot's generation when the record was made.
    pub generation: u32,
}

/// One request's accesses (module docs).
#[derive(Debug, Default)]
pub(crate) struct RequestRecord {
    /// The cache generation the record belongs to.
    pub cache_generation: u64,
    /// The LRU rank the request took, once it needed one.
    pub rank: Option<u64>,
    /// Keys seen, first-seen order.
    pub order: Vec<KeyId>,
    /// Flags of each seen key.
    pub seen: FxHashMap<KeyId, u8>,
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
        for id in self.order.drain(..) {
            keys.get_mut(id).holders -= 1;
            keys.release(id);
        }
        self.seen.clear();
    }

    /// Marks `id` seen (holding it) if new; returns whether it was new.
    pub fn see(&mut self, keys: &mut KeyTable, id: KeyId) -> bool {
        if self.seen.contains_key(&id) {
            return false;
        }
        self.seen.insert(id, 0);
        self.order.push(id);
        keys.get_mut(id).holders += 1;
        true
    }

    /// The flags of a seen key (0 if unseen).
    pub fn flags(&self, id: KeyId) -> u8 {
        self.seen.get(&id).copied().unwrap_or(0)
    }

    /// Adds `f` to a seen key's flags.
    pub fn set(&mut self, id: KeyId, f: u8) {
        if let Some(v) = self.seen.get_mut(&id) {
            *v |= f;
        }
    }
}

/// The records, in slots with generations.
#[derive(Debug, Default)]
pub(crate) struct RequestTable {
    slots: Vec<(u32, Option<RequestRecord>)>,
    free: Vec<u32>,
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
        let rec = RequestRecord {
            cache_generation,
            ..Default::default()
        };
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
