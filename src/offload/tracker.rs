//! The reuse tracker behind `store_threshold`: how many times each recent key was offered for
//! storing, in least-recently-offered order, bounded by `max_size` (vLLM's `counts`).
//!
//! An offer counts every key once per occurrence; keys already tracked move to the newest
//! end. New keys enter at count 1, pushing out the oldest keys not offered in this call; when
//! only this call's keys are left, further new keys are not tracked (so an offer larger than
//! the tracker still makes progress on the next one).

use super::keys::{KeyId, KeyList, KeyTable, TrackerLink};

/// The tracker (module docs).
#[derive(Debug)]
pub struct ReuseTracker {
    list: KeyList,
    max_size: usize,
    /// Stamps each offer, so a key repeated in one call is protected once.
    call: u64,
}

impl ReuseTracker {
    /// A tracker of at most `max_size` keys.
    pub fn new(max_size: usize) -> Self {
        ReuseTracker {
            list: KeyList::default(),
            max_size,
            call: 0,
        }
    }

    /// Records one offer of `ids`. Keys it stops tracking are pushed on `forgotten` for the
    /// caller to release.
    pub fn record(&mut self, keys: &mut KeyTable, ids: &[KeyId], forgotten: &mut Vec<KeyId>) {
        self.call += 1;
        let mut protected = 0;
        for &id in ids {
            let e = keys.get_mut(id);
            let Some(count) = e.tracked else { continue };
            e.tracked = Some(count + 1);
            if e.tracker_stamp != self.call {
                e.tracker_stamp = self.call;
                protected += 1;
            }
            self.list.move_to_back::<TrackerLink>(keys, id);
        }
        let mut unprotected = self.list.len() - protected;
        for &id in ids {
            if keys.get(id).tracked.is_some() {
                continue;
            }
            if self.list.len() >= self.max_size {
                if unprotected == 0 {
                    continue;
                }
                let oldest = self.list.front().expect("a non-empty tracker");
                self.list.unlink::<TrackerLink>(keys, oldest);
                keys.get_mut(oldest).tracked = None;
                forgotten.push(oldest);
                unprotected -= 1;
            }
            self.list.push_back::<TrackerLink>(keys, id);
            keys.get_mut(id).tracked = Some(1);
        }
    }

    /// How many times `id` was offered while tracked (0 if not tracked).
    pub fn count(keys: &KeyTable, id: KeyId) -> u32 {
        keys.get(id).tracked.unwrap_or(0)
    }

    /// Tracked keys.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.list.len() == 0
    }

    /// Tracked keys, least recently offered first.
    pub fn keys(&self, keys: &KeyTable) -> Vec<KeyId> {
        self.list.collect::<TrackerLink>(keys)
    }

    /// Checks the list against the entries' counts and the bound.
    pub fn validate(&self, keys: &KeyTable) -> Result<(), String> {
        let ids = self.keys(keys);
        if ids.len() != self.list.len() || ids.len() > self.max_size {
            return Err(format!(
                "tracker links {} keys, counts {}, bound {}",
                ids.len(),
                self.list.len(),
                self.max_size
            ));
        }
        if ids.iter().any(|&id| keys.get(id).tracked.unwrap_or(0) == 0) {
            return Err("a tracked key has no count".into());
        }
        let tagged = keys.iter().filter(|(_, e)| e.tracked.is_some()).count();
        if tagged != ids.len() {
            return Err(format!(
                "{tagged} keys carry a count, {} are tracked",
                ids.len()
            ));
        }
        Ok(())
    }
}
