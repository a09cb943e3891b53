//! `sparsetier._core._testing`, built with the `testing` cargo feature only: the hooks tests,
//! the soak and the benchmarks need and a serving engine must not call. The hooks that act on
//! one object are methods of its class under a leading underscore (`_inject_faults`, ...),
//! also compiled with this feature only; `sparsetier.testing` is their Python face.

use pyo3::prelude::*;

/// Adds the `_testing` submodule to `_core`.
pub fn register(core: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = core.py();
    let m = PyModule::new(py, "_testing")?;
    m.add_function(wrap_pyfunction!(crate::py::soak::run_soak, &m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::directory::bench_resolve, &m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::radix::bench_serve, &m)?)?;
    m.add_function(wrap_pyfunction!(crate::py::error::contained_panic, &m)?)?;
    m.add_class::<crate::py::resolve_kernel::PyResolveKernel>()?;
    core.add_submodule(&m)?;
    // `import sparsetier._core._testing` finds it, as a submodule of an extension should.
    py.import("sys")?
        .getattr("modules")?
        .set_item("sparsetier._core._testing", &m)?;
    Ok(())
}
