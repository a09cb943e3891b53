//! A set of device slots as one flag per slot of the pool: O(1) membership without hashing,
//! for the slots granted to a device resolver (thousands change hands every decode step).

use crate::ids::SlotId;

/// Slots by membership flag; the flags grow to the highest slot inserted (a directory
/// without a device resolver never allocates them).
#[derive(Debug, Clone, Default)]
pub struct SlotSet {
    member: Vec<bool>,
    len: usize,
}

impl SlotSet {
    /// Whether `s` is in the set.
    pub fn contains(&self, s: &SlotId) -> bool {
        self.member.get(s.raw() as usize) == Some(&true)
    }

    /// Adds `s`; false if it was in already.
    pub fn insert(&mut self, s: SlotId) -> bool {
        let i = s.raw() as usize;
        if i >= self.member.len() {
            self.member.resize(i + 1, false);
        }
        let m = &mut self.member[i];
        let added = !std::mem::replace(m, true);
        self.len += usize::from(added);
        added
    }

    /// Removes `s`; false if it was not in.
    pub fn remove(&mut self, s: &SlotId) -> bool {
        match self.member.get_mut(s.raw() as usize) {
            Some(m) if *m => {
                *m = false;
                self.len -= 1;
                true
            }
            _ => false,
        }
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no member.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The members, ascending (a scan of the pool: for checks).
    pub fn iter(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.member
            .iter()
            .enumerate()
            .filter(|(_, &m)| m)
            .map(|(i, _)| SlotId::new(i as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_counted_once() {
        let mut s = SlotSet::default();
        assert!(s.insert(SlotId::new(3)) && !s.insert(SlotId::new(3)));
        assert!(s.insert(SlotId::new(7)));
        assert_eq!(s.len(), 2);
        assert!(s.contains(&SlotId::new(3)) && !s.contains(&SlotId::new(4)));
        assert!(!s.contains(&SlotId::new(100)) && !s.remove(&SlotId::new(100)));
        assert!(s.remove(&SlotId::new(3)) && !s.remove(&SlotId::new(3)));
        assert_eq!(s.iter().collect::<Vec<_>>(), [SlotId::new(7)]);
        assert!(!s.is_empty());
    }
}
