//! Per-object state. Each enum's variants carry their data, and each doc names every exit;
//! the transitions themselves live in `core.rs`, one function each.

use super::key::ObjectKey;
use crate::ids::{HostSlotId, SlotId, TransferId};
use std::fmt;

/// Where an object stands on the device tier.
///
/// Exits: `Absent -> Loading` (`resolve` starts a load); `Loading -> Ready` (`complete`);
/// `Loading -> Absent` (`fail`, the slot is quarantined until the transfer ends);
/// `Ready -> Absent` (`evict`, unpinned with a Ready host copy; or the namespace is dropped).
/// `allocate` creates an object directly in `Ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceState {
    /// No device copy.
    Absent,
    /// A load into `slot` is in flight as `transfer`; the slot must not be read yet.
    Loading {
        /// The destination slot.
        slot: SlotId,
        /// The load.
        transfer: TransferId,
    },
    /// The device copy in `slot` is readable.
    Ready {
        /// The slot.
        slot: SlotId,
    },
}

/// Where an object stands on the host tier.
///
/// Exits: `None -> Writing` (`backup`); `Writing -> Ready` (`backup_complete`);
/// `Writing -> None` (`fail` on the backup; the host slot is quarantined until it ends);
/// `Ready -> freed` only when the namespace is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostState {
    /// No host copy.
    None,
    /// A backup into `slot` is in flight as `transfer`: not yet a hit source.
    Writing {
        /// The destination host slot.
        slot: HostSlotId,
        /// The backup.
        transfer: TransferId,
    },
    /// The host copy in `slot` is complete.
    Ready {
        /// The host slot.
        slot: HostSlotId,
    },
}

/// One tracked object's state: what pins, unpins, settles, evictions and resolves read and
/// write, in exactly one 64-byte cache line (aligned to it). Its identity, which only the
/// hint check and rarer paths read, lives apart ([`Identity`], the arena's column): the
/// 96-byte object of before held both, so that half the objects' state straddled two lines,
/// and in a directory of millions of objects each line is a cache miss.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Object {
    /// Device tier.
    pub device: DeviceState,
    /// Host tier.
    pub host: HostState,
    /// The sequence of its live LRU entry; 0 when it is not in the LRU list.
    pub lru_mark: u64,
    /// Logical time of the last access (resolve, release, or becoming evictable).
    pub stamp: u64,
    /// Batch number of the last batch that saw it: dedups keys inside one batch in O(1).
    pub epoch: u32,
    /// Its arena slot's generation when it was created: an [`ObjectHint`] names it only
    /// while this matches (the slot may hold another object later).
    pub generation: u32,
    /// Outstanding pins (one per pin handle that holds it, plus `held`).
    pub pins: u32,
    /// Pins held outside any handle ([`crate::directory::Directory::hold`]): the step
    /// scheduler's kept selections.
    pub held: u16,
    /// Its namespace was dropped: removed once unpinned and no transfer touches it.
    pub dropped: bool,
    /// Its last load failed; the next load counts as a retry.
    pub load_failed: bool,
}

impl super::arena::Versioned for Object {
    fn generation(&self) -> u32 {
        self.generation
    }
}

/// Where an object lives in the directory's arena, as of when the hint was taken: its slot
/// and the slot's generation then. A resolve given a hint reads only the object's state line
/// to check it (the generation must still match, so a slot reused by another object since is
/// refused and the key is looked up instead); checking the key itself read a second line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectHint {
    index: u32,
    generation: u32,
}

impl ObjectHint {
    /// No hint: the key is looked up.
    pub const NONE: ObjectHint = ObjectHint {
        index: u32::MAX,
        generation: 0,
    };

    /// The object at arena slot `index`, created under `generation`.
    pub const fn new(index: u32, generation: u32) -> Self {
        ObjectHint { index, generation }
    }

    /// Its arena slot (`u32::MAX` for [`Self::NONE`]).
    pub const fn index(self) -> u32 {
        self.index
    }

    /// The slot's generation it names.
    pub const fn generation(self) -> u32 {
        self.generation
    }
}

/// An object's identity and fixed place, beside its [`Object`] state (32 bytes, aligned, so
/// one cache line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, align(32))]
pub struct Identity {
    /// Its key.
    pub key: ObjectKey,
    /// Its host copy's fixed place, owned outside the directory (a prefix-cache host page's
    /// layer): backed up there, never taken from or freed to the directory's host allocator.
    pub home: Option<HostSlotId>,
}

impl Object {
    /// The device slot it occupies (Loading or Ready), if any.
    pub fn device_slot(&self) -> Option<SlotId> {
        match self.device {
            DeviceState::Absent => None,
            DeviceState::Loading { slot, .. } | DeviceState::Ready { slot } => Some(slot),
        }
    }

    /// The host slot it occupies (Writing or Ready), if any.
    pub fn host_slot(&self) -> Option<HostSlotId> {
        match self.host {
            HostState::None => None,
            HostState::Writing { slot, .. } | HostState::Ready { slot } => Some(slot),
        }
    }

    /// Whether the LRU list must hold it: the exact condition for eviction.
    pub fn evictable(&self) -> bool {
        matches!(self.device, DeviceState::Ready { .. })
            && matches!(self.host, HostState::Ready { .. })
            && self.pins == 0
            && !self.dropped
    }

    /// Whether nothing refers to it any more, so a dropped object can be removed.
    pub fn reapable(&self) -> bool {
        self.dropped
            && self.pins == 0
            && !matches!(self.device, DeviceState::Loading { .. })
            && !matches!(self.host, HostState::Writing { .. })
    }
}

impl fmt::Display for DeviceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceState::Absent => write!(f, "device Absent"),
            DeviceState::Loading { slot, transfer } => {
                write!(f, "device Loading into slot {slot} (transfer {transfer})")
            }
            DeviceState::Ready { slot } => write!(f, "device Ready in slot {slot}"),
        }
    }
}

impl fmt::Display for HostState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostState::None => write!(f, "host None"),
            HostState::Writing { slot, transfer } => {
                write!(f, "host Writing into slot {slot} (transfer {transfer})")
            }
            HostState::Ready { slot } => write!(f, "host Ready in slot {slot}"),
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::{Identity, Object};

    #[test]
    fn an_object_fills_one_line_and_its_identity_half_of_one() {
        assert_eq!(std::mem::size_of::<Object>(), 64);
        assert_eq!(std::mem::size_of::<Option<Object>>(), 64);
        assert_eq!(std::mem::align_of::<Option<Object>>(), 64);
        assert_eq!(std::mem::size_of::<Identity>(), 32);
        assert_eq!(std::mem::align_of::<Identity>(), 32);
    }
}
