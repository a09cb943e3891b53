//! A journal of the calls a directory served: their inputs, in order, compact. Replaying it
//! on a fresh directory of another device size re-runs the real residency code on the same
//! workload (`crate::replay`), and the offline optimum (Belady's MIN) reads the same record.
//!
//! Transfers and pin handles are named by the ordinal of the call that made them (the k-th
//! resolve, the k-th backup), so a replay can map its own ids onto them.

use super::key::{LayerGroup, Namespace, ObjectKey};
use crate::ids::{HostSlotId, PinHandleId, TransferId};
use rustc_hash::FxHashMap;

/// What a journal entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// `allocate` / `allocate_homed`: the keys (with homes, if any) became device-Ready.
    Alloc = 0,
    /// `register_host`: the keys became host-resident objects at their homes.
    Register = 1,
    /// `resolve`: pin and read the keys (handle = this resolve's ordinal).
    Resolve = 2,
    /// `prefetch_loads`: load the host-only keys, pinning only those.
    Prefetch = 3,
    /// `release` of resolve `arg`'s handle.
    Release = 4,
    /// `complete` of the load made by resolve `arg`.
    Complete = 5,
    /// `fail` of the load made by resolve `arg` (ended at once when `flag`).
    FailLoad = 6,
    /// `backup` of the keys (backup ordinal = count of earlier `Backup` entries).
    Backup = 7,
    /// `backup_complete` of backup `arg`.
    BackupDone = 8,
    /// `fail` of backup `arg`.
    FailBackup = 9,
    /// `transfer_ended` of the load of resolve `arg` (`flag` = 0) or of backup `arg` (1).
    Ended = 10,
    /// `drop_namespace` of (`arg`, version `flag`).
    Drop = 11,
    /// `evict(arg)`.
    Evict = 12,
    /// The end of a decode step (a marker for per-step figures).
    Step = 13,
}

impl Op {
    /// From its wire code.
    pub fn from_code(c: u8) -> Option<Op> {
        use Op::*;
        [
            Alloc, Register, Resolve, Prefetch, Release, Complete, FailLoad, Backup, BackupDone,
            FailBackup, Ended, Drop, Evict, Step,
        ]
        .get(c as usize)
        .copied()
    }
}

/// The journal: one entry per call, keys in flat arrays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Journal {
    /// Per entry: the op code.
    pub ops: Vec<u8>,
    /// Per entry: the ordinal or count the op names (see [`Op`]).
    pub args: Vec<u64>,
    /// Per entry: a small extra (a version, a flag).
    pub flags: Vec<u32>,
    /// Per entry: where its keys start in the key arrays (entry i's keys end where i+1's start).
    pub starts: Vec<u64>,
    /// Keys: namespace id.
    pub ns: Vec<u64>,
    /// Keys: namespace version.
    pub version: Vec<u32>,
    /// Keys: page.
    pub page: Vec<u32>,
    /// Keys: layer (-1 = every layer).
    pub layer: Vec<i32>,
    /// Keys: home host slot (-1 = none).
    pub home: Vec<i64>,
    /// Bytes of one object.
    pub object_bytes: u64,
    /// Device slots the recording directory had (usable ones).
    pub device_slots: u64,
    pub(crate) resolves: u64,
    pub(crate) backups: u64,
    pub(crate) handle_ord: FxHashMap<PinHandleId, u64>,
    pub(crate) load_ord: FxHashMap<TransferId, u64>,
    pub(crate) backup_ord: FxHashMap<TransferId, u64>,
}

impl Journal {
    /// An empty journal for a directory of `device_slots` usable slots.
    pub fn new(object_bytes: u64, device_slots: u64) -> Self {
        Journal {
            object_bytes,
            device_slots,
            ..Default::default()
        }
    }

    /// Entries.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub(crate) fn push(
        &mut self,
        op: Op,
        arg: u64,
        flag: u32,
        keys: &[ObjectKey],
        homes: Option<&[HostSlotId]>,
    ) {
        self.ops.push(op as u8);
        self.args.push(arg);
        self.flags.push(flag);
        self.starts.push(self.ns.len() as u64);
        for (i, k) in keys.iter().enumerate() {
            self.ns.push(k.namespace.id);
            self.version.push(k.namespace.version);
            self.page.push(k.page);
            self.layer.push(match k.layers {
                LayerGroup::All => -1,
                LayerGroup::Layer(l) => i32::from(l),
            });
            self.home.push(homes.map_or(-1, |h| i64::from(h[i].raw())));
        }
    }

    /// Entry `i`: (op, arg, flag, key range).
    pub fn entry(&self, i: usize) -> (Op, u64, u32, std::ops::Range<usize>) {
        let start = self.starts[i] as usize;
        let end = self
            .starts
            .get(i + 1)
            .map_or(self.ns.len(), |&s| s as usize);
        (
            Op::from_code(self.ops[i]).expect("recorded by push"),
            self.args[i],
            self.flags[i],
            start..end,
        )
    }

    /// Key `j`.
    pub fn key(&self, j: usize) -> ObjectKey {
        ObjectKey {
            namespace: Namespace {
                id: self.ns[j],
                version: self.version[j],
            },
            page: self.page[j],
            layers: if self.layer[j] < 0 {
                LayerGroup::All
            } else {
                LayerGroup::Layer(self.layer[j] as u16)
            },
        }
    }

    /// Home of key `j`, if any.
    pub fn home(&self, j: usize) -> Option<HostSlotId> {
        u32::try_from(self.home[j]).ok().map(HostSlotId::new)
    }

    /// Checks the arrays agree (for journals read back from a file).
    pub fn validate(&self) -> std::result::Result<(), String> {
        let n = self.ops.len();
        if self.args.len() != n || self.flags.len() != n || self.starts.len() != n {
            return Err("per-entry arrays differ in length".into());
        }
        let k = self.ns.len();
        if [
            self.version.len(),
            self.page.len(),
            self.layer.len(),
            self.home.len(),
        ]
        .iter()
        .any(|&l| l != k)
        {
            return Err("key arrays differ in length".into());
        }
        if self.ops.iter().any(|&c| Op::from_code(c).is_none()) {
            return Err("an unknown op code".into());
        }
        if self.starts.windows(2).any(|w| w[0] > w[1])
            || self.starts.last().is_some_and(|&s| s as usize > k)
        {
            return Err("key starts out of order or out of range".into());
        }
        Ok(())
    }
}
