//! What `HiCache.match_prefix` and `HiCache.insert` return: small immutable objects instead of
//! dicts. Page ids stay in the cache's own form until Python asks for them; then they are
//! widened to int64 once per result, and every access returns a numpy view of that buffer (no
//! copy per access). `insert(tokens, match)` takes the match's pages without any array. Both
//! also answer `result["field"]` as the dicts they replace did.

use crate::alloc::{Holder, Stamp};
use crate::ids::PageId;
use crate::py::error::contained;
use numpy::ndarray::{s, Array1};
use numpy::PyArray1;
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::OnceLock;

/// A numpy view of `pages[range]` kept alive by `owner`.
pub fn view<'py>(
    owner: &Bound<'py, PyAny>,
    pages: &Array1<i64>,
    range: std::ops::Range<usize>,
) -> Bound<'py, PyArray1<i64>> {
    let part = pages.slice(s![range]);
    // SAFETY: `pages` lives in `owner`, a frozen pyclass whose int64 buffer is never resized
    // or moved once made; the view holds a reference to `owner`, so the buffer outlives it. The
    // view stays writable (torch warns on read-only arrays): a caller writing into it changes
    // only that buffer, not the pages `insert` takes from the result.
    unsafe { PyArray1::borrow_from_array(&part, owner.clone()) }
}

pub fn to_i64(pages: impl IntoIterator<Item = PageId>) -> Array1<i64> {
    pages.into_iter().map(|p| i64::from(p.raw())).collect()
}

/// The longest cached prefix of a request.
#[pyclass(name = "PrefixMatch", module = "sparsetier._core", frozen)]
pub struct PyPrefixMatch {
    #[pyo3(get)]
    device_len: usize,
    #[pyo3(get)]
    host_len: usize,
    #[pyo3(get)]
    device_node: u64,
    #[pyo3(get)]
    last_node: u64,
    /// Device pages of the match, then (with `alloc`) the new pages for the rest.
    pages: Vec<PageId>,
    n_device: usize,
    /// The receipt of the new pages (with `alloc`): `insert` and `free_device` take those
    /// pages only while this allocation still holds them.
    receipt: Option<Holder>,
    /// The device allocator right after the allocation: while it holds, `insert` takes the
    /// new pages without reading them one by one.
    stamp: Stamp,
    /// `pages` as int64, made on the first access from Python.
    wide: OnceLock<Array1<i64>>,
}

impl PyPrefixMatch {
    /// A match whose `device_pages` hold its `n_device` matched pages, then (with a
    /// `receipt`) the new ones.
    pub fn new(
        m: crate::radix::MatchResult,
        n_device: usize,
        receipt: Option<Holder>,
        stamp: Stamp,
    ) -> PyPrefixMatch {
        let pages = m.device_pages;
        PyPrefixMatch {
            device_len: m.device_len,
            host_len: m.host_len,
            device_node: m.device_node.raw(),
            last_node: m.last_node.raw(),
            pages,
            n_device,
            receipt,
            stamp,
            wide: OnceLock::new(),
        }
    }

    /// Every page of the result (matched device pages, then new ones), for `insert`: the
    /// pages the cache returned (writing into a view does not change them).
    pub fn page_ids(&self) -> &[PageId] {
        &self.pages
    }

    /// The receipt of the new pages, if the match allocated any.
    pub fn holder(&self) -> Option<Holder> {
        self.receipt
    }

    /// The allocator's stamp after the allocation, and where the new pages start.
    pub fn fresh(&self) -> (Stamp, usize) {
        (self.stamp, self.n_device)
    }

    /// The new pages (empty without `alloc`).
    pub fn new_page_ids(&self) -> &[PageId] {
        &self.pages[self.n_device..]
    }

    fn wide(&self) -> &Array1<i64> {
        self.wide.get_or_init(|| to_i64(self.pages.iter().copied()))
    }
}

#[pymethods]
impl PyPrefixMatch {
    /// Device pages of the matched prefix, in order (a view of the result's buffer).
    #[getter]
    fn device_pages<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<i64>> {
        let me = slf.get();
        view(slf.as_any(), me.wide(), 0..me.n_device)
    }

    /// With `alloc=True`: the device pages allocated for the rest of the tokens; else None.
    #[getter]
    fn new_pages<'py>(slf: &Bound<'py, Self>) -> Option<Bound<'py, PyArray1<i64>>> {
        let me = slf.get();
        me.receipt
            .is_some()
            .then(|| view(slf.as_any(), me.wide(), me.n_device..me.pages.len()))
    }

    /// The matched device pages followed by the new ones: what `insert` takes (pass the match
    /// itself to `insert` to skip this array).
    #[getter]
    fn pages<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<i64>> {
        let me = slf.get();
        view(slf.as_any(), me.wide(), 0..me.pages.len())
    }

    fn __getitem__<'py>(slf: &Bound<'py, Self>, key: &str) -> PyResult<Bound<'py, PyAny>> {
        contained(|| {
            let py = slf.py();
            let me = slf.get();
            Ok(match key {
                "device_len" => me.device_len.into_pyobject(py)?.into_any(),
                "host_len" => me.host_len.into_pyobject(py)?.into_any(),
                "device_node" => me.device_node.into_pyobject(py)?.into_any(),
                "last_node" => me.last_node.into_pyobject(py)?.into_any(),
                "device_pages" => Self::device_pages(slf).into_any(),
                "new_pages" if me.receipt.is_some() => {
                    Self::new_pages(slf).into_pyobject(py)?.into_any()
                }
                _ => return Err(PyKeyError::new_err(key.to_owned())),
            })
        })
    }

    fn __contains__(&self, key: &str) -> bool {
        matches!(
            key,
            "device_len" | "host_len" | "device_node" | "last_node" | "device_pages"
        ) || (key == "new_pages" && self.receipt.is_some())
    }

    /// The fields as a dict (what `match_prefix` returned before).
    fn to_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        contained(|| {
            let d = PyDict::new(slf.py());
            for k in [
                "device_len",
                "host_len",
                "device_pages",
                "device_node",
                "last_node",
            ] {
                d.set_item(k, Self::__getitem__(slf, k)?)?;
            }
            if slf.get().receipt.is_some() {
                d.set_item("new_pages", Self::__getitem__(slf, "new_pages")?)?;
            }
            Ok(d)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixMatch(device_len={}, host_len={}, device_node={}, last_node={}, pages={})",
            self.device_len,
            self.host_len,
            self.device_node,
            self.last_node,
            self.pages.len()
        )
    }
}

/// What an insert did.
#[pyclass(name = "PrefixInsert", module = "sparsetier._core", frozen)]
pub struct PyPrefixInsert {
    #[pyo3(get)]
    prefix_len: usize,
    #[pyo3(get)]
    last_node: u64,
    duplicates: Array1<i64>,
}

impl PyPrefixInsert {
    pub fn new(r: &crate::radix::InsertResult) -> PyPrefixInsert {
        PyPrefixInsert {
            prefix_len: r.prefix_len,
            last_node: r.last_node.raw(),
            duplicates: to_i64(r.duplicates.iter().copied()),
        }
    }
}

#[pymethods]
impl PyPrefixInsert {
    /// Given pages that duplicated pages already cached (freed by the insert).
    #[getter]
    fn duplicates<'py>(slf: &Bound<'py, Self>) -> Bound<'py, PyArray1<i64>> {
        let me = slf.get();
        view(slf.as_any(), &me.duplicates, 0..me.duplicates.len())
    }

    fn __getitem__<'py>(slf: &Bound<'py, Self>, key: &str) -> PyResult<Bound<'py, PyAny>> {
        contained(|| {
            let py = slf.py();
            let me = slf.get();
            Ok(match key {
                "prefix_len" => me.prefix_len.into_pyobject(py)?.into_any(),
                "last_node" => me.last_node.into_pyobject(py)?.into_any(),
                "duplicates" => Self::duplicates(slf).into_any(),
                _ => return Err(PyKeyError::new_err(key.to_owned())),
            })
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixInsert(prefix_len={}, last_node={}, duplicates={})",
            self.prefix_len,
            self.last_node,
            self.duplicates.len()
        )
    }
}
