//! Where kept lists live: layer-major, every request's list of a layer in one flat array.
//!
//! A decode step merges 3,904 kept lists (61 layers x 64 requests), each untouched since the
//! layer's last plan. Held per request as `Vec<Vec<Kept>>`, each merge began with two
//! dependent cache misses (the layer's list header in the request, then the list), which
//! software prefetch could only partly hide. Here a layer's lists are one array, in the order
//! of the batch that last planned the layer, and each request's run is found through a small
//! per-layer table indexed by the request's dense [`KeptSlot`]: a plan over the same batch
//! reads the array front to back, which the hardware streams. The plan's merge writes the next
//! lists as one array too ([`super::rows::KeptRows::lists`]); finish installs it in place of
//! the old one (the runs of requests the plan did not cover are carried over), where it used
//! to copy each row back into its request.
//!
//! Invariants (checked by `validate`): every run lies inside its layer's array; runs of free
//! slots are empty. (What a kept entry means, and that it matches the directory's held pins,
//! is `kept.rs`'s.)

use super::Kept;

/// A request's dense index in the kept lists' per-layer run tables; reused after the request
/// ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeptSlot(u32);

impl KeptSlot {
    /// The slot as an index into run tables.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

/// Entries `start..end` of a layer's array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Run {
    pub start: u32,
    pub end: u32,
}

impl Run {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.end as usize
    }

    fn len(self) -> usize {
        (self.end - self.start) as usize
    }
}

/// One layer's kept lists.
#[derive(Debug, Default)]
struct LayerKept {
    lists: Vec<Kept>,
    /// Per slot: its run in `lists`.
    runs: Vec<Run>,
}

/// Every layer's kept lists, and the slots of the requests that own them.
#[derive(Debug)]
pub(super) struct KeptStore {
    layers: Vec<LayerKept>,
    /// Slots given out so far (every run table has this many entries).
    slots: u32,
    /// Slots of ended requests, to reuse.
    free: Vec<KeptSlot>,
    /// Scratch for `install`: per slot, whether the plan covered it.
    covered: Vec<bool>,
    /// An array a finished install gave back, to build a later plan's lists in.
    spare: Vec<Kept>,
}

impl KeptStore {
    /// Empty lists for `layers` layers.
    pub fn new(layers: usize) -> Self {
        KeptStore {
            layers: (0..layers).map(|_| LayerKept::default()).collect(),
            slots: 0,
            free: Vec::new(),
            covered: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// A slot for a new request: every layer's list empty.
    pub fn add(&mut self) -> KeptSlot {
        if let Some(s) = self.free.pop() {
            return s;
        }
        let s = KeptSlot(self.slots);
        self.slots += 1;
        for l in &mut self.layers {
            l.runs.push(Run::default());
        }
        s
    }

    /// Ends `slot`'s request: empties its lists, appending their objects to `objects` (to give
    /// back), and frees the slot.
    pub fn remove(&mut self, slot: KeptSlot, objects: &mut Vec<u32>) {
        for l in 0..self.layers.len() {
            self.drain(l, slot, objects);
        }
        self.free.push(slot);
    }

    /// Slots given out and not freed.
    pub fn in_use(&self) -> usize {
        self.slots as usize - self.free.len()
    }

    /// `slot`'s list at `layer`.
    #[inline]
    pub fn list(&self, layer: usize, slot: KeptSlot) -> &[Kept] {
        let l = &self.layers[layer];
        &l.lists[l.runs[slot.index()].range()]
    }

    /// `slot`'s list at `layer`, with the next `ahead` bytes of the layer's array asked for:
    /// a plan over the batch that last planned the layer reads the array front to back, so
    /// these are the next rows' lists (their misses overlap this row's merge).
    #[inline]
    pub fn list_ahead(&self, layer: usize, slot: KeptSlot, ahead: usize) -> &[Kept] {
        let l = &self.layers[layer];
        let run = l.runs[slot.index()];
        if let Some(next) = l.lists.get(run.end as usize..) {
            crate::prefetch::prefetch_range(next, ahead);
        }
        &l.lists[run.range()]
    }

    /// Empties `slot`'s list at `layer`, appending its objects to `objects`.
    pub fn drain(&mut self, layer: usize, slot: KeptSlot, objects: &mut Vec<u32>) {
        let l = &mut self.layers[layer];
        let run = std::mem::take(&mut l.runs[slot.index()]);
        objects.extend(l.lists[run.range()].iter().map(|k| k.object));
    }

    /// Entries kept for `slot`, every layer.
    #[cfg(test)]
    pub fn count(&self, slot: KeptSlot) -> usize {
        self.layers.iter().map(|l| l.runs[slot.index()].len()).sum()
    }

    /// An empty array with the room a finished plan's lists had (its next lists' buffer).
    pub fn take_spare(&mut self, room: usize) -> Vec<Kept> {
        let mut v = std::mem::take(&mut self.spare);
        v.clear();
        v.reserve(room);
        v
    }

    /// Makes `lists` layer `layer`'s array: each `(slot, run)` of `covered` is that slot's
    /// list in it (a slot the plan covered but keeps nothing for has an empty run); every other
    /// slot keeps the list it had, moved over. The old array becomes the spare.
    pub fn install(&mut self, layer: usize, mut lists: Vec<Kept>, covered: &[(KeptSlot, Run)]) {
        let l = &mut self.layers[layer];
        self.covered.clear();
        self.covered.resize(l.runs.len(), false);
        for &(s, run) in covered {
            debug_assert!(run.end as usize <= lists.len());
            l.runs[s.index()] = run;
            self.covered[s.index()] = true;
        }
        for (s, run) in l.runs.iter_mut().enumerate() {
            if self.covered[s] {
                continue;
            }
            // (An empty run, too, must point inside the new array.)
            let start = lists.len() as u32;
            lists.extend_from_slice(&l.lists[run.range()]);
            *run = Run {
                start,
                end: lists.len() as u32,
            };
        }
        self.spare = std::mem::replace(&mut l.lists, lists);
    }

    /// Drops the entries of `slot`'s list at `layer` that `keep` refuses (order kept).
    pub fn retain(&mut self, layer: usize, slot: KeptSlot, mut keep: impl FnMut(&Kept) -> bool) {
        let l = &mut self.layers[layer];
        let run = l.runs[slot.index()];
        let mut w = run.start as usize;
        for i in run.range() {
            if keep(&l.lists[i]) {
                l.lists[w] = l.lists[i];
                w += 1;
            }
        }
        l.runs[slot.index()].end = w as u32;
    }

    /// Checks the store's own invariants (module docs).
    pub fn validate(&self) -> Result<(), String> {
        for (li, l) in self.layers.iter().enumerate() {
            if l.runs.len() != self.slots as usize {
                return Err(format!(
                    "layer {li}: {} runs for {} slots",
                    l.runs.len(),
                    self.slots
                ));
            }
            for (s, run) in l.runs.iter().enumerate() {
                if run.start > run.end || run.end as usize > l.lists.len() {
                    return Err(format!(
                        "layer {li}, slot {s}: run {run:?} outside {} entries",
                        l.lists.len()
                    ));
                }
            }
            for f in &self.free {
                if l.runs[f.index()].len() > 0 {
                    return Err(format!("layer {li}: free slot {} keeps pages", f.0));
                }
            }
        }
        let distinct: rustc_hash::FxHashSet<_> = self.free.iter().collect();
        if distinct.len() != self.free.len() || self.free.iter().any(|f| f.0 >= self.slots) {
            return Err(format!("free slots {:?} of {}", self.free, self.slots));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(page: u32) -> Kept {
        Kept {
            page,
            object: page + 100,
            slot: page as i32,
        }
    }

    fn pages(s: &KeptStore, layer: usize, slot: KeptSlot) -> Vec<u32> {
        s.list(layer, slot).iter().map(|k| k.page).collect()
    }

    #[test]
    fn install_carries_over_the_slots_a_plan_did_not_cover() {
        let mut s = KeptStore::new(2);
        let (a, b, c) = (s.add(), s.add(), s.add());
        s.install(
            0,
            vec![k(1), k(2), k(5)],
            &[(a, Run { start: 0, end: 2 }), (b, Run { start: 2, end: 3 })],
        );
        assert_eq!(pages(&s, 0, a), [1, 2]);
        assert_eq!(pages(&s, 0, b), [5]);
        assert!(pages(&s, 0, c).is_empty());
        assert!(pages(&s, 1, a).is_empty(), "layer 1 untouched");
        // A plan over b and c only: a's list moves over, b's is replaced, c gets one.
        let mut next = s.take_spare(4);
        next.extend([k(6), k(7)]);
        s.install(
            0,
            next,
            &[(c, Run { start: 0, end: 1 }), (b, Run { start: 1, end: 1 })],
        );
        assert_eq!(pages(&s, 0, a), [1, 2]);
        assert!(pages(&s, 0, b).is_empty());
        assert_eq!(pages(&s, 0, c), [6]);
        assert_eq!(s.count(a), 2);
        s.validate().unwrap();
    }

    #[test]
    fn a_removed_slot_gives_back_every_layer_and_is_reused_empty() {
        let mut s = KeptStore::new(2);
        let (a, b) = (s.add(), s.add());
        s.install(
            0,
            vec![k(1), k(2)],
            &[(a, Run { start: 0, end: 1 }), (b, Run { start: 1, end: 2 })],
        );
        s.install(1, vec![k(3)], &[(a, Run { start: 0, end: 1 })]);
        let mut objects = Vec::new();
        s.remove(a, &mut objects);
        assert_eq!(objects, [101, 103]);
        s.validate().unwrap();
        let again = s.add();
        assert_eq!(again, a, "the slot is reused");
        assert!(pages(&s, 0, again).is_empty() && pages(&s, 1, again).is_empty());
        assert_eq!(pages(&s, 0, b), [2]);
        s.validate().unwrap();
    }

    #[test]
    fn retain_compacts_one_run_in_place() {
        let mut s = KeptStore::new(1);
        let (a, b) = (s.add(), s.add());
        s.install(
            0,
            vec![k(1), k(2), k(3), k(4)],
            &[(a, Run { start: 0, end: 3 }), (b, Run { start: 3, end: 4 })],
        );
        s.retain(0, a, |k| k.page != 2);
        assert_eq!(pages(&s, 0, a), [1, 3]);
        assert_eq!(pages(&s, 0, b), [4]);
        s.validate().unwrap();
    }

    #[test]
    fn validate_finds_a_run_outside_the_array_and_a_free_slot_that_keeps() {
        let mut s = KeptStore::new(1);
        let a = s.add();
        s.install(0, vec![k(1)], &[(a, Run { start: 0, end: 1 })]);
        s.layers[0].runs[0].end = 2;
        assert!(s.validate().is_err());
        s.layers[0].runs[0].end = 1;
        s.free.push(a);
        assert!(s.validate().is_err());
    }
}

#[cfg(test)]
#[path = "../tests/kept_store_proptest.rs"]
mod kept_store_proptest;
