//! What the step scheduler's calls return, as typed objects: a layer plan (`plan`), its counts
//! (`finish`), the step record (`end_step`, `totals`) and an admission (`admit`).
//!
//! Each is a frozen value made after the core's lock is released. Fields are attributes; the
//! objects also read as read-only mappings (`rec["pages"]`, `"pages" in rec`, `rec.keys()`,
//! `dict(rec)`, `rec.to_dict()`), the form these calls returned before.

use crate::ids::LayerPlanId;
use crate::scheduler::{Admission, PlanCounts, StepRecord};
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// A value a result field holds: a count or a rate that may be undefined.
enum Field {
    Count(u64),
    Rate(Option<f64>),
}

impl<'py> IntoPyObject<'py> for Field {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(match self {
            Field::Count(v) => v.into_pyobject(py)?.into_any(),
            Field::Rate(v) => v.into_pyobject(py)?.into_any(),
        })
    }
}

/// A result class's Python methods: `$items` (its own), then the mapping protocol over its
/// `fields()`. One `#[pymethods]` block per class, so the items come in as tokens.
macro_rules! result_methods {
    ($cls:ident { $($items:tt)* }) => {
        #[pymethods]
        impl $cls {
            $($items)*

            fn __getitem__(&self, key: &str) -> PyResult<Field> {
                self.fields()
                    .into_iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| v)
                    .ok_or_else(|| PyKeyError::new_err(key.to_owned()))
            }

            fn __contains__(&self, key: &str) -> bool {
                self.fields().iter().any(|(k, _)| *k == key)
            }

            /// Equal to another result or a dict with the same fields and values.
            fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
                let py = other.py();
                let mine = self.to_dict(py)?;
                if let Ok(o) = other.cast::<$cls>() {
                    return mine.eq(o.get().to_dict(py)?);
                }
                if other.cast::<PyDict>().is_ok() {
                    return mine.eq(other);
                }
                Ok(false)
            }

            fn __len__(&self) -> usize {
                self.fields().len()
            }

            fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                self.keys(py)?.try_iter().map(Bound::into_any)
            }

            /// The field names, in order.
            fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
                PyList::new(py, self.fields().into_iter().map(|(k, _)| k))
            }

            /// `(name, value)` of every field, in order.
            fn items<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
                PyList::new(py, self.fields())
            }

            /// The value of `key`, or `default` when there is no such field.
            #[pyo3(signature = (key, default=None))]
            fn get<'py>(
                &self,
                py: Python<'py>,
                key: &str,
                default: Option<Bound<'py, PyAny>>,
            ) -> PyResult<Bound<'py, PyAny>> {
                match self.fields().into_iter().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.into_pyobject(py),
                    None => Ok(default.unwrap_or_else(|| py.None().into_bound(py))),
                }
            }

            /// The fields as a new dict (for JSON and the like).
            fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                for (k, v) in self.fields() {
                    d.set_item(k, v)?;
                }
                Ok(d)
            }

            fn __repr__(&self) -> String {
                let body: Vec<String> = self
                    .fields()
                    .into_iter()
                    .map(|(k, v)| match v {
                        Field::Count(c) => format!("{k}={c}"),
                        Field::Rate(Some(r)) => format!("{k}={r}"),
                        Field::Rate(None) => format!("{k}=None"),
                    })
                    .collect();
                format!("{}({})", stringify!($cls).trim_start_matches("Py"), body.join(", "))
            }
        }
    };
}

/// A step's record (`end_step`) or the cumulative one (`totals`): every counter of seed 002's
/// record and the scheduler's CPU split, with the derived rates.
#[pyclass(name = "StepRecord", module = "sparsetier._core", frozen)]
pub struct PyStepRecord(StepRecord);

impl PyStepRecord {
    pub(crate) fn new(r: StepRecord) -> Self {
        PyStepRecord(r)
    }

    fn fields(&self) -> Vec<(&'static str, Field)> {
        let r = &self.0;
        let mut v: Vec<(&'static str, Field)> = r
            .pairs()
            .into_iter()
            .map(|(k, c)| (k, Field::Count(c)))
            .collect();
        v.push(("read_amplification", Field::Rate(r.read_amplification())));
        v.push((
            "device_byte_hit_rate",
            Field::Rate(r.device_byte_hit_rate()),
        ));
        v.push(("prefetch_accuracy", Field::Rate(r.prefetch_accuracy())));
        v
    }
}

/// The counters as attributes (the same list `StepRecord::pairs` gives; `tests/test_api.py`
/// checks that every key is an attribute).
macro_rules! record_counters {
    ($($f:ident),* $(,)?) => {
        result_methods!(PyStepRecord {
            $(
                #[getter]
                fn $f(&self) -> u64 {
                    self.0.$f
                }
            )*

            /// Bytes transferred / bytes needed among what was transferred (seed 002); None
            /// when nothing moved.
            #[getter]
            fn read_amplification(&self) -> Option<f64> {
                self.0.read_amplification()
            }

            /// Share of the selected pages already on the device; None when none was selected.
            #[getter]
            fn device_byte_hit_rate(&self) -> Option<f64> {
                self.0.device_byte_hit_rate()
            }

            /// Share of the selected pages prefetch had predicted; None when none was selected.
            #[getter]
            fn prefetch_accuracy(&self) -> Option<f64> {
                self.0.prefetch_accuracy()
            }
        });
    };
}

crate::scheduler::record::all_fields!(record_counters);

/// What one layer plan did, returned by `finish`.
#[pyclass(name = "LayerCounts", module = "sparsetier._core", frozen)]
pub struct PyLayerCounts {
    /// Distinct pages found on the device.
    #[pyo3(get)]
    ready: u64,
    /// Distinct pages loaded from host.
    #[pyo3(get)]
    loaded: u64,
    /// Distinct pages found loading (joined another plan's transfer).
    #[pyo3(get)]
    joined: u64,
    /// Time `ready` waited for this plan's loads, ns.
    #[pyo3(get)]
    exposed_wait_ns: u64,
}

impl PyLayerCounts {
    pub(crate) fn new(c: &PlanCounts) -> Self {
        PyLayerCounts {
            ready: c.ready,
            loaded: c.loaded,
            joined: c.joined,
            exposed_wait_ns: c.exposed_wait_ns,
        }
    }

    fn fields(&self) -> Vec<(&'static str, Field)> {
        vec![
            ("ready", Field::Count(self.ready)),
            ("loaded", Field::Count(self.loaded)),
            ("joined", Field::Count(self.joined)),
            ("exposed_wait_ns", Field::Count(self.exposed_wait_ns)),
        ]
    }
}
result_methods!(PyLayerCounts {});

/// What a joined scheduler's `admit` found: the request starts at `matched_pages * page_size`
/// tokens.
#[pyclass(name = "Admission", module = "sparsetier._core", frozen)]
pub struct PyAdmission {
    /// Whole pages of the prompt matched in the prefix cache.
    #[pyo3(get)]
    matched_pages: u64,
    /// Of those, pages whose Indexer-K was already on the device.
    #[pyo3(get)]
    device_pages: u64,
    /// Pages whose Indexer-K is being restored from host (`wait_prefix` per layer).
    #[pyo3(get)]
    restored_pages: u64,
    /// Main-KV objects of those pages a full restore started loading (0: Indexer-K only).
    #[pyo3(get)]
    full_restore_objects: u64,
}

impl PyAdmission {
    pub(crate) fn new(a: &Admission) -> Self {
        PyAdmission {
            matched_pages: a.matched_pages.into(),
            device_pages: a.device_pages.into(),
            restored_pages: a.restored_pages.into(),
            full_restore_objects: a.full_restore_objects,
        }
    }

    fn fields(&self) -> Vec<(&'static str, Field)> {
        vec![
            ("matched_pages", Field::Count(self.matched_pages)),
            ("device_pages", Field::Count(self.device_pages)),
            ("restored_pages", Field::Count(self.restored_pages)),
            (
                "full_restore_objects",
                Field::Count(self.full_restore_objects),
            ),
        ]
    }
}
result_methods!(PyAdmission {});

/// A layer plan, returned by `plan` and `plan_csr` with its slot table: what `ready` and
/// `finish` take. Only the scheduler that made it knows it.
#[pyclass(name = "LayerPlan", module = "sparsetier._core", frozen)]
pub struct PyLayerPlan {
    id: LayerPlanId,
    /// The layer planned.
    #[pyo3(get)]
    layer: u16,
}

impl PyLayerPlan {
    pub(crate) fn new(id: LayerPlanId, layer: u16) -> Self {
        PyLayerPlan { id, layer }
    }

    pub(crate) fn id(&self) -> LayerPlanId {
        self.id
    }
}

#[pymethods]
impl PyLayerPlan {
    /// The plan's id (unique in the process).
    #[getter(id)]
    fn raw_id(&self) -> u64 {
        self.id.raw()
    }

    fn __repr__(&self) -> String {
        format!("LayerPlan(id={}, layer={})", self.id.raw(), self.layer)
    }
}
