//! The pyo3 bindings: `sparsetier._core`.
//!
//! Only this module knows about Python. Strings are parsed into the core's enums, integers are
//! range-checked, and torch tensors are inspected (dtype, device, shape, contiguity) here, once;
//! the core below never sees an unchecked value. Every core error becomes one of the typed
//! exceptions of `sparsetier.errors` (see `error.rs`).

mod alloc;
mod args;
mod directory;
mod error;
mod joined_scheduler;
mod joined_storage;
mod lock;
mod offload;
mod page_allocation;
mod plan;
mod pool;
mod prefix_result;
mod radix;
mod replay;
mod residency_view;
#[cfg(feature = "testing")]
mod resolve_kernel;
mod resolver;
mod restore_policy;
pub(crate) mod scheduler;
mod scheduler_args;
mod scheduler_core;
mod scheduler_stats;
#[cfg(feature = "testing")]
mod soak;
mod stats;
mod step_results;
mod tensor;
#[cfg(feature = "testing")]
mod testing;
mod tokens;
mod transfer;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<pool::PyPoolSpec>()?;
    m.add_class::<alloc::PyPageAllocator>()?;
    m.add_class::<plan::PyPoolPlan>()?;
    m.add_class::<plan::PyPlan>()?;
    m.add_function(wrap_pyfunction!(plan::plan_stack, m)?)?;
    m.add_class::<directory::PyResidencyDirectory>()?;
    m.add_class::<directory::PyResolveResult>()?;
    m.add_class::<directory::PyLoadPlan>()?;
    m.add_class::<directory::PyBackupPlan>()?;
    m.add_class::<directory::PyPinHandle>()?;
    m.add_function(wrap_pyfunction!(directory::token_pages, m)?)?;
    m.add_class::<transfer::PyPageTransferBinding>()?;
    m.add_class::<transfer::PyPreparedPageTransfer>()?;
    m.add_class::<transfer::PyPageTransferGroup>()?;
    m.add_class::<transfer::PyTransferEngine>()?;
    m.add_class::<transfer::PyTransferHandle>()?;
    m.add_function(wrap_pyfunction!(transfer::cuda_status, m)?)?;
    m.add_class::<scheduler::PyStepScheduler>()?;
    m.add_class::<joined_scheduler::PyJoinedStepScheduler>()?;
    m.add_class::<joined_storage::PyJoinedStorage>()?;
    m.add_class::<resolver::PyDeviceResolver>()?;
    m.add_class::<restore_policy::PyRestorePolicy>()?;
    m.add_class::<residency_view::PyResidencyView>()?;
    m.add_class::<step_results::PyLayerPlan>()?;
    m.add_class::<step_results::PyLayerCounts>()?;
    m.add_class::<step_results::PyStepRecord>()?;
    m.add_class::<step_results::PyAdmission>()?;
    m.add_class::<radix::PyHiCache>()?;
    m.add_class::<prefix_result::PyPrefixMatch>()?;
    m.add_class::<prefix_result::PyPrefixInsert>()?;
    m.add_class::<page_allocation::PyPageAllocation>()?;
    m.add_function(wrap_pyfunction!(transfer::compile_cuda_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(transfer::kernel_cubin, m)?)?;
    m.add_function(wrap_pyfunction!(replay::replay_trace, m)?)?;
    m.add_function(wrap_pyfunction!(replay::trace_peak_live, m)?)?;
    m.add_class::<offload::PyChunkDirectory>()?;
    m.add_class::<offload::PyRequestHandle>()?;
    m.add_class::<offload::PyBlockMover>()?;
    #[cfg(feature = "testing")]
    testing::register(m)?;
    Ok(())
}
