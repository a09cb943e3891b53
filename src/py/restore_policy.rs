//! `sparsetier._core.RestorePolicy`: the joined scheduler's restore policy on its own (what a
//! prefix hit restores of its main KV, `scheduler/restore_policy.rs`), for `bench
//! prefix-sparse` to judge it against the fixed choices with the same cost model the core
//! decides by.

use crate::py::error::IntoPyResult;
use crate::scheduler::prefix::DEFAULT_COPY_OVERHEAD;
use crate::scheduler::restore_policy::{RestoreChoice, RestoreMode, RestorePolicy};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The restore policy: `decide` for an admission, `learn` from a request that restored
/// Indexer-K only.
#[pyclass(name = "RestorePolicy", module = "sparsetier._core", frozen)]
pub struct PyRestorePolicy {
    inner: Mutex<RestorePolicy>,
}

#[pymethods]
impl PyRestorePolicy {
    #[new]
    #[pyo3(
        signature = (mode="auto", copy_overhead=DEFAULT_COPY_OVERHEAD),
        text_signature = "(mode='auto', copy_overhead=16384)"
    )]
    fn new(py: Python<'_>, mode: &str, copy_overhead: u64) -> PyResult<Self> {
        let mode = RestoreMode::parse(mode).py_err(py)?;
        Ok(PyRestorePolicy {
            inner: Mutex::new(RestorePolicy::new(mode, copy_overhead)),
        })
    }

    /// A request with a `suffix`-token prefill that restored Indexer-K only loaded `loaded`
    /// of the `absent` main-KV objects its admission found off the device.
    fn learn(&self, suffix: u64, absent: u64, loaded: u64) {
        self.inner.lock().learn(suffix, absent, loaded);
    }

    /// The coverage expected for a `suffix`-token prefill, or None before any sample.
    fn coverage(&self, suffix: u64) -> Option<f64> {
        self.inner.lock().coverage(suffix)
    }

    /// The decision for an admission whose matched host pages hold `absent` objects off the
    /// device over `layers` layers, with a `suffix`-token prefill and `object_bytes` per
    /// object: `{"choice": "indexer" | "full", "coverage", "objects_indexer",
    /// "objects_full"}` (the objects each choice was predicted to load; NaN without a
    /// sample).
    fn decide<'py>(
        &self,
        py: Python<'py>,
        absent: u64,
        layers: u64,
        suffix: u64,
        object_bytes: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let d = self
            .inner
            .lock()
            .decide(absent, layers, suffix, object_bytes);
        let out = PyDict::new(py);
        let choice = match d.choice {
            RestoreChoice::IndexerOnly => "indexer",
            RestoreChoice::Full => "full",
        };
        out.set_item("choice", choice)?;
        out.set_item("coverage", d.coverage)?;
        out.set_item("objects_indexer", d.predicted.0)?;
        out.set_item("objects_full", d.predicted.1)?;
        Ok(out)
    }
}
