//! `JoinedStepScheduler`: a step scheduler joined with a prefix cache (`StepScheduler.joined`),
//! a subclass with the calls only that mode has: admission by prefix match, the Indexer-K
//! restore's waits, the flush of ended requests into the cache, its eviction. A plain
//! scheduler has none of them, so calling one is an `AttributeError` at once rather than a
//! refusal at run time.

use crate::error::Error;
use crate::py::error::{to_py, IntoPyResult};
use crate::py::joined_storage::PyJoinedStorage;
use crate::py::lock::Unblocked;
use crate::py::radix::storage_args;
use crate::py::resolver::PyDeviceResolver;
use crate::py::scheduler::PyStepScheduler;
use crate::py::scheduler_args::{rid as rid_arg, rid_list, token_ids, u32_arg};
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
    /// Joined mode: admits request `rid` with its prompt `tokens` (1-D integers in [0, 2^32), or
    /// bytes of little-endian uint32 ids, as `HiCache` reads them): matches whole pages in the
    /// prefix cache (at least one token is left to prefill), restores their Indexer-K in the
    /// background, and leaves their main KV on host. Returns `{"matched_pages", "device_pages",
    /// "restored_pages"}`; the request starts at `matched_pages * page_size` tokens.
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
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let this = slf.as_super().get();
        let stream = crate::py::args::opt_stream(stream)?;
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

    /// Starts resolving decode steps on the device: returns the `DeviceResolver` (the same
    /// one on every call). Each decode step is then `append`, `begin_device_step`, the
    /// resolver once a layer, `end_step`: a fixed number of calls into the scheduler a step.
    /// The scheduler stops prefetching (the resolver serves its misses itself). Runs the
    /// reference implementation on the cpu engine's pools, and the CUDA kernel on CUDA pools
    /// (whose host pool must be pinned: the kernel reads it over unified addressing; never
    /// run on a GPU yet).
    fn enable_device_resolver(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
    ) -> PyResult<Py<PyDeviceResolver>> {
        let this = slf.as_super().get();
        let (state, gpu) = this.inner.run_py(py, |s| {
            let j = s.joined()?;
            let state = j.enable_device_resolver()?;
            Ok((state, j.device_resolver_gpu()))
        })?;
        let owner: Py<PyStepScheduler> = slf.as_super().clone().unbind();
        Py::new(py, PyDeviceResolver::new(py, state, owner, gpu))
    }

    /// Grants the device decode step of `rids` (after `append`), whose rows have at most
    /// `entries` entries a layer: the mirror brought up to date, the batch's page tables, a
    /// granted slot for every cell. Returns False when the device cannot grant that many:
    /// plan this step on the host (`plan`, `ready`, `finish`).
    fn begin_device_step(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        rids: &Bound<'_, PyAny>,
        entries: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let this = slf.as_super().get();
        let ids = rid_list(rids)?;
        let n = u32_arg(py, entries, "entries", 1)? as usize;
        // The step's kernel copies host -> device.
        this.check_memory(py)?;
        // On a GPU the step's work is queued on torch's current stream.
        let gpu = this
            .inner
            .run_py(py, |s| Ok(s.joined()?.device_resolver_gpu()))?;
        let stream = match gpu {
            Some(ordinal) => Some(crate::py::transfer::current_torch_stream(py, ordinal)?),
            None => None,
        };
        py.detach(|| {
            this.inner
                .run(|s| s.joined()?.begin_device_step_on(&ids, n, stream))
        })
        .py_err(py)
    }

    /// Device-resolve counters: steps resolved on the device, steps planned on the host for
    /// want of a grant, grant entries standing (`granted_victims` of them directory objects
    /// pinned as victims), slots filled twice in a step, the slots of
    /// the resolver's pool, the objects only the resolver's slots hold (`pool_live`), the
    /// objects host loads took from the pool instead of copying them (`adopted`), and the
    /// objects the last device step read that host evictions passed over
    /// (`second_chances`), and the second chances the grants gave them
    /// (`grant_second_chances`: once a bitmap; a walk that comes round grants them then).
    fn device_stats<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let this = slf.as_super().get();
        let t = this.inner.run_py(py, |s| Ok(s.joined()?.device_totals()))?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("steps", t.steps)?;
        d.set_item("fallbacks", t.fallbacks)?;
        d.set_item("granted", t.granted)?;
        d.set_item("granted_victims", t.granted_victims)?;
        d.set_item("pool", t.pool)?;
        d.set_item("pool_live", t.pool_live)?;
        d.set_item("refills", t.refills)?;
        d.set_item("adopted", t.adopted)?;
        d.set_item("second_chances", t.second_chances)?;
        d.set_item("grant_second_chances", t.grant_second_chances)?;
        Ok(d)
    }

    /// Puts an L3 tier under the prefix cache's host tier (as `HiCache.enable_storage`: the
    /// core plans writes, `write_policy` "write_back" or "write_through", and prefetches) and
    /// returns the cache as an L3 controller drives it:
    /// `sparsetier.l3.StorageController(scheduler.enable_storage(), backend)`.
    #[pyo3(
        signature = (*, write_policy="write_back", salt="", remember=None, write_ahead=0.1),
        text_signature = "($self, *, write_policy='write_back', salt='', remember=1048576, write_ahead=0.1)"
    )]
    fn enable_storage(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        write_policy: &str,
        salt: &str,
        remember: Option<&Bound<'_, PyAny>>,
        write_ahead: f64,
    ) -> PyResult<Py<PyJoinedStorage>> {
        let remember: usize = match remember {
            Some(r) => crate::py::args::unsigned(r, "remember")?,
            None => 1 << 20,
        };
        let policy = storage_args(py, write_policy, remember)?;
        let this = slf.as_super().get();
        this.inner.run_py(py, |s| {
            s.joined()?
                .with_cache(|c| c.enable_storage(policy, salt.to_owned(), remember, write_ahead))
        })?;
        let page_size = this
            .inner
            .run_py(py, |s| Ok(s.joined()?.config().page_size))?;
        let owner: Py<PyStepScheduler> = slf.as_super().clone().unbind();
        Py::new(py, PyJoinedStorage::new(owner, page_size as usize))
    }

    /// Request `rid`'s restore so far: `{"choice": "indexer" | "full" | "predicted",
    /// "absent", "coverage", "predicted_indexer", "predicted_full", "predicted_pages",
    /// "bulk_objects", "loaded", "bulk_loaded", "bulk_submissions", "on_demand",
    /// "exposed_wait_ns"}`: the objects of its host-restored pages off the device at
    /// admission; the coverage the policy expected (None before a sample); the objects each
    /// choice was predicted to load (NaN without a prediction) and the predicted restore's
    /// bulk part; the objects it loaded so far, each once, of them in bulk at admission (in
    /// `bulk_submissions`, one a layer) and on demand (a copy each); the time its layers
    /// waited on the host. None when its admission restored nothing from host.
    fn restore_status<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        rid: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, pyo3::types::PyDict>>> {
        let this = slf.as_super().get();
        let id = crate::py::scheduler_args::rid(rid)?;
        let Some(st) = this.inner.run_py(py, |s| s.joined()?.restore_status(id))? else {
            return Ok(None);
        };
        let d = pyo3::types::PyDict::new(py);
        let p = st.decision.predicted;
        d.set_item("choice", st.decision.choice.name())?;
        d.set_item("absent", st.decision.absent)?;
        d.set_item("coverage", st.decision.coverage)?;
        d.set_item("predicted_indexer", p.indexer)?;
        d.set_item("predicted_full", p.full)?;
        d.set_item("predicted_pages", p.predicted)?;
        d.set_item("bulk_objects", st.decision.bulk)?;
        d.set_item("loaded", st.loaded)?;
        d.set_item("bulk_loaded", st.bulk_loaded)?;
        d.set_item("bulk_submissions", st.bulk_submissions)?;
        d.set_item("on_demand", st.on_demand)?;
        d.set_item("exposed_wait_ns", st.exposed_wait_ns)?;
        Ok(Some(d))
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
