//! Page transfer from Python: bindings over torch tensors, prepared transfers, groups, and the
//! engines (`cpu`, `kernel`, `direct`) behind one `TransferEngine`.
//!
//! Tensors are checked (dtype, contiguity, size, device, pinning) before a pointer is taken,
//! and every tensor of a submitted group is kept alive by the engine until the transfer's
//! events are finished, even if the caller drops its handle.

use crate::error::Error;
use crate::layout::HostLayout;
#[cfg(feature = "testing")]
use crate::py::args::int;
use crate::py::args::{int64_array, opt_int, short, string};
use crate::py::error::{contained, to_py, IntoPyResult};
use crate::py::pool::PyPoolSpec;
use crate::py::tensor::TensorInfo;
use crate::transfer::cuda::{CudaEngine, CudaMode};
use crate::transfer::{
    CopyEngine, CpuEngine, Direction, Granularity, LayerStatus, MemoryKind, PageTransferBinding,
    PageTransferGroup, PageTransferMap, PreparedPageTransfer, TransferEvents,
};
#[cfg(feature = "testing")]
use crate::transfer::{Fault, FaultAction};
use numpy::PyUntypedArrayMethods;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::sync::Arc;
use std::time::Duration;

/// One pool buffer (a torch tensor) as the copy engines see it.
#[pyclass(name = "PageTransferBinding", module = "sparsetier._core", frozen)]
pub struct PyPageTransferBinding {
    pub(crate) inner: PageTransferBinding,
    pub(crate) tensor: Py<PyAny>,
    /// Its memory, kept alive by whatever copies into or out of it.
    pub(crate) memory: BoundMemory,
    pub(crate) pinned: bool,
}

/// A bound tensor's storage: held, not the tensor, so that a tensor pointed elsewhere
/// (`tensor.set_()`) or dropped leaves the memory the copies use alive.
pub(crate) struct BoundMemory {
    storage: Py<PyAny>,
    base: u64,
    nbytes: u64,
}

impl BoundMemory {
    /// The storage of `tensor`, as it is now.
    pub(crate) fn of(tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        let storage = tensor.call_method0("untyped_storage")?;
        Ok(BoundMemory {
            base: storage.call_method0("data_ptr")?.extract()?,
            nbytes: storage.call_method0("nbytes")?.extract()?,
            storage: storage.unbind(),
        })
    }

    /// The storage, for an owner that keeps it alive.
    pub(crate) fn keep(&self, py: Python<'_>) -> Py<PyAny> {
        self.storage.clone_ref(py)
    }

    pub(crate) fn clone_ref(&self, py: Python<'_>) -> Self {
        BoundMemory {
            storage: self.storage.clone_ref(py),
            base: self.base,
            nbytes: self.nbytes,
        }
    }

    /// Refuses a storage resized (`untyped_storage().resize_()`) since it was bound: its
    /// memory may be gone.
    pub(crate) fn check(&self, py: Python<'_>, field: &str) -> PyResult<()> {
        // (Interned names: this runs before every copying call of a scheduler.)
        let s = self.storage.bind(py);
        let base: u64 = s.call_method0(pyo3::intern!(py, "data_ptr"))?.extract()?;
        let nbytes: u64 = s.call_method0(pyo3::intern!(py, "nbytes"))?.extract()?;
        if (base, nbytes) != (self.base, self.nbytes) {
            return Err(to_py(
                py,
                Error::config(
                    field,
                    format!(
                        "a tensor whose storage moved or was resized since it was bound \
                         ({:#x}, {} bytes; bound at {:#x}, {} bytes)",
                        base, nbytes, self.base, self.nbytes
                    ),
                    "bound tensors whose storage stays as it was while bound",
                ),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl PyPageTransferBinding {
    #[new]
    #[pyo3(signature = (tensor, spec, layout="layer_first"))]
    fn new(tensor: &Bound<'_, PyAny>, spec: &PyPoolSpec, layout: &str) -> PyResult<Self> {
        contained(|| {
            let py = tensor.py();
            let layout = HostLayout::parse("layout", layout).py_err(py)?;
            spec.check_tensor_in(tensor, layout, None, "tensor")?;
            let info = TensorInfo::inspect(tensor, "tensor")?;
            let kind = info.memory_kind("tensor").py_err(py)?;
            let pinned =
                kind == MemoryKind::Host && tensor.call_method0("is_pinned")?.extract::<bool>()?;
            let ptr: u64 = tensor.call_method0("data_ptr")?.extract()?;
            let len = spec.inner.total_bytes();
            // SAFETY: `tensor` was checked to be a contiguous buffer of exactly `len` bytes with
            // the spec's dtype and shape; we hold its storage for as long as this binding lives
            // (`memory`), and the engine holds it until every transfer over it has finished.
            let mut inner =
                unsafe { PageTransferBinding::new(ptr, len, &spec.inner, layout, kind) }
                    .py_err(py)?;
            if kind == MemoryKind::Device {
                let index: Option<u32> = tensor.getattr("device")?.getattr("index")?.extract()?;
                inner = inner.on_device(index.unwrap_or(0));
            }
            Ok(PyPageTransferBinding {
                inner,
                memory: BoundMemory::of(tensor)?,
                tensor: tensor.clone().unbind(),
                pinned,
            })
        })
    }

    /// The tensor behind the binding.
    #[getter]
    fn tensor(&self, py: Python<'_>) -> Py<PyAny> {
        self.tensor.clone_ref(py)
    }
    /// Layers of the pool.
    #[getter]
    fn layers(&self) -> usize {
        self.inner.layers()
    }
    /// Planes per layer.
    #[getter]
    fn planes_per_layer(&self) -> usize {
        self.inner.planes_per_layer()
    }
    /// `host` or `device`.
    #[getter]
    fn memory(&self) -> &'static str {
        match self.inner.kind() {
            MemoryKind::Host => "host",
            MemoryKind::Device => "device",
        }
    }
    /// Whether a host buffer is pinned (needed by the CUDA engines).
    #[getter]
    fn pinned(&self) -> bool {
        self.pinned
    }
    /// The CUDA device index of a device buffer; None for host memory.
    #[getter]
    fn device_index(&self) -> Option<u32> {
        self.inner.device()
    }

    /// Planes `(start, count)` of `layer`, or of every layer for None.
    #[pyo3(signature = (layer=None))]
    fn plane_range(&self, py: Python<'_>, layer: Option<i64>) -> PyResult<(usize, usize)> {
        contained(|| {
            let l = match layer {
                None => None,
                Some(v) => Some(usize::try_from(v).map_err(|_| {
                    to_py(
                        py,
                        Error::out_of_range("layer", v, 0, self.inner.layers() as u64),
                    )
                })?),
            };
            let r = self.inner.plane_range(l).py_err(py)?;
            Ok((r.start, r.len()))
        })
    }
}

fn units(obj: &Bound<'_, PyAny>, field: &'static str) -> PyResult<Vec<u64>> {
    let py = obj.py();
    let arr = int64_array(obj, field, "page or token indices")?;
    if arr.ndim() != 1 {
        return Err(to_py(
            py,
            Error::config(field, format!("{} dims", arr.ndim()), "a 1-D array"),
        ));
    }
    arr.as_array()
        .iter()
        .map(|&v| {
            u64::try_from(v)
                .map_err(|_| to_py(py, Error::out_of_range(field, v, 0, i128::from(i64::MAX))))
        })
        .collect()
}

/// One pool's transfer: two bindings and the (source, destination) unit pairs.
#[pyclass(name = "PreparedPageTransfer", module = "sparsetier._core", frozen)]
pub struct PyPreparedPageTransfer {
    inner: PreparedPageTransfer,
    memory: [BoundMemory; 2],
    pinned: bool,
}

#[pymethods]
impl PyPreparedPageTransfer {
    #[new]
    #[pyo3(signature = (src, dst, src_units, dst_units, *, direction="load", granularity="page"))]
    fn new(
        src: &PyPageTransferBinding,
        dst: &PyPageTransferBinding,
        src_units: &Bound<'_, PyAny>,
        dst_units: &Bound<'_, PyAny>,
        direction: &str,
        granularity: &str,
    ) -> PyResult<Self> {
        contained(|| {
            let py = src_units.py();
            let direction = match direction {
                "load" => Direction::Load,
                "backup" => Direction::Backup,
                other => {
                    return Err(to_py(
                        py,
                        Error::config("direction", format!("{other:?}"), "load or backup"),
                    ))
                }
            };
            let g = Granularity::parse("granularity", granularity).py_err(py)?;
            let map = PageTransferMap::new(
                g,
                &units(src_units, "src_units")?,
                &units(dst_units, "dst_units")?,
            )
            .py_err(py)?;
            let inner =
                PreparedPageTransfer::new(src.inner.clone(), dst.inner.clone(), map, direction)
                    .py_err(py)?;
            let pinned = [src, dst]
                .iter()
                .all(|b| b.inner.kind() == MemoryKind::Device || b.pinned);
            Ok(PyPreparedPageTransfer {
                inner,
                memory: [src.memory.clone_ref(py), dst.memory.clone_ref(py)],
                pinned,
            })
        })
    }

    /// Units moved, segments after merging, and bytes for every layer.
    fn stats(&self) -> (usize, usize, u64) {
        let m = self.inner.map();
        (
            m.units(),
            m.segments().len(),
            self.inner.bytes(None).unwrap_or(0),
        )
    }
}

/// The pools moved by one cache operation.
#[pyclass(name = "PageTransferGroup", module = "sparsetier._core", frozen)]
pub struct PyPageTransferGroup {
    inner: Arc<PageTransferGroup>,
    memory: Vec<BoundMemory>,
    pinned: bool,
}

#[pymethods]
impl PyPageTransferGroup {
    #[new]
    fn new(py: Python<'_>, members: Vec<PyRef<'_, PyPreparedPageTransfer>>) -> PyResult<Self> {
        contained(|| {
            let inner = PageTransferGroup::new(members.iter().map(|m| m.inner.clone()).collect())
                .py_err(py)?;
            let memory = members
                .iter()
                .flat_map(|m| m.memory.iter().map(|t| t.clone_ref(py)))
                .collect();
            let pinned = members.iter().all(|m| m.pinned);
            Ok(PyPageTransferGroup {
                inner: Arc::new(inner),
                memory,
                pinned,
            })
        })
    }
    /// Layers (the largest member's).
    #[getter]
    fn layers(&self) -> usize {
        self.inner.layers()
    }
    /// Bytes moved for every layer.
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    /// Contiguous copies for `layer` (what an engine runs).
    fn ops_count(&self, py: Python<'_>, layer: usize) -> PyResult<usize> {
        contained(|| Ok(self.inner.layer_ops(layer).py_err(py)?.len()))
    }
}

enum Engine {
    Cpu(Arc<CpuEngine>),
    Cuda(Arc<CudaEngine>),
}

impl Engine {
    fn dyn_ref(&self) -> &dyn CopyEngine {
        match self {
            Engine::Cpu(e) => e.as_ref(),
            Engine::Cuda(e) => e.as_ref(),
        }
    }

    fn shared(&self) -> Arc<dyn CopyEngine> {
        match self {
            Engine::Cpu(e) => Arc::clone(e) as Arc<dyn CopyEngine>,
            Engine::Cuda(e) => Arc::clone(e) as Arc<dyn CopyEngine>,
        }
    }
}

/// A submitted transfer: per-layer events, and the tensors kept alive until it finishes.
#[pyclass(name = "TransferHandle", module = "sparsetier._core", frozen)]
pub struct PyTransferHandle {
    events: Arc<TransferEvents>,
    engine: Py<PyTransferEngine>,
}

fn layer_arg(py: Python<'_>, ev: &TransferEvents, layer: Option<i64>) -> PyResult<Option<usize>> {
    match layer {
        None => Ok(None),
        Some(v) => usize::try_from(v)
            .ok()
            .filter(|l| ev.layers().contains(l))
            .map(Some)
            .ok_or_else(|| {
                to_py(
                    py,
                    Error::config("layer", v, format!("one of {:?}", ev.layers())),
                )
            }),
    }
}

fn timeout_arg(py: Python<'_>, t: Option<f64>) -> PyResult<Option<Duration>> {
    match crate::py::args::timeout("timeout", t) {
        Ok(t) => Ok(t),
        Err(e) => Err(to_py(py, e)),
    }
}

#[pymethods]
impl PyTransferHandle {
    /// Blocks (GIL released) until `layer` (or every layer) is written. Raises
    /// `CopyFailedError` if it failed, `WaitTimeoutError` after `timeout` seconds.
    #[pyo3(signature = (layer=None, timeout=None))]
    fn wait(&self, py: Python<'_>, layer: Option<i64>, timeout: Option<f64>) -> PyResult<()> {
        contained(|| {
            let l = layer_arg(py, &self.events, layer)?;
            let t = timeout_arg(py, timeout)?;
            let ev = Arc::clone(&self.events);
            let r = py.detach(move || match l {
                None => ev.wait_all(t),
                Some(l) => ev.wait_layer(l, t),
            });
            self.engine.get().prune();
            r.py_err(py)
        })
    }

    /// `pending`, `done`, or `failed: <reason>` for `layer`.
    fn status(&self, py: Python<'_>, layer: i64) -> PyResult<String> {
        contained(|| {
            let l = layer_arg(py, &self.events, Some(layer))?.expect("given");
            Ok(match self.events.status(l).py_err(py)? {
                LayerStatus::Pending => "pending".into(),
                LayerStatus::Done => "done".into(),
                LayerStatus::Failed(r) => format!("failed: {r}"),
            })
        })
    }

    /// Whether the engine will no longer write the destinations (every layer done or failed).
    #[getter]
    fn finished(&self) -> bool {
        self.events.is_finished()
    }

    /// The engine's submission number.
    #[getter]
    fn seq(&self) -> u64 {
        self.events.seq()
    }

    /// Layers moved, in order.
    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.events.layers().to_vec()
    }

    /// Seconds from submission to each layer's event (None where not yet recorded).
    fn layer_times(&self) -> Vec<Option<f64>> {
        self.events
            .layer_times()
            .iter()
            .map(|t| t.map(|d| d.as_secs_f64()))
            .collect()
    }

    /// Makes CUDA stream `stream` (a raw CUstream as an int, e.g.
    /// `torch.cuda.current_stream().cuda_stream`) wait for `layer` on the GPU, without
    /// blocking the CPU. Only for the kernel and direct engines. A failed layer raises
    /// CopyFailedError/TransferFailedError instead.
    fn stream_wait(&self, py: Python<'_>, layer: i64, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        contained(|| {
            let Some(stream) = crate::py::args::opt_stream(Some(stream))? else {
                return Err(to_py(
                    py,
                    Error::config("stream", "None", "a raw CUDA stream: an int in [0, 2^64)"),
                ));
            };
            let l = layer_arg(py, &self.events, Some(layer))?.expect("given");
            let idx = self
                .events
                .layers()
                .iter()
                .position(|&x| x == l)
                .expect("checked");
            let engine = self.engine.get();
            match &engine.inner {
                // Through the trait: a failed layer is an error, never a wait that lets stale
                // data through (the inherent call only knows the CUDA events still held).
                Engine::Cuda(e) => {
                    CopyEngine::stream_wait(e.as_ref(), &self.events, idx, stream).py_err(py)
                }
                Engine::Cpu(_) => Err(to_py(
                    py,
                    Error::config(
                        "io_backend",
                        "cpu",
                        "kernel or direct: a stream wait needs a CUDA engine",
                    ),
                )),
            }
        })
    }
}

/// A submission's events and the tensors it reads and writes.
type KeptAlive = (Arc<TransferEvents>, Vec<BoundMemory>);

/// A copy engine chosen by `io_backend`: `cpu`, `kernel` or `direct`. Options: `threads`
/// (cpu; default 2), `device` (the CUDA engines; default torch's current device), `sm_limit`
/// (kernel; default 8), `lanes` (kernel), `per_segment` (direct); an engine refuses the
/// others' options.
#[pyclass(name = "TransferEngine", module = "sparsetier._core", frozen)]
pub struct PyTransferEngine {
    // Declared first so it drops first: its workers finish before the tensors are released.
    inner: Engine,
    backend: crate::config::IoBackend,
    keepalive: Mutex<Vec<KeptAlive>>,
}

impl PyTransferEngine {
    /// The engine, shared with a cache that submits through it.
    pub fn shared(&self) -> Arc<dyn CopyEngine> {
        self.inner.shared()
    }

    /// The `io_backend` it was made with.
    pub fn backend(&self) -> crate::config::IoBackend {
        self.backend
    }

    /// Whether the engine needs pinned host tensors (the CUDA engines).
    pub fn needs_pinned(&self) -> bool {
        matches!(self.inner, Engine::Cuda(_))
    }

    /// CUDA engines: orders the next submissions after the work queued so far on torch's
    /// current stream of the engine's device (the producer of what they copy). A no-op for
    /// the cpu engine, whose tensors are written when the writing call returns.
    pub fn follow_torch_stream(&self, py: Python<'_>) -> PyResult<()> {
        let Engine::Cuda(e) = &self.inner else {
            return Ok(());
        };
        let stream = current_torch_stream(py, e.ordinal())?;
        e.set_producer(Some(stream)).py_err(py)
    }

    /// Releases the tensors of finished submissions; returns how many are still in flight.
    fn prune(&self) -> usize {
        let (done, left) = {
            let mut keep = self.keepalive.lock();
            let (done, live): (Vec<_>, Vec<_>) =
                keep.drain(..).partition(|(ev, _)| ev.is_finished());
            *keep = live;
            (done, keep.len())
        };
        // Dropped once the lock is let go: the last reference to a tensor can run Python code
        // (a weakref callback, `__del__`) that calls this engine again.
        drop(done);
        left
    }
}

/// Options the chosen engine would ignore are refused, so that a setting never silently does
/// nothing (`sm_limit` given to the cpu engine, `threads` to a CUDA one).
fn check_options_apply(
    py: Python<'_>,
    backend: crate::config::IoBackend,
    threads: Option<&Bound<'_, PyAny>>,
    device: Option<&Bound<'_, PyAny>>,
    sm_limit: Option<&Bound<'_, PyAny>>,
    per_segment: bool,
    lanes: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    use crate::config::IoBackend::{Cpu, Direct, Kernel};
    let given = [
        ("threads", threads, backend == Cpu, "io_backend='cpu'"),
        (
            "device",
            device,
            backend != Cpu,
            "the CUDA engines ('kernel', 'direct')",
        ),
        (
            "sm_limit",
            sm_limit,
            backend == Kernel,
            "io_backend='kernel'",
        ),
        ("lanes", lanes, backend == Kernel, "io_backend='kernel'"),
    ];
    for (field, value, applies, engines) in given {
        if let (Some(v), false) = (value, applies) {
            let allowed = format!(
                "None: {field} is only for {engines}, not '{}'",
                backend.name()
            );
            return Err(to_py(py, Error::config(field, short(v), allowed)));
        }
    }
    if per_segment && backend != Direct {
        let allowed = format!(
            "False: per_segment is only for io_backend='direct', not '{}'",
            backend.name()
        );
        return Err(to_py(py, Error::config("per_segment", "True", allowed)));
    }
    Ok(())
}

#[pymethods]
impl PyTransferEngine {
    #[new]
    #[pyo3(
        signature = (io_backend="cpu", *, threads=None, device=None, sm_limit=None, per_segment=false, lanes=None),
        text_signature = "(io_backend='cpu', *, threads=None, device=None, sm_limit=None, per_segment=False, lanes=None)"
    )]
    fn new(
        py: Python<'_>,
        io_backend: &str,
        threads: Option<&Bound<'_, PyAny>>,
        device: Option<&Bound<'_, PyAny>>,
        sm_limit: Option<&Bound<'_, PyAny>>,
        per_segment: bool,
        lanes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        contained(|| {
            let backend = crate::config::IoBackend::parse("io_backend", io_backend).py_err(py)?;
            check_options_apply(py, backend, threads, device, sm_limit, per_segment, lanes)?;
            let device = match opt_int(device, "device")? {
                Some(d) => d,
                // The CUDA engines default to torch's current device, as the tensors do.
                None if backend != crate::config::IoBackend::Cpu => torch_current_device(py),
                None => 0,
            };
            let device = usize::try_from(device).map_err(|_| {
                to_py(
                    py,
                    Error::config("device", device, "a CUDA device ordinal >= 0"),
                )
            })?;
            let inner = match backend {
                crate::config::IoBackend::Cpu => {
                    let t = opt_int(threads, "threads")?.unwrap_or(2);
                    let t = usize::try_from(t).map_err(|_| {
                        to_py(py, Error::config("threads", t, "1 <= threads <= 256"))
                    })?;
                    Engine::Cpu(Arc::new(CpuEngine::new(t).py_err(py)?))
                }
                crate::config::IoBackend::Kernel => {
                    let s = opt_int(sm_limit, "sm_limit")?.unwrap_or(8);
                    let s = u32::try_from(s).ok().filter(|&s| s >= 1).ok_or_else(|| {
                        to_py(py, Error::config("sm_limit", s, "an integer >= 1"))
                    })?;
                    let lanes = match opt_int(lanes, "lanes")? {
                        None => None,
                        Some(l) => Some(u32::try_from(l).map_err(|_| {
                            to_py(
                                py,
                                Error::config("lanes", l, "a power of two from 4 to 512"),
                            )
                        })?),
                    };
                    crate::transfer::cuda::check_lanes(lanes).py_err(py)?;
                    let mode = CudaMode::Kernel { sm_limit: s, lanes };
                    Engine::Cuda(Arc::new(
                        py.detach(|| CudaEngine::new(device, mode)).py_err(py)?,
                    ))
                }
                crate::config::IoBackend::Direct => Engine::Cuda(Arc::new(
                    py.detach(|| CudaEngine::new(device, CudaMode::Direct { per_segment }))
                        .py_err(py)?,
                )),
            };
            Ok(PyTransferEngine {
                inner,
                backend,
                keepalive: Mutex::new(Vec::new()),
            })
        })
    }

    /// `cpu`, `kernel` or `direct`.
    #[getter]
    fn name(&self) -> &'static str {
        self.inner.dyn_ref().name()
    }

    /// Submits every layer of `group` (or one layer); returns at once with its handle.
    #[pyo3(signature = (group, layer=None))]
    fn submit(
        slf: &Bound<'_, Self>,
        group: &PyPageTransferGroup,
        layer: Option<i64>,
    ) -> PyResult<PyTransferHandle> {
        contained(|| {
            let py = slf.py();
            let this = slf.get();
            this.follow_torch_stream(py)?; // copies follow torch's queued writes
            if matches!(this.inner, Engine::Cuda(_)) && !group.pinned {
                return Err(to_py(
                    py,
                    Error::config(
                        "group",
                        "a group with pageable host tensors",
                        "pinned host tensors (tensor.pin_memory()) for the kernel and direct engines",
                    ),
                ));
            }
            let layer = match layer {
                None => None,
                Some(v) => Some(usize::try_from(v).map_err(|_| {
                    to_py(
                        py,
                        Error::out_of_range("layer", v, 0, group.inner.layers() as u64),
                    )
                })?),
            };
            for m in &group.memory {
                m.check(py, "group")?;
            }
            let g = Arc::clone(&group.inner);
            let events = py
                .detach(|| this.inner.dyn_ref().submit(g, layer))
                .py_err(py)?;
            this.prune();
            let memory = group.memory.iter().map(|t| t.clone_ref(py)).collect();
            this.keepalive.lock().push((Arc::clone(&events), memory));
            Ok(PyTransferHandle {
                events,
                engine: slf.clone().unbind(),
            })
        })
    }

    /// Arms a fault for submission number `nth`: `fail` with a reason, `delay` seconds (cpu
    /// engine only), or `panic` with a message (cpu engine only: the worker panics, as a bug
    /// would, and the engine fails the copy from there with the panic's message), at `layer`
    /// (default: the submission's first layer). On the CUDA engines the layers before it are
    /// copied and it and every later layer fail.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_inject_fault", signature = (nth, *, layer=None, fail=None, delay=None, panic=None))]
    fn inject_fault_hook(
        &self,
        py: Python<'_>,
        nth: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
        fail: Option<String>,
        delay: Option<f64>,
        panic: Option<String>,
    ) -> PyResult<()> {
        contained(|| {
            let nth = int(nth, "nth")?;
            let nth = u64::try_from(nth)
                .map_err(|_| to_py(py, Error::config("nth", nth, "a submission number >= 0")))?;
            let layer = match opt_int(layer, "layer")? {
                None => None,
                Some(l) => Some(
                    usize::try_from(l)
                        .map_err(|_| to_py(py, Error::config("layer", l, "a layer >= 0")))?,
                ),
            };
            let action = match (fail, delay, panic) {
                (Some(reason), None, None) => FaultAction::Fail(reason),
                (None, Some(s), None) if crate::py::args::delay("delay", s).is_ok() => {
                    FaultAction::Delay(Duration::from_secs_f64(s))
                }
                (None, None, Some(message)) => FaultAction::Panic(message),
                _ => {
                    return Err(to_py(
                        py,
                        Error::config(
                            "fail/delay/panic",
                            "more than one or none, or a bad delay",
                            "exactly one of fail=<reason>, delay=<seconds >= 0> or \
                             panic=<message>",
                        ),
                    ))
                }
            };
            self.inner
                .dyn_ref()
                .inject(Fault { nth, layer, action })
                .py_err(py)
        })
    }

    /// Deprecated: `sparsetier.testing.inject_copy_fault(engine, nth, ...)`.
    #[cfg(feature = "testing")]
    #[pyo3(signature = (nth, *, layer=None, fail=None, delay=None, panic=None))]
    fn inject_fault(
        &self,
        py: Python<'_>,
        nth: &Bound<'_, PyAny>,
        layer: Option<&Bound<'_, PyAny>>,
        fail: Option<String>,
        delay: Option<f64>,
        panic: Option<String>,
    ) -> PyResult<()> {
        crate::py::error::deprecated(
            py,
            "TransferEngine.inject_fault",
            "sparsetier.testing.inject_copy_fault",
        )?;
        self.inject_fault_hook(py, nth, layer, fail, delay, panic)
    }

    /// Submissions not yet finished (finished ones release their tensors here).
    #[getter]
    fn in_flight(&self) -> usize {
        self.prune()
    }

    /// Submissions so far: the next one is number `submitted` (what `inject_fault`'s `nth`
    /// counts).
    #[getter]
    fn submitted(&self) -> u64 {
        self.inner.dyn_ref().submitted()
    }
}

/// Whether the CUDA engines can start here: `(True, "")` or `(False, why and what to install)`.
#[pyfunction]
#[pyo3(signature = (kernel=true))]
pub fn cuda_status(kernel: bool) -> (bool, String) {
    match crate::transfer::cuda::check_libraries(kernel) {
        Ok(()) => (true, String::new()),
        Err(e) => (false, e.to_string()),
    }
}

/// torch's current CUDA device, or 0 when torch or CUDA is not there.
fn torch_current_device(py: Python<'_>) -> i64 {
    py.import("torch")
        .and_then(|t| t.getattr("cuda")?.call_method0("current_device")?.extract())
        .unwrap_or(0)
}

/// A kernel's cubin for `arch` (e.g. `sm_90`): `kernel` is `page_copy` (the copy kernel) or
/// `resolve` (the device resolver), compiled with NVRTC or read from the disk cache
/// (`cache_dir`, default `$SPARSETIER_KERNEL_CACHE` or `~/.cache/sparsetier/kernels`):
/// `{"arch", "image" (bytes), "path", "from_cache"}`. Needs libnvrtc only.
#[pyfunction]
#[pyo3(signature = (arch, cache_dir=None, kernel="page_copy"))]
pub fn kernel_cubin<'py>(
    py: Python<'py>,
    arch: &Bound<'py, PyAny>,
    cache_dir: Option<std::path::PathBuf>,
    kernel: &str,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    use crate::transfer::cubin::{cubin_of, PAGE_COPY, RESOLVE};
    contained(|| {
        let a = string(arch, "arch")?;
        let src = match kernel {
            "page_copy" => PAGE_COPY,
            "resolve" => RESOLVE,
            other => {
                return Err(to_py(
                    py,
                    Error::config("kernel", other, "page_copy or resolve"),
                ))
            }
        };
        let c = py
            .detach(|| cubin_of(src, &a, cache_dir.as_deref()))
            .py_err(py)?;
        let d = pyo3::types::PyDict::new(py);
        d.set_item("arch", c.arch)?;
        d.set_item("image", pyo3::types::PyBytes::new(py, &c.image))?;
        d.set_item("path", c.path)?;
        d.set_item("from_cache", c.from_cache)?;
        Ok(d)
    })
}

/// Compiles the copy kernel with NVRTC for `arch` and returns the PTX (needs libnvrtc only).
#[pyfunction]
#[pyo3(signature = (arch=None), text_signature = "(arch='sm_90')")]
pub fn compile_cuda_kernels(py: Python<'_>, arch: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    contained(|| {
        const ARCHES: [&str; 7] = [
            "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120",
        ];
        let a = match arch {
            Some(o) => string(o, "arch")?,
            None => "sm_90".to_owned(),
        };
        let Some(&a) = ARCHES.iter().find(|x| **x == a) else {
            return Err(to_py(
                py,
                Error::config("arch", format!("{a:?}"), format!("one of {ARCHES:?}")),
            ));
        };
        py.detach(|| crate::transfer::cuda::compile_kernels(a))
            .py_err(py)
    })
}

/// torch's raw-stream getter, looked up once: `torch._C._cuda_getCurrentRawStream`, or None
/// where this torch lacks it.
static RAW_STREAM: PyOnceLock<Option<Py<PyAny>>> = PyOnceLock::new();

/// The handle of torch's current CUDA stream on device `ordinal`. Every scheduler call on a
/// CUDA engine asks (plan and ready: two a layer), so it goes through torch's raw getter (one
/// C call, as Triton and Inductor do) rather than `torch.cuda.current_stream(i).cuda_stream`,
/// which builds a `Stream` object each time; the same handle, and that path where the getter
/// is missing.
pub(crate) fn current_torch_stream(py: Python<'_>, ordinal: usize) -> PyResult<u64> {
    let raw = RAW_STREAM.get_or_try_init(py, || -> PyResult<_> {
        let c = py.import("torch")?.getattr("_C")?;
        Ok(c.getattr("_cuda_getCurrentRawStream")
            .ok()
            .map(Bound::unbind))
    })?;
    match raw {
        Some(f) => f.bind(py).call1((ordinal,))?.extract(),
        None => py
            .import("torch")?
            .getattr("cuda")?
            .call_method1("current_stream", (ordinal,))?
            .getattr("cuda_stream")?
            .extract(),
    }
}
