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
        field: &'static str,
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
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
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
