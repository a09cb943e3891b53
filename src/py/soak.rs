//! `sparsetier._core.run_soak`: the Rust soak loop (`crate::scheduler::soak`) behind
//! `sparsetier soak --engine rust`, reporting to a Python callback as it goes.

use crate::error::Error;
use crate::py::args::int;
use crate::py::error::{contained, to_py, typed_error};
use crate::scheduler::soak::{run, SoakConfig, SoakError, SoakReport};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn report_dict<'py>(py: Python<'py>, r: &SoakReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("requests", r.requests)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("rss_mib", r.rss_mib)?;
    d.set_item("objects", r.objects)?;
    d.set_item("tree_nodes", r.tree_nodes)?;
    d.set_item("finishing", r.finishing)?;
    d.set_item("failed_requests", r.failed_requests)?;
    d.set_item("failed_loads", r.failed_loads)?;
    d.set_item("failed_backups", r.failed_backups)?;
    d.set_item("restores_failed", r.restores_failed)?;
    d.set_item("rows_checked", r.rows_checked)?;
    for (call, l) in &r.latency {
        d.set_item(format!("{call}_p50_us"), l.p50_us)?;
        d.set_item(format!("{call}_p99_us"), l.p99_us)?;
    }
    Ok(d)
}

fn sized<T: TryFrom<i64>>(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    field: &str,
    allowed: &str,
) -> PyResult<T> {
    let v = int(obj, field)?;
    T::try_from(v)
        .ok()
        .filter(|_| v >= 1 || field == "seed")
        .ok_or_else(|| to_py(py, Error::config(field, v, allowed)))
}

/// Runs the joined scheduler's soak in Rust (see `sparsetier.soak`): calls
/// `on_report(dict)` every `every` requests (an exception from it stops the run) and returns
/// every report. Bad sizes raise ConfigError naming the field; a row read back that differs
/// from what was written, or a broken invariant, raises InvariantError naming it.
#[cfg(feature = "testing")]
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (*, requests, concurrent, layers, page_size, device_slots, host_pages,
                    indexer_pages, prompts, steps, faults, every, seed, on_report=None))]
pub fn run_soak<'py>(
    py: Python<'py>,
    requests: &Bound<'py, PyAny>,
    concurrent: &Bound<'py, PyAny>,
    layers: &Bound<'py, PyAny>,
    page_size: &Bound<'py, PyAny>,
    device_slots: &Bound<'py, PyAny>,
    host_pages: &Bound<'py, PyAny>,
    indexer_pages: &Bound<'py, PyAny>,
    prompts: &Bound<'py, PyAny>,
    steps: &Bound<'py, PyAny>,
    faults: f64,
    every: &Bound<'py, PyAny>,
    seed: &Bound<'py, PyAny>,
    on_report: Option<Py<PyAny>>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    contained(|| {
        const U32: &str = "an integer in [1, 2^32)";
        let cfg = SoakConfig {
            requests: sized(py, requests, "requests", "an integer >= 1")?,
            concurrent: sized(py, concurrent, "concurrent", "an integer >= 1")?,
            layers: sized(py, layers, "layers", "an integer in [1, 65536)")?,
            page_size: sized(py, page_size, "page_size", U32)?,
            device_slots: sized(py, device_slots, "device_slots", U32)?,
            host_pages: sized(py, host_pages, "host_pages", U32)?,
            indexer_pages: sized(py, indexer_pages, "indexer_pages", U32)?,
            prompts: sized(py, prompts, "prompts", U32)?,
            steps: sized(py, steps, "steps", U32)?,
            faults,
            every: sized(py, every, "every", "an integer >= 1")?,
            seed: sized(py, seed, "seed", "an integer >= 0")?,
        };
        // The callback's own exception, kept to raise as it was (not as a core error).
        let mut raised: Option<PyErr> = None;
        let out = py.detach(|| {
            run(cfg, |r| {
                let Some(cb) = &on_report else {
                    return Ok(());
                };
                Python::attach(|py| {
                    let res = py
                        .check_signals()
                        .and_then(|()| cb.call1(py, (report_dict(py, r)?,)).map(drop));
                    res.map_err(|e| {
                        raised = Some(e);
                        Error::config("on_report", "raised", "a callback that returns")
                    })
                })
            })
        });
        if let Some(e) = raised {
            return Err(e);
        }
        let reports = match out {
            Ok(r) => r,
            Err(SoakError::Core(e)) => return Err(to_py(py, e)),
            Err(SoakError::Broken(why)) => {
                return Err(typed_error(py, "InvariantError", why, &PyDict::new(py)))
            }
        };
        reports.iter().map(|r| report_dict(py, r)).collect()
    })
}
