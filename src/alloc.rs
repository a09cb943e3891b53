//! The page allocator of one tier.
//!
//! # What it owns
//! The free list of one pool group on one tier. Pages `[0, reserve)` are never handed out
//! (a device pool keeps page 0 as the padding target of dummy writes); pages
//! `[reserve, total)` are the usable capacity.
//!
//! # Invariants (checked by [`PageAllocator::validate`])
//! - `free + used == capacity` at every step;
//! - no page is on the free list twice, and no allocated page is on it at all.
//!
//! # Cost
//! `alloc(n)` and `free(pages)` are O(1) per page: the free list is a stack and the ownership
//! check is one flag per page. Both are all-or-nothing: a failed call changes nothing.

use crate::error::{Error, Result};
use crate::ids::PageId;
use std::sync::atomic::{AtomicU64, Ordering};

/// Names of allocators, for [`FreeStamp`]s.
static NEXT_ALLOCATOR: AtomicU64 = AtomicU64::new(0);

/// An allocator and how many pages it had taken back (or seen handed on) when the stamp was
/// made. Pages only stop being allocated through [`PageAllocator::free`], so pages that were
/// all allocated under a stamp still are, with the same owners, while the allocator's stamp is
/// the same: [`PageAllocator::unchanged_since`] lets a caller skip checking them one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeStamp {
    allocator: u64,
    freed: u64,
}

/// Most pages one allocator manages (2^28: 17 billion tokens at 64-token pages). Its
/// bookkeeping is 5 bytes a page, allocated up front, so a mistyped size must be refused
/// rather than attempted.
pub const MAX_PAGES: u32 = 1 << 28;

/// Fixed-capacity, all-or-nothing page allocator.
#[derive(Debug)]
pub struct PageAllocator {
    total: u32,
    reserve: u32,
    /// Free pages; the next page handed out is the last one.
    free: Vec<PageId>,
    /// `allocated[p]` is true while page `p` is handed out.
    allocated: Vec<bool>,
    /// Unique to this allocator (a clone gets its own).
    id: u64,
    /// Pages taken back by `free` or handed on (`hand_on`) so far.
    freed: u64,
}

impl Clone for PageAllocator {
    fn clone(&self) -> Self {
        PageAllocator {
            total: self.total,
            reserve: self.reserve,
            free: self.free.clone(),
            allocated: self.allocated.clone(),
            id: NEXT_ALLOCATOR.fetch_add(1, Ordering::Relaxed),
            freed: self.freed,
        }
    }
}

impl PageAllocator {
    /// An allocator over pages `[0, total)` of which `[0, reserve)` are reserved.
    /// `reserve` must leave at least one usable page.
    pub fn new(total: u32, reserve: u32) -> Result<Self> {
        if total == 0 || total > MAX_PAGES {
            return Err(Error::config(
                "pages",
                total,
                format!("1 <= pages <= {MAX_PAGES}"),
            ));
        }
        if reserve >= total {
            return Err(Error::config(
                "reserve_pages",
                reserve,
                format!("0 <= reserve_pages < pages ({total}), leaving one usable page"),
            ));
        }
        // Reversed so that pages come out in ascending order: contiguous pages make
        // contiguous copy segments.
        let free = (reserve..total).rev().map(PageId::new).collect();
        Ok(PageAllocator {
            total,
            reserve,
            free,
            allocated: vec![false; total as usize],
            id: NEXT_ALLOCATOR.fetch_add(1, Ordering::Relaxed),
            freed: 0,
        })
    }

    /// Usable pages (reserve excluded).
    pub fn capacity(&self) -> usize {
        (self.total - self.reserve) as usize
    }

    /// All pages of the buffer, reserve included.
    pub fn total_pages(&self) -> u32 {
        self.total
    }

    /// Reserved pages at the front of the buffer.
    pub fn reserve_pages(&self) -> u32 {
        self.reserve
    }

    /// Pages free now.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Pages handed out now.
    pub fn used_count(&self) -> usize {
        self.capacity() - self.free.len()
    }

    /// Whether `page` is handed out now.
    pub fn is_allocated(&self, page: PageId) -> bool {
        self.allocated.get(page.index()).copied().unwrap_or(false)
    }

    /// This allocator now (see [`FreeStamp`]).
    pub fn stamp(&self) -> FreeStamp {
        FreeStamp {
            allocator: self.id,
            freed: self.freed,
        }
    }

    /// Whether `stamp` is this allocator's and no page came back since it was made.
    pub fn unchanged_since(&self, stamp: FreeStamp) -> bool {
        stamp == self.stamp()
    }

    /// The first of `pages` that is not allocated here, if any (the callers' check of pages
    /// handed back): all are tested first without an early exit, the culprit looked for only
    /// when there is one.
    pub fn first_unallocated(&self, pages: &[PageId]) -> Option<PageId> {
        if pages.iter().fold(true, |ok, &p| ok & self.is_allocated(p)) {
            return None;
        }
        pages.iter().copied().find(|&p| !self.is_allocated(p))
    }

    /// Allocates `n` pages, or none: [`Error::OutOfPages`] when fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>> {
        // Checked before reserving: `n` may come straight from a caller.
        let mut out = Vec::with_capacity(n.min(self.free.len()));
        self.alloc_into(n, &mut out)?;
        Ok(out)
    }

    /// One page, or `None` when none is free.
    #[inline]
    pub fn alloc_one(&mut self) -> Option<PageId> {
        let p = self.free.pop()?;
        self.allocated[p.index()] = true;
        Some(p)
    }

    /// Like [`Self::alloc`], appending to `out` (which is left untouched on error).
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<PageId>) -> Result<()> {
        if n > self.free.len() {
            return Err(Error::OutOfPages {
                requested: n,
                free: self.free.len(),
                capacity: self.capacity(),
            });
        }
        let start = self.free.len() - n;
        // Two loops, not one: the copy vectorizes, and the marks carry no dependency from one
        // page to the next (a push per page reloads and stores the length each time).
        let taken = &self.free[start..];
        out.extend(taken.iter().rev());
        for &p in taken {
            self.allocated[p.index()] = true;
        }
        self.free.truncate(start);
        Ok(())
    }

    /// Returns `pages` to the free list, or none of them: a page outside the usable range is
    /// [`Error::NotOwned`], a page not allocated (or listed twice) is [`Error::DoubleFree`].
    pub fn free(&mut self, pages: &[PageId]) -> Result<()> {
        // Stage: clear the flags, undoing them if any page is refused.
        for (i, &p) in pages.iter().enumerate() {
            let refused = if p.raw() < self.reserve || p.raw() >= self.total {
                Some(Error::NotOwned {
                    page: p.raw(),
                    lo: self.reserve,
                    hi: self.total,
                })
            } else if !self.allocated[p.index()] {
                Some(Error::DoubleFree { page: p.raw() })
            } else {
                None
            };
            if let Some(err) = refused {
                for &q in &pages[..i] {
                    self.allocated[q.index()] = true;
                }
                return Err(err);
            }
            self.allocated[p.index()] = false;
        }
        // Commit.
        self.free.extend_from_slice(pages);
        self.freed += pages.len() as u64;
        Ok(())
    }

    /// Records that allocated `pages` changed hands without coming back (pages a cache evicted
    /// and gives straight to a new owner): they stay allocated, but a [`FreeStamp`] taken
    /// before no longer vouches for them.
    pub fn hand_on(&mut self, pages: &[PageId]) {
        debug_assert!(self.first_unallocated(pages).is_none());
        self.freed += pages.len() as u64;
    }

    /// Checks the invariants; returns a description of the first one broken.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.total as usize];
        for &p in &self.free {
            if p.raw() < self.reserve || p.raw() >= self.total {
                return Err(format!("free list holds page {p} outside the usable range"));
            }
            if std::mem::replace(&mut seen[p.index()], true) {
                return Err(format!("page {p} is on the free list twice"));
            }
            if self.allocated[p.index()] {
                return Err(format!("page {p} is both free and allocated"));
            }
        }
        let used = self.allocated.iter().filter(|&&a| a).count();
        if self.allocated[..self.reserve as usize].iter().any(|&a| a) {
            return Err("a reserved page is allocated".into());
        }
        if used + self.free.len() != self.capacity() {
            return Err(format!(
                "free {} + used {used} != capacity {}",
                self.free.len(),
                self.capacity()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "tests/alloc_proptest.rs"]
mod alloc_proptest;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_holds_until_a_page_comes_back() {
        let mut a = PageAllocator::new(8, 1).unwrap();
        let s = a.stamp();
        let got = a.alloc(3).unwrap();
        a.alloc_one().unwrap();
        assert!(a.unchanged_since(s), "allocating takes nothing back");
        assert!(a.free(&[PageId::new(0)]).is_err());
        assert!(a.unchanged_since(s), "a refused free changes nothing");
        a.free(&got[..1]).unwrap();
        assert!(!a.unchanged_since(s));
        let other = PageAllocator::new(8, 1).unwrap();
        assert!(
            !other.unchanged_since(a.stamp()),
            "another allocator's stamp"
        );
        assert!(
            !a.clone().unchanged_since(a.stamp()),
            "a clone is another allocator"
        );
    }

    #[test]
    fn all_or_nothing() {
        let mut a = PageAllocator::new(8, 1).unwrap();
        let got = a.alloc(5).unwrap();
        assert_eq!(
            got.iter().map(|p| p.raw()).collect::<Vec<_>>(),
            vec![1, 2, 3, 4, 5]
        );
        assert_eq!(
            a.alloc(3),
            Err(Error::OutOfPages {
                requested: 3,
                free: 2,
                capacity: 7
            })
        );
        assert_eq!(a.free_count(), 2);
        a.validate().unwrap();
    }

    #[test]
    fn double_free_and_foreign_pages_change_nothing() {
        let mut a = PageAllocator::new(8, 1).unwrap();
        let got = a.alloc(3).unwrap();
        assert_eq!(
            a.free(&[got[0], PageId::new(0)]),
            Err(Error::NotOwned {
                page: 0,
                lo: 1,
                hi: 8
            })
        );
        assert_eq!(
            a.free(&[got[0], got[0]]),
            Err(Error::DoubleFree { page: got[0].raw() })
        );
        assert!(a.free(&[PageId::new(99)]).is_err());
        assert_eq!(a.used_count(), 3);
        a.validate().unwrap();
        a.free(&got).unwrap();
        assert_eq!(
            a.free(&got[..1]),
            Err(Error::DoubleFree { page: got[0].raw() })
        );
        a.validate().unwrap();
    }

    #[test]
    fn reserve_must_leave_a_page() {
        assert!(PageAllocator::new(4, 4).is_err());
        assert!(PageAllocator::new(0, 0).is_err());
        assert_eq!(PageAllocator::new(4, 3).unwrap().capacity(), 1);
    }
}
