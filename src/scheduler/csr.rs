//! Ragged selections: rows as CSR (row offsets + entries) instead of padded `[B, K]`.
//!
//! A batch whose requests select different numbers of entries (short contexts, token rows
//! mapped to pages) can hand its rows without padding: `offsets` (`B + 1`, from 0, not
//! decreasing, ending at the number of entries) and the entries of every row back to back,
//! with counts in the same order where the rows are counted. The plan pads them to the widest
//! row once, plans that, and hands back the slot table in the same CSR form (each entry's
//! `pages_per_entry` cells, row after row); a retry's moved cells and a failed row's cells
//! are reported in that form too.
//!
//! Padding keeps one planning path for both forms (the row builders, kept selections, retries
//! and the state machines' coverage stay theirs); what it costs is a copy of the entries and
//! of the table, against a plan that touches each entry several times anyway.

use std::ops::Range;

use crate::error::{Error, Result};

/// A plan's rows as CSR: where each row's entries start, and the padded width they were
/// planned at.
#[derive(Debug, Clone)]
pub(super) struct Csr {
    /// `B + 1` row starts, in entries.
    offsets: Vec<u32>,
    /// The widest row: the padded plan's `K`.
    width: usize,
    /// Slot-table cells per entry.
    ppe: usize,
}

/// Padded rows made from CSR ones: the selection `[B, width]` (-1 past each row's end) and
/// its counts where given (0 there).
#[derive(Debug)]
pub(super) struct Padded {
    pub csr: Csr,
    pub selection: Vec<i64>,
    pub counts: Option<Vec<u32>>,
}

impl Csr {
    /// Checks `offsets` against `rows` and `entries` (and `counts`, one per entry) and pads
    /// the rows to the widest one.
    pub(super) fn pad(
        rows: usize,
        offsets: &[i64],
        entries: &[i64],
        counts: Option<&[u32]>,
        ppe: usize,
    ) -> Result<Padded> {
        if offsets.len() != rows + 1 {
            return Err(Error::config(
                "offsets",
                format!("{} offsets", offsets.len()),
                format!("{}: one more than the requests", rows + 1),
            ));
        }
        if offsets[0] != 0 {
            return Err(Error::config("offsets[0]", offsets[0], "0"));
        }
        if let Some(b) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(Error::config(
                format!("offsets[{}]", b + 1),
                offsets[b + 1],
                format!(
                    "at least offsets[{b}] = {} (rows do not overlap)",
                    offsets[b]
                ),
            ));
        }
        let last = offsets[rows];
        if last != entries.len() as i64 || last > i64::from(u32::MAX) {
            return Err(Error::config(
                format!("offsets[{rows}]"),
                last,
                format!("{}: the number of entries", entries.len()),
            ));
        }
        if let Some(c) = counts {
            if c.len() != entries.len() {
                return Err(Error::config(
                    "counts",
                    format!("{} counts", c.len()),
                    format!("{}: one per entry", entries.len()),
                ));
            }
        }
        let offsets: Vec<u32> = offsets.iter().map(|&o| o as u32).collect();
        let width = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        let mut selection = vec![-1i64; rows * width];
        let mut padded_counts = counts.map(|_| vec![0u32; rows * width]);
        for (b, w) in offsets.windows(2).enumerate() {
            let (s, e) = (w[0] as usize, w[1] as usize);
            selection[b * width..b * width + (e - s)].copy_from_slice(&entries[s..e]);
            if let (Some(pc), Some(c)) = (padded_counts.as_mut(), counts) {
                pc[b * width..b * width + (e - s)].copy_from_slice(&c[s..e]);
            }
        }
        Ok(Padded {
            csr: Csr {
                offsets,
                width,
                ppe,
            },
            selection,
            counts: padded_counts,
        })
    }

    /// The padded plan's width in entries.
    pub(super) fn width(&self) -> usize {
        self.width
    }

    /// Row `b`'s cells in the CSR table.
    pub(super) fn row_cells(&self, b: usize) -> Range<usize> {
        self.offsets[b] as usize * self.ppe..self.offsets[b + 1] as usize * self.ppe
    }

    /// The CSR cell of padded cell `at` (None: padding, which names nothing).
    pub(super) fn cell(&self, at: u32) -> Option<u32> {
        let row_cells = self.width * self.ppe;
        let (b, j) = (at as usize / row_cells, at as usize % row_cells);
        let cells = self.row_cells(b);
        (j < cells.len()).then(|| (cells.start + j) as u32)
    }

    /// An error of the padded plan that names a cell of a row (`selection[b][j]`,
    /// `counts[b][j]`) names the CSR entry instead (`entries[n]`, `counts[n]`): what the
    /// caller can index.
    pub(super) fn rename(&self, e: Error) -> Error {
        let at = |field: &str, name: &str| -> Option<String> {
            let rest = field
                .strip_prefix(name)?
                .strip_prefix('[')?
                .strip_suffix(']')?;
            let (b, j) = rest.split_once("][")?;
            let (b, j): (usize, u32) = (b.parse().ok()?, j.parse().ok()?);
            let start = *self.offsets.get(b)?;
            Some(format!("[{}]", u64::from(start) + u64::from(j)))
        };
        match e {
            Error::OutOfRange {
                field,
                value,
                lo,
                hi,
            } => {
                let field = match (at(&field, "selection"), at(&field, "counts")) {
                    (Some(n), _) => format!("entries{n}"),
                    (_, Some(n)) => format!("counts{n}"),
                    _ => field,
                };
                Error::OutOfRange {
                    field,
                    value,
                    lo,
                    hi,
                }
            }
            other => other,
        }
    }

    /// The padded table (a row of `width * ppe` cells per request) in CSR form.
    pub(super) fn compact(&self, table: &[i32]) -> Vec<i32> {
        let row_cells = self.width * self.ppe;
        let mut out = Vec::with_capacity(*self.offsets.last().unwrap_or(&0) as usize * self.ppe);
        for b in 0..self.offsets.len() - 1 {
            let n = self.row_cells(b).len();
            out.extend_from_slice(&table[b * row_cells..b * row_cells + n]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pad_to_the_widest_and_compact_back() {
        let p = Csr::pad(
            3,
            &[0, 2, 2, 5],
            &[4, 7, 1, 2, 3],
            Some(&[1, 2, 3, 4, 5]),
            2,
        )
        .unwrap();
        assert_eq!(p.csr.width(), 3);
        assert_eq!(p.selection, [4, 7, -1, -1, -1, -1, 1, 2, 3]);
        assert_eq!(p.counts.unwrap(), [1, 2, 0, 0, 0, 0, 3, 4, 5]);
        // Two cells an entry: padded rows of 6 cells.
        let table: Vec<i32> = (0..18).collect();
        assert_eq!(p.csr.compact(&table), [0, 1, 2, 3, 12, 13, 14, 15, 16, 17]);
        assert_eq!(p.csr.row_cells(2), 4..10);
        assert_eq!(p.csr.cell(13), Some(5));
        assert_eq!(p.csr.cell(4), None, "padding of row 0");
        assert_eq!(p.csr.cell(7), None, "row 1 is empty");
    }

    #[test]
    fn a_cell_named_in_an_error_is_named_as_its_entry() {
        let p = Csr::pad(3, &[0, 2, 2, 5], &[4, 7, 1, 2, 3], None, 1).unwrap();
        let field = |f: &str| match p.csr.rename(Error::out_of_range(f, 9, 0, 4)) {
            Error::OutOfRange { field, .. } => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field("selection[2][1]"), "entries[3]");
        assert_eq!(field("counts[0][1]"), "counts[1]");
        assert_eq!(field("layer"), "layer");
        assert_eq!(
            field("selection[9][0]"),
            "selection[9][0]",
            "no such row: as it was"
        );
    }

    #[test]
    fn bad_offsets_and_counts_name_the_field() {
        let field = |offsets: &[i64], entries: &[i64], counts: Option<&[u32]>| match Csr::pad(
            2, offsets, entries, counts, 1,
        ) {
            Err(Error::Config { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(&[0, 1], &[1], None), "offsets");
        assert_eq!(field(&[1, 1, 1], &[1], None), "offsets[0]");
        assert_eq!(field(&[0, 2, 1], &[1, 2], None), "offsets[2]");
        assert_eq!(field(&[0, 1, 3], &[1, 2], None), "offsets[2]");
        assert_eq!(field(&[0, 1, 2], &[1, 2], Some(&[1])), "counts");
    }
}
