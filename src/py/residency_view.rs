//! `ResidencyView`: the step scheduler's residency directory, read only.
//!
//! The scheduler owns every transition of its directory; a caller that could evict, release
//! or complete on it would break the scheduler's books. The view answers what a caller may
//! ask (counts, one object's state, the invariants) and nothing else.

use crate::directory::Directory;
use crate::py::directory::PyResidencyDirectory;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;

#[pyclass(name = "ResidencyView", module = "sparsetier._core", frozen)]
pub struct PyResidencyView {
    dir: PyResidencyDirectory,
}

impl PyResidencyView {
    pub(crate) fn of(dir: Arc<Directory>) -> Self {
        PyResidencyView {
            dir: PyResidencyDirectory::shared(dir),
        }
    }
}

#[pymethods]
impl PyResidencyView {
    /// Counts now (objects by state, pins, slots, transfers in flight), with cumulative totals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.dir.stats(py)
    }

    /// The state of the object at `key` (a `(namespace, version, page, layer)` tuple), or
    /// None when the directory does not hold it.
    fn state<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.dir.state(key)
    }

    /// Raises InvariantError if any invariant of the directory is broken.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.dir.validate(py)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.dir.stats(py)?;
        Ok(format!(
            "ResidencyView(objects={}, pins={})",
            s.get_item("objects")?
                .map_or(0, |v| v.extract().unwrap_or(0u64)),
            s.get_item("pins")?
                .map_or(0, |v| v.extract().unwrap_or(0u64)),
        ))
    }
}
