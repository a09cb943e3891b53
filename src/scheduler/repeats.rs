//! The cells of a plan's table that name a key but are not its first cell: filled with the
//! key's slot once the resolve has placed it (and again where a retry moves it).
//!
//! Most come one by one (a block named twice in a row, a token row out of order). A sorted
//! token row names each page by a run of adjacent cells, ~16 in a top-2048 row: those come as
//! one run each, so that a step's ~700k repeated token cells at DeepSeek-V3.2's shape cost ~45k
//! runs to list and a range fill each to place.

/// Repeated cells of a plan, as single cells and as runs.
#[derive(Debug, Default)]
pub(super) struct Repeats {
    /// (cell, key).
    cells: Vec<(u32, u32)>,
    /// (first cell, end cell, key): cells `first..end` all name the key.
    runs: Vec<(u32, u32, u32)>,
}

impl Repeats {
    /// Cell `at` names `key`.
    #[inline]
    pub fn push(&mut self, at: u32, key: u32) {
        self.cells.push((at, key));
    }

    /// Cells `cells` all name `key` (nothing if the range is empty).
    #[inline]
    pub fn push_run(&mut self, cells: std::ops::Range<u32>, key: u32) {
        if !cells.is_empty() {
            self.runs.push((cells.start, cells.end, key));
        }
    }

    /// Writes each repeated cell's key slot (`slot(key)`) into `table`.
    pub fn place(&self, table: &mut [i32], slot: impl Fn(usize) -> i32) {
        for &(at, key) in &self.cells {
            table[at as usize] = slot(key as usize);
        }
        for &(first, end, key) in &self.runs {
            table[first as usize..end as usize].fill(slot(key as usize));
        }
    }

    /// Every repeated cell whose key `slot` gives (`Some`), with that slot: the cells a retry
    /// moved.
    pub fn cells_of(&self, slot: impl Fn(usize) -> Option<i32>) -> Vec<(u32, i32)> {
        let mut out: Vec<(u32, i32)> = self
            .cells
            .iter()
            .filter_map(|&(at, key)| slot(key as usize).map(|s| (at, s)))
            .collect();
        for &(first, end, key) in &self.runs {
            if let Some(s) = slot(key as usize) {
                out.extend((first..end).map(|at| (at, s)));
            }
        }
        out
    }

    /// Every repeated cell as (cell, key), single cells first, then the runs' in order.
    #[cfg(test)]
    pub fn expanded(&self) -> Vec<(u32, u32)> {
        let mut out = self.cells.clone();
        for &(first, end, key) in &self.runs {
            out.extend((first..end).map(|at| (at, key)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_and_runs_are_placed_and_reported_alike() {
        let mut r = Repeats::default();
        r.push(1, 0);
        r.push_run(3..6, 1);
        r.push_run(7..7, 0); // empty: nothing
        r.push(8, 1);
        let mut table = vec![-1; 10];
        r.place(&mut table, |key| [50, 60][key]);
        assert_eq!(table, [-1, 50, -1, 60, 60, 60, -1, -1, 60, -1]);
        let moved = r.cells_of(|key| (key == 1).then_some(99));
        assert_eq!(moved, [(8, 99), (3, 99), (4, 99), (5, 99)]);
        assert_eq!(r.expanded(), [(1, 0), (8, 1), (3, 1), (4, 1), (5, 1)]);
    }
}
