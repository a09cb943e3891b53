//! An intrusive LRU list over object indices: O(1) push, remove and pop.
//!
//! Membership is exact: an object is in the list if and only if it is evictable now (device
//! Ready, unpinned, host copy Ready, not dropped). The owner keeps that promise at every state
//! change, so eviction never has to skip entries. Order is the order objects became evictable;
//! the head is the least recently used.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
    linked: bool,
}

const UNLINKED: Link = Link {
    prev: NIL,
    next: NIL,
    linked: false,
};

/// Doubly linked list of indices, stored as arrays indexed by the object index.
#[derive(Debug, Default, Clone)]
pub struct Lru {
    links: Vec<Link>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    /// An empty list.
    pub fn new() -> Self {
        Lru {
            links: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Entries in the list.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `idx` is in the list.
    pub fn contains(&self, idx: usize) -> bool {
        self.links.get(idx).is_some_and(|l| l.linked)
    }

    /// Appends `idx` as the most recently used entry. No-op if already linked.
    pub fn push_back(&mut self, idx: usize) {
        if idx >= self.links.len() {
            self.links.resize(idx + 1, UNLINKED);
        }
        if self.links[idx].linked {
            return;
        }
        let i = idx as u32;
        self.links[idx] = Link {
            prev: self.tail,
            next: NIL,
            linked: true,
        };
        if self.tail == NIL {
            self.head = i;
        } else {
            self.links[self.tail as usize].next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Unlinks `idx`; returns whether it was linked.
    pub fn remove(&mut self, idx: usize) -> bool {
        let Some(&link) = self.links.get(idx) else {
            return false;
        };
        if !link.linked {
            return false;
        }
        if link.prev == NIL {
            self.head = link.next;
        } else {
            self.links[link.prev as usize].next = link.next;
        }
        if link.next == NIL {
            self.tail = link.prev;
        } else {
            self.links[link.next as usize].prev = link.prev;
        }
        self.links[idx] = UNLINKED;
        self.len -= 1;
        true
    }

    /// Unlinks and returns the least recently used entry.
    pub fn pop_front(&mut self) -> Option<usize> {
        if self.head == NIL {
            return None;
        }
        let idx = self.head as usize;
        self.remove(idx);
        Some(idx)
    }

    /// Entries from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let idx = cur as usize;
            cur = self.links[idx].next;
            Some(idx)
        })
    }

    /// Checks the links: both directions agree and the length matches.
    pub fn validate(&self) -> Result<(), String> {
        let forward: Vec<usize> = self.iter().take(self.len + 1).collect();
        if forward.len() != self.len {
            return Err(format!(
                "list walks {} entries, len is {}",
                forward.len(),
                self.len
            ));
        }
        let linked = self.links.iter().filter(|l| l.linked).count();
        if linked != self.len {
            return Err(format!(
                "{linked} entries flagged linked, len is {}",
                self.len
            ));
        }
        let mut prev = NIL;
        for &idx in &forward {
            if self.links[idx].prev != prev {
                return Err(format!("entry {idx} has a broken back link"));
            }
            prev = idx as u32;
        }
        if prev != self.tail {
            return Err("tail does not end the list".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_remove_pop_keep_order() {
        let mut l = Lru::new();
        for i in [3, 1, 4, 0, 5] {
            l.push_back(i);
        }
        l.push_back(1); // already linked: no-op
        assert!(l.remove(4));
        assert!(!l.remove(4));
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![3, 1, 0, 5]);
        assert_eq!(l.pop_front(), Some(3));
        l.push_back(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), vec![1, 0, 5, 3]);
        l.validate().unwrap();
        while l.pop_front().is_some() {}
        assert!(l.is_empty());
        l.validate().unwrap();
    }
}
