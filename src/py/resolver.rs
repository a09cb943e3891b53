//! `sparsetier.DeviceResolver`: the device side of a joined scheduler's decode step
//! (`JoinedStepScheduler.enable_device_resolver`). One call a layer for the batch, which never
//! enters the scheduler: it works on the resolver's own state (the mirror, page tables, the
//! grant) under its own lock, with the GIL released. On the cpu engine's pools it runs the
//! reference implementation (numpy in and out); on CUDA pools, the kernel on their GPU (torch
//! tensors in and out, queued on the step's stream, nothing read back).

use crate::error::Error;
use crate::py::error::{to_py, IntoPyResult};
use crate::py::scheduler::PyStepScheduler;
use crate::py::scheduler_args::{rid_list, u32_arg};
use crate::py::tensor::TensorInfo;
use crate::scheduler::resolver::ResolverState;
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use parking_lot::Mutex;
use pyo3::prelude::*;
use std::sync::Arc;

/// Maps each layer's top-k to device slots and serves the misses from host, within the slots
/// the scheduler granted for the step (`begin_device_step`); the scheduler learns what it did
/// at `end_step`.
#[pyclass(name = "DeviceResolver", module = "sparsetier._core", frozen)]
pub struct PyDeviceResolver {
    state: Arc<Mutex<ResolverState>>,
    layers: u16,
    /// The CUDA device its kernel runs on (CUDA pools), else `None` (the reference).
    gpu: Option<usize>,
    /// The scheduler whose pools the copies read and write: kept alive with this object.
    #[allow(dead_code)]
    owner: Py<PyStepScheduler>,
}

impl PyDeviceResolver {
    pub(crate) fn new(
        py: Python<'_>,
        state: Arc<Mutex<ResolverState>>,
        owner: Py<PyStepScheduler>,
        gpu: Option<usize>,
    ) -> Self {
        // (The lock may be held by a step of the scheduler's on another thread.)
        let layers = py.detach(|| state.lock().layers());
        PyDeviceResolver {
            state,
            layers,
            gpu,
            owner,
        }
    }

    /// One layer on the GPU: `selection` a CUDA int32 `[B, K]` tensor on the resolver's
    /// device; the slot table comes back as a tensor like it, both queued on the step's stream
    /// (which must be torch's current one: the tensors' memory is ordered on it).
    fn resolve_cuda<'py>(
        &self,
        py: Python<'py>,
        (layer, ids): (u16, &[crate::ids::RequestId]),
        selection: &Bound<'py, PyAny>,
        tokens: bool,
        ordinal: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let info = TensorInfo::inspect(selection, "selection")?;
        let index: Option<usize> = selection.getattr("device")?.getattr("index")?.extract()?;
        if info.device_type != "cuda" || index != Some(ordinal) {
            return Err(to_py(
                py,
                Error::config(
                    "selection.device",
                    format!("{}:{index:?}", info.device_type),
                    format!("cuda:{ordinal}, the pools' device (the resolver runs there)"),
                ),
            ));
        }
        if info.dtype != "int32" {
            return Err(to_py(
                py,
                Error::config("selection.dtype", &info.dtype, "int32"),
            ));
        }
        info.require_contiguous("selection").py_err(py)?;
        if info.shape.len() != 2 {
            return Err(to_py(
                py,
                Error::config(
                    "selection.shape",
                    format!("{:?}", info.shape),
                    "(B, K): one row per request",
                ),
            ));
        }
        let shape: Vec<usize> = info.shape.iter().map(|&d| d as usize).collect();
        let (rows, k) = rows_and_width(py, &shape, ids.len())?;
        let stream = crate::py::transfer::current_torch_stream(py, ordinal)?;
        let table = py
            .import("torch")?
            .call_method1("empty_like", (selection,))?;
        let sel: u64 = selection.call_method0("data_ptr")?.extract()?;
        let out: u64 = table.call_method0("data_ptr")?.extract()?;
        py.detach(|| {
            // SAFETY (the launch below): both tensors were checked: contiguous int32 on the
            // kernel's device, of `ids.len() * k` elements; their memory is ordered on the
            // step's stream (torch's current one, checked), so it is not reused before the
            // launch has run.
            let mut st = self.state.lock();
            // (Checked under the lock the launch takes: the step's stream cannot change
            // between the two.)
            let step = st.stream();
            // Under a CUDA graph's capture of this stream (the step's or another) the launch
            // is captured there.
            let capturing = st.stream_capturing(stream)?;
            if stream != step && !capturing {
                return Err(Error::config(
                    "stream",
                    format!("{stream:#x}"),
                    format!("the step's stream ({step:#x}), current at begin_device_step"),
                ));
            }
            let capture = capturing.then_some(stream);
            unsafe { st.resolve_layer_device(layer, ids, (sel, out), (rows, k, tokens), capture) }
        })
        .py_err(py)?;
        Ok(table)
    }
}

/// A selection's rows and width: at least a row per request of the batch (`n`); rows past
/// them are padding, which the resolver allows for the step's batch in its order.
fn rows_and_width(py: Python<'_>, shape: &[usize], n: usize) -> PyResult<(usize, usize)> {
    if shape.len() != 2 || shape[0] < n {
        return Err(to_py(
            py,
            Error::config(
                "selection.shape",
                format!("{shape:?}"),
                format!("(B, K) with B >= {n}: a row per request, padding rows after"),
            ),
        ));
    }
    Ok((shape[0], shape[1]))
}

/// `will_replay`'s `rows`: a graph's batch bucket, or `None`.
fn rows_arg(rows: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    match rows {
        Some(r) if !r.is_none() => Ok(Some(crate::py::args::unsigned::<usize>(r, "rows")?)),
        _ => Ok(None),
    }
}

#[pymethods]
impl PyDeviceResolver {
    /// A cell's slot when its object's copy failed, and its retry: its request has no data
    /// for that layer (the caller fails it for the step).
    #[classattr]
    const FAILED: i32 = crate::scheduler::resolver::FAILED;

    /// Resolves `layer` for the batch `rids` (int64, the granted step's requests):
    /// `selection` is a C-contiguous int32 `[B, K]` array of entries (-1 = none), block ids of
    /// a page each, or with `tokens` token indices. Returns the slot table (int32 `[B, K]`, -1
    /// where an entry names nothing, `FAILED` where its copy failed twice). `B` may exceed
    /// `len(rids)` when `rids` is the step's batch in its order: the rows past it are padding
    /// (a CUDA graph's batch bucket), left -1. On CUDA pools both
    /// are CUDA tensors on the pools' device, and the work is queued on the step's stream:
    /// nothing is read back, and entries past their request are reported by `end_step`.
    #[pyo3(signature = (layer, rids, selection, tokens=false))]
    fn resolve<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        rids: &Bound<'py, PyAny>,
        selection: &Bound<'py, PyAny>,
        tokens: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layer = u32_arg(py, layer, "layer", 0)?;
        let layer = u16::try_from(layer)
            .ok()
            .filter(|&l| l < self.layers)
            .ok_or_else(|| to_py(py, Error::out_of_range("layer", layer, 0, self.layers)))?;
        let ids = rid_list(rids)?;
        if let Some(ordinal) = self.gpu {
            return self.resolve_cuda(py, (layer, &ids), selection, tokens, ordinal);
        }
        let sel: PyReadonlyArray2<'py, i32> = crate::py::args::c_order(selection)?
            .extract()
            .map_err(|_| {
                to_py(
                    py,
                    Error::config(
                        "selection",
                        crate::py::args::short(selection),
                        "a C-contiguous int32 numpy array [B, K]",
                    ),
                )
            })?;
        let (rows, k) = rows_and_width(py, sel.shape(), ids.len())?;
        let flat = sel.as_slice().map_err(|_| {
            to_py(
                py,
                Error::config(
                    "selection",
                    "a non-contiguous array",
                    "a C-contiguous array",
                ),
            )
        })?;
        let mut table = vec![-1i32; flat.len()];
        py.detach(|| {
            self.state
                .lock()
                .resolve_layer(layer, &ids, flat, k, tokens, &mut table)
        })
        .py_err(py)?;
        let table: Bound<'py, PyArray2<i32>> =
            numpy::PyArray1::from_vec(py, table).reshape([rows, k])?;
        Ok(table.into_any())
    }

    /// Test builds with `host-kernel` (`make build`): from the next step on, resolves with the
    /// CUDA kernel's source compiled for the CPU, run on `threads` threads (1 to 256) that race
    /// as the GPU's warps do, instead of the reference. Refused while a step is open.
    #[cfg(all(feature = "testing", feature = "host-kernel"))]
    #[pyo3(name = "_use_host_kernel", signature = (threads=4))]
    fn use_host_kernel(&self, py: Python<'_>, threads: usize) -> PyResult<()> {
        py.detach(|| self.state.lock().use_host_kernel(threads))
            .py_err(py)
    }

    /// Test builds: the read-backs of the next `count` steps fail when they end, as a GPU's
    /// can (the kernel only: the reference reads nothing back).
    #[cfg(feature = "testing")]
    #[pyo3(name = "_fail_read_backs", signature = (count=1))]
    fn fail_read_backs(&self, py: Python<'_>, count: u32) -> PyResult<()> {
        py.detach(|| self.state.lock().fail_read_backs(count))
            .py_err(py)
    }

    /// Test builds: nanoseconds the host spent in the kernel's device calls when steps opened
    /// and closed, in all (on the CPU the device's work itself; on a GPU queuing and the
    /// step's one wait), or None on the reference. `bench decode --resolve device
    /// --kernel-threads` takes it out of the core's time.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_kernel_device_ns")]
    fn kernel_device_ns(&self, py: Python<'_>) -> Option<u64> {
        py.detach(|| self.state.lock().kernel_device_ns())
    }

    /// The epoch of the open step's launch arguments on a device (None on the reference):
    /// it changes when the resolver's buffers move (they grow by powers of two; `reserve`
    /// sizes them for the largest steps). A graph captured in one epoch replays in steps of
    /// the same epoch only.
    #[getter]
    fn graph_epoch(&self, py: Python<'_>) -> Option<u64> {
        py.detach(|| self.state.lock().graph_epoch())
    }

    /// Before a CUDA graph that captured the launches of `layers` (`resolve` under capture)
    /// is replayed in the open step: accounts them, in order, as the step's next calls.
    /// `rows` names the graph's rows (its batch bucket) when a layer has captures over
    /// several. Refused (`ConfigError`, nothing changed) unless each layer's launch was
    /// captured in this `graph_epoch` with a row per request of the step at least, in capture
    /// order, no layer resolved twice, and (on a GPU) torch's current stream is the step's.
    #[pyo3(signature = (layers, rows=None))]
    fn will_replay(
        &self,
        py: Python<'_>,
        layers: &Bound<'_, PyAny>,
        rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let rows = rows_arg(rows)?;
        let layers: Vec<u16> = layers
            .try_iter()
            .map_err(|_| {
                to_py(
                    py,
                    Error::config(
                        "layers",
                        crate::py::args::short(layers),
                        "an iterable of layer indices",
                    ),
                )
            })?
            .map(|l| crate::py::args::unsigned::<u16>(&l?, "layers"))
            .collect::<PyResult<_>>()?;
        let stream = match self.gpu {
            Some(ordinal) => Some(crate::py::transfer::current_torch_stream(py, ordinal)?),
            None => None,
        };
        py.detach(|| {
            let mut st = self.state.lock();
            if let Some(stream) = stream.filter(|&s| s != st.stream()) {
                return Err(Error::config(
                    "stream",
                    format!("{stream:#x}"),
                    format!(
                        "the step's stream ({:#x}), current at begin_device_step",
                        st.stream()
                    ),
                ));
            }
            st.will_replay(&layers, rows)
        })
        .py_err(py)
    }

    /// Sizes the resolver's device buffers for steps of up to `requests` requests (and as
    /// many running), rows of up to `entries` entries and requests of up to `pages` pages:
    /// while steps stay within them `graph_epoch` stays put, so graphs captured once replay
    /// for the whole run. Between steps only; nothing to do on the reference.
    fn reserve(
        &self,
        py: Python<'_>,
        requests: &Bound<'_, PyAny>,
        entries: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let requests = crate::py::args::unsigned::<usize>(requests, "requests")?;
        let entries = crate::py::args::unsigned::<usize>(entries, "entries")?;
        let pages = crate::py::args::unsigned::<usize>(pages, "pages")?;
        py.detach(|| self.state.lock().reserve(requests, entries, pages))
            .py_err(py)
    }

    /// Test builds: while `on`, the kernel on CPU threads records each launch instead of
    /// running it, as a CUDA graph's capture does (`_replay_recorded` runs them).
    #[cfg(feature = "testing")]
    #[pyo3(name = "_record_launches")]
    fn record_launches(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        py.detach(|| self.state.lock().record_launches(on))
            .py_err(py)
    }

    /// Test builds: runs the launches recorded for `layers` with their arguments as
    /// recorded (a graph's replay; `will_replay` first). The arrays a recorded launch read
    /// and wrote (the selection passed, the table returned) must still be alive: the caller
    /// keeps them.
    #[cfg(feature = "testing")]
    #[pyo3(name = "_replay_recorded", signature = (layers, rows=None))]
    fn replay_recorded(
        &self,
        py: Python<'_>,
        layers: Vec<u16>,
        rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let rows = rows_arg(rows)?;
        // SAFETY: the caller's contract above (test builds only).
        py.detach(|| unsafe { self.state.lock().replay_recorded(&layers, rows) })
            .py_err(py)
    }

    /// Whether a step is granted and not yet ended.
    #[getter]
    fn step_open(&self, py: Python<'_>) -> bool {
        py.detach(|| self.state.lock().is_open())
    }
}
