//! `sparsetier.PoolSpec`: the geometry of one pool.

use crate::error::Error;
use crate::layout::{Component, Dtype, HostLayout};
use crate::pool::PoolSpec;
use crate::py::args::{int, opt_int, string};
use crate::py::error::{contained, to_py, IntoPyResult};
use crate::py::tensor::TensorInfo;
use crate::row::{PageLayout, PartKind, RowPart};
use pyo3::prelude::*;

/// The geometry of one pool: component, layers, planes, heads, head_dim, dtype, page size and
/// page count.
#[pyclass(name = "PoolSpec", module = "sparsetier._core", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyPoolSpec {
    pub inner: PoolSpec,
}

fn u32_arg(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<u32> {
    let v = int(obj, field)?;
    crate::config::positive_u32(field, v).py_err(obj.py())
}

fn layout_arg(obj: &Bound<'_, PyAny>) -> PyResult<HostLayout> {
    HostLayout::parse("layout", &string(obj, "layout")?).py_err(obj.py())
}

/// A non-negative index below `hi`, or an `OutOfRangeError` naming `field`.
fn index_arg(obj: &Bound<'_, PyAny>, field: &'static str, hi: u64) -> PyResult<u64> {
    let v = int(obj, field)?;
    match u64::try_from(v) {
        Ok(x) if x < hi => Ok(x),
        _ => Err(to_py(obj.py(), Error::out_of_range(field, v, 0, hi))),
    }
}

/// `row_parts`: a sequence of `(name, dtype, count)`, e.g. `[("values", "fp8_e4m3", 128),
/// ("scales", "fp32", 1)]`.
fn row_parts_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<RowPart>> {
    let py = obj.py();
    let bad = |field: String, what: String| {
        to_py(
            py,
            Error::config(
                field,
                what,
                "a (name, dtype, count) tuple, e.g. (\"values\", \"fp8_e4m3\", 128)",
            ),
        )
    };
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad("row_parts".into(), crate::py::args::repr(obj)));
    }
    let items: Vec<Bound<'_, PyAny>> = obj
        .try_iter()
        .map_err(|_| bad("row_parts".into(), crate::py::args::repr(obj)))?
        .collect::<PyResult<_>>()?;
    let mut parts = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let field = format!("row_parts[{i}]");
        let t: Vec<Bound<'_, PyAny>> = match item.try_iter() {
            Ok(it) if !item.is_instance_of::<pyo3::types::PyString>() => {
                it.collect::<PyResult<_>>()?
            }
            _ => return Err(bad(field, crate::py::args::repr(item))),
        };
        if t.len() != 3 {
            return Err(bad(field, crate::py::args::repr(item)));
        }
        let kind = PartKind::parse(
            &format!("{field}.name"),
            &string(&t[0], &format!("{field}.name"))?,
        )
        .py_err(py)?;
        let dtype =
            crate::layout::Dtype::parse(&format!("{field}.dtype"), &t[1].str()?.to_string())
                .py_err(py)?;
        let count = int(&t[2], &format!("{field}.count"))?;
        let count = u32::try_from(count)
            .ok()
            .filter(|&c| c >= 1)
            .ok_or_else(|| {
                to_py(
                    py,
                    Error::config(format!("{field}.count"), count, "an integer >= 1"),
                )
            })?;
        parts.push(RowPart { kind, dtype, count });
    }
    Ok(parts)
}

impl PyPoolSpec {
    /// `check_tensor` with a parsed layout, for the other bindings.
    pub fn check_tensor_in(
        &self,
        tensor: &Bound<'_, PyAny>,
        layout: HostLayout,
        device: Option<&str>,
        field: &str,
    ) -> PyResult<()> {
        self.check_tensor(tensor, layout.name(), device, field)
    }

    fn shape_in(&self, layout: HostLayout) -> Vec<u64> {
        let s = &self.inner;
        s.geometry(layout)
            .tensor_shape(u64::from(s.heads), u64::from(s.head_dim))
            .to_vec()
    }
}

#[pymethods]
impl PyPoolSpec {
    #[new]
    #[pyo3(
        signature = (component, layers, heads, head_dim, dtype=None, page_size=None, pages=None, planes_per_layer=None, row_parts=None, page_layout=None),
        text_signature = "(component, layers, heads, head_dim, dtype='bf16', page_size=64, pages=1, planes_per_layer=None, row_parts=None, page_layout=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        component: &Bound<'_, PyAny>,
        layers: &Bound<'_, PyAny>,
        heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: Option<&Bound<'_, PyAny>>,
        page_size: Option<&Bound<'_, PyAny>>,
        pages: Option<&Bound<'_, PyAny>>,
        planes_per_layer: Option<&Bound<'_, PyAny>>,
        row_parts: Option<&Bound<'_, PyAny>>,
        page_layout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        contained(|| {
            let py = component.py();
            let component =
                Component::parse("component", &string(component, "component")?).py_err(py)?;
            let dtype = match dtype {
                Some(d) if !d.is_none() => {
                    Dtype::parse("dtype", &d.str()?.to_string()).py_err(py)?
                }
                _ => Dtype::Bf16,
            };
            let ppl = match opt_int(planes_per_layer, "planes_per_layer")? {
                Some(v) => crate::config::positive_u32("planes_per_layer", v).py_err(py)?,
                None => component.default_planes_per_layer(),
            };
            let page_size = match page_size {
                Some(p) if !p.is_none() => u32_arg(p, "page_size")?,
                _ => 64,
            };
            let pages = match pages {
                Some(p) if !p.is_none() => u32_arg(p, "pages")?,
                _ => 1,
            };
            let inner = PoolSpec::new(
                component,
                u32_arg(layers, "layers")?,
                ppl,
                u32_arg(heads, "heads")?,
                u32_arg(head_dim, "head_dim")?,
                dtype,
                page_size,
                pages,
            )
            .py_err(py)?;
            let layout = match page_layout {
                Some(l) if !l.is_none() => {
                    Some(PageLayout::parse("page_layout", &string(l, "page_layout")?).py_err(py)?)
                }
                _ => None,
            };
            let inner = match row_parts {
                Some(r) if !r.is_none() => inner
                    .with_row(
                        &row_parts_arg(r)?,
                        layout.unwrap_or(PageLayout::Interleaved),
                    )
                    .py_err(py)?,
                _ if layout == Some(PageLayout::ValuesThenScales) => {
                    return Err(to_py(
                        py,
                        Error::config(
                            "page_layout",
                            "values_then_scales",
                            "interleaved, unless row_parts names the parts to split",
                        ),
                    ))
                }
                _ => inner,
            };
            Ok(PyPoolSpec { inner })
        })
    }

    /// A spec read off an existing device pool tensor of shape
    /// `[planes, layers, pages, page_size, heads, head_dim]` (layer-first).
    #[staticmethod]
    #[pyo3(signature = (component, tensor, field="tensor"))]
    fn from_tensor(
        component: &Bound<'_, PyAny>,
        tensor: &Bound<'_, PyAny>,
        field: &str,
    ) -> PyResult<Self> {
        contained(|| {
            let py = tensor.py();
            let component =
                Component::parse("component", &string(component, "component")?).py_err(py)?;
            let info = TensorInfo::inspect(tensor, field)?;
            let dtype = info.pool_dtype(field).py_err(py)?;
            info.require_contiguous(field).py_err(py)?;
            if info.shape.len() != 6 {
                return Err(to_py(
                    py,
                    Error::config(
                        format!("{field}.shape"),
                        format!("{:?}", info.shape),
                        "6 dims: [planes, layers, pages, page_size, heads, head_dim]",
                    ),
                ));
            }
            let dim = |i: usize, name: &str| -> PyResult<u32> {
                u32::try_from(info.shape[i])
                    .ok()
                    .filter(|&v| v >= 1)
                    .ok_or_else(|| {
                        to_py(
                            py,
                            Error::config(
                                format!("{field}.shape[{i}] ({name})"),
                                info.shape[i],
                                format!("1 <= {name} <= {}", u32::MAX),
                            ),
                        )
                    })
            };
            let inner = PoolSpec::new(
                component,
                dim(1, "layers")?,
                dim(0, "planes")?,
                dim(4, "heads")?,
                dim(5, "head_dim")?,
                dtype,
                dim(3, "page_size")?,
                dim(2, "pages")?,
            )
            .map_err(|e| match e {
                Error::Config {
                    field: f,
                    value,
                    allowed,
                } => Error::config(format!("{field}: {f}"), value, allowed),
                other => other,
            })
            .py_err(py)?;
            Ok(PyPoolSpec { inner })
        })
    }

    /// Raises `ConfigError` unless `tensor` is a contiguous buffer of this pool in `layout`,
    /// on a device of type `device` when one is given (`cpu`, `cuda`).
    #[pyo3(signature = (tensor, layout="layer_first", device=None, field="tensor"))]
    fn check_tensor(
        &self,
        tensor: &Bound<'_, PyAny>,
        layout: &str,
        device: Option<&str>,
        field: &str,
    ) -> PyResult<()> {
        contained(|| {
            let py = tensor.py();
            let layout = HostLayout::parse("layout", layout).py_err(py)?;
            let info = TensorInfo::inspect(tensor, field)?;
            if let Some(want) = device {
                if info.device_type != want {
                    return Err(to_py(
                        py,
                        Error::config(
                            format!("{field}.device"),
                            &info.device_type,
                            format!("a {want} tensor"),
                        ),
                    ));
                }
            }
            let dtype = info.pool_dtype(field).py_err(py)?;
            if dtype != self.inner.dtype {
                return Err(to_py(
                    py,
                    Error::config(
                        format!("{field}.dtype"),
                        format!("torch.{}", info.dtype),
                        self.inner.dtype.name(),
                    ),
                ));
            }
            let want = self.shape_in(layout);
            if info.shape != want {
                return Err(to_py(
                    py,
                    Error::config(
                        format!("{field}.shape"),
                        format!("{:?}", info.shape),
                        format!("{want:?}"),
                    ),
                ));
            }
            info.require_contiguous(field).py_err(py)
        })
    }

    /// Tensor shape of the buffer in `layout`.
    #[pyo3(signature = (layout="layer_first"))]
    fn shape(&self, py: Python<'_>, layout: &str) -> PyResult<Vec<u64>> {
        contained(|| {
            let layout = HostLayout::parse("layout", layout).py_err(py)?;
            Ok(self.shape_in(layout))
        })
    }

    /// Byte offset of `page` of (`plane`, `layer`) in a buffer of this pool in `layout`.
    fn page_offset(
        &self,
        layout: &Bound<'_, PyAny>,
        plane: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        page: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        contained(|| {
            let g = self.inner.geometry(layout_arg(layout)?);
            let plane = index_arg(plane, "plane", g.planes)?;
            let layer = index_arg(layer, "layer", g.layers)?;
            let page = index_arg(page, "page", g.pages)?;
            g.page_offset(plane, layer, page).py_err(layout.py())
        })
    }

    /// Byte offset of token row `token` of `page` of (`plane`, `layer`) in `layout` (of its
    /// first part, in a `values_then_scales` page).
    fn token_offset(
        &self,
        layout: &Bound<'_, PyAny>,
        plane: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        page: &Bound<'_, PyAny>,
        token: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        contained(|| {
            let zero = 0u32.into_pyobject(layout.py())?.into_any();
            self.part_offset(layout, plane, layer, page, token, &zero)
        })
    }

    /// Byte offset of part `part` (an index into `row_parts`) of token `token`'s row of
    /// `page` of (`plane`, `layer`) in `layout`: in a `values_then_scales` page a token's
    /// values and scales sit in two places.
    #[allow(clippy::too_many_arguments)]
    fn part_offset(
        &self,
        layout: &Bound<'_, PyAny>,
        plane: &Bound<'_, PyAny>,
        layer: &Bound<'_, PyAny>,
        page: &Bound<'_, PyAny>,
        token: &Bound<'_, PyAny>,
        part: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        contained(|| {
            let g = self.inner.geometry(layout_arg(layout)?);
            let plane = index_arg(plane, "plane", g.planes)?;
            let layer = index_arg(layer, "layer", g.layers)?;
            let page = index_arg(page, "page", g.pages)?;
            let token = index_arg(token, "token", g.page_size)?;
            let part = index_arg(part, "part", self.inner.row.parts().len() as u64)?;
            g.part_offset(plane, layer, page, token, part)
                .py_err(layout.py())
        })
    }

    /// The parts of a token's row: `[{name, dtype, count, bytes}]` (one `values` part for a
    /// plain pool).
    #[getter]
    fn row_parts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        contained(|| {
            self.inner
                .row
                .parts()
                .iter()
                .map(|p| {
                    let d = pyo3::types::PyDict::new(py);
                    d.set_item("name", p.kind.name())?;
                    d.set_item("dtype", p.dtype.name())?;
                    d.set_item("count", p.count)?;
                    d.set_item("bytes", p.bytes())?;
                    Ok(d)
                })
                .collect()
        })
    }

    /// `interleaved` or `values_then_scales`.
    #[getter]
    fn page_layout(&self) -> &'static str {
        self.inner.row.layout().name()
    }

    /// Where token `t`'s row sits in a page: `[(part name, base, bytes)]`, the part at
    /// `base + t * bytes` of the page (one whole-row entry unless the page is split).
    #[getter]
    fn token_pieces(&self) -> Vec<(&'static str, u64, u64)> {
        let row = &self.inner.row;
        let pieces = row.pieces(u64::from(self.inner.page_size));
        if row.is_split() {
            row.parts()
                .iter()
                .zip(pieces)
                .map(|(p, x)| (p.kind.name(), x.base, x.bytes))
                .collect()
        } else {
            vec![("row", pieces[0].base, pieces[0].bytes)]
        }
    }

    /// The same geometry with another page count.
    fn with_pages(&self, pages: &Bound<'_, PyAny>) -> PyResult<Self> {
        contained(|| {
            let n = u32_arg(pages, "pages")?;
            Ok(PyPoolSpec {
                inner: self.inner.with_pages(n).py_err(pages.py())?,
            })
        })
    }

    #[getter]
    fn component(&self) -> &'static str {
        self.inner.component.name()
    }
    #[getter]
    fn layers(&self) -> u32 {
        self.inner.layers
    }
    #[getter]
    fn planes_per_layer(&self) -> u32 {
        self.inner.planes_per_layer
    }
    #[getter]
    fn heads(&self) -> u32 {
        self.inner.heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    #[getter]
    fn itemsize(&self) -> u64 {
        self.inner.dtype.itemsize()
    }
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size
    }
    #[getter]
    fn pages(&self) -> u32 {
        self.inner.pages
    }
    /// Bytes of one token row of one plane of one layer.
    #[getter]
    fn token_bytes(&self) -> u64 {
        self.inner.token_bytes()
    }
    /// Bytes of one token across every plane and layer.
    #[getter]
    fn token_bytes_all_layers(&self) -> u64 {
        self.inner.token_bytes_all_layers()
    }
    /// Bytes of one page of one plane of one layer.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.inner.page_bytes()
    }
    /// Bytes of one page across every plane and layer.
    #[getter]
    fn page_bytes_all_layers(&self) -> u64 {
        self.inner.page_bytes_all_layers()
    }
    /// Bytes of the whole buffer.
    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }
    /// Token slots of the buffer, reserve pages included.
    #[getter]
    fn token_slots(&self) -> u64 {
        self.inner.token_slots()
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        let packed = if s.row.parts().len() > 1 || s.row.is_split() {
            let parts: Vec<String> = s
                .row
                .parts()
                .iter()
                .map(|p| format!("('{}', '{}', {})", p.kind.name(), p.dtype.name(), p.count))
                .collect();
            format!(
                ", row_parts=[{}], page_layout='{}'",
                parts.join(", "),
                s.row.layout().name()
            )
        } else {
            String::new()
        };
        format!(
            "PoolSpec(component='{}', layers={}, heads={}, head_dim={}, dtype='{}', page_size={}, pages={}, planes_per_layer={}{packed})",
            s.component.name(),
            s.layers,
            s.heads,
            s.head_dim,
            s.dtype.name(),
            s.page_size,
            s.pages,
            s.planes_per_layer
        )
    }
}
