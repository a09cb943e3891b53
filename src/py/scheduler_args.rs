//! The step scheduler binding's arguments: request ids, selections (padded or CSR, int64 or
//! int32, read in place), counts, tokens and plans, each checked and refused with a typed error
//! naming the field before the core is called; and the scheduler's configuration from its
//! constructor's arguments.

use crate::error::Error;
use crate::ids::{LayerPlanId, RequestId, SlotId};
use crate::py::args::{int, int64_array, opt_int};
use crate::py::error::{deprecated, to_py};
use crate::py::step_results::PyLayerPlan;
use crate::py::transfer::{PyPageTransferBinding, PyTransferEngine};
use crate::scheduler::SchedulerConfig;
use crate::transfer::MemoryKind;
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// Per-entry token counts as the core takes them: a negative one (no count) is refused,
/// named by `field(index)`; the core checks each against its page.
pub(super) fn counts_u32(
    py: Python<'_>,
    c: &[i32],
    page_size: u32,
    field: impl Fn(usize) -> String,
) -> PyResult<Vec<u32>> {
    if let Some(j) = c.iter().position(|&v| v < 0) {
        return Err(to_py(
            py,
            Error::out_of_range(field(j), c[j], 0, u64::from(page_size) + 1),
        ));
    }
    Ok(c.iter().map(|&v| v as u32).collect())
}

pub(super) fn rid_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<RequestId>> {
    let py = obj.py();
    // The usual input, a contiguous int64 array, is copied out without a borrow (the
    // borrow's bookkeeping costs more than copying a batch of ids, once per layer).
    let ids: Vec<i64> = match obj
        .cast::<PyArray1<i64>>()
        .ok()
        .filter(|a| crate::py::args::in_place(a.as_untyped()))
        .and_then(|a| a.to_vec().ok())
    {
        Some(v) => v,
        None => int64_array(obj, "rids", "request ids >= 0")?
            .as_array()
            .to_vec(),
    };
    ids.into_iter()
        .map(|v| {
            u64::try_from(v)
                .map(RequestId::new)
                .map_err(|_| to_py(py, Error::out_of_range("rids", v, 0, i128::from(i64::MAX))))
        })
        .collect()
}

/// A selection's entries as the caller's array holds them (the core reads either).
#[derive(Clone, Copy)]
pub(super) enum Entries<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

/// CSR entries: int32 as they are, anything else as int64.
pub(super) enum Rows1<'py> {
    I64(numpy::PyReadonlyArray1<'py, i64>),
    I32(numpy::PyReadonlyArray1<'py, i32>),
}

/// A padded selection `[B, K]`: an int64 array (what `torch.topk` returns) or an int32 one.
pub(super) enum Rows2<'py> {
    I64(PyReadonlyArray2<'py, i64>),
    I32(PyReadonlyArray2<'py, i32>),
}

impl<'py> Rows2<'py> {
    /// The array, if it is a 2-D int64 or int32 numpy array, in C order (a copy of one in
    /// any other order: a row is read as a row).
    pub(super) fn extract(obj: &Bound<'py, PyAny>) -> Option<Self> {
        let obj = crate::py::args::c_order(obj).ok()?;
        if let Ok(a) = obj.extract() {
            return Some(Rows2::I64(a));
        }
        obj.extract().ok().map(Rows2::I32)
    }

    pub(super) fn shape(&self) -> &[usize] {
        match self {
            Rows2::I64(a) => a.shape(),
            Rows2::I32(a) => a.shape(),
        }
    }

    /// Its entries, if it is C-contiguous (a Fortran-ordered array's memory is not its rows).
    pub(super) fn as_slice(&self) -> Option<Entries<'_>> {
        match self {
            Rows2::I64(a) if a.is_c_contiguous() => a.as_slice().ok().map(Entries::I64),
            Rows2::I32(a) if a.is_c_contiguous() => a.as_slice().ok().map(Entries::I32),
            _ => None,
        }
    }
}

/// Token ids, read as `HiCache` reads them (`tokens::with_tokens`): 1-D integers in
/// [0, 2^32), or `bytes`/`bytearray`/byte `memoryview`s of little-endian uint32 ids (not a
/// token a byte).
pub(super) fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    crate::py::tokens::with_tokens(obj, |t| Ok(t.to_vec()))
}

/// Device-tier bindings must be where the engine's device memory is (cuda tensors for the
/// CUDA engines, cpu tensors for the cpu engine); host-tier ones on the host, pinned for the
/// CUDA engines.
pub(super) fn check_tiers(
    py: Python<'_>,
    e: &PyTransferEngine,
    devices: &[(&str, &PyPageTransferBinding)],
    hosts: &[(&str, &PyPageTransferBinding)],
) -> PyResult<()> {
    let cuda = e.needs_pinned();
    let want = if cuda {
        MemoryKind::Device
    } else {
        MemoryKind::Host
    };
    for (field, b) in devices {
        if b.inner.kind() != want {
            return Err(to_py(
                py,
                Error::config(
                    *field,
                    format!("a {:?} tensor", b.inner.kind()).to_lowercase(),
                    format!(
                        "a {} tensor for the {} engine",
                        if cuda { "cuda" } else { "cpu" },
                        e.shared().name()
                    ),
                ),
            ));
        }
    }
    for (field, b) in hosts {
        if b.inner.kind() != MemoryKind::Host || (cuda && !b.pinned) {
            return Err(to_py(
                py,
                Error::config(
                    *field,
                    "a device or pageable tensor",
                    "a cpu tensor (pinned, tensor.pin_memory(), for the kernel and direct \
                     engines)",
                ),
            ));
        }
    }
    Ok(())
}

/// The scheduler's configuration from the device slots `d`, the host pool `h` and the
/// arguments: `device_reserve` (>= 0, default 0) and `prefetch_depth` (>= 1, default 1).
pub(super) fn scheduler_config(
    py: Python<'_>,
    layers: u16,
    d: &PyPageTransferBinding,
    h: &PyPageTransferBinding,
    device_reserve: Option<&Bound<'_, PyAny>>,
    prefetch: bool,
    prefetch_depth: Option<&Bound<'_, PyAny>>,
) -> PyResult<SchedulerConfig> {
    let reserve = opt_int(device_reserve, "device_reserve")?.unwrap_or(0);
    let reserve = u32::try_from(reserve).map_err(|_| {
        to_py(
            py,
            Error::config("device_reserve", reserve, "an integer >= 0"),
        )
    })?;
    let depth = opt_int(prefetch_depth, "prefetch_depth")?.unwrap_or(1);
    let depth = u16::try_from(depth)
        .ok()
        .filter(|&d| d >= 1)
        .ok_or_else(|| {
            to_py(
                py,
                Error::config("prefetch_depth", depth, "an integer >= 1"),
            )
        })?;
    Ok(SchedulerConfig {
        layers,
        page_size: d.inner.page_size(),
        device_pages: d.inner.pages(),
        device_reserve: reserve,
        host_pages: h.inner.pages(),
        prefetch,
        prefetch_depth: depth,
    })
}

pub(super) fn rid(obj: &Bound<'_, PyAny>) -> PyResult<RequestId> {
    let v = int(obj, "rid")?;
    u64::try_from(v).map(RequestId::new).map_err(|_| {
        to_py(
            obj.py(),
            Error::out_of_range("rid", v, 0, i128::from(i64::MAX)),
        )
    })
}

pub(super) fn u32_arg(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    field: &str,
    lo: i64,
) -> PyResult<u32> {
    let v = int(obj, field)?;
    u32::try_from(v)
        .ok()
        .filter(|&x| i64::from(x) >= lo)
        .ok_or_else(|| {
            to_py(
                py,
                Error::out_of_range(field, v, lo, i128::from(u32::MAX) + 1),
            )
        })
}

pub(super) fn slots_2d<'py>(
    py: Python<'py>,
    slots: &[SlotId],
    rows: usize,
) -> PyResult<Bound<'py, PyArray2<i32>>> {
    let cols = slots.len().checked_div(rows).unwrap_or(0);
    let v: Vec<i32> = slots.iter().map(|s| s.raw() as i32).collect();
    PyArray1::from_vec(py, v).reshape([rows, cols])
}

/// A slot table as a `[rows, cols]` array that takes over `t`'s buffer: no copy and no
/// reshaped view (this runs once per layer).
pub(super) fn table(
    py: Python<'_>,
    t: Vec<i32>,
    rows: usize,
) -> PyResult<Bound<'_, PyArray2<i32>>> {
    let cols = t.len().checked_div(rows).unwrap_or(0);
    let a = numpy::ndarray::Array2::from_shape_vec((rows, cols), t).map_err(|e| {
        to_py(
            py,
            Error::config("table", e, "rows x columns entries (an internal error)"),
        )
    })?;
    Ok(PyArray2::from_owned_array(py, a))
}

/// A token count >= 1.
pub(super) fn tokens_arg(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let n = int(obj, "tokens")?;
    u64::try_from(n)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| to_py(obj.py(), Error::config("tokens", n, "an integer >= 1")))
}

/// The plan `ready` and `finish` name: a `LayerPlan`, or (one more release, with a
/// DeprecationWarning) its id as an int.
pub(super) fn plan_id(obj: &Bound<'_, PyAny>) -> PyResult<LayerPlanId> {
    if let Ok(p) = obj.cast::<PyLayerPlan>() {
        return Ok(p.get().id());
    }
    let v = int(obj, "plan")?;
    let id = u64::try_from(v).map(LayerPlanId::new).map_err(|_| {
        to_py(
            obj.py(),
            Error::config("plan", v, "a LayerPlan from plan()"),
        )
    })?;
    deprecated(
        obj.py(),
        "a plan id as an int",
        "the LayerPlan plan() returns",
    )?;
    Ok(id)
}

/// The `K` of a selection of shape `(B, K)`, checked to have a row for each of `rows` requests.
pub(super) fn row_width(py: Python<'_>, shape: &[usize], rows: usize) -> PyResult<usize> {
    if shape[0] != rows {
        return Err(to_py(
            py,
            Error::config(
                "selection.shape",
                format!("{shape:?}"),
                format!("({rows}, K): one row per request"),
            ),
        ));
    }
    Ok(shape[1])
}
