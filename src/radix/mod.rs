//! The hierarchical prefix cache: the radix tree over L1/L2 pages ([`tree`]), and the cache
//! that drives allocators and copy engines over it ([`cache`]).

pub mod bench;
pub mod cache;
pub mod storage;
mod token_id;
pub mod tree;

pub use cache::{HiCache, HiCacheConfig, LoadBack, PoolPair};
pub use storage::{PageKey, PrefetchPlan, StorageTier, StorageTotals, WritePlan, WritePolicy};
pub use tree::{HostCopy, InsertResult, MatchResult, NodeId, RadixTree};

#[cfg(test)]
#[path = "../tests/radix_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "../tests/storage_tests.rs"]
mod storage_tests;
