//! Newtype ids. Each id is its own type so a page number can never be passed where a slot or a
//! transfer is expected; conversions are explicit, one function each.

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
    /// One copy operation between the tiers. Never reused.
    TransferId(u64)
);
newtype_id!(
    /// The receipt of one `resolve`: what `release` consumes. Never reused.
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
