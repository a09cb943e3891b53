//! sparsetier: a tiered KV-cache runtime for sparse-attention LLM inference.
//!
//! The crate owns every decision about where cached data lives and when it moves. This
//! foundation holds the vocabulary of the design (`../shared/DESIGN.md`):
//!
//! - [`layout`]: dtypes, components, host layouts and byte offsets inside a pool buffer;
//! - [`pool`]: the geometry of one pool ([`pool::PoolSpec`]);
//! - [`alloc`]: the all-or-nothing page allocator of one tier;
//! - [`config`]: the configuration boundary (io backend, write policy, host budget, ...);
//! - [`plan`]: pool groups and the host-budget split across KV, Indexer-K, SWA and draft.
//!
//! Python bindings live in `py/`, behind the `python` feature, so `cargo test` and
//! `cargo bench` need no interpreter.
#![deny(missing_docs)]

pub mod alloc;
pub mod config;
pub mod directory;
pub mod error;
pub mod guard;
pub mod ids;
pub mod layout;
pub mod offload;
pub mod plan;
pub mod pool;
pub mod prefetch;
pub mod radix;
pub mod replay;
pub mod row;
pub mod scheduler;
#[doc(hidden)]
pub mod testing;
pub mod transfer;

#[cfg(feature = "python")]
mod py;

/// The extension allocates with mimalloc: the prefix cache's serve loop and the decode step
/// allocate and free many short-lived arrays (a request's pages and tokens, a layer's rows),
/// where glibc's malloc spent a tenth of the time. The unit tests use it too, so that the
/// profiling harnesses (`full_shape`) allocate as the extension does.
#[cfg(any(feature = "python", test))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub use error::{Error, Result};

#[cfg(test)]
#[path = "tests/soak.rs"]
mod soak;
