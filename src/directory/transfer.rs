//! Transfer records and the plans the directory hands to a copy engine.

use crate::ids::{HostSlotId, SlotId, TransferId};
use smallvec::SmallVec;

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    /// Host to device.
    Load,
    /// Device to host (write-through backup).
    Backup,
}

impl TransferKind {
    /// Name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            TransferKind::Load => "load",
            TransferKind::Backup => "backup",
        }
    }
}

/// Where a transfer stands.
///
/// Exits: `InFlight -> Completed` (`complete` / `backup_complete`); `InFlight -> Failed`
/// (`fail`). A failed transfer's slots stay quarantined until `transfer_ended`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferState {
    /// Submitted or about to be; its destinations must not be read.
    InFlight,
    /// Every destination was written.
    Completed,
    /// It failed or was cancelled, for this reason.
    Failed(String),
}

/// The directory's record of one transfer.
#[derive(Debug, Clone)]
pub struct Transfer {
    /// Direction.
    pub kind: TransferKind,
    /// Objects it moves (slab indices; none is removed while the transfer is in flight).
    pub objects: Vec<usize>,
    /// State.
    pub state: TransferState,
    /// Pin handles that depend on it (started or joined it). The record is forgotten once it
    /// has finished and no handle refers to it.
    pub refs: u32,
    /// When the engine reported it submitted (ns since the directory started).
    pub submitted_ns: Option<u64>,
    /// When it completed or failed.
    pub finished_ns: Option<u64>,
}

/// A load the engine must run: host slot to device slot, pair by pair, as one transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadPlan {
    /// The transfer to `complete` or `fail` when the copy ends.
    pub transfer: TransferId,
    /// Source host slots.
    pub host_slots: Vec<HostSlotId>,
    /// Destination device slots, paired with `host_slots`.
    pub device_slots: Vec<SlotId>,
}

/// A backup the engine must run: device slot to host slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupPlan {
    /// The transfer to `backup_complete` or `fail`; `None` when every key was already backed
    /// up or being backed up.
    pub transfer: Option<TransferId>,
    /// Source device slots.
    pub device_slots: Vec<SlotId>,
    /// Destination host slots, paired with `device_slots`.
    pub host_slots: Vec<HostSlotId>,
}

/// Transfers a pin handle depends on; few per batch, so inline.
pub type TransferList = SmallVec<[TransferId; 4]>;
