//! The device resolver kernel's ABI (`cuda/resolve.cu`): its argument structs field for field,
//! and the indices of its cursors and counters. Shared by the kernel's two launchers: on CPU
//! threads (`kernel`, test builds) and on a GPU (`launch`).

/// `st[ST_USED]`: grant entries gone through (runs past the grant's end).
pub const ST_USED: usize = 0;
/// `st[ST_LOG]`: log entries written.
pub const ST_LOG: usize = 1;
/// `st[ST_OVERFLOW]`: cells left without a slot.
pub const ST_OVERFLOW: usize = 2;
/// `st[ST_DEF_LEN]`: grant entries deferred (a victim the layer taking it had read).
pub const ST_DEF_LEN: usize = 3;
/// `st[ST_DEF_AT]`: deferred entries taken again.
pub const ST_DEF_AT: usize = 4;
/// `st[ST_REFILL_AT]`: log entries of earlier calls considered for a refill.
pub const ST_REFILL_AT: usize = 5;
/// `st[ST_BAD]`: cells naming a page past their request.
pub const ST_BAD: usize = 6;
/// `st[ST_GRANT_LEN]`: entries in the grant (written by the host before a step).
pub const ST_GRANT_LEN: usize = 7;
/// `st[ST_SERIAL]`: the step's serial (written by the host before a step).
pub const ST_SERIAL: usize = 8;
/// `st[ST_LOG_CAP]`: log entries the step's log has room for (written by the host before a
/// step).
pub const ST_LOG_CAP: usize = 9;
/// `st[ST_ROWS]`: the step's requests (written by the host before a step): a launch's rows
/// past them are padding (a CUDA graph's batch bucket), left without a slot.
pub const ST_ROWS: usize = 10;
/// Words in `st`.
pub const ST_LEN: usize = 11;
/// `tok[TOK_SELECTED]`: selected entries (cells naming a page).
pub const TOK_SELECTED: usize = 0;
/// `tok[TOK_NEEDED]`: selected tokens, every cell.
pub const TOK_NEEDED: usize = 1;
/// `tok[TOK_NEEDED_MOVED]`: selected tokens in the objects the step copied.
pub const TOK_NEEDED_MOVED: usize = 2;
/// A deferred or log entry not written yet (the host fills `deferred`, and the call of each
/// log entry, with it at a step's start).
pub const NOT_YET: i32 = 0x7fff_ffff;
/// Ints per log entry: (grant index, mirror entry, table row, page, call).
pub const LOG_INTS: usize = 5;
/// A mirror entry claimed by a cell in flight: never left once a launch returns.
pub const CLAIMING: i32 = -3;

/// `struct StepArgs` of the kernel, field for field (passed by value): the step's state. The
/// grant's length, the step's serial and the log's room are in `st` (`ST_GRANT_LEN`,
/// `ST_SERIAL`, `ST_LOG_CAP`), so that a layer's launches take the same arguments every step.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Step {
    pub mirror: *mut i32,
    pub marks: *mut u32,
    pub filled: *mut u32,
    pub grant: *const i32,
    pub deferred: *mut i32,
    pub log: *mut i32,
    pub st: *mut u32,
    pub counts: *mut u32,
    pub tok: *mut u64,
    pub call: i32,
}

/// `struct Geometry` of the kernel, field for field (passed by value): where pages lie.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Geometry {
    pub host_planes: *const u64,
    pub dev_planes: *const u64,
    pub host_stride: u64,
    pub dev_stride: u64,
    pub page_bytes: u64,
    pub planes: i32,
    pub order_first: i32,
    pub order_n: u32,
}
