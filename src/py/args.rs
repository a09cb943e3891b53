//! Argument parsing at the boundary: every Python value becomes a checked Rust value or a
//! `ConfigError` naming the field, so a wrong type or a huge integer never surfaces as a bare
//! `TypeError`/`OverflowError` from deep inside the bindings.

use crate::error::Error;
use crate::py::error::to_py;
use pyo3::prelude::*;
use pyo3::types::PyBool;

/// An integer argument in `i64` range.
pub fn int(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(to_py(
            obj.py(),
            Error::config(field, repr(obj), "an integer, not a bool"),
        ));
    }
    obj.extract::<i64>().map_err(|_| {
        to_py(
            obj.py(),
            Error::config(
                field,
                repr(obj),
                format!("an integer in [{}, {}]", i64::MIN, i64::MAX),
            ),
        )
    })
}

/// An optional integer argument (`None` is absent).
pub fn opt_int(obj: Option<&Bound<'_, PyAny>>, field: &str) -> PyResult<Option<i64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => int(o, field).map(Some),
    }
}

/// An optional float argument (`None` is absent); ints are accepted.
pub fn opt_float(obj: Option<&Bound<'_, PyAny>>, field: &str) -> PyResult<Option<f64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) if o.is_instance_of::<PyBool>() => Err(to_py(
            o.py(),
            Error::config(field, repr(o), "a number, not a bool"),
        )),
        Some(o) => o
            .extract::<f64>()
            .map(Some)
            .map_err(|_| to_py(o.py(), Error::config(field, repr(o), "a number"))),
    }
}

/// A string argument.
pub fn string(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<String> {
    obj.extract::<String>()
        .map_err(|_| to_py(obj.py(), Error::config(field, repr(obj), "a string")))
}

/// An optional string argument (`None` is absent).
pub fn opt_string(obj: Option<&Bound<'_, PyAny>>, field: &str) -> PyResult<Option<String>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => string(o, field).map(Some),
    }
}

/// `repr(obj)`, for error messages.
pub fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "<unprintable>".to_owned())
}
