//! Selections as the step scheduler takes them: a padded `[B, K]` array whose entries each name
//! `unit` consecutive tokens (block mode: a block id, `unit` = the selection block size; token
//! mode: a token index, `unit` = 1), mapped to pages and deduplicated per request.
//!
//! The selection block size and the page size are separate: one must divide the other, so an
//! entry covers whole pages (`unit >= page_size`) or lies inside one page.

use crate::error::{Error, Result};

/// How selection entries map onto pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelectionUnit {
    unit: u32,
    page_size: u32,
}

impl SelectionUnit {
    /// `unit` tokens per entry over pages of `page_size` tokens.
    pub fn new(unit: u32, page_size: u32) -> Result<Self> {
        if unit == 0 || !(unit % page_size == 0 || page_size % unit == 0) {
            return Err(Error::config(
                "unit",
                unit,
                format!(
                    "tokens per selection entry that divide or are a multiple of the page size \
                     {page_size} (1 for token mode)"
                ),
            ));
        }
        Ok(SelectionUnit { unit, page_size })
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Tokens per entry.
    pub fn unit(&self) -> u32 {
        self.unit
    }

    /// Slot-table cells per entry: the pages one entry covers.
    pub fn pages_per_entry(&self) -> usize {
        (self.unit / self.page_size).max(1) as usize
    }

    /// Entries a request of `len` tokens can name (`0 <= entry < entries(len)`).
    pub fn entries(&self, len: u64) -> u64 {
        len.div_ceil(u64::from(self.unit))
    }

    /// The pages of `entry` for a request of `len` tokens, with the selected tokens each
    /// holds: `out[i]` is page `i` of the entry, or `None` where it lies past the request's
    /// last token. The caller checked `entry < entries(len)`.
    pub fn entry_pages(&self, entry: u64, len: u64, out: &mut [Option<(u32, u32)>]) {
        let (unit, ps) = (u64::from(self.unit), u64::from(self.page_size));
        let lo = entry * unit;
        let hi = (lo + unit).min(len);
        for (i, cell) in out.iter_mut().enumerate() {
            let page = lo / ps + i as u64;
            let (plo, phi) = (page * ps, page * ps + ps);
            *cell = (plo < hi).then(|| (page as u32, (hi.min(phi) - lo.max(plo)) as u32));
        }
    }
}

/// Dedups pages inside one row in O(1) per entry: a stamp per page says whether the current
/// row already named it, and where its key went.
#[derive(Debug, Default)]
pub struct RowDedup {
    stamp: Vec<u32>,
    index: Vec<u32>,
    row: u32,
}

impl RowDedup {
    /// Starts a new row whose pages are below `pages`.
    pub fn begin_row(&mut self, pages: u32) {
        let n = pages as usize;
        if self.stamp.len() < n {
            self.stamp.resize(n, 0);
            self.index.resize(n, 0);
        }
        self.row = self.row.wrapping_add(1);
        if self.row == 0 {
            // The stamp wrapped: forget every earlier row.
            self.stamp.iter_mut().for_each(|s| *s = 0);
            self.row = 1;
        }
    }

    /// The index already given to `page` in this row, or `None` after recording `next` for it.
    #[inline]
    pub fn seen_or_insert(&mut self, page: u32, next: u32) -> Option<u32> {
        let p = page as usize;
        if self.stamp[p] == self.row {
            Some(self.index[p])
        } else {
            self.stamp[p] = self.row;
            self.index[p] = next;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_must_divide_or_be_multiples_of_the_page() {
        assert!(SelectionUnit::new(0, 16).is_err());
        assert!(SelectionUnit::new(24, 16).is_err());
        assert_eq!(SelectionUnit::new(64, 16).unwrap().pages_per_entry(), 4);
        assert_eq!(SelectionUnit::new(4, 16).unwrap().pages_per_entry(), 1);
        assert_eq!(SelectionUnit::new(1, 16).unwrap().pages_per_entry(), 1);
    }

    #[test]
    fn entries_map_to_pages_with_their_token_counts() {
        let mut out = [None; 4];
        // Block of 64 tokens over 16-token pages, request of 100 tokens: block 1 covers
        // tokens 64..100, so pages 4 and 5 (16 and 4 tokens) and nothing past the end.
        let u = SelectionUnit::new(64, 16).unwrap();
        u.entry_pages(1, 100, &mut out);
        assert_eq!(out, [Some((4, 16)), Some((5, 16)), Some((6, 4)), None]);
        // Token 37 lies in page 2.
        let mut one = [None; 1];
        SelectionUnit::new(1, 16)
            .unwrap()
            .entry_pages(37, 100, &mut one);
        assert_eq!(one, [Some((2, 1))]);
        // A 4-token block inside a page.
        SelectionUnit::new(4, 16)
            .unwrap()
            .entry_pages(5, 100, &mut one);
        assert_eq!(one, [Some((1, 4))]);
        assert_eq!(SelectionUnit::new(4, 16).unwrap().entries(100), 25);
    }

    #[test]
    fn dedup_is_per_row() {
        let mut d = RowDedup::default();
        d.begin_row(10);
        assert_eq!(d.seen_or_insert(3, 0), None);
        assert_eq!(d.seen_or_insert(3, 1), Some(0));
        d.begin_row(10);
        assert_eq!(d.seen_or_insert(3, 7), None);
    }
}
