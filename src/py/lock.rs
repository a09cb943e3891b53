//! Taking a core lock from Python without blocking other Python threads.
//!
//! The rule (issue 40): no lock of the core is ever waited on with the GIL held, and no
//! Python code runs while one is held. A binding therefore reads and converts its arguments
//! first, then takes the lock with [`Unblocked::run_py`]: at once if it is free, else only
//! after releasing the GIL (so the holder, which may need the GIL, can finish), and builds
//! Python results and exceptions after the lock is released. Closures given here return the
//! core's own `Result` and touch no Python object.

use crate::guard::Guarded;
use crate::py::error::IntoPyResult;
use pyo3::prelude::*;
use std::panic::Location;

/// Runs core calls under a [`Guarded`] lock the GIL never waits on (module docs).
pub trait Unblocked<T> {
    /// Runs `f` on the value; its error becomes the typed exception after the lock is gone.
    fn run_py<R>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> crate::Result<R>) -> PyResult<R>;

    /// [`Self::run_py`] for a call that cannot fail otherwise.
    fn get_py<R>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> R) -> PyResult<R>;
}

impl<T: Send> Unblocked<T> for Guarded<T> {
    #[track_caller]
    fn run_py<R>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> crate::Result<R>) -> PyResult<R> {
        let site = Location::caller();
        let mut f = Some(f);
        loop {
            let call = |v: &mut T| (f.take().expect("runs once"))(v);
            if let Some(r) = self.try_run_at(site, call) {
                return r.py_err(py);
            }
            py.detach(|| self.wait_free());
        }
    }

    #[track_caller]
    fn get_py<R>(&self, py: Python<'_>, f: impl FnOnce(&mut T) -> R) -> PyResult<R> {
        let site = Location::caller();
        let mut f = Some(f);
        loop {
            let call = |v: &mut T| Ok((f.take().expect("runs once"))(v));
            if let Some(r) = self.try_run_at(site, call) {
                return r.py_err(py);
            }
            py.detach(|| self.wait_free());
        }
    }
}
