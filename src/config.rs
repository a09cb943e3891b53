//! The configuration boundary: what a stack is built with, and what this integration refuses.
//!
//! Strings are parsed into enums here, once. Every refusal is an [`Error::Config`] naming the
//! field, the value given and what is allowed. The limits (no deferred
//! layer loading, no pipeline parallelism, write-through only) are limits of this integration,
//! not of sparse attention.

use crate::error::{Error, Result};
use crate::layout::HostLayout;

/// Which copy engine moves pages between the tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoBackend {
    /// A CUDA copy kernel run on SMs, reading pinned host memory directly.
    Kernel,
    /// The CUDA memcpy API (`cuMemcpyBatchAsync`) over merged segments.
    Direct,
    /// Both tiers in host memory, copies on worker threads.
    Cpu,
}

impl IoBackend {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            IoBackend::Kernel => "kernel",
            IoBackend::Direct => "direct",
            IoBackend::Cpu => "cpu",
        }
    }

    /// Parses an io_backend name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim() {
            "kernel" => Ok(IoBackend::Kernel),
            "direct" => Ok(IoBackend::Direct),
            "cpu" => Ok(IoBackend::Cpu),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "one of kernel, direct, cpu",
            )),
        }
    }

    /// Whether the engine needs CUDA device pools.
    pub const fn needs_cuda(self) -> bool {
        !matches!(self, IoBackend::Cpu)
    }
}

/// When device pages are copied to host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// Every inserted page is backed up to host as soon as it is written.
    WriteThrough,
}

impl WritePolicy {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        "write_through"
    }

    /// Parses a write policy name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim() {
            "write_through" => Ok(WritePolicy::WriteThrough),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "write_through (write_back and write_through_selective are not supported)",
            )),
        }
    }
}

/// The L3 store under the host tier (its pages are written and fetched by a Python backend,
/// planned by the cache: `radix::storage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageKind {
    /// A local directory, one checksummed file per page (embedded, no server).
    File,
    /// Mooncake Store (a master and clients, TCP or RDMA).
    Mooncake,
}

impl StorageKind {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            StorageKind::File => "file",
            StorageKind::Mooncake => "mooncake",
        }
    }

    /// Parses a backend name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim() {
            "file" => Ok(StorageKind::File),
            "mooncake" => Ok(StorageKind::Mooncake),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "None, 'file' or 'mooncake'",
            )),
        }
    }
}

/// How a sidecar pool of a group decides whether a prefix page is a hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HitPolicy {
    /// Every page of the prefix must be present (KV, Indexer-K, draft).
    AllPages,
    /// Only the trailing window of this many tokens must be present (SWA).
    Window(u32),
}

/// How large the host tier is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostBudget {
    /// An absolute budget in bytes for the whole group (`hicache_size`, decimal GB).
    Bytes(u64),
    /// Host pages = device pages x ratio (`hicache_ratio`).
    Ratio(f64),
}

/// The host budget used when neither `hicache_size` nor `hicache_ratio` is given.
pub const DEFAULT_HICACHE_RATIO: f64 = 2.0;

/// A checked stack configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StackConfig {
    /// Tokens per page, shared by every pool.
    pub page_size: u32,
    /// Host budget.
    pub host_budget: HostBudget,
    /// Host pool layout.
    pub layout: HostLayout,
    /// Copy engine.
    pub io_backend: IoBackend,
    /// Backup policy.
    pub write_policy: WritePolicy,
    /// Reserved pages at the front of every device pool (padding target of dummy writes).
    pub device_reserve: u32,
    /// Reserved pages at the front of every host pool.
    pub host_reserve: u32,
    /// The L3 store, if any.
    pub storage_backend: Option<StorageKind>,
}

/// Unchecked builder inputs, as a user or a CLI gives them.
#[derive(Debug, Clone, Copy)]
pub struct RawStackConfig<'a> {
    /// Tokens per page.
    pub page_size: i64,
    /// Host budget in decimal GB, if absolute.
    pub hicache_size: Option<f64>,
    /// Host/device page ratio, if relative.
    pub hicache_ratio: Option<f64>,
    /// Host layout name.
    pub layout: &'a str,
    /// io backend name.
    pub io_backend: &'a str,
    /// Write policy name.
    pub write_policy: &'a str,
    /// L3 storage backend name, if any.
    pub storage_backend: Option<&'a str>,
    /// Deferred loading end layer: must be absent.
    pub load_end_layer: Option<i64>,
    /// Pipeline-parallel size: must be 1.
    pub pp_size: i64,
    /// Reserved device pages.
    pub device_reserve: i64,
    /// Reserved host pages.
    pub host_reserve: i64,
}

impl Default for RawStackConfig<'_> {
    fn default() -> Self {
        RawStackConfig {
            page_size: 64,
            hicache_size: None,
            hicache_ratio: None,
            layout: "layer_first",
            io_backend: "cpu",
            write_policy: "write_through",
            storage_backend: None,
            load_end_layer: None,
            pp_size: 1,
            device_reserve: 1,
            host_reserve: 0,
        }
    }
}

impl RawStackConfig<'_> {
    /// Checks every field and returns the parsed configuration.
    pub fn check(&self) -> Result<StackConfig> {
        let storage_backend = self
            .storage_backend
            .map(|b| StorageKind::parse("storage_backend", b))
            .transpose()?;
        if let Some(layer) = self.load_end_layer {
            return Err(Error::config(
                "load_end_layer",
                layer,
                "None: deferred layer loading is not supported",
            ));
        }
        if self.pp_size != 1 {
            return Err(Error::config(
                "pp_size",
                self.pp_size,
                "1: pipeline parallelism is not supported",
            ));
        }
        let write_policy = WritePolicy::parse("write_policy", self.write_policy)?;
        let layout = HostLayout::parse("layout", self.layout)?;
        let io_backend = IoBackend::parse("io_backend", self.io_backend)?;
        let page_size = positive_u32("page_size", self.page_size)?;
        let device_reserve = non_negative_u32("device_reserve", self.device_reserve)?;
        let host_reserve = non_negative_u32("host_reserve", self.host_reserve)?;
        let host_budget = match (self.hicache_size, self.hicache_ratio) {
            (Some(_), Some(_)) => {
                return Err(Error::config(
                    "hicache_ratio",
                    format!("{:?}", self.hicache_ratio.unwrap_or_default()),
                    "None when hicache_size is set: give one host budget, not both",
                ))
            }
            (Some(gb), None) => {
                // Decimal GB, as the source's configuration does; 1 PB bounds typos.
                if !(gb.is_finite() && gb > 0.0 && gb <= 1e6) {
                    return Err(Error::config(
                        "hicache_size",
                        gb,
                        "a decimal GB figure with 0 < hicache_size <= 1e6",
                    ));
                }
                HostBudget::Bytes((gb * 1e9).floor() as u64)
            }
            (None, Some(r)) => {
                if !(r.is_finite() && r > 0.0 && r <= 1e6) {
                    return Err(Error::config(
                        "hicache_ratio",
                        r,
                        "a finite ratio with 0 < hicache_ratio <= 1e6",
                    ));
                }
                HostBudget::Ratio(r)
            }
            (None, None) => HostBudget::Ratio(DEFAULT_HICACHE_RATIO),
        };
        Ok(StackConfig {
            page_size,
            host_budget,
            layout,
            io_backend,
            write_policy,
            device_reserve,
            host_reserve,
            storage_backend,
        })
    }
}

/// Checks `1 <= v <= u32::MAX`.
pub fn positive_u32(field: &str, v: i64) -> Result<u32> {
    match u32::try_from(v) {
        Ok(x) if x >= 1 => Ok(x),
        _ => Err(Error::config(
            field,
            v,
            format!("an integer with 1 <= {field} <= {}", u32::MAX),
        )),
    }
}

/// Checks `0 <= v <= u32::MAX`.
pub fn non_negative_u32(field: &str, v: i64) -> Result<u32> {
    u32::try_from(v).map_err(|_| {
        Error::config(
            field,
            v,
            format!("an integer with 0 <= {field} <= {}", u32::MAX),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(e: Error) -> String {
        match e {
            Error::Config { field, .. } => field,
            other => panic!("not a config error: {other}"),
        }
    }

    #[test]
    fn each_refusal_names_its_field() {
        let ok = RawStackConfig::default();
        ok.check().unwrap();
        let cases: Vec<(RawStackConfig, &str)> = vec![
            (
                RawStackConfig {
                    storage_backend: Some("s3"),
                    ..ok
                },
                "storage_backend",
            ),
            (
                RawStackConfig {
                    load_end_layer: Some(4),
                    ..ok
                },
                "load_end_layer",
            ),
            (RawStackConfig { pp_size: 2, ..ok }, "pp_size"),
            (
                RawStackConfig {
                    write_policy: "write_back",
                    ..ok
                },
                "write_policy",
            ),
            (
                RawStackConfig {
                    layout: "page_first",
                    ..ok
                },
                "layout",
            ),
            (
                RawStackConfig {
                    io_backend: "nixl",
                    ..ok
                },
                "io_backend",
            ),
            (RawStackConfig { page_size: 0, ..ok }, "page_size"),
            (
                RawStackConfig {
                    page_size: -64,
                    ..ok
                },
                "page_size",
            ),
            (
                RawStackConfig {
                    hicache_size: Some(-1.0),
                    ..ok
                },
                "hicache_size",
            ),
            (
                RawStackConfig {
                    hicache_size: Some(f64::NAN),
                    ..ok
                },
                "hicache_size",
            ),
            (
                RawStackConfig {
                    hicache_ratio: Some(0.0),
                    ..ok
                },
                "hicache_ratio",
            ),
            (
                RawStackConfig {
                    hicache_size: Some(1.0),
                    hicache_ratio: Some(2.0),
                    ..ok
                },
                "hicache_ratio",
            ),
            (
                RawStackConfig {
                    device_reserve: -1,
                    ..ok
                },
                "device_reserve",
            ),
        ];
        for (raw, field) in cases {
            assert_eq!(field_of(raw.check().unwrap_err()), field);
        }
    }

    #[test]
    fn hicache_size_is_decimal_gb() {
        let cfg = RawStackConfig {
            hicache_size: Some(30.0),
            ..Default::default()
        }
        .check()
        .unwrap();
        assert_eq!(cfg.host_budget, HostBudget::Bytes(30_000_000_000));
    }
}
