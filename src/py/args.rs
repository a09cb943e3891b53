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

/// A 1-D int64 array: numpy int64 arrays are borrowed as they are; anything numpy can turn
/// into one (lists, torch CPU tensors, other integer dtypes) is converted. Anything else is a
/// `ConfigError` naming `field` and saying it should be `what`.
pub fn int64_array<'py>(
    obj: &Bound<'py, PyAny>,
    field: &str,
    what: &str,
) -> PyResult<numpy::PyReadonlyArray1<'py, i64>> {
    if let Ok(a) = obj.extract() {
        return Ok(a);
    }
    let py = obj.py();
    let bad = |value: String| {
        to_py(
            py,
            Error::config(field, value, format!("a 1-D array of {what}")),
        )
    };
    let converted = py
        .import("numpy")?
        .call_method1("asarray", (obj, "int64"))
        .map_err(|_| bad(short(obj)))?;
    converted.extract().map_err(|_| {
        let shape = converted
            .getattr("shape")
            .map(|s| s.to_string())
            .unwrap_or_default();
        bad(format!("an array of shape {shape}"))
    })
}

/// `repr(obj)` cut to 60 characters, for error messages.
pub fn short(obj: &Bound<'_, PyAny>) -> String {
    let r = repr(obj);
    if r.chars().count() > 60 {
        format!("{}...", r.chars().take(57).collect::<String>())
    } else {
        r
    }
}
