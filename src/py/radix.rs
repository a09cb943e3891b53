//! `sparsetier.HiCache`: the hierarchical prefix cache from Python.
//!
//! Tokens cross as one int array per call (numpy, torch or list), page ids come back as numpy
//! int64 arrays, node ids as ints (stale ids raise instead of aliasing). The cache keeps the
//! pool tensors alive and, when dropped, waits for its transfers before letting them go.

use crate::alloc::Expect;
use crate::config::HitPolicy;
use crate::error::Error;
use crate::guard::Guarded;
use crate::ids::PageId;
use crate::py::alloc::{page_array, page_ids};
use crate::py::args::{int, opt_int, unsigned};
#[cfg(feature = "testing")]
use crate::py::error::contained;
use crate::py::error::{to_py, IntoPyResult};
use crate::py::lock::Unblocked;
use crate::py::page_allocation::PyPageAllocation;
use crate::py::prefix_result::{PyPrefixInsert, PyPrefixMatch};
use crate::py::scheduler_args::check_tiers;
use crate::py::stats::Stats;
use crate::py::tokens::{with_lookup, with_tokens, Lookup};
use crate::py::transfer::{BoundMemory, PyPageTransferBinding, PyTransferEngine};
use crate::radix::storage::L3State;
use crate::radix::{HiCache, HiCacheConfig, NodeId, PageKey, PoolPair, WritePolicy};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(super) fn namespace(obj: Option<&Bound<'_, PyAny>>) -> PyResult<u32> {
    match opt_int(obj, "namespace")? {
        None => Ok(0),
        Some(v) => u32::try_from(v).map_err(|_| {
            Python::attach(|py| {
                to_py(
                    py,
                    Error::out_of_range("namespace", v, 0, i128::from(u32::MAX) + 1),
                )
            })
        }),
    }
}

fn node(obj: &Bound<'_, PyAny>) -> PyResult<NodeId> {
    let v = int(obj, "node")?;
    u64::try_from(v)
        .map(NodeId::from_raw)
        .map_err(|_| to_py(obj.py(), Error::UnknownNode { id: v as u64 }))
}

/// A storage plan as Python gets it: (id, keys, host pages).
pub(super) type PlanTuple<'py> = (u64, Vec<String>, Bound<'py, PyArray1<i64>>);

/// A storage plan for Python.
pub(super) fn plan_tuple<'py>(
    py: Python<'py>,
    id: u64,
    keys: &[PageKey],
    pages: &[PageId],
) -> PlanTuple<'py> {
    let keys = keys.iter().map(ToString::to_string).collect();
    (id, keys, page_array(py, pages))
}

/// `enable_storage`'s checked arguments: the write policy by name, and a non-zero `remember`.
pub(super) fn storage_args(
    py: Python<'_>,
    write_policy: &str,
    remember: usize,
) -> PyResult<WritePolicy> {
    let policy = WritePolicy::parse(write_policy).ok_or_else(|| {
        to_py(
            py,
            Error::config(
                "write_policy",
                format!("{write_policy:?}"),
                "'write_back' or 'write_through'",
            ),
        )
    })?;
    if remember == 0 {
        return Err(to_py(py, Error::config("remember", 0, ">= 1 keys")));
    }
    Ok(policy)
}

fn parse_key(s: &str) -> Option<PageKey> {
    if s.len() != 32 || !s.is_ascii() {
        return None;
    }
    let mut k = [0u8; 16];
    for (i, b) in k.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(PageKey(k))
}

/// One pool as the constructor takes it: (device binding, host binding, SWA window).
type PoolArg<'py> = (
    PyRef<'py, PyPageTransferBinding>,
    PyRef<'py, PyPageTransferBinding>,
    Option<u32>,
);

/// The hierarchical prefix cache.
#[pyclass(name = "HiCache", module = "sparsetier._core", frozen)]
pub struct PyHiCache {
    /// The cache, behind a guard that turns a panic inside into `InternalError` and refuses
    /// every later call (`crate::guard`).
    inner: Guarded<HiCache>,
    page_size: usize,
    _tensors: Vec<Py<PyAny>>,
    /// The pools' storages as bound, checked before each flush submits copies.
    memory: Vec<(String, BoundMemory)>,
    engine: Option<Py<PyTransferEngine>>,
}

impl Drop for PyHiCache {
    fn drop(&mut self) {
        // The engine may still write our tensors: wait before they are released.
        let poisoned = self.inner.poison().get().is_some();
        let c = self.inner.get_mut();
        let drained = !poisoned && catch_unwind(AssertUnwindSafe(|| c.drain())).is_ok();
        if !drained {
            // After an internal error the books may miss a transfer still in flight: the
            // pools' tensors stay alive for good rather than a copy writing freed memory.
            Python::attach(|py| {
                for t in &self._tensors {
                    std::mem::forget(t.clone_ref(py));
                }
            });
        }
    }
}

impl PyHiCache {
    /// Refuses pools resized or freed since bound (copies, or the store, would use memory
    /// that is gone).
    fn check_memory(&self, py: Python<'_>) -> PyResult<()> {
        for (field, m) in &self.memory {
            m.check(py, field)?;
        }
        Ok(())
    }

    /// Runs `f` over tokens borrowed from a caller's buffer under the cache's lock: at once
    /// if the lock is free (read with the GIL held, no Python thread writes the buffer
    /// meanwhile), else over a copy taken before the GIL is let go to wait for it.
    #[track_caller]
    fn run_tokens<R>(
        &self,
        py: Python<'_>,
        t: Lookup<'_>,
        f: impl Fn(&mut HiCache, Lookup<'_>) -> crate::Result<R>,
    ) -> PyResult<R> {
        let site = std::panic::Location::caller();
        if let Some(r) = self.inner.try_run_at(site, |c| f(c, t)) {
            return r.py_err(py);
        }
        let owned = t.copied();
        self.inner.run_py(py, |c| f(c, owned.view()))
    }
}

#[pymethods]
impl PyHiCache {
    /// A cache of `device_pages` (and `host_pages`) pages of `page_size` tokens. With `pools`
    /// (a list of `(device_binding, host_binding, window)`, window None but for SWA) and an
    /// `engine`, pages move between the tiers; without, it is a device-only prefix cache.
    /// `drop_unbacked` (default: True exactly when there are no pools) lets device eviction drop
    /// leaves that have no host copy; False with no pools is refused (nothing could be evicted).
    #[new]
    #[pyo3(
        signature = (page_size, device_pages, *, host_pages=None, device_reserve=None, host_reserve=None, pools=None, engine=None, drop_unbacked=None),
        text_signature = "(page_size, device_pages, *, host_pages=0, device_reserve=0, host_reserve=0, pools=None, engine=None, drop_unbacked=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        page_size: &Bound<'_, PyAny>,
        device_pages: &Bound<'_, PyAny>,
        host_pages: Option<&Bound<'_, PyAny>>,
        device_reserve: Option<&Bound<'_, PyAny>>,
        host_reserve: Option<&Bound<'_, PyAny>>,
        pools: Option<Vec<PoolArg<'_>>>,
        engine: Option<PyRef<'_, PyTransferEngine>>,
        drop_unbacked: Option<bool>,
    ) -> PyResult<Self> {
        // Default: a cache that backs pages up keeps them until backed up; a device-only one
        // (no pools) drops them, or it could never evict.
        let drop_unbacked = drop_unbacked.unwrap_or(pools.as_ref().is_none_or(Vec::is_empty));
        use crate::config::{non_negative_u32, positive_u32};
        let cfg = HiCacheConfig {
            page_size: positive_u32("page_size", int(page_size, "page_size")?).py_err(py)? as usize,
            device_pages: positive_u32("device_pages", int(device_pages, "device_pages")?)
                .py_err(py)?,
            device_reserve: non_negative_u32(
                "device_reserve",
                opt_int(device_reserve, "device_reserve")?.unwrap_or(0),
            )
            .py_err(py)?,
            host_pages: non_negative_u32(
                "host_pages",
                opt_int(host_pages, "host_pages")?.unwrap_or(0),
            )
            .py_err(py)?,
            host_reserve: non_negative_u32(
                "host_reserve",
                opt_int(host_reserve, "host_reserve")?.unwrap_or(0),
            )
            .py_err(py)?,
            drop_unbacked,
        };
        let mut pairs = Vec::new();
        let mut tensors = Vec::new();
        let mut memory = Vec::new();
        let pools = pools.unwrap_or_default();
        for (i, (d, h, window)) in pools.iter().enumerate() {
            // Each pair where the engine copies: device memory of its kind (cuda tensors for
            // the CUDA engines, cpu ones for the cpu engine), host memory on the host (pinned
            // for the CUDA engines). A cpu engine would read a cuda tensor's address as host
            // memory.
            let (df, hf) = (format!("pools[{i}][0]"), format!("pools[{i}][1]"));
            if let Some(e) = engine.as_ref() {
                check_tiers(py, e, &[(df.as_str(), &**d)], &[(hf.as_str(), &**h)])?;
            }
            let hit = match window {
                None => HitPolicy::AllPages,
                Some(0) => {
                    return Err(to_py(
                        py,
                        Error::config(
                            format!("pools[{i}][2]"),
                            0,
                            "None or a window of >= 1 tokens",
                        ),
                    ))
                }
                Some(w) => HitPolicy::Window(*w),
            };
            pairs.push(PoolPair {
                device: Some(d.inner.clone()),
                host: h.inner.clone(),
                hit,
            });
            // (Their storages: what the copies use, whatever becomes of the tensors.)
            tensors.push(d.memory.keep(py));
            tensors.push(h.memory.keep(py));
            memory.push((format!("pools[{i}][0]"), d.memory.clone_ref(py)));
            memory.push((format!("pools[{i}][1]"), h.memory.clone_ref(py)));
        }
        let shared = engine.as_ref().map(|e| e.shared());
        let inner = HiCache::new(cfg, pairs, shared).py_err(py)?;
        Ok(PyHiCache {
            page_size: inner.tree().page_size(),
            inner: Guarded::new(inner),
            _tensors: tensors,
            memory,
            engine: engine.map(|e| e.into()),
        })
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
    }

    /// The longest cached prefix, as a `PrefixMatch` (`device_len`, `host_len`, `device_pages`,
    /// `device_node`, `last_node`; also readable as `m["device_len"]`...). Lock `device_node` to
    /// keep the device pages; `load_back(last_node)` restores the host part. With `lock`,
    /// `device_node` is locked in the same call; with `alloc` (which implies `lock`), device
    /// pages for the rest of the tokens are allocated too (evicting as needed) and returned as
    /// `new_pages`, all or nothing: on `OutOfPagesError` nothing stays locked or allocated.
    /// Pass the match itself to `insert` as its pages.
    #[pyo3(signature = (tokens, namespace=None, *, lock=false, alloc=false))]
    fn match_prefix(
        &self,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        lock: bool,
        alloc: bool,
    ) -> PyResult<PyPrefixMatch> {
        let py = tokens.py();
        let ns = self::namespace(namespace)?;
        // The tokens are borrowed (or converted) before the lock: their conversion may run
        // Python code, which never runs under a core lock.
        with_lookup(tokens, |t| {
            let n = t.len();
            self.run_tokens(py, t, |c, t| {
                let mut m = match t {
                    Lookup::U32(t) => c.match_prefix(ns, t),
                    // Read only as far as the match goes: a bad id after it is refused by
                    // `insert`, which then inserts nothing (the caller frees the new pages).
                    Lookup::I64(t) => c.match_prefix(ns, t),
                };
                if lock || alloc {
                    c.lock(m.device_node)?;
                }
                let n_device = m.device_pages.len();
                let mut receipt = None;
                if alloc {
                    // The new pages go after the matched ones, in the match's own array.
                    let ps = c.tree().page_size();
                    match c.alloc_device_into(n / ps - m.device_len / ps, &mut m.device_pages) {
                        Ok(r) => receipt = Some(r),
                        Err(e) => {
                            c.unlock(m.device_node)?;
                            return Err(e);
                        }
                    }
                }
                Ok(PyPrefixMatch::new(m, n_device, receipt, c.device_stamp()))
            })
        })
    }

    /// Inserts `tokens` with one device page per whole page (fresh pages from
    /// `alloc_device`, or the matched path's own pages for the prefix). `device_pages` is the
    /// `PrefixMatch` of `match_prefix(..., alloc=True)` or the `PageAllocation` of
    /// `alloc_device` (their pages, without building an array; every page not the tree's own
    /// at its position must still be that allocation's), or an array of page ids (each such
    /// page must be held by some allocation). Anything else is `NotHeldError` before anything
    /// changes. Duplicates are freed here; write-through backups are queued. With `lock`, the
    /// new path is locked; `unlock` names a node to unlock in the same call (the match's
    /// lock). Returns a `PrefixInsert` (`prefix_len`, `duplicates`, `last_node`).
    #[pyo3(signature = (tokens, device_pages, namespace=None, *, lock=false, unlock=None))]
    fn insert(
        &self,
        tokens: &Bound<'_, PyAny>,
        device_pages: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
        lock: bool,
        unlock: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyPrefixInsert> {
        let py = tokens.py();
        // A match's pages are borrowed (a frozen result: they cannot change), an array's read.
        let given: Vec<PageId>;
        let (pages, expect, fresh) = if let Ok(m) = device_pages.cast::<PyPrefixMatch>() {
            let m = m.get();
            let expect = m.holder().map_or(Expect::Nobody, Expect::Holder);
            (m.page_ids(), expect, Some(m.fresh()))
        } else if let Ok(a) = device_pages.cast::<PyPageAllocation>() {
            let a = a.get();
            (
                a.page_ids(),
                Expect::Holder(a.holder()),
                Some((a.stamp(), 0)),
            )
        } else {
            given = page_ids(device_pages, "device_pages")?;
            (&given[..], Expect::AnyCaller, None)
        };
        let ns = self::namespace(namespace)?;
        let unlock = unlock.map(node).transpose()?;
        with_lookup(tokens, |t| {
            self.run_tokens(py, t, |c, t| {
                // The match's lock goes first, so that a stale or unlocked node is refused
                // before the insert changes anything; an insert that fails takes it again.
                // Nothing evicts in between: the insert allocates no page.
                if let Some(u) = unlock {
                    c.unlock(u)?;
                }
                let r = match t {
                    Lookup::U32(t) => c.insert_held(ns, t, pages, expect, fresh, lock),
                    Lookup::I64(t) => c.insert_held(ns, t, pages, expect, fresh, lock),
                };
                match r {
                    Ok(r) => Ok(PyPrefixInsert::new(&r)),
                    Err(e) => {
                        if let Some(u) = unlock {
                            c.lock(u)?;
                        }
                        Err(e)
                    }
                }
            })
        })
    }

    /// `n` device pages for a request (evicting LRU device leaves if needed), all or nothing:
    /// a `PageAllocation` (its pages, as an array too, and the receipt that names them).
    fn alloc_device(&self, n: &Bound<'_, PyAny>) -> PyResult<PyPageAllocation> {
        let py = n.py();
        let v = int(n, "n")?;
        let n =
            usize::try_from(v).map_err(|_| to_py(py, Error::config("n", v, "an integer >= 0")))?;
        self.inner.run_py(py, |c| {
            let mut pages = Vec::new();
            let receipt = c.alloc_device_into(n, &mut pages)?;
            Ok(PyPageAllocation::new(pages, receipt, c.device_stamp()))
        })
    }

    /// Returns pages that were not inserted: a `PageAllocation` (all its pages), the
    /// `PrefixMatch` of `match_prefix(..., alloc=True)` (its new pages; unlock its node
    /// apart), or an array of pages from allocations. A page its caller does not hold (the
    /// cache's, a free one, another allocation's) is `NotHeldError`, and nothing is freed.
    fn free_device(&self, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = pages.py();
        if let Ok(m) = pages.cast::<PyPrefixMatch>() {
            let m = m.get();
            let Some(r) = m.holder() else {
                let why =
                    "a PrefixMatch from match_prefix(alloc=True), a PageAllocation or an array";
                return Err(to_py(
                    py,
                    Error::config("pages", "a match without new pages", why),
                ));
            };
            return self.inner.run_py(py, |c| {
                c.free_device_held(m.new_page_ids(), Expect::Holder(r))
            });
        }
        if let Ok(a) = pages.cast::<PyPageAllocation>() {
            let a = a.get();
            return self.inner.run_py(py, |c| {
                c.free_device_held(a.page_ids(), Expect::Holder(a.holder()))
            });
        }
        let p: Vec<PageId> = page_ids(pages, "pages")?;
        self.inner.run_py(py, |c| c.free_device(&p))
    }

    /// Removes a namespace (a retired model version) and frees its pages on both tiers;
    /// returns how many. Refused (ConfigError) while a node of it is locked or in flight.
    fn drop_namespace(&self, namespace: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ns = self::namespace(Some(namespace))?;
        self.inner.run_py(namespace.py(), |c| c.drop_namespace(ns))
    }

    /// Locks the path from the root to `node`: none of it is evicted until `unlock`.
    fn lock(&self, node: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::node(node)?;
        self.inner.run_py(node.py(), |c| c.lock(id))
    }

    /// Undoes one `lock`.
    fn unlock(&self, node: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::node(node)?;
        self.inner.run_py(node.py(), |c| c.unlock(id))
    }

    /// Device pages of the path to `node`.
    fn path_device_pages<'py>(
        &self,
        node: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let id = self::node(node)?;
        let p = self
            .inner
            .run_py(node.py(), |c| c.tree().path_device_pages(id))?;
        Ok(page_array(node.py(), &p))
    }

    /// Fault injection for tests: the next `count` device allocations fail with
    /// `OutOfPagesError`, as a full device would.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_inject_alloc_failures", signature = (count=None))]
    fn inject_alloc_failures_hook(
        &self,
        py: Python<'_>,
        count: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let count: u32 = count.map_or(Ok(1), |c| unsigned(c, "count"))?;
        self.inner.get_py(py, |c| c.inject_alloc_failures(count))
    }

    /// Deprecated: `sparsetier.testing.inject_alloc_failures(cache, count)`.
    #[cfg(feature = "testing")]
    #[pyo3(signature = (count=None))]
    fn inject_alloc_failures(
        &self,
        py: Python<'_>,
        count: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        crate::py::error::deprecated(
            py,
            "HiCache.inject_alloc_failures",
            "sparsetier.testing.inject_alloc_failures",
        )?;
        self.inject_alloc_failures_hook(py, count)
    }

    /// Evicts at least `n` device pages (LRU leaves; backed-up nodes keep their host copy).
    fn evict_device(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n: usize = unsigned(n, "n")?;
        self.inner.get_py(py, |c| c.evict_device(n))
    }

    /// Evicts at least `n` host pages of nodes no longer on the device and not locked.
    fn evict_host(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        let n: usize = unsigned(n, "n")?;
        self.inner.run_py(py, |c| c.evict_host(n))
    }

    /// Queues a restore of the host part of the prefix ending at `node` into fresh device pages
    /// of every pool. Returns `{"transfer_id", "tokens", "joined"}`, or None when device pages
    /// cannot be found even after eviction (nothing is half-restored: recompute instead).
    fn load_back<'py>(&self, node: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let py = node.py();
        let id = self::node(node)?;
        let Some(lb) = self.inner.run_py(py, |c| c.load_back(id))? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("transfer_id", lb.transfer)?;
        d.set_item("tokens", lb.tokens)?;
        d.set_item("joined", lb.joined)?;
        Ok(Some(d))
    }

    /// Submits this step's queued backups and loads (at most one transfer each); returns their
    /// ids.
    fn flush(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.check_memory(py)?;
        if let Some(e) = &self.engine {
            e.get().follow_torch_stream(py)?; // copies follow torch's queued writes
        }
        self.inner.run_py(py, |c| c.flush())
    }

    /// Settles finished transfers; returns how many.
    fn poll(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.run_py(py, |c| c.poll())
    }

    /// Waits (GIL released) until every submitted transfer has finished, and settles them.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.run(|c| c.drain())).py_err(py)
    }

    /// Waits (GIL released) for `layer` (or all layers) of submitted transfer `transfer_id`;
    /// raises CopyFailedError if it failed. A transfer already settled returns at once; one
    /// still queued (not flushed) is TransferStateError, another cache's UnknownTransferError.
    #[pyo3(signature = (transfer_id, layer=None, timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        transfer_id: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        // Arguments are checked before the lookup: bad input is an error even when the
        // transfer has already settled.
        let id = int(transfer_id, "transfer_id")?;
        let id = u64::try_from(id).map_err(|_| {
            to_py(
                py,
                Error::out_of_range("transfer_id", id, 0, i128::from(i64::MAX) + 1),
            )
        })?;
        let layer = match opt_int(layer, "layer")? {
            None => None,
            Some(l) => Some(usize::try_from(l).map_err(|_| {
                to_py(py, Error::out_of_range("layer", l, 0, i128::from(u32::MAX)))
            })?),
        };
        let t = crate::py::args::timeout("timeout", timeout).py_err(py)?;
        let Some(ev) = self.inner.run_py(py, |c| c.wait_target(id))? else {
            return Ok(()); // settled
        };
        py.detach(|| match layer {
            None => ev.wait_all(t),
            Some(l) => ev.wait_layer(l, t),
        })
        // The events count the engine's submissions; the error names the caller's transfer.
        .map_err(|e| match e {
            Error::WaitTimeout { timeout_ms, .. } => Error::WaitTimeout { id, timeout_ms },
            e => e,
        })
        .py_err(py)
    }

    /// Counts: pages per tier, tree size, transfers in flight, and cumulative totals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.inner.get_py(py, |c| hicache_stats(c))?.to_dict(py)
    }

    /// Puts an L3 tier under the host tier (see `sparsetier.l3`): the core plans writes
    /// (`write_policy` `"write_back"`, the default: when host eviction would drop a page the
    /// store lacks; `"write_through"`: when a host copy becomes Ready) and prefetches; a
    /// backend runs them. Page keys are a hash chain over tokens, salted with `salt` (model
    /// version, LoRA) and the namespace. `remember` bounds the keys kept as known stored;
    /// `write_ahead` is the share of host pages kept clean under write-back.
    #[pyo3(
        signature = (*, write_policy="write_back", salt="", remember=None, write_ahead=0.1),
        text_signature = "($self, *, write_policy='write_back', salt='', remember=1048576, write_ahead=0.1)"
    )]
    fn enable_storage(
        &self,
        py: Python<'_>,
        write_policy: &str,
        salt: &str,
        remember: Option<&Bound<'_, PyAny>>,
        write_ahead: f64,
    ) -> PyResult<()> {
        let remember: usize = match remember {
            Some(r) => crate::py::args::unsigned(r, "remember")?,
            None => 1 << 20,
        };
        let policy = storage_args(py, write_policy, remember)?;
        self.inner.run_py(py, |c| {
            c.enable_storage(policy, salt.to_owned(), remember, write_ahead)
        })
    }

    /// The store keys (32 hex digits) of the whole pages of `tokens`.
    #[pyo3(signature = (tokens, namespace=None))]
    fn storage_keys(
        &self,
        tokens: &Bound<'_, PyAny>,
        namespace: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let py = tokens.py();
        let ns = self::namespace(namespace)?;
        let keys = with_tokens(tokens, |t| {
            self.run_tokens(py, Lookup::U32(t), |c, t| match t {
                Lookup::U32(t) => c.storage_keys(ns, t),
                Lookup::I64(_) => unreachable!("passed as u32"),
            })
        })?;
        Ok(keys.iter().map(ToString::to_string).collect())
    }

    /// What this cache knows of each key: "unknown", "stored", "writing" or "prefetching".
    fn storage_states(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<&'static str>> {
        self.inner.run_py(py, |c| storage_states_of(c, &keys))
    }

    /// Turns the store on or off (off: unreachable; no new plans, write-back evicts without
    /// writing).
    #[pyo3(name = "_set_storage_online")]
    fn set_storage_online(&self, py: Python<'_>, online: bool) -> PyResult<()> {
        self.inner.run_py(py, |c| c.set_storage_online(online))
    }

    /// Write-back ahead of need: while fewer than `write_ahead` of the host pages are free,
    /// plans writes for the least recently used host pages the store lacks. Returns the pages
    /// planned.
    #[pyo3(name = "_storage_write_ahead")]
    fn storage_write_ahead(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.run_py(py, |c| c.storage_write_ahead())
    }

    /// Write plans queued since the last call: `(id, keys, host_pages)` each.
    #[pyo3(name = "_take_storage_writes")]
    fn take_storage_writes<'py>(&self, py: Python<'py>) -> PyResult<Vec<PlanTuple<'py>>> {
        self.check_memory(py)?; // (the store reads the plans' host pages)
        let plans = self.inner.run_py(py, |c| c.take_storage_writes())?;
        Ok(plans
            .into_iter()
            .map(|p| plan_tuple(py, p.id, &p.keys, &p.host_pages))
            .collect())
    }

    /// Ends write `plan_id`: `ok[i]` says whether its page i was stored.
    #[pyo3(name = "_storage_write_done")]
    fn storage_write_done(
        &self,
        py: Python<'_>,
        plan_id: &Bound<'_, PyAny>,
        ok: Vec<bool>,
    ) -> PyResult<()> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        self.inner
            .run_py(py, |c| c.storage_write_done(plan_id, &ok))
    }

    /// Plans a prefetch of pages `start_page..start_page + n_pages` of `tokens` from the store
    /// into host pages: `(id, keys, host_pages)` (possibly fewer pages), or None.
    #[pyo3(name = "_plan_prefetch", signature = (tokens, start_page, n_pages, namespace=None))]
    fn plan_prefetch<'py>(
        &self,
        tokens: &Bound<'py, PyAny>,
        start_page: &Bound<'py, PyAny>,
        n_pages: &Bound<'py, PyAny>,
        namespace: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<PlanTuple<'py>>> {
        let py = tokens.py();
        self.check_memory(py)?; // (the store writes the plan's host pages)
        let start_page: usize = unsigned(start_page, "start_page")?;
        let n_pages: usize = unsigned(n_pages, "n_pages")?;
        let ns = self::namespace(namespace)?;
        let plan = with_tokens(tokens, |t| {
            self.run_tokens(py, Lookup::U32(t), |c, t| match t {
                Lookup::U32(t) => c.plan_prefetch(ns, t, start_page, n_pages),
                Lookup::I64(_) => unreachable!("passed as u32"),
            })
        })?;
        Ok(plan.map(|p| plan_tuple(py, p.id, &p.keys, &p.host_pages)))
    }

    /// Inserts the first `arrived` pages of prefetch `plan_id` (complete, verified) as host
    /// copies; returns how many the tree took. Once per prefetch, before `prefetch_end`.
    #[pyo3(name = "_prefetch_commit")]
    fn prefetch_commit(
        &self,
        py: Python<'_>,
        plan_id: &Bound<'_, PyAny>,
        arrived: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        let arrived: usize = unsigned(arrived, "arrived")?;
        self.inner
            .run_py(py, |c| c.prefetch_commit(plan_id, arrived))
    }

    /// Ends prefetch `plan_id` once no read writes its pages: frees what was not committed.
    #[pyo3(name = "_prefetch_end")]
    fn prefetch_end(&self, py: Python<'_>, plan_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let plan_id: u64 = unsigned(plan_id, "plan_id")?;
        self.inner.run_py(py, |c| c.prefetch_end(plan_id))
    }

    /// Byte ranges `(address, length)` of host page `page` in every pool, in store order.
    #[pyo3(name = "_host_segments")]
    fn host_segments(&self, py: Python<'_>, page: &Bound<'_, PyAny>) -> PyResult<Vec<(u64, u64)>> {
        let page: u32 = unsigned(page, "page")?;
        self.check_memory(py)?;
        self.inner
            .run_py(py, |c| c.host_segments(PageId::new(page)))
    }

    /// The L3 protocol's old public names (`take_storage_writes`, ...), one more release with
    /// a DeprecationWarning: they are `sparsetier.lowlevel.L3Protocol`'s now.
    fn __getattr__<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Bound<'py, PyAny>> {
        const MOVED: [&str; 8] = [
            "set_storage_online",
            "storage_write_ahead",
            "take_storage_writes",
            "storage_write_done",
            "plan_prefetch",
            "prefetch_commit",
            "prefetch_end",
            "host_segments",
        ];
        if !MOVED.contains(&name) {
            return Err(pyo3::exceptions::PyAttributeError::new_err(format!(
                "'HiCache' object has no attribute '{name}'"
            )));
        }
        crate::py::error::deprecated(
            slf.py(),
            &format!("HiCache.{name}"),
            "sparsetier.lowlevel.L3Protocol(cache)",
        )?;
        slf.getattr(format!("_{name}"))
    }

    /// The L3 tier's state and counters, or None without one.
    fn storage_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.inner.get_py(py, |c| storage_stats(c))? {
            Some(s) => Ok(Some(s.to_dict(py)?)),
            None => Ok(None),
        }
    }

    /// Raises InvariantError if the tree or page conservation is broken.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.get_py(py, |c| c.validate())?.map_err(|why| {
            crate::py::error::typed_error(py, "InvariantError", why, &PyDict::new(py))
        })
    }
}

/// Benchmark hook: the serve loop in Rust alone (`radix::bench::serve`) over `seqs` (a list
/// of token arrays): returns (per-request ns, hit tokens, total tokens, failed requests).
#[cfg(feature = "testing")]
#[pyfunction]
pub fn bench_serve(
    py: Python<'_>,
    seqs: Vec<Bound<'_, PyAny>>,
    page_size: usize,
    capacity_pages: u32,
    inflight: usize,
) -> PyResult<(Vec<u64>, u64, u64, u64)> {
    contained(|| {
        let seqs: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| with_tokens(s, |t| Ok(t.to_vec())))
            .collect::<PyResult<_>>()?;
        let st = py
            .detach(|| crate::radix::bench::serve(&seqs, page_size, capacity_pages, inflight))
            .py_err(py)?;
        Ok((st.lat_ns, st.hit_tokens, st.total_tokens, st.failed))
    })
}

/// Counts of a cache (`HiCache.stats`).
fn hicache_stats(c: &HiCache) -> Stats {
    let mut d = Stats::default();
    let (hf, hc) = c.host_free_capacity();
    d.put("device_capacity", c.device_capacity());
    d.put("device_free", c.device_free());
    d.put("device_in_tree", c.tree().device_pages());
    d.put("device_outstanding", c.outstanding());
    // Leaves evictable right now (a lower bound of what one eviction call frees), and every
    // unlocked device page (SGLang's evictable_size: what admission should count).
    d.put("device_evictable_now", c.evictable_device_pages());
    d.put(
        "device_evictable_total",
        c.tree().evictable_device_pages_total(),
    );
    d.put("host_capacity", hc);
    d.put("host_free", hf);
    d.put("host_in_tree", c.tree().host_pages());
    d.put("nodes", c.tree().node_count());
    d.put("in_flight", c.in_flight());
    let t = c.totals();
    let mut totals = Stats::default();
    macro_rules! put {
        ($($f:ident),*) => { $( totals.put(stringify!($f), t.$f); )* };
    }
    put!(
        matches,
        device_hit_tokens,
        host_hit_tokens,
        match_tokens,
        pages_backed_up,
        backups_skipped,
        pages_loaded,
        loads_refused,
        failed_transfers,
        device_evicted,
        host_evicted
    );
    d.put("totals", totals);
    d
}

/// What `c` knows of each of `keys` (`HiCache.storage_states`).
fn storage_states_of(c: &HiCache, keys: &[String]) -> crate::Result<Vec<&'static str>> {
    let t = c
        .storage()
        .ok_or_else(|| Error::config("storage_backend", "None", "a HiCache with an L3 tier"))?;
    keys.iter()
        .map(|k| {
            let key = parse_key(k)
                .ok_or_else(|| Error::config("keys", k, "32 hex digits (from storage_keys)"))?;
            Ok(match t.state(&key) {
                L3State::Unknown => "unknown",
                L3State::Stored => "stored",
                L3State::Writing => "writing",
                L3State::Prefetching => "prefetching",
            })
        })
        .collect()
}

/// The L3 tier's state and counters (`HiCache.storage_stats`).
pub(super) fn storage_stats(c: &HiCache) -> Option<Stats> {
    let s = c.storage()?;
    let mut d = Stats::default();
    d.put("online", s.online());
    d.put(
        "write_policy",
        match s.policy() {
            WritePolicy::WriteBack => "write_back",
            WritePolicy::WriteThrough => "write_through",
        },
    );
    d.put("writes_in_flight", s.writes_in_flight());
    d.put("prefetches_in_flight", s.prefetches_in_flight());
    d.put("stored_known", s.stored_len());
    let t = s.totals();
    macro_rules! put {
        ($($f:ident),*) => { $( d.put(stringify!($f), t.$f); )* };
    }
    put!(
        writes_planned,
        pages_written,
        write_failures,
        evicted_unstored,
        prefetches_planned,
        pages_prefetched,
        prefetch_missed,
        prefetch_spare,
        offline_events
    );
    Some(d)
}
