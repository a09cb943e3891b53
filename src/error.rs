//! The crate's one error type.
//!
//! Every variant is structured: it carries the field, the value and what is allowed, so the
//! Python layer can map it onto a typed exception without parsing strings. Panics are kept for
//! broken internal invariants only.

use thiserror::Error as ThisError;

/// Errors raised by the sparsetier core.
#[derive(Debug, Clone, PartialEq, ThisError)]
pub enum Error {
    /// A configuration value is outside what this integration supports.
    #[error("invalid {field} = {value}: allowed {allowed}")]
    Config {
        /// The configuration field, as the user spells it.
        field: String,
        /// The value that was given.
        value: String,
        /// What would have been accepted.
        allowed: String,
    },
    /// A numeric argument lies outside its valid range `[lo, hi)`.
    #[error("{field} = {value} is out of range: allowed {lo} <= {field} < {hi}")]
    OutOfRange {
        /// The argument's name.
        field: String,
        /// The value that was given.
        value: i128,
        /// Smallest allowed value.
        lo: i128,
        /// One past the largest allowed value.
        hi: i128,
    },
    /// An all-or-nothing allocation could not be satisfied; nothing was allocated.
    #[error("out of pages: requested {requested}, free {free} (capacity {capacity})")]
    OutOfPages {
        /// Pages asked for.
        requested: usize,
        /// Pages that were free.
        free: usize,
        /// Usable capacity of the allocator.
        capacity: usize,
    },
    /// A page was freed that is not currently allocated (double free).
    #[error("page {page} is not allocated: double free")]
    DoubleFree {
        /// The page.
        page: u32,
    },
    /// A page was freed that this allocator never hands out.
    #[error("page {page} is not owned by this allocator: allowed {lo} <= page < {hi}")]
    NotOwned {
        /// The page.
        page: u32,
        /// First page the allocator hands out (pages below are reserved).
        lo: u32,
        /// One past the last page.
        hi: u32,
    },
    /// A call named a page its caller does not hold (a second owner would follow); nothing
    /// changed.
    #[error("{field}: page {page} is held by {held_by}; allowed: {allowed}")]
    NotHeld {
        /// The argument that named the page.
        field: String,
        /// The page.
        page: u32,
        /// Who holds it now.
        held_by: String,
        /// What the call accepts.
        allowed: String,
    },
    /// The directory could not find slots on a tier even after evicting every evictable object;
    /// nothing in the batch was applied.
    #[error(
        "out of {tier} slots: need {requested}, free {free}, evictable {evictable} \
         (the rest are pinned, loading, quarantined or not backed up)"
    )]
    OutOfSlots {
        /// `device` or `host`.
        tier: &'static str,
        /// Slots the batch needed.
        requested: usize,
        /// Slots free.
        free: usize,
        /// Slots that eviction could have freed.
        evictable: usize,
    },
    /// An object is neither on the device nor has a ready host copy (or is unknown).
    #[error("object {key} is not resident: no device copy and no ready host copy")]
    NotResident {
        /// The object key, printed.
        key: String,
    },
    /// `allocate` was given a key that already exists.
    #[error("object {key} already exists")]
    KeyExists {
        /// The object key, printed.
        key: String,
    },
    /// A key names a namespace that was dropped.
    #[error("namespace {namespace} was dropped: its keys are no longer valid")]
    NamespaceDropped {
        /// The namespace, printed.
        namespace: String,
    },
    /// An operation is not a transition the state machine allows from the object's state.
    #[error("cannot {op} object {key}: it is {state}")]
    InvalidTransition {
        /// The operation attempted.
        op: &'static str,
        /// The object key, printed.
        key: String,
        /// The object's state.
        state: String,
    },
    /// A transfer id the directory does not know (never issued, or finished and forgotten).
    #[error("unknown transfer {id}")]
    UnknownTransfer {
        /// The transfer id.
        id: u64,
    },
    /// A transfer is not in the state the operation needs.
    #[error("cannot {op} transfer {id}: it is {state}")]
    TransferState {
        /// The operation attempted.
        op: &'static str,
        /// The transfer id.
        id: u64,
        /// Its state.
        state: String,
    },
    /// A transfer failed; its waiters get this.
    #[error("transfer {id} failed: {reason}")]
    TransferFailed {
        /// The transfer id.
        id: u64,
        /// Why, as given to `fail`.
        reason: String,
    },
    /// A wait ran out of time.
    #[error("transfer {id} still in flight after {timeout_ms} ms")]
    WaitTimeout {
        /// The transfer id.
        id: u64,
        /// The time waited.
        timeout_ms: u64,
    },
    /// A transfer plan is inconsistent (duplicate destination, mismatched bindings, ...).
    #[error("invalid transfer plan: {field} = {value}: allowed {allowed}")]
    Plan {
        /// What is wrong, as a field name.
        field: String,
        /// The value found.
        value: String,
        /// What would be accepted.
        allowed: String,
    },
    /// A copy engine failed to move (part of) a transfer.
    #[error("copy failed on the {engine} engine, layer {layer}: {reason}")]
    CopyFailed {
        /// Engine name.
        engine: &'static str,
        /// First layer not written.
        layer: usize,
        /// Why.
        reason: String,
    },
    /// CUDA is not usable: a library is missing, or the driver lacks an entry point.
    #[error("CUDA unavailable: {what}. {fix}")]
    CudaUnavailable {
        /// What is missing.
        what: String,
        /// What to install or change.
        fix: String,
    },
    /// A CUDA call failed.
    #[error("CUDA error in {call}: {message}")]
    Cuda {
        /// The call.
        call: &'static str,
        /// The driver's message.
        message: String,
    },
    /// A prefix-tree node id that is unknown or stale (its node was split off, evicted or
    /// dropped since).
    #[error("unknown or stale node {id}")]
    UnknownNode {
        /// The node id.
        id: u64,
    },
    /// `unlock` of a node whose lock count is already zero.
    #[error("node {id} is not locked")]
    NotLocked {
        /// The node id.
        id: u64,
    },
    /// A pin handle that is unknown or was already released.
    #[error("pin handle {id} is unknown or already released")]
    UnknownHandle {
        /// The handle id.
        id: u64,
    },
    /// A broken internal invariant (a panic, caught): a bug in sparsetier. The object it
    /// happened in refuses every later call (see [`crate::guard`]).
    #[error("internal error at {site}: {message} (a bug in sparsetier; please report it)")]
    Internal {
        /// Where the failing call entered the core (file:line:column).
        site: String,
        /// The panic's message.
        message: String,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Shorthand for [`Error::Plan`].
    pub fn plan(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Plan {
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }

    /// Shorthand for [`Error::OutOfRange`] over `[lo, hi)`.
    pub fn out_of_range(
        field: impl Into<String>,
        value: impl Into<i128>,
        lo: impl Into<i128>,
        hi: impl Into<i128>,
    ) -> Self {
        Error::OutOfRange {
            field: field.into(),
            value: value.into(),
            lo: lo.into(),
            hi: hi.into(),
        }
    }

    /// Shorthand for [`Error::Config`].
    pub fn config(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Config {
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}
