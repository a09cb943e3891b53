//! Element types, components and buffer layouts.
//!
//! A pool's buffer is a set of planes (K and V for main KV, one K plane for Indexer-K). Each
//! plane holds every layer and every page. Two orders exist for a plane:
//!
//! - [`HostLayout::LayerFirst`]: `[layer][page][token][head][dim]`, what device pools use;
//! - [`HostLayout::LayerPageFirst`]: `[page][layer][token][head][dim]`, a page's layers
//!   contiguous, which makes a whole-page host copy one run of bytes per plane.
//!
//! Planes are stored one after another, so a pool buffer is the tensor
//! `[plane][layer][page][token][head][dim]` (layer-first) or
//! `[plane][page][layer][token][head][dim]` (layer-page-first). All offset arithmetic of the
//! crate goes through [`BufferGeometry`].

use crate::error::{Error, Result};
use crate::row::RowFormat;

/// Element type of a pool. fp8 e4m3 is carried as raw bytes: the runtime never does arithmetic
/// on it, only moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// fp8 e4m3, moved as raw bytes.
    Fp8E4m3,
}

impl Dtype {
    /// Every dtype, in the order error messages list them.
    pub const ALL: [Dtype; 4] = [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::Fp8E4m3];

    /// Bytes per element.
    pub const fn itemsize(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 => 1,
        }
    }

    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
            Dtype::F32 => "fp32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Parses a dtype name; torch spellings (`torch.bfloat16`, `float8_e4m3fn`) are accepted.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        let t = t.strip_prefix("torch.").unwrap_or(&t);
        Ok(match t {
            "bf16" | "bfloat16" => Dtype::Bf16,
            "fp16" | "f16" | "float16" | "half" => Dtype::F16,
            "fp32" | "f32" | "float32" | "float" => Dtype::F32,
            "fp8_e4m3" | "fp8" | "float8_e4m3fn" | "e4m3" => Dtype::Fp8E4m3,
            _ => {
                return Err(Error::config(
                    field,
                    format!("{s:?}"),
                    "one of bf16, fp16, fp32, fp8_e4m3 (torch names accepted)",
                ))
            }
        })
    }
}

/// One kind of cached data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Component {
    /// Main attention KV: the anchor of a pool group.
    Kv,
    /// Indexer-K: one scoring key per token per layer; K only.
    Indexer,
    /// Sliding-window attention KV: only the trailing window is kept.
    Swa,
    /// MTP draft state.
    Draft,
}

impl Component {
    /// Canonical (upper-case) name.
    pub const fn name(self) -> &'static str {
        match self {
            Component::Kv => "KV",
            Component::Indexer => "INDEXER",
            Component::Swa => "SWA",
            Component::Draft => "DRAFT",
        }
    }

    /// Planes per layer unless the caller says otherwise: 1 for K-only Indexer-K, 2 for K/V.
    pub const fn default_planes_per_layer(self) -> u32 {
        match self {
            Component::Indexer => 1,
            Component::Kv | Component::Swa | Component::Draft => 2,
        }
    }

    /// Parses a component name, case-insensitively.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_uppercase().as_str() {
            "KV" => Component::Kv,
            "INDEXER" => Component::Indexer,
            "SWA" => Component::Swa,
            "DRAFT" => Component::Draft,
            _ => {
                return Err(Error::config(
                    field,
                    format!("{s:?}"),
                    "one of KV, INDEXER, SWA, DRAFT",
                ))
            }
        })
    }
}

/// The order of a pool buffer's dimensions inside one plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostLayout {
    /// `[layer][page][token][head][dim]`.
    LayerFirst,
    /// `[page][layer][token][head][dim]`.
    LayerPageFirst,
}

impl HostLayout {
    /// Canonical name.
    pub const fn name(self) -> &'static str {
        match self {
            HostLayout::LayerFirst => "layer_first",
            HostLayout::LayerPageFirst => "layer_page_first",
        }
    }

    /// Parses a layout name.
    pub fn parse(field: &str, s: &str) -> Result<Self> {
        match s.trim() {
            "layer_first" => Ok(HostLayout::LayerFirst),
            "layer_page_first" => Ok(HostLayout::LayerPageFirst),
            _ => Err(Error::config(
                field,
                format!("{s:?}"),
                "one of layer_first, layer_page_first",
            )),
        }
    }
}

/// Byte geometry of one pool buffer in one layout: the only place that does offset arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferGeometry {
    /// Planes per layer (2 for K/V, 1 for K-only).
    pub planes: u64,
    /// Layers.
    pub layers: u64,
    /// Pages in the buffer, reserve pages included.
    pub pages: u64,
    /// Bytes of one token row of one plane of one layer (`heads x head_dim x itemsize`).
    pub token_bytes: u64,
    /// Tokens per page.
    pub page_size: u64,
    /// Dimension order.
    pub layout: HostLayout,
    /// The token row's parts and how a page lays them out.
    pub row: RowFormat,
}

impl BufferGeometry {
    /// Bytes of one page of one plane of one layer.
    pub const fn page_bytes(&self) -> u64 {
        self.token_bytes * self.page_size
    }

    /// Bytes of one plane (every layer, every page).
    pub const fn plane_bytes(&self) -> u64 {
        self.page_bytes() * self.layers * self.pages
    }

    /// Bytes of the whole buffer.
    pub const fn total_bytes(&self) -> u64 {
        self.plane_bytes() * self.planes
    }

    /// Byte offset of the first byte of `page` in (`plane`, `layer`). Arguments are checked.
    pub fn page_offset(&self, plane: u64, layer: u64, page: u64) -> Result<u64> {
        check("plane", plane, self.planes)?;
        check("layer", layer, self.layers)?;
        check("page", page, self.pages)?;
        Ok(self.page_offset_unchecked(plane, layer, page))
    }

    /// Byte offset of token row `token` of `page` in (`plane`, `layer`) (of its first part, in a
    /// split page). Arguments are checked.
    pub fn token_offset(&self, plane: u64, layer: u64, page: u64, token: u64) -> Result<u64> {
        self.part_offset(plane, layer, page, token, 0)
    }

    /// Byte offset of part `part` of token `token`'s row of `page` in (`plane`, `layer`): in a
    /// split page (values, then scales) a token's row is one range per part. Checked.
    pub fn part_offset(
        &self,
        plane: u64,
        layer: u64,
        page: u64,
        token: u64,
        part: u64,
    ) -> Result<u64> {
        check("token", token, self.page_size)?;
        check("part", part, self.row.parts().len() as u64)?;
        Ok(self.page_offset(plane, layer, page)?
            + self.row.part_offset(self.page_size, token, part as usize))
    }

    /// [`Self::page_offset`] without the range checks, for hot loops whose inputs were checked.
    #[inline]
    pub const fn page_offset_unchecked(&self, plane: u64, layer: u64, page: u64) -> u64 {
        let within_plane = match self.layout {
            HostLayout::LayerFirst => layer * self.pages + page,
            HostLayout::LayerPageFirst => page * self.layers + layer,
        };
        plane * self.plane_bytes() + within_plane * self.page_bytes()
    }

    /// Element shape of the buffer as a tensor, outermost first:
    /// `[planes, layers, pages, page_size, heads, head_dim]` or, layer-page-first,
    /// `[planes, pages, layers, page_size, heads, head_dim]`.
    pub fn tensor_shape(&self, heads: u64, head_dim: u64) -> [u64; 6] {
        match self.layout {
            HostLayout::LayerFirst => [
                self.planes,
                self.layers,
                self.pages,
                self.page_size,
                heads,
                head_dim,
            ],
            HostLayout::LayerPageFirst => [
                self.planes,
                self.pages,
                self.layers,
                self.page_size,
                heads,
                head_dim,
            ],
        }
    }
}

fn check(field: &'static str, value: u64, hi: u64) -> Result<()> {
    if value < hi {
        Ok(())
    } else {
        Err(Error::out_of_range(field, value, 0, hi))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(layout: HostLayout) -> BufferGeometry {
        BufferGeometry {
            planes: 2,
            layers: 3,
            pages: 5,
            token_bytes: 8,
            page_size: 4,
            layout,
            row: RowFormat::plain(Dtype::Bf16, 4),
        }
    }

    #[test]
    fn layer_first_offsets_follow_strides() {
        let g = geom(HostLayout::LayerFirst);
        // strides in bytes: plane 480, layer 160, page 32, token 8
        assert_eq!(
            g.token_offset(1, 2, 3, 1).unwrap(),
            480 + 2 * 160 + 3 * 32 + 8
        );
    }

    #[test]
    fn layer_page_first_offsets_follow_strides() {
        let g = geom(HostLayout::LayerPageFirst);
        // strides in bytes: plane 480, page 96, layer 32, token 8
        assert_eq!(
            g.token_offset(1, 2, 3, 1).unwrap(),
            480 + 3 * 96 + 2 * 32 + 8
        );
    }

    #[test]
    fn out_of_range_is_an_error() {
        let g = geom(HostLayout::LayerFirst);
        assert_eq!(
            g.page_offset(0, 3, 0),
            Err(Error::out_of_range("layer", 3, 0, 3))
        );
        assert!(g.token_offset(0, 0, 0, 4).is_err());
        assert!(g.page_offset(2, 0, 0).is_err());
        assert!(g.page_offset(0, 0, 5).is_err());
    }

    #[test]
    fn parse_rejects_unknown_names() {
        assert!(Dtype::parse("dtype", "int8").is_err());
        assert_eq!(
            Dtype::parse("dtype", "torch.bfloat16").unwrap(),
            Dtype::Bf16
        );
        assert!(HostLayout::parse("layout", "page_first").is_err());
        assert_eq!(
            Component::parse("component", "indexer").unwrap(),
            Component::Indexer
        );
    }
}
