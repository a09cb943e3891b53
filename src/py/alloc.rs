//! `sparsetier.PageAllocator`: the all-or-nothing page allocator of one tier.
//!
//! Pages cross the boundary as numpy int64 arrays (one call per batch, never per page).

use crate::alloc::PageAllocator;
use crate::error::Error;
use crate::guard::Guarded;
use crate::ids::PageId;
use crate::py::args::{int, int64_array};
use crate::py::error::{to_py, IntoPyResult};
use crate::py::lock::Unblocked;
use numpy::PyArray1;
use pyo3::prelude::*;

/// Fixed-capacity page allocator: batch `alloc(n)` / `free(pages)`, all-or-nothing.
#[pyclass(name = "PageAllocator", module = "sparsetier._core", frozen)]
pub struct PyPageAllocator {
    /// Behind a guard: a panic inside (a bug) is `InternalError`, and the allocator refuses
    /// every later call (`crate::guard`).
    inner: Guarded<PageAllocator>,
}

/// Reads a 1-D array of page ids (numpy array, torch CPU tensor or list) as `PageId`s. Every
/// value must fit a page id; range and ownership are the allocator's to check.
pub fn page_ids(obj: &Bound<'_, PyAny>, field: &'static str) -> PyResult<Vec<PageId>> {
    let py = obj.py();
    let arr = int64_array(obj, field, "integer page ids")?;
    let view = arr.as_slice().map_err(|_| {
        to_py(
            py,
            Error::config(field, "a non-contiguous array", "a contiguous 1-D array"),
        )
    })?;
    view.iter()
        .map(|&v| {
            u32::try_from(v).map(PageId::new).map_err(|_| {
                to_py(
                    py,
                    Error::out_of_range(field, v, 0, i128::from(u32::MAX) + 1),
                )
            })
        })
        .collect()
}

/// Page ids as a numpy int64 array.
pub fn page_array<'py>(py: Python<'py>, pages: &[PageId]) -> Bound<'py, PyArray1<i64>> {
    let raw: Vec<i64> = pages.iter().map(|p| i64::from(p.raw())).collect();
    PyArray1::from_vec(py, raw)
}

#[pymethods]
impl PyPageAllocator {
    #[new]
    #[pyo3(signature = (pages, reserve_pages=None), text_signature = "(pages, reserve_pages=0)")]
    fn new(pages: &Bound<'_, PyAny>, reserve_pages: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let py = pages.py();
        let total = crate::config::positive_u32("pages", int(pages, "pages")?).py_err(py)?;
        let reserve = match reserve_pages {
            Some(r) if !r.is_none() => {
                crate::config::non_negative_u32("reserve_pages", int(r, "reserve_pages")?)
                    .py_err(py)?
            }
            _ => 0,
        };
        Ok(PyPageAllocator {
            inner: Guarded::new(PageAllocator::new(total, reserve).py_err(py)?),
        })
    }

    /// Allocates `n` pages or raises `OutOfPagesError` having allocated nothing.
    fn alloc<'py>(&self, n: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let py = n.py();
        let v = int(n, "n")?;
        let n = match usize::try_from(v) {
            Ok(n) => n,
            Err(_) => {
                let cap = self.capacity(py)?;
                let allowed = format!("an integer with 0 <= n <= {cap}");
                return Err(to_py(py, Error::config("n", v, allowed)));
            }
        };
        let pages = self.inner.run_py(py, |a| a.alloc(n))?;
        Ok(page_array(py, &pages))
    }

    /// Frees `pages` or raises `AllocatorError` having freed nothing.
    fn free(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = page_ids(pages, "pages")?;
        self.inner.run_py(pages.py(), |a| a.free(&ids))
    }

    /// Whether `page` is handed out now.
    fn is_allocated(&self, page: &Bound<'_, PyAny>) -> PyResult<bool> {
        let v = int(page, "page")?;
        let Ok(p) = u32::try_from(v) else {
            return Ok(false);
        };
        self.inner
            .get_py(page.py(), |a| a.is_allocated(PageId::new(p)))
    }

    /// Raises `InvariantError` if an allocator invariant is broken.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.get_py(py, |a| a.validate())?.map_err(|why| {
            crate::py::error::typed_error(py, "InvariantError", why, &pyo3::types::PyDict::new(py))
        })
    }

    /// Usable pages (reserve excluded).
    #[getter]
    fn capacity(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.get_py(py, |a| a.capacity())
    }
    /// Pages of the buffer, reserve included.
    #[getter]
    fn total_pages(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.get_py(py, |a| a.total_pages())
    }
    /// Reserved pages at the front of the buffer.
    #[getter]
    fn reserve_pages(&self, py: Python<'_>) -> PyResult<u32> {
        self.inner.get_py(py, |a| a.reserve_pages())
    }
    /// Pages free now.
    #[getter]
    fn free_count(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.get_py(py, |a| a.free_count())
    }
    /// Pages handed out now.
    #[getter]
    fn used_count(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.get_py(py, |a| a.used_count())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.inner.get_py(py, |a| {
            format!(
                "PageAllocator(capacity={}, free={}, used={}, reserve_pages={})",
                a.capacity(),
                a.free_count(),
                a.used_count(),
                a.reserve_pages()
            )
        })
    }
}
