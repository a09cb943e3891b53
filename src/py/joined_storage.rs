//! `sparsetier._core.JoinedStorage`: a joined scheduler's prefix cache as an L3 controller
//! sees it (`JoinedStepScheduler.enable_storage`). It answers what `sparsetier.l3`'s
//! `StorageController` asks of a `HiCache` (matches, store keys, the L3 protocol), each call
//! under the scheduler's lock and followed by dropping the objects of the host pages the cache
//! let go (`scheduler/storage.rs`).

use crate::error::{Error, Result};
use crate::ids::PageId;
use crate::py::args::unsigned;
use crate::py::error::to_py;
use crate::py::lock::Unblocked;
use crate::py::prefix_result::PyPrefixMatch;
use crate::py::radix::{namespace, plan_tuple, storage_stats, PlanTuple};
use crate::py::scheduler::PyStepScheduler;
use crate::py::scheduler_args::token_ids;
use crate::radix::HiCache;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The prefix cache of a joined scheduler, for an L3 controller
/// (`sparsetier.l3.StorageController(storage, backend)`).
#[pyclass(name = "JoinedStorage", module = "sparsetier._core", frozen)]
pub struct PyJoinedStorage {
    owner: Py<PyStepScheduler>,
    page_size: usize,
}

impl PyJoinedStorage {
    pub(crate) fn new(owner: Py<PyStepScheduler>, page_size: usize) -> Self {
        PyJoinedStorage { owner, page_size }
    }

    /// Runs `f` on the cache, under the scheduler's lock (the GIL released), then drops the
    /// objects of the host pages it let go.
    fn run<R>(&self, py: Python<'_>, f: impl FnOnce(&mut HiCache) -> Result<R>) -> PyResult<R> {
        self.owner
            .get()
            .inner
            .run_py(py, |s| s.joined()?.with_cache(f))
    }

    /// The joined scheduler's cache matches in namespace 0 only.
    fn check_namespace(py: Python<'_>, ns: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
        match namespace(ns)? {
            0 => Ok(0),
            v => Err(to_py(
                py,
                Error::config(
                    "namespace",
                    v,
                    "None or 0 (a joined scheduler's one namespace)",
                ),
            )),
        }
    }
}

#[pymethods]
impl PyJoinedStorage {
    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
    }

    /// The L3 tier's state and counters (as `HiCache.storage_stats`).
    fn storage_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let s = self
            .owner
            .get()
            .inner
            .run_py(py, |s| Ok(storage_stats(s.joined_ref()?.cache())))?;
        s.map(|s| s.to_dict(py)).transpose()
    }

    /// The longest cached prefix of `tokens` (a `PrefixMatch`; nothing locked).
    #[pyo3(signature = (tokens, namespace=None))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPrefixMatch> {
        let ns = Self::check_namespace(py, namespace)?;
        let t = token_ids(tokens)?;
        self.run(py, |c| {
            let m = c.match_prefix(ns, &t);
            let n = m.device_pages.len();
            Ok(PyPrefixMatch::new(m, n, None, c.device_stamp()))
        })
    }

    /// The store keys of the whole pages of `tokens`.
    #[pyo3(signature = (tokens, namespace=None))]
    fn storage_keys(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let ns = Self::check_namespace(py, namespace)?;
        let t = token_ids(tokens)?;
        let keys = self.run(py, |c| c.storage_keys(ns, &t))?;
        Ok(keys.iter().map(ToString::to_string).collect())
    }

    #[pyo3(name = "_set_storage_online")]
    fn set_storage_online(&self, py: Python<'_>, online: bool) -> PyResult<()> {
        self.run(py, |c| c.set_storage_online(online))
    }

    #[pyo3(name = "_storage_write_ahead")]
    fn storage_write_ahead(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |c| c.storage_write_ahead())
    }

    #[pyo3(name = "_take_storage_writes")]
    fn take_storage_writes<'py>(&self, py: Python<'py>) -> PyResult<Vec<PlanTuple<'py>>> {
        self.owner.get().check_memory(py)?; // (the store reads the plans' host pages)
        let plans = self.run(py, |c| c.take_storage_writes())?;
        Ok(plans
            .into_iter()
            .map(|p| plan_tuple(py, p.id, &p.keys, &p.host_pages))
            .collect())
    }

    #[pyo3(name = "_storage_write_done")]
    fn storage_write_done(
        &self,
        py: Python<'_>,
        plan_id: &Bound<'_, PyAny>,
        ok: Vec<bool>,
    ) -> PyResult<()> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        self.run(py, |c| c.storage_write_done(plan_id, &ok))
    }

    #[pyo3(name = "_plan_prefetch", signature = (tokens, start_page, n_pages, namespace=None))]
    fn plan_prefetch<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        start_page: &Bound<'py, PyAny>,
        n_pages: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<PlanTuple<'py>>> {
        // (Making room can copy; the store writes the plan's host pages.)
        self.owner.get().follow(py)?;
        let start_page: usize = unsigned(start_page, "start_page")?;
        let n_pages: usize = unsigned(n_pages, "n_pages")?;
        let ns = Self::check_namespace(py, namespace)?;
        let t = token_ids(tokens)?;
        // Room first, as an admission's own pages get it, the cached prefix kept.
        let plan = self.owner.get().inner.run_py(py, |s| {
            s.joined()?.plan_l3_prefetch(ns, &t, start_page, n_pages)
        })?;
        Ok(plan.map(|p| plan_tuple(py, p.id, &p.keys, &p.host_pages)))
    }

    #[pyo3(name = "_prefetch_commit")]
    fn prefetch_commit(
        &self,
        py: Python<'_>,
        plan_id: &Bound<'_, PyAny>,
        arrived: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        let arrived: usize = unsigned(arrived, "arrived")?;
        self.run(py, |c| c.prefetch_commit(plan_id, arrived))
    }

    #[pyo3(name = "_prefetch_end")]
    fn prefetch_end(&self, py: Python<'_>, plan_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        self.run(py, |c| c.prefetch_end(plan_id))
    }

    #[pyo3(name = "_host_segments")]
    fn host_segments(&self, py: Python<'_>, page: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
        let page: u32 = unsigned(page, "page")?;
        self.owner.get().check_memory(py)?;
        self.run(py, |c| c.host_segments(PageId::new(page)))
    }
}
