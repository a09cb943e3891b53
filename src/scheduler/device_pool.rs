//! The device resolver's pool: device slots the resolver keeps between steps, each holding
//! the object it last copied in (or nothing). The directory counts them as granted and never
//! tracks what is in them, so a step's misses cost the core no directory work once the pool
//! has grown: the log says which slot now holds which mirror entry, and that is all the pool
//! records.
//!
//! Slots are offered again in ring order with a second chance (the clock algorithm): an
//! entry whose object the last step read goes to the back once a pass. An entry's occupant
//! is stale when the mirror names another slot for it (the host moved or dropped the object
//! since); such an entry is as good as free, and the pool does not look: the device evicts an
//! occupant only where the mirror names that slot for it.
//!
//! A host load of an object a slot holds (where the mirror names it) adopts it there instead
//! of copying it again (`adopt_pooled`): the slot leaves the pool from wherever it is in the
//! ring.

use super::core::StepScheduler;
use super::device_step::Held;
use super::prefix::HOST_NS;
use super::resolver::ABSENT;
use super::PrefixTier;
use crate::directory::{DeviceState, LayerGroup, ObjectHint, ObjectKey};
use crate::error::Result;
use crate::ids::SlotId;
use std::collections::VecDeque;

/// No occupant.
const NONE: u32 = u32::MAX;

/// Entries fetched ahead of the clock hand.
const AHEAD: usize = 32;

/// Pool slots in clock order, each with its occupant's mirror entry.
///
/// A slot can leave from anywhere in the ring ([`DevicePool::remove`]: the host adopts what
/// it holds). Its entry stays in the ring, dead, and the clock drops it when it comes round:
/// a slot's dead entries always come before its live one (a slot is pushed again only after
/// it left), so a count of dead entries per slot tells them apart. Removals are rare (host
/// loads of what the pool holds), and the clock pays nothing for them until there are some.
#[derive(Debug, Default)]
pub(crate) struct DevicePool {
    /// (slot, occupant or NONE), in clock order; dead entries included.
    ring: VecDeque<(SlotId, u32)>,
    /// Per slot, dead entries still in the ring; and how many in all.
    dead: rustc_hash::FxHashMap<u32, u32>,
    dead_total: usize,
}

impl DevicePool {
    /// Slots in the pool.
    pub(crate) fn len(&self) -> usize {
        self.ring.len() - self.dead_total
    }

    /// Puts `slot` (not in the pool) at the back, holding mirror entry `occupant` (or
    /// nothing).
    pub(crate) fn push(&mut self, slot: SlotId, occupant: Option<usize>) {
        let e = occupant.map_or(NONE, |e| u32::try_from(e).expect("mirror entries fit u32"));
        self.ring.push_back((slot, e));
    }

    /// Takes `slot`, which is in the pool, out of it, from wherever it is in the ring.
    pub(crate) fn remove(&mut self, slot: SlotId) {
        debug_assert!(
            self.iter().any(|(s, _)| s == slot),
            "{slot} is not in the pool"
        );
        *self.dead.entry(slot.raw()).or_default() += 1;
        self.dead_total += 1;
    }

    /// Pops the front entry: Some(Some(live entry)), Some(None) for a dead one, None when
    /// the ring is empty. A live entry popped leaves the pool.
    fn pop(&mut self) -> Option<Option<(SlotId, u32)>> {
        let (slot, e) = self.ring.pop_front()?;
        if self.dead_total > 0 {
            if let std::collections::hash_map::Entry::Occupied(mut d) = self.dead.entry(slot.raw())
            {
                *d.get_mut() -= 1;
                if *d.get() == 0 {
                    d.remove();
                }
                self.dead_total -= 1;
                return Some(None);
            }
        }
        Some(Some((slot, e)))
    }

    /// Takes up to `n` entries off the front, in clock order: an entry whose occupant is
    /// `recent` goes to the back instead, at most once each (`second_chance`; without it,
    /// every entry is taken as it comes). Returns (slot, occupant as recorded: it may be
    /// stale, which costs nothing, since the device evicts an occupant only where the mirror
    /// names that slot for it).
    pub(crate) fn take(
        &mut self,
        n: usize,
        second_chance: bool,
        recent: impl Fn(usize) -> bool,
        fetch: impl Fn(usize),
        out: &mut Vec<(SlotId, Option<usize>)>,
    ) {
        let mut passes = self.ring.len();
        let want = out.len() + n;
        // `recent` reads state indexed by the occupant, a cache miss apiece: the entries
        // ahead are fetched (`fetch`) so that those misses overlap.
        if second_chance {
            for &(_, e) in self.ring.iter().take(AHEAD) {
                if e != NONE {
                    fetch(e as usize);
                }
            }
        }
        while out.len() < want && passes > 0 {
            passes -= 1;
            if second_chance {
                if let Some(&(_, e)) = self.ring.get(AHEAD) {
                    if e != NONE {
                        fetch(e as usize);
                    }
                }
            }
            let Some(popped) = self.pop() else {
                break;
            };
            let Some((slot, e)) = popped else {
                continue; // (dead: it left the pool before)
            };
            let occupant = (e != NONE).then_some(e as usize);
            if second_chance && occupant.is_some_and(&recent) {
                self.push(slot, occupant);
                continue;
            }
            out.push((slot, occupant));
        }
    }

    /// Empties the pool: every (slot, occupant as recorded).
    pub(crate) fn drain(&mut self) -> Vec<(SlotId, Option<usize>)> {
        let mut out = Vec::with_capacity(self.len());
        while let Some(popped) = self.pop() {
            if let Some((s, e)) = popped {
                out.push((s, (e != NONE).then_some(e as usize)));
            }
        }
        out
    }

    /// Every (slot, occupant as recorded), front to back (for checks).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (SlotId, Option<usize>)> + '_ {
        let mut dead = self.dead.clone();
        self.ring.iter().filter_map(move |&(s, e)| {
            if let Some(d) = dead.get_mut(&s.raw()).filter(|d| **d > 0) {
                *d -= 1;
                return None;
            }
            Some((s, (e != NONE).then_some(e as usize)))
        })
    }
}

impl StepScheduler<PrefixTier> {
    /// Gives back the grant and the pool between steps (no step open): victims to the LRU,
    /// the objects the pool holds to the directory (adopted where they are: nothing on the
    /// device is lost), and empty slots to the free list. The host needs the room
    /// (`make_room`), or the run is ending (`drain`). The mirror stays true: what the host
    /// then evicts is logged and cleared at the next grant.
    pub(crate) fn release_device(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        if link.open {
            return Ok(());
        }
        let mut slots = link.pool.drain();
        let mut victims = Vec::new();
        for (s, held) in std::mem::take(&mut link.grant) {
            match held {
                Held::Free => slots.push((s, None)),
                Held::Pool(e) => slots.push((s, Some(e))),
                Held::Victim(_, i) => victims.push(i),
            }
        }
        self.dir.unhold(&victims)?;
        self.give_back(slots, true)
    }

    /// Ends the grant between steps (no step open): victims back to the LRU (nothing stays
    /// pinned), and the slots the resolver owns into its pool, which keeps what they hold.
    pub(crate) fn park_grant(&mut self) -> Result<()> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(());
        };
        if link.open {
            return Ok(());
        }
        let mut victims = Vec::new();
        for (s, held) in std::mem::take(&mut link.grant) {
            match held {
                Held::Free => link.pool.push(s, None),
                Held::Pool(e) => link.pool.push(s, Some(e)),
                Held::Victim(_, i) => victims.push(i),
            }
        }
        self.dir.unhold(&victims)
    }

    /// Gives `slots` of the pool back to the directory (no step open): each live occupant
    /// (the mirror names its slot) adopted there when `adopt`, else dropped from the mirror,
    /// and the other slots freed.
    fn give_back(&mut self, slots: Vec<(SlotId, Option<usize>)>, adopt: bool) -> Result<()> {
        let Some(link) = self.tier.device.as_ref() else {
            return Ok(());
        };
        let state = link.state.clone();
        let mut st = state.lock();
        // The mirror first follows what changed since the last step (a home with a new
        // generation no longer holds what the pool copied from it).
        self.sync_mirror(&mut st)?;
        let layers = self.cfg.layers as usize;
        let mut keep = Vec::new();
        let mut free = Vec::new();
        for (s, e) in slots {
            match e.filter(|&e| st.mirror()[e] == s.raw() as i32) {
                Some(e) if adopt => keep.push((self.key_of(e, layers), ObjectHint::NONE, s)),
                Some(e) => {
                    st.set(e, ABSENT);
                    free.push(s);
                }
                None => free.push(s),
            }
        }
        let adopted = self.dir.adopt(&keep)?;
        for ((key, _, s), ok) in keep.iter().zip(adopted) {
            if !ok {
                // (Its object moved or went meanwhile: the mirror follows the directory.)
                let e = self.entry_of(key);
                let now = match self.dir.state(key).map(|o| o.device) {
                    Some(DeviceState::Ready { slot }) => slot.raw() as i32,
                    _ => ABSENT,
                };
                st.set(e, now);
                free.push(*s);
            }
        }
        self.dir.return_slots(&free)
    }

    /// Before the host loads `keys` (a plan's or a restore's; no step open): those whose
    /// object the resolver's pool holds, where the mirror names it, are adopted in their
    /// slots instead of copied in again, and leave the pool. Returns how many.
    pub(crate) fn adopt_pooled(
        &mut self,
        keys: &[ObjectKey],
        hints: &[ObjectHint],
    ) -> Result<usize> {
        let Some(link) = self.tier.device.as_ref() else {
            return Ok(0);
        };
        let owns_objects =
            link.pool.len() > 0 || link.grant.iter().any(|(_, h)| matches!(h, Held::Pool(_)));
        if link.open || !owns_objects {
            return Ok(0);
        }
        let state = link.state.clone();
        let mut st = state.lock();
        // The mirror first follows what changed since the last step: a home with a new
        // generation no longer holds the page the pool copied from it.
        self.sync_mirror(&mut st)?;
        let mut found = Vec::new();
        for (key, &hint) in keys.iter().zip(hints) {
            if key.namespace.id < HOST_NS || !matches!(key.layers, LayerGroup::Layer(_)) {
                continue;
            }
            if let Ok(s) = u32::try_from(st.mirror()[self.entry_of(key)]) {
                found.push((*key, hint, SlotId::new(s)));
            }
        }
        drop(st);
        // A plan's rows may name one object each (requests on one prefix): one slot, once.
        found.sort_unstable_by_key(|&(_, _, s)| s);
        found.dedup_by_key(|&mut (_, _, s)| s);
        // Of the slots the mirror names, the resolver's are the directory's granted ones, and
        // each holds the entry the mirror names there (`validate`); the rest are the
        // directory's own objects.
        let found: Vec<_> = self
            .dir
            .granted_among(&found.iter().map(|&(_, _, s)| s).collect::<Vec<_>>())
            .into_iter()
            .map(|i| found[i])
            .collect();
        if found.is_empty() {
            return Ok(0);
        }
        let link = self.tier.device.as_mut().expect("checked above");
        // Those standing in the grant join the pool first (a victim's slot is never one:
        // the directory does not count it granted).
        let wanted: rustc_hash::FxHashSet<SlotId> = found.iter().map(|&(_, _, s)| s).collect();
        let pool = &mut link.pool;
        link.grant.retain(|&(s, held)| {
            let found = wanted.contains(&s);
            if found {
                pool.push(s, held.pool_entry());
            }
            !found
        });
        // One the directory has elsewhere on the device, or whose host copy is not Ready, is
        // not adopted: the pool keeps it. (The call's one refusal, a slot not granted, cannot
        // come: the slots are distinct, granted, and nothing took them since.)
        let adopted = self.dir.adopt(&found)?;
        let link = self.tier.device.as_mut().expect("checked above");
        let mut n = 0;
        for (&(_, _, s), ok) in found.iter().zip(adopted) {
            if ok {
                link.pool.remove(s);
                n += 1;
            }
        }
        link.adopted += n as u64;
        Ok(n)
    }

    /// Frees at least `n` device slots from the resolver's pool when it can (no step open),
    /// oldest first, dropping what they hold from the mirror: for the host's allocations
    /// once the directory has nothing left to evict. Returns the slots freed.
    pub(crate) fn reclaim_device(&mut self, n: usize) -> Result<usize> {
        let Some(link) = self.tier.device.as_mut() else {
            return Ok(0);
        };
        if link.open || n == 0 {
            return Ok(0);
        }
        // All or nothing: when the pool cannot give them all, `make_room` adopts what it holds
        // instead. The standing grant's own slots count too: it is parked when they make up
        // the difference (its victims go back to the LRU; the next step grants again).
        if link.pool.len() < n {
            let parked = link
                .grant
                .iter()
                .filter(|(_, h)| !matches!(h, Held::Victim(..)))
                .count();
            if link.pool.len() + parked < n {
                return Ok(0);
            }
            self.park_grant()?;
        }
        let link = self.tier.device.as_mut().expect("checked above");
        let mut slots = Vec::with_capacity(n);
        link.pool.take(n, false, |_| false, |_| {}, &mut slots);
        let freed = slots.len();
        self.give_back(slots, false)?;
        Ok(freed)
    }
}

#[cfg(test)]
#[path = "../tests/device_pool_proptest.rs"]
mod device_pool_proptest;
