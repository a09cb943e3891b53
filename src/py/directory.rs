//! `sparsetier.ResidencyDirectory` and its result types.
//!
//! Keys cross the boundary as one int64 array of shape `(N, 4)`, columns
//! `(namespace, version, page, layer)` with layer -1 for all layers, so a batch is one call
//! and one parse. Slots come back as numpy int64 arrays. Blocking calls and batch work run
//! with the GIL released.

use crate::directory::{
    token_pages as core_token_pages, DeviceState, Directory, DirectoryConfig, DirectoryStats,
    HostState, LayerGroup, Namespace, ObjectKey, ResolveMetrics,
};
use crate::error::Error;
use crate::ids::{PinHandleId, TransferId};
use crate::py::args::{int, int64_array, int64_ndarray, opt_int, short};
use crate::py::error::{contained, to_py, IntoPyResult};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Parses an `(N, 4)` int64 key array (or any integer array or sequence numpy reads as one,
/// by value; floats, bools and strings are refused, never truncated).
fn parse_keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ObjectKey>> {
    let py = obj.py();
    const ALLOWED: &str =
        "an int64 array of shape (N, 4): namespace, version, page, layer (-1 = all)";
    let converted;
    let borrowed = obj
        .extract::<PyReadonlyArray2<'_, i64>>()
        .ok()
        .filter(|a| crate::py::args::in_place(a.as_untyped()));
    let arr: PyReadonlyArray2<'_, i64> = match borrowed {
        Some(a) => a,
        None => {
            converted = int64_ndarray(obj, "keys", ALLOWED)?;
            match converted.extract() {
                Ok(a) => a,
                Err(_) => {
                    let shape = converted.getattr("shape")?.to_string();
                    return Err(to_py(py, Error::config("keys.shape", shape, ALLOWED)));
                }
            }
        }
    };
    let shape = arr.shape();
    if shape.len() != 2 || shape[1] != 4 {
        return Err(to_py(
            py,
            Error::config(
                "keys.shape",
                format!("{shape:?}"),
                "(N, 4): namespace, version, page, layer (-1 = all)",
            ),
        ));
    }
    let arr = arr.as_array();
    let mut keys = Vec::with_capacity(shape[0]);
    for (i, row) in arr.outer_iter().enumerate() {
        let range = |col: usize, name: &str, lo: i128, hi: i128| -> PyResult<i64> {
            let v = row[col];
            if i128::from(v) >= lo && i128::from(v) < hi {
                Ok(v)
            } else {
                Err(to_py(
                    py,
                    Error::out_of_range(format!("keys[{i}].{name}"), v, lo, hi),
                ))
            }
        };
        let ns = range(0, "namespace", 0, i128::from(i64::MAX) + 1)?;
        let version = range(1, "version", 0, i128::from(u32::MAX) + 1)?;
        let page = range(2, "page", 0, i128::from(u32::MAX) + 1)?;
        let layer = range(3, "layer", -1, i128::from(u16::MAX) + 1)?;
        let layers = if layer < 0 {
            LayerGroup::All
        } else {
            LayerGroup::Layer(layer as u16)
        };
        keys.push(ObjectKey::new(
            ns as u64,
            version as u32,
            page as u32,
            layers,
        ));
    }
    Ok(keys)
}

fn keys_array<'py>(py: Python<'py>, keys: &[ObjectKey]) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let rows: Vec<Vec<i64>> = keys
        .iter()
        .map(|k| {
            vec![
                k.namespace.id as i64,
                i64::from(k.namespace.version),
                i64::from(k.page),
                k.layers.code(),
            ]
        })
        .collect();
    if rows.is_empty() {
        return Ok(PyArray2::zeros(py, [0, 4], false));
    }
    PyArray2::from_vec2(py, &rows)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
}

fn transfer_id(obj: &Bound<'_, PyAny>) -> PyResult<TransferId> {
    let v = int(obj, "transfer_id")?;
    u64::try_from(v).map(TransferId::new).map_err(|_| {
        to_py(
            obj.py(),
            Error::out_of_range("transfer_id", v, 1, i128::from(i64::MAX) + 1),
        )
    })
}

fn metrics_dict<'py>(py: Python<'py>, m: &ResolveMetrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("selected", m.selected)?;
    d.set_item("distinct", m.distinct)?;
    d.set_item("ready", m.ready)?;
    d.set_item("absent", m.absent)?;
    d.set_item("loading", m.loading)?;
    d.set_item("inflight_reuse", m.inflight_reuse)?;
    d.set_item("bytes_needed", m.bytes_needed)?;
    d.set_item("bytes_transferred", m.bytes_transferred)?;
    d.set_item("moved_per_needed", m.moved_per_needed())?;
    d.set_item("device_byte_hit_rate", m.device_byte_hit_rate())?;
    d.set_item("resolved_ns", m.resolved_ns)?;
    d.set_item("submitted_ns", m.submitted_ns)?;
    d.set_item("ready_ns", m.ready_ns)?;
    d.set_item("consumed_ns", m.consumed_ns)?;
    Ok(d)
}

pub(crate) fn stats_dict<'py>(py: Python<'py>, s: &DirectoryStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    macro_rules! put {
        ($($f:ident),*) => { $( d.set_item(stringify!($f), s.$f)?; )* };
    }
    put!(
        objects,
        device_absent,
        device_loading,
        device_ready,
        host_none,
        host_writing,
        host_ready,
        pinned_objects,
        pins,
        evictable,
        device_capacity,
        device_free,
        device_used,
        device_quarantined,
        host_capacity,
        host_free,
        host_used,
        host_quarantined,
        transfers_in_flight,
        handles
    );
    let t = &s.totals;
    let totals = PyDict::new(py);
    macro_rules! tot {
        ($($f:ident),*) => { $( totals.set_item(stringify!($f), t.$f)?; )* };
    }
    tot!(
        resolves,
        selected,
        distinct,
        ready,
        absent,
        inflight_reuse,
        bytes_needed,
        bytes_transferred,
        bytes_backed_up,
        evictions,
        second_chances,
        grant_second_chances,
        loads_completed,
        backups_completed,
        failed_transfers,
        retries,
        releases,
        namespaces_dropped
    );
    let ra = if t.bytes_needed == 0 {
        0.0
    } else {
        t.bytes_transferred as f64 / t.bytes_needed as f64
    };
    let hit = if t.distinct == 0 {
        0.0
    } else {
        t.ready as f64 / t.distinct as f64
    };
    totals.set_item("moved_per_needed", ra)?;
    totals.set_item("device_byte_hit_rate", hit)?;
    d.set_item("totals", totals)?;
    Ok(d)
}

/// The receipt of one `resolve`; `ResidencyDirectory.release` consumes it.
#[pyclass(name = "PinHandle", module = "sparsetier._core", frozen)]
pub struct PyPinHandle {
    id: PinHandleId,
}

#[pymethods]
impl PyPinHandle {
    /// The handle's id (never reused).
    #[getter]
    fn id(&self) -> u64 {
        self.id.raw()
    }
    fn __repr__(&self) -> String {
        format!("PinHandle({})", self.id.raw())
    }
}

/// A load the engine must run: `host_slots[i]` to `device_slots[i]`, as one transfer.
#[pyclass(name = "LoadPlan", module = "sparsetier._core", frozen, get_all)]
pub struct PyLoadPlan {
    /// The transfer to complete or fail.
    transfer_id: u64,
    /// Source host slots (int64).
    host_slots: Py<PyArray1<i64>>,
    /// Destination device slots (int64).
    device_slots: Py<PyArray1<i64>>,
}

/// A backup the engine must run: `device_slots[i]` to `host_slots[i]`.
#[pyclass(name = "BackupPlan", module = "sparsetier._core", frozen, get_all)]
pub struct PyBackupPlan {
    /// The transfer to backup_complete or fail; None when nothing needed a backup.
    transfer_id: Option<u64>,
    /// Source device slots (int64).
    device_slots: Py<PyArray1<i64>>,
    /// Destination host slots (int64).
    host_slots: Py<PyArray1<i64>>,
}

/// What `resolve` returns.
#[pyclass(name = "ResolveResult", module = "sparsetier._core", frozen, get_all)]
pub struct PyResolveResult {
    /// Device slot of every key, in order (int64).
    slots: Py<PyArray1<i64>>,
    /// New loads: at most one transfer per batch.
    loads: Vec<Py<PyLoadPlan>>,
    /// In-flight transfers the batch joined.
    joined: Vec<u64>,
    /// The receipt to release.
    handle: Py<PyPinHandle>,
    /// The batch's metrics record.
    metrics: Py<PyDict>,
}

fn i64s<'py, T: Copy>(py: Python<'py>, v: &[T], f: impl Fn(T) -> i64) -> Py<PyArray1<i64>> {
    PyArray1::from_vec(py, v.iter().map(|&x| f(x)).collect()).unbind()
}

/// The residency directory: for every object, where it lives, whether it is ready, who uses it.
#[pyclass(name = "ResidencyDirectory", module = "sparsetier._core", frozen)]
pub struct PyResidencyDirectory {
    inner: std::sync::Arc<Directory>,
}

impl PyResidencyDirectory {
    fn evict_keys(&self, n: &Bound<'_, PyAny>) -> PyResult<Vec<ObjectKey>> {
        let py = n.py();
        let v = int(n, "n")?;
        let n =
            usize::try_from(v).map_err(|_| to_py(py, Error::config("n", v, "an integer >= 0")))?;
        self.run(py, |d| Ok(d.evict(n))).py_err(py)
    }

    /// Evicts at least `n` unpinned, written-through device objects: how many it evicted.
    #[cfg(feature = "testing")]
    pub(crate) fn evict_count(&self, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.evict_keys(n)?.len())
    }

    /// A Python view of a directory another owner (the step scheduler) holds.
    pub(crate) fn shared(inner: std::sync::Arc<Directory>) -> Self {
        PyResidencyDirectory { inner }
    }

    /// Runs `f` on the directory with a panic inside contained (`crate::guard`): it raises
    /// `InternalError`, and every later call on this directory (and on the scheduler that
    /// owns it) does too.
    #[track_caller]
    fn core<R>(&self, f: impl FnOnce(&Directory) -> crate::Result<R>) -> crate::Result<R> {
        self.inner.poison().contain(|| f(&self.inner))
    }

    /// [`Self::core`] with the GIL let go: the directory's lock may be held by another thread
    /// (the scheduler that owns it, in a long call), which must not stop every Python thread.
    fn run<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Directory) -> crate::Result<R> + Send,
    ) -> crate::Result<R> {
        py.detach(|| self.core(f))
    }
}

#[pymethods]
impl PyResidencyDirectory {
    /// Starts recording every call the directory serves (for `sparsetier replay`).
    pub(crate) fn start_journal(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |d| {
            d.start_journal();
            Ok(())
        })
        .py_err(py)
    }

    /// Stops recording and returns the journal as a dict of numpy arrays, or None.
    pub(crate) fn take_journal<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.run(py, |d| Ok(d.take_journal())).py_err(py)? {
            Some(j) => crate::py::replay::journal_dict(py, &j).map(Some),
            None => Ok(None),
        }
    }

    #[new]
    #[pyo3(
        signature = (device_pages, host_pages, *, object_bytes, device_reserve=None, host_reserve=None),
        text_signature = "(device_pages, host_pages, *, object_bytes, device_reserve=0, host_reserve=0)"
    )]
    fn new(
        device_pages: &Bound<'_, PyAny>,
        host_pages: &Bound<'_, PyAny>,
        object_bytes: &Bound<'_, PyAny>,
        device_reserve: Option<&Bound<'_, PyAny>>,
        host_reserve: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        use crate::config::{non_negative_u32, positive_u32};
        let py = device_pages.py();
        let ob = int(object_bytes, "object_bytes")?;
        let cfg = DirectoryConfig {
            device_pages: positive_u32("device_pages", int(device_pages, "device_pages")?)
                .py_err(py)?,
            host_pages: positive_u32("host_pages", int(host_pages, "host_pages")?).py_err(py)?,
            device_reserve: non_negative_u32(
                "device_reserve",
                opt_int(device_reserve, "device_reserve")?.unwrap_or(0),
            )
            .py_err(py)?,
            host_reserve: non_negative_u32(
                "host_reserve",
                opt_int(host_reserve, "host_reserve")?.unwrap_or(0),
            )
            .py_err(py)?,
            object_bytes: u64::try_from(ob)
                .ok()
                .filter(|&b| b >= 1)
                .ok_or_else(|| to_py(py, Error::config("object_bytes", ob, "an integer >= 1")))?,
        };
        Ok(PyResidencyDirectory {
            inner: std::sync::Arc::new(Directory::new(cfg).py_err(py)?),
        })
    }

    /// Creates objects for `keys`, device-Ready in fresh slots (evicting LRU if needed).
    fn allocate<'py>(&self, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let py = keys.py();
        let keys = parse_keys(keys)?;
        let slots = py.detach(|| self.core(|d| d.allocate(&keys))).py_err(py)?;
        Ok(PyArray1::from_vec(
            py,
            slots.iter().map(|s| i64::from(s.raw())).collect(),
        ))
    }

    /// Resolves a batch, all or nothing: Ready objects are pinned, Absent objects with a
    /// Ready host copy start loading, Loading objects are joined.
    #[pyo3(signature = (keys, bytes_needed=None))]
    fn resolve(
        &self,
        keys: &Bound<'_, PyAny>,
        bytes_needed: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyResolveResult> {
        let py = keys.py();
        let needed = match opt_int(bytes_needed, "bytes_needed")? {
            Some(v) => Some(
                u64::try_from(v)
                    .map_err(|_| to_py(py, Error::config("bytes_needed", v, "an integer >= 0")))?,
            ),
            None => None,
        };
        let keys = parse_keys(keys)?;
        let r = py
            .detach(|| self.core(|d| d.resolve(&keys, needed)))
            .py_err(py)?;
        let loads = r
            .loads
            .iter()
            .map(|lp| {
                Py::new(
                    py,
                    PyLoadPlan {
                        transfer_id: lp.transfer.raw(),
                        host_slots: i64s(py, &lp.host_slots, |s| i64::from(s.raw())),
                        device_slots: i64s(py, &lp.device_slots, |s| i64::from(s.raw())),
                    },
                )
            })
            .collect::<PyResult<_>>()?;
        Ok(PyResolveResult {
            slots: i64s(py, &r.slots, |s| i64::from(s.raw())),
            loads,
            joined: r.joined.iter().map(|t| t.raw()).collect(),
            handle: Py::new(py, PyPinHandle { id: r.handle })?,
            metrics: metrics_dict(py, &r.metrics)?.unbind(),
        })
    }

    /// Unpins a resolve's objects; returns its metrics record with the submitted, ready and
    /// consumed times filled in. A second release of the same handle raises.
    fn release<'py>(&self, handle: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
        let py = handle.py();
        let id = match handle.cast::<PyPinHandle>() {
            Ok(h) => h.get().id,
            Err(_) => {
                return Err(to_py(
                    py,
                    Error::config("handle", short(handle), "a PinHandle from resolve"),
                ))
            }
        };
        let m = self.run(py, |d| d.release(id)).py_err(py)?;
        metrics_dict(py, &m)
    }

    /// Records that the engine submitted load `transfer_id`.
    fn mark_submitted(&self, transfer_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::transfer_id(transfer_id)?;
        self.run(transfer_id.py(), |d| d.mark_submitted(id))
            .py_err(transfer_id.py())
    }

    /// Loading -> Ready for every object of load `transfer_id`; wakes waiters.
    fn complete(&self, transfer_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::transfer_id(transfer_id)?;
        self.run(transfer_id.py(), |d| d.complete(id))
            .py_err(transfer_id.py())
    }

    /// Writing -> Ready for every host copy of backup `transfer_id`.
    fn backup_complete(&self, transfer_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::transfer_id(transfer_id)?;
        self.run(transfer_id.py(), |d| d.backup_complete(id))
            .py_err(transfer_id.py())
    }

    /// Fails (or cancels) a transfer: its objects go back to Absent (load) or host None
    /// (backup); destination slots stay quarantined until `transfer_ended`, unless `ended`.
    #[pyo3(signature = (transfer_id, reason, ended=false))]
    fn fail(&self, transfer_id: &Bound<'_, PyAny>, reason: &str, ended: bool) -> PyResult<()> {
        let id = self::transfer_id(transfer_id)?;
        self.run(transfer_id.py(), |d| d.fail(id, reason, ended))
            .py_err(transfer_id.py())
    }

    /// The engine reports failed transfer `transfer_id` can no longer write: its quarantined
    /// slots are freed, exactly once.
    fn transfer_ended(&self, transfer_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::transfer_id(transfer_id)?;
        self.run(transfer_id.py(), |d| d.transfer_ended(id))
            .py_err(transfer_id.py())
    }

    /// Blocks (GIL released) until the transfer finishes. Raises TransferFailedError if it
    /// failed, WaitTimeoutError after `timeout` seconds.
    #[pyo3(signature = (transfer_id, timeout=None))]
    fn wait(&self, transfer_id: &Bound<'_, PyAny>, timeout: Option<f64>) -> PyResult<()> {
        let py = transfer_id.py();
        let id = self::transfer_id(transfer_id)?;
        let timeout = crate::py::args::timeout("timeout", timeout).py_err(py)?;
        py.detach(|| self.core(|d| d.wait(id, timeout))).py_err(py)
    }

    /// Plans write-through backups of device-Ready objects without a host copy.
    fn backup(&self, keys: &Bound<'_, PyAny>) -> PyResult<PyBackupPlan> {
        let py = keys.py();
        let keys = parse_keys(keys)?;
        let p = py.detach(|| self.core(|d| d.backup(&keys))).py_err(py)?;
        Ok(PyBackupPlan {
            transfer_id: p.transfer.map(|t| t.raw()),
            device_slots: i64s(py, &p.device_slots, |s| i64::from(s.raw())),
            host_slots: i64s(py, &p.host_slots, |s| i64::from(s.raw())),
        })
    }

    /// Evicts up to `n` LRU evictable objects; returns their keys as an (M, 4) array.
    fn evict<'py>(&self, n: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let py = n.py();
        let keys = self.evict_keys(n)?;
        keys_array(py, &keys)
    }

    /// Ends a namespace. Returns (objects removed now, objects removed later when their pins
    /// and transfers end).
    #[pyo3(signature = (namespace, version=None), text_signature = "($self, namespace, version=0)")]
    fn drop_namespace(
        &self,
        namespace: &Bound<'_, PyAny>,
        version: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(usize, usize)> {
        let py = namespace.py();
        let id = int(namespace, "namespace")?;
        let ver = opt_int(version, "version")?.unwrap_or(0);
        let id = u64::try_from(id).map_err(|_| {
            to_py(
                py,
                Error::out_of_range("namespace", id, 0, i128::from(i64::MAX) + 1),
            )
        })?;
        let ver = u32::try_from(ver).map_err(|_| {
            to_py(
                py,
                Error::out_of_range("version", ver, 0, i128::from(u32::MAX) + 1),
            )
        })?;
        self.run(py, |d| d.drop_namespace(Namespace { id, version: ver }))
            .py_err(py)
    }

    /// The states of one live object `(namespace, version, page, layer)`, or None.
    pub(crate) fn state<'py>(
        &self,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let py = key.py();
        let allowed = "a (namespace, version, page, layer) tuple of ints";
        let arr = int64_ndarray(key, "key", allowed)?
            .call_method1("reshape", ((1, 4),))
            .map_err(|_| to_py(py, Error::config("key", short(key), allowed)))?;
        let keys = parse_keys(&arr)?;
        let Some(s) = self.run(py, |d| Ok(d.state(&keys[0]))).py_err(py)? else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        let (dev, slot, dt) = match s.device {
            DeviceState::Absent => ("Absent", None, None),
            DeviceState::Loading { slot, transfer } => {
                ("Loading", Some(slot.raw()), Some(transfer.raw()))
            }
            DeviceState::Ready { slot } => ("Ready", Some(slot.raw()), None),
        };
        let (host, hslot, ht) = match s.host {
            HostState::None => ("None", None, None),
            HostState::Writing { slot, transfer } => {
                ("Writing", Some(slot.raw()), Some(transfer.raw()))
            }
            HostState::Ready { slot } => ("Ready", Some(slot.raw()), None),
        };
        d.set_item("device", dev)?;
        d.set_item("device_slot", slot)?;
        d.set_item("host", host)?;
        d.set_item("host_slot", hslot)?;
        d.set_item("transfer_id", dt.or(ht))?;
        d.set_item("pins", s.pins)?;
        d.set_item("lru_stamp", s.stamp)?;
        Ok(Some(d))
    }

    /// Counts per state, pins, quarantined and free/used slots per tier, cumulative totals.
    pub(crate) fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, &self.run(py, |d| Ok(d.stats())).py_err(py)?)
    }

    /// Raises InvariantError if any invariant is broken.
    pub(crate) fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |d| Ok(d.validate()))
            .py_err(py)?
            .map_err(|why| {
                crate::py::error::typed_error(py, "InvariantError", why, &PyDict::new(py))
            })
    }
}

/// Maps selected token positions to pages: distinct pages, tokens, bytes needed (tokens x
/// token_bytes) and bytes to move (pages x page_size x token_bytes).
#[pyfunction]
pub fn token_pages<'py>(
    positions: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    token_bytes: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    contained(|| {
        let py = positions.py();
        let arr = int64_array(positions, "positions", "token positions")?;
        let pos: Vec<u64> = arr
            .as_array()
            .iter()
            .map(|&p| {
                u64::try_from(p).map_err(|_| {
                    to_py(
                        py,
                        Error::out_of_range("positions", p, 0, i128::from(i64::MAX) + 1),
                    )
                })
            })
            .collect::<PyResult<_>>()?;
        let ps =
            crate::config::positive_u32("page_size", int(page_size, "page_size")?).py_err(py)?;
        let tb = int(token_bytes, "token_bytes")?;
        let tb = u64::try_from(tb)
            .ok()
            .filter(|&b| b >= 1)
            .ok_or_else(|| to_py(py, Error::config("token_bytes", tb, "an integer >= 1")))?;
        let tp = core_token_pages(&pos, ps, tb).py_err(py)?;
        let d = PyDict::new(py);
        d.set_item(
            "pages",
            PyArray1::from_vec(py, tp.pages.iter().map(|&p| i64::from(p)).collect()),
        )?;
        d.set_item("tokens", tp.tokens)?;
        d.set_item("bytes_needed", tp.bytes_needed)?;
        d.set_item("bytes_to_move", tp.bytes_to_move)?;
        d.set_item("read_amplification", tp.read_amplification())?;
        Ok(d)
    })
}

/// Benchmark hook: the Rust-side time of `iters` resolves of the shared workload
/// (`directory::bench::ResolveWorkload`), in ns per call, with the GIL released. Used by
/// `sparsetier bench directory` to report the binding's overhead in the same run.
#[cfg(feature = "testing")]
#[pyfunction]
#[pyo3(name = "bench_resolve")]
pub fn bench_resolve(py: Python<'_>, batch: usize, hit_rate: f64, iters: u64) -> PyResult<f64> {
    contained(|| {
        if batch == 0 || iters == 0 || !(0.0..=1.0).contains(&hit_rate) {
            return Err(to_py(
                py,
                Error::config(
                    "batch/hit_rate/iters",
                    format!("{batch}/{hit_rate}/{iters}"),
                    "batch >= 1, 0 <= hit_rate <= 1, iters >= 1",
                ),
            ));
        }
        let w = crate::directory::bench::ResolveWorkload::new(batch, hit_rate).py_err(py)?;
        let total = py.detach(|| {
            w.time_resolves(iters.min(3)); // warm-up
            w.time_resolves(iters)
        });
        Ok(total.as_nanos() as f64 / iters as f64)
    })
}
