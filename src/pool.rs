//! Pool geometry: the buffers of one component on one tier.
//!
//! "Same page count" is not "same bytes": a KV page and an Indexer-K page cover the same tokens
//! with different sizes. [`PoolSpec`] keeps the per-token and per-page byte counts apart so
//! budget arithmetic never mixes them.

use crate::error::{Error, Result};
use crate::layout::{BufferGeometry, Component, Dtype, HostLayout};
use crate::row::{PageLayout, RowFormat, RowPart};

/// Largest accepted buffer, in bytes (1 PiB): sizes above it are surely a typo, and the limit
/// keeps every product of the geometry inside `u64`.
pub const MAX_POOL_BYTES: u64 = 1 << 50;

/// The geometry of one pool: what it stores and how many pages it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    /// What kind of cached data the pool holds.
    pub component: Component,
    /// Layers.
    pub layers: u32,
    /// Planes per layer: 2 for K/V, 1 for K-only.
    pub planes_per_layer: u32,
    /// Heads stored (KV heads under GQA, not query heads).
    pub heads: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per page.
    pub page_size: u32,
    /// Pages in the buffer, reserve pages included.
    pub pages: u32,
    /// The token row's parts and page layout: one plain part unless [`Self::with_row`] packs it.
    pub row: RowFormat,
}

impl PoolSpec {
    /// Checks every size and returns the spec. Zero sizes, planes other than 1 or 2, and buffers
    /// larger than [`MAX_POOL_BYTES`] are refused with a [`Error::Config`] naming the field.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        component: Component,
        layers: u32,
        planes_per_layer: u32,
        heads: u32,
        head_dim: u32,
        dtype: Dtype,
        page_size: u32,
        pages: u32,
    ) -> Result<Self> {
        for (field, v) in [
            ("layers", layers),
            ("heads", heads),
            ("head_dim", head_dim),
            ("page_size", page_size),
            ("pages", pages),
        ] {
            if v == 0 {
                return Err(Error::config(field, v, "an integer >= 1"));
            }
        }
        if !(1..=2).contains(&planes_per_layer) {
            return Err(Error::config(
                "planes_per_layer",
                planes_per_layer,
                "1 (K-only) or 2 (K and V)",
            ));
        }
        if u64::from(heads) * u64::from(head_dim) > u64::from(u32::MAX) {
            return Err(Error::config(
                "head_dim",
                head_dim,
                format!("heads x head_dim < 2^32 (heads = {heads})"),
            ));
        }
        let spec = PoolSpec {
            component,
            layers,
            planes_per_layer,
            heads,
            head_dim,
            dtype,
            page_size,
            pages,
            row: RowFormat::plain(dtype, heads.saturating_mul(head_dim)),
        };
        // Every factor up to 2^32: checked in u128 (the u64 products below wrap past it).
        let total = [
            u64::from(heads),
            u64::from(head_dim),
            dtype.itemsize(),
            u64::from(planes_per_layer),
            u64::from(layers),
            u64::from(page_size),
            u64::from(pages),
        ]
        .into_iter()
        .try_fold(1u128, |acc, f| acc.checked_mul(u128::from(f)))
        .unwrap_or(u128::MAX);
        if total > u128::from(MAX_POOL_BYTES) {
            return Err(Error::config(
                "pages",
                pages,
                if total == u128::MAX {
                    format!("a pool of at most {MAX_POOL_BYTES} bytes; this geometry needs 2^128 or more")
                } else {
                    format!("a pool of at most {MAX_POOL_BYTES} bytes; this geometry needs {total} bytes")
                },
            ));
        }
        Ok(spec)
    }

    /// The same geometry (row format included) with another page count.
    pub fn with_pages(&self, pages: u32) -> Result<Self> {
        let spec = PoolSpec::new(
            self.component,
            self.layers,
            self.planes_per_layer,
            self.heads,
            self.head_dim,
            self.dtype,
            self.page_size,
            pages,
        )?;
        Ok(PoolSpec {
            row: self.row,
            ..spec
        })
    }

    /// The same pool with its token row packed as `parts` in `layout` (DeepSeek-V3.2's FP8
    /// rows). The parts must add up to the row's bytes; sizes and transfers are unchanged, only
    /// a token's place in a split page is.
    pub fn with_row(&self, parts: &[RowPart], layout: PageLayout) -> Result<Self> {
        Ok(PoolSpec {
            row: RowFormat::new(parts, layout, self.token_bytes())?,
            ..*self
        })
    }

    /// Bytes of one token row in one plane of one layer: `heads x head_dim x itemsize`.
    pub fn token_bytes(&self) -> u64 {
        u64::from(self.heads) * u64::from(self.head_dim) * self.dtype.itemsize()
    }

    /// Bytes of one token across every plane and layer of the pool.
    pub fn token_bytes_all_layers(&self) -> u64 {
        self.token_bytes() * u64::from(self.planes_per_layer) * u64::from(self.layers)
    }

    /// Bytes of one page in one plane of one layer: what one page copy of one plane moves.
    pub fn page_bytes(&self) -> u64 {
        self.token_bytes() * u64::from(self.page_size)
    }

    /// Bytes of one page across every plane and layer.
    pub fn page_bytes_all_layers(&self) -> u64 {
        self.token_bytes_all_layers() * u64::from(self.page_size)
    }

    /// Bytes of the whole buffer.
    pub fn total_bytes(&self) -> u64 {
        self.page_bytes_all_layers() * u64::from(self.pages)
    }

    /// Token slots the buffer covers, reserve pages included.
    pub fn token_slots(&self) -> u64 {
        u64::from(self.pages) * u64::from(self.page_size)
    }

    /// The buffer geometry of this pool in `layout`.
    pub fn geometry(&self, layout: HostLayout) -> BufferGeometry {
        BufferGeometry {
            planes: u64::from(self.planes_per_layer),
            layers: u64::from(self.layers),
            pages: u64::from(self.pages),
            token_bytes: self.token_bytes(),
            page_size: u64::from(self.page_size),
            layout,
            row: self.row,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_page_sizes_come_out_exactly() {
        // 8 KV heads x 128 dims x 2 planes x bf16 = 4096 B per token; Indexer-K 128 dims bf16.
        let kv = PoolSpec::new(Component::Kv, 1, 2, 8, 128, Dtype::Bf16, 64, 100).unwrap();
        let ik = PoolSpec::new(Component::Indexer, 1, 1, 1, 128, Dtype::Bf16, 64, 100).unwrap();
        assert_eq!(kv.token_bytes_all_layers(), 4096);
        assert_eq!(ik.token_bytes_all_layers(), 256);
        assert_eq!(kv.page_bytes_all_layers(), 256 * 1024);
        assert_eq!(ik.page_bytes_all_layers(), 16 * 1024);
        assert_eq!(kv.token_slots(), 6400);
        assert_eq!(ik.token_slots(), 6400);
    }

    #[test]
    fn indexer_bytes_scale_with_layers() {
        let ik = PoolSpec::new(Component::Indexer, 61, 1, 1, 128, Dtype::Bf16, 64, 1).unwrap();
        assert_eq!(ik.token_bytes_all_layers(), 256 * 61);
    }

    #[test]
    fn zero_and_huge_sizes_are_refused() {
        let e = PoolSpec::new(Component::Kv, 0, 2, 8, 128, Dtype::Bf16, 64, 1).unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "layers"));
        let e = PoolSpec::new(Component::Kv, 1, 3, 8, 128, Dtype::Bf16, 64, 1).unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "planes_per_layer"));
        let e = PoolSpec::new(
            Component::Kv,
            4096,
            2,
            4096,
            4096,
            Dtype::F32,
            4096,
            u32::MAX,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "pages"));
        // 2^16 layers x 2^15 x 2^16 dims x bf16 x 2^16 tokens x 4 pages: 2^66 bytes, which a
        // u64 product wrapped to 0 and let through.
        let e = PoolSpec::new(
            Component::Kv,
            1 << 16,
            1,
            1 << 15,
            1 << 16,
            Dtype::Bf16,
            1 << 16,
            4,
        )
        .unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "pages"));
        // A row of 2^32 elements or more: refused, not saturated.
        let e =
            PoolSpec::new(Component::Kv, 1, 1, 1 << 16, 1 << 16, Dtype::Bf16, 1, 1).unwrap_err();
        assert!(matches!(e, Error::Config { ref field, .. } if field == "head_dim"));
    }
}
