//! Inspection of torch tensors without linking torch: dtype, device, shape, strides and
//! contiguity are read through Python attributes, checked, and only then trusted.

use crate::error::Error;
use crate::layout::Dtype;
use crate::py::args::short;
use crate::py::error::to_py;
use crate::transfer::MemoryKind;
use pyo3::prelude::*;

/// What the bindings know about a tensor after inspecting it.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// torch dtype name without the `torch.` prefix (`bfloat16`, `uint8`, ...).
    pub dtype: String,
    /// `cpu`, `cuda`, ...
    pub device_type: String,
    /// Sizes, outermost first.
    pub shape: Vec<u64>,
    /// `tensor.is_contiguous()`.
    pub contiguous: bool,
}

impl TensorInfo {
    /// Reads a tensor's metadata; anything that is not a tensor is a `ConfigError`.
    pub fn inspect(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Self> {
        let py = obj.py();
        let not_tensor = || to_py(py, Error::config(field, short(obj), "a torch.Tensor"));
        let dtype = obj
            .getattr("dtype")
            .map_err(|_| not_tensor())?
            .str()?
            .to_string();
        let device_type: String = obj
            .getattr("device")
            .and_then(|d| d.getattr("type"))
            .and_then(|t| t.extract())
            .map_err(|_| not_tensor())?;
        let shape: Vec<u64> = obj
            .getattr("shape")
            .and_then(|s| s.extract())
            .map_err(|_| not_tensor())?;
        let contiguous: bool = obj
            .call_method0("is_contiguous")
            .and_then(|c| c.extract())
            .map_err(|_| not_tensor())?;
        Ok(TensorInfo {
            dtype: dtype.trim_start_matches("torch.").to_owned(),
            device_type,
            shape,
            contiguous,
        })
    }

    /// The pool dtype this tensor stores; `uint8` carries fp8 e4m3 as raw bytes.
    pub fn pool_dtype(&self, field: &str) -> Result<Dtype, Error> {
        match self.dtype.as_str() {
            "uint8" => Ok(Dtype::Fp8E4m3),
            other => Dtype::parse(&format!("{field}.dtype"), other).map_err(|_| {
                Error::config(
                    format!("{field}.dtype"),
                    format!("torch.{other}"),
                    "one of torch.bfloat16, torch.float16, torch.float32, \
                     torch.float8_e4m3fn, torch.uint8 (fp8 as raw bytes)",
                )
            }),
        }
    }

    /// Host or device memory, by the tensor's device; other devices are refused.
    pub fn memory_kind(&self, field: &str) -> Result<MemoryKind, Error> {
        match self.device_type.as_str() {
            "cpu" => Ok(MemoryKind::Host),
            "cuda" => Ok(MemoryKind::Device),
            other => Err(Error::config(
                format!("{field}.device"),
                other,
                "a cpu or cuda tensor",
            )),
        }
    }

    /// Refuses a non-contiguous tensor.
    pub fn require_contiguous(&self, field: &str) -> Result<(), Error> {
        if self.contiguous {
            Ok(())
        } else {
            Err(Error::config(
                format!("{field}.is_contiguous()"),
                "False",
                "a contiguous tensor (call .contiguous() first)",
            ))
        }
    }
}
