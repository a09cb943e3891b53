//! What a device resolver's last step read, for the host's own evictions. A decode step
//! resolved on the device hits objects without the directory seeing it, so its LRU order goes
//! stale: a prefill's loads would evict the pages the device reads every step. The scheduler
//! publishes the step's read bitmap (a bit per object of a homed namespace range, as the
//! resolver's mirror numbers them) when it reconciles the step; an eviction, or the device's
//! next grant of victims, then gives an object the last step read a second chance, back to the
//! LRU's end, once a bitmap.

use super::*;
use crate::directory::key::LayerGroup;
use std::sync::Arc;

/// How many objects the device read one host eviction passes over at most before it takes
/// the next as it is: the walk, paid inside a host step, stays short where most of the LRU's
/// front was read (the bench's hot set), and what was passed over waits at the LRU's end.
pub(crate) const MAX_CHANCES: u32 = 8;

/// A published read bitmap: bit `(namespace id - base) * layers + layer` is set when the
/// last device step read that object (a namespace per host page, as the joined scheduler
/// keys its pages' objects).
#[derive(Debug)]
pub(super) struct ReadBits {
    bits: Arc<Vec<u32>>,
    base: u64,
    layers: u64,
    /// The LRU's last sequence when published: an entry pushed since (a second chance given,
    /// or the object used again) gets no chance from this bitmap.
    before: u64,
}

impl ReadBits {
    fn was_read(&self, key: &ObjectKey) -> bool {
        // (Whole-page objects are a namespace's one object when it has one layer.)
        let l = match key.layers {
            LayerGroup::Layer(l) => l,
            LayerGroup::All if self.layers == 1 => 0,
            LayerGroup::All => return false,
        };
        let Some(n) = key.namespace.id.checked_sub(self.base) else {
            return false;
        };
        let e = n.saturating_mul(self.layers).saturating_add(u64::from(l));
        if u64::from(l) >= self.layers {
            return false;
        }
        usize::try_from(e / 32)
            .ok()
            .and_then(|w| self.bits.get(w))
            .is_some_and(|w| w >> (e % 32) & 1 == 1)
    }
}

impl Core {
    /// Publishes what the last device step read: `bits`, a bit per object of the namespaces
    /// from `base` on, `layers` a namespace (each a layer's object). Later evictions give the
    /// objects it names a second chance ([`Core::second_chance`]).
    pub fn publish_reads(&mut self, bits: Arc<Vec<u32>>, base: u64, layers: u16) {
        self.reads = Some(ReadBits {
            bits,
            base,
            layers: u64::from(layers),
            before: self.lru.last_seq(),
        });
    }

    /// Whether object `idx`, just popped from the LRU entry of sequence `seq` to be evicted,
    /// gets a second chance instead: the last published bitmap says the device read it, it
    /// has had none from that bitmap, and this eviction gave fewer than `bound` (`given`,
    /// counted here; the caller adds it to its total). If so it goes back to the LRU's end.
    pub(super) fn second_chance(
        &mut self,
        idx: usize,
        seq: u64,
        given: &mut u32,
        bound: u32,
    ) -> bool {
        let Some(r) = &self.reads else {
            return false;
        };
        if *given >= bound || seq > r.before || !r.was_read(&self.objects.side_of(idx).key) {
            return false;
        }
        *given += 1;
        let stamp = self.tick();
        self.objects[idx].stamp = stamp;
        self.settle(idx);
        true
    }
}
