//! `sparsetier.StepScheduler`: the batched decode step from Python.
//!
//! One call per layer for the whole batch: request ids and selections cross as numpy arrays
//! (a CPU torch tensor's `.numpy()` is a view, no copy), slot tables come back as int32
//! arrays. Every transition (complete, fail, release, retry, backup) happens in the core;
//! Python only passes arrays and reads results. Calls that wait run with the GIL released.
//!
//! # Drop
//! The scheduler holds both pool tensors (through their bindings) and the engine. Dropping it
//! first drains every transfer in flight, so no copy outlives the tensors it touches.

use crate::config::HitPolicy;
use crate::error::Error;
use crate::guard::Guarded;
#[cfg(feature = "testing")]
use crate::py::args::opt_int;
use crate::py::args::{int, int64_array};
use crate::py::directory::{stats_dict, PyResidencyDirectory};
use crate::py::error::{deprecated, to_py, typed_error, IntoPyResult};
use crate::py::joined_scheduler::PyJoinedStepScheduler;
use crate::py::lock::Unblocked;
use crate::py::residency_view::PyResidencyView;
use crate::py::scheduler_args::*;
use crate::py::scheduler_core::{each, Core};
use crate::py::scheduler_stats::{prefix_stats, scheduler_stats};
use crate::py::step_results::{PyLayerCounts, PyLayerPlan, PyStepRecord};
use crate::py::transfer::{PyPageTransferBinding, PyTransferEngine};
use crate::radix::PoolPair;
use crate::scheduler::restore_policy::{default_copy_overhead, RestoreMode};
use crate::scheduler::{Prefix, SelectionUnit, StepScheduler};
#[cfg(feature = "testing")]
use crate::transfer::Direction;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rustc_hash::FxHashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The batched, asynchronous decode-step scheduler over one-layer device and host KV pools.
#[pyclass(name = "StepScheduler", module = "sparsetier._core", frozen, subclass)]
pub struct PyStepScheduler {
    /// The core, behind a guard that turns a panic inside into `InternalError` and refuses
    /// every later call; its poison flag is the directory's, so the directory's own binding
    /// refuses too.
    pub(super) inner: Guarded<Core>,
    /// What never changes, read without the lock.
    layers: u16,
    page_size: u32,
    object_bytes: u64,
    joined: bool,
    device: Py<PyPageTransferBinding>,
    host: Py<PyPageTransferBinding>,
    engine: Py<PyTransferEngine>,
    /// Joined mode: the sidecar bindings, held so their tensors outlive every copy.
    #[allow(dead_code)]
    sidecars: Vec<Py<PyPageTransferBinding>>,
    /// The slot table each outstanding plan handed over (taken from the core, not copied:
    /// token mode's are half a megabyte a layer), for `ready` to patch a copy of when a
    /// retry moves objects.
    tables: Mutex<FxHashMap<u64, Handed>>,
}

/// A slot table handed to Python: a row per request (`plan`), or CSR like the plan's rows
/// (`plan_csr`).
enum Handed {
    Rows(Py<PyArray2<i32>>),
    Csr(Py<PyArray1<i32>>),
}

#[pymethods]
impl PyStepScheduler {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(
        signature = (device, host, engine, *, layers, device_reserve=None, prefetch=true, prefetch_depth=None),
        text_signature = "(device, host, engine, *, layers, device_reserve=0, prefetch=True, prefetch_depth=1)"
    )]
    fn new(
        py: Python<'_>,
        device: Bound<'_, PyPageTransferBinding>,
        host: Bound<'_, PyPageTransferBinding>,
        engine: Bound<'_, PyTransferEngine>,
        layers: &Bound<'_, PyAny>,
        device_reserve: Option<&Bound<'_, PyAny>>,
        prefetch: bool,
        prefetch_depth: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let layers = u32_arg(py, layers, "layers", 1)?;
        let layers = u16::try_from(layers)
            .map_err(|_| to_py(py, Error::out_of_range("layers", layers, 1, 1 << 16)))?;
        let (d, h, e) = (device.get(), host.get(), engine.get());
        check_tiers(py, e, &[("device", d)], &[("host", h)])?;
        let cfg = scheduler_config(py, layers, d, h, device_reserve, prefetch, prefetch_depth)?;
        let inner =
            StepScheduler::new(cfg, d.inner.clone(), h.inner.clone(), e.shared()).py_err(py)?;
        Ok(PyStepScheduler::wrap(
            Core::Plain(inner),
            device.unbind(),
            host.unbind(),
            engine.unbind(),
            Vec::new(),
        ))
    }

    /// A joined scheduler: `host_kv` is the group's multi-layer KV host pool (either layout),
    /// whose pages the prefix cache owns; main-KV objects are loaded from there per layer
    /// into the one-layer `device` slots. `indexer_device` / `indexer_host` are the Indexer-K
    /// pools (whole pages, every layer), restored on a prefix hit and written through when a
    /// request ends. `restore`: what a prefix hit restores of its main KV, `auto` (the core's
    /// cost model, per admission), `indexer` (none: loaded as selections name it), `full` (all
    /// of it in bulk) or `predicted` (in bulk the pages predicted selected by position, the
    /// rest on demand); `restore_copy_overhead`: a copy's fixed cost in bytes, in that model
    /// (None: the engine's own, `prefix_stats()["restore_copy_overhead"]`).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(
        signature = (device, host_kv, engine, *, indexer_device, indexer_host, device_reserve=None, prefetch=true, prefetch_depth=None, restore="auto", restore_copy_overhead=None),
        text_signature = "(device, host_kv, engine, *, indexer_device, indexer_host, device_reserve=0, prefetch=True, prefetch_depth=1, restore='auto', restore_copy_overhead=None)"
    )]
    fn joined(
        py: Python<'_>,
        device: Bound<'_, PyPageTransferBinding>,
        host_kv: Bound<'_, PyPageTransferBinding>,
        engine: Bound<'_, PyTransferEngine>,
        indexer_device: Bound<'_, PyPageTransferBinding>,
        indexer_host: Bound<'_, PyPageTransferBinding>,
        device_reserve: Option<&Bound<'_, PyAny>>,
        prefetch: bool,
        prefetch_depth: Option<&Bound<'_, PyAny>>,
        restore: &str,
        restore_copy_overhead: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyJoinedStepScheduler>> {
        let mode = RestoreMode::parse(restore).py_err(py)?;
        let overhead = match restore_copy_overhead {
            Some(v) => u64::from(u32_arg(py, v, "restore_copy_overhead", 0)?),
            None => default_copy_overhead(engine.get().backend()),
        };
        let (d, h, e) = (device.get(), host_kv.get(), engine.get());
        let (id, ih) = (indexer_device.get(), indexer_host.get());
        check_tiers(
            py,
            e,
            &[("device", d), ("indexer_device", id)],
            &[("host_kv", h), ("indexer_host", ih)],
        )?;
        let layers = u16::try_from(h.inner.layers()).map_err(|_| {
            to_py(
                py,
                Error::out_of_range("host_kv.layers", h.inner.layers() as u64, 1, 1 << 16),
            )
        })?;
        let cfg = scheduler_config(py, layers, d, h, device_reserve, prefetch, prefetch_depth)?;
        let sidecars = vec![PoolPair {
            device: Some(id.inner.clone()),
            host: ih.inner.clone(),
            hit: HitPolicy::AllPages,
        }];
        let mut inner = StepScheduler::joined(
            cfg,
            d.inner.clone(),
            h.inner.clone(),
            sidecars,
            id.inner.pages(),
            e.shared(),
        )
        .map_err(indexer_names)
        .py_err(py)?;
        inner.set_restore_policy(mode, overhead);
        let base = PyStepScheduler::wrap(
            Core::Joined(inner),
            device.unbind(),
            host_kv.unbind(),
            engine.unbind(),
            vec![indexer_device.unbind(), indexer_host.unbind()],
        );
        Py::new(
            py,
            PyClassInitializer::from(base).add_subclass(PyJoinedStepScheduler),
        )
    }

    /// Whether this is a joined scheduler (with a prefix cache).
    #[getter]
    fn is_joined(&self) -> bool {
        self.joined
    }

    /// Joined mode: prefix-tier counters (hits, bytes restored and loaded against a full
    /// restore) and the prefix cache's page counts; None for a plain scheduler.
    fn prefix_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self
            .inner
            .get_py(py, |s| s.joined_ref().ok().map(prefix_stats))?
        {
            Some(d) => Ok(Some(d.to_dict(py)?)),
            None => Ok(None),
        }
    }

    /// Plans whose entries are at most a page (block = page, token mode) keep each row's
    /// selected pages pinned to the next step and read the pages selected again from there,
    /// without a directory call (the default; with or without prefetch, whose prediction the
    /// kept pages are; kept pages hold at most half the device); False gives every kept page
    /// back and resolves every selected page each step.
    #[getter]
    fn keep_selections(&self, py: Python<'_>) -> PyResult<bool> {
        self.inner
            .get_py(py, |s| each!(s, s => s.keeps_selections()))
    }

    #[setter]
    fn set_keep_selections(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.inner
            .run_py(py, |s| each!(s, s => s.set_keep_selections(on)))
    }

    /// Model layers.
    #[getter]
    pub(super) fn layers(&self) -> u16 {
        self.layers
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Bytes of one object (one page of one layer, K and V).
    #[getter]
    fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// The device and host bindings and the engine the scheduler was built over.
    #[getter]
    fn bindings(&self, py: Python<'_>) -> (Py<PyPageTransferBinding>, Py<PyPageTransferBinding>) {
        (self.device.clone_ref(py), self.host.clone_ref(py))
    }

    /// The copy engine (arm faults through `inject_faults`, not on the engine directly,
    /// so they land on the scheduler's own submissions).
    #[getter]
    fn engine(&self, py: Python<'_>) -> Py<PyTransferEngine> {
        self.engine.clone_ref(py)
    }

    /// The residency directory, read only: its counts, an object's state, its invariants.
    #[getter]
    fn residency(&self, py: Python<'_>) -> PyResult<PyResidencyView> {
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        Ok(PyResidencyView::of(d))
    }

    /// Deprecated: `residency` (read only). This gave out the scheduler's own directory,
    /// which a caller could change under it.
    #[getter]
    fn directory(&self, py: Python<'_>) -> PyResult<PyResidencyDirectory> {
        deprecated(
            py,
            "StepScheduler.directory",
            "StepScheduler.residency (read only)",
        )?;
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        Ok(PyResidencyDirectory::shared(d))
    }

    /// Stores a shared prefix of `pages` whole pages: returns its slots `[layers, pages]` to
    /// write before the next call; written through at the next `end_step`.
    fn add_prompt<'py>(
        &self,
        py: Python<'py>,
        namespace: &Bound<'py, PyAny>,
        pages: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.follow(py)?;
        let ns = int(namespace, "namespace")?;
        let ns = u64::try_from(ns)
            .map_err(|_| to_py(py, Error::config("namespace", ns, "an integer >= 0")))?;
        let pages = u32_arg(py, pages, "pages", 1)?;
        let layers = self.layers() as usize;
        let slots = py
            .detach(|| {
                self.inner
                    .run(|s| s.plain("add_prompt")?.add_prompt(ns, pages))
            })
            .py_err(py)?;
        slots_2d(py, &slots, layers)
    }

    /// Ends a stored prefix (refused while a running request reads it).
    fn drop_prompt(&self, py: Python<'_>, namespace: &Bound<'_, PyAny>) -> PyResult<()> {
        let ns = int(namespace, "namespace")?;
        let ns = u64::try_from(ns)
            .map_err(|_| to_py(py, Error::config("namespace", ns, "a stored prompt")))?;
        self.inner
            .run_py(py, |s| s.plain("drop_prompt")?.drop_prompt(ns))
    }

    /// Admits a request of `tokens` prefilled tokens, optionally over `prefix = (namespace,
    /// pages)`; returns its own pages' slots `[layers, own pages]` to write before the next
    /// call.
    #[pyo3(signature = (rid, tokens, prefix=None))]
    fn add_request<'py>(
        &self,
        py: Python<'py>,
        rid: &Bound<'py, PyAny>,
        tokens: &Bound<'py, PyAny>,
        prefix: Option<(i64, i64)>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        self.follow(py)?;
        let id = self::rid(rid)?;
        let n = tokens_arg(tokens)?;
        let prefix = match prefix {
            None => None,
            Some((ns, pages)) => Some(Prefix {
                namespace: u64::try_from(ns).map_err(|_| {
                    to_py(
                        py,
                        Error::config("prefix", ns, "(namespace >= 0, pages >= 1)"),
                    )
                })?,
                pages: u32::try_from(pages).map_err(|_| {
                    to_py(
                        py,
                        Error::config("prefix", pages, "(namespace >= 0, pages >= 1)"),
                    )
                })?,
            }),
        };
        let layers = self.layers() as usize;
        let slots = py
            .detach(|| {
                self.inner
                    .run(|s| s.plain("add_request")?.add_request(id, n, prefix))
            })
            .py_err(py)?;
        slots_2d(py, &slots, layers)
    }

    /// Appends `tokens` prefilled tokens to request `rid` (chunked prefill): returns `(first
    /// page, slots [layers, pages touched])`; write the rows before the next call.
    fn extend<'py>(
        &self,
        py: Python<'py>,
        rid: &Bound<'py, PyAny>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<(u32, Bound<'py, PyArray2<i32>>)> {
        self.follow(py)?;
        let id = self::rid(rid)?;
        let n = tokens_arg(tokens)?;
        let layers = self.layers() as usize;
        let (first, slots) = py
            .detach(|| self.inner.run(|s| each!(s, s => s.extend(id, n))))
            .py_err(py)?;
        Ok((first, slots_2d(py, &slots, layers)?))
    }

    /// Ends a request: its objects go now or when the last pin or transfer on them ends.
    /// Joined mode: with `tokens` (its prompt and generated tokens) its whole pages go into
    /// the prefix tree once written through; without, its own pages are let go.
    #[pyo3(signature = (rid, tokens=None))]
    fn finish_request(
        &self,
        py: Python<'_>,
        rid: &Bound<'_, PyAny>,
        tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.follow(py)?;
        let id = self::rid(rid)?;
        let Some(tokens) = tokens else {
            return self
                .inner
                .run_py(py, |s| each!(s, s => s.finish_request(id)));
        };
        let toks = token_ids(tokens)?;
        self.inner
            .run_py(py, |s| s.joined()?.end_request(id, Some(&toks)))
    }

    /// Tokens written for request `rid`.
    fn request_len(&self, py: Python<'_>, rid: &Bound<'_, PyAny>) -> PyResult<u64> {
        let id = self::rid(rid)?;
        self.inner
            .get_py(py, |s| each!(s, s => s.request(id).map(|r| r.len)))?
            .ok_or_else(|| to_py(py, Error::config("rid", id, "a running request")))
    }

    /// Starts a step: `(slots [B, layers], rows [B])` where the batch's new K/V rows go.
    #[allow(clippy::type_complexity)]
    fn append<'py>(
        &self,
        py: Python<'py>,
        rids: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyArray2<i32>>, Bound<'py, PyArray1<i32>>)> {
        self.follow(py)?;
        let ids = rid_list(rids)?;
        let (slots, rows) = py
            .detach(|| self.inner.run(|s| each!(s, s => s.append(&ids))))
            .py_err(py)?;
        let rows: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        Ok((
            slots_2d(py, &slots, ids.len())?,
            PyArray1::from_vec(py, rows),
        ))
    }

    /// Plans `layer` for the batch: `selection` is an int64 or int32 `[B, K]` array of
    /// entries (-1 = none; int32 rows are half the bytes to read) of `unit` tokens each
    /// (block mode: block ids, `unit` = block size; token mode: token indices, `unit` = 1).
    /// Returns `(plan, slot table [B, K * pages_per_entry])`.
    /// With `counts` (an int32 `[B, K]` array; page rows only, `unit` = the page size) each
    /// entry's page holds that many selected tokens: token mode mapped to pages where it was
    /// selected (`sparsetier.token_map.map_tokens`).
    #[pyo3(signature = (layer, rids, selection, unit, counts=None))]
    fn plan<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        rids: &Bound<'py, PyAny>,
        selection: &Bound<'py, PyAny>,
        unit: &Bound<'py, PyAny>,
        counts: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(PyLayerPlan, Bound<'py, PyArray2<i32>>)> {
        self.follow(py)?;
        let layer = self.layer_arg(py, layer)?;
        let ids = rid_list(rids)?;
        let sel = Rows2::extract(selection).ok_or_else(|| {
            to_py(
                py,
                Error::config(
                    "selection",
                    crate::py::args::short(selection),
                    "a C-contiguous int64 or int32 numpy array of shape (B, K) (tensor.numpy() \
                     of a CPU int64 or int32 tensor)",
                ),
            )
        })?;
        let shape = sel.shape();
        let k = row_width(py, shape, ids.len())?;
        let flat = sel.as_slice().ok_or_else(|| {
            to_py(
                py,
                Error::config(
                    "selection",
                    "a non-contiguous array",
                    "a C-contiguous array",
                ),
            )
        })?;
        let ps = self.page_size();
        let unit = u32_arg(py, unit, "unit", 1)?;
        let unit = SelectionUnit::new(unit, ps).py_err(py)?;
        let counts: Option<PyReadonlyArray2<'py, i32>> = match counts {
            None => None,
            Some(c) if c.is_none() => None,
            Some(c) => Some(crate::py::args::c_order(c)?.extract().map_err(|_| {
                to_py(
                    py,
                    Error::config(
                        "counts",
                        crate::py::args::short(c),
                        "None or a C-contiguous int32 numpy array of the selection's shape",
                    ),
                )
            })?),
        };
        // Checked here (a negative count is no count) and copied: a few thousand a layer.
        let counts: Option<Vec<u32>> = match &counts {
            None => None,
            Some(c) => {
                if c.shape() != shape {
                    return Err(to_py(
                        py,
                        Error::config(
                            "counts.shape",
                            format!("{:?}", c.shape()),
                            format!("{shape:?}: the selection's"),
                        ),
                    ));
                }
                let c = c
                    .as_slice()
                    .ok()
                    .filter(|_| c.is_c_contiguous())
                    .ok_or_else(|| {
                        to_py(
                            py,
                            Error::config(
                                "counts",
                                "a non-contiguous array",
                                "a C-contiguous array",
                            ),
                        )
                    })?;
                let w = k.max(1);
                Some(counts_u32(py, c, ps, |j| {
                    format!("counts[{}][{}]", j / w, j % w)
                })?)
            }
        };
        let rows = ids.len();
        let (id, t) = py
            .detach(|| {
                self.inner.run(|s| {
                    each!(s, s => {
                        let counts = counts.as_deref();
                        let (id, _) = match flat {
                            Entries::I64(f) => s.plan_counted(layer, &ids, f, k, unit, counts)?,
                            Entries::I32(f) => s.plan_counted(layer, &ids, f, k, unit, counts)?,
                        };
                        Ok((id, s.take_table(id)?))
                    })
                })
            })
            .py_err(py)?;
        let t = table(py, t, rows)?;
        let replaced = self
            .tables
            .lock()
            .insert(id.raw(), Handed::Rows(t.clone().unbind()));
        drop(replaced); // (after the lock: see `patched_table`)
        Ok((PyLayerPlan::new(id, layer), t))
    }

    /// [`plan`](Self::plan) of ragged rows, as CSR: row `b`'s entries are
    /// `entries[offsets[b]:offsets[b + 1]]` (int64 or int32, the same entries as a padded
    /// row's, no padding needed), `offsets` `B + 1` int64 from 0, not decreasing, ending at
    /// `len(entries)`; `counts` (int32, one per entry) as `plan`'s. Returns `(plan, slot
    /// table)`, the table flat in the same form: each entry's `pages_per_entry` cells, row
    /// after row; `ready` reports a moved table in that form too.
    #[pyo3(signature = (layer, rids, offsets, entries, unit, counts=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan_csr<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        rids: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        entries: &Bound<'py, PyAny>,
        unit: &Bound<'py, PyAny>,
        counts: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(PyLayerPlan, Bound<'py, PyArray1<i32>>)> {
        self.follow(py)?;
        let layer = self.layer_arg(py, layer)?;
        let ids = rid_list(rids)?;
        let offsets = int64_array(offsets, "offsets", "row starts (int64), B + 1 of them")?;
        // int32 entries are read as they are (half the bytes); anything else as int64.
        // (Strided or unaligned arrays are copied: read by value, never in memory order.)
        let entries = &crate::py::args::c_order(entries)?;
        let entries = match entries.extract::<numpy::PyReadonlyArray1<'py, i32>>() {
            Ok(e) => Rows1::I32(e),
            Err(_) => Rows1::I64(int64_array(
                entries,
                "entries",
                "every row's entries (int64 or int32)",
            )?),
        };
        let ps = self.page_size();
        let unit = u32_arg(py, unit, "unit", 1)?;
        let unit = SelectionUnit::new(unit, ps).py_err(py)?;
        let counts: Option<Vec<u32>> = match counts {
            None => None,
            Some(c) if c.is_none() => None,
            Some(c) => {
                let c: numpy::PyReadonlyArray1<'py, i32> =
                    crate::py::args::c_order(c)?.extract().map_err(|_| {
                        to_py(
                            py,
                            Error::config(
                                "counts",
                                crate::py::args::short(c),
                                "None or a 1-D int32 numpy array, one per entry",
                            ),
                        )
                    })?;
                let c = c.as_slice().map_err(|_| {
                    to_py(
                        py,
                        Error::config("counts", "a non-contiguous array", "a C-contiguous array"),
                    )
                })?;
                Some(counts_u32(py, c, ps, |j| format!("counts[{j}]"))?)
            }
        };
        let strided = |field: &str| {
            to_py(
                py,
                Error::config(field, "a non-contiguous array", "a C-contiguous array"),
            )
        };
        let flat = match &entries {
            Rows1::I64(e) => e.as_slice().ok().map(Entries::I64),
            Rows1::I32(e) => e.as_slice().ok().map(Entries::I32),
        }
        .ok_or_else(|| strided("entries"))?;
        let offsets = offsets.as_slice().map_err(|_| strided("offsets"))?;
        let (id, t) = py
            .detach(|| {
                self.inner.run(|s| {
                    each!(s, s => {
                        let counts = counts.as_deref();
                        let (id, _) = match flat {
                            Entries::I64(e) => s.plan_csr(layer, &ids, offsets, e, unit, counts)?,
                            Entries::I32(e) => s.plan_csr(layer, &ids, offsets, e, unit, counts)?,
                        };
                        Ok((id, s.take_table(id)?))
                    })
                })
            })
            .py_err(py)?;
        let t = PyArray1::from_vec(py, t);
        let replaced = self
            .tables
            .lock()
            .insert(id.raw(), Handed::Csr(t.clone().unbind()));
        drop(replaced); // (after the lock: see `patched_table`)
        Ok((PyLayerPlan::new(id, layer), t))
    }

    /// Makes plan `plan` readable (event wait; with `stream`, a CUDA stream wait instead).
    /// Returns `(failed, table)`: `failed` lists `(row, rid, reason)` of requests whose loads
    /// failed twice; `table` is the updated slot table when a retry moved objects, else None.
    #[pyo3(signature = (plan, stream=None))]
    #[allow(clippy::type_complexity)]
    fn ready<'py>(
        &self,
        py: Python<'py>,
        plan: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Vec<(usize, u64, String)>, Option<Bound<'py, PyAny>>)> {
        self.follow(py)?;
        let stream = crate::py::args::opt_stream(stream)?;
        let id = plan_id(plan)?;
        let out = py
            .detach(|| self.inner.run(|s| each!(s, s => s.ready(id, stream))))
            .py_err(py)?;
        let t = if out.slots_changed {
            Some(self.patched_table(py, id.raw(), &out)?)
        } else {
            None
        };
        let failed = out
            .failed
            .into_iter()
            .map(|(b, r, why)| (b, r.raw(), why))
            .collect();
        Ok((failed, t))
    }

    /// Releases the plan's pins; returns its counts (ready, loaded, joined, exposed_wait_ns).
    fn finish<'py>(&self, py: Python<'py>, plan: &Bound<'py, PyAny>) -> PyResult<PyLayerCounts> {
        let id = plan_id(plan)?;
        let c = self.inner.run_py(py, |s| each!(s, s => s.finish(id)))?;
        let handed = self.tables.lock().remove(&id.raw());
        drop(handed); // (after the lock: see `patched_table`)
        Ok(PyLayerCounts::new(&c))
    }

    /// Ends the step (write-through of filled pages, settling, next prefetches); returns the
    /// step's record. Refused (ConfigError naming `plans`) while a layer plan is open: finish
    /// every plan of the step first.
    fn end_step(&self, py: Python<'_>) -> PyResult<PyStepRecord> {
        self.follow(py)?;
        let r = py
            .detach(|| self.inner.run(|s| each!(s, s => s.end_step())))
            .py_err(py)?;
        Ok(PyStepRecord::new(r))
    }

    /// Cumulative record: every finished step, plus what happened since the last one.
    fn totals(&self, py: Python<'_>) -> PyResult<PyStepRecord> {
        let r = self.inner.get_py(py, |s| each!(s, s => s.totals()))?;
        Ok(PyStepRecord::new(r))
    }

    /// Settles finished transfers.
    fn poll(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.run(|s| each!(s, s => s.poll())))
            .py_err(py)
    }

    /// Waits for and settles every transfer in flight; releases unconsumed prefetches.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        self.follow(py)?;
        py.detach(|| self.inner.run(|s| each!(s, s => s.drain())))
            .py_err(py)
    }

    /// Arms `count` failures of the next `kind` (`load`, `backup` or `restore`) submissions,
    /// at `layer` only if given; they fail inside the engine (every engine). With `delay`
    /// (seconds; cpu engine only) those copies start that much later instead of failing; with
    /// `panic` (cpu engine only) the engine's worker panics on them instead, as a bug in the
    /// copy path would, and the engine fails them. Kind `internal` (nothing else given): the
    /// next plan panics inside the core, as a bug would; that call raises `InternalError`, and
    /// so does every later call on this scheduler and its directory.
    #[cfg(feature = "testing")]
    #[pyo3(
        name = "_inject_faults",
        signature = (kind, count=None, layer=None, delay=None, panic=false),
        text_signature = "($self, kind, count=1, layer=None, delay=None, panic=False)"
    )]
    fn inject_faults_hook(
        &self,
        py: Python<'_>,
        kind: &str,
        count: Option<&Bound<'_, PyAny>>,
        layer: Option<&Bound<'_, PyAny>>,
        delay: Option<f64>,
        panic: bool,
    ) -> PyResult<()> {
        let count = match count {
            Some(c) => u32_arg(py, c, "count", 1)?,
            None => 1,
        };
        let direction = match kind {
            "load" => Direction::Load,
            "backup" => Direction::Backup,
            "restore" => Direction::Load,
            "internal" if count == 1 && layer.is_none() && delay.is_none() && !panic => {
                return self
                    .inner
                    .get_py(py, |s| each!(s, s => s.inject_internal_fault()));
            }
            "internal" => {
                return Err(to_py(
                    py,
                    Error::config(
                        "count/layer/delay/panic",
                        "given",
                        "count 1 and none of the others for an internal fault (the next plan \
                         panics)",
                    ),
                ))
            }
            other => {
                return Err(to_py(
                    py,
                    Error::config(
                        "kind",
                        format!("{other:?}"),
                        "load, backup, restore or internal",
                    ),
                ))
            }
        };
        if panic && (delay.is_some() || kind == "restore" || self.engine.get().needs_pinned()) {
            return Err(to_py(
                py,
                Error::config(
                    "panic",
                    "True",
                    "False with a delay, for restores, and on the kernel and direct engines \
                     (their copies run on the GPU, not on a worker thread); a load or backup \
                     on the cpu engine",
                ),
            ));
        }
        let layer = match opt_int(layer, "layer")? {
            None => None,
            Some(l) => Some(
                u16::try_from(l)
                    .ok()
                    .filter(|&l| l < self.layers())
                    .ok_or_else(|| to_py(py, Error::out_of_range("layer", l, 0, self.layers())))?,
            ),
        };
        let delay = match delay {
            None => None,
            // Checked now: the engine would refuse it only at the submission it is armed for.
            Some(d) if self.engine.get().needs_pinned() => {
                return Err(to_py(
                    py,
                    Error::config(
                        "delay",
                        d,
                        "None on the kernel and direct engines (a GPU copy cannot be held \
                         back from the host); delays need the cpu engine",
                    ),
                ))
            }
            Some(d) => Some(crate::py::args::delay("delay", d).py_err(py)?),
        };
        if kind == "restore" {
            if layer.is_some() || delay.is_some() {
                return Err(to_py(
                    py,
                    Error::config(
                        "layer/delay",
                        "given",
                        "None for restore faults (a restore fails as a whole)",
                    ),
                ));
            }
            return self.inner.run_py(py, |s| {
                s.joined()?.inject_restore_faults(count);
                Ok(())
            });
        }
        self.inner.get_py(py, |s| {
            each!(s, s => match panic {
                true => s.inject_panics(direction, count, layer),
                false => s.inject_faults(direction, count, layer, delay),
            })
        })
    }

    /// Deprecated: `sparsetier.testing.inject_faults(scheduler, ...)`.
    #[cfg(feature = "testing")]
    #[pyo3(signature = (kind, count=None, layer=None, delay=None, panic=false))]
    fn inject_faults(
        &self,
        py: Python<'_>,
        kind: &str,
        count: Option<&Bound<'_, PyAny>>,
        layer: Option<&Bound<'_, PyAny>>,
        delay: Option<f64>,
        panic: bool,
    ) -> PyResult<()> {
        deprecated(
            py,
            "StepScheduler.inject_faults",
            "sparsetier.testing.inject_faults",
        )?;
        self.inject_faults_hook(py, kind, count, layer, delay, panic)
    }

    /// Tests: evicts at least `n` device pages the scheduler does not pin (written through),
    /// so that the next plans load them.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_evict_device")]
    fn evict_device_hook(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        self.follow(py)?;
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        PyResidencyDirectory::shared(d).evict_count(n)
    }

    /// Tools and tests: the scheduler's own directory, which they may change under it.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_directory")]
    fn directory_hook(&self, py: Python<'_>) -> PyResult<PyResidencyDirectory> {
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        Ok(PyResidencyDirectory::shared(d))
    }

    /// Starts recording the directory's transitions (what `sparsetier replay` replays at
    /// other budgets): from now until `take_journal`.
    fn start_journal(&self, py: Python<'_>) -> PyResult<()> {
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        PyResidencyDirectory::shared(d).start_journal(py)
    }

    /// The transitions recorded since `start_journal`, as a trace dict (None when not
    /// recording); recording stops.
    fn take_journal<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let d = self
            .inner
            .get_py(py, |s| each!(s, s => s.directory().clone()))?;
        PyResidencyDirectory::shared(d).take_journal(py)
    }

    /// Directory counts now (objects, pins, slots, ...), with cumulative totals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (dir, own) = self
            .inner
            .get_py(py, |s| each!(s, s => scheduler_stats(s)))?;
        let d = stats_dict(py, &dir)?;
        for (k, v) in own.to_dict(py)?.iter() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Raises InvariantError if any invariant of the scheduler or its directory is broken.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.inner
            .get_py(py, |s| each!(s, s => s.validate()))?
            .map_err(|why| typed_error(py, "InvariantError", why, &PyDict::new(py)))
    }
}

/// The joined core's names of its one sidecar pair, as this binding's arguments spell them.
fn indexer_names(e: Error) -> Error {
    let rename = |s: String| {
        s.replace("sidecars[0].device", "indexer_device")
            .replace("sidecars[0].host", "indexer_host")
    };
    match e {
        Error::Config {
            field,
            value,
            allowed,
        } => Error::Config {
            field: rename(field),
            value: rename(value),
            allowed: rename(allowed),
        },
        other => other,
    }
}

impl PyStepScheduler {
    fn wrap(
        inner: Core,
        device: Py<PyPageTransferBinding>,
        host: Py<PyPageTransferBinding>,
        engine: Py<PyTransferEngine>,
        sidecars: Vec<Py<PyPageTransferBinding>>,
    ) -> Self {
        let poison = each!(&inner, s => std::sync::Arc::clone(s.directory().poison()));
        let cfg = *each!(&inner, s => s.config());
        PyStepScheduler {
            layers: cfg.layers,
            page_size: cfg.page_size,
            object_bytes: each!(&inner, s => s.object_bytes()),
            joined: matches!(inner, Core::Joined(_)),
            inner: Guarded::sharing(inner, poison),
            device,
            host,
            engine,
            sidecars,
            tables: Mutex::default(),
        }
    }

    /// Refuses bound tensors whose storage was resized or freed since binding (the copies
    /// would use memory that is gone), before every call that may copy: two Python calls a
    /// binding. One resized under copies already in flight cannot be caught.
    pub(super) fn check_memory(&self, py: Python<'_>) -> PyResult<()> {
        let (device, host) = if self.joined {
            ("device", "host_kv")
        } else {
            ("device", "host")
        };
        self.device.get().memory.check(py, device)?;
        self.host.get().memory.check(py, host)?;
        for (b, name) in self.sidecars.iter().zip(["indexer_device", "indexer_host"]) {
            b.get().memory.check(py, name)?;
        }
        Ok(())
    }

    /// A layer index, checked against the scheduler's layers.
    fn layer_arg(&self, py: Python<'_>, layer: &Bound<'_, PyAny>) -> PyResult<u16> {
        let v = int(layer, "layer")?;
        u16::try_from(v)
            .ok()
            .filter(|&l| l < self.layers())
            .ok_or_else(|| to_py(py, Error::out_of_range("layer", v, 0, self.layers())))
    }

    /// CUDA engines: the copies submitted by the call about to run follow torch's queued
    /// writes on its current stream.
    pub(super) fn follow(&self, py: Python<'_>) -> PyResult<()> {
        self.check_memory(py)?;
        self.engine.get().follow_torch_stream(py)
    }

    /// A copy of the table plan `id` handed over, with the cells a retry moved and the rows
    /// that failed (-1) applied, in the form it was handed in; it replaces the kept one, so a
    /// later retry builds on it.
    fn patched_table<'py>(
        &self,
        py: Python<'py>,
        id: u64,
        out: &crate::scheduler::ReadyOutcome,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Python objects are made and dropped outside the lock: either can run Python code (a
        // weakref callback, a collection) that calls this scheduler again on this thread.
        let handed = self.tables.lock().get(&id).map(|h| match h {
            Handed::Rows(t) => Handed::Rows(t.clone_ref(py)),
            Handed::Csr(t) => Handed::Csr(t.clone_ref(py)),
        });
        let patch = |mut t: Vec<i32>| {
            for &(at, slot) in &out.moved {
                t[at as usize] = slot;
            }
            for &(start, end) in &out.failed_cells {
                t[start as usize..end as usize].fill(-1);
            }
            t
        };
        let (patched, any) = match &handed {
            None => {
                return Err(to_py(
                    py,
                    Error::config("plan", id, "a plan planned through this binding"),
                ))
            }
            Some(Handed::Rows(h)) => {
                let h = h.bind(py);
                let t = table(py, patch(h.readonly().as_slice()?.to_vec()), h.shape()[0])?;
                (Handed::Rows(t.clone().unbind()), t.into_any())
            }
            Some(Handed::Csr(h)) => {
                let t = PyArray1::from_vec(py, patch(h.bind(py).readonly().as_slice()?.to_vec()));
                (Handed::Csr(t.clone().unbind()), t.into_any())
            }
        };
        let replaced = self.tables.lock().insert(id, patched);
        drop((replaced, handed));
        Ok(any)
    }
}

impl Drop for PyStepScheduler {
    fn drop(&mut self) {
        // Copies in flight must end before the tensors they touch are released.
        let poisoned = self.inner.poison().get().is_some();
        // A pool freed under the scheduler: no copy may touch it, not even the drain's.
        let intact = Python::attach(|py| self.check_memory(py).is_ok());
        let s = self.inner.get_mut();
        let drained = !poisoned
            && intact
            && catch_unwind(AssertUnwindSafe(|| each!(s, s => s.drain()))).is_ok();
        if !drained {
            // After an internal error the books may miss a transfer still in flight: the
            // pools' tensors stay alive for good rather than a copy writing freed memory.
            Python::attach(|py| {
                for t in [&self.device, &self.host].into_iter().chain(&self.sidecars) {
                    std::mem::forget(t.clone_ref(py));
                }
            });
        }
    }
}
