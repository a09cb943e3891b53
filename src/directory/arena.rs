//! The object arena: slots of `Option<T>` indexed by a stable `usize`, with a free list, and
//! beside them a column of `S` per slot (what the hot paths read rarely: the directory keeps
//! each object's 64-byte hot state in the slots and its identity in the column, so that a pin,
//! an unpin or an eviction reads one cache line, never two).
//!
//! It does what `slab` does for the directory, plus one thing `slab` cannot: the address of
//! slot `i` is known without reading it ([`Arena::prefetch`]). A resolve over millions of
//! objects is bound by one cache miss per object; prefetching the objects a few keys ahead
//! lets those misses overlap, and that needs the address before the read.
//!
//! Every slot has a generation, bumped when its value is removed: a value is created knowing
//! its slot's generation (it keeps it, [`Versioned`]), so an (index, generation) pair names
//! one value and never the one that reuses the slot after it (until the slot has been reused
//! 2^32 times). The generation of a vacant slot waits in the free list.
//!
//! Invariants: `len` is the number of occupied slots; `free` lists exactly the vacant slots,
//! each once, with the generation their next value gets; the column is as long as the slots
//! (a vacant slot's entry is stale).

/// The most values room is reserved for ahead (2^25): past it an arena grows as it fills.
pub const MAX_ROOM: usize = 1 << 25;

/// Slots of `T` with a free list, and a column of `S` beside them.
#[derive(Debug, Clone)]
pub struct Arena<T, S = ()> {
    slots: Vec<Option<T>>,
    column: Vec<S>,
    /// Vacant slots, each with the generation its next value gets.
    free: Vec<(u32, u32)>,
    len: usize,
}

/// A value that keeps the generation of the arena slot it was created in.
pub trait Versioned {
    /// The generation it was created under.
    fn generation(&self) -> u32;
}

impl<T, S> Default for Arena<T, S> {
    fn default() -> Self {
        Arena {
            slots: Vec::new(),
            column: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T: Versioned, S: Copy> Arena<T, S> {
    /// An empty arena.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty arena with room for `n` values (at most 2^25) before it grows, its buffers
    /// backed by huge pages where the kernel allows (see [`huge_pages`]). The room is
    /// reserved, not touched: memory is committed as slots fill. Where the reservation is
    /// refused the arena starts empty and grows as [`Self::new`]'s does.
    pub fn with_capacity(n: usize) -> Self {
        let mut a = Self::new();
        a.reserve(n);
        a
    }

    /// Room for `n` values in all (at most [`MAX_ROOM`]) before the arena grows, reserved as
    /// [`Self::with_capacity`] reserves it. Growing moves every slot (a copy of the whole
    /// arena, and its fresh pages faulted in, inside whichever call crossed the capacity);
    /// a reservation made up front keeps that off the hot paths. Nothing when the arena
    /// already has the room or the reservation is refused.
    pub fn reserve(&mut self, n: usize) {
        let more = n.min(MAX_ROOM).saturating_sub(self.slots.len());
        if self.slots.capacity() - self.slots.len() >= more {
            return;
        }
        if self.slots.try_reserve_exact(more).is_ok() && self.column.try_reserve_exact(more).is_ok()
        {
            huge_pages(&self.slots);
            huge_pages(&self.column);
        }
    }

    /// Values it holds before it grows.
    pub fn capacity(&self) -> usize {
        self.slots.capacity().min(self.column.capacity())
    }

    /// Occupied slots.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is occupied.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Stores `make(generation)` in a vacant slot (a freed one first), `side` in its column
    /// entry, and returns its index; `generation` is the slot's, which the value must keep.
    pub fn insert(&mut self, side: S, make: impl FnOnce(u32) -> T) -> usize {
        self.len += 1;
        let (reused, generation) = match self.free.pop() {
            Some((i, generation)) => (Some(i as usize), generation),
            None => (None, 0),
        };
        let value = make(generation);
        debug_assert_eq!(
            value.generation(),
            generation,
            "a value keeps its generation"
        );
        if let Some(i) = reused {
            debug_assert!(self.slots[i].is_none(), "free list names an occupied slot");
            self.slots[i] = Some(value);
            self.column[i] = side;
            return i;
        }
        let cap = (self.slots.capacity(), self.column.capacity());
        self.slots.push(Some(value));
        self.column.push(side);
        if self.slots.capacity() != cap.0 {
            huge_pages(&self.slots);
        }
        if self.column.capacity() != cap.1 {
            huge_pages(&self.column);
        }
        self.slots.len() - 1
    }

    /// Takes the value out of slot `i`, with its column entry, and bumps the slot's
    /// generation. Panics if it is vacant: callers hold only live indices, so that is a broken
    /// internal invariant.
    pub fn remove(&mut self, i: usize) -> (T, S) {
        let v = self.slots[i].take().expect("removing a vacant arena slot");
        self.free.push((i as u32, v.generation().wrapping_add(1)));
        self.len -= 1;
        (v, self.column[i])
    }

    /// The value at `index` if it is still the one created under `generation`.
    #[inline]
    pub fn get_versioned(&self, index: usize, generation: u32) -> Option<&T> {
        self.get(index).filter(|v| v.generation() == generation)
    }

    /// The column entry of slot `i`, if occupied.
    #[inline]
    pub fn side(&self, i: usize) -> Option<&S> {
        self.contains(i).then(|| &self.column[i])
    }

    /// The column entry of slot `i`. Panics if it is vacant (callers hold live indices).
    #[inline]
    pub fn side_of(&self, i: usize) -> &S {
        self.side(i).expect("a live arena index")
    }

    /// Hints the CPU to fetch the column entry of slot `i` (any `i`).
    #[inline]
    pub fn prefetch_side(&self, i: usize) {
        crate::prefetch::prefetch_bytes(self.column.as_ptr().wrapping_add(i), size_of::<S>());
    }

    /// Hints the CPU to fetch slot `i` (any `i`: out of range or vacant is harmless): every
    /// cache line it spans. A slot larger than a line spans two or three; asking for the
    /// first alone leaves the others to demand misses, taken one after another when the slot
    /// is read (benches/RESULTS.md, "Decode step: changes, measured").
    #[inline]
    pub fn prefetch(&self, i: usize) {
        crate::prefetch::prefetch_bytes(
            self.slots.as_ptr().wrapping_add(i),
            size_of::<Option<T>>(),
        );
    }

    /// Checks that `len`, the free list and the column agree with the slots.
    pub fn validate(&self) -> Result<(), String> {
        let occupied = self.slots.iter().filter(|s| s.is_some()).count();
        if occupied != self.len || occupied + self.free.len() != self.slots.len() {
            return Err(format!(
                "{occupied} occupied + {} free != {} slots (len {})",
                self.free.len(),
                self.slots.len(),
                self.len
            ));
        }
        if self.column.len() != self.slots.len() {
            return Err(format!(
                "{} column entries for {} slots",
                self.column.len(),
                self.slots.len()
            ));
        }
        if self
            .free
            .iter()
            .any(|&(i, _)| self.slots[i as usize].is_some())
        {
            return Err("the free list names an occupied slot".into());
        }
        Ok(())
    }
}

impl<T, S> Arena<T, S> {
    /// The value in slot `i`, if occupied.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&T> {
        self.slots.get(i).and_then(Option::as_ref)
    }

    /// The value in slot `i`, if occupied.
    #[inline]
    pub fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.slots.get_mut(i).and_then(Option::as_mut)
    }

    /// Whether slot `i` is occupied.
    #[inline]
    pub fn contains(&self, i: usize) -> bool {
        self.get(i).is_some()
    }

    /// Occupied slots and their values, in index order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|v| (i, v)))
    }

    /// Every occupied slot's value, in index order.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.slots.iter_mut().flatten()
    }
}

impl<'a, T, S> IntoIterator for &'a Arena<T, S> {
    type Item = (usize, &'a T);
    type IntoIter = Box<dyn Iterator<Item = (usize, &'a T)> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<T, S> std::ops::Index<usize> for Arena<T, S> {
    type Output = T;
    #[inline]
    fn index(&self, i: usize) -> &T {
        self.get(i).expect("a live arena index")
    }
}

impl<T, S> std::ops::IndexMut<usize> for Arena<T, S> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        self.get_mut(i).expect("a live arena index")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test value: a name and the generation it was made under.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) struct V(pub &'static str, pub u32);

    impl Versioned for V {
        fn generation(&self) -> u32 {
            self.1
        }
    }

    #[test]
    fn slots_are_reused_and_accounted() {
        let mut a = Arena::new();
        let x = a.insert(1, |g| V("x", g));
        let y = a.insert(2, |g| V("y", g));
        assert_eq!(a.remove(x), (V("x", 0), 1));
        assert!(!a.contains(x) && a.get(y) == Some(&V("y", 0)));
        assert_eq!(
            (a.side(x), a.side(y)),
            (None, Some(&2)),
            "a vacant slot has no entry"
        );
        let z = a.insert(3, |g| V("z", g));
        assert_eq!(z, x, "a freed slot is reused");
        assert_eq!(*a.side_of(z), 3, "with its new column entry");
        assert_eq!(a.iter().map(|(_, v)| v.0).collect::<Vec<_>>(), ["z", "y"]);
        a.prefetch(1_000_000); // harmless out of range
        a.validate().unwrap();
        assert_eq!(a.len(), 2);
    }

    #[test]
    fn a_generation_names_one_value_of_a_slot_never_the_next() {
        let mut a: Arena<V> = Arena::new();
        let x = a.insert((), |g| V("x", g));
        assert_eq!(a.get_versioned(x, 0), Some(&V("x", 0)));
        a.remove(x);
        assert_eq!(a.get_versioned(x, 0), None, "vacant");
        let y = a.insert((), |g| V("y", g));
        assert_eq!(y, x);
        assert_eq!(
            a.get_versioned(y, 0),
            None,
            "the slot's old generation names x, gone"
        );
        assert_eq!(a.get_versioned(y, 1), Some(&V("y", 1)));
        a.remove(y);
        let z = a.insert((), |g| V("z", g));
        assert_eq!(
            (a.get_versioned(z, 1), a.get_versioned(z, 2)),
            (None, Some(&V("z", 2)))
        );
        assert_eq!(a.get_versioned(99, 0), None, "out of range");
    }
}

/// Asks the kernel to back `v`'s buffer with huge pages (transparent huge pages in `madvise`
/// mode, the common default). A directory of millions of objects is read at random, one
/// object per key: with 4 KiB pages nearly every read also misses the TLB, and the page walks
/// (nested ones under a hypervisor) serialize. A hint only: where it is refused nothing
/// changes.
fn huge_pages<T>(v: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let bytes = v.capacity() * std::mem::size_of::<T>();
    if bytes < HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = v.as_ptr() as usize;
        let page = 4096;
        let aligned = start.div_ceil(page) * page;
        let len = (start + bytes).saturating_sub(aligned) / page * page;
        if len > 0 {
            // SAFETY: the range lies inside the vector's own allocation (rounded inward to
            // page bounds); MADV_HUGEPAGE changes how the kernel backs it, never its contents.
            unsafe {
                libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
}

#[cfg(test)]
mod huge_page_tests {
    use super::tests::V;
    use super::Arena;

    #[test]
    fn a_reserved_arena_fills_without_moving_and_grows_past_its_room() {
        let mut a = Arena::with_capacity(100_000);
        let first = a.insert(0u32, |g| V("first", g));
        let base = (a.slots.as_ptr(), a.column.as_ptr());
        for i in 1..100_000u32 {
            a.insert(i, |g| V("", g));
        }
        let now = (a.slots.as_ptr(), a.column.as_ptr());
        assert_eq!(now, base, "the reserved room held every slot");
        a.insert(7, |g| V("", g)); // past the room: it grows
        assert_eq!((a.len(), a.get(first)), (100_001, Some(&V("first", 0))));
        assert_eq!((a.side(first), a.side(99_999)), (Some(&0), Some(&99_999)));
        a.validate().unwrap();
    }

    #[test]
    fn room_reserved_later_is_filled_without_moving() {
        let mut a = Arena::with_capacity(10);
        let first = a.insert(0u32, |g| V("first", g));
        a.reserve(50_000);
        let base = (a.slots.as_ptr(), a.column.as_ptr());
        for i in 1..50_000u32 {
            a.insert(i, |g| V("", g));
        }
        assert_eq!((a.slots.as_ptr(), a.column.as_ptr()), base);
        a.reserve(20); // less than it holds: nothing changes
        assert_eq!(
            (a.slots.as_ptr(), a.get(first)),
            (base.0, Some(&V("first", 0)))
        );
        a.validate().unwrap();
    }
}
