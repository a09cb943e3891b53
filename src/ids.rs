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
