//! The ARC policy (adaptive replacement), as vLLM's `ARCCachePolicy` runs it.
//!
//! T1 holds resident keys seen once, T2 resident keys reused; B1 and B2 are ghosts of keys
//! evicted from T1 and T2, at most `capacity` each. A store-miss or touch of a ghost moves
//! the target size of T1 (towards recency for a B1 hit, towards frequency for a B2 hit).
//! Eviction takes from T1 while T1 is at least its target, else from T2, falling back to the
//! other list; it skips keys that are pinned or protected, and is all or nothing.
//!
//! Every list is intrusive over the key arena (`KeyEntry::arc`), so each step is O(1).

use super::keys::{ArcLink, ArcList, KeyId, KeyList, KeyTable};

/// The ARC policy's state (module docs).
#[derive(Debug, Default)]
pub struct ArcPolicy {
    capacity: usize,
    target_t1: f64,
    t1: KeyList,
    t2: KeyList,
    b1: KeyList,
    b2: KeyList,
}

impl ArcPolicy {
    /// A policy for a pool of `capacity` chunks (the ghost lists' bound).
    pub fn new(capacity: usize) -> Self {
        ArcPolicy {
            capacity,
            ..Default::default()
        }
    }

    fn list(&mut self, which: ArcList) -> &mut KeyList {
        match which {
            ArcList::T1 => &mut self.t1,
            ArcList::T2 => &mut self.t2,
            ArcList::B1 => &mut self.b1,
            ArcList::B2 => &mut self.b2,
        }
    }

    fn take_out(&mut self, keys: &mut KeyTable, id: KeyId) {
        if let Some(which) = keys.get(id).arc {
            self.list(which).unlink::<ArcLink>(keys, id);
            keys.get_mut(id).arc = None;
        }
    }

    fn put(&mut self, keys: &mut KeyTable, id: KeyId, which: ArcList) {
        self.list(which).push_back::<ArcLink>(keys, id);
        keys.get_mut(id).arc = Some(which);
    }

    fn move_to_back(&mut self, keys: &mut KeyTable, id: KeyId, which: ArcList) {
        self.list(which).move_to_back::<ArcLink>(keys, id);
    }

    /// A key just stored (its chunk set) enters T1, leaving a ghost list if it was in one.
    pub fn insert(&mut self, keys: &mut KeyTable, id: KeyId) {
        self.take_out(keys, id);
        self.put(keys, id, ArcList::T1);
    }

    /// A failed store's key leaves T1 or T2 (the caller frees its chunk and entry).
    pub fn remove(&mut self, keys: &mut KeyTable, id: KeyId) {
        if matches!(keys.get(id).arc, Some(ArcList::T1 | ArcList::T2)) {
            self.take_out(keys, id);
        }
    }

    /// A hit on a ghost: moves T1's target and refreshes the ghost. Whether it was one.
    fn adapt_to_ghost_hit(&mut self, keys: &mut KeyTable, id: KeyId) -> bool {
        let (b1, b2) = (self.b1.len() as f64, self.b2.len() as f64);
        match keys.get(id).arc {
            Some(ArcList::B1) => {
                let delta = (b2 / b1).max(1.0);
                self.target_t1 = (self.target_t1 + delta).min(self.capacity as f64);
                self.move_to_back(keys, id, ArcList::B1);
                true
            }
            Some(ArcList::B2) => {
                let delta = (b1 / b2).max(1.0);
                self.target_t1 = (self.target_t1 - delta).max(0.0);
                self.move_to_back(keys, id, ArcList::B2);
                true
            }
            _ => false,
        }
    }

    /// Keys a store found missing (before their insert): ghost hits adapt, last key first.
    pub fn on_store_miss(&mut self, keys: &mut KeyTable, ids: &[KeyId]) {
        for &id in ids.iter().rev() {
            self.adapt_to_ghost_hit(keys, id);
        }
    }

    /// vLLM's `touch`, last key first: T1 keys move to T2 (or to T1's end while their store
    /// is in flight), T2 keys to T2's end, ghosts adapt.
    pub fn touch(&mut self, keys: &mut KeyTable, ids: &[KeyId]) {
        for &id in ids.iter().rev() {
            match keys.get(id).arc {
                Some(ArcList::T1) => {
                    let ready = keys.get(id).chunk.is_some_and(|c| c.is_ready());
                    self.take_out(keys, id);
                    self.put(keys, id, if ready { ArcList::T2 } else { ArcList::T1 });
                }
                Some(ArcList::T2) => self.move_to_back(keys, id, ArcList::T2),
                _ => {
                    self.adapt_to_ghost_hit(keys, id);
                }
            }
        }
    }

    /// A request's end, its keys head to tail, applied tail first: a key it only inserted
    /// moves to its list's end; a ready key it reused counts one access (T1 to T2, or T2's
    /// end).
    pub fn on_request_finished(
        &mut self,
        keys: &mut KeyTable,
        ordered: &[KeyId],
        insertion_only: impl Fn(KeyId) -> bool,
        reused: impl Fn(KeyId) -> bool,
    ) {
        for &id in ordered.iter().rev() {
            let at = keys.get(id).arc;
            if insertion_only(id) {
                if let Some(which @ (ArcList::T1 | ArcList::T2)) = at {
                    self.move_to_back(keys, id, which);
                }
                continue;
            }
            if reused(id) {
                match at {
                    Some(ArcList::T1) => {
                        self.take_out(keys, id);
                        self.put(keys, id, ArcList::T2);
                    }
                    Some(ArcList::T2) => self.move_to_back(keys, id, ArcList::T2),
                    _ => {}
                }
            }
        }
    }

    /// The next key from `at` on (in `list`) that is evictable and not protected.
    fn scan(
        list: &KeyList,
        keys: &KeyTable,
        at: &mut Option<KeyId>,
        protected: &impl Fn(KeyId) -> bool,
    ) -> Option<KeyId> {
        while let Some(id) = *at {
            *at = list.next::<ArcLink>(keys, id);
            if keys.get(id).chunk.is_some_and(|c| c.refs == 0) && !protected(id) {
                return Some(id);
            }
        }
        None
    }

    /// Evicts exactly `n` keys or none (`None`). Each evicted key leaves a ghost in B1 or B2;
    /// ghosts past `capacity` are forgotten and returned in `forgotten` for the caller to
    /// release. The caller removes the evicted keys' chunks.
    pub fn evict(
        &mut self,
        keys: &mut KeyTable,
        n: usize,
        protected: impl Fn(KeyId) -> bool,
        forgotten: &mut Vec<KeyId>,
    ) -> Option<Vec<KeyId>> {
        if n == 0 {
            return Some(Vec::new());
        }
        let mut picked: Vec<(KeyId, ArcList)> = Vec::with_capacity(n);
        let mut virtual_t1 = self.t1.len() as i64;
        let target = self.target_t1.trunc() as i64;
        let (mut c1, mut c2) = (self.t1.front(), self.t2.front());
        for _ in 0..n {
            let mut pick = None;
            if virtual_t1 >= target {
                if let Some(id) = Self::scan(&self.t1, keys, &mut c1, &protected) {
                    pick = Some((id, ArcList::T1));
                    virtual_t1 -= 1;
                }
            }
            if pick.is_none() {
                pick = Self::scan(&self.t2, keys, &mut c2, &protected).map(|id| (id, ArcList::T2));
            }
            if pick.is_none() {
                let id = Self::scan(&self.t1, keys, &mut c1, &protected)?;
                pick = Some((id, ArcList::T1));
                virtual_t1 -= 1;
            }
            picked.extend(pick);
        }
        for &(id, from) in &picked {
            self.take_out(keys, id);
            let ghost = if from == ArcList::T1 {
                ArcList::B1
            } else {
                ArcList::B2
            };
            self.put(keys, id, ghost);
        }
        for ghost in [ArcList::B1, ArcList::B2] {
            while self.list(ghost).len() > self.capacity {
                let id = self
                    .list(ghost)
                    .front()
                    .expect("a list longer than capacity");
                self.take_out(keys, id);
                forgotten.push(id);
            }
        }
        Some(picked.into_iter().map(|(id, _)| id).collect())
    }

    /// Forgets every key; returns them for the caller to release.
    pub fn clear(&mut self, keys: &mut KeyTable) -> Vec<KeyId> {
        let mut all = Vec::new();
        for which in [ArcList::T1, ArcList::T2, ArcList::B1, ArcList::B2] {
            for id in self.list(which).collect::<ArcLink>(keys) {
                let e = keys.get_mut(id);
                e.arc = None;
                e.arc_link = Default::default();
                all.push(id);
            }
            self.list(which).forget();
        }
        self.target_t1 = 0.0;
        all
    }

    /// T1's target size.
    pub fn target_t1(&self) -> f64 {
        self.target_t1
    }

    /// Checks the lists: T1 and T2 hold exactly the resident keys, ghosts are not resident,
    /// each key's tag names the list it is in, ghost lists within capacity.
    pub fn validate(&self, keys: &KeyTable) -> Result<(), String> {
        let mut in_lists = 0;
        for (which, list) in [
            (ArcList::T1, &self.t1),
            (ArcList::T2, &self.t2),
            (ArcList::B1, &self.b1),
            (ArcList::B2, &self.b2),
        ] {
            let ids = list.collect::<ArcLink>(keys);
            if ids.len() != list.len() {
                return Err(format!(
                    "ARC {which:?} links {} keys, counts {}",
                    ids.len(),
                    list.len()
                ));
            }
            for id in ids {
                let e = keys.get(id);
                if e.arc != Some(which) {
                    return Err(format!(
                        "key {id:?} is linked in {which:?} but tagged {:?}",
                        e.arc
                    ));
                }
                let resident = e.chunk.is_some();
                if resident != matches!(which, ArcList::T1 | ArcList::T2) {
                    return Err(format!("key {id:?} in {which:?} has resident = {resident}"));
                }
            }
            in_lists += list.len();
        }
        let tagged = keys.iter().filter(|(_, e)| e.arc.is_some()).count();
        if tagged != in_lists {
            return Err(format!(
                "{tagged} keys tagged in ARC lists, {in_lists} linked"
            ));
        }
        if self.b1.len() > self.capacity || self.b2.len() > self.capacity {
            return Err("an ARC ghost list exceeds the capacity".into());
        }
        if !(0.0..=self.capacity as f64).contains(&self.target_t1) {
            return Err(format!(
                "ARC target {} outside [0, capacity]",
                self.target_t1
            ));
        }
        Ok(())
    }
}
