//! Directory journals to and from Python (numpy arrays in a dict, saved as `.npz` by
//! `sparsetier.replay`), and the replays of `crate::replay`.

use crate::directory::journal::Journal;
use crate::error::Error;
use crate::py::args::{int64_ndarray, string, unsigned};
use crate::py::error::{contained, to_py, IntoPyResult};
use crate::replay::{peak_live, replay_lru, replay_min, ReplayStats};
use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The journal as a dict of numpy arrays and two integers.
pub(crate) fn journal_dict<'py>(py: Python<'py>, j: &Journal) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("ops", PyArray1::from_slice(py, &j.ops))?;
    d.set_item("args", PyArray1::from_slice(py, &j.args))?;
    d.set_item("flags", PyArray1::from_slice(py, &j.flags))?;
    d.set_item("starts", PyArray1::from_slice(py, &j.starts))?;
    d.set_item("ns", PyArray1::from_slice(py, &j.ns))?;
    d.set_item("version", PyArray1::from_slice(py, &j.version))?;
    d.set_item("page", PyArray1::from_slice(py, &j.page))?;
    d.set_item("layer", PyArray1::from_slice(py, &j.layer))?;
    d.set_item("home", PyArray1::from_slice(py, &j.home))?;
    d.set_item("object_bytes", j.object_bytes)?;
    d.set_item("device_slots", j.device_slots)?;
    Ok(d)
}

fn array<'py, T: numpy::Element + Copy>(
    trace: &Bound<'py, PyDict>,
    field: &str,
) -> PyResult<Vec<T>> {
    let py = trace.py();
    let item = trace.get_item(field)?.ok_or_else(|| {
        to_py(
            py,
            Error::config(
                "trace",
                format!("no {field:?}"),
                "a trace from start_journal/take_journal",
            ),
        )
    })?;
    // Read by value as integers (floats, bools, strings refused), then checked to fit the
    // field's type before the cast: nothing is truncated or wrapped.
    let name = format!("trace.{field}");
    let ints = int64_ndarray(&item, &name, "an array of integers")?;
    let np = py.import("numpy")?;
    if ints.getattr("size")?.extract::<usize>()? > 0 {
        let info = np.call_method1("iinfo", (numpy::dtype::<T>(py),))?;
        let (lo, hi): (i128, i128) = (
            info.getattr("min")?.extract()?,
            info.getattr("max")?.extract()?,
        );
        let min: i128 = ints.call_method0("min")?.extract()?;
        let max: i128 = ints.call_method0("max")?.extract()?;
        if let Some(bad) = [min, max].into_iter().find(|&v| v < lo || v > hi) {
            return Err(to_py(py, Error::out_of_range(name, bad, lo, hi + 1)));
        }
    }
    // (`require`: `ascontiguousarray` keeps an unaligned array as it is.)
    let arr = np.call_method1("require", (ints, numpy::dtype::<T>(py), ("C", "A")))?;
    let a: PyReadonlyArray1<'py, T> = arr.extract().map_err(|_| {
        to_py(
            py,
            Error::config("trace", format!("{field} of another shape"), "1-D arrays"),
        )
    })?;
    Ok(a.as_slice()?.to_vec())
}

fn journal_of(trace: &Bound<'_, PyDict>) -> PyResult<Journal> {
    let py = trace.py();
    let scalar = |f: &str| -> PyResult<u64> {
        let v = trace
            .get_item(f)?
            .ok_or_else(|| to_py(py, Error::config("trace", format!("no {f:?}"), "a trace")))?;
        unsigned(&v, &format!("trace.{f}"))
    };
    let j = Journal {
        ops: array(trace, "ops")?,
        args: array(trace, "args")?,
        flags: array(trace, "flags")?,
        starts: array(trace, "starts")?,
        ns: array(trace, "ns")?,
        version: array(trace, "version")?,
        page: array(trace, "page")?,
        layer: array(trace, "layer")?,
        home: array(trace, "home")?,
        object_bytes: scalar("object_bytes")?,
        device_slots: scalar("device_slots")?,
        ..Default::default()
    };
    j.validate()
        .map_err(|why| to_py(py, Error::config("trace", why, "a consistent journal")))?;
    Ok(j)
}

fn stats_dict<'py>(py: Python<'py>, s: &ReplayStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("budget", s.budget)?;
    d.set_item("feasible", s.feasible)?;
    d.set_item("accesses", s.accesses)?;
    d.set_item("hits", s.hits)?;
    d.set_item("loads", s.loads)?;
    d.set_item("prefetch_loads", s.prefetch_loads)?;
    d.set_item("forced_backups", s.forced_backups)?;
    d.set_item("steps", s.steps)?;
    Ok(d)
}

/// Replays a trace (the dict `ResidencyDirectory.take_journal()` returns, or one loaded from
/// `.npz`) at `budget` device slots under `policy`: `lru` (the directory itself) or `min`
/// (Belady's offline optimum). Returns the counts.
#[pyfunction]
#[pyo3(signature = (trace, budget, policy=None))]
pub fn replay_trace<'py>(
    py: Python<'py>,
    trace: &Bound<'py, PyDict>,
    budget: i64,
    policy: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    contained(|| {
        let policy = match policy {
            Some(p) => string(p, "policy")?,
            None => "lru".to_owned(),
        };
        let budget = u32::try_from(budget)
            .ok()
            .filter(|&b| b >= 1)
            .ok_or_else(|| {
                to_py(
                    py,
                    Error::config("budget", budget, "1 <= budget < 2^32 slots"),
                )
            })?;
        let j = journal_of(trace)?;
        let s = match policy.as_str() {
            "lru" => py.detach(|| replay_lru(&j, budget)).py_err(py)?,
            "min" => py.detach(|| replay_min(&j, budget)).py_err(py)?,
            other => {
                return Err(to_py(
                    py,
                    Error::config("policy", format!("{other:?}"), "lru or min"),
                ))
            }
        };
        stats_dict(py, &s)
    })
}

/// The most objects a trace holds alive at once (a budget at which nothing is evicted).
#[pyfunction]
pub fn trace_peak_live(trace: &Bound<'_, PyDict>) -> PyResult<u64> {
    contained(|| Ok(peak_live(&journal_of(trace)?)))
}
