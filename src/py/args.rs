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

/// An optional raw CUDA stream (`CUstream` as an int, e.g. `torch.cuda.current_stream()
/// .cuda_stream`): None, or an integer from 0 to 2^64 - 1 (never pyo3's `OverflowError`).
pub fn opt_stream(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(o) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    const ALLOWED: &str = "None or a raw CUDA stream: an int in [0, 2^64)";
    let bad = |v: String| to_py(o.py(), Error::config("stream", v, ALLOWED));
    if o.is_instance_of::<PyBool>() {
        return Err(bad(repr(o)));
    }
    let v: i128 = o.extract().map_err(|_| bad(repr(o)))?;
    u64::try_from(v).map(Some).map_err(|_| bad(v.to_string()))
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

/// `obj` as a numpy int64 array of any shape, read by value: numpy arrays, torch CPU tensors,
/// lists and tuples of ints, in any order, strides and byte order. Floats, bools, strings and
/// objects are refused (`ConfigError` naming `field`, allowing `allowed`), as are unsigned
/// values past int64; nothing is truncated or wrapped.
pub fn int64_ndarray<'py>(
    obj: &Bound<'py, PyAny>,
    field: &str,
    allowed: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let bad = |value: String| to_py(py, Error::config(field, value, allowed));
    let np = py.import("numpy")?;
    let as_is = np
        .call_method1("asarray", (obj,))
        .map_err(|_| bad(short(obj)))?;
    let dtype = as_is.getattr("dtype")?;
    let kind: String = dtype.getattr("kind")?.extract()?;
    let size: usize = as_is.getattr("size")?.extract()?;
    if size > 0 && kind != "i" && kind != "u" {
        return Err(bad(format!("{} (an array of {})", short(obj), dtype)));
    }
    if size > 0 && kind == "u" && dtype.getattr("itemsize")?.extract::<usize>()? == 8 {
        let max: u64 = as_is.call_method0("max")?.extract()?;
        if max > i64::MAX as u64 {
            return Err(bad(format!("an unsigned value {max}, past int64")));
        }
    }
    // (`require`, not `ascontiguousarray`: that keeps an unaligned array as it is.)
    np.call_method1("require", (as_is, "int64", ("C", "A")))
        .map_err(|_| bad(short(obj)))
}

/// Whether a numpy array's memory can be read in place as its elements in order: C-ordered
/// and aligned. A strided view (a record array's field, a step other than the item size) or
/// an unaligned buffer is read by value instead.
pub fn in_place(a: &Bound<'_, numpy::PyUntypedArray>) -> bool {
    use numpy::PyUntypedArrayMethods;
    a.is_c_contiguous() && a.is_aligned()
}

/// A 1-D int64 array: native int64 numpy arrays in C order and aligned are borrowed as they are;
/// other integer arrays and sequences (strided or unaligned views, lists, torch CPU tensors, other
/// integer dtypes or byte orders) are converted by value. Floats, bools, strings and unsigned
/// values past int64 are refused, not truncated: anything else is a `ConfigError` naming `field`
/// and saying it should be `what`.
pub fn int64_array<'py>(
    obj: &Bound<'py, PyAny>,
    field: &str,
    what: &str,
) -> PyResult<numpy::PyReadonlyArray1<'py, i64>> {
    use numpy::PyArrayMethods;
    if let Ok(a) = obj.extract::<numpy::PyReadonlyArray1<'py, i64>>() {
        if in_place(a.as_untyped()) {
            return Ok(a);
        }
    }
    let py = obj.py();
    let allowed = format!("a 1-D array of {what}");
    let converted = int64_ndarray(obj, field, &allowed)?;
    converted.extract().map_err(|_| {
        let shape = converted
            .getattr("shape")
            .map(|s| s.to_string())
            .unwrap_or_default();
        to_py(
            py,
            Error::config(field, format!("an array of shape {shape}"), allowed),
        )
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

/// Waits longer than this are waits without a limit (a deadline further off would overflow
/// the clock's arithmetic; about 31 years).
pub const FOREVER_SECONDS: f64 = 1e9;

/// A timeout in seconds: None, or seconds >= 0; beyond [`FOREVER_SECONDS`] (or infinite) it
/// means no limit. NaN and negative values are refused naming `field`.
pub fn timeout(field: &str, t: Option<f64>) -> Result<Option<std::time::Duration>, Error> {
    match t {
        None => Ok(None),
        Some(s) if s >= FOREVER_SECONDS => Ok(None),
        Some(s) if s >= 0.0 => Ok(Some(std::time::Duration::from_secs_f64(s))),
        Some(s) => Err(Error::config(
            field,
            s,
            "None, or seconds >= 0 (inf or beyond 1e9: no limit)",
        )),
    }
}

/// A delay in seconds: 0 to [`FOREVER_SECONDS`]; anything else is refused naming `field`.
#[cfg(feature = "testing")]
pub fn delay(field: &str, s: f64) -> Result<std::time::Duration, Error> {
    if (0.0..=FOREVER_SECONDS).contains(&s) {
        Ok(std::time::Duration::from_secs_f64(s))
    } else {
        Err(Error::config(field, s, "seconds from 0 to 1e9"))
    }
}

/// `obj` itself, or, for a numpy array not in C order (a transpose, Fortran order, a strided
/// view) or not aligned, a C-ordered aligned copy of it: an array is read by value, whatever
/// its strides, never in memory order.
pub fn c_order<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match obj.cast::<numpy::PyUntypedArray>() {
        Ok(a) if !in_place(a) => obj
            .py()
            .import("numpy")?
            .call_method1("require", (obj, obj.py().None(), ("C", "A"))),
        _ => Ok(obj.clone()),
    }
}

/// A count, index or id argument: an integer from 0 to what `T` holds, else a `ConfigError`
/// naming `field` (never pyo3's `OverflowError` for a negative value).
pub fn unsigned<T: TryFrom<i64>>(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<T> {
    let v = int(obj, field)?;
    T::try_from(v).map_err(|_| {
        to_py(
            obj.py(),
            Error::config(
                field,
                v,
                format!("an integer >= 0 that fits a {}", std::any::type_name::<T>()),
            ),
        )
    })
}

/// A 1-D array or sequence of counts (as [`int64_array`] reads it), each from 0 to what `T`
/// holds, else a `ConfigError` naming `field[i]`.
pub fn unsigned_array<T: TryFrom<i64>>(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<T>> {
    let a = int64_array(obj, field, "integers >= 0")?;
    a.as_array()
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            T::try_from(v).map_err(|_| {
                to_py(
                    obj.py(),
                    Error::config(
                        format!("{field}[{i}]"),
                        v,
                        format!("an integer >= 0 that fits a {}", std::any::type_name::<T>()),
                    ),
                )
            })
        })
        .collect()
}
