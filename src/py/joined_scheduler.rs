//! `JoinedStepScheduler`: a step scheduler joined with a prefix cache (`StepScheduler.joined`),
//! a subclass with the calls only that mode has: admission by prefix match, the Indexer-K
//! restore's waits, the flush of ended requests into the cache, its eviction. A plain
//! scheduler has none of them, so calling one is an `AttributeError` at once rather than a
//! refusal at run time.

use crate::error::Error;
use crate::py::error::{to_py, IntoPyResult};
use crate::py::lock::Unblocked;
use crate::py::scheduler::PyStepScheduler;
use crate::py::scheduler_args::{rid as rid_arg, token_ids, u32_arg};
use crate::py::step_results::PyAdmission;
use numpy::PyArray1;
use pyo3::prelude::*;

#[pyclass(
    name = "JoinedStepScheduler",
    module = "sparsetier._core",
    frozen,
    extends = PyStepScheduler
)]
pub struct PyJoinedStepScheduler;

#[pymethods]
impl PyJoinedStepScheduler {
    /// Joined mode: admits request `rid` with its prompt `tokens` (1-D integers in
    /// [0, 2^32)): matches whole pages in the prefix cache (at least one token is left to
    /// prefill), restores their Indexer-K in the background, and leaves their main KV on
    /// host. Returns `{"matched_pages", "device_pages", "restored_pages"}`; the request
    /// starts at `matched_pages * page_size` tokens.
    fn admit<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        rid: &Bound<'py, PyAny>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<PyAdmission> {
        let this = slf.as_super().get();
        this.follow(py)?;
        let id = rid_arg(rid)?;
        let toks = token_ids(tokens)?;
        let a = py
            .detach(|| this.inner.run(|s| s.joined()?.admit(id, &toks)))
            .py_err(py)?;
        Ok(PyAdmission::new(&a))
    }

    /// Joined mode: makes layer `layer` of request `rid`'s restored Indexer-K readable (an
    /// event wait, or with `stream` a CUDA stream wait). Raises TransferFailedError if the
    /// restore failed; end the request then.
    #[pyo3(signature = (rid, layer, stream=None))]
    fn wait_prefix(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let this = slf.as_super().get();
        let id = rid_arg(rid)?;
        let l = u32_arg(py, layer, "layer", 0)?;
        let l = u16::try_from(l)
            .map_err(|_| to_py(py, Error::out_of_range("layer", l, 0, this.layers())))?;
        py.detach(|| this.inner.run(|s| s.joined()?.wait_prefix(id, l, stream)))
            .py_err(py)
    }

    /// Joined mode: request `rid`'s Indexer-K device pages, one per page (int64).
    fn indexer_pages<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        rid: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let this = slf.as_super().get();
        let id = rid_arg(rid)?;
        let pages = this.inner.run_py(py, |s| {
            let pages = s.joined()?.indexer_pages(id)?;
            Ok(pages.iter().map(|&p| i64::from(p)).collect::<Vec<_>>())
        })?;
        Ok(PyArray1::from_vec(py, pages))
    }

    /// Joined mode: writes through and inserts every ended request now, waiting for the
    /// copies (so the next admission sees their pages).
    fn flush_finished(slf: &Bound<'_, Self>, py: Python<'_>) -> PyResult<()> {
        let this = slf.as_super().get();
        this.follow(py)?;
        py.detach(|| this.inner.run(|s| s.joined()?.flush_finished()))
            .py_err(py)
    }

    /// Joined mode: evicts up to `device` Indexer-K device pages and `host` host pages of
    /// unlocked prefixes (their main-KV objects go with their host pages). Returns (device
    /// pages freed, host pages freed).
    fn evict_prefix(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        device: &Bound<'_, PyAny>,
        host: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize)> {
        let this = slf.as_super().get();
        let d = u32_arg(py, device, "device", 0)? as usize;
        let h = u32_arg(py, host, "host", 0)? as usize;
        this.inner.run_py(py, |s| s.joined()?.evict_prefix(d, h))
    }
}
