//! The read bitmap of the last closed step (a bit per mirror entry), shared with the
//! directory, whose evictions give what the device read a second chance. Two buffers take
//! turns: the one published two steps ago is filled next, once the directory has let it go.

use std::sync::Arc;

#[derive(Debug)]
pub(crate) struct ReadBitmaps {
    last: Arc<Vec<u32>>,
    retired: Option<Arc<Vec<u32>>>,
    words: usize,
}

impl ReadBitmaps {
    /// Bitmaps of `entries` bits, none set.
    pub(crate) fn new(entries: usize) -> Self {
        let words = entries.div_ceil(32);
        ReadBitmaps {
            last: Arc::new(vec![0; words]),
            retired: None,
            words,
        }
    }

    /// A buffer to fill for the next close (its contents are stale): the bitmap published
    /// two closes ago when nobody holds it any more, else a new one.
    pub(crate) fn spare(&mut self) -> Vec<u32> {
        match self.retired.take().map(Arc::try_unwrap) {
            Some(Ok(v)) if v.len() == self.words => v,
            _ => vec![0; self.words],
        }
    }

    /// Makes `bits` the last closed step's.
    pub(crate) fn publish(&mut self, bits: Vec<u32>) {
        debug_assert_eq!(bits.len(), self.words);
        self.retired = Some(std::mem::replace(&mut self.last, Arc::new(bits)));
    }

    /// The last closed step's bitmap, to share.
    pub(crate) fn last(&self) -> Arc<Vec<u32>> {
        self.last.clone()
    }

    /// Whether the last closed step read entry `e`.
    #[inline]
    pub(crate) fn was_read(&self, e: usize) -> bool {
        self.last
            .get(e / 32)
            .is_some_and(|w| w >> (e % 32) & 1 == 1)
    }

    /// Fetches [`Self::was_read`]'s word for entry `e` into the cache (a hint).
    #[inline]
    pub(crate) fn prefetch(&self, e: usize) {
        crate::prefetch::prefetch(self.last.as_ptr().wrapping_add(e / 32));
    }
}
