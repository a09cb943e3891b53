//! `ChunkDirectory`: the host chunk tier behind an engine's offload connector.
//!
//! It answers, for every offload key: is it stored (in which chunk), is its store still in
//! flight, which loads read it, and which key goes when room is needed. Its calls and their
//! results are those of vLLM's `CPUOffloadingManager` (vLLM 0.33), so that vLLM's own tests
//! and a differential run against it hold:
//!
//! - `lookup`: miss, hit, or hit pending (store in flight);
//! - `prepare_load` pins ready chunks (in the keys' order), `complete_load` unpins;
//! - `prepare_store` is all or nothing: it stores the offered keys that are missing (those
//!   offered `store_threshold` times, when set), evicting unpinned, stored keys the offer does
//!   not name, and hands out fresh chunks before freed ones (freed ones last-in first-out);
//!   `complete_store` makes them readable, or frees them on failure;
//! - recency is request-scoped (see `lru.rs`, `arc.rs`), events list removals before stores.
//!
//! # Invariants (`validate`, after every step of the tests)
//! - chunk ids `< allocated` are each either on the free list or one resident key's chunk;
//! - `evictable` counts resident keys with no reader and a completed store, `write_pending`
//!   the resident keys whose store is in flight;
//! - the policy's structures agree with the key entries (`LruPolicy::validate`,
//!   `ArcPolicy::validate`), the tracker holds at most its bound;
//! - a key entry lives exactly while something refers to it, and its `holders` count the
//!   request records that saw it.
//!
//! # Errors
//! A call that would break the protocol (load a key that is not stored or not ready, unpin a
//! key nobody pinned, store a key twice in one offer, access new keys after the request
//! finished) is refused before anything changes.

use super::arc::ArcPolicy;
use super::keys::{group_of, Chunk, ChunkId, KeyBytes, KeyId, KeyTable};
use super::lru::LruPolicy;
use super::request::{flags, RequestRecord, RequestRef, RequestTable};
use super::tracker::ReuseTracker;
use crate::error::{Error, Result};
use rustc_hash::{FxHashMap, FxHashSet};

/// The eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used, with request-scoped recency.
    Lru,
    /// Adaptive replacement (recency and frequency).
    Arc,
}

impl PolicyKind {
    /// Parses vLLM's `cache_policy` names.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s {
            "lru" => Ok(PolicyKind::Lru),
            "arc" => Ok(PolicyKind::Arc),
            other => Err(Error::config(field, other, "'lru' or 'arc'")),
        }
    }
}

#[derive(Debug)]
enum Policy {
    Lru(LruPolicy),
    Arc(ArcPolicy),
}

/// What a directory is built with.
#[derive(Debug, Clone, Copy)]
pub struct DirectoryConfig {
    /// Chunks in the host pool.
    pub num_chunks: u32,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Offers a key needs before it is stored; below 2 every offer stores.
    pub store_threshold: u32,
    /// Bound of the reuse tracker (with `store_threshold >= 2`).
    pub max_tracker_size: usize,
    /// Whether to queue store and removal events.
    pub events: bool,
}

/// What `lookup` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Not stored.
    Miss,
    /// Stored and readable.
    Hit,
    /// Its store is in flight.
    HitPending,
}

/// A store or removal, as the engine's KV events report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The keys.
    pub keys: Vec<KeyBytes>,
    /// Removed (true) or stored.
    pub removed: bool,
    /// A failed store's cleanup: the keys were never announced as stored.
    pub metadata_only: bool,
}

/// What `prepare_store` decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Positions in the offer of the keys to store, in offer order.
    pub stored: Vec<usize>,
    /// Their chunks, in the same order.
    pub chunks: Vec<ChunkId>,
    /// Keys evicted to make room, in eviction order.
    pub evicted: Vec<KeyBytes>,
}

/// Pool usage, as fractions of the chunks (vLLM's gauges).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Chunks in use (pinned by a load or a store in flight).
    pub used: f64,
    /// Chunks whose store is in flight.
    pub write: f64,
    /// Chunks pinned by loads.
    pub read: f64,
}

/// Counters since the last `take_stats`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Usage now.
    pub usage: Usage,
    /// Keys each allocating `prepare_store` asked chunks for.
    pub allocation_sizes: Vec<u32>,
    /// Store candidates below the threshold (None without a threshold).
    pub stores_skipped: Option<u64>,
}

/// The directory (module docs).
#[derive(Debug)]
pub struct ChunkDirectory {
    keys: KeyTable,
    requests: RequestTable,
    policy: Policy,
    tracker: Option<ReuseTracker>,
    store_threshold: u32,
    num_chunks: u32,
    allocated: u32,
    free_list: Vec<ChunkId>,
    evictable: u32,
    write_pending: u32,
    events: Option<Vec<Event>>,
    stores_skipped: u64,
    allocation_sizes: Vec<u32>,
    generation: u64,
    /// Keys interned or dropped by the call in progress, released at its end.
    scratch: Vec<KeyId>,
}

/// Sorts `keys` stably by position if every one has a position (else leaves them).
fn sort_by_position(keys: &mut [(Option<i64>, KeyId)]) {
    if keys.iter().all(|k| k.0.is_some()) && !keys.is_sorted_by_key(|k| k.0) {
        keys.sort_by_key(|k| k.0);
    }
}

/// Refuses, naming the field, a key too short to end in a group index.
fn check_keys(keys: &[&[u8]]) -> Result<()> {
    match keys.iter().position(|k| k.len() < 4) {
        Some(i) => group_of(keys[i], &format!("keys[{i}]")).map(|_| ()),
        None => Ok(()),
    }
}

fn printable(bytes: &[u8]) -> String {
    let hex: String = bytes.iter().take(16).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > 16 {
        format!("0x{hex}... ({} bytes)", bytes.len())
    } else {
        format!("0x{hex}")
    }
}

impl ChunkDirectory {
    /// An empty directory.
    pub fn new(cfg: DirectoryConfig) -> Self {
        let policy = match cfg.policy {
            PolicyKind::Lru => Policy::Lru(LruPolicy::default()),
            PolicyKind::Arc => Policy::Arc(ArcPolicy::new(cfg.num_chunks as usize)),
        };
        ChunkDirectory {
            keys: KeyTable::default(),
            requests: RequestTable::default(),
            policy,
            tracker: (cfg.store_threshold >= 2).then(|| ReuseTracker::new(cfg.max_tracker_size)),
            store_threshold: cfg.store_threshold,
            num_chunks: cfg.num_chunks,
            allocated: 0,
            free_list: Vec::new(),
            evictable: 0,
            write_pending: 0,
            events: cfg.events.then(Vec::new),
            stores_skipped: 0,
            allocation_sizes: Vec::new(),
            generation: 0,
            scratch: Vec::new(),
        }
    }

    /// Chunks in the pool.
    pub fn num_chunks(&self) -> u32 {
        self.num_chunks
    }

    /// Whether `key` is stored, and readable.
    pub fn lookup(&self, key: &[u8]) -> Lookup {
        match self.keys.find(key).and_then(|id| self.keys.get(id).chunk) {
            None => Lookup::Miss,
            Some(c) if c.is_ready() => Lookup::Hit,
            Some(_) => Lookup::HitPending,
        }
    }

    // ---- requests ----

    /// The record `have` names, started over if it belongs to an earlier cache generation,
    /// or a new one. The caller keeps the returned ref on the request's context.
    pub fn request(&mut self, have: Option<RequestRef>) -> RequestRef {
        if let Some(r) = have {
            if let Some(rec) = self.requests.get_mut(r) {
                if rec.cache_generation != self.generation {
                    rec.restart(&mut self.keys, self.generation);
                }
                return r;
            }
        }
        self.requests.create(self.generation)
    }

    /// The context of a request is gone: its record goes.
    pub fn release_request(&mut self, r: RequestRef) {
        self.requests.free(&mut self.keys, r);
    }

    /// Live request records.
    pub fn live_requests(&self) -> usize {
        self.requests.len()
    }

    /// Refuses access to keys a finished request never saw.
    fn check_not_finished(&mut self, have: Option<RequestRef>, keys: &[&[u8]]) -> Result<()> {
        let generation = self.generation;
        let Some(rec) = have.and_then(|r| self.requests.get_mut(r)) else {
            return Ok(());
        };
        if !rec.finished || rec.cache_generation != generation {
            return Ok(());
        }
        for (i, k) in keys.iter().enumerate() {
            let seen = self.keys.find(k).is_some_and(|id| rec.has_seen(id));
            if !seen {
                return Err(Error::InvalidTransition {
                    op: "access",
                    key: format!("keys[{i}] = {}", printable(k)),
                    state: "new to a request that already finished".into(),
                });
            }
        }
        Ok(())
    }

    /// Records that request `r` accessed `ids` (at `positions`): new keys are seen (and
    /// tell the LRU policy their positions), `reused` ones are marked reused unless the
    /// request inserted them.
    fn record_access(
        &mut self,
        r: RequestRef,
        ids: &[KeyId],
        positions: &[Option<i64>],
        reused: &[KeyId],
    ) {
        let rec = self.requests.get_mut(r).expect("a live request");
        let mut fresh = Vec::new();
        let mut fresh_pos = Vec::new();
        for (&id, &p) in ids.iter().zip(positions) {
            if rec.see(&mut self.keys, id, p) {
                fresh.push(id);
                fresh_pos.push(p);
            }
        }
        if !fresh.is_empty() {
            if let Policy::Lru(lru) = &mut self.policy {
                let rank = *rec.rank.get_or_insert_with(|| lru.take_rank());
                lru.on_request_access(&mut self.keys, &fresh, &fresh_pos, rank);
            }
        }
        for &id in reused {
            if rec.flags(id) & flags::INSERTED == 0 {
                rec.set(id, flags::REUSED);
            }
        }
    }

    // ---- loads ----

    /// Pins the chunks of `keys` (stored and ready) for reading; their chunk ids, in order.
    pub fn prepare_load(
        &mut self,
        have: Option<RequestRef>,
        keys: &[&[u8]],
        positions: &[Option<i64>],
    ) -> Result<(RequestRef, Vec<ChunkId>)> {
        check_keys(keys)?;
        let mut ids = Vec::with_capacity(keys.len());
        for (i, k) in keys.iter().enumerate() {
            let id = self.keys.find(k);
            match id.and_then(|id| self.keys.get(id).chunk) {
                Some(c) if c.is_ready() => ids.push(id.expect("found")),
                Some(_) => {
                    return Err(Error::InvalidTransition {
                        op: "load",
                        key: format!("keys[{i}] = {}", printable(k)),
                        state: "being stored (a lookup said HIT_PENDING)".into(),
                    })
                }
                None => {
                    return Err(Error::NotResident {
                        key: format!("keys[{i}] = {}", printable(k)),
                    })
                }
            }
        }
        self.check_not_finished(have, keys)?;
        let r = self.request(have);
        let mut chunks = Vec::with_capacity(ids.len());
        for &id in &ids {
            let c = self.keys.get_mut(id).chunk.as_mut().expect("checked");
            if c.refs == 0 {
                self.evictable -= 1;
                if let Policy::Lru(lru) = &mut self.policy {
                    lru.mark_non_evictable();
                }
            }
            c.refs += 1;
            chunks.push(c.id);
        }
        self.record_access(r, &ids, positions, &ids);
        Ok((r, chunks))
    }

    /// Unpins chunks `prepare_load` pinned, once per occurrence.
    pub fn complete_load(&mut self, keys: &[&[u8]]) -> Result<()> {
        check_keys(keys)?;
        let mut ids = Vec::with_capacity(keys.len());
        let mut pins: FxHashMap<KeyId, i32> = FxHashMap::default();
        for (i, k) in keys.iter().enumerate() {
            let id = self.keys.find(k);
            let refs = id
                .and_then(|id| self.keys.get(id).chunk)
                .map_or(0, |c| c.refs);
            let id = id
                .filter(|_| refs > 0)
                .ok_or_else(|| Error::InvalidTransition {
                    op: "complete_load",
                    key: format!("keys[{i}] = {}", printable(k)),
                    state: "not pinned by a load".into(),
                })?;
            let n = pins.entry(id).or_insert(0);
            *n += 1;
            if *n > refs {
                return Err(Error::InvalidTransition {
                    op: "complete_load",
                    key: format!("keys[{i}] = {}", printable(k)),
                    state: format!("pinned by {refs} loads, completed {n} times in this call"),
                });
            }
            ids.push(id);
        }
        for id in ids {
            let c = self.keys.get_mut(id).chunk.as_mut().expect("checked");
            c.refs -= 1;
            if c.refs == 0 {
                self.evictable += 1;
                if let Policy::Lru(lru) = &mut self.policy {
                    lru.mark_evictable(&mut self.keys, id);
                }
            }
        }
        Ok(())
    }

    /// vLLM's `touch`: marks `keys` recently used (unknown keys are skipped).
    pub fn touch(&mut self, keys: &[&[u8]]) {
        let ids: Vec<KeyId> = keys.iter().filter_map(|k| self.keys.find(k)).collect();
        match &mut self.policy {
            Policy::Lru(lru) => lru.touch(&mut self.keys, &ids),
            Policy::Arc(arc) => arc.touch(&mut self.keys, &ids),
        }
    }

    // ---- stores ----

    /// Chunks free to allocate without eviction.
    fn free_chunks(&self) -> u32 {
        self.free_list.len() as u32 + self.num_chunks - self.allocated
    }

    /// `n` chunks: fresh ones first, then freed ones, last freed first.
    fn allocate(&mut self, n: usize) -> Vec<ChunkId> {
        let fresh = (n as u32).min(self.num_chunks - self.allocated);
        let mut out: Vec<ChunkId> = (self.allocated..self.allocated + fresh)
            .map(ChunkId)
            .collect();
        self.allocated += fresh;
        for _ in fresh as usize..n {
            out.push(self.free_list.pop().expect("enough free chunks"));
        }
        out
    }

    /// Prepares storing the offered `keys` (module docs). `None`: nothing can be stored now
    /// (the pool is full of pinned or pending chunks); the offer still counts for the reuse
    /// tracker and the request's recency.
    pub fn prepare_store(
        &mut self,
        have: Option<RequestRef>,
        keys: &[&[u8]],
        positions: &[Option<i64>],
    ) -> Result<(RequestRef, Option<StoreOutcome>)> {
        check_keys(keys)?;
        {
            let mut distinct: FxHashSet<&[u8]> = FxHashSet::default();
            distinct.reserve(keys.len());
            for (i, k) in keys.iter().enumerate() {
                if !distinct.insert(k) {
                    return Err(Error::config(
                        format!("keys[{i}]"),
                        printable(k),
                        "keys offered once per prepare_store (this one repeats an earlier key)",
                    ));
                }
            }
        }
        self.check_not_finished(have, keys)?;
        // The record first: starting an old one over releases keys, which must not free
        // the ones this call interns.
        let r = self.request(have);
        let ids: Vec<KeyId> = keys.iter().map(|k| self.keys.intern(k)).collect();
        self.scratch.extend_from_slice(&ids);
        let out = self.store_offer(r, &ids, positions);
        self.release_scratch();
        Ok((r, out))
    }

    fn store_offer(
        &mut self,
        r: RequestRef,
        ids: &[KeyId],
        positions: &[Option<i64>],
    ) -> Option<StoreOutcome> {
        if let Some(t) = &mut self.tracker {
            t.record(&mut self.keys, ids, &mut self.scratch);
        }
        let mut to_store: Vec<usize> = Vec::new();
        let mut ready: Vec<KeyId> = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            match self.keys.get(id).chunk {
                None => to_store.push(i),
                Some(c) if c.is_ready() => ready.push(id),
                Some(_) => {}
            }
        }
        if self.tracker.is_some() {
            let before = to_store.len();
            let threshold = self.store_threshold;
            to_store.retain(|&i| ReuseTracker::count(&self.keys, ids[i]) >= threshold);
            self.stores_skipped += (before - to_store.len()) as u64;
        }
        let rec: &RequestRecord = self.requests.get_mut(r).expect("live");
        let misses: Vec<KeyId> = to_store
            .iter()
            .map(|&i| ids[i])
            .filter(|&id| rec.flags(id) & flags::STORE_MISS == 0)
            .collect();
        if !misses.is_empty() {
            if let Policy::Arc(arc) = &mut self.policy {
                arc.on_store_miss(&mut self.keys, &misses);
            }
        }
        {
            let mut recorded = vec![false; ids.len()];
            for &i in &to_store {
                recorded[i] = true;
            }
            for (i, &id) in ids.iter().enumerate() {
                if self.keys.get(id).chunk.is_some_and(|c| c.is_ready()) {
                    recorded[i] = true;
                }
            }
            let (rids, rpos): (Vec<KeyId>, Vec<Option<i64>>) = ids
                .iter()
                .zip(positions)
                .zip(&recorded)
                .filter(|(_, &keep)| keep)
                .map(|((&id, &p), _)| (id, p))
                .unzip();
            self.record_access(r, &rids, &rpos, &ready);
        }
        let rec = self.requests.get_mut(r).expect("live");
        for &id in &misses {
            rec.set(id, flags::STORE_MISS);
        }
        if to_store.is_empty() {
            return Some(StoreOutcome::default());
        }
        self.allocation_sizes.push(to_store.len() as u32);
        let need = to_store.len() as i64 - i64::from(self.free_chunks());
        let mut evicted = Vec::new();
        if need > 0 {
            let need = need as usize;
            if need > self.evictable as usize {
                return None;
            }
            let offered: FxHashSet<KeyId> = ids.iter().copied().collect();
            let protected = |id: KeyId| offered.contains(&id);
            let picked = match &mut self.policy {
                Policy::Lru(lru) => lru.evict(&self.keys, need, protected),
                Policy::Arc(arc) => arc.evict(&mut self.keys, need, protected, &mut self.scratch),
            };
            let picked = picked?;
            self.evictable -= picked.len() as u32;
            for id in picked {
                let e = self.keys.get_mut(id);
                let c = e.chunk.take().expect("evicted keys are resident");
                self.free_list.push(c.id);
                evicted.push(e.bytes.clone());
                self.scratch.push(id);
            }
        }
        if !evicted.is_empty() {
            if let Some(ev) = &mut self.events {
                ev.push(Event {
                    keys: evicted.clone(),
                    removed: true,
                    metadata_only: false,
                });
            }
        }
        let chunks = self.allocate(to_store.len());
        let rank_of = &mut self.requests.get_mut(r).expect("live").rank;
        for (&i, &chunk) in to_store.iter().zip(&chunks) {
            let id = ids[i];
            self.keys.get_mut(id).chunk = Some(Chunk {
                id: chunk,
                refs: Chunk::STORING,
            });
            match &mut self.policy {
                Policy::Lru(lru) => lru.insert(&mut self.keys, id, positions[i], |lru| {
                    *rank_of.get_or_insert_with(|| lru.take_rank())
                }),
                Policy::Arc(arc) => arc.insert(&mut self.keys, id),
            }
        }
        self.write_pending += to_store.len() as u32;
        let rec = self.requests.get_mut(r).expect("live");
        for &i in &to_store {
            rec.set(ids[i], flags::INSERTED);
        }
        Some(StoreOutcome {
            stored: to_store,
            chunks,
            evicted,
        })
    }

    /// Completes the stores of `keys` still in flight: readable on success, freed on failure.
    /// Keys not in flight are skipped.
    pub fn complete_store(&mut self, keys: &[&[u8]], success: bool) {
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for k in keys {
            let Some(id) = self.keys.find(k) else {
                continue;
            };
            let Some(c) = self.keys.get(id).chunk.filter(|c| !c.is_ready()) else {
                continue;
            };
            self.write_pending -= 1;
            if success {
                self.keys.get_mut(id).chunk = Some(Chunk { id: c.id, refs: 0 });
                self.evictable += 1;
                if let Policy::Lru(lru) = &mut self.policy {
                    lru.mark_evictable(&mut self.keys, id);
                }
                stored.push(self.keys.get(id).bytes.clone());
            } else {
                if let Policy::Arc(arc) = &mut self.policy {
                    arc.remove(&mut self.keys, id);
                }
                let e = self.keys.get_mut(id);
                e.chunk = None;
                removed.push(e.bytes.clone());
                self.free_list.push(c.id);
                self.keys.release(id);
            }
        }
        if let Some(ev) = &mut self.events {
            if !removed.is_empty() {
                ev.push(Event {
                    keys: removed,
                    removed: true,
                    metadata_only: true,
                });
            }
            if !stored.is_empty() {
                ev.push(Event {
                    keys: stored,
                    removed: false,
                    metadata_only: false,
                });
            }
        }
    }

    fn release_scratch(&mut self) {
        for id in std::mem::take(&mut self.scratch) {
            self.keys.release(id);
        }
    }

    // ---- request end, reset ----

    /// The keys request `have` saw whose position its context had not given when they were
    /// first seen (to ask again before it finishes); usually none.
    pub fn unpositioned_keys(&mut self, have: RequestRef) -> Vec<KeyBytes> {
        let generation = self.generation;
        match self.requests.get_mut(have) {
            Some(rec) if rec.cache_generation == generation && !rec.finished => rec
                .order
                .iter()
                .filter(|s| s.position.is_none())
                .map(|s| self.keys.get(s.id).bytes.clone())
                .collect(),
            _ => Vec::new(),
        }
    }

    /// A request ended: its keys, head to tail by token position, take their request-scoped
    /// recency. A key's position is the one its context gave when the request first saw it,
    /// or else the one in `late` (what [`Self::unpositioned_keys`] asked). A stale or
    /// finished record is left alone.
    pub fn finish_request(&mut self, have: RequestRef, late: &[(&[u8], i64)]) {
        let generation = self.generation;
        let Some(rec) = self.requests.get_mut(have) else {
            return;
        };
        if rec.cache_generation != generation || rec.finished {
            return;
        }
        rec.finished = true;
        for &(k, p) in late {
            if let Some(&i) = self.keys.find(k).and_then(|id| rec.seen.get(&id)) {
                let s = &mut rec.order[i as usize];
                s.position = s.position.or(Some(p));
            }
        }
        // Per group (ascending), first-seen order, by position if every key has one; then
        // all of them by position if every key has one (vLLM's order_request_keys).
        let mut groups: Vec<u32> = rec
            .order
            .iter()
            .map(|s| self.keys.get(s.id).group)
            .collect();
        let mut distinct = groups.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let mut ordered: Vec<(Option<i64>, KeyId)> = Vec::with_capacity(rec.order.len());
        for g in &distinct {
            let from = ordered.len();
            ordered.extend(
                rec.order
                    .iter()
                    .zip(&groups)
                    .filter(|(_, gg)| *gg == g)
                    .map(|(s, _)| (s.position, s.id)),
            );
            sort_by_position(&mut ordered[from..]);
        }
        sort_by_position(&mut ordered);
        groups.clear();
        let ordered: Vec<KeyId> = ordered.into_iter().map(|(_, id)| id).collect();
        match &mut self.policy {
            Policy::Lru(lru) => lru.on_request_finished(&mut self.keys, &ordered),
            Policy::Arc(arc) => {
                let f = |id: KeyId| rec.flags(id);
                arc.on_request_finished(
                    &mut self.keys,
                    &ordered,
                    |id| f(id) & flags::INSERTED != 0 && f(id) & flags::REUSED == 0,
                    |id| f(id) & flags::REUSED != 0,
                );
            }
        }
    }

    /// Forgets every chunk and the policy's history; request records made before read as new.
    /// The reuse tracker and queued events stay, as vLLM's do.
    pub fn reset(&mut self) {
        let mut dropped = match &mut self.policy {
            Policy::Lru(lru) => {
                lru.clear();
                Vec::new()
            }
            Policy::Arc(arc) => arc.clear(&mut self.keys),
        };
        let resident: Vec<KeyId> = self
            .keys
            .iter()
            .filter(|(_, e)| e.chunk.is_some())
            .map(|(id, _)| id)
            .collect();
        for id in resident {
            self.keys.get_mut(id).chunk = None;
            dropped.push(id);
        }
        for id in dropped {
            self.keys.release(id);
        }
        self.generation += 1;
        self.evictable = 0;
        self.write_pending = 0;
        self.free_list.clear();
        self.allocated = 0;
    }

    // ---- events, stats ----

    /// The queued events (None when events are off), oldest first; the queue is emptied.
    pub fn take_events(&mut self) -> Option<Vec<Event>> {
        self.events.as_mut().map(std::mem::take)
    }

    /// Whether each key is absent (not stored): a failed store's cleanup is reported only
    /// for keys no retry stored since.
    pub fn absent(&self, keys: &[&[u8]]) -> Vec<bool> {
        keys.iter()
            .map(|k| self.lookup(k) == Lookup::Miss)
            .collect()
    }

    /// Usage now.
    pub fn usage(&self) -> Usage {
        if self.num_chunks == 0 {
            return Usage::default();
        }
        let n = f64::from(self.num_chunks);
        let used = self.allocated - self.free_list.len() as u32 - self.evictable;
        let used = f64::from(used) / n;
        let write = f64::from(self.write_pending) / n;
        Usage {
            used,
            write,
            read: (used - write).max(0.0),
        }
    }

    /// Usage, and the counters since the last call (which restart).
    pub fn take_stats(&mut self) -> Stats {
        Stats {
            usage: self.usage(),
            allocation_sizes: std::mem::take(&mut self.allocation_sizes),
            stores_skipped: (self.store_threshold >= 2)
                .then(|| std::mem::take(&mut self.stores_skipped)),
        }
    }

    /// Store candidates skipped by the threshold since the last `take_stats`.
    pub fn stores_skipped(&self) -> u64 {
        self.stores_skipped
    }

    /// The reuse tracker's count for `key`, if it is tracked (None without a threshold).
    pub fn tracked_count(&self, key: &[u8]) -> Option<u32> {
        self.tracker.as_ref()?;
        self.keys.find(key).and_then(|id| self.keys.get(id).tracked)
    }

    /// The tracked keys, least recently offered first (None without a threshold).
    pub fn tracked_keys(&self) -> Option<Vec<KeyBytes>> {
        let t = self.tracker.as_ref()?;
        Some(
            t.keys(&self.keys)
                .into_iter()
                .map(|id| self.keys.get(id).bytes.clone())
                .collect(),
        )
    }

    /// Stored keys, and those whose store is in flight.
    pub fn resident(&self) -> (usize, usize) {
        let mut n = (0, 0);
        for (_, e) in self.keys.iter() {
            match e.chunk {
                Some(c) if c.is_ready() => n.0 += 1,
                Some(_) => n.1 += 1,
                None => {}
            }
        }
        n
    }

    /// Chunks pinned by loads (sum of readers).
    pub fn pinned(&self) -> u64 {
        self.keys
            .iter()
            .filter_map(|(_, e)| e.chunk)
            .map(|c| c.refs.max(0) as u64)
            .sum()
    }

    /// ARC's T1 target (None under LRU).
    pub fn arc_target(&self) -> Option<f64> {
        match &self.policy {
            Policy::Arc(a) => Some(a.target_t1()),
            Policy::Lru(_) => None,
        }
    }

    /// Checks every invariant of the module docs.
    pub fn validate(&self) -> Result<()> {
        self.check().map_err(|msg| Error::Internal {
            site: "ChunkDirectory::validate".into(),
            message: msg,
        })
    }

    fn check(&self) -> std::result::Result<(), String> {
        self.keys.validate()?;
        if self.allocated > self.num_chunks {
            return Err(format!(
                "{} chunks allocated of {}",
                self.allocated, self.num_chunks
            ));
        }
        let mut owner = vec![0u8; self.allocated as usize];
        for c in &self.free_list {
            let slot = owner
                .get_mut(c.0 as usize)
                .ok_or(format!("free chunk {} was never allocated", c.0))?;
            *slot += 1;
        }
        let (mut evictable, mut pending) = (0u32, 0u32);
        for (_, e) in self.keys.iter() {
            let Some(c) = e.chunk else { continue };
            let slot = owner
                .get_mut(c.id.0 as usize)
                .ok_or(format!("resident chunk {} was never allocated", c.id.0))?;
            *slot += 1;
            match c.refs {
                0 => evictable += 1,
                Chunk::STORING => pending += 1,
                r if r > 0 => {}
                r => return Err(format!("chunk {} has refs {r}", c.id.0)),
            }
        }
        if let Some(i) = owner.iter().position(|&n| n != 1) {
            return Err(format!(
                "chunk {i} is held {} times (free list and resident keys)",
                owner[i]
            ));
        }
        if (evictable, pending) != (self.evictable, self.write_pending) {
            return Err(format!(
                "counts evictable {} pending {}, found {evictable} and {pending}",
                self.evictable, self.write_pending
            ));
        }
        match &self.policy {
            Policy::Lru(l) => l.validate(&self.keys)?,
            Policy::Arc(a) => a.validate(&self.keys)?,
        }
        if let Some(t) = &self.tracker {
            t.validate(&self.keys)?;
        } else if self.keys.iter().any(|(_, e)| e.tracked.is_some()) {
            return Err("a key is tracked without a tracker".into());
        }
        let mut holders: FxHashMap<KeyId, u32> = FxHashMap::default();
        for rec in self.requests.iter() {
            if rec.order.len() != rec.seen.len() {
                return Err("a request record's order and seen set differ".into());
            }
            for (i, s) in rec.order.iter().enumerate() {
                if rec.seen.get(&s.id) != Some(&(i as u32)) {
                    return Err("a request record's order and seen set differ".into());
                }
                *holders.entry(s.id).or_insert(0) += 1;
            }
        }
        for (id, e) in self.keys.iter() {
            if e.holders != holders.get(&id).copied().unwrap_or(0) {
                return Err(format!(
                    "key {id:?} counts {} request holders, {} records hold it",
                    e.holders,
                    holders.get(&id).copied().unwrap_or(0)
                ));
            }
        }
        Ok(())
    }
}
