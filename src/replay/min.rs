//! Belady's MIN on a journal: when a slot is needed, evict the evictable object whose next
//! read is furthest in the future. Evictable means what it means at run time: on the device,
//! unpinned, with a host copy. With the calls' pins and write-throughs taken as given, no
//! policy can miss less at this budget (the furthest-next-use exchange argument; checked
//! against exhaustive search in `tests/test_replay.py`).

use super::ReplayStats;
use crate::directory::journal::{Journal, Op};
use crate::error::{Error, Result};
use rustc_hash::FxHashMap;
use std::collections::BinaryHeap;

const NEVER: u64 = u64::MAX;

#[derive(Debug, Clone, Copy, Default)]
struct Obj {
    resident: bool,
    live: bool,
    backed: bool,
    pins: u32,
    next: u64,
}

struct Min {
    objs: Vec<Obj>,
    heap: BinaryHeap<(u64, u32)>,
    used: u64,
    cap: u64,
    stats: ReplayStats,
}

impl Min {
    fn evictable(o: &Obj) -> bool {
        o.resident && o.live && o.backed && o.pins == 0
    }

    /// Frees one slot by MIN; false when nothing is evictable.
    fn evict_one(&mut self) -> bool {
        let mut held = Vec::new();
        let mut found = false;
        while let Some((next, id)) = self.heap.pop() {
            let o = &self.objs[id as usize];
            if !o.resident || o.next != next {
                continue; // stale entry
            }
            if !Self::evictable(o) {
                held.push((next, id));
                continue;
            }
            self.objs[id as usize].resident = false;
            self.used -= 1;
            found = true;
            break;
        }
        self.heap.extend(held);
        found
    }

    /// Makes `n` slots free: evicting, then writing every unbacked page through (make-room)
    /// and evicting again. False when the budget cannot.
    fn room(&mut self, n: u64) -> bool {
        if n > self.cap {
            return false;
        }
        while self.used + n > self.cap {
            if self.evict_one() {
                continue;
            }
            let mut forced = 0;
            for o in self.objs.iter_mut() {
                if o.resident && o.live && !o.backed {
                    o.backed = true;
                    forced += 1;
                }
            }
            self.stats.forced_backups += forced;
            if forced == 0 || !self.evict_one() {
                return false;
            }
        }
        true
    }

    /// [`Self::room`]; when that fails, drops the pins of outstanding prefetches (handles
    /// `prefetched` of `pinned`) and tries again, as the scheduler's make-room does.
    fn room_dropping(
        &mut self,
        n: u64,
        prefetched: &mut Vec<u64>,
        pinned: &mut FxHashMap<u64, Vec<u32>>,
    ) -> bool {
        if self.room(n) {
            return true;
        }
        if prefetched.is_empty() {
            return false;
        }
        for arg in prefetched.drain(..) {
            for id in pinned.remove(&arg).unwrap_or_default() {
                self.objs[id as usize].pins -= 1;
                self.free_if_dead(id);
            }
        }
        self.room(n)
    }

    fn place(&mut self, id: u32, next: u64) {
        let o = &mut self.objs[id as usize];
        o.next = next;
        if o.resident {
            self.heap.push((next, id));
        }
    }

    fn free_if_dead(&mut self, id: u32) {
        let o = &mut self.objs[id as usize];
        if !o.live && o.pins == 0 && o.resident {
            o.resident = false;
            self.used -= 1;
        }
    }
}

/// Replays `j` under MIN with `budget` device slots.
pub fn replay_min(j: &Journal, budget: u32) -> Result<ReplayStats> {
    j.validate()
        .map_err(|e| Error::config("trace", e, "a journal recorded by a directory"))?;
    // Dense ids, and the namespace of each.
    let mut ids: FxHashMap<crate::directory::ObjectKey, u32> = FxHashMap::default();
    let mut by_ns: FxHashMap<(u64, u32), Vec<u32>> = FxHashMap::default();
    let key_id: Vec<u32> = (0..j.ns.len())
        .map(|k| {
            let key = j.key(k);
            let n = ids.len() as u32;
            *ids.entry(key).or_insert_with(|| {
                by_ns.entry((j.ns[k], j.version[k])).or_default().push(n);
                n
            })
        })
        .collect();
    // Next read of each key occurrence: the next resolve entry naming it.
    let mut next_of = vec![NEVER; j.ns.len()];
    let mut upcoming = vec![NEVER; ids.len()];
    for i in (0..j.len()).rev() {
        let (op, _, _, keys) = j.entry(i);
        for k in keys {
            let id = key_id[k] as usize;
            next_of[k] = upcoming[id];
            if op == Op::Resolve {
                upcoming[id] = i as u64;
            }
        }
    }
    let mut m = Min {
        objs: vec![Obj::default(); ids.len()],
        heap: BinaryHeap::new(),
        used: 0,
        cap: u64::from(budget),
        stats: ReplayStats {
            budget: u64::from(budget),
            feasible: true,
            ..Default::default()
        },
    };
    let mut pinned: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
    let mut prefetched: Vec<u64> = Vec::new(); // handles of `pinned` that are prefetches'
    let mut backups: FxHashMap<u64, Vec<u32>> = FxHashMap::default();
    let mut seen = vec![u64::MAX; ids.len()];
    for i in 0..j.len() {
        let (op, arg, flag, keys) = j.entry(i);
        let ok = match op {
            Op::Alloc => {
                let fresh: Vec<usize> = keys
                    .clone()
                    .filter(|&k| !m.objs[key_id[k] as usize].live)
                    .collect();
                if !m.room_dropping(fresh.len() as u64, &mut prefetched, &mut pinned) {
                    false
                } else {
                    for k in fresh {
                        let id = key_id[k];
                        m.objs[id as usize] = Obj {
                            resident: true,
                            live: true,
                            backed: false,
                            pins: 0,
                            next: NEVER,
                        };
                        m.used += 1;
                        m.place(id, next_of[k]);
                    }
                    true
                }
            }
            Op::Register => {
                for k in keys {
                    let o = &mut m.objs[key_id[k] as usize];
                    if !o.live {
                        *o = Obj {
                            live: true,
                            backed: true,
                            ..Default::default()
                        };
                    }
                }
                true
            }
            Op::Resolve | Op::Prefetch => {
                let read = op == Op::Resolve;
                // Distinct ids of the call, each with its occurrence's next read.
                let mut distinct = Vec::new();
                for k in keys {
                    let id = key_id[k];
                    if seen[id as usize] != i as u64 {
                        seen[id as usize] = i as u64;
                        distinct.push((id, next_of[k]));
                    }
                }
                // Present objects are pinned first (a resolve's own pages are not evicted
                // for its misses); a prefetch pins only what it loads.
                let mut pins = Vec::new();
                let mut misses = Vec::new();
                for &(id, next) in &distinct {
                    let o = m.objs[id as usize];
                    if o.resident {
                        if read {
                            m.stats.hits += 1;
                            m.objs[id as usize].pins += 1;
                            pins.push(id);
                            m.place(id, next);
                        }
                    } else if o.live && o.backed {
                        misses.push((id, next));
                    }
                }
                if read {
                    m.stats.accesses += distinct.len() as u64;
                }
                let fits = m.room_dropping(misses.len() as u64, &mut prefetched, &mut pinned);
                if fits {
                    for &(id, next) in &misses {
                        let o = &mut m.objs[id as usize];
                        o.resident = true;
                        o.pins += 1;
                        m.used += 1;
                        pins.push(id);
                        m.place(id, next);
                    }
                    m.stats.loads += misses.len() as u64;
                    if !read {
                        m.stats.prefetch_loads += misses.len() as u64;
                    }
                }
                if !read && !pins.is_empty() {
                    prefetched.push(arg);
                }
                pinned.insert(arg, pins);
                // A prefetch that does not fit is skipped, as at run time.
                fits || !read
            }
            Op::Release => {
                for id in pinned.remove(&arg).unwrap_or_default() {
                    m.objs[id as usize].pins -= 1;
                    m.free_if_dead(id);
                }
                true
            }
            Op::Backup => {
                backups.insert(arg, keys.map(|k| key_id[k]).collect());
                true
            }
            Op::BackupDone => {
                for id in backups.remove(&arg).unwrap_or_default() {
                    let o = &mut m.objs[id as usize];
                    if o.live {
                        o.backed = true;
                    }
                }
                true
            }
            Op::FailBackup => {
                backups.remove(&arg);
                true
            }
            Op::Drop => {
                for id in by_ns.get(&(arg, flag)).cloned().unwrap_or_default() {
                    m.objs[id as usize].live = false;
                    m.free_if_dead(id);
                }
                true
            }
            Op::Evict => {
                for _ in 0..arg {
                    if !m.evict_one() {
                        break;
                    }
                }
                true
            }
            Op::Step => {
                m.stats.steps += 1;
                true
            }
            Op::Complete | Op::FailLoad | Op::Ended => true,
        };
        if !ok {
            m.stats.feasible = false;
            break;
        }
    }
    Ok(m.stats)
}
