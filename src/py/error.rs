//! Maps [`crate::Error`] onto the exception classes of `sparsetier.errors`.
//!
//! The classes are defined in Python so they can inherit from both `SparsetierError` and the
//! builtin that fits (`ValueError`, `MemoryError`); each carries its fields as attributes.

use crate::error::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Builds an instance of `sparsetier.errors.<class>(message, **details)`.
pub fn typed_error(
    py: Python<'_>,
    class: &str,
    message: String,
    details: &Bound<'_, PyDict>,
) -> PyErr {
    let made = ERRORS
        .get_or_try_init(py, || {
            PyModule::import(py, "sparsetier.errors").map(Bound::unbind)
        })
        .and_then(|m| m.bind(py).getattr(class))
        .and_then(|cls| cls.call((message.clone(),), Some(details)));
    match made {
        Ok(instance) => PyErr::from_value(instance),
        // The errors module is part of the package; failing to import it is a broken install.
        Err(e) => PyRuntimeError::new_err(format!(
            "{message} (and sparsetier.errors could not be loaded: {e})"
        )),
    }
}

/// Converts a core error into its typed Python exception.
pub fn to_py(py: Python<'_>, err: Error) -> PyErr {
    let details = PyDict::new(py);
    let message = err.to_string();
    let class = fill(&details, &err).unwrap_or("SparsetierError");
    typed_error(py, class, message, &details)
}

fn fill(d: &Bound<'_, PyDict>, err: &Error) -> Option<&'static str> {
    let set = |k: &str, v: Bound<'_, PyAny>| d.set_item(k, v).ok();
    let py = d.py();
    Some(match err {
        Error::Config {
            field,
            value,
            allowed,
        } => {
            set("field", field.into_pyobject(py).ok()?.into_any())?;
            set("value", value.into_pyobject(py).ok()?.into_any())?;
            set("allowed", allowed.into_pyobject(py).ok()?.into_any())?;
            "ConfigError"
        }
        Error::OutOfRange {
            field,
            value,
            lo,
            hi,
        } => {
            set("field", field.into_pyobject(py).ok()?.into_any())?;
            set("value", value.into_pyobject(py).ok()?.into_any())?;
            set(
                "allowed",
                format!("{lo} <= {field} < {hi}")
                    .into_pyobject(py)
                    .ok()?
                    .into_any(),
            )?;
            "OutOfRangeError"
        }
        Error::OutOfPages {
            requested,
            free,
            capacity,
        } => {
            set("requested", requested.into_pyobject(py).ok()?.into_any())?;
            set("free", free.into_pyobject(py).ok()?.into_any())?;
            set("capacity", capacity.into_pyobject(py).ok()?.into_any())?;
            "OutOfPagesError"
        }
        Error::DoubleFree { page } => {
            set("field", "pages".into_pyobject(py).ok()?.into_any())?;
            set("value", page.into_pyobject(py).ok()?.into_any())?;
            set(
                "allowed",
                "pages currently allocated"
                    .into_pyobject(py)
                    .ok()?
                    .into_any(),
            )?;
            "AllocatorError"
        }
        Error::NotOwned { page, lo, hi } => {
            set("field", "pages".into_pyobject(py).ok()?.into_any())?;
            set("value", page.into_pyobject(py).ok()?.into_any())?;
            set(
                "allowed",
                format!("{lo} <= page < {hi}")
                    .into_pyobject(py)
                    .ok()?
                    .into_any(),
            )?;
            "AllocatorError"
        }
    })
}

/// `Result<T, crate::Error>` into `PyResult<T>`.
pub trait IntoPyResult<T> {
    /// Converts the error, if any.
    fn py_err(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::Result<T> {
    fn py_err(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}
