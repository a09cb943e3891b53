//! Page transfer: planning (binding, map, prepared transfer, group) and the copy engines.
//!
//! # What it owns
//! Planning turns (pool buffer, page pairs) into contiguous copies per layer, checking every
//! address against the buffers once, up front. Engines run those copies and record one event
//! per layer: `cpu` (worker threads, both tiers in host memory), and `kernel` / `direct` (CUDA,
//! in `cuda`). Every engine takes injected failures (`fault`) for tests.
//!
//! # Invariants
//! - every copy an engine runs lies inside the bindings it was prepared from;
//! - a layer's event is recorded only after every byte of that layer, of every pool of the
//!   group, is written; a failed layer fails every later layer of the same submission;
//! - a destination is listed at most once per map.

pub mod binding;
pub mod cpu;
pub mod cubin;
pub mod cuda;
pub mod engine;
pub mod events;
pub mod fault;
pub mod map;
pub mod prepared;

pub use binding::{LayerPageOrder, MemoryKind, PageTransferBinding};
pub use cpu::CpuEngine;
pub use engine::CopyEngine;
pub use events::{LayerStatus, TransferEvents};
pub use fault::{Fault, FaultAction};
pub use map::{Granularity, PageTransferMap, Segment};
pub use prepared::{CopyOp, Direction, PageTransferGroup, PreparedPageTransfer};

#[cfg(test)]
#[path = "../tests/transfer_cpu.rs"]
mod cpu_tests;

#[cfg(test)]
#[path = "../tests/transfer_edges.rs"]
mod edge_tests;
