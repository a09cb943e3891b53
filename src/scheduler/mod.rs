//! The step scheduler: transfer scheduling for the batched decode step, in the Rust core.
//!
//! [`StepScheduler`] owns the main-KV residency of a batch of requests (per-layer objects in a
//! [`crate::directory::Directory`]), the copy engine that moves them, and the per-request block
//! state. Python hands it a layer's selection for the whole batch and gets back a slot table;
//! completion, failure, retries, backups and prefetch happen here. See [`core`] for the
//! invariants and the data flow of one step.

pub mod bench;
#[cfg(any(test, feature = "testing"))]
mod copies_check;
pub mod core;
mod csr;
mod device_pool;
mod device_step;
pub mod entry;
#[cfg(any(test, feature = "testing"))]
mod faults;
mod joined;
mod kept;
mod kept_entries;
mod kept_store;
mod plain;
mod plan_steps;
mod prefetching;
pub mod prefix;
mod ready;
pub mod record;
mod repeats;
pub mod request;
pub mod resolver;
pub mod restore;
pub mod restore_policy;
pub mod restore_positions;
mod rows;
pub mod selection;
#[cfg(any(test, feature = "testing"))]
pub mod soak;
mod storage;
mod tier;
mod transfers;
mod validate;

pub use self::core::{PlanCounts, ReadyOutcome, SchedulerConfig, StepScheduler};
pub use device_step::DeviceTotals;
pub use tier::{Plain, Tier};

/// The joined step scheduler: host copies at the pages of a radix prefix cache.
pub type JoinedScheduler = StepScheduler<PrefixTier>;
pub use entry::Entry;
pub use kept_store::KeptSlot;
pub use prefix::{Admission, PrefixTier, PrefixTotals, HOST_NS};
pub use record::StepRecord;
pub use request::{Kept, Prefix, RequestState};
pub use selection::SelectionUnit;

#[cfg(test)]
#[path = "../tests/scheduler/mod.rs"]
mod tests;

#[cfg(test)]
#[path = "../tests/joined_tests.rs"]
mod joined_tests;

#[cfg(test)]
#[path = "../tests/resolver_tests.rs"]
mod resolver_tests;
