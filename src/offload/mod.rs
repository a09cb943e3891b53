//! The host tier behind a serving engine's KV offload connector (vLLM's `OffloadingManager`
//! and `OffloadingWorker`).
//!
//! # What it owns
//! - [`ChunkDirectory`] (`directory`): every offload key's chunk, its store state and pins,
//!   the recency policy (`lru`, `arc`), the reuse tracker (`tracker`), request-scoped access
//!   records (`request`) and the store/removal events. Keys are interned in one arena
//!   (`keys`); every structure is an index over it.
//! - [`BlockMover`] (`mover`): the worker side. It turns an engine's block ids and chunk ids
//!   into page transfers between the engine's device block tensors and the host pools, runs
//!   them on a copy engine, and reports each job's outcome.
//!
//! The directory is single-threaded; the bindings put it behind a `Guarded` (a panic poisons
//! it) and never wait for it while holding the GIL.
//!
//! # Departure from the residency directory
//! The engine, not sparsetier, owns the device blocks here: the directory tracks the host
//! tier only, keyed by the engine's content keys, and its eviction order is the engine's
//! (vLLM's LRU with request-scoped ranks, or ARC), because the engine's tests and scheduler
//! depend on it. `docs/vllm.md` maps each call.

pub mod arc;
pub mod bench;
pub mod directory;
pub mod keys;
pub mod lru;
pub mod mover;
pub mod queue;
pub mod request;
pub mod tracker;

pub use directory::{
    ChunkDirectory, DirectoryConfig, Event, Lookup, PolicyKind, Stats, StoreOutcome, Usage,
};
pub use keys::{group_of, ChunkId, KeyBytes};
pub use mover::{BlockMover, BlockTensor, JobOutcome, JobSpec, Ref};
pub use request::RequestRef;

#[cfg(test)]
#[path = "../tests/offload_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "../tests/offload_proptest.rs"]
mod proptests;
