//! The LRU replay: the journal's calls re-run on a fresh residency directory with another
//! device size. This is the code the step scheduler runs, not a model of it.

use super::ReplayStats;
use crate::directory::core::Core;
use crate::directory::journal::{Journal, Op};
use crate::directory::{DeviceState, DirectoryConfig, HostState, Namespace, ObjectKey};
use crate::error::{Error, Result};
use crate::ids::{HostSlotId, PinHandleId, TransferId};
use rustc_hash::FxHashMap;

struct Replay {
    dir: Core,
    handles: FxHashMap<u64, PinHandleId>,
    /// Of `handles`, the prefetches' (their pins are dropped to make room).
    prefetches: Vec<u64>,
    loads: FxHashMap<u64, TransferId>,
    backups: FxHashMap<u64, TransferId>,
    stats: ReplayStats,
}

impl Replay {
    /// Writes every unbacked page through now and drops the pins of outstanding prefetches
    /// (their loads still land), as the scheduler's make-room does.
    fn make_room(&mut self) -> Result<()> {
        for arg in std::mem::take(&mut self.prefetches) {
            if let Some(h) = self.handles.remove(&arg) {
                self.dir.release(h)?;
            }
        }
        for (_, t) in self.backups.drain() {
            let _ = self.dir.backup_complete(t);
        }
        let keys = self.dir.unbacked_keys();
        if keys.is_empty() {
            return Ok(());
        }
        let plan = self.dir.backup(&keys)?;
        if let Some(t) = plan.transfer {
            self.dir.backup_complete(t)?;
        }
        self.stats.forced_backups += keys.len() as u64;
        Ok(())
    }

    /// Runs `f`; on a full device makes room and runs it once more. `Ok(None)`: infeasible.
    fn with_room<T>(&mut self, f: impl Fn(&mut Core) -> Result<T>) -> Result<Option<T>> {
        match f(&mut self.dir) {
            Ok(v) => Ok(Some(v)),
            Err(Error::OutOfSlots { .. }) => {
                self.make_room()?;
                match f(&mut self.dir) {
                    Ok(v) => Ok(Some(v)),
                    Err(Error::OutOfSlots { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// Replays `j` on a directory of `budget` device slots.
pub fn replay_lru(j: &Journal, budget: u32) -> Result<ReplayStats> {
    j.validate()
        .map_err(|e| Error::config("trace", e, "a journal recorded by a directory"))?;
    let keys_total = j.ns.len() as u64;
    let host_pages = u32::try_from(keys_total + 1).unwrap_or(u32::MAX).max(1);
    let dir = Core::new(DirectoryConfig {
        device_pages: budget.max(1),
        device_reserve: 0,
        host_pages,
        host_reserve: 0,
        object_bytes: j.object_bytes.max(1),
    })?;
    let mut r = Replay {
        dir,
        handles: FxHashMap::default(),
        prefetches: Vec::new(),
        loads: FxHashMap::default(),
        backups: FxHashMap::default(),
        stats: ReplayStats {
            budget: u64::from(budget),
            feasible: true,
            ..Default::default()
        },
    };
    for i in 0..j.len() {
        let (op, arg, flag, range) = j.entry(i);
        let keys: Vec<ObjectKey> = range.clone().map(|k| j.key(k)).collect();
        let homes: Option<Vec<HostSlotId>> = range.clone().map(|k| j.home(k)).collect();
        let done = match op {
            Op::Alloc => r
                .with_room(|d| match &homes {
                    Some(h) if !h.is_empty() => d.allocate_homed(&keys, h),
                    _ => d.allocate(&keys),
                })?
                .is_some(),
            Op::Register => {
                let h = homes.ok_or_else(|| {
                    Error::config("trace", "a registered key without a home", "homes")
                })?;
                r.dir.register_host(&keys, &h)?;
                true
            }
            Op::Resolve | Op::Prefetch => {
                let pin = op == Op::Resolve;
                let res = r.with_room(|d| {
                    if pin {
                        d.resolve_hinted(&keys, None, None)
                    } else {
                        d.prefetch_loads(&keys, None)
                    }
                })?;
                match res {
                    Some(res) => {
                        let m = res.metrics;
                        if pin {
                            r.stats.accesses += m.distinct;
                            r.stats.hits += m.ready + m.loading;
                        } else {
                            r.stats.prefetch_loads += m.absent;
                        }
                        r.stats.loads += m.absent;
                        r.handles.insert(arg, res.handle);
                        if !pin {
                            r.prefetches.push(arg);
                        }
                        if let Some(lp) = res.loads.first() {
                            r.loads.insert(arg, lp.transfer);
                        }
                        true
                    }
                    None => !pin, // a prefetch that does not fit is skipped, as at run time
                }
            }
            Op::Release => {
                if let Some(t) = r.loads.remove(&arg) {
                    r.dir.complete(t)?; // the consumer read it: it had landed
                }
                if let Some(h) = r.handles.remove(&arg) {
                    r.dir.release(h)?;
                }
                true
            }
            Op::Complete => {
                if let Some(t) = r.loads.remove(&arg) {
                    r.dir.complete(t)?;
                }
                true
            }
            Op::FailLoad => {
                if let Some(t) = r.loads.remove(&arg) {
                    r.dir.fail(t, "failed in the recording", true)?;
                }
                true
            }
            Op::Backup => {
                // What still needs it here: a smaller budget may have written a page through
                // early (make-room) and evicted it since.
                let live: Vec<ObjectKey> = keys
                    .iter()
                    .copied()
                    .filter(|k| {
                        r.dir.state(k).is_some_and(|o| {
                            matches!(o.device, DeviceState::Ready { .. })
                                && matches!(o.host, HostState::None)
                        })
                    })
                    .collect();
                if !live.is_empty() {
                    if let Some(t) = r.dir.backup(&live)?.transfer {
                        r.backups.insert(arg, t);
                    }
                }
                true
            }
            Op::BackupDone => {
                if let Some(t) = r.backups.remove(&arg) {
                    r.dir.backup_complete(t)?;
                }
                true
            }
            Op::FailBackup => {
                if let Some(t) = r.backups.remove(&arg) {
                    r.dir.fail(t, "failed in the recording", true)?;
                }
                true
            }
            Op::Ended => true,
            Op::Drop => {
                let _ = r.dir.drop_namespace(Namespace {
                    id: arg,
                    version: flag,
                });
                true
            }
            Op::Evict => {
                r.dir.evict(arg as usize);
                true
            }
            Op::Step => {
                r.stats.steps += 1;
                true
            }
        };
        if !done {
            r.stats.feasible = false;
            break;
        }
    }
    Ok(r.stats)
}
