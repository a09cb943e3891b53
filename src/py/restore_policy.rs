//! `sparsetier._core.RestorePolicy`: the joined scheduler's restore policy on its own (what a
//! prefix hit restores of its main KV, `scheduler/restore_policy.rs`), for `bench
//! prefix-sparse` to judge it against the fixed choices with the same cost model the core
//! decides by.

use crate::error::Error;
use crate::py::args::{unsigned, unsigned_array};
use crate::py::error::IntoPyResult;
use crate::scheduler::prefix::DEFAULT_COPY_OVERHEAD;
use crate::scheduler::restore_policy::{RestoreMode, RestorePolicy};
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
        signature = (mode="auto", copy_overhead=None),
        text_signature = "(mode='auto', copy_overhead=16384)"
    )]
    fn new(py: Python<'_>, mode: &str, copy_overhead: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let mode = RestoreMode::parse(mode).py_err(py)?;
        // (Within u32, as the joined scheduler's `restore_copy_overhead`.)
        let copy_overhead = match copy_overhead {
            Some(c) if !c.is_none() => u64::from(unsigned::<u32>(c, "copy_overhead")?),
            _ => DEFAULT_COPY_OVERHEAD,
        };
        Ok(PyRestorePolicy {
            inner: Mutex::new(RestorePolicy::new(mode, copy_overhead)),
        })
    }

    /// A request with a `suffix`-token prefill that restored Indexer-K only, over a prefix
    /// whose pages from `first` on were restored from host: `absent[i]` main-KV objects of
    /// page `first + i` were off the device at its admission, and it loaded `loaded[i]` of
    /// them.
    #[pyo3(
        signature = (suffix, absent, loaded, first=None),
        text_signature = "($self, suffix, absent, loaded, first=0)"
    )]
    fn learn(
        &self,
        py: Python<'_>,
        suffix: &Bound<'_, PyAny>,
        absent: &Bound<'_, PyAny>,
        loaded: &Bound<'_, PyAny>,
        first: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let suffix: u64 = unsigned(suffix, "suffix")?;
        let absent: Vec<u32> = unsigned_array(absent, "absent")?;
        let loaded: Vec<u32> = unsigned_array(loaded, "loaded")?;
        let first = first_page(first)?;
        if loaded.len() != absent.len() {
            return Err(Error::config(
                "loaded",
                format!("{} pages", loaded.len()),
                format!("one count per page of absent ({})", absent.len()),
            ))
            .py_err(py);
        }
        if let Some(i) = (0..absent.len()).find(|&i| loaded[i] > absent[i]) {
            return Err(Error::config(
                format!("loaded[{i}]"),
                loaded[i],
                format!(
                    "at most absent[{i}] ({}): the objects that were off the device",
                    absent[i]
                ),
            ))
            .py_err(py);
        }
        let matched = matched(py, first, &absent)?;
        self.inner
            .lock()
            .learn(suffix, first, matched, &absent, &loaded);
        Ok(())
    }

    /// The coverage expected for a `suffix`-token prefill, or None before any sample.
    fn coverage(&self, suffix: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        let suffix: u64 = unsigned(suffix, "suffix")?;
        Ok(self.inner.lock().coverage(suffix))
    }

    /// The decision for an admission whose prefix pages from `first` on were restored from
    /// host, `absent[i]` main-KV objects of page `first + i` off the device, over `layers`
    /// layers, with a `suffix`-token prefill and `object_bytes` per object: `{"choice":
    /// "indexer" | "full" | "predicted", "coverage", "objects_indexer", "objects_full",
    /// "objects_predicted", "bulk_objects", "pages"}` (the objects each choice was predicted
    /// to load, NaN without a prediction; what the predicted restore loads in bulk; the pages
    /// it restores when chosen).
    #[pyo3(
        signature = (absent, layers, suffix, object_bytes, first=None),
        text_signature = "($self, absent, layers, suffix, object_bytes, first=0)"
    )]
    fn decide<'py>(
        &self,
        py: Python<'py>,
        absent: &Bound<'py, PyAny>,
        layers: &Bound<'py, PyAny>,
        suffix: &Bound<'py, PyAny>,
        object_bytes: &Bound<'py, PyAny>,
        first: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let absent: Vec<u32> = unsigned_array(absent, "absent")?;
        let layers: u64 = unsigned(layers, "layers")?;
        let suffix: u64 = unsigned(suffix, "suffix")?;
        let object_bytes: u64 = unsigned(object_bytes, "object_bytes")?;
        let first = first_page(first)?;
        let matched = matched(py, first, &absent)?;
        if object_bytes == 0 {
            return Err(Error::config("object_bytes", 0, "an integer >= 1")).py_err(py);
        }
        if layers == 0 {
            return Err(Error::config("layers", 0, "an integer >= 1")).py_err(py);
        }
        // (A page has an object a layer.)
        if let Some(i) = absent.iter().position(|&a| u64::from(a) > layers) {
            return Err(Error::config(
                format!("absent[{i}]"),
                absent[i],
                format!("at most layers ({layers}) objects a page"),
            ))
            .py_err(py);
        }
        let (d, pages) =
            self.inner
                .lock()
                .decide(first, matched, &absent, layers, suffix, object_bytes);
        let out = PyDict::new(py);
        out.set_item("choice", d.choice.name())?;
        out.set_item("coverage", d.coverage)?;
        out.set_item("objects_indexer", d.predicted.indexer)?;
        out.set_item("objects_full", d.predicted.full)?;
        out.set_item("objects_predicted", d.predicted.predicted)?;
        out.set_item("bulk_objects", d.bulk)?;
        out.set_item("pages", pages)?;
        Ok(out)
    }
}

/// The prefix's pages: `first` and one per count, within u32.
fn matched(py: Python<'_>, first: u32, absent: &[u32]) -> PyResult<u32> {
    u32::try_from(absent.len())
        .ok()
        .and_then(|n| first.checked_add(n))
        .ok_or_else(|| Error::config("first", first, "first + len(absent) pages within 2^32 - 1"))
        .py_err(py)
}

/// `first` (default 0): a page index within u32.
fn first_page(first: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
    match first {
        Some(f) if !f.is_none() => unsigned(f, "first"),
        _ => Ok(0),
    }
}
