//! `_testing.ResolveKernel`: the device resolver's CUDA kernel launched on torch tensors, for
//! the GPU check of the kernel (`sparsetier.tools.resolver_gpu`); with `device="cpu"` (builds
//! with `host-kernel`) the same source on CPU threads over CPU tensors, so that CI runs the
//! check's own logic. Every tensor is checked (device, dtype, contiguity, size, pinning) and
//! every index the kernel takes from one is read back and bounded before the launch: a test
//! hook, so a sync per launch is fine.

use crate::error::Error;
use crate::py::error::{to_py, IntoPyResult};
use crate::py::tensor::TensorInfo;
use crate::scheduler::resolver::abi::{
    self, Geometry, Step, LOG_INTS, NOT_YET, ST_DEF_AT, ST_DEF_LEN, ST_GRANT_LEN, ST_LEN, ST_LOG,
    ST_LOG_CAP, ST_REFILL_AT, ST_ROWS, ST_USED,
};
use crate::scheduler::resolver::launch::{LaunchArgs, ResolveKernel};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The kernel on one CUDA device, or on CPU threads.
#[pyclass(name = "ResolveKernel", module = "sparsetier._core._testing", frozen)]
pub struct PyResolveKernel {
    backend: Backend,
}

enum Backend {
    Gpu(ResolveKernel),
    #[cfg_attr(not(feature = "host-kernel"), allow(dead_code))]
    Cpu {
        threads: u32,
    },
}

/// A checked tensor: its address and element count.
struct Checked {
    ptr: u64,
    numel: u64,
}

/// Where a buffer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Where {
    Cuda(usize),
    /// Pinned host memory (the GPU reads it over unified addressing).
    Pinned,
    Cpu,
}

fn tensor(
    py: Python<'_>,
    t: &Bound<'_, PyDict>,
    name: &str,
    dtype: &str,
    at: Where,
) -> PyResult<Checked> {
    let obj = t
        .get_item(name)?
        .ok_or_else(|| to_py(py, Error::config("tensors", name, "every buffer named")))?;
    let info = TensorInfo::inspect(&obj, name)?;
    if info.dtype != dtype {
        return Err(to_py(
            py,
            Error::config(format!("{name}.dtype"), &info.dtype, dtype),
        ));
    }
    info.require_contiguous(name).py_err(py)?;
    match at {
        Where::Cuda(ordinal) => {
            let index: Option<usize> = obj.getattr("device")?.getattr("index")?.extract()?;
            if info.device_type != "cuda" || index != Some(ordinal) {
                return Err(to_py(
                    py,
                    Error::config(
                        format!("{name}.device"),
                        format!("{}:{index:?}", info.device_type),
                        format!("cuda:{ordinal}"),
                    ),
                ));
            }
        }
        Where::Pinned | Where::Cpu => {
            let pinned = at == Where::Cpu || obj.call_method0("is_pinned")?.extract::<bool>()?;
            if info.device_type != "cpu" || !pinned {
                return Err(to_py(
                    py,
                    Error::config(
                        format!("{name}.device"),
                        &info.device_type,
                        if at == Where::Cpu {
                            "a cpu tensor (the kernel runs on CPU threads)"
                        } else {
                            "pinned host memory (pin_memory=True)"
                        },
                    ),
                ));
            }
        }
    }
    Ok(Checked {
        ptr: obj.call_method0("data_ptr")?.extract()?,
        numel: info.shape.iter().product(),
    })
}

/// A tensor's values, read back to the host.
fn values(t: &Bound<'_, PyDict>, name: &str) -> PyResult<Vec<i64>> {
    let obj = t.get_item(name)?.expect("checked before");
    obj.call_method0("cpu")?
        .call_method1("reshape", (-1,))?
        .call_method0("long")?
        .call_method0("tolist")?
        .extract()
}

fn bounded(py: Python<'_>, name: &str, v: &[i64], lo: i64, hi: i64) -> PyResult<()> {
    match v.iter().find(|&&x| x < lo || x >= hi) {
        Some(&x) => Err(to_py(py, Error::out_of_range(name, x, lo, hi))),
        None => Ok(()),
    }
}

fn need(py: Python<'_>, name: &str, have: u64, want: u64) -> PyResult<()> {
    if have == want {
        Ok(())
    } else {
        Err(to_py(
            py,
            Error::config(format!("{name}.numel()"), have, format!("{want}")),
        ))
    }
}

#[pymethods]
impl PyResolveKernel {
    // The kernel's ABI (`resolver/abi.rs`), for callers that lay out its buffers.
    /// Words in `st`.
    #[classattr]
    const ST_LEN: usize = abi::ST_LEN;
    /// `st` index: entries in the grant (written before a step).
    #[classattr]
    const ST_GRANT_LEN: usize = abi::ST_GRANT_LEN;
    /// `st` index: the step's serial (written before a step).
    #[classattr]
    const ST_SERIAL: usize = abi::ST_SERIAL;
    /// `st` index: log entries the log has room for (written before a step).
    #[classattr]
    const ST_LOG_CAP: usize = abi::ST_LOG_CAP;
    /// `st` index: the step's rows; a launch's rows past them are padding (written before a
    /// step).
    #[classattr]
    const ST_ROWS: usize = abi::ST_ROWS;
    /// `st` index: grant entries deferred.
    #[classattr]
    const ST_DEF_LEN: usize = abi::ST_DEF_LEN;
    /// `st` index: cells left without a slot.
    #[classattr]
    const ST_OVERFLOW: usize = abi::ST_OVERFLOW;
    /// `st` index: cells naming a page past their request.
    #[classattr]
    const ST_BAD: usize = abi::ST_BAD;
    /// Ints per log entry (grant index, mirror entry, row, page, call).
    #[classattr]
    const LOG_INTS: usize = abi::LOG_INTS;
    /// A deferred or log entry's call before it is written.
    #[classattr]
    const NOT_YET: i32 = abi::NOT_YET;

    /// The kernel on CUDA device `device` (an index), or with `device="cpu"` on `threads` CPU
    /// threads (builds with `host-kernel`).
    #[new]
    #[pyo3(signature = (device=None, threads=4))]
    fn new(py: Python<'_>, device: Option<&Bound<'_, PyAny>>, threads: u32) -> PyResult<Self> {
        if let Some(d) = device {
            if d.extract::<String>().is_ok_and(|s| s == "cpu") {
                if !cfg!(feature = "host-kernel") {
                    return Err(to_py(
                        py,
                        Error::config(
                            "device",
                            "cpu",
                            "a CUDA device (a build without host-kernel)",
                        ),
                    ));
                }
                if !(1..=256).contains(&threads) {
                    return Err(to_py(py, Error::out_of_range("threads", threads, 1, 257)));
                }
                return Ok(PyResolveKernel {
                    backend: Backend::Cpu { threads },
                });
            }
        }
        let ordinal: usize = match device {
            Some(d) => d.extract().map_err(|_| {
                to_py(
                    py,
                    Error::config(
                        "device",
                        crate::py::args::short(d),
                        "a CUDA device index or \"cpu\"",
                    ),
                )
            })?,
            None => 0,
        };
        let kernel = py.detach(|| ResolveKernel::new(ordinal)).py_err(py)?;
        Ok(PyResolveKernel {
            backend: Backend::Gpu(kernel),
        })
    }

    /// Launches one layer on `stream` (a raw CUDA stream of the device, e.g.
    /// `torch.cuda.current_stream().cuda_stream`; ignored on the CPU, where the call returns
    /// when the kernel is done). `t` holds the buffers, named as the
    /// kernel's parameters: `sel`, `rows`, `tables`, `table`, `mirror`, `marks`, `filled`,
    /// `grant`, `deferred`, `log`, `st`, `counts` (int32 on the device), `lens`, `tok` and
    /// `planes` (int64 on the device; `planes` = [host pool address, device pool address]),
    /// `host` (uint8 `[pages, page_bytes]`, pinned) and `dev` (uint8 `[slots, page_bytes]` on
    /// the device). Host pages are numbered layer-first (`layer * homes + home`). Every index
    /// the kernel takes from a buffer is read back and bounded first; with `capture` (inside a
    /// CUDA graph's capture, where nothing can be read back) only the buffers and sizes are,
    /// and the caller runs `check` on the same buffers before each replay, or, launching
    /// eagerly with `capture` (to time the launch without its read-backs), just before it.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, t, *, k, layers, layer, page_size, tokens, call, blocks=None, capture=false))]
    fn launch(
        &self,
        py: Python<'_>,
        stream: u64,
        t: &Bound<'_, PyDict>,
        k: u32,
        layers: u32,
        layer: u32,
        page_size: u32,
        tokens: bool,
        call: i32,
        blocks: Option<u32>,
        capture: bool,
    ) -> PyResult<()> {
        if capture && matches!(self.backend, Backend::Cpu { .. }) {
            return Err(to_py(
                py,
                Error::config("capture", "True", "False on the CPU (no graph to capture)"),
            ));
        }
        let args = self.prepare(
            py, t, k, layers, layer, page_size, tokens, call, blocks, !capture,
        )?;
        // SAFETY: every buffer was checked by `prepare` (device, dtype, contiguity, size), the
        // indices the kernel reads from them (rows, homes, lengths, grant slots and victims,
        // deferred entries, earlier log entries, mirror slots) are bounded by the sizes they
        // index (under capture, by `check` before each replay: the caller's contract), the
        // host pool is pinned (mapped for the device under unified addressing) with a page per
        // (home, layer), and the caller's dict keeps every tensor alive while torch's stream
        // (the caller's) runs the launch: the tensors are freed through torch's caching
        // allocator, stream-ordered. (Queuing a launch does not wait: the GIL stays held.) On
        // the CPU the launch has joined its threads when it returns.
        match &self.backend {
            Backend::Gpu(k) => unsafe { k.launch(stream, &args) }.py_err(py),
            #[cfg(feature = "host-kernel")]
            Backend::Cpu { threads } => {
                unsafe { crate::scheduler::resolver::kernel::launch_on_host(*threads, &args) };
                Ok(())
            }
            #[cfg(not(feature = "host-kernel"))]
            Backend::Cpu { .. } => Err(to_py(
                py,
                Error::config(
                    "device",
                    "cpu",
                    "a CUDA device (a build without host-kernel)",
                ),
            )),
        }
    }

    /// The checks `launch` makes, every index included, without launching: before each replay
    /// of a CUDA graph captured with `launch(..., capture=True)`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (t, *, k, layers, layer, page_size, tokens, call))]
    fn check(
        &self,
        py: Python<'_>,
        t: &Bound<'_, PyDict>,
        k: u32,
        layers: u32,
        layer: u32,
        page_size: u32,
        tokens: bool,
        call: i32,
    ) -> PyResult<()> {
        self.prepare(py, t, k, layers, layer, page_size, tokens, call, None, true)
            .map(|_| ())
    }
}

impl PyResolveKernel {
    /// Checks the buffers and the launch's sizes; with `contents`, also every index the kernel
    /// takes from a buffer (read back: not possible while a CUDA graph is captured).
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        t: &Bound<'_, PyDict>,
        k: u32,
        layers: u32,
        layer: u32,
        page_size: u32,
        tokens: bool,
        call: i32,
        blocks: Option<u32>,
        contents: bool,
    ) -> PyResult<LaunchArgs> {
        let dev = match &self.backend {
            Backend::Gpu(k) => Where::Cuda(k.ordinal()),
            Backend::Cpu { .. } => Where::Cpu,
        };
        let i32s = |name| tensor(py, t, name, "int32", dev);
        let (sel, rows, tables, table) =
            (i32s("sel")?, i32s("rows")?, i32s("tables")?, i32s("table")?);
        let (mirror, marks, filled) = (i32s("mirror")?, i32s("marks")?, i32s("filled")?);
        let (grant, deferred, log) = (i32s("grant")?, i32s("deferred")?, i32s("log")?);
        let (st, counts) = (i32s("st")?, i32s("counts")?);
        let lens = tensor(py, t, "lens", "int64", dev)?;
        let tok = tensor(py, t, "tok", "int64", dev)?;
        let planes = tensor(py, t, "planes", "int64", dev)?;
        let host = tensor(
            py,
            t,
            "host",
            "uint8",
            if dev == Where::Cpu {
                Where::Cpu
            } else {
                Where::Pinned
            },
        )?;
        let devpool = tensor(py, t, "dev", "uint8", dev)?;
        if layers == 0 || layer >= layers || k == 0 || page_size == 0 {
            return Err(to_py(
                py,
                Error::config(
                    "k, layers, layer, page_size",
                    format!("{k}, {layers}, {layer}, {page_size}"),
                    "k, layers, page_size >= 1 and layer < layers",
                ),
            ));
        }
        let cells = sel.numel;
        if cells % u64::from(k) != 0 || cells > i32::MAX as u64 {
            return Err(to_py(
                py,
                Error::config("sel.numel()", cells, format!("a multiple of k = {k}")),
            ));
        }
        need(py, "table", table.numel, cells)?;
        // The marks' launch writes `table` before the resolve reads the selection and the
        // page tables: a table over one of them would change what the resolve reads.
        let span = |b: &Checked, width: u64| (b.ptr, b.ptr.saturating_add(b.numel * width));
        let out = span(&table, 4);
        for (name, b, width) in [
            ("sel", &sel, 4),
            ("rows", &rows, 4),
            ("tables", &tables, 4),
            ("lens", &lens, 8),
        ] {
            let (lo, hi) = span(b, width);
            if out.0 < hi && lo < out.1 {
                return Err(to_py(
                    py,
                    Error::config(
                        "table",
                        format!("memory overlapping {name}"),
                        "a buffer of its own (the kernel writes it before reading the others)",
                    ),
                ));
            }
        }
        need(py, "rows", rows.numel, cells / u64::from(k))?;
        let entries = mirror.numel;
        need(py, "marks", marks.numel, entries)?;
        need(py, "filled", filled.numel, entries)?;
        if entries % u64::from(layers) != 0 {
            return Err(to_py(
                py,
                Error::config(
                    "mirror.numel()",
                    entries,
                    format!("homes x {layers} layers"),
                ),
            ));
        }
        if entries > i32::MAX as u64 {
            return Err(to_py(
                py,
                Error::config("mirror.numel()", entries, "entries an int32 index holds"),
            ));
        }
        let homes = entries / u64::from(layers);
        let dims = |name: &str| -> PyResult<Vec<u64>> {
            Ok(TensorInfo::inspect(&t.get_item(name)?.expect("checked"), name)?.shape)
        };
        let (hs, ds) = (dims("host")?, dims("dev")?);
        if hs.len() != 2 || ds.len() != 2 || hs[1] != ds[1] || hs[0] != entries {
            return Err(to_py(
                py,
                Error::config(
                    "host, dev",
                    format!("{hs:?}, {ds:?}"),
                    format!("[{entries}, page_bytes] and [slots, page_bytes]"),
                ),
            ));
        }
        let (page_bytes, slots) = (hs[1], ds[0]);
        let rows_n = lens.numel;
        if rows_n == 0 || tables.numel % rows_n != 0 {
            return Err(to_py(
                py,
                Error::config("tables.numel()", tables.numel, "table rows x pages_per_row"),
            ));
        }
        let ppr = tables.numel / rows_n;
        need(py, "deferred", deferred.numel, grant.numel)?;
        need(py, "st", st.numel, ST_LEN as u64)?;
        need(py, "counts", counts.numel, 2 * u64::from(layers))?;
        need(py, "tok", tok.numel, 3)?;
        need(py, "planes", planes.numel, 2)?;
        if grant.numel % 2 != 0 || log.numel % LOG_INTS as u64 != 0 {
            return Err(to_py(
                py,
                Error::config(
                    "grant, log",
                    format!("{}, {}", grant.numel, log.numel),
                    "2 ints a grant entry and 5 a log entry",
                ),
            ));
        }
        let capacity = log.numel / LOG_INTS as u64;
        if contents {
            // The indices the kernel takes from the buffers.
            bounded(py, "rows", &values(t, "rows")?, 0, rows_n as i64)?;
            bounded(py, "tables", &values(t, "tables")?, 0, homes as i64)?;
            bounded(
                py,
                "lens",
                &values(t, "lens")?,
                0,
                (ppr * u64::from(page_size)) as i64 + 1,
            )?;
            let st_now = values(t, "st")?;
            bounded(
                py,
                "st[ST_GRANT_LEN]",
                &st_now[ST_GRANT_LEN..=ST_GRANT_LEN],
                0,
                grant.numel as i64 / 2 + 1,
            )?;
            // The counters the kernel indexes with (each index below its bound is checked
            // there, a negative one is not).
            for (name, i) in [("st[ST_USED]", ST_USED), ("st[ST_LOG]", ST_LOG)] {
                bounded(py, name, &st_now[i..=i], 0, i64::from(i32::MAX))?;
            }
            // The cursors as a step leaves them: deferrals consume grant entries, and the
            // cursors over deferrals and the log stay inside what they index.
            let grant_len = st_now[ST_GRANT_LEN];
            let def_len = st_now[ST_DEF_LEN];
            bounded(
                py,
                "st[ST_DEF_LEN]",
                &[def_len],
                0,
                st_now[ST_USED].min(grant_len) + 1,
            )?;
            bounded(py, "st[ST_DEF_AT]", &[st_now[ST_DEF_AT]], 0, def_len + 1)?;
            bounded(
                py,
                "st[ST_ROWS]",
                &st_now[ST_ROWS..=ST_ROWS],
                0,
                rows.numel as i64 + 1,
            )?;
            bounded(
                py,
                "st[ST_LOG_CAP]",
                &st_now[ST_LOG_CAP..=ST_LOG_CAP],
                0,
                capacity as i64 + 1,
            )?;
            bounded(
                py,
                "st[ST_REFILL_AT]",
                &[st_now[ST_REFILL_AT]],
                0,
                capacity as i64 + 1,
            )?;
            // The grant's first st[ST_GRANT_LEN] entries are the step's.
            let g = values(t, "grant")?;
            let g = &g[..2 * st_now[ST_GRANT_LEN] as usize];
            let slots_g: Vec<i64> = g.iter().step_by(2).copied().collect();
            let victims: Vec<i64> = g.iter().skip(1).step_by(2).copied().collect();
            bounded(py, "grant slots", &slots_g, 0, slots as i64)?;
            bounded(py, "grant victims", &victims, -1, entries as i64)?;
            let d = values(t, "deferred")?;
            bounded(
                py,
                "deferred",
                &d.iter().step_by(2).copied().collect::<Vec<_>>(),
                0,
                grant_len.max(1),
            )?;
            let l = values(t, "log")?;
            // Entries written by earlier calls (their call set; the rest read NOT_YET).
            for (i, en) in l
                .chunks(LOG_INTS)
                .enumerate()
                .filter(|(_, en)| en[4] != i64::from(NOT_YET))
            {
                if en[0] < 0
                    || en[0] >= grant.numel as i64 / 2
                    || en[1] < 0
                    || en[1] >= entries as i64
                {
                    return Err(to_py(
                        py,
                        Error::config(
                            format!("log[{i}]"),
                            format!("{en:?}"),
                            "an entry of this grant and mirror, of an earlier call",
                        ),
                    ));
                }
            }
            bounded(py, "mirror", &values(t, "mirror")?, -1, slots as i64)?;
            let p = values(t, "planes")?;
            if p != [host.ptr as i64, devpool.ptr as i64] {
                return Err(to_py(
                    py,
                    Error::config(
                        "planes",
                        format!("{p:?}"),
                        "[host.data_ptr(), dev.data_ptr()]",
                    ),
                ));
            }
        }
        let args = LaunchArgs {
            sel: sel.ptr,
            rows: rows.ptr,
            tables: tables.ptr,
            lens: lens.ptr,
            table: table.ptr,
            step: Step {
                mirror: mirror.ptr as *mut i32,
                marks: marks.ptr as *mut u32,
                filled: filled.ptr as *mut u32,
                grant: grant.ptr as *const i32,
                deferred: deferred.ptr as *mut i32,
                log: log.ptr as *mut i32,
                st: st.ptr as *mut u32,
                counts: counts.ptr as *mut u32,
                tok: tok.ptr as *mut u64,
                call,
            },
            geo: Geometry {
                host_planes: planes.ptr as *const u64,
                dev_planes: (planes.ptr + 8) as *const u64,
                host_stride: page_bytes,
                dev_stride: page_bytes,
                page_bytes,
                planes: 1,
                order_first: 1,
                order_n: homes as u32,
            },
            cells: cells as u32,
            k,
            pages_per_row: ppr as u32,
            layers,
            layer,
            page_size,
            tokens,
            blocks,
        };
        Ok(args)
    }
}
