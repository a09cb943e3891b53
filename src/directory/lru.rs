//! The LRU list of evictable objects: O(1) push, remove and pop, with lazy removal.
//!
//! Membership is exact: an object is a member if and only if it is evictable now (device
//! Ready, unpinned, host copy Ready, not dropped). The owner keeps that promise at every state
//! change. Order is the order objects became evictable; the front is the least recently used.
//!
//! Each member carries a *mark* in its own object: the sequence number of its live entry
//! (0 = not a member). Removing an object clears its mark: one write to an object the caller
//! is touching anyway, instead of relinking neighbours of a doubly linked list, which are cache
//! misses in a directory of millions of objects. The queue keeps the stale entry until a pop
//! meets it or a compaction drops it; compaction scans the queue in order and decides each
//! entry without a branch, so the object reads overlap. Sequence numbers never repeat, so an
//! entry of a removed object can never match the object that later reuses its index.
//!
//! The queue is a ring: a pop frees its entry's room at once. (A vector with a head index left
//! a dead prefix that had to be moved out: a million entries, about 3 ms, every ~90 decode
//! steps at DeepSeek-V3.2's shape, all inside one step.)

use std::collections::VecDeque;

/// FIFO of (index, sequence) entries; an entry is live while its object's mark equals its
/// sequence.
#[derive(Debug, Default, Clone)]
pub struct Lru {
    queue: VecDeque<(u32, u64)>,
    seq: u64,
    len: usize,
}

impl Lru {
    /// An empty list.
    pub fn new() -> Self {
        Lru::default()
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends object `idx`, whose mark is `mark`, as the most recently used member. No-op if
    /// it is a member already.
    #[inline]
    pub fn push_back(&mut self, idx: usize, mark: &mut u64) {
        if *mark != 0 {
            return;
        }
        self.seq += 1;
        *mark = self.seq;
        self.queue.push_back((idx as u32, self.seq));
        self.len += 1;
    }

    /// Removes the member whose mark is `mark`; returns whether it was one.
    #[inline]
    pub fn remove(&mut self, mark: &mut u64) -> bool {
        if *mark == 0 {
            return false;
        }
        *mark = 0;
        self.len -= 1;
        true
    }

    /// Removes and returns the least recently used member. `take(i, seq)` says whether
    /// object `i`'s mark is `seq` (the entry is live) and, if so, clears it.
    pub fn pop_front(&mut self, mut take: impl FnMut(usize, u64) -> bool) -> Option<usize> {
        self.pop_front_ahead(usize::MAX, |i, s, _| take(i, s))
    }

    /// [`Self::pop_front`] whose `take(i, seq, ahead)` also gets the object of the entry
    /// `distance` places behind each entry it reads, live or stale, to prefetch: every entry a
    /// run of pops reads is then announced once, `distance` reads before. (One prefetch per
    /// pop skipped the stale entries' objects, each a cache miss as costly as a live one's.)
    pub fn pop_front_ahead(
        &mut self,
        distance: usize,
        mut take: impl FnMut(usize, u64, Option<usize>) -> bool,
    ) -> Option<usize> {
        while let Some((i, s)) = self.queue.pop_front() {
            let ahead = self
                .queue
                .get(distance.wrapping_sub(1))
                .map(|&(a, _)| a as usize);
            if take(i as usize, s, ahead) {
                self.len -= 1;
                return Some(i as usize);
            }
        }
        None
    }

    /// Drops stale entries once they outnumber the members (amortized O(1) per push).
    pub fn compact_if_needed(&mut self, mark_of: impl Fn(usize) -> u64) {
        if self.queue.len() <= 2 * self.len + 4096 {
            return;
        }
        let q = self.queue.make_contiguous();
        let mut w = 0;
        for r in 0..q.len() {
            let e = q[r];
            q[w] = e;
            // Branch-free: every entry's object read is independent, so they overlap.
            w += usize::from(mark_of(e.0 as usize) == e.1);
        }
        self.queue.truncate(w);
    }

    /// Members from least to most recently used.
    pub fn iter<'a>(
        &'a self,
        mark_of: impl Fn(usize) -> u64 + 'a,
    ) -> impl Iterator<Item = usize> + 'a {
        self.queue
            .iter()
            .filter(move |&&(i, s)| mark_of(i as usize) == s)
            .map(|&(i, _)| i as usize)
    }

    /// Checks that the live entries are exactly `len`, each object at most once.
    pub fn validate(&self, mark_of: impl Fn(usize) -> u64) -> Result<(), String> {
        let live: Vec<usize> = self.iter(&mark_of).collect();
        if live.len() != self.len {
            return Err(format!(
                "queue holds {} live entries, len is {}",
                live.len(),
                self.len
            ));
        }
        let mut seen = rustc_hash::FxHashSet::default();
        for i in live {
            if !seen.insert(i) {
                return Err(format!("member {i} has two live entries"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_pop_keep_order_and_compaction_keeps_members() {
        let mut marks = vec![0u64; 8];
        let mut l = Lru::new();
        for i in [3, 1, 4, 0, 5] {
            let m = &mut marks[i];
            l.push_back(i, m);
        }
        l.push_back(1, &mut marks[1]); // already a member: no-op
        assert!(l.remove(&mut marks[4]));
        assert!(!l.remove(&mut marks[4]));
        let order = |l: &Lru, marks: &[u64]| l.iter(|i| marks[i]).collect::<Vec<_>>();
        assert_eq!(order(&l, &marks), vec![3, 1, 0, 5]);
        fn take(marks: &mut [u64]) -> impl FnMut(usize, u64) -> bool + '_ {
            move |i, s| {
                let live = marks[i] == s;
                if live {
                    marks[i] = 0;
                }
                live
            }
        }
        assert_eq!(l.pop_front(take(&mut marks)), Some(3));
        l.push_back(3, &mut marks[3]);
        assert_eq!(order(&l, &marks), vec![1, 0, 5, 3]);
        // Removing and re-adding leaves stale entries behind; order and members survive.
        for _ in 0..5000 {
            l.remove(&mut marks[0]);
            l.push_back(0, &mut marks[0]);
            l.compact_if_needed(|i| marks[i]);
        }
        assert_eq!(order(&l, &marks), vec![1, 5, 3, 0]);
        l.validate(|i| marks[i]).unwrap();
        while l.pop_front(take(&mut marks)).is_some() {}
        assert!(l.is_empty());
        l.validate(|i| marks[i]).unwrap();
    }

    #[test]
    fn pop_and_push_churn_keeps_the_queue_bounded() {
        // Evict the least recently used, bring it back: the pops consume every entry they
        // pass, so no stale entry piles up, and the ring must not grow either.
        let mut marks = vec![0u64; 100];
        let mut l = Lru::new();
        for (i, m) in marks.iter_mut().enumerate() {
            l.push_back(i, m);
        }
        for _ in 0..200_000 {
            let i = l
                .pop_front(|i, s| {
                    let live = marks[i] == s;
                    if live {
                        marks[i] = 0;
                    }
                    live
                })
                .unwrap();
            l.push_back(i, &mut marks[i]);
            l.compact_if_needed(|i| marks[i]);
        }
        assert!(
            l.queue.len() <= 2 * (l.len() + 4096) + 2,
            "{}",
            l.queue.len()
        );
        assert!(
            l.queue.capacity() <= 4 * (l.len() + 4096) + 8,
            "the ring kept growing"
        );
        assert_eq!(l.len(), 100);
        l.validate(|i| marks[i]).unwrap();
    }
}
