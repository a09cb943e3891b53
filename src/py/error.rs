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

/// The `field`, `value`, `allowed` attributes most errors carry.
fn field_value_allowed<'py>(
    d: &Bound<'py, PyDict>,
    field: impl IntoPyObject<'py>,
    value: impl IntoPyObject<'py>,
    allowed: impl IntoPyObject<'py>,
) -> PyResult<()> {
    d.set_item("field", field)?;
    d.set_item("value", value)?;
    d.set_item("allowed", allowed)
}

/// Sets the exception's attributes; returns its class name in `sparsetier.errors`.
fn fill(d: &Bound<'_, PyDict>, err: &Error) -> PyResult<&'static str> {
    Ok(match err {
        Error::Config {
            field,
            value,
            allowed,
        } => {
            field_value_allowed(d, field, value, allowed)?;
            "ConfigError"
        }
        Error::OutOfRange {
            field,
            value,
            lo,
            hi,
        } => {
            field_value_allowed(d, field, value, format!("{lo} <= {field} < {hi}"))?;
            "OutOfRangeError"
        }
        Error::OutOfPages {
            requested,
            free,
            capacity,
        } => {
            d.set_item("requested", requested)?;
            d.set_item("free", free)?;
            d.set_item("capacity", capacity)?;
            "OutOfPagesError"
        }
        Error::OutOfSlots {
            tier,
            requested,
            free,
            evictable,
        } => {
            d.set_item("tier", tier)?;
            d.set_item("requested", requested)?;
            d.set_item("free", free)?;
            d.set_item("evictable", evictable)?;
            "OutOfPagesError"
        }
        Error::DoubleFree { page } => {
            field_value_allowed(d, "pages", page, "pages currently allocated")?;
            "AllocatorError"
        }
        Error::NotOwned { page, lo, hi } => {
            field_value_allowed(d, "pages", page, format!("{lo} <= page < {hi}"))?;
            "AllocatorError"
        }
        Error::NotHeld {
            field,
            page,
            held_by,
            allowed,
        } => {
            field_value_allowed(d, field, page, allowed)?;
            d.set_item("held_by", held_by)?;
            "NotHeldError"
        }
        Error::NotResident { key } => {
            d.set_item("key", key)?;
            "NotResidentError"
        }
        Error::KeyExists { key } => {
            d.set_item("key", key)?;
            "KeyExistsError"
        }
        Error::NamespaceDropped { namespace } => {
            d.set_item("namespace", namespace)?;
            "NamespaceDroppedError"
        }
        Error::InvalidTransition { op, key, state } => {
            d.set_item("op", op)?;
            d.set_item("key", key)?;
            d.set_item("state", state)?;
            "InvalidTransitionError"
        }
        Error::UnknownTransfer { id } => {
            d.set_item("field", "transfer_id")?;
            d.set_item("value", id)?;
            d.set_item(
                "allowed",
                "a transfer id this directory issued and still tracks",
            )?;
            "UnknownTransferError"
        }
        Error::TransferState { op, id, state } => {
            d.set_item("op", op)?;
            d.set_item("transfer_id", id)?;
            d.set_item("state", state)?;
            "TransferStateError"
        }
        Error::TransferFailed { id, reason } => {
            d.set_item("transfer_id", id)?;
            d.set_item("reason", reason)?;
            "TransferFailedError"
        }
        Error::WaitTimeout { id, timeout_ms } => {
            d.set_item("transfer_id", id)?;
            d.set_item("timeout_ms", timeout_ms)?;
            "WaitTimeoutError"
        }
        Error::Plan {
            field,
            value,
            allowed,
        } => {
            field_value_allowed(d, field, value, allowed)?;
            "PlanError"
        }
        Error::CopyFailed {
            engine,
            layer,
            reason,
        } => {
            d.set_item("engine", engine)?;
            d.set_item("layer", layer)?;
            d.set_item("reason", reason)?;
            "CopyFailedError"
        }
        Error::CudaUnavailable { what, fix } => {
            d.set_item("what", what)?;
            d.set_item("fix", fix)?;
            "CudaUnavailableError"
        }
        Error::Cuda { call, message } => {
            d.set_item("call", call)?;
            d.set_item("detail", message)?;
            "CudaError"
        }
        Error::UnknownNode { id } => {
            field_value_allowed(
                d,
                "node",
                id,
                "a node id from this cache that is still live",
            )?;
            "UnknownNodeError"
        }
        Error::NotLocked { id } => {
            field_value_allowed(d, "node", id, "a node locked by an earlier lock()")?;
            "NotLockedError"
        }
        Error::UnknownHandle { id } => {
            d.set_item("field", "handle")?;
            d.set_item("value", id)?;
            d.set_item(
                "allowed",
                "a pin handle from resolve that was not yet released",
            )?;
            "UnknownHandleError"
        }
        Error::Internal { site, message } => {
            d.set_item("site", site)?;
            d.set_item("detail", message)?;
            "InternalError"
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

/// Runs a binding's body with a panic inside (a bug) turned into `InternalError` naming the
/// call's site, instead of pyo3's `PanicException` (a `BaseException`). For the bindings
/// that keep no state a panic could break (values, pure functions, one-shot transfers); the
/// stateful owners sit behind a [`crate::guard::Guarded`], which also refuses later calls.
#[track_caller]
pub fn contained<R>(f: impl FnOnce() -> PyResult<R>) -> PyResult<R> {
    let site = std::panic::Location::caller();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let e = Error::Internal {
            site: site.to_string(),
            message: crate::guard::panic_message(payload.as_ref()),
        };
        Err(Python::attach(|py| to_py(py, e)))
    })
}

/// Tests: panics with `message` inside [`contained`], as a bug in a binding would; it must
/// raise `InternalError`.
#[cfg(feature = "testing")]
#[pyfunction]
pub fn contained_panic(message: &str) -> PyResult<()> {
    contained(|| crate::guard::injected_panic(message))
}

/// Warns (`DeprecationWarning`, at the caller's line) that `old` is going in the next release
/// and `new` replaces it.
pub(crate) fn deprecated(py: Python<'_>, old: &str, new: &str) -> PyResult<()> {
    let message =
        format!("sparsetier: {old} is deprecated, use {new}; it goes in the next release");
    let message = std::ffi::CString::new(message).expect("no NUL in a name");
    let category = py.get_type::<pyo3::exceptions::PyDeprecationWarning>();
    PyErr::warn(py, &category, &message, 1)
}
