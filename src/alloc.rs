//! The page allocator of one tier.
//!
//! # What it owns
//! The free list of one pool group on one tier, and who holds each page handed out. Pages
//! `[0, reserve)` are never handed out (a device pool keeps page 0 as the padding target of
//! dummy writes); pages `[reserve, total)` are the usable capacity.
//!
//! # Holders (receipts)
//! A page handed out is held either by the allocator's owner itself ([`Holder::OWNER`]: a
//! cache's tree, a directory) or by one caller's allocation, named by the receipt that
//! allocation got ([`Holder::fresh`]). A call that names pages says whose it expects
//! ([`Expect`]); a page held by anyone else is refused before anything changes, so a page can
//! never get a second owner through a stale list or a second insert.
//!
//! # Invariants (checked by [`PageAllocator::validate`])
//! - `free + used == capacity` at every step;
//! - no page is on the free list twice, and no held page is on it at all.
//!
//! # Cost
//! `alloc(n)`, `free(pages)` and `claim(pages)` are O(1) per page: the free list is a stack
//! and the holder is one word per page. All are all-or-nothing: a failed call changes nothing.

use crate::error::{Error, Result};
use crate::ids::PageId;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Most pages one allocator manages (2^28: 17 billion tokens at 64-token pages). Its
/// bookkeeping is 8 bytes a page, allocated up front, so a mistyped size must be refused
/// rather than attempted.
pub const MAX_PAGES: u32 = 1 << 28;

/// The holder word of a free page.
const FREE: u32 = 0;

/// The next receipt, shared by every allocator: a receipt from one cache names no pages in
/// another. It wraps past `u32::MAX`, so a receipt could come back only after four billion
/// allocations.
static NEXT_RECEIPT: AtomicU32 = AtomicU32::new(2);

/// Names of allocators, for [`Stamp`]s.
static NEXT_ALLOCATOR: AtomicU64 = AtomicU64::new(0);

/// An allocator, and how many times caller pages had left their holders (freed, or claimed
/// by the owner) when the stamp was made. While an allocator's stamp is the same, every
/// allocation made before it still holds all its pages: [`PageAllocator::claim_fresh`] lets
/// the cache take such pages without reading their holders one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    allocator: u64,
    departures: u64,
}

/// Who holds a page that is handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Holder(NonZeroU32);

impl Holder {
    /// The allocator's owner itself (the cache's tree, its copies in flight, a directory).
    pub const OWNER: Holder = Holder(NonZeroU32::MIN);

    /// The raw holder word (1 for the owner, a receipt from 2 up).
    pub fn raw(self) -> u32 {
        self.0.get()
    }

    /// A receipt for a new caller allocation (see [`PageAllocator::alloc_as`]), unique
    /// among the allocations alive in this process.
    pub fn fresh() -> Holder {
        loop {
            let r = NEXT_RECEIPT.fetch_add(1, Ordering::Relaxed);
            if r > Holder::OWNER.raw() {
                return Holder(NonZeroU32::new(r).expect("above 1"));
            }
        }
    }
}

/// The holders a call accepts for the pages it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Exactly this holder: the allocation the caller names by its receipt.
    Holder(Holder),
    /// Any caller's allocation, not the owner (a bare page list carries no receipt).
    AnyCaller,
    /// No page at all (a match that allocated nothing names only pages the tree already
    /// holds at their positions).
    Nobody,
}

impl Expect {
    #[inline]
    fn accepts(self, held: u32) -> bool {
        match self {
            Expect::Holder(h) => held == h.raw(),
            Expect::AnyCaller => held > Holder::OWNER.raw(),
            Expect::Nobody => false,
        }
    }

    fn allowed(self) -> String {
        match self {
            Expect::Holder(h) if h == Holder::OWNER => "pages the cache itself holds".into(),
            Expect::Holder(h) => format!(
                "pages of allocation {} (the PageAllocation or PrefixMatch given), not yet \
                 inserted or freed",
                h.raw()
            ),
            Expect::AnyCaller => "pages from alloc_device (or match_prefix(alloc=True)) not yet \
                                  inserted or freed, or the matched path's own pages"
                .into(),
            Expect::Nobody => "the matched path's own pages (this match allocated no pages)".into(),
        }
    }
}

/// Whether `p` is among the first `done` pages of `parts` (a page named twice in one call).
fn named(parts: &[&[PageId]], done: usize, p: PageId) -> bool {
    parts
        .iter()
        .flat_map(|part| part.iter())
        .take(done)
        .any(|&q| q == p)
}

fn held_by(held: u32) -> String {
    match held {
        FREE => "no one (it is free)".into(),
        1 => "the cache itself".into(),
        r => format!("another allocation (receipt {r})"),
    }
}

/// Fixed-capacity, all-or-nothing page allocator.
#[derive(Debug)]
pub struct PageAllocator {
    total: u32,
    reserve: u32,
    /// Free pages; the next page handed out is the last one.
    free: Vec<PageId>,
    /// `holder[p]`: [`FREE`], or the raw [`Holder`] of page `p`.
    holder: Vec<u32>,
    /// Unique to this allocator (a clone gets its own).
    id: u64,
    /// Calls so far that moved caller pages off their holders (see [`Stamp`]).
    departures: u64,
}

impl Clone for PageAllocator {
    fn clone(&self) -> Self {
        PageAllocator {
            total: self.total,
            reserve: self.reserve,
            free: self.free.clone(),
            holder: self.holder.clone(),
            id: NEXT_ALLOCATOR.fetch_add(1, Ordering::Relaxed),
            departures: self.departures,
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
            holder: vec![FREE; total as usize],
            id: NEXT_ALLOCATOR.fetch_add(1, Ordering::Relaxed),
            departures: 0,
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
        self.held(page) != FREE
    }

    /// Who holds `page` now (`None`: free, reserved or out of range).
    pub fn holder(&self, page: PageId) -> Option<Holder> {
        NonZeroU32::new(self.held(page)).map(Holder)
    }

    #[inline]
    fn held(&self, page: PageId) -> u32 {
        self.holder.get(page.index()).copied().unwrap_or(FREE)
    }

    /// This allocator now (see [`Stamp`]).
    pub fn stamp(&self) -> Stamp {
        Stamp {
            allocator: self.id,
            departures: self.departures,
        }
    }

    /// The error for `page`, which `expect` does not accept under `field`.
    pub fn not_held(&self, field: &str, page: PageId, expect: Expect) -> Error {
        let held_by = if page.raw() < self.reserve || page.raw() >= self.total {
            format!(
                "no one: the cache's pages are {} <= page < {}",
                self.reserve, self.total
            )
        } else {
            held_by(self.held(page))
        };
        Error::NotHeld {
            field: field.into(),
            page: page.raw(),
            held_by,
            allowed: expect.allowed(),
        }
    }

    /// Allocates `n` pages for the owner, or none: [`Error::OutOfPages`] when fewer than `n`
    /// are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<PageId>> {
        // Checked before reserving: `n` may come straight from a caller.
        let mut out = Vec::with_capacity(n.min(self.free.len()));
        self.alloc_into(n, &mut out)?;
        Ok(out)
    }

    /// One page for the owner, or `None` when none is free.
    #[inline]
    pub fn alloc_one(&mut self) -> Option<PageId> {
        let p = self.free.pop()?;
        self.holder[p.index()] = Holder::OWNER.raw();
        Some(p)
    }

    /// Like [`Self::alloc`], appending to `out` (which is left untouched on error).
    pub fn alloc_into(&mut self, n: usize, out: &mut Vec<PageId>) -> Result<()> {
        self.alloc_as(n, out, Holder::OWNER)
    }

    /// Like [`Self::alloc_into`], the pages held by `holder`.
    pub fn alloc_as(&mut self, n: usize, out: &mut Vec<PageId>, holder: Holder) -> Result<()> {
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
        let marks = &mut self.holder[..];
        for &p in taken {
            marks[p.index()] = holder.raw();
        }
        self.free.truncate(start);
        Ok(())
    }

    /// Returns the owner's `pages` to the free list, or none of them: a page outside the
    /// usable range is [`Error::NotOwned`], a free page (or one listed twice)
    /// [`Error::DoubleFree`], a caller's page [`Error::NotHeld`].
    pub fn free(&mut self, pages: &[PageId]) -> Result<()> {
        self.free_held(pages, Expect::Holder(Holder::OWNER), "pages")
    }

    /// [`Self::free`] of pages `expect` accepts (named `field` in an error).
    pub fn free_held(&mut self, pages: &[PageId], expect: Expect, field: &str) -> Result<()> {
        let (lo, hi) = (self.reserve, self.total);
        self.stage(&[pages], FREE, expect, |me, p, twice| {
            let held = me.held(p);
            if p.raw() < lo || p.raw() >= hi {
                Error::NotOwned {
                    page: p.raw(),
                    lo,
                    hi,
                }
            } else if held == FREE || twice {
                Error::DoubleFree { page: p.raw() }
            } else {
                me.not_held(field, p, expect)
            }
        })?;
        if expect != Expect::Holder(Holder::OWNER) {
            self.departures += 1;
        }
        self.free.extend_from_slice(pages);
        Ok(())
    }

    /// Gives the owner the pages of `parts` (a caller's pages joining the cache), all or
    /// nothing: each must be held as `expect` says, and none may be named twice; else
    /// [`Error::NotHeld`] naming `field`, and nothing changes.
    pub fn claim(&mut self, parts: &[&[PageId]], expect: Expect, field: &str) -> Result<()> {
        // The owner has nothing to claim from itself (and a page it holds, named twice,
        // would pass unseen): it is refused as from nobody.
        let expect = match expect {
            Expect::Holder(Holder::OWNER) => Expect::Nobody,
            e => e,
        };
        self.stage(parts, Holder::OWNER.raw(), expect, |me, p, twice| {
            let mut e = me.not_held(field, p, expect);
            if let (true, Error::NotHeld { held_by, .. }) = (twice, &mut e) {
                *held_by = "this same call: the page is named twice".into();
            }
            e
        })?;
        self.departures += 1;
        Ok(())
    }

    /// [`Self::claim`] of `checked` and `fresh` for allocation `r`, where `fresh` are pages `r`
    /// was given (distinct, none in `checked`) and `stamp` was read after that allocation.
    /// While the stamp still holds, `r` holds them all: they are taken without reading their
    /// holders (a page-1 prompt's thousands of pages), and only `checked` is read.
    pub fn claim_fresh(
        &mut self,
        checked: &[PageId],
        fresh: &[PageId],
        r: Holder,
        stamp: Stamp,
        field: &str,
    ) -> Result<()> {
        if stamp != self.stamp() {
            return self.claim(&[checked, fresh], Expect::Holder(r), field);
        }
        self.claim(&[checked], Expect::Holder(r), field)?;
        debug_assert!(
            fresh.iter().all(|&p| self.held(p) == r.raw()),
            "not all r's"
        );
        let marks = &mut self.holder[..];
        for &p in fresh {
            marks[p.index()] = Holder::OWNER.raw();
        }
        Ok(())
    }

    /// Sets the holder of every page of `parts` to `to`, all or nothing. Every page must be
    /// held as `expect` says, and none named twice; else `refuse` makes the error for the
    /// first page refused (with the holders as they were; `true` for a page named twice), and
    /// nothing changes.
    fn stage(
        &mut self,
        parts: &[&[PageId]],
        to: u32,
        expect: Expect,
        refuse: impl Fn(&Self, PageId, bool) -> Error,
    ) -> Result<()> {
        if let Expect::Holder(h) = expect {
            // One accepted holder: one pass, undone by writing it back (a page named twice
            // meets `to` the second time).
            let h = h.raw();
            let mut done = 0usize;
            for part in parts {
                for &p in *part {
                    let was = self.held(p);
                    if was != h {
                        self.undo(parts, done, |_| h);
                        return Err(refuse(self, p, named(parts, done, p)));
                    }
                    self.holder[p.index()] = to;
                    done += 1;
                }
            }
            return Ok(());
        }
        // Holders of many kinds: each page's own is kept to undo.
        let mut before: Vec<u32> = Vec::new();
        for part in parts {
            for &p in *part {
                let was = self.held(p);
                if !expect.accepts(was) {
                    let done = before.len();
                    self.undo(parts, done, |k| before[k]);
                    return Err(refuse(self, p, named(parts, done, p)));
                }
                self.holder[p.index()] = to;
                before.push(was);
            }
        }
        Ok(())
    }

    /// Gives the first `done` pages of `parts` the holders `was(k)` back, last first (a page
    /// changed twice ends with its first holder).
    fn undo(&mut self, parts: &[&[PageId]], done: usize, was: impl Fn(usize) -> u32) {
        let all: Vec<PageId> = parts
            .iter()
            .flat_map(|part| part.iter().copied())
            .take(done)
            .collect();
        for (k, &p) in all.iter().enumerate().rev() {
            self.holder[p.index()] = was(k);
        }
    }

    /// Gives held `pages` to `to` without freeing them or reading their holders: pages a
    /// cache evicted and hands straight to a new allocation, or pages of its own caller's
    /// allocation it keeps (the joined mode's host pages). The caller vouches for them.
    pub fn hand_over(&mut self, pages: &[PageId], to: Holder) {
        debug_assert!(
            pages.iter().all(|&p| self.held(p) != FREE),
            "a free page handed over"
        );
        let marks = &mut self.holder[..];
        for &p in pages {
            marks[p.index()] = to.raw();
        }
        if to == Holder::OWNER {
            // Caller pages left their holder: stamps taken before no longer vouch for them.
            self.departures += 1;
        }
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
            if self.holder[p.index()] != FREE {
                return Err(format!("page {p} is both free and held"));
            }
        }
        let used = self.holder.iter().filter(|&&h| h != FREE).count();
        if self.holder[..self.reserve as usize]
            .iter()
            .any(|&h| h != FREE)
        {
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

    fn raw(pages: &[PageId]) -> Vec<u32> {
        pages.iter().map(|p| p.raw()).collect()
    }

    #[test]
    fn a_receipt_names_its_pages_only() {
        let mut a = PageAllocator::new(16, 1).unwrap();
        let (r1, r2) = (Holder::fresh(), Holder::fresh());
        assert_ne!(r1, r2);
        let (mut p1, mut p2) = (Vec::new(), Vec::new());
        a.alloc_as(3, &mut p1, r1).unwrap();
        a.alloc_as(3, &mut p2, r2).unwrap();
        let tree = a.alloc(2).unwrap();
        assert_eq!(a.holder(p1[0]), Some(r1));
        assert_eq!(a.holder(tree[0]), Some(Holder::OWNER));
        // Another allocation's pages, the owner's, or a free page: refused, nothing changes.
        let free = PageId::new(15);
        for (bad, held) in [
            (p2[1], "receipt"),
            (tree[0], "cache itself"),
            (free, "free"),
        ] {
            let mixed = [p1[0], p1[1], bad];
            match a.claim(&[&mixed], Expect::Holder(r1), "device_pages") {
                Err(Error::NotHeld { page, held_by, .. }) => {
                    assert_eq!(page, bad.raw());
                    assert!(held_by.contains(held), "{held_by}");
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(a.holder(p1[0]), Some(r1), "rolled back");
            a.validate().unwrap();
        }
        // Named twice: the second sight finds the owner.
        assert!(a
            .claim(&[&p1[..2], &p1[1..2]], Expect::Holder(r1), "device_pages")
            .is_err());
        assert!(p1.iter().all(|&p| a.holder(p) == Some(r1)));
        a.claim(&[&p1[..1], &p1[1..]], Expect::Holder(r1), "device_pages")
            .unwrap();
        assert!(p1.iter().all(|&p| a.holder(p) == Some(Holder::OWNER)));
        // A bare list accepts any allocation's pages, not the owner's; a refusal restores each
        // page's own holder.
        let mixed = [p2[0], tree[1], p2[2]];
        assert!(a
            .claim(&[&mixed], Expect::AnyCaller, "device_pages")
            .is_err());
        assert_eq!(a.holder(p2[0]), Some(r2));
        assert!(a.free_held(&p1, Expect::AnyCaller, "pages").is_err());
        assert!(a.free_held(&p2, Expect::Holder(r1), "pages").is_err());
        assert_eq!(raw(&p2).len(), 3);
        a.free_held(&p2, Expect::Holder(r2), "pages").unwrap();
        assert_eq!(a.free(&p2), Err(Error::DoubleFree { page: p2[0].raw() }));
        // Evicted pages handed on to a new allocation.
        let r3 = Holder::fresh();
        a.hand_over(&tree, r3);
        assert!(a.free(&tree).is_err(), "no longer the owner's");
        a.free_held(&tree, Expect::Holder(r3), "pages").unwrap();
        a.free(&p1).unwrap();
        assert_eq!(a.used_count(), 0);
        a.validate().unwrap();
    }

    #[test]
    fn expect_nobody_accepts_no_page() {
        let mut a = PageAllocator::new(4, 0).unwrap();
        let r = Holder::fresh();
        let mut p = Vec::new();
        a.alloc_as(1, &mut p, r).unwrap();
        assert!(a.claim(&[&p], Expect::Nobody, "device_pages").is_err());
        a.claim(&[&[]], Expect::Nobody, "device_pages").unwrap();
        assert_eq!(a.holder(p[0]), Some(r));
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
