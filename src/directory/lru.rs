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
//! a dead prefix that had to be moved out, about a million entries every ~90 decode steps at
//! DeepSeek-V3.2's shape, all inside one step: benches/RESULTS.md, "Decode step: changes,
//! measured".)
//!
//! Compaction is incremental, a *sweep*: once stale entries outnumber the members, each push
//! moves the sweep on by [`SWEEP_STEP`] entries, keeping the live ones in place, in order.
//! Compacting the whole queue at once read every entry's object in one call: millions of
//! cache misses inside one decode step, in a workload that re-pins evictable pages often and
//! evicts rarely (a device budget that holds most of the KV; benches/RESULTS.md, "LRU
//! compaction under a large device budget"). While
//! a sweep runs the queue is three runs: `[..write)` swept, `[write..read)` a hole (entries
//! already moved or dropped), `[read..)` not yet swept; pops and iteration skip the hole, and a
//! sweep ends when `read` reaches the back (pushes meanwhile go on the back, and are swept
//! too). The sweep moves faster than pushes add entries, so it ends.

use std::collections::VecDeque;

/// Entries a sweep moves on per push, on average (each one reads its object: a cache miss at
/// scale).
pub const SWEEP_STEP: usize = 8;

/// Entries a sweep moves on at once: owed pushes are paid in runs this long, whose object
/// reads are all asked for first, so that they overlap (one push's eight, amid other misses,
/// cost more per entry than a long run).
pub const SWEEP_RUN: usize = 512;

/// FIFO of (index, sequence) entries; an entry is live while its object's mark equals its
/// sequence.
#[derive(Debug, Clone)]
pub struct Lru {
    queue: VecDeque<(u32, u64)>,
    seq: u64,
    len: usize,
    /// The sweep in progress, if any (module docs).
    sweep: Option<Sweep>,
    /// Stale entries allowed beyond the members before a sweep starts (tests make it
    /// negative, so that sweeps start at the first stale entries).
    slack: isize,
    /// Entries a push owes a sweep ([`SWEEP_STEP`]), and owed entries it waits for before it
    /// runs ([`SWEEP_RUN`]); tests make them small.
    step: usize,
    run: usize,
    /// Entries the sweep owes the pushes since its last run.
    owed: usize,
}

/// A sweep's cursors: `[..write)` swept, `[write..read)` the hole, `[read..)` to sweep.
#[derive(Debug, Clone, Copy)]
struct Sweep {
    write: usize,
    read: usize,
}

impl Lru {
    /// An empty list.
    pub fn new() -> Self {
        Lru {
            queue: VecDeque::new(),
            seq: 0,
            len: 0,
            sweep: None,
            slack: 4096,
            step: SWEEP_STEP,
            run: SWEEP_RUN,
            owed: 0,
        }
    }

    /// Tests: sweeps that start at `slack` stale entries beyond the members, owed `step`
    /// entries a push, and run once `run` are owed, so that small state machines meet them
    /// (mid-sweep too: with a step of 2 a sweep outlasts a few pushes).
    #[cfg(test)]
    pub fn tune(&mut self, slack: isize, step: usize, run: usize) {
        self.slack = slack;
        self.step = step;
        self.run = run;
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sequence of the last entry pushed (0 before any): entries pushed later have higher
    /// ones.
    pub fn last_seq(&self) -> u64 {
        self.seq
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
        while let Some((i, s)) = self.pop_entry() {
            let ahead = self.get(distance.wrapping_sub(1)).map(|(a, _)| a as usize);
            if take(i as usize, s, ahead) {
                self.len -= 1;
                return Some(i as usize);
            }
        }
        None
    }

    /// The front entry, live or stale, taken off the queue (past a sweep's hole).
    fn pop_entry(&mut self) -> Option<(u32, u64)> {
        if let Some(sw) = &mut self.sweep {
            if sw.write == 0 {
                // Nothing swept is left before the hole: drop the hole, the sweep goes on
                // from the front.
                self.queue.drain(..sw.read);
                sw.read = 0;
            } else {
                sw.write -= 1;
                sw.read -= 1;
            }
        }
        self.queue.pop_front()
    }

    /// The `n`-th entry from the front, past a sweep's hole.
    fn get(&self, n: usize) -> Option<(u32, u64)> {
        let at = match self.sweep {
            Some(sw) if n >= sw.write => n.checked_add(sw.read - sw.write)?,
            _ => n,
        };
        self.queue.get(at).copied()
    }

    /// Drops stale entries once they outnumber the members, [`SWEEP_STEP`] entries a call on
    /// average, paid in runs of [`SWEEP_RUN`] (module docs): amortized O(1) per push, and no
    /// call does more than a run. `prefetch(i)` asks for object `i`'s line.
    pub fn compact_if_needed(&mut self, mark_of: impl Fn(usize) -> u64, prefetch: impl Fn(usize)) {
        if self.sweep.is_none() {
            if self.queue.len() as isize <= 2 * self.len as isize + self.slack {
                return;
            }
            self.sweep = Some(Sweep { write: 0, read: 0 });
            self.owed = 0;
        }
        self.owed += self.step;
        if self.owed >= self.run {
            let n = std::mem::take(&mut self.owed);
            self.sweep_on(n, mark_of, prefetch);
        }
    }

    /// Moves the sweep on by up to `n` entries, ending it at the back.
    fn sweep_on(&mut self, n: usize, mark_of: impl Fn(usize) -> u64, prefetch: impl Fn(usize)) {
        let Some(mut sw) = self.sweep else {
            return;
        };
        let end = (sw.read + n).min(self.queue.len());
        for r in sw.read..end {
            prefetch(self.queue[r].0 as usize);
        }
        for r in sw.read..end {
            let e = self.queue[r];
            self.queue[sw.write] = e;
            // Branch-free: the entries' object reads are independent, so they overlap.
            sw.write += usize::from(mark_of(e.0 as usize) == e.1);
        }
        sw.read = end;
        if sw.read == self.queue.len() {
            self.queue.truncate(sw.write);
            self.sweep = None;
        } else {
            self.sweep = Some(sw);
        }
    }

    /// Members from least to most recently used.
    pub fn iter<'a>(
        &'a self,
        mark_of: impl Fn(usize) -> u64 + 'a,
    ) -> impl Iterator<Item = usize> + 'a {
        let (write, read) = self.sweep.map_or((0, 0), |sw| (sw.write, sw.read));
        self.queue
            .iter()
            .enumerate()
            .filter(move |&(p, _)| p < write || p >= read)
            .map(|(_, e)| e)
            .filter(move |&&(i, s)| mark_of(i as usize) == s)
            .map(|&(i, _)| i as usize)
    }

    /// Entries in the queue, stale ones included (a sweep's hole left out).
    #[cfg(test)]
    pub fn entries(&self) -> usize {
        self.queue.len() - self.sweep.map_or(0, |sw| sw.read - sw.write)
    }

    /// Checks that the live entries are exactly `len`, each object at most once.
    pub fn validate(&self, mark_of: impl Fn(usize) -> u64) -> Result<(), String> {
        if let Some(sw) = self.sweep {
            if sw.write > sw.read || sw.read > self.queue.len() {
                return Err(format!(
                    "sweep at write {} read {} in {} entries",
                    sw.write,
                    sw.read,
                    self.queue.len()
                ));
            }
        }
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

impl Default for Lru {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
#[path = "../tests/lru_proptest.rs"]
mod lru_proptest;

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
            l.compact_if_needed(|i| marks[i], |_| ());
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
            l.compact_if_needed(|i| marks[i], |_| ());
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
