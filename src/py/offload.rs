//! The offload directory and block mover from Python: what `sparsetier.vllm` is built on.
//!
//! Keys are vLLM's `OffloadKey`s (`bytes`), read in place. A request's record is reached
//! through a `RequestHandle` kept on its `ReqContext` (`set_state`), and freed when the
//! context goes. Token positions are read from the context's position map in one pass (or
//! through its `get_offload_key_position` where a subclass overrides it), before the core's
//! lock is taken: no Python code runs under it, and a thread that finds it held waits with
//! the GIL released.

use crate::error::Error;
use crate::guard::Guarded;
use crate::offload::{
    BlockMover, BlockTensor, ChunkDirectory, DirectoryConfig, JobSpec, Lookup, PolicyKind, Ref,
    RequestRef,
};
use crate::py::args::{int, int64_array, opt_int, repr, short};
use crate::py::error::{contained, to_py, IntoPyResult};
use crate::py::lock::Unblocked;
use crate::py::tensor::TensorInfo;
use crate::py::transfer::PyTransferEngine;
use crate::transfer::{Direction, MemoryKind};
use crossbeam_channel::{Receiver, Sender};
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A request's record in one directory, as its context carries it. Dropping it (the
/// context is gone) frees the record at the directory's next call.
#[pyclass(name = "RequestHandle", module = "sparsetier._core", frozen)]
pub struct PyRequestHandle {
    owner: u64,
    r: RequestRef,
    released: Sender<RequestRef>,
}

impl Drop for PyRequestHandle {
    fn drop(&mut self) {
        let _ = self.released.send(self.r);
    }
}

/// The keys of a call, borrowed from their `bytes` objects.
struct Keys<'py> {
    objs: Vec<Bound<'py, PyBytes>>,
}

impl<'py> Keys<'py> {
    fn read(keys: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = keys.py();
        let one = |i: usize, k: Bound<'py, PyAny>| -> PyResult<Bound<'py, PyBytes>> {
            k.cast_into::<PyBytes>().map_err(|e| {
                to_py(
                    py,
                    Error::config(
                        format!("keys[{i}]"),
                        short(e.into_inner().as_any()),
                        "bytes (an OffloadKey)",
                    ),
                )
            })
        };
        let objs = if let Ok(list) = keys.cast::<PyList>() {
            list.iter().enumerate().map(|(i, k)| one(i, k)).collect()
        } else if let Ok(t) = keys.cast::<PyTuple>() {
            t.iter().enumerate().map(|(i, k)| one(i, k)).collect()
        } else if keys.is_instance_of::<PyBytes>() || keys.is_instance_of::<pyo3::types::PyString>()
        {
            Err(to_py(
                py,
                Error::config("keys", short(keys), "a collection of OffloadKeys (bytes)"),
            ))
        } else {
            let it = keys.try_iter().map_err(|_| {
                to_py(
                    py,
                    Error::config("keys", short(keys), "a collection of OffloadKeys (bytes)"),
                )
            })?;
            it.enumerate().map(|(i, k)| one(i, k?)).collect()
        }?;
        Ok(Keys { objs })
    }

    fn bytes(&self) -> Vec<&[u8]> {
        self.objs.iter().map(|b| b.as_bytes()).collect()
    }
}

/// vLLM's `ReqContext` as the directory reads it.
struct Context<'py> {
    ctx: Bound<'py, PyAny>,
    /// The position map, unless a subclass overrides the getter.
    map: Option<Bound<'py, PyDict>>,
}

/// The host chunk directory (`sparsetier.offload.directory`) behind
/// `sparsetier.vllm.SparsetierOffloadingManager`.
#[pyclass(name = "ChunkDirectory", module = "sparsetier._core", frozen)]
pub struct PyChunkDirectory {
    inner: Guarded<ChunkDirectory>,
    owner: u64,
    released_tx: Sender<RequestRef>,
    released_rx: Receiver<RequestRef>,
    /// What `lookup` returns for a miss, a hit and a pending hit.
    results: [Py<PyAny>; 3],
    /// `ReqContext.get_offload_key_position`: a context whose class has this one keeps its
    /// positions in `_offload_key_positions`.
    base_position: Option<Py<PyAny>>,
}

/// A request's context is vLLM's `ReqContext` (the handle rides on its state), not None or
/// another object that would fail deep inside with an AttributeError. (`handle_of` checks it:
/// every call that takes a context reads its handle.)
fn check_context(ctx: &Bound<'_, PyAny>) -> PyResult<()> {
    if ctx.hasattr("get_state")? && ctx.hasattr("set_state")? {
        return Ok(());
    }
    let allowed = "a vLLM ReqContext (get_state, set_state)";
    Err(to_py(
        ctx.py(),
        Error::config("req_context", short(ctx), allowed),
    ))
}

impl PyChunkDirectory {
    fn run<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut ChunkDirectory) -> crate::Result<R>,
    ) -> PyResult<R> {
        let rx = &self.released_rx;
        self.inner.run_py(py, |d| {
            while let Ok(r) = rx.try_recv() {
                d.release_request(r);
            }
            f(d)
        })
    }

    fn context<'py>(&self, ctx: &Bound<'py, PyAny>) -> PyResult<Context<'py>> {
        let map = match &self.base_position {
            Some(base) => {
                let getter = ctx.get_type().getattr("get_offload_key_position");
                match getter {
                    Ok(g) if g.is(base.bind(ctx.py())) => ctx
                        .getattr("_offload_key_positions")
                        .ok()
                        .and_then(|m| m.cast_into::<PyDict>().ok()),
                    _ => None,
                }
            }
            None => None,
        };
        Ok(Context {
            ctx: ctx.clone(),
            map,
        })
    }

    /// The handle on `ctx`, if it is one of this directory's.
    fn handle_of(&self, ctx: &Bound<'_, PyAny>) -> PyResult<Option<RequestRef>> {
        let py = ctx.py();
        check_context(ctx)?;
        let h = ctx.call_method1("get_state", (py.get_type::<PyRequestHandle>(),))?;
        Ok(h.cast::<PyRequestHandle>()
            .ok()
            .map(|h| h.get())
            .filter(|h| h.owner == self.owner)
            .map(|h| h.r))
    }

    /// Puts the handle of `r` on `ctx` unless it carries it already.
    fn keep(&self, ctx: &Bound<'_, PyAny>, had: Option<RequestRef>, r: RequestRef) -> PyResult<()> {
        if had == Some(r) {
            return Ok(());
        }
        let h = PyRequestHandle {
            owner: self.owner,
            r,
            released: self.released_tx.clone(),
        };
        ctx.call_method1("set_state", (Bound::new(ctx.py(), h)?,))?;
        Ok(())
    }

    fn position(c: &Context<'_>, key: &Bound<'_, PyBytes>) -> PyResult<Option<i64>> {
        let v = match &c.map {
            Some(m) => m.get_item(key)?,
            None => {
                let v = c.ctx.call_method1("get_offload_key_position", (key,))?;
                (!v.is_none()).then_some(v)
            }
        };
        v.map(|v| int(&v, "req_context offload key position"))
            .transpose()
    }

    fn positions(c: &Context<'_>, keys: &Keys<'_>) -> PyResult<Vec<Option<i64>>> {
        keys.objs.iter().map(|k| Self::position(c, k)).collect()
    }

    /// What a batch call reads before taking the lock: the keys, their positions on the
    /// context, and the context's handle.
    fn batch<'py>(
        &self,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<(Keys<'py>, Vec<Option<i64>>, Option<RequestRef>)> {
        let k = Keys::read(keys)?;
        let had = self.handle_of(req_context)?; // (first: it checks the context)
        let c = self.context(req_context)?;
        let pos = Self::positions(&c, &k)?;
        Ok((k, pos, had))
    }

    fn chunk_array<'py>(
        py: Python<'py>,
        ids: impl Iterator<Item = u32>,
    ) -> Bound<'py, PyArray1<i32>> {
        let v: Vec<i32> = ids.map(|c| c as i32).collect();
        PyArray1::from_vec(py, v)
    }
}

#[pymethods]
impl PyChunkDirectory {
    /// A directory of `num_chunks` chunks (module docs of `sparsetier.offload`).
    /// `results` are the values `lookup` returns for a miss, a hit and a pending hit;
    /// `base_position` is `ReqContext.get_offload_key_position`.
    #[new]
    #[pyo3(signature = (num_chunks, *, results, cache_policy="lru", store_threshold=None, max_tracker_size=None, enable_events=false, base_position=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_chunks: &Bound<'_, PyAny>,
        results: (Py<PyAny>, Py<PyAny>, Py<PyAny>),
        cache_policy: &str,
        store_threshold: Option<&Bound<'_, PyAny>>,
        max_tracker_size: Option<&Bound<'_, PyAny>>,
        enable_events: bool,
        base_position: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        contained(|| {
            let num_chunks = int(num_chunks, "num_chunks")?;
            let num_chunks = u32::try_from(num_chunks).map_err(|_| {
                to_py(
                    py,
                    Error::config("num_chunks", num_chunks, "0 <= num_chunks < 2^32"),
                )
            })?;
            let policy = PolicyKind::parse("cache_policy", cache_policy).py_err(py)?;
            let threshold = opt_int(store_threshold, "store_threshold")?.unwrap_or(0);
            let threshold = u32::try_from(threshold).map_err(|_| {
                to_py(
                    py,
                    Error::config(
                        "store_threshold",
                        threshold,
                        "an integer from 0 to 2^32 - 1",
                    ),
                )
            })?;
            let tracker = opt_int(max_tracker_size, "max_tracker_size")?.unwrap_or(64_000);
            let tracker = usize::try_from(tracker)
                .ok()
                .filter(|&t| t >= 1)
                .ok_or_else(|| {
                    to_py(
                        py,
                        Error::config("max_tracker_size", tracker, "an integer >= 1"),
                    )
                })?;
            let (tx, rx) = crossbeam_channel::unbounded();
            Ok(PyChunkDirectory {
                inner: Guarded::new(ChunkDirectory::new(DirectoryConfig {
                    num_chunks,
                    policy,
                    store_threshold: threshold,
                    max_tracker_size: tracker,
                    events: enable_events,
                })),
                owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
                released_tx: tx,
                released_rx: rx,
                results: [results.0, results.1, results.2],
                base_position,
            })
        })
    }

    /// Chunks in the pool.
    #[getter]
    fn num_chunks(&self, py: Python<'_>) -> PyResult<u32> {
        self.run(py, |d| Ok(d.num_chunks()))
    }

    /// `results[0]` (miss), `[1]` (hit) or `[2]` (hit, store in flight) for `key`.
    #[pyo3(signature = (key, req_context=None))]
    fn lookup(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        req_context: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let _ = req_context;
        let k = key.cast::<PyBytes>().map_err(|_| {
            to_py(
                py,
                Error::config("key", short(key), "bytes (an OffloadKey)"),
            )
        })?;
        let bytes = k.as_bytes();
        let found = self.run(py, |d| Ok(d.lookup(bytes)))?;
        let i = match found {
            Lookup::Miss => 0,
            Lookup::Hit => 1,
            Lookup::HitPending => 2,
        };
        Ok(self.results[i].clone_ref(py))
    }

    /// Starts (or finds) `req_context`'s record.
    fn on_new_request(&self, req_context: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = req_context.py();
        let had = self.handle_of(req_context)?;
        let r = self.run(py, |d| Ok(d.request(had)))?;
        self.keep(req_context, had, r)
    }

    /// Pins the chunks of `keys` for reading; their chunk ids (int32), in order.
    fn prepare_load<'py>(
        &self,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = keys.py();
        let (k, pos, had) = self.batch(keys, req_context)?;
        let bytes = k.bytes();
        let (r, chunks) = self.run(py, |d| d.prepare_load(had, &bytes, &pos))?;
        self.keep(req_context, had, r)?;
        Ok(Self::chunk_array(py, chunks.into_iter().map(|c| c.0)))
    }

    /// Unpins chunks `prepare_load` pinned.
    fn complete_load(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = Keys::read(keys)?;
        let bytes = k.bytes();
        self.run(keys.py(), |d| d.complete_load(&bytes))
    }

    /// Marks `keys` recently used.
    fn touch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let k = Keys::read(keys)?;
        let bytes = k.bytes();
        self.run(keys.py(), |d| {
            d.touch(&bytes);
            Ok(())
        })
    }

    /// `None` if nothing can be stored now, else `(keys_to_store, chunk_ids, evicted_keys)`.
    #[allow(clippy::type_complexity)]
    fn prepare_store<'py>(
        &self,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<
        Option<(
            Bound<'py, PyList>,
            Bound<'py, PyArray1<i32>>,
            Bound<'py, PyList>,
        )>,
    > {
        let py = keys.py();
        let (k, pos, had) = self.batch(keys, req_context)?;
        let bytes = k.bytes();
        let (r, out) = self.run(py, |d| d.prepare_store(had, &bytes, &pos))?;
        self.keep(req_context, had, r)?;
        let Some(out) = out else { return Ok(None) };
        let stored = PyList::new(py, out.stored.iter().map(|&i| &k.objs[i]))?;
        let chunks = Self::chunk_array(py, out.chunks.iter().map(|c| c.0));
        let evicted = PyList::new(py, out.evicted.iter().map(|b| PyBytes::new(py, b)))?;
        Ok(Some((stored, chunks, evicted)))
    }

    /// Completes the stores of `keys`: readable on success, freed on failure.
    #[pyo3(signature = (keys, success=true))]
    fn complete_store(&self, keys: &Bound<'_, PyAny>, success: bool) -> PyResult<()> {
        let k = Keys::read(keys)?;
        let bytes = k.bytes();
        self.run(keys.py(), |d| {
            d.complete_store(&bytes, success);
            Ok(())
        })
    }

    /// The request of `req_context` ended: its keys take their request-scoped recency.
    fn finish_request(&self, req_context: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = req_context.py();
        let Some(r) = self.handle_of(req_context)? else {
            return Ok(());
        };
        // Positions the context gave after the keys were first seen (usually none).
        let missing = self.run(py, |d| Ok(d.unpositioned_keys(r)))?;
        let mut late: Vec<(Bound<'_, PyBytes>, i64)> = Vec::new();
        if !missing.is_empty() {
            let c = self.context(req_context)?;
            for b in missing {
                let k = PyBytes::new(py, &b);
                if let Some(p) = Self::position(&c, &k)? {
                    late.push((k, p));
                }
            }
        }
        let late: Vec<(&[u8], i64)> = late.iter().map(|(k, p)| (k.as_bytes(), *p)).collect();
        self.run(py, |d| {
            d.finish_request(r, &late);
            Ok(())
        })
    }

    /// Forgets every chunk (vLLM's `reset_cache`).
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |d| {
            d.reset();
            Ok(())
        })
    }

    /// The queued events as `(keys, removed, metadata_only)`, oldest first (None when
    /// events are off); the queue is emptied.
    #[allow(clippy::type_complexity)]
    fn take_events<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<Vec<(Bound<'py, PyList>, bool, bool)>>> {
        let Some(events) = self.run(py, |d| Ok(d.take_events()))? else {
            return Ok(None);
        };
        events
            .into_iter()
            .map(|e| {
                let keys = PyList::new(py, e.keys.iter().map(|k| PyBytes::new(py, k)))?;
                Ok((keys, e.removed, e.metadata_only))
            })
            .collect::<PyResult<Vec<_>>>()
            .map(Some)
    }

    /// Of `keys`, those not stored now.
    fn absent<'py>(&self, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let py = keys.py();
        let k = Keys::read(keys)?;
        let bytes = k.bytes();
        let gone: Vec<bool> = self.run(py, |d| {
            Ok(bytes.iter().map(|b| d.lookup(b) == Lookup::Miss).collect())
        })?;
        PyList::new(
            py,
            k.objs.iter().zip(gone).filter(|(_, g)| *g).map(|(o, _)| o),
        )
    }

    /// `(usage, write_usage, read_usage, allocation_sizes, stores_skipped or None)`; the
    /// counters restart.
    #[allow(clippy::type_complexity)]
    fn take_stats(&self, py: Python<'_>) -> PyResult<(f64, f64, f64, Vec<u32>, Option<u64>)> {
        let s = self.run(py, |d| Ok(d.take_stats()))?;
        Ok((
            s.usage.used,
            s.usage.write,
            s.usage.read,
            s.allocation_sizes,
            s.stores_skipped,
        ))
    }

    /// Store candidates skipped by the threshold since the last `take_stats`.
    #[getter]
    fn stores_skipped(&self, py: Python<'_>) -> PyResult<u64> {
        self.run(py, |d| Ok(d.stores_skipped()))
    }

    /// The reuse tracker's count of `key`, if tracked.
    fn tracked_count(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
        let py = key.py();
        let k = key.cast::<PyBytes>().map_err(|_| {
            to_py(
                py,
                Error::config("key", short(key), "bytes (an OffloadKey)"),
            )
        })?;
        let b = k.as_bytes();
        self.run(py, |d| Ok(d.tracked_count(b)))
    }

    /// The tracked keys, least recently offered first (None without a store threshold).
    fn tracked_keys<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(keys) = self.run(py, |d| Ok(d.tracked_keys()))? else {
            return Ok(None);
        };
        PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k))).map(Some)
    }

    /// Counts for tests and monitoring: stored and pending keys, load pins, live request
    /// records, ARC's T1 target.
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (resident, pending, pinned, requests, target) = self.run(py, |d| {
            let (r, p) = d.resident();
            Ok((r, p, d.pinned(), d.live_requests(), d.arc_target()))
        })?;
        let out = PyDict::new(py);
        out.set_item("stored", resident)?;
        out.set_item("storing", pending)?;
        out.set_item("pinned", pinned)?;
        out.set_item("requests", requests)?;
        out.set_item("arc_target", target)?;
        Ok(out)
    }

    /// Checks every invariant; `InvariantError` if one is broken.
    fn validate(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |d| d.validate())
    }
}

// ---- the block mover ----

/// A 1-D array of integer ids, copied.
fn ids(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<i64>> {
    Ok(int64_array(obj, field, "integers")?.as_array().to_vec())
}

/// One tensor's checked facts: address, bytes, rows, row stride, kind, ordinal.
struct Tensor2d {
    base: u64,
    len: u64,
    rows: u32,
    row_bytes: u64,
    stride: u64,
    kind: MemoryKind,
    ordinal: Option<u32>,
    pinned: bool,
}

fn tensor_2d(t: &Bound<'_, PyAny>, field: &str) -> PyResult<Tensor2d> {
    let py = t.py();
    let info = TensorInfo::inspect(t, field)?;
    if !matches!(info.dtype.as_str(), "int8" | "uint8") {
        return Err(to_py(
            py,
            Error::config(
                format!("{field}.dtype"),
                format!("torch.{}", info.dtype),
                "torch.int8 or torch.uint8 (a byte view)",
            ),
        ));
    }
    if info.shape.len() != 2 {
        return Err(to_py(
            py,
            Error::config(
                format!("{field}.shape"),
                format!("{:?}", info.shape),
                "(blocks, bytes per block)",
            ),
        ));
    }
    let strides: Vec<i64> = t.call_method0("stride")?.extract()?;
    let (rows, row_bytes) = (info.shape[0], info.shape[1]);
    if strides[1] != 1 || strides[0] < row_bytes as i64 || rows == 0 || row_bytes == 0 {
        return Err(to_py(
            py,
            Error::config(
                format!("{field}.stride()"),
                format!("{strides:?} for shape {:?}", info.shape),
                "bytes contiguous within a block, blocks at a stride of at least a block, at least one of each",
            ),
        ));
    }
    let rows = u32::try_from(rows).map_err(|_| {
        to_py(
            py,
            Error::config(format!("{field}.shape[0]"), rows, "fewer than 2^32 blocks"),
        )
    })?;
    let stride = strides[0] as u64;
    let kind = info.memory_kind(field).py_err(py)?;
    let ordinal = if kind == MemoryKind::Device {
        let i: Option<u32> = t.getattr("device")?.getattr("index")?.extract()?;
        Some(i.unwrap_or(0))
    } else {
        None
    };
    let pinned = kind == MemoryKind::Host && t.call_method0("is_pinned")?.extract::<bool>()?;
    let base: u64 = t.call_method0("data_ptr")?.extract()?;
    let len = u64::from(rows - 1) * stride + row_bytes;
    Ok(Tensor2d {
        base,
        len,
        rows,
        row_bytes,
        stride,
        kind,
        ordinal,
        pinned,
    })
}

/// The worker side: moves blocks between an engine's block tensors and host pools
/// (`sparsetier.offload.mover`) behind `sparsetier.vllm.SparsetierOffloadingWorker`.
#[pyclass(name = "BlockMover", module = "sparsetier._core", frozen)]
pub struct PyBlockMover {
    // Declared first so it drops first: its jobs finish before the tensors are released.
    inner: Guarded<BlockMover>,
    engines: [Py<PyTransferEngine>; 2],
    _tensors: Vec<Py<PyAny>>,
}

#[pymethods]
impl PyBlockMover {
    /// `device_tensors[i]` `(blocks, page)` byte views and `host_tensors[i]` their pools
    /// `(num_chunks, page * blocks_per_chunk)`; `groups[g]` lists `(tensor index, bytes)` per
    /// layer of KV-cache group `g`. Loads and stores run on `engine`, expedited loads on
    /// `expedited` (the same engine if None).
    #[new]
    #[pyo3(signature = (device_tensors, host_tensors, groups, blocks_per_chunk, num_chunks, engine, expedited=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device_tensors: Vec<Bound<'_, PyAny>>,
        host_tensors: Vec<Bound<'_, PyAny>>,
        groups: Vec<Vec<(usize, u64)>>,
        blocks_per_chunk: &Bound<'_, PyAny>,
        num_chunks: &Bound<'_, PyAny>,
        engine: Bound<'_, PyTransferEngine>,
        expedited: Option<Bound<'_, PyTransferEngine>>,
    ) -> PyResult<Self> {
        contained(|| {
            let bpc = int(blocks_per_chunk, "blocks_per_chunk")?;
            let bpc = u32::try_from(bpc).ok().filter(|&b| b >= 1).ok_or_else(|| {
                to_py(
                    py,
                    Error::config("blocks_per_chunk", bpc, "an integer >= 1"),
                )
            })?;
            let chunks = int(num_chunks, "num_chunks")?;
            let chunks = u32::try_from(chunks).map_err(|_| {
                to_py(
                    py,
                    Error::config("num_chunks", chunks, "0 <= num_chunks < 2^32"),
                )
            })?;
            if device_tensors.len() != host_tensors.len() {
                return Err(to_py(
                    py,
                    Error::config(
                        "host_tensors",
                        format!("{} tensors", host_tensors.len()),
                        format!("{}: one pool per device tensor", device_tensors.len()),
                    ),
                ));
            }
            let expedited = expedited.unwrap_or_else(|| engine.clone());
            let cuda = engine.get().needs_pinned() || expedited.get().needs_pinned();
            let mut tensors = Vec::with_capacity(device_tensors.len());
            for (i, (d, h)) in device_tensors.iter().zip(&host_tensors).enumerate() {
                let dev = tensor_2d(d, &format!("device_tensors[{i}]"))?;
                let host = tensor_2d(h, &format!("host_tensors[{i}]"))?;
                let want = (u64::from(chunks), dev.row_bytes * u64::from(bpc));
                if host.kind != MemoryKind::Host
                    || (u64::from(host.rows), host.row_bytes) != want
                    || host.stride != host.row_bytes
                {
                    return Err(to_py(
                        py,
                        Error::config(
                            format!("host_tensors[{i}]"),
                            repr(h),
                            format!("a contiguous cpu tensor of shape {want:?}: num_chunks x (page x blocks_per_chunk)"),
                        ),
                    ));
                }
                if cuda && (!host.pinned || dev.kind != MemoryKind::Device) {
                    return Err(to_py(
                        py,
                        Error::config(
                            format!("device_tensors[{i}] / host_tensors[{i}]"),
                            repr(d),
                            "a cuda tensor and a pinned host pool for the kernel and direct engines",
                        ),
                    ));
                }
                if !cuda && dev.kind != MemoryKind::Host {
                    return Err(to_py(
                        py,
                        Error::config(
                            "io_backend",
                            "cpu",
                            "cpu tensors for the cpu engine; cuda tensors need kernel or direct",
                        ),
                    ));
                }
                tensors.push(BlockTensor {
                    device_base: dev.base,
                    device_len: dev.len,
                    blocks: dev.rows,
                    block_stride: dev.stride,
                    device_kind: dev.kind,
                    ordinal: dev.ordinal,
                    host_base: host.base,
                    host_len: host.len,
                    page_bytes: dev.row_bytes,
                });
            }
            let groups = groups
                .into_iter()
                .map(|g| {
                    g.into_iter()
                        .map(|(tensor, bytes)| Ref { tensor, bytes })
                        .collect()
                })
                .collect();
            // SAFETY: every tensor was checked (dtype, shape, strides, device, pinning) and
            // its storage is kept alive in `_tensors` for the mover's life (whatever becomes
            // of the tensor); the mover drops first and waits for its jobs, so no copy
            // outlives a buffer.
            let mover = unsafe {
                BlockMover::new(
                    tensors,
                    groups,
                    bpc,
                    chunks,
                    engine.get().shared(),
                    expedited.get().shared(),
                )
            }
            .py_err(py)?;
            let keep = device_tensors
                .iter()
                .chain(&host_tensors)
                .map(|t| t.call_method0("untyped_storage").map(Bound::unbind))
                .collect::<PyResult<_>>()?;
            Ok(PyBlockMover {
                inner: Guarded::new(mover),
                engines: [engine.unbind(), expedited.unbind()],
                _tensors: keep,
            })
        })
    }

    /// Submits job `job_id`: `store` (device to host) or a load; returns at once. Copies
    /// follow the work queued so far on torch's current stream.
    #[pyo3(signature = (job_id, store, block_ids, group_sizes, block_indices, chunk_ids, expedited=false))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        store: bool,
        block_ids: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        chunk_ids: &Bound<'_, PyAny>,
        expedited: bool,
    ) -> PyResult<()> {
        let id = int(job_id, "job_id")?;
        let id = u64::try_from(id)
            .map_err(|_| to_py(py, Error::config("job_id", id, "an integer >= 0")))?;
        let spec = JobSpec {
            direction: if store {
                Direction::Backup
            } else {
                Direction::Load
            },
            blocks: ids(block_ids, "gpu_spec.block_ids")?,
            group_sizes: ids(group_sizes, "gpu_spec.group_sizes")?,
            block_indices: ids(block_indices, "gpu_spec.block_indices")?,
            chunks: ids(chunk_ids, "cpu_spec.block_ids")?,
        };
        for e in &self.engines {
            e.get().follow_torch_stream(py)?;
        }
        self.inner.run_py(py, |m| m.submit(id, &spec, expedited))
    }

    /// Jobs finished since the last call: `(job_id, success, bytes, seconds, error)`.
    #[allow(clippy::type_complexity)]
    fn finished(&self, py: Python<'_>) -> PyResult<Vec<(u64, bool, u64, f64, Option<String>)>> {
        let out = self.inner.get_py(py, |m| m.finished())?;
        Ok(out
            .into_iter()
            .map(|o| (o.job_id, o.success, o.bytes, o.seconds, o.error))
            .collect())
    }

    /// Blocks (GIL released) until the given jobs are finished; unknown ids are skipped.
    /// `job_ids` is a 1-D array or sequence of ints >= 0 (read by value; floats, bools and
    /// strings are refused).
    fn wait(&self, job_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = job_ids.py();
        let arr = int64_array(job_ids, "job_ids", "job ids (ints >= 0)")?;
        let ids = arr
            .as_array()
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                u64::try_from(v).map_err(|_| {
                    let field = format!("job_ids[{i}]");
                    to_py(
                        py,
                        Error::out_of_range(field, v, 0, i128::from(i64::MAX) + 1),
                    )
                })
            })
            .collect::<PyResult<Vec<u64>>>()?;
        let events = self.inner.get_py(py, |m| m.events_of(&ids))?;
        py.detach(|| {
            for ev in events {
                let _ = ev.wait_all(None);
            }
        });
        Ok(())
    }

    /// Jobs not yet reported by `finished`.
    #[getter]
    fn pending(&self, py: Python<'_>) -> PyResult<usize> {
        self.inner.get_py(py, |m| m.pending())
    }

    /// Waits for every job (GIL released).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let events = self.inner.get_py(py, |m| m.all_events())?;
        py.detach(|| {
            for ev in events {
                let _ = ev.wait_all(None);
            }
        });
        Ok(())
    }
}
