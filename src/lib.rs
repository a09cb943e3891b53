//! sparsetier: a tiered KV-cache runtime for sparse-attention LLM inference.
//!
//! The crate owns every decision about where cached data lives (L1: GPU pages, L2: pinned host
//! pages, L3: storage under the host tier) and when it moves; Python hands it buffers and runs
//! the model. `docs/architecture.md` describes the concepts and maps the code. The modules:
//!
//! - [`alloc`]: the all-or-nothing page allocator of one tier, and who holds each page;
//! - [`config`]: the configuration boundary (io backend, write policy, host budget, ...);
//! - [`directory`]: the residency directory: each object's device and host state, its pins,
//!   the LRU of evictable objects, transfers in flight;
//! - [`error`]: the crate's one error enum, every variant structured;
//! - [`guard`]: panic containment: a panic poisons the state it broke, every later call is
//!   refused;
//! - [`ids`]: newtype ids and the process-wide serial every issued id comes from;
//! - [`layout`]: dtypes, components, host layouts and byte offsets inside a pool buffer;
//! - [`offload`]: the host tier behind vLLM's offloading connector (its chunk directory,
//!   LRU and ARC, the block mover);
//! - [`plan`]: pool groups and the host-budget split across KV, Indexer-K, SWA and draft;
//! - [`pool`]: the geometry of one pool ([`pool::PoolSpec`]);
//! - [`prefetch`]: the software prefetch hint of loops over millions of objects;
//! - [`radix`]: the radix prefix cache (`HiCache`) over device and host pages, and the state
//!   of its L3 tier;
//! - [`replay`]: a directory journal re-run at other device sizes, under LRU and Belady's MIN;
//! - [`row`]: a token row's named parts (values, scales, rope) and page layouts;
//! - [`scheduler`]: the batched decode step, in two kinds as two types (`StepScheduler`, plain,
//!   and `JoinedScheduler` over the prefix cache): kept selections, prefetch, the soak loop
//!   (test builds);
//! - [`transfer`]: page transfer plans and the copy engines (cpu, CUDA kernel and direct);
//! - `testing`: helpers shared by tests, soaks and benches (hidden from the docs);
//! - `py`: the pyo3 bindings, behind the `python` feature, so `cargo test` and `cargo bench`
//!   need no interpreter.
//!
//! The tests live in `src/tests/`, each compiled into the module it tests.
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
/// where glibc's malloc was measurably slower (benches/RESULTS.md, "Memory system: huge pages,
/// allocators, caches"). The unit tests use it too, so that the
/// profiling harnesses (`full_shape`) allocate as the extension does.
#[cfg(any(feature = "python", test))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub use error::{Error, Result};

#[cfg(test)]
#[path = "tests/soak.rs"]
mod soak;
