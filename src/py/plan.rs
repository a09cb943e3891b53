//! `sparsetier.plan_stack`: the builder's checks and the host-budget plan.

use crate::config::{HitPolicy, RawStackConfig, StackConfig};
use crate::error::Error;
use crate::plan::{plan_stack as core_plan, Plan, PoolGroup, PoolPlan, Tier};
use crate::py::args::{opt_float, opt_int, opt_string, string};
use crate::py::error::{contained, to_py, IntoPyResult};
use crate::py::pool::PyPoolSpec;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// One pool on one tier of a plan.
#[pyclass(name = "PoolPlan", module = "sparsetier._core", frozen)]
pub struct PyPoolPlan {
    inner: PoolPlan,
}

#[pymethods]
impl PyPoolPlan {
    /// `KV`, `INDEXER`, `SWA` or `DRAFT`.
    #[getter]
    fn component(&self) -> &'static str {
        self.inner.component.name()
    }
    /// `device` or `host`.
    #[getter]
    fn tier(&self) -> &'static str {
        self.inner.tier.name()
    }
    /// `layer_first` or `layer_page_first` (device pools are always layer-first).
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.layout.name()
    }
    /// `ALL_PAGES` or `WINDOW`.
    #[getter]
    fn hit(&self) -> &'static str {
        match self.inner.hit {
            HitPolicy::AllPages => "ALL_PAGES",
            HitPolicy::Window(_) => "WINDOW",
        }
    }
    /// The SWA window in tokens, or None.
    #[getter]
    fn window(&self) -> Option<u32> {
        match self.inner.hit {
            HitPolicy::AllPages => None,
            HitPolicy::Window(w) => Some(w),
        }
    }
    /// Bytes of one page across every plane and layer.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.page_bytes
    }
    /// Pages of the buffer, reserve included.
    #[getter]
    fn pages(&self) -> u32 {
        self.inner.pages
    }
    /// Reserved pages.
    #[getter]
    fn reserve_pages(&self) -> u32 {
        self.inner.reserve_pages
    }
    /// Logical token capacity (usable pages x page size).
    #[getter]
    fn tokens(&self) -> u64 {
        self.inner.tokens
    }
    /// Actual buffer bytes.
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes
    }
    /// The pool's geometry on this tier.
    #[getter]
    fn spec(&self) -> PyPoolSpec {
        PyPoolSpec {
            inner: self.inner.spec,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "PoolPlan(component='{}', tier='{}', pages={}, tokens={}, bytes={})",
            self.component(),
            self.tier(),
            self.inner.pages,
            self.inner.tokens,
            self.inner.bytes
        )
    }
}

/// The layout of a stack across both tiers, with its checked configuration.
#[pyclass(name = "Plan", module = "sparsetier._core", frozen)]
pub struct PyPlan {
    plan: Plan,
    config: StackConfig,
}

impl PyPlan {
    fn tier_dict<'py>(&self, py: Python<'py>, tier: Tier) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("pages", self.plan.tier_pages(tier))?;
        d.set_item("tokens", self.plan.tier_tokens(tier))?;
        d.set_item("bytes", self.plan.tier_bytes(tier))?;
        Ok(d)
    }
}

#[pymethods]
impl PyPlan {
    /// Device pools then host pools, anchor first within each tier.
    #[getter]
    fn pools(&self) -> Vec<PyPoolPlan> {
        self.plan
            .pools
            .iter()
            .map(|p| PyPoolPlan { inner: *p })
            .collect()
    }
    /// The host budget aimed at, in bytes.
    #[getter]
    fn target_bytes(&self) -> u64 {
        self.plan.target_bytes
    }
    /// The host buffers' real bytes.
    #[getter]
    fn actual_bytes(&self) -> u64 {
        self.plan.actual_bytes
    }
    /// Pages of every device pool of the group.
    #[getter]
    fn device_pages(&self) -> u32 {
        self.plan.tier_pages(Tier::Device)
    }
    /// Pages of every host pool of the group.
    #[getter]
    fn host_pages(&self) -> u32 {
        self.plan.tier_pages(Tier::Host)
    }
    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.config.page_size
    }
    /// Host layout.
    #[getter]
    fn layout(&self) -> &'static str {
        self.config.layout.name()
    }
    /// Copy engine.
    #[getter]
    fn io_backend(&self) -> &'static str {
        self.config.io_backend.name()
    }
    /// Backup policy.
    #[getter]
    fn write_policy(&self) -> &'static str {
        self.config.write_policy.name()
    }
    /// The L3 store under the host tier (None, "file" or "mooncake").
    #[getter]
    fn storage_backend(&self) -> Option<&'static str> {
        self.config.storage_backend.map(|s| s.name())
    }
    /// Reserved pages per device pool.
    #[getter]
    fn device_reserve(&self) -> u32 {
        self.config.device_reserve
    }
    /// Reserved pages per host pool.
    #[getter]
    fn host_reserve(&self) -> u32 {
        self.config.host_reserve
    }

    /// The plan as plain data: `{"pools": [...], "totals": {...}, "budget": {...}}`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        contained(|| {
            let pools = PyList::empty(py);
            for p in &self.plan.pools {
                let d = PyDict::new(py);
                d.set_item("component", p.component.name())?;
                d.set_item("tier", p.tier.name())?;
                d.set_item("layout", p.layout.name())?;
                d.set_item("page_bytes", p.page_bytes)?;
                d.set_item("pages", p.pages)?;
                d.set_item("reserve_pages", p.reserve_pages)?;
                d.set_item("tokens", p.tokens)?;
                d.set_item("bytes", p.bytes)?;
                pools.append(d)?;
            }
            let totals = PyDict::new(py);
            totals.set_item("device", self.tier_dict(py, Tier::Device)?)?;
            totals.set_item("host", self.tier_dict(py, Tier::Host)?)?;
            let budget = PyDict::new(py);
            budget.set_item("target_bytes", self.plan.target_bytes)?;
            budget.set_item("actual_bytes", self.plan.actual_bytes)?;
            let config = PyDict::new(py);
            config.set_item("page_size", self.config.page_size)?;
            config.set_item("layout", self.config.layout.name())?;
            config.set_item("io_backend", self.config.io_backend.name())?;
            config.set_item("write_policy", self.config.write_policy.name())?;
            config.set_item(
                "storage_backend",
                self.config.storage_backend.map(|s| s.name()),
            )?;
            let out = PyDict::new(py);
            out.set_item("pools", pools)?;
            out.set_item("totals", totals)?;
            out.set_item("budget", budget)?;
            out.set_item("config", config)?;
            Ok(out)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(device_pages={}, host_pages={}, target_bytes={}, actual_bytes={})",
            self.device_pages(),
            self.host_pages(),
            self.plan.target_bytes,
            self.plan.actual_bytes
        )
    }
}

/// Checks a stack configuration and plans its pools on both tiers. `pools` lists device pool
/// specs, the KV anchor first. Raises `ConfigError` naming the field for every refusal.
#[pyfunction]
#[pyo3(
    signature = (pools, *, page_size=None, hicache_size=None, hicache_ratio=None, layout=None, io_backend=None, write_policy=None, storage_backend=None, load_end_layer=None, pp_size=None, device_reserve=None, host_reserve=None, swa_window=None),
    text_signature = "(pools, *, page_size=None, hicache_size=None, hicache_ratio=None, layout='layer_first', io_backend='cpu', write_policy='write_through', storage_backend=None, load_end_layer=None, pp_size=1, device_reserve=1, host_reserve=0, swa_window=None)"
)]
#[allow(clippy::too_many_arguments)]
pub fn plan_stack(
    pools: &Bound<'_, PyAny>,
    page_size: Option<&Bound<'_, PyAny>>,
    hicache_size: Option<&Bound<'_, PyAny>>,
    hicache_ratio: Option<&Bound<'_, PyAny>>,
    layout: Option<&Bound<'_, PyAny>>,
    io_backend: Option<&Bound<'_, PyAny>>,
    write_policy: Option<&Bound<'_, PyAny>>,
    storage_backend: Option<&Bound<'_, PyAny>>,
    load_end_layer: Option<&Bound<'_, PyAny>>,
    pp_size: Option<&Bound<'_, PyAny>>,
    device_reserve: Option<&Bound<'_, PyAny>>,
    host_reserve: Option<&Bound<'_, PyAny>>,
    swa_window: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyPlan> {
    contained(|| {
        let py = pools.py();
        let specs = pool_specs(pools)?;
        let str_or = |o: Option<&Bound<'_, PyAny>>, field: &str, d: &str| -> PyResult<String> {
            match o {
                Some(v) if !v.is_none() => string(v, field),
                _ => Ok(d.to_owned()),
            }
        };
        let defaults = RawStackConfig::default();
        let layout = str_or(layout, "layout", defaults.layout)?;
        let io_backend = str_or(io_backend, "io_backend", defaults.io_backend)?;
        let write_policy = str_or(write_policy, "write_policy", defaults.write_policy)?;
        // Any non-None storage backend is refused; a non-string one is shown by its repr.
        let storage_backend = match storage_backend {
            Some(v) if !v.is_none() => Some(
                opt_string(Some(v), "storage_backend")
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| crate::py::args::repr(v)),
            ),
            _ => None,
        };
        let raw = RawStackConfig {
            page_size: match opt_int(page_size, "page_size")? {
                Some(p) => p,
                None => specs
                    .first()
                    .map_or(defaults.page_size, |s| i64::from(s.page_size)),
            },
            hicache_size: opt_float(hicache_size, "hicache_size")?,
            hicache_ratio: opt_float(hicache_ratio, "hicache_ratio")?,
            layout: &layout,
            io_backend: &io_backend,
            write_policy: &write_policy,
            storage_backend: storage_backend.as_deref(),
            load_end_layer: opt_int(load_end_layer, "load_end_layer")?,
            pp_size: opt_int(pp_size, "pp_size")?.unwrap_or(defaults.pp_size),
            device_reserve: opt_int(device_reserve, "device_reserve")?
                .unwrap_or(defaults.device_reserve),
            host_reserve: opt_int(host_reserve, "host_reserve")?.unwrap_or(defaults.host_reserve),
        };
        let config = raw.check().py_err(py)?;
        let window = match opt_int(swa_window, "swa_window")? {
            Some(w) => Some(crate::config::positive_u32("swa_window", w).py_err(py)?),
            None => None,
        };
        let group = PoolGroup::new(&specs, window).py_err(py)?;
        let plan = core_plan(&group, &config).py_err(py)?;
        Ok(PyPlan { plan, config })
    })
}

fn pool_specs(pools: &Bound<'_, PyAny>) -> PyResult<Vec<crate::pool::PoolSpec>> {
    let py = pools.py();
    let bad = |what: String| {
        to_py(
            py,
            Error::config("pools", what, "a list of PoolSpec, KV anchor first"),
        )
    };
    let iter = pools
        .try_iter()
        .map_err(|_| bad(crate::py::args::repr(pools)))?;
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        let item = item?;
        let spec = item.cast::<PyPoolSpec>().map_err(|_| {
            to_py(
                py,
                Error::config(
                    format!("pools[{i}]"),
                    crate::py::args::repr(&item),
                    "a PoolSpec",
                ),
            )
        })?;
        out.push(spec.get().inner);
    }
    Ok(out)
}
