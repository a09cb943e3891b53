//! The running requests' page tables as the resolver's kernel reads them, kept on its device
//! from step to step: a row per request (page -> home), rows of `width` homes. A step sends
//! only what changed: the homes of pages that started since the request's last step, as
//! (index, home) pairs that `sparsetier_mirror_apply` scatters, the lengths, and the batch's
//! rows. The whole table moves only when it grows (a row longer than `width`, or more
//! requests than rows): then each request's row is sent again at its next step.

use super::device::KernelDevice;
use crate::error::{Error, Result};
use crate::ids::RequestId;
use rustc_hash::FxHashMap;

/// One request of a step: its id, admission serial, homes (page -> home) and length in
/// tokens (bounded by its homes).
pub(super) type StepTable<'a> = (RequestId, u64, &'a [u32], u64);

/// Whether a request still runs (its row is kept).
pub(super) type Live<'a> = &'a dyn Fn(&RequestId) -> bool;

/// A request's row, and how much of its table the device has.
#[derive(Debug, Clone, Copy)]
struct Row {
    row: u32,
    serial: u64,
    sent: usize,
}

/// What a step uploads for its tables.
#[derive(Debug, Default)]
pub(super) struct TableUpload {
    /// (index in the table, home) pairs.
    pub pairs: Vec<i32>,
    /// Per row of the table, its request's length in tokens (0 for a free row).
    pub lens: Vec<i64>,
    /// The batch's rows, in the step's order.
    pub rows: Vec<i32>,
}

/// The page tables on the kernel's device (see the module docs).
#[derive(Debug, Default)]
pub(super) struct DeviceTables {
    /// `[capacity * width]` homes, at `addr`.
    pub addr: u64,
    pub width: usize,
    capacity: usize,
    rows: FxHashMap<RequestId, Row>,
    free: Vec<u32>,
    /// Per row, its request (the log names rows).
    pub owners: Vec<Option<RequestId>>,
    lens: Vec<i64>,
}

impl DeviceTables {
    /// Brings the tables up to the step's `tables`, first letting go of the rows of requests
    /// `live` no longer names; (re)allocates on `dev` when they grow. Returns the uploads.
    pub(super) fn prepare(
        &mut self,
        dev: &mut dyn KernelDevice,
        tables: &[StepTable<'_>],
        live: impl Fn(&RequestId) -> bool,
    ) -> Result<TableUpload> {
        let gone: Vec<RequestId> = self.rows.keys().filter(|id| !live(id)).copied().collect();
        for id in gone {
            let r = self.rows.remove(&id).expect("listed above");
            self.owners[r.row as usize] = None;
            self.lens[r.row as usize] = 0;
            self.free.push(r.row);
        }
        let new_rows = tables
            .iter()
            .filter(|t| !self.rows.contains_key(&t.0))
            .count();
        let longest = tables.iter().map(|t| t.2.len()).max().unwrap_or(0);
        if longest > self.width || new_rows > self.free.len() || self.addr == 0 {
            self.grow(dev, longest, self.rows.len() + new_rows)?;
        }
        let mut up = TableUpload::default();
        for &(id, serial, homes, len) in tables {
            if !self.rows.contains_key(&id) {
                let row = self.free.pop().expect("grown above");
                self.owners[row as usize] = Some(id);
                self.rows.insert(
                    id,
                    Row {
                        row,
                        serial,
                        sent: 0,
                    },
                );
            }
            let r = self.rows.get_mut(&id).expect("inserted above");
            if r.serial != serial || r.sent > homes.len() {
                // Another admission under the same id: its table starts over.
                *r = Row {
                    row: r.row,
                    serial,
                    sent: 0,
                };
            }
            let base = r.row as usize * self.width;
            for (p, &h) in homes.iter().enumerate().skip(r.sent) {
                up.pairs.extend([(base + p) as i32, h as i32]);
            }
            r.sent = homes.len();
            self.lens[r.row as usize] = len as i64;
            up.rows.push(r.row as i32);
        }
        up.lens = self.lens.clone();
        Ok(up)
    }

    /// Forgets what the device has of every row (an upload that may not have reached it):
    /// each is sent whole at its request's next step.
    pub(super) fn invalidate(&mut self) {
        for r in self.rows.values_mut() {
            r.sent = 0;
        }
    }

    /// The rows of `rids`, which must be requests of the step.
    pub(super) fn rows_of(&self, rids: &[RequestId]) -> Result<Vec<i32>> {
        rids.iter()
            .map(|id| {
                self.rows
                    .get(id)
                    .map(|r| r.row as i32)
                    .ok_or_else(|| Error::config("rids", id, "requests of the granted step"))
            })
            .collect()
    }

    /// A table of at least `width` homes a row and `rows` rows (powers of two): every row is
    /// sent again (its request's next step sends it whole).
    fn grow(&mut self, dev: &mut dyn KernelDevice, width: usize, rows: usize) -> Result<()> {
        let width = width.max(self.width).max(16).next_power_of_two();
        let capacity = rows.max(self.capacity).max(8).next_power_of_two();
        if i32::try_from(width * capacity).is_err() {
            return Err(Error::config(
                "requests",
                format!("{capacity} rows of {width} pages"),
                "page tables that an int32 index holds",
            ));
        }
        let addr = dev.alloc(4 * width * capacity)?;
        if self.addr != 0 {
            dev.free(self.addr);
        }
        self.addr = addr;
        self.width = width;
        self.free
            .extend((self.capacity as u32..capacity as u32).rev());
        self.owners.resize(capacity, None);
        self.lens.resize(capacity, 0);
        self.capacity = capacity;
        for r in self.rows.values_mut() {
            r.sent = 0;
        }
        Ok(())
    }

    /// Makes room for `rows` requests of up to `width` pages without moving again while the
    /// steps stay within them (a no-op when there is room).
    pub(super) fn reserve(
        &mut self,
        dev: &mut dyn KernelDevice,
        width: usize,
        rows: usize,
    ) -> Result<()> {
        if width > self.width || rows > self.capacity || self.addr == 0 {
            self.grow(dev, width, rows)?;
        }
        Ok(())
    }

    /// Rows the table has room for.
    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Frees the table on `dev`.
    pub(super) fn release(&mut self, dev: &mut dyn KernelDevice) {
        if self.addr != 0 {
            dev.free(self.addr);
            self.addr = 0;
        }
    }
}

#[cfg(all(test, feature = "host-kernel"))]
#[path = "../../tests/device_tables_proptest.rs"]
mod device_tables_proptest;
