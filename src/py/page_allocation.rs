//! What `HiCache.alloc_device` returns: the pages of one allocation and its receipt. Passing
//! the allocation itself to `insert` or `free_device` lets the cache take or free exactly
//! these pages: a page list that another allocation (or the cache) holds by now is refused
//! instead of getting a second owner. It reads as an int64 array (`np.asarray(a)`,
//! `a.pages`), so code that wants plain page ids still has them.

use crate::alloc::{Holder, Stamp};
use crate::ids::PageId;
use crate::py::prefix_result::{to_i64, view};
use numpy::ndarray::Array1;
use numpy::PyArray1;
use pyo3::prelude::*;
use std::sync::OnceLock;

/// Device pages handed to a caller, with the receipt that names them.
#[pyclass(name = "PageAllocation", module = "sparsetier._core", frozen, sequence)]
pub struct PyPageAllocation {
    pages: Vec<PageId>,
    receipt: Holder,
    /// The device allocator right after the allocation (see `alloc::Stamp`).
    stamp: Stamp,
    /// `pages` as int64, made on the first access from Python.
    wide: OnceLock<Array1<i64>>,
}

impl PyPageAllocation {
    /// The allocation of `pages` under `receipt`, `stamp` read right after it.
    pub fn new(pages: Vec<PageId>, receipt: Holder, stamp: Stamp) -> PyPageAllocation {
        PyPageAllocation {
            pages,
            receipt,
            stamp,
            wide: OnceLock::new(),
        }
    }

    /// The pages as the cache handed them out (writing into a view does not change them).
    pub fn page_ids(&self) -> &[PageId] {
        &self.pages
    }

    /// The receipt the pages are held under.
    pub fn holder(&self) -> Holder {
        self.receipt
    }

    /// The allocator's stamp right after the allocation.
    pub fn stamp(&self) -> Stamp {
        self.stamp
    }

    fn wide(&self) -> &Array1<i64> {
        self.wide.get_or_init(|| to_i64(self.pages.iter().copied()))
    }
}

#[pymethods]
impl PyPageAllocation {
    /// The page ids, in order (a view of the allocation's buffer).
    #[getter]
    fn pages<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<i64>> {
        let me = slf.get();
        view(slf.as_any(), me.wide(), 0..me.pages.len())
    }

    /// The receipt: an int naming this allocation (unique among live allocations).
    #[getter]
    fn receipt(&self) -> u32 {
        self.receipt.raw()
    }

    fn __len__(&self) -> usize {
        self.pages.len()
    }

    /// `allocation[i]` or a slice, as the array `pages` answers it.
    fn __getitem__<'py>(
        slf: &Bound<'py, Self>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        Self::pages(slf).as_any().get_item(key)
    }

    /// The page ids as a list of ints.
    fn tolist<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Self::pages(slf).as_any().call_method0("tolist")
    }

    fn __iter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        Ok(Self::pages(slf).as_any().try_iter()?.into_any())
    }

    /// The page ids as a numpy array (`np.asarray(allocation)`), in `dtype` if given.
    #[pyo3(signature = (dtype=None, copy=None))]
    fn __array__<'py>(
        slf: &Bound<'py, Self>,
        dtype: Option<&Bound<'py, PyAny>>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = Self::pages(slf).into_any();
        match (dtype, copy) {
            (Some(d), _) => a.call_method1("astype", (d,)),
            (None, Some(true)) => a.call_method0("copy"),
            _ => Ok(a),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "PageAllocation(pages={}, receipt={})",
            self.pages.len(),
            self.receipt.raw()
        )
    }
}
