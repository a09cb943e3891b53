//! Ragged selections: rows as CSR (row offsets + entries) instead of padded `[B, K]`.
//!
//! A batch whose requests select different numbers of entries (short contexts, token rows
//! mapped to pages) can hand its rows without padding: `offsets` (`B + 1`, from 0, not
//! decreasing, ending at the number of entries) and the entries of every row back to back,
//! with counts in the same order where the rows are counted. The row builders read each row
//! where it lies ([`RowsIn`]), padded or not, and write the slot table in the same form:
//! each entry's `pages_per_entry` cells, row after row. A retry's moved cells and a failed
//! row's cells are cells of that table. Nothing is padded or copied: a batch with one long
//! row costs its entries, not the long row's width for every row.

use std::ops::Range;

use crate::error::{Error, Result};

/// Where each row of a plan's selection lies: every row `k` entries (`[B, k]`, padded with
/// -1 by the caller), or CSR.
#[derive(Debug, Clone, Copy)]
pub(super) enum RowsIn<'a> {
    /// Row `b` is entries `b * k..(b + 1) * k`.
    Padded(usize),
    /// Row `b` is entries `offsets[b]..offsets[b + 1]` (checked by [`Csr::check`]).
    Csr(&'a [u32]),
}

impl RowsIn<'_> {
    /// Row `b`'s entries in the selection (and its cells, `pages_per_entry` each).
    #[inline]
    pub(super) fn row(self, b: usize) -> Range<usize> {
        match self {
            RowsIn::Padded(k) => b * k..(b + 1) * k,
            RowsIn::Csr(o) => o[b] as usize..o[b + 1] as usize,
        }
    }

    /// The field an error names for entry `j` of row `b`: `selection[b][j]` or
    /// `counts[b][j]` padded, `entries[n]` or `counts[n]` as CSR (what the caller indexes).
    pub(super) fn name(self, counts: bool, b: usize, j: usize) -> String {
        match (self, counts) {
            (RowsIn::Padded(_), false) => format!("selection[{b}][{j}]"),
            (RowsIn::Padded(_), true) => format!("counts[{b}][{j}]"),
            (RowsIn::Csr(_), false) => format!("entries[{}]", self.row(b).start + j),
            (RowsIn::Csr(_), true) => format!("counts[{}]", self.row(b).start + j),
        }
    }
}

/// The form a plan's rows came in, kept with the plan: its table, and the cells `ready`
/// reports, are in that form.
#[derive(Debug, Clone)]
pub(super) enum RowForm {
    /// `[B, k]`, `ppe` cells an entry.
    Padded { k: usize, ppe: usize },
    /// CSR (`plan_csr`).
    Csr(Csr),
}

impl RowForm {
    /// The rows, for the row builders.
    pub(super) fn rows_in(&self) -> RowsIn<'_> {
        match self {
            RowForm::Padded { k, .. } => RowsIn::Padded(*k),
            RowForm::Csr(c) => RowsIn::Csr(&c.offsets),
        }
    }

    /// Row `b`'s cells in the table.
    pub(super) fn row_cells(&self, b: usize) -> Range<usize> {
        match self {
            RowForm::Padded { k, ppe } => b * k * ppe..(b + 1) * k * ppe,
            RowForm::Csr(c) => c.offsets[b] as usize * c.ppe..c.offsets[b + 1] as usize * c.ppe,
        }
    }
}

/// A CSR plan's row starts.
#[derive(Debug, Clone)]
pub(super) struct Csr {
    /// `B + 1` row starts, in entries.
    offsets: Vec<u32>,
    /// Slot-table cells per entry.
    ppe: usize,
}

impl Csr {
    /// Checks `offsets` against `rows` and the `entries` there are (and `counts`, one per
    /// entry).
    pub(super) fn check(
        rows: usize,
        offsets: &[i64],
        entries: usize,
        counts: Option<&[u32]>,
        ppe: usize,
    ) -> Result<Csr> {
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
        if last != entries as i64 || last > i64::from(u32::MAX) {
            return Err(Error::config(
                format!("offsets[{rows}]"),
                last,
                format!("{entries}: the number of entries"),
            ));
        }
        if let Some(c) = counts {
            if c.len() != entries {
                return Err(Error::config(
                    "counts",
                    format!("{} counts", c.len()),
                    format!("{entries}: one per entry"),
                ));
            }
        }
        Ok(Csr {
            offsets: offsets.iter().map(|&o| o as u32).collect(),
            ppe,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_lie_where_their_form_says() {
        let c = Csr::check(3, &[0, 2, 2, 5], 5, Some(&[1, 2, 3, 4, 5]), 2).unwrap();
        let form = RowForm::Csr(c);
        let rows = form.rows_in();
        assert_eq!(rows.row(0), 0..2);
        assert_eq!(rows.row(1), 2..2, "an empty row");
        assert_eq!(rows.row(2), 2..5);
        // Two cells an entry.
        assert_eq!(form.row_cells(2), 4..10);
        let padded = RowForm::Padded { k: 4, ppe: 2 };
        assert_eq!(padded.rows_in().row(2), 8..12);
        assert_eq!(padded.row_cells(2), 16..24);
    }

    #[test]
    fn an_entry_named_in_an_error_is_named_as_the_caller_indexes_it() {
        let c = RowForm::Csr(Csr::check(3, &[0, 2, 2, 5], 5, None, 1).unwrap());
        assert_eq!(c.rows_in().name(false, 2, 1), "entries[3]");
        assert_eq!(c.rows_in().name(true, 0, 1), "counts[1]");
        assert_eq!(RowsIn::Padded(4).name(false, 2, 1), "selection[2][1]");
        assert_eq!(RowsIn::Padded(4).name(true, 0, 3), "counts[0][3]");
    }

    #[test]
    fn bad_offsets_and_counts_name_the_field() {
        let field = |offsets: &[i64], entries: &[i64], counts: Option<&[u32]>| match Csr::check(
            2,
            offsets,
            entries.len(),
            counts,
            1,
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
