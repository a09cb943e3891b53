//! `MinQueue`: a min-priority queue for pushes that mostly come in order.
//!
//! A sorted run (a deque) takes every push not below its last element, in O(1); a binary
//! heap takes the others. A pop takes the smaller of the two fronts. The LRU policy's pushes
//! are mostly fresh ranks, each above all before it, so most entries live in the run and a
//! pop is O(1) instead of a sift down a heap of every evictable key.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// The queue (module docs).
#[derive(Debug, Clone)]
pub struct MinQueue<T: Ord> {
    run: VecDeque<T>,
    rest: BinaryHeap<Reverse<T>>,
}

impl<T: Ord> Default for MinQueue<T> {
    fn default() -> Self {
        MinQueue {
            run: VecDeque::new(),
            rest: BinaryHeap::new(),
        }
    }
}

impl<T: Ord> MinQueue<T> {
    /// Adds `x`.
    pub fn push(&mut self, x: T) {
        match self.run.back() {
            Some(last) if x < *last => self.rest.push(Reverse(x)),
            _ => self.run.push_back(x),
        }
    }

    /// The smallest entry.
    pub fn peek(&self) -> Option<&T> {
        match (self.run.front(), self.rest.peek()) {
            (Some(a), Some(Reverse(b))) => Some(if b < a { b } else { a }),
            (a, b) => a.or(b.map(|r| &r.0)),
        }
    }

    /// Takes the smallest entry.
    pub fn pop(&mut self) -> Option<T> {
        let from_rest = match (self.run.front(), self.rest.peek()) {
            (Some(a), Some(Reverse(b))) => b < a,
            (None, Some(_)) => true,
            _ => false,
        };
        if from_rest {
            self.rest.pop().map(|r| r.0)
        } else {
            self.run.pop_front()
        }
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.run.len() + self.rest.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the entries `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&T) -> bool) {
        self.run.retain(&mut keep);
        self.rest.retain(|r| keep(&r.0));
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.run.clear();
        self.rest.clear();
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.run.iter().chain(self.rest.iter().map(|r| &r.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(crate::testing::proptest_config(256, "offload_queue"))]

        /// Against a sorted list: pops come out in order, whatever order the pushes came in,
        /// with pops, retains and pushes interleaved.
        #[test]
        fn pops_in_order(ops in prop::collection::vec((0u8..4, 0u32..50), 0..300)) {
            let mut q = MinQueue::default();
            let mut model: Vec<u32> = Vec::new();
            for (op, v) in ops {
                match op {
                    0 | 1 => { q.push(v); model.push(v); }
                    2 => {
                        model.sort_unstable();
                        let want = (!model.is_empty()).then(|| model.remove(0));
                        prop_assert_eq!(q.peek().copied(), want);
                        prop_assert_eq!(q.pop(), want);
                    }
                    _ => { q.retain(|x| x % 7 != v % 7); model.retain(|x| x % 7 != v % 7); }
                }
                prop_assert_eq!(q.len(), model.len());
            }
        }
    }
}
