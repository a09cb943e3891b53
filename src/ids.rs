//! Newtype ids. Each id is its own type so a page number can never be passed where a slot or a
//! transfer is expected; conversions are explicit, one function each.
//!
//! Ids an object hands out (transfers, pin handles, layer plans, L3 plans, prefix-tree node
//! generations) come from one process-wide [`serial`]: an id from one object is unknown to any
//! other, never the name of one of its own.

use std::sync::atomic::{AtomicU64, Ordering};

/// The next number of the process-wide serial.
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(1);

/// A number no other call in this process gets (from 1 up; 2^64 calls before it wraps).
#[inline]
pub fn serial() -> u64 {
    NEXT_SERIAL.fetch_add(1, Ordering::Relaxed)
}

/// Tags of [`IdSpace`]s.
static NEXT_TAG: AtomicU64 = AtomicU64::new(1);

/// Bits of an [`IdSpace`] id below its tag.
const LOCAL_BITS: u32 = 40;

/// The ids one object issues, when it must tell an id it issued (and has since forgotten)
/// from one it never issued: its own tag above, a counter below (2^40 ids an object, 2^24
/// objects before tags come back).
#[derive(Debug)]
pub struct IdSpace {
    tag: u64,
    next: u64,
}

impl Default for IdSpace {
    fn default() -> Self {
        let tag = NEXT_TAG.fetch_add(1, Ordering::Relaxed) & ((1 << (64 - LOCAL_BITS)) - 1);
        IdSpace { tag, next: 1 }
    }
}

impl IdSpace {
    /// A new id.
    pub fn issue(&mut self) -> u64 {
        let id = (self.tag << LOCAL_BITS) | (self.next & ((1 << LOCAL_BITS) - 1));
        self.next += 1;
        id
    }

    /// Whether `id` is one this space issued.
    pub fn issued(&self, id: u64) -> bool {
        let local = id & ((1 << LOCAL_BITS) - 1);
        id >> LOCAL_BITS == self.tag && local >= 1 && local < self.next
    }
}

/// A page index inside one tier's pool group. The same index is valid in every pool of the
/// group on that tier (sidecars mirror the anchor's page count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct PageId(u32);

impl PageId {
    /// Wraps a raw page index.
    #[inline]
    pub const fn new(raw: u32) -> Self {
        PageId(raw)
    }

    /// The raw page index.
    #[inline]
    pub const fn raw(self) -> u32 {
        self.0
    }

    /// The page index as a `usize`, for indexing buffers.
    #[inline]
    pub const fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for PageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

macro_rules! newtype_id {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(transparent)]
        pub struct $name($inner);

        impl $name {
            /// Wraps a raw value.
            #[inline]
            pub const fn new(raw: $inner) -> Self {
                $name(raw)
            }

            /// The raw value.
            #[inline]
            pub const fn raw(self) -> $inner {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

newtype_id!(
    /// A device slot: the device page that holds an object's copy on the GPU tier.
    SlotId(u32)
);
newtype_id!(
    /// A host slot: the pinned-host page that holds an object's backup.
    HostSlotId(u32)
);
newtype_id!(
    /// One copy operation between the tiers. Never reused, in any directory of the process.
    TransferId(u64)
);
newtype_id!(
    /// The receipt of one `resolve`: what `release` consumes. Never reused, in any directory of
    /// the process.
    PinHandleId(u64)
);

impl SlotId {
    /// The device page behind a slot.
    #[inline]
    pub const fn page(self) -> PageId {
        PageId::new(self.0)
    }

    /// The slot of a device page.
    #[inline]
    pub const fn of_page(p: PageId) -> Self {
        SlotId(p.raw())
    }
}

impl HostSlotId {
    /// The host page behind a slot.
    #[inline]
    pub const fn page(self) -> PageId {
        PageId::new(self.0)
    }

    /// The slot of a host page.
    #[inline]
    pub const fn of_page(p: PageId) -> Self {
        HostSlotId(p.raw())
    }
}
newtype_id!(
    /// A request the step scheduler serves; it is also the namespace of the request's objects.
    RequestId(u64)
);
newtype_id!(
    /// One planned layer of one step, as the step scheduler hands it out. Never reused, so a
    /// stale id misses instead of naming a later plan.
    LayerPlanId(u64)
);
